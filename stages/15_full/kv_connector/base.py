"""The KV connector: how KV blocks enter and leave the device pool other than by computing them.

A connector has two halves, as vLLM's `KVConnectorBase_V1` (`kv_connector/v1/base.py`) does:

    scheduler side (one, beside the Scheduler)       worker side (one per rank, beside its runner)
    get_num_new_matched_tokens: how many tokens     register_kv_caches: the device pool to copy
      of a request can come from elsewhere           start_load_kv: start the step's transfers
    update_state_after_alloc: the device blocks      handle_preemptions: order the forward
      they go to, once the scheduler allocated them    after transfers on blocks it writes
    build_connector_meta: the step's transfers,      wait_for_save: what must end with the step
      as plain data inside the SchedulerOutput       take_output: which transfers ended, which
    update_connector_output: what the workers          failed, which blocks hold no valid KV
      reported finished                                after a load (get_finished, get_block_
    request_finished: may the request's blocks be      ids_with_load_errors, in one call)
      freed now, or only once a transfer drains?

The step's metadata travels inside the scheduler's output, so every tensor-parallel rank gets
the same list of transfers and runs it on its own shard of the cache, and every rank reports
what ended: `KVOutputAggregator` makes one report of them for the scheduler. Stage 12's
offloading (offload/connector.py) is one connector: a host-memory tier behind the device pool. Stage
13's transfer between a prefill and a decode engine is another (disagg/connector.py). No connector
configured: stage 11 exactly.
Both worker sides keep their reports in one `TransferTracker` and move one kind of `KVPool`.

This engine loads external KV asynchronously only (`load_async`): a request whose tokens come
from the connector waits outside the batch (vLLM's WAITING_FOR_REMOTE_KVS) until its load is
reported finished, then is scheduled like a prefix-cache hit. A failed load never reaches a
forward: the request recomputes instead.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

from ..quant.kv_cache import block_tensors

if TYPE_CHECKING:
    import torch

    from ..kv_cache import PagedKVCache
    from ..request import Request


class ScheduledStep(Protocol):
    """What a connector reads of the scheduler's output (scheduler.py's `SchedulerOutput`). It
    is named by its shape: the scheduler imports this module, never the other way round."""

    @property
    def requests(self) -> Sequence[Any]: ...


@dataclass(slots=True)
class KVPool:
    """The blocks a worker-side connector moves: K and V of every layer, each
    `[num_layers, num_blocks, block_size, kv_heads, head_dim]`, and the per-block tensors that
    travel with them (stage 14: a quantized cache's `k_scale`, `v_scale`
    [num_layers, num_blocks, kv_heads]; empty for a float cache). The host tier copies them to
    a host pool of the same shape (offload/copy_engine.py), the transfer sends them to another
    engine."""

    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, ...] = ()

    @classmethod
    def of(cls, kv_cache: PagedKVCache) -> KVPool:
        """The pool of a rank's paged KV cache (its tensors, not a copy)."""
        k, v, *scales = block_tensors(kv_cache)
        return cls(k, v, tuple(scales))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds a block's state; copying a block copies index `block` of
        dim 1 of each, in this order (`kv_quant.block_tensors`: K, V, then the scales)."""
        return block_tensors(self)


class KVConnectorMetadata:
    """A step's transfers, built by the scheduler side for the worker side: plain data, picklable
    (it crosses to every tensor-parallel rank inside the SchedulerOutput)."""


@dataclass(frozen=True, slots=True)
class KVConnectorOutput:
    """What the worker side reports after a step: the transfers that ended since the last report
    (their ids, as the metadata named them), which of them failed, and the device blocks whose
    load failed."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[int] = frozenset()

    @property
    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class KVOutputAggregator:
    """Every rank's reports made into the one the scheduler reads, as vLLM's
    `KVOutputAggregator` (kv_connector/utils.py) does. Each rank moves its own shard of a
    transfer's blocks (its KV heads), so a transfer has ended only once every rank has reported
    it: one rank done while another still copies is not done. A transfer that failed on any
    rank failed, and is reported so beside its end (the scheduler reads `failed` for the ids
    that end); a block any rank could not load is invalid at once. Ranks may report an end in
    different rounds: the count carries over."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._remaining: dict[tuple[bool, str], int] = {}  # (sending?, id) -> ranks yet to end
        self._failed: set[str] = set()  # failed on some rank, not yet ended on all

    def aggregate(self, reports: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """One report from a round of the ranks' reports (any number of them, in any order)."""
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        for report in reports:
            self._count(True, report.finished_sending, sending)
            self._count(False, report.finished_recving, recving)
            self._failed |= report.failed
            invalid |= report.invalid_block_ids
        failed = self._failed & (sending | recving)
        self._failed -= failed
        return KVConnectorOutput(
            frozenset(sending), frozenset(recving), frozenset(failed), frozenset(invalid)
        )

    def _count(self, sending: bool, ids: frozenset[str], ended: set[str]) -> None:
        for transfer_id in ids:
            left = self._remaining.pop((sending, transfer_id), self.world_size) - 1
            if left:
                self._remaining[sending, transfer_id] = left
            else:
                ended.add(transfer_id)


@dataclass(frozen=True, slots=True)
class ConnectorUpdate:
    """What the scheduler must do after a report: requests whose KV arrived (schedule them),
    requests whose load failed (recompute them), requests whose delayed free may happen now,
    and requests to fail, each with the reason (a transfer that failed, when the connector is
    told to fail the request rather than compute it here)."""

    loaded: tuple[str, ...] = ()
    load_failed: tuple[str, ...] = ()
    sent: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()


