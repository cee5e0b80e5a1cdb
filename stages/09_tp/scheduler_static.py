"""Static batching, stage 03's policy, kept for comparison (`scheduling="static"`).

A static batch is admitted only when the running one is empty, on its members' worst case
(prompt + max_tokens), and runs until its last member ends: it never preempts anyone, but a
request that finishes early leaves an idle seat, and a request that arrives meanwhile waits for
the whole batch. `StaticBatching` is a part of `Scheduler` (scheduler.py), which calls it when
the config asks for this policy.
"""

from __future__ import annotations

from collections import deque

from .kv_cache import KVCacheManager
from .request import Request
from .scheduler_output import ScheduledRequest


class StaticBatching:
    """Stage 03's policy inside the scheduler (a mixin of `Scheduler`: it shares the
    scheduler's queues, budget and KV manager)."""

    kv: KVCacheManager
    waiting: deque[Request]
    running: list[Request]
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked: bool

    def _admit_static_batch(self) -> None:
        """Stage 03's policy: a new batch only when the running one is empty, admitted on its
        members' worst case (prompt + max_tokens) so it never needs a preemption. Without
        chunked prefill the batch's prompts must also fit one step's token budget; with it they
        run chunk by chunk (`_schedule_static_batch`), so the budget bounds no admission."""
        promised, free, tokens = 0, self.kv.num_free_blocks, 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            assert request.params.max_tokens is not None
            worst = self.kv.blocks_needed(len(request.prompt_token_ids) + request.params.max_tokens)
            over_budget = tokens + request.num_tokens > self.max_num_batched_tokens
            if promised + worst > free or (over_budget and not self.chunked):
                break
            promised += worst
            tokens += request.num_tokens
            self.running.append(self.waiting.popleft())

    def _schedule_static_batch(self) -> list[ScheduledRequest]:
        """The static batch's next tokens, members in arrival order under the token budget: a
        whole prompt without chunked prefill (admission made the prompts fit one step), else
        chunk by chunk as running requests get them. Blocks never run out: admission promised
        every member its worst case."""
        scheduled: list[ScheduledRequest] = []
        budget = self.max_num_batched_tokens
        for request in self.running:
            num_new = 0 if request.finishes_in_flight else self._chunk(request, budget)
            if num_new:
                num_new += self._drafts_that_fit(request, num_new, budget - num_new)
                scheduled.append(self._schedule_new_tokens(request, num_new))
                budget -= num_new
        return scheduled
