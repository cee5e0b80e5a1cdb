"""The scheduler: which requests run in the next forward, and which of their tokens.

Every request carries `num_computed_tokens`, the tokens whose K/V are already in the cache. A
step gives a request `num_tokens - num_computed_tokens` new tokens (vLLM V1's rule): the whole
prompt on its first step, one token per decode step after that. There is no "prefill" or
"decode" in the scheduler's data, only new tokens over a cached context, so later stages add a
recompute after preemption, a prefill chunk, a prefix-cache hit or k+1 speculative tokens
without a new case.

The scheduler's output is plain data (`SchedulerOutput`): ids, token ids, counts, sampling
settings. No tensors, no `Request` objects with their detokenizers, so it can be pickled and sent
to another process (tensor-parallel workers, a disaggregated decode worker) or kept while the
previous step is still running (async scheduling).

Stage 03's policy is static batching over the paged KV pool: when nothing runs, admit
waiting requests in arrival order while the worst case of each (prompt + max_tokens) fits in the
free blocks, then step that batch until its last member ends. Blocks are still handed out only as
tokens arrive (`KVCacheManager.allocate_slots`), but the promise made at admission means the batch
can never run out of them. A request that finishes early frees its blocks at once, yet nobody
takes its seat until the whole batch is done: the idle seats stage 04 fills.
"""

from __future__ import annotations

import itertools
from collections import deque

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .request import Request
from .scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """A waiting queue and one static batch running over a shared KV block pool."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager) -> None:
        self.kv = kv_manager
        self.max_num_seqs = config.max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._finished_ids: list[str] = []
        self._admissions = itertools.count()  # numbers every add(): see Request.admission_id

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.admission_id = next(self._admissions)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        """Pick the step's requests and their new tokens.

        Contract: a scheduled request gets every token it has not computed yet
        (`num_tokens - num_computed_tokens`) with KV slots for all of them, and its
        `num_computed_tokens` moves past them now, before the forward runs. At most
        `max_num_seqs` requests run together.
        """
        if not self.running:
            self._admit_static_batch()
        scheduled = tuple(self._schedule_all_new_tokens(r) for r in self.running)
        return SchedulerOutput(scheduled, self._take_finished_ids())

    def _admit_static_batch(self) -> None:
        """Take waiting requests in arrival order while their worst cases fit in the pool."""
        promised, free = 0, self.kv.num_free_blocks
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            assert request.params.max_tokens is not None
            worst = self.kv.blocks_needed(len(request.prompt_token_ids) + request.params.max_tokens)
            if promised + worst > free:
                break
            promised += worst
            self.running.append(self.waiting.popleft())

    def _schedule_all_new_tokens(self, request: Request) -> ScheduledRequest:
        start, end = request.num_computed_tokens, request.num_tokens
        if not self.kv.allocate_slots(request.request_id, end):  # callers made room first
            raise RuntimeError(f"no KV blocks for {request.request_id}: a scheduling bug")
        request.num_computed_tokens = end
        return ScheduledRequest(
            request_id=request.request_id,
            admission_id=request.admission_id,
            token_ids=tuple(request.token_ids_between(start, end)),
            num_computed_tokens=start,
            params=request.params,
            seed=request.seed,
            sample=True,
            block_ids=tuple(self.kv.block_ids(request.request_id)),
        )

    def _take_finished_ids(self) -> tuple[str, ...]:
        finished, self._finished_ids = tuple(self._finished_ids), []
        return finished

    def finish(self, request: Request) -> None:
        """A request is done: it leaves the batch and its blocks go back at once."""
        self._remove(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is, freeing its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self._remove(request)
        return request

    def _remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it, for good, and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
