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

Static batching (stage 03) fixes a batch and runs it until its last member ends: a request that
finishes early leaves an idle seat, and a request that arrives meanwhile waits for the whole
batch. Continuous batching (Orca's iteration-level scheduling, as vLLM does it) decides again at
every step, under a token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`):

    1. running requests first, oldest first, each with its new tokens. When the block pool is
       full, the newest running request is *preempted*: its blocks are freed, its
       `num_computed_tokens` drops to 0 and it goes back to the front of the waiting queue, to be
       recomputed from its tokens later (a recompute is just more new tokens);
    2. then waiting requests join, in arrival order, while seats, tokens and free blocks allow
       (none in a step that preempted);
    3. finished requests leave at once (`finish`), so their blocks serve the next step.

`scheduling="static"` keeps stage 03's policy, for comparison.
"""

from __future__ import annotations

import itertools
from collections import deque

from .config import EngineConfig
from .kv_cache import KVCacheManager
from .request import Request
from .scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Waiting and running queues over one KV block pool, decided again at every step."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager) -> None:
        assert config.max_model_len is not None  # the engine resolves it
        self.kv = kv_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(
            2048, config.max_model_len
        )
        if self.max_num_batched_tokens < config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({config.max_model_len}): a whole prompt runs in one forward"
            )
        self.policy = config.scheduling
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._finished_ids: list[str] = []
        self._admissions = itertools.count()  # numbers every add(): see Request.admission_id
        self.num_preemptions = 0

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
        `num_computed_tokens` moves past them now, before the forward runs. The step holds at
        most `max_num_seqs` requests and `max_num_batched_tokens` tokens. A preempted request
        holds no blocks, has `num_computed_tokens == 0` and waits at the front of the queue.
        """
        if self.policy == "static":
            if not self.running:
                self._admit_static_batch()
            for request in self.running:
                self._allocate_promised(request, request.num_tokens)
            scheduled = [self._schedule_all_new_tokens(r, r.num_tokens) for r in self.running]
        else:
            scheduled, budget, preempted = self._schedule_running()
            if not preempted:
                scheduled += self._admit_waiting(budget)
        return SchedulerOutput(tuple(scheduled), self._take_finished_ids())

    def _schedule_running(self) -> tuple[list[ScheduledRequest], int, bool]:
        """Each running request's new tokens, oldest first; preempt the newest when blocks run
        out. Returns the scheduled requests, the token budget they leave, and whether anyone
        was preempted."""
        scheduled: list[ScheduledRequest] = []
        preempted = False
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running):
            request = self.running[index]
            end = request.num_tokens
            if self.kv.allocate_slots(request.request_id, end):
                step = self._schedule_all_new_tokens(request, end)
                scheduled.append(step)
                budget -= len(step.token_ids)
                index += 1
                continue
            victim = self.running[-1]  # the most recent arrival gives way
            self._preempt(victim)
            preempted = True
            if victim is request:
                break
        return scheduled, budget, preempted

    def _preempt(self, victim: Request) -> None:
        """Recompute preemption: the victim leaves `running`, its blocks are freed, its
        `num_computed_tokens` is 0 (its KV is gone; its tokens are kept), it waits at the front
        of `waiting`, and `num_preemptions` counts it."""
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        self.waiting.appendleft(victim)
        self.num_preemptions += 1

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        """Waiting requests join in arrival order while seats, tokens and blocks allow."""
        scheduled: list[ScheduledRequest] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget or not self.kv.allocate_slots(
                request.request_id, request.num_tokens
            ):
                break
            self.waiting.popleft()
            self.running.append(request)
            scheduled.append(self._schedule_all_new_tokens(request, request.num_tokens))
            budget -= num_new
        return scheduled

    def _admit_static_batch(self) -> None:
        """Stage 03's policy: a new batch only when the running one is empty, admitted on its
        members' worst case (prompt + max_tokens) so it never needs a preemption."""
        promised, free, tokens = 0, self.kv.num_free_blocks, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            assert request.params.max_tokens is not None
            worst = self.kv.blocks_needed(len(request.prompt_token_ids) + request.params.max_tokens)
            if promised + worst > free or tokens + request.num_tokens > self.max_num_batched_tokens:
                break
            promised += worst
            tokens += request.num_tokens
            self.running.append(self.waiting.popleft())

    def _allocate_promised(self, request: Request, end: int) -> None:
        """A static batch's member gets its slots: admission promised its worst case."""
        if not self.kv.allocate_slots(request.request_id, end):
            raise RuntimeError(f"no KV blocks for {request.request_id}: a scheduling bug")

    def _schedule_all_new_tokens(self, request: Request, end: int) -> ScheduledRequest:
        """The request's new tokens, up to `end` (its `num_tokens`, which the caller has read),
        whose slots the caller has allocated: `allocate_slots` runs once per request per step,
        not a second time here to check."""
        start = request.num_computed_tokens
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
        """A request is done: it leaves now and its blocks serve the next step."""
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
