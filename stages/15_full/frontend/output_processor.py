"""The front end's half of a request: token ids from an engine core become text and outputs.

An engine core (frontend/engine_core.py) samples tokens and stops on EOS, stop token ids and
max_tokens; it never sees text. Detokenizing and stop strings live here, in the front end's process,
as in vLLM V1 (`OutputProcessor`, `IncrementalDetokenizer`): the core's loop spends no time on text,
and the replicas need no tokenizer.

Each request keeps the front end's own `Request` (request.py): its prompt ids, its incremental
detokenizer, its stop strings, its output kind and its timings. The core's new token ids are
appended to it with the same `append_token` the in-process engine uses, so the text, the
stop-string cut (even across tokens), the held-back text of a stream and the `RequestOutput`s
are those of stage 09. When a stop string ends a request the core does not know about it: its
id is returned in `ids_to_abort`, and the caller tells the core to drop it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from ..request import FINISH_ABORT, FINISH_ERROR, Request, RequestOutput
from .core_messages import EngineCoreOutput, EngineCoreRequest


@dataclass
class ProcessedOutputs:
    """What one batch of core outputs gave: outputs to deliver, and requests the front end
    finished that the core still runs (a stop string completed)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    ids_to_abort: list[str] = field(default_factory=list)


def core_request(request: Request) -> EngineCoreRequest:
    """The message for an engine core: token ids, the resolved seed, no stop strings."""
    params = replace(request.params, stop=(), seed=request.seed)
    return EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        params=params,
        cache_salt=request.cache_salt,
        arrival_time=request.arrival_time,
    )


class OutputProcessor:
    """Per-request detokenizing and stop strings, for requests whose tokens come from a core."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> EngineCoreRequest:
        """Track a request (made by the front end's InputProcessor); returns its core message."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        return core_request(request)

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        """Append each output's tokens to its request and build its `RequestOutput`. Outputs
        of requests no longer tracked (aborted, or stopped here already) are dropped."""
        result = ProcessedOutputs()
        for core_output in outputs:
            request = self.requests.get(core_output.request_id)
            if request is None:
                continue
            request.num_cached_tokens = core_output.num_cached_tokens
            request.events.extend(core_output.events)  # the core's scheduler events (stage 15)
            try:
                now = time.perf_counter()  # one iteration: its tokens arrive together
                for token in core_output.new_token_ids:
                    request.append_token(token, now)
                    if request.finished:  # a stop string (or a check the core also made)
                        break
            except Exception as exc:  # detokenizing failed: this request alone
                request.fail(exc)
            if not request.finished and core_output.finish_reason is not None:
                if core_output.finish_reason == FINISH_ERROR:
                    request.fail(core_output.error or "the engine core failed the request")
                else:
                    request.finish(core_output.finish_reason)
            if request.finished and core_output.finish_reason is None:
                result.ids_to_abort.append(request.request_id)  # the core still runs it
            output = request.output()
            if output is not None:
                result.request_outputs.append(output)
            if request.finished:
                del self.requests[request.request_id]
        return result

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop tracking a request; its final output ends "abort" (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.finish(FINISH_ABORT)
        return request.output()

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with an error (its replica died); None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.fail(error)
        return request.output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)


__all__ = ["OutputProcessor", "ProcessedOutputs", "core_request"]
