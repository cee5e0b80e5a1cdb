"""Moving whole KV blocks between the device pool and a host pool, off the compute path.

A transfer copies a list of blocks, every layer's K and V, from one pool to the other: a *store*
(device -> host) or a *load* (host -> device). A step's stores go as one batch and its loads as
another (offload/copy_plan.py plans them): one gather of the source blocks into a contiguous staging
tensor, the host side by runs of consecutive host blocks (one copy each, straight into the host
pool, whose blocks are contiguous), and on the device one scatter (`index_copy_`). Batches run in
submission order on one copy lane, so a step's forward runs while they copy, and a store may stay
in flight across steps: its end is polled each step, never waited for at the step's end. Two
orderings make it correct, and both are bugs vLLM shipped:

- A batch starts only after the compute queued before it (`fence`). A store that overtakes the
  forward still writing its block copies stale K/V (vLLM #45704: the copy stream did not wait
  for the compute stream, garbled output); a load that overtakes the forward still reading the
  block it overwrites corrupts that forward (#47282).
- The compute comes after a transfer that touches a block it uses: before a forward writes a
  block a store still reads, or a load still writes (`OffloadingConnectorWorker.
  handle_preemptions`; vLLM PR #29870), and before a forward reads a load's blocks
  (`order_compute_after`).

On CUDA the host pool is pinned memory, the batch is queued on a side stream that waits on an
event recorded on the compute stream (the fence), and its end is an event recorded after it:
polled with `query()`, and "the compute comes after it" is the compute stream waiting on that
event, no host wait (`CudaLane`: the stream and its events; a test hands in a stand-in to run
this path on a CPU). On a CPU the host pool is a plain second pool, the fence a
`threading.Event`, one copy thread runs the batches and its futures say when each ended; the
compute there is the host, so ordering it after a transfer is a host wait. `delay` (seconds, or a
function of the job) and `fail` (a predicate) are injected by tests to make each race
reproducible. A delay holds its batch in flight, never the caller, on both paths: on CUDA the
copy thread waits it out, then queues the batch on the stream and waits for its end (spent at
submission instead, a held store blocked the very step that was to release it, and a slow one
had ended before the next forward: the H100 run). A host polls an end (`wait_end`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import torch

from stages.common.step_wait import wait_until

from ..kv_connector.base import KVPool
from .copy_plan import Batch, BatchPlan, TransferJob, TransferLedger, plan_batch

__all__ = [
    "CopyEngine",
    "CudaLane",
    "Fence",
    "KVPool",
    "TransferJob",
    "compute_fence",
    "copy_batch",
]

logger = logging.getLogger(__name__)

WAIT_TIMEOUT_SECONDS = 120.0  # the longest anyone waits for a transfer before giving up

Fence = threading.Event | torch.cuda.Event | None


class CudaLane:
    """The copy lane on a GPU: a side stream, and CUDA events as fences and as batch ends (an
    event has `query()`, which `wait_end` polls). Its own class so that a stand-in drives the CUDA
    path of `CopyEngine` on a CPU (tests/test_12_host_copies.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def queue(self) -> torch.cuda.StreamContext:
        """Copies queued inside this context run on the copy stream."""
        return torch.cuda.stream(self.stream)

    def wait_fence(self, fence: torch.cuda.Event) -> None:
        """What is queued on the copy stream from now on runs after `fence`."""
        self.stream.wait_event(fence)

    def record_end(self) -> torch.cuda.Event:
        """An event after everything queued on the copy stream so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def compute_waits_for(self, end: torch.cuda.Event) -> None:
        """The compute queued from now on (the current stream) runs after `end`."""
        torch.cuda.current_stream(self.device).wait_event(end)

    @staticmethod
    def wait_end(end: torch.cuda.Event, seconds: float) -> bool:
        """Wait until `end` has passed, at most `seconds` (False: not). Polled: a batch fenced
        after a hung compute (a dead peer's collective) never ends, and synchronize() hangs."""
        try:
            wait_until(end.query, lambda: None, seconds)
        except TimeoutError:
            return False
        return True


def host_pool_like(device_k: torch.Tensor, num_blocks: int) -> KVPool:
    """A host pool with the device pool's block shape: pinned when the device is a GPU (so a
    copy is asynchronous), plain memory on a CPU. The storage is block-major, so one block (all
    its layers) and a run of consecutive blocks are each one contiguous piece of memory; the
    tensors are views indexed like the device pool's."""
    pin = device_k.device.type == "cuda"
    shape = (num_blocks, device_k.shape[0], *device_k.shape[2:])
    k, v = (torch.zeros(shape, dtype=device_k.dtype, pin_memory=pin) for _ in range(2))
    return KVPool(k.transpose(0, 1), v.transpose(0, 1))


def copy_batch(plan: BatchPlan, device: KVPool, host: KVPool, keep: list[object]) -> None:
    """Queue one batch's copies (on the current stream): per tensor one gather into a
    contiguous staging tensor, one copy per run of consecutive host blocks (non-blocking: from
    and into pinned memory on CUDA), and for a load one scatter into the device blocks. `keep`
    receives the temporaries, which must live until the batch has ended."""
    where = device.k.device
    index = torch.tensor(plan.device, dtype=torch.long, pin_memory=where.type == "cuda")
    index = index.to(where, non_blocking=True)
    keep.append(index)
    for on_device, on_host in zip(device.tensors(), host.tensors(), strict=True):
        device_blocks, host_blocks = on_device.transpose(0, 1), on_host.transpose(0, 1)
        if plan.kind == "store":
            staged = device_blocks.index_select(0, index)  # [n, layers, ...], contiguous
            for run in plan.runs:
                rows = staged[run.start : run.start + run.length]
                host_blocks[run.host_block : run.host_block + run.length].copy_(
                    rows, non_blocking=True
                )
        else:
            staged = torch.empty(
                (plan.num_blocks, *host_blocks.shape[1:]), dtype=on_device.dtype, device=where
            )
            for run in plan.runs:
                rows = host_blocks[run.host_block : run.host_block + run.length]
                staged[run.start : run.start + run.length].copy_(rows, non_blocking=True)
            device_blocks.index_copy_(0, index, staged)
        keep.append(staged)


class CopyEngine:
    """Runs batches of transfers between `device` and `host` in submission order, one lane."""

    def __init__(
        self,
        device: KVPool,
        host: KVPool,
        delay: float | Callable[[TransferJob], float] = 0.0,
        fail: Callable[[TransferJob], bool] | None = None,
        lane: CudaLane | None = None,
    ) -> None:
        self.device, self.host = device, host
        self.delay, self.fail = delay, fail
        if lane is None and device.k.device.type == "cuda":
            lane = CudaLane(device.k.device)
        self._lane = lane  # None: a CPU, the copy thread runs every batch
        self._ledger = TransferLedger()
        self._lock = threading.Lock()
        self._finished: list[tuple[TransferJob, bool]] = []  # ended, not yet taken
        self._thread: ThreadPoolExecutor | None = None  # a CPU's copy thread, on first use
        self._finalizer: weakref.finalize | None = None

    def submit(self, job: TransferJob, fence: Fence = None) -> None:
        """Queue one job as a batch of its own."""
        self.submit_batch((job,), fence)

    def submit_batch(self, jobs: Sequence[TransferJob], fence: Fence = None) -> None:
        """Queue `jobs` (one direction) as one batch: it starts once `fence` is done and every
        earlier batch has ended. Returns without waiting for the copy (nor for an injected
        delay: on CUDA a delayed batch, and any after it while one is held, goes through the
        copy thread, which keeps the lane's order)."""
        batch = Batch(tuple(jobs))
        with self._lock:
            self._poll()
            held = any(isinstance(b.handle, Future) for b in self._ledger.batches())
        if self._lane is not None and not (self.delay or held):
            self._queue_on_stream(batch, fence)
        else:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-copy")
                self._finalizer = weakref.finalize(self, self._thread.shutdown, wait=False)
            batch.handle = self._thread.submit(self._on_thread, batch, fence)
        with self._lock:
            self._ledger.add(batch)

    def in_flight(self) -> list[TransferJob]:
        """The jobs submitted and not ended yet, in submission order."""
        with self._lock:
            self._poll()
            return self._ledger.in_flight()

    def touching(self, write_blocks: frozenset[int]) -> list[str]:
        """Jobs in flight that read (a store) or write (a load) one of `write_blocks`."""
        with self._lock:
            self._poll()
            return self._ledger.touching(write_blocks)

    def unordered_store_reads(self, write_blocks: frozenset[int]) -> list[tuple[TransferJob, set]]:
        """Stores in flight reading one of `write_blocks` that the compute does not wait for."""
        with self._lock:
            self._poll()
            return self._ledger.unordered_store_reads(write_blocks)

    def wait(self, job_ids: Iterable[str], timeout: float = WAIT_TIMEOUT_SECONDS) -> None:
        """Block the host until no job in `job_ids` is in flight (each ended, well or not)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._poll()
            batches = self._ledger.holding(job_ids)
        for batch in batches:
            left = max(0.0, deadline - time.monotonic())
            if isinstance(batch.handle, Future):
                ended = bool(wait_futures([batch.handle], left).done)
            else:
                ended = self._lane is not None and self._lane.wait_end(batch.handle, left)
            if not ended:
                raise TimeoutError(f"KV transfers {[j.job_id for j in batch.jobs]} hung")
        with self._lock:
            self._poll()

    def order_compute_after(self, job_ids: Iterable[str]) -> None:
        """The compute queued from now on runs after these transfers. CUDA: the current stream
        waits on their end events (no host wait); a CPU computes on the host: it waits, as it
        does on CUDA for a batch the copy thread still holds (no event to wait on yet)."""
        job_ids = list(job_ids)
        if self._lane is None:
            self.wait(job_ids)
            return
        with self._lock:
            self._poll()
            batches = self._ledger.holding(job_ids)
        on_thread = [j.job_id for b in batches if isinstance(b.handle, Future) for j in b.jobs]
        if on_thread:
            self.wait(on_thread)
        with self._lock:
            for batch in batches:
                if not isinstance(batch.handle, Future):
                    self._lane.compute_waits_for(batch.handle)
                    batch.compute_waits = True

    def take_finished(self) -> list[tuple[TransferJob, bool]]:
        """Jobs ended since the last call, with whether each succeeded (polled, no wait)."""
        with self._lock:
            self._poll()
            finished, self._finished = self._finished, []
            return finished

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------------ internals
    def _poll(self) -> None:
        """Move the batches that ended (in order) to `_finished`; the caller holds the lock."""
        self._finished += self._ledger.poll(_ended, _raised)

    def _execute(self, batch: Batch, fence: Fence) -> None:
        """Run one batch: wait for its fence (the compute queued before it), wait the injected
        delay, leave out the jobs the injected failure names, copy the rest as one batch. It
        raises when the copy does (the batch then fails; the lane goes on)."""
        if isinstance(fence, threading.Event) and not fence.wait(WAIT_TIMEOUT_SECONDS):
            raise TimeoutError(f"the compute before KV transfers {batch.jobs} never ended")
        if fence is not None and not isinstance(fence, threading.Event):
            assert self._lane is not None, "a CUDA fence on a CPU copy engine"
            self._lane.wait_fence(fence)
        delay = sum(self.delay(j) if callable(self.delay) else self.delay for j in batch.jobs)
        if delay:
            time.sleep(delay)
        batch.failed = {j.job_id for j in batch.jobs if self.fail is not None and self.fail(j)}
        todo = [j for j in batch.jobs if j.job_id not in batch.failed]
        if todo:
            with torch.inference_mode():
                copy_batch(plan_batch(todo), self.device, self.host, batch.keep_alive)

    def _queue_on_stream(self, batch: Batch, fence: Fence) -> None:
        """CUDA: queue the batch on the copy stream and mark its end with an event, whatever
        happens (a copy that raised fails its batch; the copies queued before it still end)."""
        assert self._lane is not None
        with self._lane.queue():
            try:
                self._execute(batch, fence)
            except Exception:
                logger.exception("KV copy batch %s failed", [j.job_id for j in batch.jobs])
                batch.failed = {j.job_id for j in batch.jobs}
            finally:
                batch.handle = self._lane.record_end()

    def _on_thread(self, batch: Batch, fence: Fence) -> None:
        """The copy thread's batch. On a CPU: `_execute`. On CUDA (a delay was injected): queue
        it on the copy stream after the delay, then wait for its end, so that the future ends
        when the copy does (a copy that raised fails the batch, as on a CPU)."""
        if self._lane is None:
            self._execute(batch, fence)
            return
        with self._lane.queue():
            try:
                self._execute(batch, fence)
            finally:
                if not self._lane.wait_end(self._lane.record_end(), WAIT_TIMEOUT_SECONDS):
                    raise TimeoutError(f"KV transfers {[j.job_id for j in batch.jobs]} hung")


def _ended(batch: Batch) -> bool:
    handle = batch.handle
    return handle.done() if isinstance(handle, Future) else bool(handle.query())


def _raised(batch: Batch) -> bool:
    """A CPU batch whose copy raised: logged, and every job of it fails."""
    if not isinstance(batch.handle, Future) or batch.handle.exception() is None:
        return False
    error = batch.handle.exception()
    logger.warning("KV copy batch %s failed: %r", [j.job_id for j in batch.jobs], error)
    return True


def compute_fence(device: torch.device) -> Fence:
    """A fence after the compute queued so far: a CUDA event on the current stream; on a CPU
    None, since transfers are submitted by the thread that ran that compute, after it."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
