"""A request's KV blocks packed into one host buffer, and unpacked into another pool's blocks.

A transport moves bytes between hosts, so a device pool's blocks pass through host memory: the
sender gathers them (`index_select` over the block dim of every block tensor: K, V, and a
quantized cache's scales) into one staging buffer and sends it as one message; the receiver
takes the message into its own staging buffer and scatters it into its block ids
(`index_copy_`). Bit-exact: bytes are copied, never converted.

Two parts, kept apart so the first is tested without a device:
- `plan_transfer`: which blocks, in which order, and where each tensor's slice lies in the
  buffer (`Segment`: byte offset, shape, dtype). Pure: layouts in, a plan out.
- `Stager`: the copies. On CUDA the buffer is pinned host memory and the copies run on a
  dedicated stream (never the compute stream), ordered after an event the engine thread
  recorded on the compute stream when it started the transfer; the transfer thread waits for
  the stream's own event, so a finished transfer has finished its device copies too: the
  engine schedules a request over received blocks only after that. On a CPU the same calls run
  on plain tensors with no stream: the CPU tests run this path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from stages.common.step_wait import wait_until

ALIGN = 16  # bytes: every segment starts here, so a uint8 slice views as any dtype
Layout = tuple[tuple[int, ...], torch.dtype]  # a block tensor's shape and dtype


@dataclass(frozen=True)
class Segment:
    """One block tensor's blocks in the buffer: `shape` is [layers, blocks, ...] at `offset`."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TransferPlan:
    """The blocks to move, in order, and the buffer's layout: a segment per block tensor."""

    block_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    nbytes: int


def layouts(tensors: Sequence[torch.Tensor]) -> tuple[Layout, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def plan_transfer(pool_layouts: Sequence[Layout], block_ids: Sequence[int]) -> TransferPlan:
    """The plan for `block_ids` of tensors shaped [layers, num_blocks, ...]. A block id out of
    range or named twice is a ValueError: a receive would write one block twice (in an order
    `index_copy_` does not promise)."""
    ids = tuple(int(b) for b in block_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"a block named twice in {ids}")
    segments, offset = [], 0
    for shape, dtype in pool_layouts:
        if len(shape) < 2:
            raise ValueError(f"a block tensor is [layers, blocks, ...], not {shape}")
        if any(not 0 <= b < shape[1] for b in ids):
            raise ValueError(f"block ids {ids} outside a pool of {shape[1]} blocks")
        seg_shape = (shape[0], len(ids), *shape[2:])
        numel = 1
        for size in seg_shape:
            numel *= size
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        segments.append(Segment(offset, nbytes, seg_shape, dtype))
        offset += -(-nbytes // ALIGN) * ALIGN
    return TransferPlan(ids, tuple(segments), offset)


def segment_view(buffer: torch.Tensor, segment: Segment) -> torch.Tensor:
    """`segment` of a uint8 buffer as its dtype and shape (a view: no copy)."""
    raw = buffer[segment.offset : segment.offset + segment.nbytes]
    return raw.view(segment.dtype).view(segment.shape)


class Stager:
    """Gathers blocks into a host buffer and scatters them back, for the pool on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A staging buffer: pinned on CUDA (an async copy needs it; torch caches pinned blocks)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def mark(self) -> torch.cuda.Event | None:
        """On the engine's thread: an event after the work the compute stream queued so far
        (the forward that wrote the blocks, or that still reads blocks now reused)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def gather(
        self,
        tensors: Sequence[torch.Tensor],
        plan: TransferPlan,
        out: torch.Tensor,
        after: torch.cuda.Event | None = None,
        seconds: float | None = None,
    ) -> None:
        """Copy the plan's blocks of each tensor into `out`; returns when the bytes are there.
        TimeoutError after `seconds` (the transfer's deadline): the copies follow the forwards
        queued before the send, and one hung on a dead peer's collective never ends."""
        with self._on_stream(plan, after, seconds) as ids:
            for tensor, segment in zip(tensors, plan.segments, strict=True):
                segment_view(out, segment).copy_(tensor.index_select(1, ids), non_blocking=True)

    def scatter(
        self,
        tensors: Sequence[torch.Tensor],
        plan: TransferPlan,
        staging: torch.Tensor,
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Write `staging` into the plan's blocks of each tensor; returns when written. No
        deadline: a receive that gave up would free blocks these copies may still write."""
        with self._on_stream(plan, after, None) as ids:
            for tensor, segment in zip(tensors, plan.segments, strict=True):
                blocks = segment_view(staging, segment).to(self.device, non_blocking=True)
                tensor.index_copy_(1, ids, blocks)

    @contextlib.contextmanager
    def _on_stream(
        self, plan: TransferPlan, after: torch.cuda.Event | None, seconds: float | None
    ) -> Iterator[torch.Tensor]:
        """Run the body's copies on the side stream after `after`, then wait for them (on the
        transfer thread: the engine's thread never blocks here). Yields the block ids as an
        index on the pool's device."""
        if self.stream is None:
            yield torch.tensor(plan.block_ids, dtype=torch.long)
            return
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            yield torch.tensor(plan.block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        if seconds is None:  # a receive (see scatter): block, without waking every few us
            done.synchronize()
            return
        try:  # polled: synchronize() has no bound
            wait_until(done.query, lambda: None, seconds)
        except TimeoutError:
            raise TimeoutError(f"the staging copies did not end within {seconds:.3g} s") from None
