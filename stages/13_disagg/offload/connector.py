"""KV offloading: a host-memory tier behind the device pool, as one KV connector.

The device pool is small and precious; host memory is large and slow. Two uses of a second tier:

- Swap preemption (vLLM V0's `swap_out`, `preemption_mode="swap"`): when the pool runs out, the
  victim's blocks are stored in the host tier instead of discarded, and loaded back when it
  resumes, so it recomputes nothing. (V0 aborted a request when swap space ran out, #588, #787;
  here a victim that does not fit recomputes.)
- A prefix tier (vLLM V1's OffloadingConnector, LMCache): a cached block the device pool evicts is
  stored under its content key, so a later prefix hit in the host tier loads it back, counted as
  cached tokens, instead of recomputing it.

The scheduler side (`OffloadingConnectorScheduler`) keeps the host tier's ledger
(offload/manager.py) and turns preemptions, evictions and hits into transfer jobs, carried to
every rank in the step's `OffloadMetadata`. The worker side (`OffloadingConnectorWorker`) runs them
on its rank's shard with a copy engine (offload/copy_engine.py): the step's stores as one batch, its
loads as another, started before the forward and never waited for at the step's end. A transfer ends
in a later step as often as not; its end is polled, reported, and only then acted on:

    stores and loads start after the compute queued before them (the fence: #45704, #47282)
    the forward writes no block a store still reads or a load still writes (handle_preemptions:
      PR #29870); on CUDA the compute stream waits for those copies, the host does not
    a swapped-out request resumes only once its store is reported done (#46014)
    a key is loadable only once its store is reported done; a failed store frees its blocks
    a loaded request runs only once its load is reported done, and the next step's metadata
      names that load so every rank orders its forward after its own copy (`loads_done`)
    a failed load sends its request back to recompute; the other requests never notice
    a step that runs no forward waits for every transfer in flight (`flush`: nothing to overlap),
      so requests waiting on a transfer are no livelock and an idle engine holds none
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..kv_connector.base import (
    ConnectorStats,
    ConnectorUpdate,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVPool,
    ScheduledStep,
    TransferEnd,
    TransferTracker,
)
from .copy_engine import CopyEngine, TransferJob, compute_fence, host_pool_like
from .manager import LRUOffloadManager

if TYPE_CHECKING:
    from ..kv_cache import KVCacheManager, PagedKVCache
    from ..request import Request

SWAP = "swap"  # the first element of a swapped-out block's key


@dataclass(frozen=True, slots=True)
class OffloadMetadata(KVConnectorMetadata):
    """One step's transfers: stores first (a block freed and handed out again in this step is
    read before it is written), then loads; the loads reported ended since the last step (this
    step's forward may read their blocks); and whether the step runs no forward (`flush`: it
    waits for every transfer in flight)."""

    stores: tuple[TransferJob, ...] = ()
    loads: tuple[TransferJob, ...] = ()
    loads_done: tuple[str, ...] = ()
    flush: bool = False


@dataclass(slots=True)
class _Swap:
    """A swapped-out request: its host keys, how many tokens they hold, the store's state."""

    keys: tuple[Hashable, ...]
    num_tokens: int
    store_id: str
    state: Literal["storing", "stored"] = "storing"
    discard: bool = False  # the request left while its store was in flight


