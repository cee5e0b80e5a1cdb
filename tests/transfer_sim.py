"""A prefill side and a decode side wired together in one process, for the state tests
(tests/test_13_transfer_state.py): stage 13's transfer_sides.py without engines.

It plays the parts the engines play: two block pools, the control messages
between the sides (which may be lost), the transport's reads and writes (which hold blocks
until they drain), and the requests that run once their KV arrived. It checks, as it applies
each side's `Effects`, the two rules the state machine exists for: no block is freed while the
transport still touches it, and no block is freed twice.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any


class BlockPool:
    """A free list that refuses a double free or a foreign block."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = set(range(num_blocks))

    def take(self, count: int) -> tuple[int, ...]:
        if count > len(self.free_ids):
            raise RuntimeError(f"pool has {len(self.free_ids)} free blocks, {count} asked")
        ids = tuple(sorted(self.free_ids)[:count])
        self.free_ids.difference_update(ids)
        return ids

    def give(self, ids: tuple[int, ...]) -> None:
        for block in ids:
            assert 0 <= block < self.num_blocks and block not in self.free_ids, (block, ids)
            self.free_ids.add(block)

    @property
    def full(self) -> bool:
        return len(self.free_ids) == self.num_blocks


@dataclass
class Cluster:
    """Both sides, both pools, the wire between them. `lose_messages` drops control messages
    (a lost "done" or "failed"), to show that the deadlines alone end every request."""

    stage: ModuleType
    config: Any  # the stage's TransferConfig
    num_blocks: int = 64
    lose_messages: bool = False
    now: float = 0.0
    prefill: Any = field(init=False)  # the stage's PrefillTransfers
    decode: Any = field(init=False)  # ... and DecodeTransfers
    prefill_pool: BlockPool = field(init=False)
    decode_pool: BlockPool = field(init=False)
    reading: dict[str, tuple[int, ...]] = field(default_factory=dict)  # prefill blocks read
    writing: dict[str, tuple[int, ...]] = field(default_factory=dict)  # decode blocks written
    allocated: dict[str, tuple[int, ...]] = field(default_factory=dict)  # decode, per request
    running: dict[str, tuple[int, ...]] = field(default_factory=dict)  # decode, KV arrived
    outcome: dict[str, str] = field(default_factory=dict)  # loaded / local_prefill / failed
    cancelled: set[str] = field(default_factory=set)
    messages: list[tuple[str, Any]] = field(default_factory=list)  # (to, PeerMessage)

    def __post_init__(self) -> None:
        sides = importlib.import_module(f"{self.stage.__name__}.disagg.transfer_sides")
        self._no_effects = importlib.import_module(
            f"{self.stage.__name__}.disagg.transfer_state"
        ).Effects()
        self.prefill = sides.PrefillTransfers(self.config)
        self.decode = sides.DecodeTransfers(self.config)
        self.prefill_pool = BlockPool(self.num_blocks)
        self.decode_pool = BlockPool(self.num_blocks)

    # Steps of one request, in the order a disaggregated request takes them.
    def arrive(self, rid: str) -> None:
        self.prefill.add(rid, self.now)
        self.decode.add(rid, self.now)

    def bootstrap(self, rid: str) -> None:
        self.prefill.bootstrapped(rid, self.now)
        self.decode.bootstrapped(rid, self.now)

    def prefill_done(self, rid: str, num_blocks: int) -> None:
        ids = self.prefill_pool.take(num_blocks)
        if not self.prefill.hold(rid, ids, self.now):
            self.prefill_pool.give(ids)

    def decode_allocate(self, rid: str, num_blocks: int, external_tokens: int) -> None:
        self.allocated[rid] = self.decode_pool.take(num_blocks)
        self.decode.allocate(rid, self.allocated[rid], external_tokens, self.now)

    def start_transfer(self, rid: str) -> None:
        self.prefill.start_send(rid, self.now)
        self.reading[rid] = self.prefill.records[rid].block_ids
        self.decode.start_recv(rid, self.now)
        self.writing[rid] = self.allocated[rid]

    def send_drained(self, rid: str, ok: bool) -> None:
        del self.reading[rid]
        self.prefill.send_finished(rid, ok, self.now)

    def recv_drained(self, rid: str, ok: bool) -> None:
        del self.writing[rid]
        self.decode.recv_finished(rid, ok, self.now)

    def finish_request(self, rid: str) -> None:
        """A loaded request generated its tokens: the decode scheduler frees its blocks."""
        self.decode_pool.give(self.running.pop(rid))

    # Time and effects.
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.prefill.poll_timeouts(self.now)
        self.decode.poll_timeouts(self.now)
        self.settle()

    def settle(self) -> None:
        """Apply both sides' effects and deliver their messages until nothing changes."""
        while True:
            moved = self._apply("prefill", self.prefill.drain())
            moved |= self._apply("decode", self.decode.drain())
            pending, self.messages = self.messages, []
            for to, message in pending:
                side = self.prefill if to == "prefill" else self.decode
                side.on_peer_message(message, self.now)
            if not moved and not pending:
                return

    def _apply(self, side: str, effects: Any) -> bool:
        self.cancelled.update(effects.cancel)
        pool = self.prefill_pool if side == "prefill" else self.decode_pool
        touching = self.reading if side == "prefill" else self.writing
        busy = {block for ids in touching.values() for block in ids}
        for rid, ids in effects.free:
            assert not busy & set(ids), f"{side} freed {rid}'s blocks while the transport has them"
            pool.give(ids)
        for rid in effects.loaded:
            self.running[rid] = self.allocated.pop(rid)
        for kind in ("loaded", "local_prefill", "failed"):
            for rid in getattr(effects, kind):
                assert rid not in self.outcome, f"{rid}: second outcome {kind}"
                self.outcome[rid] = kind
        if side == "decode":
            for rid, _, _ in effects.ended:
                self.allocated.pop(rid, None)  # freed above, or handed to `running`
        if not self.lose_messages:
            peer = "decode" if side == "prefill" else "prefill"
            self.messages.extend((peer, message) for message in effects.to_peer)
        return bool(effects != self._no_effects)

    def drain_cancelled(self) -> None:
        """The transport honours the cancels: each cancelled transfer drains, failed."""
        for rid in sorted(self.cancelled):
            if rid in self.reading:
                self.send_drained(rid, ok=False)
            if rid in self.writing:
                self.recv_drained(rid, ok=False)
        self.cancelled.clear()
        self.settle()

    def assert_clean(self) -> None:
        """After a scenario: no record left, nothing in flight, both pools full."""
        assert not self.prefill.records and not self.decode.records
        assert not self.reading and not self.writing and not self.running
        assert self.prefill_pool.full and self.decode_pool.full
