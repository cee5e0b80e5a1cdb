"""The engine: the request lifecycle, driven one step at a time.

    add_request --> Scheduler.schedule() --> ModelRunner.execute_model() --> update requests
                    (which tokens run)       (forward + sampling)            (detokenize, stop,
                                                                              free the finished)

`step()` runs one forward and returns the outputs of the requests that got a token. The offline
`LLM` (llm.py) and the async server of later stages both drive this same loop, as vLLM's engine
core is driven. From stage 03 on, requests share one pool of KV blocks: the model runner sizes it
from a memory budget, the scheduler's `KVCacheManager` hands its blocks out, and the context is
clamped to what the whole pool holds, so every request the engine accepts can run.

Async scheduling (stage 05): `step` launches the next forward before it processes the previous
one's tokens, so scheduling, input preparation, detokenization, stop checks and streaming run while
the model computes, instead of between forwards.

Prefix caching (stage 07) lives in the scheduler and the KV cache manager; here it passes on the
`cache_salt` of a request (checked in input_processor.py) and reports the aggregate hit rate
(`prefix_cache_stats`).

Tensor parallelism (stage 09): the model runs through an executor (parallel/executor.py), in this
process or across `tensor_parallel_size` ranks; the engine sends it each step's scheduler output and
gets rank 0's tokens back. `shutdown` stops the ranks' processes.

Speculative decoding (stage 08): after a step, each running request gets drafts for the next one
(`_propose`); `update_from_output` appends the accepted drafts and the token after them, and rolls
back the positions of the rejected ones. Steps then run synchronously (stage 15: only those that
may get drafts, with `speculative_disable_batch_size`). The n-gram drafter indexes each request's
tokens as they arrive, so proposing costs O(new tokens) a step.

A KV connector (stage 12: the host tier, offload/connector.py; stage 13: the transfer to another
engine of a prefill/decode pair) plugs in through the methods kv_connector/engine_side.py gives
`LLMEngine`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from stages.common.devices import default_max_num_seqs, resolve_device, resolve_dtype
from stages.common.model_config import ModelConfig
from stages.common.tokenizer import Message, Tokenizer
from stages.common.weights import DEFAULT_MODEL, resolve_model, served_model_name

from .config import EngineConfig, with_device_defaults
from .config_checks import check_checkpoint, check_one_engine
from .engine_views import EngineViews
from .input_processor import InputProcessor, Prompt
from .kv_cache import KVCacheManager
from .kv_connector.engine_side import KVConnectorEngineMixin, has_work
from .model_runner import StepHandle
from .observability.live_view import StepWatcher
from .parallel.executor import make_executor
from .request import FINISH_ABORT, OutputKind, Request, RequestOutput
from .sampling import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .spec_decode.drafters import DRAFT, NgramProposer, SpecDecodeStats

logger = logging.getLogger(__name__)


class LLMEngine(EngineViews, KVConnectorEngineMixin):
    """Validates requests (its input processor), then steps them through scheduler and runner."""

    def __init__(self, model: str = DEFAULT_MODEL, **config: Any) -> None:
        started = time.perf_counter()
        self.config = EngineConfig(model=model, **config)
        check_one_engine(self.config)
        config = self.config
        if config.speculative and config.speculative_disable_batch_size is None:
            # Drafts need the step's accepted tokens on the host before the next step is
            # scheduled: speculation runs steps one at a time (vLLM V1 began the same way).
            # With speculative_disable_batch_size only the steps that may draft do (`_step`).
            self.config = replace(config, async_scheduling=False)
        self.device = resolve_device(self.config.device)
        self.config = with_device_defaults(self.config, self.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.model_path = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        check_checkpoint(self.config, self.model_config.num_experts)
        self.tokenizer = Tokenizer.from_pretrained(
            self.model_path, extra_eos_ids=self.model_config.eos_token_ids
        )
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        length, seats = self.max_model_len, self._seats()  # resolved once: read by every part
        self.config = replace(self.config, max_model_len=length, max_num_seqs=seats)
        self.executor = make_executor(
            self.config, self.model_path, self.model_config, self.device, self.dtype
        )
        self.runner = self.executor.driver  # rank 0's runner, in this process
        # quantization="auto": what the loader chose for these weights here (quant/auto.py)
        self.weight_format = self.runner.model.weight_format
        if self.weight_format is not None:
            logger.info("quantization auto: %s", self.weight_format.describe())
        self._fit_context_to_pool()
        self.kv_manager = KVCacheManager(
            self.runner.num_blocks,
            self.runner.block_size,
            self.config.prefix_caching,
            kv_events=self.config.kv_events,
            record_evictions=bool(self.config.kv_offload_bytes) and self.config.prefix_caching,
        )
        self.kv_connector = self._make_kv_connector()
        self.scheduler = Scheduler(self.config, self.kv_manager, self.kv_connector)
        self.model_name = served_model_name(self.config.served_model_name, self.config.model)
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None  # async: step t
        self.input_processor = InputProcessor(
            self.config, self.tokenizer, self.model_config.vocab_size
        )
        self.spec_stats = SpecDecodeStats()
        self.ngram = (
            NgramProposer(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            if self.config.speculative == "ngram"
            else None
        )
        self._idle = False  # the last step scheduled nothing and resolved nothing
        self.watcher: StepWatcher | None = None  # the live view (15): None while unwatched
        self.last_scheduled: SchedulerOutput | None = None  # the newest step's batch
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
        cache_salt: str | None = None,
    ) -> Request:
        """Tokenize and validate a request (input_processor.py); ValueError if it can't run.

        Requests with different `cache_salt`s never share prefix-cache blocks (say, one salt
        per tenant); requests without one share with each other."""
        return self.input_processor.make_request(
            prompt,
            params,
            messages=messages,
            request_id=request_id,
            output_kind=output_kind,
            cache_salt=cache_salt,
        )

    def _seats(self) -> int:
        """`max_num_seqs`, or else the device's default: a CPU's decode step grows with the
        batch, so it gets fewer seats than a GPU (`devices.py` says what was measured)."""
        return self.config.max_num_seqs or default_max_num_seqs(self.device)

    def _fit_context_to_pool(self) -> None:
        """A context longer than the whole pool could never be used: clamp it, and say so."""
        pool_tokens = self.runner.num_blocks * self.runner.block_size
        if pool_tokens < self.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, less than max_model_len %d: the context is "
                "clamped to %d tokens (give it more memory with kv_cache_bytes)",
                pool_tokens, self.max_model_len, pool_tokens,
            )  # fmt: skip
            self.max_model_len = pool_tokens
            self.config = replace(self.config, max_model_len=pool_tokens)

    # ----------------------------------------------------------------------- step API
    def add_request(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_progress(self) -> None:
        """Raise if the last step did nothing although requests remain. A step that schedules
        nothing while nothing is in flight leaves every request as it was, so every later step
        would do nothing too: a loop that keeps stepping would spin forever (a livelock). A
        request waiting for a transfer from another engine is no livelock: the transfer ends,
        one way or the other, by its deadline."""
        if not (self._idle and self.has_unfinished()) or self.scheduler.loading:
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
        self._forget_drafts(request_id)
        request.finish(FINISH_ABORT)
        return request.output()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, and return the outputs of the requests that advanced.

        With `async_scheduling`, a step launches step t+1 and then resolves step t (queue depth
        2): the host schedules, prepares and post-processes while the model runs. The outputs
        returned are step t's. Once no request is left, the step still in flight is waited for
        and dropped.

        `_idle` must say whether this step did nothing: it scheduled no request AND resolved
        no step in flight. `check_progress` raises on an idle step while requests remain (a
        livelock), so a step that only collects the one in flight is not idle. Nor is a step
        that preempted: it admits no one (as vLLM's scheduler), so a running request that gave
        way to a waiting one holding blocks (a KV load) schedules nothing, and the next step
        goes on (stage 12). Once no request is left, the host tier's transfers still in
        flight are settled (`_settle_kv_transfers`). A watched engine ends it with a view."""
        outputs = self._step()
        self._settle_kv_transfers()
        if (watcher := self.watcher) is not None:  # read once: it may be switched off now
            watcher.stepped(self)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step as `step` describes it, before any settling.

        Speculation with `speculative_disable_batch_size` (stage 15) switches between the two
        ways per step: a step that may get drafts (the batch at most that size) runs alone,
        after the step in flight is resolved (a step that only resolves it); a step above it
        gets no drafts and overlaps the one before, as without speculation."""
        drafting = self.config.speculative is not None and self.scheduler.drafting
        if self.config.async_scheduling and drafting and self._in_flight is not None:
            return self._resolve_in_flight()
        preemptions = self.scheduler.num_preemptions
        if not self.config.async_scheduling or drafting:
            scheduler_output = self.last_scheduled = self.scheduler.schedule()
            preempted = self.scheduler.num_preemptions != preemptions
            self._idle = not has_work(scheduler_output) and not preempted
            sampled = self.executor.execute_model(scheduler_output)
            failed = self._poll_connector()
            return self.update_from_output(scheduler_output, sampled) + failed
        self.scheduler.drafts_allowed = False  # drafts proposed before step t: stale
        scheduler_output = self.last_scheduled = self.scheduler.schedule()  # t+1; t may run
        self.scheduler.drafts_allowed = True
        preempted = self.scheduler.num_preemptions != preemptions
        self._idle = not has_work(scheduler_output) and self._in_flight is None and not preempted
        launched = None
        if has_work(scheduler_output):
            launched = (scheduler_output, self.executor.launch(scheduler_output))
        previous, self._in_flight = self._in_flight, None
        outputs = []
        if previous is not None:
            sampled = previous[1].result()
            failed = self._poll_connector()
            outputs = self.update_from_output(previous[0], sampled) + failed
        if launched is not None and not self.scheduler.has_unfinished():
            launched[1].result()  # every request it holds is done: wait, drop its tokens
            outputs += self._poll_connector()
            launched = None
        elif previous is None and launched is None:  # transfers between engines run on
            outputs += self._poll_connector()
        self._in_flight = launched
        return outputs

    def _resolve_in_flight(self) -> list[RequestOutput]:
        """Wait for the step in flight and take its outputs, launching nothing: the next step
        is scheduled from every token on the host (its drafts need them)."""
        assert self._in_flight is not None
        (scheduler_output, handle), self._in_flight = self._in_flight, None
        self._idle = False
        sampled = handle.result()
        failed = self._poll_connector()
        return self.update_from_output(scheduler_output, sampled) + failed

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[RequestOutput]:
        """Append each request's new tokens; a request that is done leaves at once.

        With speculative decoding a request gets its accepted drafts and one more token: the
        positions of the rejected drafts are rolled back (`Scheduler.rollback`), and the next
        drafts are proposed (`_propose`, into `spec_token_ids`) for a request still running.
        A stop inside the accepted drafts ends the request there. `spec_stats.record(drafts,
        accepted)` counts each step's drafts and the ones accepted: the extra token after them
        is no accepted draft. Each request's token in flight has landed: one placeholder fewer.
        Whatever goes wrong with one request's tokens (detokenizing, a stop check) fails that
        request alone: the others in the step carry on. Every token of the step gets one
        timestamp, and a running request whose output kind is "final" is not asked for an
        output: both run once per request per step.
        """
        outputs = []
        unfinished, speculative = self.scheduler.requests, self.config.speculative
        now = time.perf_counter()  # one iteration: its tokens arrive together
        for scheduled in scheduler_output.requests:
            request = unfinished.get(scheduled.request_id)
            if request is not None and request.admission_id != scheduled.admission_id:
                request = None  # aborted and its id reused since: not the new one's token
            tokens = sampled.get(scheduled.request_id)
            if request is None or tokens is None:  # finished or aborted meanwhile: dropped
                continue
            request.num_output_placeholders -= 1  # the token in flight has landed
            drafts = scheduled.num_draft_tokens
            if drafts:
                accepted = len(tokens) - 1
                self.spec_stats.record(drafts, accepted)
                self.scheduler.rollback(request, drafts - accepted)
            try:
                for token in tokens:
                    request.append_token(token, now)
                    if request.finished:  # a stop inside the accepted drafts ends it there
                        break
                if speculative and not request.finished:
                    request.spec_token_ids = self._propose(request)
            except Exception as exc:
                request.fail(exc)
            if request.finish_reason is not None:
                self.scheduler.finish(request)
                self._forget_drafts(request.request_id)
            elif request.output_kind == "final":  # nothing to report before its end
                continue
            output = request.output()
            if output is not None:
                outputs.append(output)
        return outputs

    def _propose(self, request: Request) -> list[int]:
        """The next step's drafts: at most k, and never past max_tokens (the step emits one
        token more than it accepts)."""
        assert request.params.max_tokens is not None
        room = request.params.max_tokens - len(request.output_token_ids) - 1
        k = min(self.config.num_speculative_tokens, room)
        if k <= 0:
            return []
        if self.ngram is not None:  # index only the tokens new since its last proposal
            request_id, seen = request.request_id, self.ngram.num_tokens(request.request_id)
            self.ngram.extend(request_id, request.token_ids_between(seen, request.num_tokens))
            return self.ngram.propose_for(request_id, k)
        return [DRAFT] * k  # the draft model writes them on the device, in the step

    def _forget_drafts(self, request_id: str) -> None:
        """The request left: the n-gram drafter drops its index (the id may come back)."""
        if self.ngram is not None:
            self.ngram.forget(request_id)
