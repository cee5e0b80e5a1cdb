"""What a batch of KV block copies does, and which batches are still in flight: plain data.

The copy engine (offload/copy_engine.py) moves a step's blocks in one batch per direction, as vLLM's
OffloadingConnector does (`kv_offload/worker/cpu_gpu.py`): one gather of every source block into
a contiguous staging tensor, then the host side by runs of consecutive host blocks (one copy per
run, straight into the pinned host pool), and on the device one scatter (`index_copy_`). This
module decides the indices and runs (`plan_batch`) and keeps the ledger of batches in flight
across steps (`TransferLedger`), so that logic is tested on a CPU without any copy.

A batch ends when its completion handle says so (a CUDA event, or a future of the copy thread),
polled each step; it is never waited for at the end of a step. The ledger answers the two
questions the worker must ask before a forward: which transfers touch a block it writes (a store
still reading it, a load still writing it), and which batches hold given jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One transfer: plain data (it travels in the step's metadata to every rank)."""

    job_id: str
    kind: Literal["store", "load"]
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    request_id: str | None = None  # whose KV a load brings (None: a prefix-tier store)

    def device_blocks(self) -> tuple[int, ...]:
        """The device blocks it touches: a store reads its sources, a load writes its targets."""
        return self.src_blocks if self.kind == "store" else self.dst_blocks


@dataclass(frozen=True, slots=True)
class Run:
    """`length` consecutive host blocks from `host_block`, at positions `start`.. of the batch."""

    start: int
    length: int
    host_block: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One batch's copy: the staging tensor holds block `device[i]` (or `host`'s) at row i."""

    kind: Literal["store", "load"]
    device: tuple[int, ...]  # a store gathers these, a load scatters into them
    host: tuple[int, ...]  # a store writes these, a load reads them
    runs: tuple[Run, ...]  # `host` cut into runs of consecutive blocks

    @property
    def num_blocks(self) -> int:
        return len(self.device)


def host_runs(host_blocks: Sequence[int]) -> tuple[Run, ...]:
    """Cut a sequence of host blocks into maximal runs of consecutive ids (one copy each)."""
    runs: list[Run] = []
    for i, block in enumerate(host_blocks):
        last = runs[-1] if runs else None
        if last is not None and block == last.host_block + last.length:
            runs[-1] = Run(last.start, last.length + 1, last.host_block)
        else:
            runs.append(Run(i, 1, block))
    return tuple(runs)


def plan_batch(jobs: Sequence[TransferJob]) -> BatchPlan:
    """The blocks of every job, in order, as one copy. All jobs go one way; no block is written
    twice (index_copy_ with repeated targets is undefined); a source may repeat (two requests
    loading the same host block)."""
    kinds = {job.kind for job in jobs}
    assert len(kinds) == 1, f"a batch goes one way, not {sorted(kinds)}"
    kind = kinds.pop()
    src = tuple(b for job in jobs for b in job.src_blocks)
    dst = tuple(b for job in jobs for b in job.dst_blocks)
    assert len(src) == len(dst), "every source block needs a target"
    assert len(set(dst)) == len(dst), f"a batch writes a block twice: {dst}"
    device, host = (src, dst) if kind == "store" else (dst, src)
    return BatchPlan(kind, device, host, host_runs(host))


@dataclass(slots=True)
class Batch:
    """A batch submitted to the copy engine: its jobs, the handle that says when it ended, the
    jobs that failed (injected, or the copy raised), and what must live until it ends."""

    jobs: tuple[TransferJob, ...]
    handle: Any = None  # a torch.cuda.Event or a concurrent.futures.Future
    failed: set[str] = field(default_factory=set)
    keep_alive: list[Any] = field(default_factory=list)
    compute_waits: bool = False  # the compute stream waits for it (CUDA: no host wait)


class TransferLedger:
    """The batches in flight, in submission order (they end in that order: one copy lane)."""

    def __init__(self) -> None:
        self._batches: list[Batch] = []

    def add(self, batch: Batch) -> None:
        self._batches.append(batch)

    def in_flight(self) -> list[TransferJob]:
        """Every job not reported ended yet, in submission order."""
        return [job for batch in self._batches for job in batch.jobs]

    def batches(self) -> list[Batch]:
        return list(self._batches)

    def holding(self, job_ids: Iterable[str]) -> list[Batch]:
        """The batches in flight that hold any of `job_ids`."""
        wanted = set(job_ids)
        return [b for b in self._batches if any(j.job_id in wanted for j in b.jobs)]

    def touching(self, write_blocks: frozenset[int]) -> list[str]:
        """Jobs in flight that a forward writing `write_blocks` must come after: a store still
        reading one of them (vLLM PR #29870), or a load still writing one (its request was
        aborted or failed, and the block handed out again)."""
        return [
            job.job_id
            for job in self.in_flight()
            if not write_blocks.isdisjoint(job.device_blocks())
        ]

    def unordered_store_reads(self, write_blocks: frozenset[int]) -> list[tuple[TransferJob, set]]:
        """Stores in flight reading a block the forward writes that the compute does not wait
        for: each is a bug (the invariant `handle_preemptions` keeps)."""
        return [
            (job, clash)
            for batch in self._batches
            if not batch.compute_waits
            for job in batch.jobs
            if job.kind == "store" and (clash := write_blocks.intersection(job.src_blocks))
        ]

    def poll(
        self, done: Callable[[Batch], bool], error: Callable[[Batch], bool] = lambda b: False
    ) -> list[tuple[TransferJob, bool]]:
        """Take the batches that ended, oldest first, stopping at the first still running:
        each job with whether it succeeded (a batch whose copy raised fails every job)."""
        ended: list[tuple[TransferJob, bool]] = []
        while self._batches and done(self._batches[0]):
            batch = self._batches.pop(0)
            failed = {j.job_id for j in batch.jobs} if error(batch) else batch.failed
            ended.extend((job, job.job_id not in failed) for job in batch.jobs)
        return ended