@dataclass
class ConnectorStats:
    """Counters a connector keeps for benchmarks (and, from stage 15, /health)."""

    tokens_loaded: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    load_failures: int = 0
    store_failures: int = 0
    swapped_in: int = 0  # swapped-out requests that came back by a load
    swap_lost: int = 0  # ... and those that had to recompute (evicted, or a copy failed)


class KVConnectorScheduler(ABC):
    """The scheduler's half: decides what moves, in plain data."""

    stats: ConnectorStats
    # Whether the tokens it loads were found in a cache, a prefix hit (the host tier), or were
    # computed for this very request by another engine and sent (stage 13): no hit, counted
    # as `stats.tokens_loaded` only.
    loads_are_cache_hits: ClassVar[bool] = True

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens after the `num_computed_tokens` already on the device that the connector can
        supply, and whether they arrive asynchronously. None: not known yet (a transfer the
        answer depends on is in flight), ask again at a later step. Never the last token: its
        logits are what the request samples from."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The scheduler allocated the request's blocks (`block_ids`, its whole table): queue
        the load of its `num_external_tokens` into the blocks after its computed ones."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: ScheduledStep) -> KVConnectorMetadata | None:
        """The step's transfers (None: none). Called once per schedule, after it."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        """Take the workers' report; say which requests changed state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, Any]:
        """The request left (finished or aborted). Returns (delay_free, transfer params):
        delay_free asks the scheduler to keep its blocks until a transfer reading them is
        reported in `finished_sending` under the request's id."""

    def request_preempted(self, request: Request, block_ids: Sequence[int]) -> bool:
        """The request is preempted and its blocks are about to be freed: True when the
        connector keeps its KV (swaps it out), so it resumes by loading instead of recomputing.
        The default keeps nothing."""
        return False


class TransferEnd(NamedTuple):
    """One transfer that ended: its id, its direction, whether it succeeded, and the device
    blocks it wrote (a receive's: invalid when it failed)."""

    transfer_id: str
    sending: bool  # a store or a send (it read device blocks); else a load or a receive
    ok: bool
    blocks: Sequence[int] = ()


class TransferTracker:
    """The worker side's ledger of ended transfers, one for both connectors (the host tier's
    copies, the transfer's sends and receives): what ended since the last report, sent or
    received, which of them failed, and the device blocks a failed receive left invalid.

    `poll` yields the transfers that ended since it was last called. The tracker calls it
    under `lock` (the runner's thread starts transfers, the engine's thread reports), so each
    report is one consistent cut: drained once, then forgotten."""

    def __init__(
        self, poll: Callable[[], Iterable[TransferEnd]], lock: threading.Lock | None = None
    ) -> None:
        self.poll = poll
        self.lock = lock or threading.Lock()
        self._ledgers: dict[str, set[Any]] = {
            name: set() for name in ("sent", "received", "failed", "invalid")
        }  # transfer ids, but block ids in "invalid"

    def take_output(self) -> KVConnectorOutput:
        """Everything that ended since the last report, as one KVConnectorOutput."""
        return KVConnectorOutput(*self._take("sent", "received", "failed", "invalid"))

    def take_finished(self) -> tuple[frozenset[str], frozenset[str]]:
        """(done sending, done receiving) since the last call."""
        sent, received = self._take("sent", "received")
        return sent, received

    def _take(self, *names: str) -> list[frozenset[Any]]:
        """The named ledgers, after taking what `poll` yields, then emptied."""
        with self.lock:
            ledgers = self._ledgers
            for end in self.poll():
                ledgers["sent" if end.sending else "received"].add(end.transfer_id)
                if not end.ok:
                    ledgers["failed"].add(end.transfer_id)
                    if not end.sending:
                        ledgers["invalid"].update(end.blocks)
            taken = [frozenset(ledgers[name]) for name in names]
            for name in names:
                ledgers[name].clear()
            return taken


class KVConnectorWorker(ABC):
    """A rank's half: moves the bytes the metadata names, on its own shard of the pool, and
    reports what ended through its `tracker`.

    vLLM's worker side also has per-layer hooks (`wait_for_layer_load`, `save_kv_layer`) for
    a connector that loads layer by layer into the step that reads it. This engine loads
    asynchronously only (a loaded request runs in a later step), so it has none."""

    tracker: TransferTracker

    @abstractmethod
    def register_kv_caches(self, kv_cache: PagedKVCache) -> None:
        """The device pool this rank's transfers read and write."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Start the step's transfers, ordered after the compute already queued: called in
        launch order, before the step's forward."""

    def handle_preemptions(self, write_blocks: frozenset[int]) -> None:  # noqa: B027
        """Before the forward writes `write_blocks`: wait for any transfer still reading them
        (vLLM's `handle_preemptions`: freed blocks are handed out again at once)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """At the end of the step: block until what must end with the step has ended. A
        connector whose transfers run across steps (the host tier's stores, polled by
        `take_output`) waits for nothing here."""

    def get_finished(self) -> tuple[frozenset[str], frozenset[str]]:
        """(done sending, done receiving): the transfer ids finished since the last call."""
        return self.tracker.take_finished()

    def take_output(self) -> KVConnectorOutput:
        """Everything finished since the last report, as one KVConnectorOutput: one
        consistent cut, where vLLM's worker side answers `get_finished` and
        `get_block_ids_with_load_errors` in two calls."""
        return self.tracker.take_output()