class OffloadingConnectorScheduler(KVConnectorScheduler):
    """Swap preemption and the host prefix tier, decided beside the scheduler."""

    def __init__(self, manager: LRUOffloadManager, kv: KVCacheManager, prefix_tier: bool) -> None:
        self.manager, self.kv, self.prefix_tier = manager, kv, prefix_tier
        self.block_size = kv.block_size
        self.stats = ConnectorStats()
        self._ids = itertools.count()
        self._stores: list[TransferJob] = []  # this step's, not yet in a metadata
        self._loads: list[TransferJob] = []
        self._jobs: dict[str, tuple[TransferJob, tuple[Hashable, ...]]] = {}  # in flight
        self._swaps: dict[str, _Swap] = {}  # request id -> its swapped-out KV
        self._planned: dict[str, tuple[Hashable, ...]] = {}  # keys a load will read, by request
        self._loads_done: list[str] = []  # loads reported ended, for the next metadata

    def holds_swap(self, request_id: str) -> bool:
        """Whether the host tier holds this request's swapped-out KV (/metrics counts them)."""
        return request_id in self._swaps

    # ------------------------------------------------------------------ scheduler hooks
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A swapped-out request: its swapped tokens after the device hit (None while its store
        is in flight: it waits, #46014). Any other: the run of its full blocks after the device
        hit that the host prefix tier holds, ready. Never its last token."""
        first, size = num_computed_tokens // self.block_size, self.block_size
        limit = request.num_tokens - 1  # the last token is always computed: it is sampled from
        swap = self._swaps.get(request.request_id)
        if swap is not None:
            if swap.state == "storing":
                return None, False
            found = self.manager.lookup(swap.keys[first:])
            end = min(swap.num_tokens, (first + found) * size, limit)
            if end > num_computed_tokens:
                self._planned[request.request_id] = swap.keys[first : -(-end // size)]
                return end - num_computed_tokens, True
            # Nothing to load: the device's prefix cache still holds every swapped token (its
            # blocks were freed but not reused: nothing lost), or the host evicted them (lost:
            # the rest is recomputed). With steps one at a time the first is common: a victim
            # comes back a step or two later, its freed blocks still cached.
            lost = num_computed_tokens < min(swap.num_tokens, limit)
            self._drop_swap(request.request_id, lost=lost)
        if not self.prefix_tier:
            return 0, False
        keys = tuple(self.kv.block_contents(request, limit // size)[first:])
        found = self.manager.lookup(keys)
        if not found:
            return 0, False
        self._planned[request.request_id] = keys[:found]
        return found * size, True

    def update_state_after_alloc(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Queue the load of the planned keys into the blocks after the device hit (the
        scheduler calls this before it moves `num_computed_tokens` past the external ones)."""
        first = request.num_computed_tokens // self.block_size
        count = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size) - first
        keys = self._planned.pop(request.request_id)[:count]
        host_blocks = self.manager.prepare_load(keys)
        self.manager.touch(keys)
        job = TransferJob(
            f"load-{next(self._ids)}",
            "load",
            tuple(host_blocks),
            tuple(block_ids[first : first + count]),
            request.request_id,
        )
        self._loads.append(job)
        self._jobs[job.job_id] = (job, keys)
        self.stats.tokens_loaded += num_external_tokens
        self.stats.blocks_loaded += count

    def request_preempted(self, request: Request, block_ids: Sequence[int]) -> bool:
        """Swap the victim out: store its blocks that hold computed tokens under fresh keys.
        False (it recomputes) when the host tier cannot make room."""
        self._drop_swap(request.request_id)
        num_tokens = request.num_computed_tokens
        count = -(-num_tokens // self.block_size)
        if count == 0:
            return False
        keys = tuple((SWAP, request.request_id, next(self._ids), i) for i in range(count))
        job = self._store(keys, block_ids[:count], request.request_id)
        if job is None:
            return False
        self._swaps[request.request_id] = _Swap(keys, num_tokens, job.job_id)
        return True

    def build_connector_meta(self, scheduler_output: ScheduledStep) -> OffloadMetadata | None:
        """The step's stores (swap-outs, then the device pool's evictions when the prefix tier
        is on) and loads, the loads that ended since the last step, and `flush` when the step
        runs no forward while transfers are in flight; None when there is nothing of these."""
        for block, content in self.kv.drain_evictions():
            if self.prefix_tier:
                self._store((content,), (block,), None)
        flush = not scheduler_output.requests and bool(self._jobs)
        if not (self._stores or self._loads or self._loads_done or flush):
            return None
        metadata = OffloadMetadata(
            tuple(self._stores), tuple(self._loads), tuple(self._loads_done), flush
        )
        self._stores, self._loads, self._loads_done = [], [], []
        return metadata

    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        """Stores ended: their keys become loadable (or are freed, on failure), and a swapped
        request may resume. Loads ended: their host blocks lose a reference; each request is
        loaded, or failed (it recomputes)."""
        loaded: list[str] = []
        failed: list[str] = []
        for job_id in sorted(output.finished_sending | output.finished_recving):
            entry = self._jobs.pop(job_id, None)
            if entry is None:
                continue
            job, keys = entry
            ok = job_id not in output.failed
            if job.kind == "store":
                self.manager.complete_store(keys, ok)
                self.stats.blocks_stored += len(keys) if ok else 0
                self.stats.store_failures += not ok
                swap = self._swaps.get(job.request_id or "")
                if swap is not None and swap.store_id == job_id:
                    swap.state = "stored"
                    if swap.discard or not ok:  # left meanwhile, or it must recompute
                        self._drop_swap(job.request_id or "", lost=not ok)
                continue
            ok = ok and output.invalid_block_ids.isdisjoint(job.dst_blocks)
            self._loads_done.append(job_id)
            self.manager.complete_load(keys)
            assert job.request_id is not None
            (loaded if ok else failed).append(job.request_id)
            self.stats.load_failures += not ok
            swap = self._swaps.get(job.request_id)
            if swap is not None:  # swapped in (or failed): its keys are done with
                self.stats.swapped_in += ok
                self._drop_swap(job.request_id, lost=not ok)
            self.manager.discard(k for k in keys if _is_swap_key(k))
        return ConnectorUpdate(tuple(loaded), tuple(failed))

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, Any]:
        """Offloading never reads a finished request's device blocks after its step: free them
        now. Its swapped-out KV goes (once its store ends, if it is in flight)."""
        self._planned.pop(request.request_id, None)
        swap = self._swaps.get(request.request_id)
        if swap is not None and swap.state == "storing":
            swap.discard = True
        else:
            self._drop_swap(request.request_id)
        return False, None

    # ------------------------------------------------------------------ internals
    def _store(
        self, keys: Sequence[Hashable], device_blocks: Sequence[int], request_id: str | None
    ) -> TransferJob | None:
        """A store job for the keys the host tier does not hold yet; None when it cannot make
        room. Keys already held are only marked recently used."""
        prepared = self.manager.prepare_store(keys)
        if prepared is None:
            return None
        self.manager.touch(keys)
        by_key = dict(zip(keys, device_blocks, strict=True))
        src = tuple(by_key[k] for k in prepared.keys_to_store)
        job_id = f"store-{next(self._ids)}"
        job = TransferJob(job_id, "store", src, prepared.host_blocks, request_id)
        if src:
            self._stores.append(job)
            self._jobs[job.job_id] = (job, prepared.keys_to_store)
        return job

    def _drop_swap(self, request_id: str, lost: bool = False) -> None:
        """Forget a request's swapped-out KV and free its host blocks (those idle)."""
        swap = self._swaps.pop(request_id, None)
        if swap is not None:
            self.manager.discard(swap.keys)
            self.stats.swap_lost += lost

    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)


