"""The worker side of the transfer connector: a rank's transport, and the transfers under way.

The scheduler side (disagg/connector.py) decides; this side moves bytes. Each step's
`TransferMetadata` names sends, receives and cancels; `start_load_kv` hands them to the
transport, which runs them in the background (whole requests, asynchronously, as NIXL does: a
transfer may span many steps, so `wait_for_save` has nothing to wait for). After each step the
engine asks `take_output` which transfers drained: done sending, done receiving, and which of
them failed (an error, a refusal, or a cancel), with the receive blocks they leave invalid.

The transport comes from `kv_transfer_address`: a private gloo pair between this engine and its
peer, which meet at a TCP store, `tcp://host:port` (the decode engine serves it) or
`store://host:port` (another process serves it: DisaggClient, on a port the OS picked). The
tests and the notebook pair two engines of one process by swapping `make_transport`
(harness/fake_transport.py); no address of the engine reaches that harness. Its per-transfer
deadline is shorter than the state machine's `transfer_timeout_seconds`, so a transfer the state
machine gave up on drains soon after.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..kv_connector.base import (
    KVConnectorMetadata,
    KVConnectorWorker,
    KVPool,
    TransferEnd,
    TransferTracker,
)
from .transport import GlooTransport, KVTransport, TransferHandle

if TYPE_CHECKING:
    from ..kv_cache import PagedKVCache

TRANSPORT_DEADLINE_SHARE = 0.8  # of transfer_timeout_seconds: drained before the state gives up
CONNECT_TIMEOUT_SECONDS = 120.0  # both engines load their model before they meet


def make_transport(address: str, role: str, transfer_timeout_seconds: float) -> KVTransport:
    """The transport `address` names, as `role`'s end ("prefill" or "decode")."""
    if address.startswith(("tcp://", "store://")):
        rank = 0 if role == "decode" else 1  # decode serves a tcp:// store: it outlives prefills
        deadline = TRANSPORT_DEADLINE_SHARE * transfer_timeout_seconds
        serve = address.startswith("tcp://")
        return GlooTransport(rank, address, deadline, CONNECT_TIMEOUT_SECONDS, serve)
    raise ValueError(f"kv_transfer_address must be tcp:// or store://host:port, not {address!r}")


class TransferConnectorWorker(KVConnectorWorker):
    """A rank's transfers: started from the step's metadata, reported once drained."""

    def __init__(self, address: str, role: str, transfer_timeout_seconds: float) -> None:
        self.address, self.role = address, role
        self.transfer_timeout_seconds = transfer_timeout_seconds
        self.transport: KVTransport | None = None
        self.pool: KVPool | None = None
        self._lock = threading.Lock()  # the runner's thread starts, the engine's thread reports
        self._handles: dict[str, tuple[str, TransferHandle, tuple[int, ...]]] = {}
        self.tracker = TransferTracker(self._ended, self._lock)

    def register_kv_caches(self, kv_cache: PagedKVCache) -> None:
        """The pool to read and write; meet the peer (blocks until it is there, bounded) and
        check that its blocks are laid out as ours: a ValueError at start-up, not a failed
        transfer per request later."""
        self.pool = KVPool.of(kv_cache)
        self.transport = make_transport(self.address, self.role, self.transfer_timeout_seconds)
        self.transport.handshake(self.pool)

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Cancel what the scheduler gave up on, then start the step's sends and receives (in
        the order given: a gloo pair is one stream, both ends must agree on it)."""
        sends = getattr(metadata, "sends", ())
        recvs = getattr(metadata, "recvs", ())
        cancels = getattr(metadata, "cancels", ())
        if not (sends or recvs or cancels):
            return
        assert self.transport is not None and self.pool is not None, "register_kv_caches first"
        with self._lock:
            for request_id in cancels:
                if request_id in self._handles:
                    self._handles[request_id][1].cancel()
            for request_id, block_ids in sends:
                handle = self.transport.start_send(request_id, self.pool, block_ids)
                self._handles[request_id] = ("send", handle, block_ids)
            for request_id, block_ids in recvs:
                handle = self.transport.start_recv(request_id, self.pool, block_ids)
                self._handles[request_id] = ("recv", handle, block_ids)

    def wait_for_save(self) -> None:
        """Transfers run across steps: nothing to wait for at a step's end."""

    def _ended(self) -> Iterator[TransferEnd]:
        """The transfers drained since the last report (the tracker holds `_lock`): a failure
        is an error, a refusal or a cancel, and leaves a receive's blocks invalid."""
        for request_id, (kind, handle, block_ids) in list(self._handles.items()):
            if handle.done():
                del self._handles[request_id]
                ok = handle.error is None and not handle.cancelled
                yield TransferEnd(request_id, kind == "send", ok, block_ids)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def close(self) -> None:
        """Stop the transport (a transfer under way ends by its deadline)."""
        if self.transport is not None:
            self.transport.close()
