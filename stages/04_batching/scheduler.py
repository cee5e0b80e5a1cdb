"""The scheduler: which requests run in the next forward, decided again at every step.

Static batching (stage 03) fixes a batch and runs it until its last member ends: a request that
finishes early leaves an idle seat, and a request that arrives meanwhile waits for the whole
batch. Continuous batching (Orca's iteration-level scheduling, as vLLM does it) re-decides at
every step:

    1. every running request gets its next decode token, oldest first. When the block pool is
       full, the newest running request is *preempted*: its blocks are freed and it goes back
       to the front of the waiting queue, to be recomputed from its tokens later;
    2. then waiting requests join, in arrival order, while `max_num_seqs`,
       `max_num_batched_tokens` and the free blocks allow (none in a step that preempted);
    3. finished requests leave at once (`finish`), so their blocks serve the next step.

Prefills (whole prompts, or prompt + output so far after a preemption) and decodes then run
together in one flat forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import Request


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: prefills first, then decodes, each with its KV slots allocated."""

    prefills: list[Request] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    slots: dict[str, list[int]] = field(default_factory=dict)  # request id -> new tokens' slots
    num_preempted: int = 0

    @property
    def requests(self) -> list[Request]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.prefills) + len(self.decodes)


class Scheduler:
    """Waiting and running queues over one KV block pool."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "continuous",
    ) -> None:
        if policy not in ("continuous", "static"):
            raise ValueError(f"scheduling must be 'continuous' or 'static', got {policy!r}")
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """A running request is done: it leaves the batch and its blocks go back at once."""
        self.running.remove(request)
        self.kv.free(request)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is, freeing its blocks; None if unknown."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.kv.free(request)
                    return request
        return None

    def schedule(self) -> ScheduledBatch:
        """Decide the next forward's prefills and decodes and allocate their KV slots.

        Contract: every returned request has slots for all its new tokens; the batch holds at
        most `max_num_seqs` requests and `max_num_batched_tokens` tokens; a preempted request
        holds no blocks and waits at the front of the queue with its tokens kept.
        """
        if self.policy == "static":
            return self._schedule_static()
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        if not batch.num_preempted:
            self._admit_waiting(batch)
        return batch

    # ------------------------------------------------------------------ continuous policy
    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        """One new token for each running request, preempting the newest when blocks run out."""
        index = 0
        while index < len(self.running):
            request = self.running[index]
            position = request.num_tokens - 1  # the newest token enters the cache this step
            if self.kv.blocks_needed(position + 1) <= len(request.block_ids) or (
                self.kv.num_free_blocks > 0
            ):
                batch.slots[request.request_id] = self.kv.allocate_slots(request, position, 1)
                batch.decodes.append(request)
                index += 1
                continue
            victim = self.running[-1]  # the most recent arrival gives way
            self._preempt(victim, batch)
            if victim is request:
                break

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        """Recompute preemption: drop the victim's KV, keep its tokens, queue it first."""
        self.running.remove(victim)
        if victim in batch.decodes:
            batch.decodes.remove(victim)
            del batch.slots[victim.request_id]
        self.kv.free(victim)
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        batch.num_preempted += 1
        self.num_preemptions += 1

    def _admit_waiting(self, batch: ScheduledBatch) -> None:
        """Waiting requests join in arrival order while seats, tokens and blocks allow."""
        tokens = len(batch.decodes)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            need = request.num_tokens  # prompt, plus any output a preemption threw away
            if tokens + need > self.max_num_batched_tokens:
                break
            if self.kv.blocks_needed(need) > self.kv.num_free_blocks:
                break
            self.waiting.popleft()
            batch.slots[request.request_id] = self.kv.allocate_slots(request, 0, need)
            batch.prefills.append(request)
            self.running.append(request)
            tokens += need

    # ------------------------------------------------------------------ static policy (stage 03)
    def _schedule_static(self) -> ScheduledBatch:
        """Stage 03's policy: a new batch only when the running one is empty, admitted on its
        members' worst case (prompt + max_tokens) so it never needs a preemption."""
        batch = ScheduledBatch()
        if self.running:
            for request in self.running:
                position = request.num_tokens - 1
                batch.slots[request.request_id] = self.kv.allocate_slots(request, position, 1)
                batch.decodes.append(request)
            return batch
        promised = tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            assert request.params.max_tokens is not None
            worst = self.kv.blocks_needed(len(request.prompt_token_ids) + request.params.max_tokens)
            if promised + worst > self.kv.num_free_blocks:
                break
            if tokens + request.num_tokens > self.max_num_batched_tokens:
                break
            promised += worst
            tokens += request.num_tokens
            self.waiting.popleft()
            batch.slots[request.request_id] = self.kv.allocate_slots(request, 0, request.num_tokens)
            batch.prefills.append(request)
            self.running.append(request)
        return batch
