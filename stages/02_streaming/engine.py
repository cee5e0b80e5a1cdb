"""The engine: the request lifecycle, driven one step at a time.

    add_request --> Scheduler.schedule() --> ModelRunner.execute_model() --> update requests
                    (which tokens run)       (forward + sampling)            (detokenize, stop,
                                                                              free the finished)

`step()` runs one forward and returns the outputs of the requests that got a token. The offline
`LLM` (llm.py) and the async server of later stages both drive this same loop, as vLLM's engine
core is driven. In stage 01 the scheduler runs one request at a time: a prompt's first
step prefills it whole, every later step decodes one token reading the rest from the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from stages.common.devices import resolve_device, resolve_dtype
from stages.common.model_config import ModelConfig
from stages.common.tokenizer import Message, Tokenizer
from stages.common.weights import DEFAULT_MODEL, resolve_model, served_model_name

from .config import EngineConfig
from .engine_views import EngineViews
from .input_processor import InputProcessor, Prompt
from .model_runner import ModelRunner
from .request import FINISH_ABORT, OutputKind, Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerOutput


class LLMEngine(EngineViews):
    """Validates requests (its input processor), then steps them through scheduler and runner."""

    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        started = time.perf_counter()
        self.config = EngineConfig(model=model, **config)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.model_path = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer.from_pretrained(
            self.model_path, extra_eos_ids=self.model_config.eos_token_ids
        )
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        # Resolved once here, so every component reads the same context length from the config.
        self.config = replace(self.config, max_model_len=self.max_model_len)
        self.runner = ModelRunner(
            self.config, self.model_path, self.model_config, self.device, self.dtype
        )
        self.scheduler = Scheduler(self.config)
        self.model_name = served_model_name(self.config.served_model_name, self.config.model)
        self.input_processor = InputProcessor(
            self.config, self.tokenizer, self.model_config.vocab_size
        )
        self._idle = False  # the last step scheduled nothing and resolved nothing
        self.load_seconds = time.perf_counter() - started

    # ----------------------------------------------------------------------- requests
    def make_request(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None = None,
        *,
        messages: Sequence[Message] | None = None,
        request_id: str | None = None,
        output_kind: OutputKind = "cumulative",
    ) -> Request:
        """Tokenize and validate a request (input_processor.py); ValueError if it can't run."""
        return self.input_processor.make_request(
            prompt, params, messages=messages, request_id=request_id, output_kind=output_kind
        )

    # ----------------------------------------------------------------------- step API
    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_progress(self) -> None:
        """Raise if the last step did nothing although requests remain. A step that schedules
        nothing while nothing is in flight leaves every request as it was, so every later step
        would do nothing too: a loop that keeps stepping would spin forever (a livelock)."""
        if not (self._idle and self.has_unfinished()):
            return
        waiting, running = len(self.scheduler.waiting), len(self.scheduler.running)
        raise RuntimeError(
            f"no progress: a step scheduled nothing and nothing is in flight, yet {waiting} "
            f"requests wait and {running} run. The scheduler can fit none of them into a step; "
            "the likely cause is a request larger than one step may take (a prompt over "
            "max_num_batched_tokens under a policy that does not chunk it, such as "
            "scheduling='static'), else a scheduler bug"
        )

    def fail_stuck_request(self) -> tuple[str, RuntimeError] | None:
        """When `check_progress` finds the engine stuck, end the request it cannot place (the
        head of the queue) and return its id and the error, so that the requests behind it get
        their turn; None while the engine progresses. The front ends over an engine loop
        (AsyncLLM from stage 02, an engine core from stage 10) fail that one request this way."""
        try:
            self.check_progress()
        except RuntimeError as exc:
            stuck = (self.waiting or self.running)[0].request_id
            self.abort_request(stuck)
            return stuck, exc
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request early and release what it holds; None if it is not in the engine."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        request.finish(FINISH_ABORT)
        return request.output()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, and return the outputs of the requests that advanced."""
        scheduler_output = self.scheduler.schedule()
        self._idle = not scheduler_output.requests
        sampled = self.runner.execute_model(scheduler_output)
        return self.update_from_output(scheduler_output, sampled)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, int]
    ) -> list[RequestOutput]:
        """Append each sampled token to its request; a request that is done leaves at once.

        Whatever goes wrong with one request's token (detokenizing, a stop check) fails that
        request alone: the others in the step carry on. Every token of the step gets one
        timestamp: the clock is read once a step.
        """
        outputs = []
        now = time.perf_counter()
        requests = self.scheduler.requests
        for scheduled in scheduler_output.requests:
            request = requests.get(scheduled.request_id)
            if request is not None and request.admission_id != scheduled.admission_id:
                request = None  # aborted and its id reused since: not the new one's token
            token = sampled.get(scheduled.request_id)
            if request is None or token is None:  # aborted meanwhile, or nothing sampled
                continue
            try:
                request.append_token(token, now)
            except Exception as exc:
                request.fail(exc)
            if request.finish_reason is not None:
                self.scheduler.finish(request)
            output = request.output()
            if output is not None:
                outputs.append(output)
        return outputs
