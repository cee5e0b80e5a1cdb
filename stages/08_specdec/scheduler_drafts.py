"""Speculative decoding in the scheduler (stage 08): a running request's draft tokens are
scheduled after its last token, k + 1 new tokens in one step, and `Scheduler.rollback` takes
back the positions of the drafts the target rejected.

Drafts are optional work: they get the blocks and budget left once every real token has its
place, and shrink (to none) rather than preempt anyone. `DraftScheduling` is a part of
`Scheduler` (scheduler.py), which asks it how many drafts fit after a request's real tokens.
"""

from __future__ import annotations

from .kv_cache import KVCacheManager
from .request import Request


class DraftScheduling:
    """How many drafts ride along (a mixin of `Scheduler`: it shares the scheduler's budget
    settings and KV manager)."""

    kv: KVCacheManager
    long_prefill_token_threshold: int

    def _drafts_that_fit(self, request: Request, num_new: int, budget: int) -> int:
        """How many of its drafts ride after a request's `num_new` real tokens: none unless
        those reach its last real token, else as many as the budget, the per-request threshold
        and the blocks free now allow. Drafts are optional work: they shrink, to none, where a
        real token would have to preempt someone for them."""
        if not request.spec_token_ids or num_new < self._left(request):
            return 0
        room = budget
        if self.long_prefill_token_threshold:
            room = min(room, self.long_prefill_token_threshold - num_new)
        end = request.num_computed_tokens + num_new
        held = len(self.kv.block_ids(request.request_id)) + self.kv.num_free_blocks
        return max(0, min(len(request.spec_token_ids), room, held * self.kv.block_size - end))
