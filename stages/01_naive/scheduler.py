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

Stage 01's policy is the simplest: one request at a time, first come first served. With
`use_kv_cache=False` nothing is ever cached, so every step recomputes every token.
"""

from __future__ import annotations

import itertools
from collections import deque

from .config import EngineConfig
from .request import Request
from .scheduler_output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """A waiting queue and the request that is running, first come first served."""

    def __init__(self, config: EngineConfig) -> None:
        self.keep_kv = config.use_kv_cache
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
        (`num_tokens - num_computed_tokens`), and its `num_computed_tokens` moves past them
        now, before the forward runs. Here at most one request runs at a time.
        """
        if not self.running and self.waiting:
            self.running.append(self.waiting.popleft())
        scheduled = tuple(self._schedule_all_new_tokens(r) for r in self.running)
        return SchedulerOutput(scheduled, self._take_finished_ids())

    def _schedule_all_new_tokens(self, request: Request) -> ScheduledRequest:
        start, end = request.num_computed_tokens, request.num_tokens
        # Without a KV cache nothing stays computed: the next step starts from 0 again.
        request.num_computed_tokens = end if self.keep_kv else 0
        assert request.params.max_tokens is not None
        capacity = len(request.prompt_token_ids) + request.params.max_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            admission_id=request.admission_id,
            token_ids=tuple(request.token_ids_between(start, end)),
            num_computed_tokens=start,
            params=request.params,
            seed=request.seed,
            sample=True,
            kv_capacity=capacity if self.keep_kv else 0,
        )

    def _take_finished_ids(self) -> tuple[str, ...]:
        finished, self._finished_ids = tuple(self._finished_ids), []
        return finished

    def finish(self, request: Request) -> None:
        """A request is done: it leaves, and its cache goes at the next step."""
        self._remove(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self._remove(request)
        return request

    def _remove(self, request: Request) -> None:
        """Take a request out of whichever queue holds it, for good."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
