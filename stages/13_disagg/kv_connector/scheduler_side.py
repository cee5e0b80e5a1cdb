"""The scheduler's side of a KV connector (stage 12; kv_connector/base.py): one more source of
cached tokens.

At admission, after the device prefix hit, the connector says how many further tokens it can
supply (`get_num_new_matched_tokens`); the scheduler allocates their blocks, the connector
queues their load (`update_state_after_alloc`), and the request waits in `loading`, outside the
batch, until the workers report the load done (`update_connector_output`). Then it joins like a
prefix hit; if the load failed, it recomputes. With `preemption_mode="swap"` a victim's KV is
handed to the connector (`request_preempted`) before its blocks are freed, and comes back the
same way when it resumes. Each step's transfers travel in
`SchedulerOutput.kv_connector_metadata`.

Disaggregation (stage 13) is the same seam with another connector (disagg/connector.py): on a
decode engine the "external" tokens are a prompt's KV computed by a prefill engine, received
while the request waits in `loading`, possibly over many steps; on a prefill engine a finished
request's blocks stay held (`_held`) until their send drained, and `request_finished` hands
back where they are. A failed transfer computes the prompt here, or fails the request.

`ConnectorScheduling` is a part of `Scheduler` (scheduler.py), kept apart so that the policy
reads without the connector: the scheduler calls its methods at the points named above.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from ..config import EngineConfig
from ..kv_cache import KVCacheManager
from ..request import Request
from ..scheduler_output import SchedulerOutput
from .base import KVConnectorOutput, KVConnectorScheduler


class ConnectorScheduling:
    """The connector's state and steps inside the scheduler (a mixin of `Scheduler`: it shares
    the scheduler's queues and KV manager)."""

    kv: KVCacheManager
    requests: dict[str, Request]
    waiting: deque[Request]
    chunked: bool

    def _init_connector(self, config: EngineConfig, connector: KVConnectorScheduler | None) -> None:
        self.connector = connector
        self.swap = config.preemption_mode == "swap" and connector is not None
        self.loading: dict[str, Request] = {}  # waiting for the connector's load of their KV
        self._recompute_only: set[str] = set()  # their load failed: never ask the connector
        self._held: dict[str, list[int]] = {}  # finished, blocks kept until a send drains
        self.num_swapped_out = 0  # preemptions whose KV went to the connector

    def _with_connector_meta(self, output: SchedulerOutput) -> SchedulerOutput:
        """The step's output with the transfers the connector wants done (none without one)."""
        if self.connector is None:
            return output
        metadata = self.connector.build_connector_meta(output)
        return replace(output, kv_connector_metadata=metadata)

    def _loaded_first(self) -> None:
        """Move the waiting requests whose KV is loaded (they hold device blocks) ahead of those
        that hold none, each group in its order. A loaded request gives its blocks back only by
        running. Queued behind a request that cannot fit without those blocks (a victim
        preempted after the load goes to the front), neither could ever run: every step would
        schedule nothing."""
        if self.connector is None or not self.waiting:  # only a connector loads KV
            return
        if self.kv.block_ids(self.waiting[0].request_id):
            return
        loaded: list[Request] = []
        rest: list[Request] = []
        for request in self.waiting:  # one pass, each group in its order
            (loaded if self.kv.block_ids(request.request_id) else rest).append(request)
        if loaded:
            self.waiting.clear()
            self.waiting.extend(loaded + rest)

    def _external_tokens(self, request: Request) -> int | None:
        """Tokens the connector can supply after the device hit (0 without one)."""
        if self.connector is None or request.request_id in self._recompute_only:
            return 0
        tokens, load_async = self.connector.get_num_new_matched_tokens(
            request, request.num_computed_tokens
        )
        if tokens and not load_async:
            raise NotImplementedError("this engine loads external KV asynchronously only")
        return tokens

    def _start_load(self, request: Request, hit: list[int], external: int) -> bool:
        """Allocate blocks for the device hit, the external tokens and the first token after
        them, let the connector queue the load, and park the request in `loading`. False (and
        nothing held) when the pool cannot supply the blocks. Tokens a transfer brings
        (stage 13) are not the request's cached tokens: its hit is the device's, recorded here
        (`update_connector_output` then records nothing); a cache's load counts when done."""
        assert self.connector is not None
        end = request.num_computed_tokens + external
        if not self.kv.allocate_slots(request.request_id, end + 1, hit):
            request.num_computed_tokens = 0
            return False
        blocks = self.kv.block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, blocks, external)
        if not self.connector.loads_are_cache_hits and request.num_cached_tokens is None:
            # KV sent by another engine is no cache hit: the device's is, counted now
            request.num_cached_tokens = request.num_computed_tokens
            self.kv.stats.record(request.num_tokens, request.num_cached_tokens)
        request.num_computed_tokens = end
        self.loading[request.request_id] = self.waiting.popleft()
        return True

    def _fit_held(self, request: Request, num_new: int) -> int:
        """A loaded request's new tokens: as many as asked if the pool can grow its table,
        else (chunked prefill) what its blocks already hold; 0 when it must wait."""
        end = request.num_computed_tokens + num_new
        if num_new and self.kv.allocate_slots(request.request_id, end):
            return num_new
        held = len(self.kv.block_ids(request.request_id)) * self.kv.block_size
        room = held - request.num_computed_tokens
        return min(num_new, room) if self.chunked else 0

    def update_connector_output(self, output: KVConnectorOutput) -> list[Request]:
        """The workers' report after a step: a request whose KV arrived joins the front of the
        waiting queue (its prefix hit counted now); one whose load failed gives its blocks back
        and recomputes, without the connector; a finished request's delayed free happens; a
        request the connector fails (stage 13: its transfer failed, and the engine is told to
        fail it rather than compute it) leaves with the reason. Returns those it failed."""
        if self.connector is None:
            return []
        update = self.connector.update_connector_output(output)
        for request_id in reversed(update.loaded + update.load_failed):
            request = self.loading.pop(request_id, None)
            if request is None:  # aborted while loading
                continue
            if request_id in update.load_failed:
                self.kv.free(request_id)
                request.num_computed_tokens = 0
                self._recompute_only.add(request_id)
            elif request.num_cached_tokens is None:  # its first admission, not a swap-in
                request.num_cached_tokens = request.num_computed_tokens
                self.kv.stats.record(request.num_tokens, request.num_cached_tokens)
            self.waiting.appendleft(request)
        for request_id in update.sent:
            self.kv.allocator.free(reversed(self._held.pop(request_id, [])))
        failed = []
        for request_id, reason in update.failed:
            request = self.requests.get(request_id)
            if request is not None:
                request.fail(reason)
                self._remove(request)
                failed.append(request)
        return failed

    def _swap_out(self, victim: Request) -> None:
        """Swap preemption: first the connector takes the victim's KV (`request_preempted`); the
        blocks are freed all the same (the workers finish reading them before any forward
        writes them), and it resumes by loading them (`_admit_waiting`)."""
        if self.swap and self.connector is not None:
            blocks = self.kv.block_ids(victim.request_id)
            self.num_swapped_out += self.connector.request_preempted(victim, blocks)

    def _free_blocks(self, request: Request) -> None:
        """A request leaves for good: free its blocks, or hold them while the connector still
        reads them (`request_finished` says so; `update_connector_output` frees them later)."""
        request_id = request.request_id
        self._recompute_only.discard(request_id)
        delay_free, request.kv_transfer_params = False, None  # what it hands back (stage 13)
        if self.connector is not None:
            blocks = self.kv.block_ids(request_id)
            delay_free, request.kv_transfer_params = self.connector.request_finished(
                request, blocks
            )
        if delay_free:
            self._held[request_id] = self.kv.detach(request_id)
        else:
            self.kv.free(request_id)
