"""The transfer state machine of one disaggregated request, on the prefill and the decode side.

A request prefilled on one engine and decoded on another has its KV blocks in flight between
them. Each side keeps one record per such request, in SGLang's poll states (`KVPoll` in
`srt/disaggregation/base/conn.py`), ordered so that the minimum over ranks is the request's
state:

    FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS

    BOOTSTRAPPING      the two sides have not met yet (handshake, transfer params)
    WAITING_FOR_INPUT  prefill: KV computed, blocks leased, waiting for decode to take them;
                       decode: blocks allocated, waiting for the data
    TRANSFERRING       bytes are moving; the transport reads (prefill) or writes (decode) the
                       request's blocks
    SUCCESS, FAILED    terminal

Every move is checked against `ALLOWED`. Time is passed in (`now`), never read, so a test can
walk a request through hours of timeouts in microseconds. The sides do not free blocks or send
messages themselves: each event queues `Effects` (blocks to free, messages for the peer,
transfers to cancel, what becomes of the request) that the caller takes with `drain()`.

The two sides (`PrefillTransfers`, `DecodeTransfers` in disagg/transfer_sides.py) apply the rules
that make this safe; this module holds what they share.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal


class KVPoll(IntEnum):
    """A transfer's state; the order is SGLang's, so `min` over ranks is the combined state."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


ALLOWED: dict[KVPoll, frozenset[KVPoll]] = {
    KVPoll.BOOTSTRAPPING: frozenset({KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED}),
    # SUCCESS straight from WAITING_FOR_INPUT: nothing to move (a full prefix hit on decode)
    KVPoll.WAITING_FOR_INPUT: frozenset({KVPoll.TRANSFERRING, KVPoll.SUCCESS, KVPoll.FAILED}),
    KVPoll.TRANSFERRING: frozenset({KVPoll.SUCCESS, KVPoll.FAILED}),
    KVPoll.SUCCESS: frozenset(),
    KVPoll.FAILED: frozenset(),
}


class IllegalTransition(AssertionError):
    """A move `ALLOWED` does not list: a bug in the caller's event order."""


def combined_poll(states: Iterable[KVPoll]) -> KVPoll:
    """The state of a request whose transfer runs on several ranks: the least advanced one."""
    return min(states)


@dataclass(frozen=True)
class TransferConfig:
    """Deadlines (seconds) and what a failed transfer does to its request."""

    lease_seconds: float = 30.0  # prefill holds computed blocks this long for decode to take
    bootstrap_timeout_seconds: float = 10.0  # either side, until the two have met
    waiting_timeout_seconds: float = 30.0  # decode, blocks allocated, until the data starts
    transfer_timeout_seconds: float = 30.0  # either side, from start to done
    on_failure: Literal["local_prefill", "fail"] = "local_prefill"

    def __post_init__(self) -> None:
        for name in ("lease", "bootstrap_timeout", "waiting_timeout", "transfer_timeout"):
            if not getattr(self, f"{name}_seconds") > 0:
                raise ValueError(f"{name}_seconds must be > 0")
        if self.on_failure not in ("local_prefill", "fail"):
            raise ValueError(f"on_failure must be 'local_prefill' or 'fail', not {self.on_failure}")


@dataclass(frozen=True)
class PeerMessage:
    """A control message for the other side. decode -> prefill: "pull" (send me these blocks
    now: the decode side has posted its receive), "reject" (before admission), "done" (has
    what it needs: free), "abort" (gave up). prefill -> decode: "failed"."""

    kind: Literal["pull", "reject", "done", "abort", "failed"]
    request_id: str
    block_ids: tuple[int, ...] = ()  # "pull": the prefill side's blocks to send, in order


@dataclass(frozen=True)
class Effects:
    """What the caller must do after a batch of events, in this order: cancel the transfers at
    the transport, free the blocks, send the messages, then route each request."""

    cancel: tuple[str, ...] = ()
    free: tuple[tuple[str, tuple[int, ...]], ...] = ()
    to_peer: tuple[PeerMessage, ...] = ()
    loaded: tuple[str, ...] = ()  # decode: KV arrived, schedule the request
    local_prefill: tuple[str, ...] = ()  # decode: transfer failed, compute the prompt here
    failed: tuple[str, ...] = ()  # decode: transfer failed, fail the request
    ended: tuple[tuple[str, KVPoll, str], ...] = ()  # records forgotten: (id, state, reason)


@dataclass
class TransferRecord:
    request_id: str
    state: KVPoll
    since: float  # when it entered `state`
    block_ids: tuple[int, ...] = ()
    lease_until: float = float("inf")
    in_flight: bool = False  # the transport may still touch block_ids
    reason: str = ""


@dataclass
class _Outbox:
    cancel: list[str] = field(default_factory=list)
    free: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    to_peer: list[PeerMessage] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    local_prefill: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    ended: list[tuple[str, KVPoll, str]] = field(default_factory=list)


class TransferSide:
    """What both sides share: the records, checked moves, deferred frees, the outbox."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self.records: dict[str, TransferRecord] = {}
        self.late_messages = 0  # peer messages about requests already forgotten
        self._out = _Outbox()

    def poll(self, request_id: str) -> KVPoll:
        return self.records[request_id].state

    def reason(self, request_id: str) -> str:
        return self.records[request_id].reason

    def drain(self) -> Effects:
        out, self._out = self._out, _Outbox()
        return Effects(
            tuple(out.cancel),
            tuple(out.free),
            tuple(out.to_peer),
            tuple(out.loaded),
            tuple(out.local_prefill),
            tuple(out.failed),
            tuple(out.ended),
        )

    def _add(self, request_id: str, now: float) -> TransferRecord:
        if request_id in self.records:
            raise ValueError(f"request {request_id!r} already has a transfer")
        record = TransferRecord(request_id, KVPoll.BOOTSTRAPPING, now)
        self.records[request_id] = record
        return record

    def _move(self, record: TransferRecord, new: KVPoll, now: float, reason: str = "") -> None:
        if new not in ALLOWED[record.state]:
            raise IllegalTransition(f"{record.request_id}: {record.state.name} -> {new.name}")
        record.state, record.since = new, now
        record.reason = reason or record.reason

    def _release(self, record: TransferRecord) -> None:
        """Once terminal and out of the transport's hands: free what is still held, forget."""
        if record.in_flight or record.state not in (KVPoll.SUCCESS, KVPoll.FAILED):
            return
        if record.block_ids:
            self._out.free.append((record.request_id, record.block_ids))
        self._out.ended.append((record.request_id, record.state, record.reason))
        del self.records[record.request_id]

    def _drained(self, request_id: str) -> TransferRecord:
        record = self.records.get(request_id)
        if record is None or not record.in_flight:
            raise IllegalTransition(f"{request_id}: drained, but no transfer was in flight")
        record.in_flight = False
        return record
