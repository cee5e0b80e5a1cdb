"""Moving whole KV blocks between the device pool and a host pool, off the compute path.

A transfer copies a list of blocks, every layer's K and V, from one pool to the other: a *store*
(device -> host) or a *load* (host -> device). Transfers run one after another, in submission
order, on a background thread, so a step's forward runs while they copy. Two orderings make it
correct, and both are bugs vLLM shipped:

- A transfer starts only after the compute queued before it (`fence`). A store that overtakes
  the forward still writing its block copies stale K/V (vLLM #45704: the copy stream did not wait
  for the compute stream, garbled output); a load that overtakes the forward still reading the
  block it overwrites corrupts that forward (#47282).
- A block a store is still reading is not written by a forward (the worker side flushes such
  stores first, `OffloadingConnectorWorker.handle_preemptions`; vLLM PR #29870).

On CUDA the host pool is pinned memory and the copies are queued on a side stream that waits on
an event recorded on the compute stream (the fence); the thread then waits for the copy's own
event. On a CPU the host pool is a plain second pool, the fence is a `threading.Event`, and the
same thread copies: one code path. `delay` (seconds, or a function of the job) and `fail` (a
predicate) are injected by tests to make each race reproducible here.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from .kv_quant import block_tensors

WAIT_TIMEOUT_SECONDS = 120.0  # the longest anyone waits for a transfer before giving up

Fence = threading.Event | torch.cuda.Event | None


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One transfer: plain data (it travels in the step's metadata to every rank)."""

    job_id: str
    kind: Literal["store", "load"]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    request_id: str | None = None  # whose KV a load brings (None: a prefix-tier store)


@dataclass(slots=True)
class KVPool:
    """K and V of every layer: `[num_layers, num_blocks, block_size, kv_heads, head_dim]`, and
    the per-block tensors that travel with them (stage 14: a quantized cache's `k_scale`,
    `v_scale` [num_layers, num_blocks, kv_heads]; empty for a float cache)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor, ...] = ()

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


def host_pool_like(
    device_k: torch.Tensor, num_blocks: int, scales: tuple[torch.Tensor, ...] = ()
) -> KVPool:
    """A host pool with the device pool's block shape (and its `scales`' shapes): pinned when
    the device is a GPU (so a copy can be asynchronous), plain memory on a CPU."""
    pin = device_k.device.type == "cuda"

    def like(tensor: torch.Tensor) -> torch.Tensor:
        shape = (tensor.shape[0], num_blocks, *tensor.shape[2:])
        return torch.zeros(shape, dtype=tensor.dtype, pin_memory=pin)

    return KVPool(like(device_k), like(device_k), tuple(like(scale) for scale in scales))


class CopyEngine:
    """Runs transfers between `device` and `host` in submission order on one thread."""

    def __init__(
        self,
        device: KVPool,
        host: KVPool,
        delay: float | Callable[[TransferJob], float] = 0.0,
        fail: Callable[[TransferJob], bool] | None = None,
    ) -> None:
        self.device, self.host = device, host
        self.delay, self.fail = delay, fail
        cuda = device.k.device.type == "cuda"
        self._stream = torch.cuda.Stream(device.k.device) if cuda else None
        self._jobs: queue.Queue[tuple[TransferJob, Fence] | None] = queue.Queue()
        self._done = threading.Condition()
        self._in_flight: dict[str, TransferJob] = {}
        self._finished: list[tuple[TransferJob, bool]] = []  # not yet taken
        self._thread: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    def submit(self, job: TransferJob, fence: Fence = None) -> None:
        """Queue `job`; it starts once `fence` is done and every earlier job has ended."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self), self._jobs), name="kv-copy", daemon=True
            )
            self._thread.start()
        with self._done:
            self._in_flight[job.job_id] = job
        self._jobs.put((job, fence))

    def in_flight(self) -> list[TransferJob]:
        """The jobs submitted and not ended yet, in submission order."""
        with self._done:
            return list(self._in_flight.values())

    def wait(self, job_ids: Iterable[str], timeout: float = WAIT_TIMEOUT_SECONDS) -> None:
        """Block until no job in `job_ids` is in flight any more (each ended, well or not)."""
        wanted = set(job_ids)
        deadline = time.monotonic() + timeout
        with self._done:
            while busy := wanted & self._in_flight.keys():
                left = deadline - time.monotonic()
                if left <= 0 or not self._done.wait(left):
                    raise TimeoutError(f"KV transfers {sorted(busy)} hung")

    def take_finished(self) -> list[tuple[TransferJob, bool]]:
        """Jobs ended since the last call, with whether each succeeded."""
        with self._done:
            finished, self._finished = self._finished, []
            return finished

    def close(self) -> None:
        self._finalizer()

    def _execute(self, job: TransferJob, fence: Fence) -> None:
        """Wait for the fence, wait the injected delay, copy (unless told to fail), report."""
        if isinstance(fence, threading.Event) and not fence.wait(WAIT_TIMEOUT_SECONDS):
            raise TimeoutError(f"the compute before KV transfer {job.job_id} never ended")
        delay = self.delay(job) if callable(self.delay) else self.delay
        if delay:
            time.sleep(delay)
        ok = not (self.fail is not None and self.fail(job))
        if ok:
            self._copy(job, fence)
        with self._done:
            del self._in_flight[job.job_id]
            self._finished.append((job, ok))
            self._done.notify_all()

    def _copy(self, job: TransferJob, fence: Fence) -> None:
        """Every layer's K and V (and scales) of each block pair. On CUDA: on the side stream,
        after the fence event, and waited for here (so `ended` means the bytes landed)."""
        src, dst = (self.device, self.host) if job.kind == "store" else (self.host, self.device)
        context = contextlib.nullcontext()
        if self._stream is not None:
            context = torch.cuda.stream(self._stream)
            if isinstance(fence, torch.cuda.Event):
                self._stream.wait_event(fence)
        pairs = list(zip(block_tensors(src), block_tensors(dst), strict=True))
        with context, torch.inference_mode():
            for s, d in zip(job.src_blocks, job.dst_blocks, strict=True):
                for source, target in pairs:
                    target[:, d].copy_(source[:, s], non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()


def _run(engine_ref: weakref.ref[CopyEngine], jobs: queue.Queue) -> None:
    """The copy thread: one job at a time, in order; ends on None (the engine was closed or
    collected). It holds the engine only while running a job."""
    while (item := jobs.get()) is not None:
        engine = engine_ref()
        if engine is None:
            return
        engine._execute(*item)
        del engine


def compute_fence(device: torch.device) -> Fence:
    """A fence after the compute queued so far: a CUDA event on the current stream; on a CPU
    None, since transfers are submitted by the thread that ran that compute, after it."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
