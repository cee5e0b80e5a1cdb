"""A transport inside one process: what the tests and the in-process pair use instead of gloo.

Two ends (`FakeTransport.pair()`, or the engines of one process built inside
`in_process_transports()`, which find each other by their `kv_transfer_address`) share a
wire: the blocks each send gathered, by request id. A receive completes when its send has
arrived, at once if it already has, else the moment it does (the decode side starts its
receive before the prefill side hears the "pull" and sends). On command an end fails its
transfers (`mode = "fail"`) or holds them (`mode = "hold"`) until `release()`, so a test can
stage every race: an abort during a transfer, a transfer that never ends, a late arrival.
A cancelled transfer never writes the receiver's blocks. The bytes take GlooTransport's path:
gathered into a staging buffer by its plan, scattered from it (disagg/kv_staging.py), so every
in-process test runs the staging code too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from ..disagg import transfer_worker
from ..disagg.kv_staging import Layout, Stager, TransferPlan, layouts, plan_transfer
from ..disagg.transport import (
    KVPool,
    KVTransport,
    TransferError,
    TransferHandle,
    TransferRefused,
    pool_tensors,
)

_Blocks = tuple[TransferPlan, torch.Tensor] | None  # the plan and its staging; None: a refusal


class _Wire:
    """What the two ends share: sends not yet received, and receives waiting for a send."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[str, _Blocks] = {}
        self.waiting: dict[str, Callable[[_Blocks], None]] = {}
        self.layouts: dict[int, tuple[Layout, ...]] = {}  # each end's pool, from its handshake


class FakeTransport:
    """One end of an in-process pair. `mode`: "ok" moves bytes, "fail" fails every transfer,
    "hold" keeps transfers open until `release()` (which then runs them, or fails them)."""

    def __init__(self, wire: _Wire, end: int = 0) -> None:
        self.wire, self.end = wire, end
        self.mode = "ok"
        self._held: list[tuple[TransferHandle, Callable[[], None]]] = []

    @classmethod
    def pair(cls) -> tuple[FakeTransport, FakeTransport]:
        wire = _Wire()
        return cls(wire, 0), cls(wire, 1)

    def handshake(self, pool: KVPool) -> None:
        """Record this end's layout; a ValueError if the other end has one that differs (the
        second engine of a pair to start finds out, as over gloo)."""
        mine = _layouts_without_blocks(pool)
        with self.wire.lock:
            self.wire.layouts[self.end] = mine
            theirs = self.wire.layouts.get(1 - self.end)
        if theirs is not None and theirs != mine:
            raise ValueError(
                f"the two engines' KV blocks differ: {mine} here, {theirs} there; start both "
                "with the same model, block_size and kv_cache_dtype"
            )

    def start_send(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        """Put the blocks on the wire (none: a refusal) and hand them to a waiting receive."""
        handle = TransferHandle(request_id)

        def send() -> None:
            if handle.cancelled:
                return handle._finish()
            blocks = None
            if block_ids:
                tensors = pool_tensors(pool)
                plan = plan_transfer(layouts(tensors), block_ids)
                stager = Stager(tensors[0].device)
                staging = stager.buffer(plan.nbytes)
                stager.gather(tensors, plan, staging)
                blocks = (plan, staging)
            with self.wire.lock:
                deliver = self.wire.waiting.pop(request_id, None)
                if deliver is None:
                    self.wire.sent[request_id] = blocks
            if deliver is not None:
                deliver(blocks)
            handle._finish()

        return self._start(handle, send)

    def start_recv(self, request_id: str, pool: KVPool, block_ids: Sequence[int]) -> TransferHandle:
        """Take the request's blocks from the wire into `block_ids`, now or when they come."""
        handle = TransferHandle(request_id)

        def deliver(blocks: _Blocks) -> None:
            try:
                if handle.cancelled:
                    raise TransferError(f"{request_id}: cancelled")
                if blocks is None:
                    raise TransferRefused(f"{request_id}: the sender has no KV for it")
                sent_plan, staging = blocks
                tensors = pool_tensors(pool)
                plan = plan_transfer(layouts(tensors), block_ids)
                if len(sent_plan.block_ids) != len(block_ids):
                    raise TransferError(
                        f"{request_id}: {len(sent_plan.block_ids)} blocks sent, "
                        f"{len(block_ids)} expected"
                    )
                if [(g.shape, g.dtype) for g in sent_plan.segments] != [
                    (g.shape, g.dtype) for g in plan.segments
                ]:
                    raise TransferError(f"{request_id}: the sender's blocks are not this pool's")
                Stager(tensors[0].device).scatter(tensors, plan, staging)
                handle._finish()
            except TransferError as error:
                handle._finish(error)

        def give_up() -> None:  # cancelled while waiting for its send: drained at once
            with self.wire.lock:
                waiting = self.wire.waiting.get(request_id) is deliver
                if waiting:
                    del self.wire.waiting[request_id]
            if waiting:
                handle._finish(TransferError(f"{request_id}: cancelled"))

        def receive() -> None:
            with self.wire.lock:
                arrived = request_id in self.wire.sent
                blocks = self.wire.sent.pop(request_id, None)
                if not arrived:
                    self.wire.waiting[request_id] = deliver
                    handle.on_cancel = give_up
            if arrived:
                deliver(blocks)

        return self._start(handle, receive)

    def release(self, ok: bool = True) -> None:
        """Run the held transfers now (or fail them)."""
        held, self._held = self._held, []
        for handle, start in held:
            if ok:
                start()
            else:
                handle._finish(TransferError(f"{handle.request_id}: failed on command"))

    def close(self) -> None:
        self.release(ok=False)

    def _start(self, handle: TransferHandle, start: Callable[[], None]) -> TransferHandle:
        if self.mode == "hold":
            self._held.append((handle, start))
        elif self.mode == "fail":
            handle._finish(TransferError(f"{handle.request_id}: failed on command"))
        else:
            start()
        return handle


def _layouts_without_blocks(pool: KVPool) -> tuple[Layout, ...]:
    return tuple(((*shape[:1], *shape[2:]), dtype) for shape, dtype in layouts(pool_tensors(pool)))


_PAIRS: dict[str, tuple[FakeTransport, FakeTransport]] = {}
_PAIRS_LOCK = threading.Lock()


def fake_transport(name: str, role: str) -> FakeTransport:
    """The `role` ("prefill" or "decode") end of the in-process pair called `name`."""
    with _PAIRS_LOCK:
        if name not in _PAIRS:
            _PAIRS[name] = FakeTransport.pair()
        return _PAIRS[name][0 if role == "prefill" else 1]


ADDRESS = "in-process://"  # kv_transfer_address of an in-process pair: in-process://name


@contextlib.contextmanager
def in_process_transports() -> Iterator[None]:
    """While open, an engine this process builds with `kv_transfer_address="in-process://name"`
    gets the `role` end of the in-process pair `name`: a prefill and a decode engine given the
    same address meet here. The engine knows only tcp://; this swaps its transport factory
    (transfer_worker.make_transport) for the body, so no configuration reaches this module.
    Any other address still goes to the engine's own factory."""
    own = transfer_worker.make_transport

    def make(address: str, role: str, transfer_timeout_seconds: float) -> KVTransport:
        if address.startswith(ADDRESS):
            return fake_transport(address.removeprefix(ADDRESS), role)
        return own(address, role, transfer_timeout_seconds)

    transfer_worker.make_transport = make
    try:
        yield
    finally:
        transfer_worker.make_transport = own
