"""The offline API, vLLM's: ``LLM(model).generate(prompts, params)`` and ``LLM.chat``.

It drives the engine's step loop (engine.py) until the submitted requests are done. If anything
interrupts the loop (an exception, a Ctrl-C in a notebook), the requests it submitted are
aborted, so they never linger in the engine holding memory.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence

from stages.common.tokenizer import Message

from .engine import LLMEngine, Prompt
from .request import Request, RequestOutput
from .sampling import SamplingParams, sampling_params_list


class LLM(LLMEngine):
    """Offline inference engine with vLLM's interface."""

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params_list(sampling_params, len(prompt_list))
        requests = [
            self.make_request(p, sp, output_kind="final")
            for p, sp in zip(prompt_list, params, strict=True)
        ]
        return self.run_all(requests)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        params = sampling_params_list(sampling_params, len(conversations))
        requests = [
            self.make_request(None, sp, messages=messages, output_kind="final")  # type: ignore[arg-type]
            for messages, sp in zip(conversations, params, strict=True)
        ]
        return self.run_all(requests)

    def run_all(self, requests: Sequence[Request]) -> list[RequestOutput]:
        """Submit every request, step until all are done, return their outputs in order.

        On any exception, the requests not yet finished are aborted before it propagates; a
        step that schedules nothing while nothing is in flight raises RuntimeError
        (`check_progress`) instead of stepping forever.
        """
        try:
            for request in requests:
                self.add_request(request)
            while any(not r.finished for r in requests):
                self.step()
                self.check_progress()  # a step that can never do anything raises, not spins
        finally:
            for request in requests:
                if not request.finished:
                    self.abort_request(request.request_id)
        return [request.final_output() for request in requests]

    def run(self, request: Request) -> RequestOutput:
        """Generate one request to completion and return its final output."""
        return self.run_all([request])[0]

    def stream(self, request: Request) -> Iterator[RequestOutput]:
        """Generate one request, yielding its output each time it gets a token (in the
        request's output kind). Closing the iterator early aborts the request."""
        if request.output_kind == "final":  # a stream shows every token
            request.output_kind = "cumulative"
        self.add_request(request)
        try:
            while not request.finished:
                for output in self.step():
                    if output.request_id == request.request_id:
                        yield output
                self.check_progress()
        finally:
            if not request.finished:
                self.abort_request(request.request_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(p, numbers.Integral) for p in prompts):  # one prompt as token ids
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]
