"""What the prefill and the decode engine's transfer connectors share (disagg/connector.py):
the step's metadata for the worker side (disagg/transfer_worker.py), the control-message mailboxes
between the two engines, the state machine's effects taken each step, and the clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..kv_connector.base import ConnectorStats, KVConnectorMetadata, KVConnectorScheduler
from .transfer_sides import DecodeTransfers, PrefillTransfers
from .transfer_state import Effects, PeerMessage

if TYPE_CHECKING:
    from ..kv_cache import KVCacheManager
    from ..request import Request


@dataclass(frozen=True, slots=True)
class TransferMetadata(KVConnectorMetadata):
    """One step's transfers for the worker side: sends (no blocks: a refusal), receives, and
    transfers to cancel."""

    sends: tuple[tuple[str, tuple[int, ...]], ...] = ()
    recvs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    cancels: tuple[str, ...] = ()


def wants(request: Request, key: str) -> dict[str, Any] | None:
    params = request.kv_transfer_params
    return params if params and params.get(key) else None


class TransferConnector(KVConnectorScheduler):
    """What both roles share: the state machine, the mailboxes, the clock."""

    side: PrefillTransfers | DecodeTransfers
    loads_are_cache_hits = False  # a decode engine receives KV computed for the request

    def __init__(self, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.block_size, self.clock = kv, kv.block_size, clock
        self.stats = ConnectorStats()
        self._inbox: list[PeerMessage] = []
        self._outbox: list[PeerMessage] = []
        self._cancels: list[str] = []
        self._sent: list[str] = []  # finished requests whose held blocks may be freed now

    def deliver(self, messages: Iterable[PeerMessage]) -> None:
        """Control messages from the other engine, applied at the next schedule."""
        self._inbox.extend(messages)

    def take_peer_messages(self) -> list[PeerMessage]:
        """Control messages for the other engine (the front end relays them)."""
        out, self._outbox = self._outbox, []
        return out

    def has_pending(self) -> bool:
        """A transfer or a message is still under way: the engine must keep polling."""
        return bool(self.side.records or self._inbox or self._outbox)

    def num_jobs_in_flight(self) -> int:
        return sum(r.in_flight for r in self.side.records.values())

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Nothing to do here (the decode side overrides it)."""

    def _collect(self) -> Effects:
        """Take the state machine's effects: cancels go to the workers, messages out."""
        effects = self.side.drain()
        self._cancels.extend(effects.cancel)
        self._outbox.extend(effects.to_peer)
        return effects

    def _metadata(self, sends: list, recvs: list) -> TransferMetadata | None:
        cancels, self._cancels = tuple(self._cancels), []
        if not (sends or recvs or cancels):
            return None
        return TransferMetadata(tuple(sends), tuple(recvs), cancels)