def _is_swap_key(key: Hashable) -> bool:
    return isinstance(key, tuple) and len(key) == 4 and key[0] == SWAP


class OffloadingConnectorWorker(KVConnectorWorker):
    """A rank's copies between its device pool and its host pool of `num_host_blocks`."""

    def __init__(self, num_host_blocks: int) -> None:
        self.num_host_blocks = num_host_blocks
        self.engine: CopyEngine | None = None
        self._flush = False  # this step runs no forward: its end waits for every transfer
        self.tracker = TransferTracker(self._ended)

    def register_kv_caches(self, kv_cache: PagedKVCache) -> None:
        device = KVPool.of(kv_cache)
        self.engine = CopyEngine(device, host_pool_like(device.k, self.num_host_blocks))

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Queue the step's stores as one batch, then its loads as another, after the compute
        queued so far; then order the compute after the loads that ended since the last step
        (this step's forward may read their blocks; on this rank the copy may still run)."""
        if not isinstance(metadata, OffloadMetadata):
            return
        assert self.engine is not None, "register_kv_caches first"
        fence = compute_fence(self.engine.device.k.device)
        for batch in (metadata.stores, metadata.loads):
            if batch:
                self.engine.submit_batch(batch, fence)
        if metadata.loads_done:
            self.engine.order_compute_after(metadata.loads_done)
        self._flush = metadata.flush

    def handle_preemptions(self, write_blocks: frozenset[int]) -> None:
        """Before the forward writes `write_blocks`: order it after every transfer in flight
        that touches one of them (a store still reading a victim's or an evicted block handed
        out again, a load still writing a block its aborted request gave back), then check
        the invariant that no store reads one unordered. The others run on."""
        if self.engine is None:
            return
        self.engine.order_compute_after(self.engine.touching(write_blocks))
        self.check_no_store_reads(write_blocks)

    def check_no_store_reads(self, write_blocks: frozenset[int]) -> None:
        """The invariant: no store in flight reads a block the forward writes, unless the
        compute waits for it."""
        if self.engine is None:
            return
        if clashes := self.engine.unordered_store_reads(write_blocks):
            job, clash = clashes[0]
            raise AssertionError(f"the forward overwrites blocks {sorted(clash)} that {job} reads")

    def wait_for_save(self) -> None:
        """End of the step: stores and loads run on (their end is polled by `take_output`),
        except in a step without a forward (`flush`), which waits for all of them."""
        if self.engine is not None and self._flush:
            self.engine.wait(job.job_id for job in self.engine.in_flight())
        self._flush = False

    def _ended(self) -> Iterator[TransferEnd]:
        """The copies that ended since the last report (a load's blocks: invalid if it failed)."""
        if self.engine is not None:
            for job, ok in self.engine.take_finished():
                yield TransferEnd(job.job_id, job.kind == "store", ok, job.dst_blocks)
