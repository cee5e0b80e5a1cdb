"""Persistent input buffers: the step's inputs reach the device without stalling the host.

A step's inputs (token ids, positions, slot mapping, block tables, ...) are built on the host
as Python lists. The obvious `torch.tensor(values, device="cuda")` copies from pageable memory,
which CUDA can only do by first waiting for the stream to drain: the host stops exactly when
async scheduling wants it to run ahead. And a fresh device tensor per step, made on one stream
and read on another, can be freed and handed to the next step while the forward still reads it.

So, as vLLM's persistent input batch does (`CpuGpuBuffer` in vllm/v1/utils.py):

- every input has one device tensor, allocated once (sized from the config, grown only if a
  step ever needs more) on the stream that runs the steps, and reused by every step;
- the host writes a step's values into a *staging* tensor in pinned memory, and the step starts
  with a non-blocking copy from there into the device tensor, queued in launch order (on the
  step stream on CUDA, on the worker thread on a CPU), so a step never sees the next step's
  values;
- there are two staging copies, used in turn, and an event marks when a step's copy has read
  its staging copy: the host waits for it (normally long done) before writing that copy again;
- all the inputs share one allocation, each at a fixed offset (a view of it, so a CUDA graph
  captured on it reads the same addresses every step), and a step's inputs reach the device in
  one copy: the bytes from the first input it uses to the end of the last. vLLM copies each
  buffer on its own; a copy costs the host a few microseconds to issue whatever its size, and
  eleven of them per step were a measurable share of a small step (the step profile's
  "host-to-device" phase). The gaps between inputs travel too: a few hundred kilobytes at most,
  microseconds of PCIe time, and only up to the last input the step uses.

On a CPU "pinned" memory is ordinary memory and the event is a threading.Event the worker
thread sets; the code is the same, so the test suite runs it. A CPU whose steps do not overlap
(`async_scheduling` off: each step runs on the engine's thread and is done before the next is
staged) needs no second copy of its inputs at all: the staging memory is the device memory
(`direct`), and `copy_to_device` has nothing to copy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")
COPY_WAIT_SECONDS = 600.0  # longer than any step; a wait past it means the step never ran


class CopyDone:
    """Marks when a queued copy out of one staging slot has run: a CUDA event recorded on the
    step stream, or on a CPU a threading.Event the worker thread sets."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = torch.cuda.Event() if device.type == "cuda" else None
        self._queued = threading.Event()
        self._queued.set()  # nothing queued yet

    def expect(self) -> None:
        """A copy out of this slot is about to be queued."""
        self._queued.clear()

    def record(self) -> None:
        """The copy is queued (CUDA: on the current stream) or done (CPU)."""
        if self._cuda is not None:
            self._cuda.record()
        self._queued.set()

    def wait(self, timeout: float = COPY_WAIT_SECONDS) -> None:
        """Block the host until the copy has read the slot. A copy that is never queued (the
        thread that runs steps died or hangs) is a RuntimeError after `timeout` seconds, not a
        hang: the engine then fails its requests. Once queued, a CUDA copy is waited for by its
        event, as vLLM waits for its own."""
        if not self._queued.wait(timeout):
            raise RuntimeError(
                f"the step meant to copy this staging slot did not queue its copy in {timeout:.0f}"
                " s: the thread that runs steps is stuck or dead"
            )
        if self._cuda is not None:
            self._cuda.synchronize()


@dataclass(frozen=True, slots=True)
class Staged:
    """One step's staged inputs: which staging slot holds them, and how many of each."""

    slot: int
    lengths: dict[str, int]


ALIGN = 64  # bytes: each input starts on its own cache line (and any dtype's alignment)
MAX_KEPT_VIEWS = 4096  # views kept (InputBuffers.prefix, .matrix): no memory of their own


class InputBuffers:
    """Named 1-D device tensors that persist across steps, each filled from two host staging
    tensors (pinned on CUDA) used in turn. Multi-dimensional inputs are stored flat. Every
    input is a view of one packed allocation, so one copy moves a whole step."""

    def __init__(
        self,
        sizes: dict[str, tuple[int, torch.dtype]],
        device: torch.device,
        stream: torch.cuda.Stream | None,
        direct: bool = False,
    ) -> None:
        if direct and device.type != "cpu":
            raise ValueError(f"direct input buffers need a CPU, not {device}")
        self.device, self.stream = device, stream
        # A CPU running one step at a time: the step reads the staging memory itself
        self.direct = direct
        self.sizes = dict(sizes)  # name -> (capacity in elements, dtype)
        self.device_tensors: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, torch.Tensor] = {}  # (name, length[, width]) -> its view
        self.host: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._host_np: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] = ({}, {})
        self._offsets: dict[str, int] = {}  # name -> its first byte in the packed allocation
        self._done = (CopyDone(device), CopyDone(device))
        self._next_slot = 0
        self._allocate()

    def _allocate(self) -> None:
        """Lay the inputs out end to end (each aligned) and allocate the packed device tensor
        and its two host staging copies; every named tensor is a view of them."""
        offset = 0
        for name, (size, dtype) in self.sizes.items():
            self._offsets[name] = offset
            offset += -(-size * dtype.itemsize // ALIGN) * ALIGN
        pin = self.device.type == "cuda"
        # Allocated on the step stream: freeing it (after a growth) is ordered after the
        # steps that read it, as the caching allocator orders frees within a stream.
        on_stream = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with on_stream:
            self._device_bytes = torch.zeros(offset, dtype=torch.uint8, device=self.device)
        self._views.clear()  # views of the old allocation
        self._host_bytes = (
            (self._device_bytes,) * 2  # both slots are the device memory: nothing to copy
            if self.direct
            else tuple(torch.zeros(offset, dtype=torch.uint8, pin_memory=pin) for _ in range(2))
        )
        for name in self.sizes:
            self.device_tensors[name] = self._view(self._device_bytes, name)
            for slot in range(2):
                self.host[slot][name] = self._view(self._host_bytes[slot], name)
                self._host_np[slot][name] = self.host[slot][name].numpy()

    def _view(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        size, dtype = self.sizes[name]
        start = self._offsets[name]
        return packed[start : start + size * dtype.itemsize].view(dtype)

    def stage(self, values: dict[str, Sequence[int]]) -> tuple[Staged, dict[str, torch.Tensor]]:
        """Write one step's values into the next staging slot. Returns the handle for
        `copy_to_device` and the device views the step will read (filled once it has run)."""
        slot = self._next_slot
        self._next_slot ^= 1
        direct = self.direct  # no copy ever reads the slot: nothing to wait for or to mark
        if not direct:
            self._done[slot].wait()  # the copy two steps back may still be reading this slot
        lengths = {name: len(vals) for name, vals in values.items()}
        if any(n > self.sizes[name][0] for name, n in lengths.items()):
            self._grow(lengths, slot)
        for name, vals in values.items():
            self._host_np[slot][name][: lengths[name]] = vals
        if not direct:
            self._done[slot].expect()
        views = {name: self.prefix(name, n) for name, n in lengths.items()}
        return Staged(slot, lengths), views

    def prefix(self, name: str, n: int) -> torch.Tensor:
        """The first `n` elements of a device input, made once per length and kept: a step's
        lengths repeat (a decode step's are its batch size). Views made per step came with
        more context switches between the engine's thread and the runner's, and more CPU
        (stage 05's README measures it)."""
        view = self._views.get((name, n))
        if view is None:
            if len(self._views) >= MAX_KEPT_VIEWS:  # lengths of every size seen: start over
                self._views.clear()
            view = self._views[name, n] = self.device_tensors[name][:n]
        return view

    def matrix(self, name: str, rows: int, width: int) -> torch.Tensor:
        """The first `rows * width` elements of a flat input as a [rows, width] view (a block
        table), kept as `prefix` keeps its views: a decode step's shape repeats too."""
        view = self._views.get((name, rows, width))
        if view is None:
            if len(self._views) >= MAX_KEPT_VIEWS:
                self._views.clear()
            flat = self.prefix(name, rows * width)
            view = self._views[name, rows, width] = flat.view(rows, width)
        return view

    def _grow(self, lengths: dict[str, int], slot: int) -> None:
        """Rare: a step larger than the buffers. Each input too small grows to the next power
        of two and the whole layout is allocated anew (the graphs captured on the old one, if
        any, see that and stop replaying: stage 15's `DecodeGraphs.usable`)."""
        self._done[slot ^ 1].wait()  # the other slot's copy reads the old allocation
        for name, n in lengths.items():
            size, dtype = self.sizes[name]
            if n > size:
                self.sizes[name] = (1 << (n - 1).bit_length(), dtype)
        self._allocate()

    def copy_to_device(self, staged: Staged) -> None:
        """Queue the copy of a staged step into the device tensors: one copy, from the first
        input the step uses to the end of the last. Call it where the step runs (the step
        stream on CUDA, the worker thread on a CPU), in launch order."""
        if self.direct:  # the step reads the staged values where they are
            return
        used = [
            (self._offsets[name], self._offsets[name] + n * self.sizes[name][1].itemsize)
            for name, n in staged.lengths.items()
            if n
        ]
        if used:
            start, end = min(s for s, _ in used), max(e for _, e in used)
            host = self._host_bytes[staged.slot]
            self._device_bytes[start:end].copy_(host[start:end], non_blocking=True)
        self._done[staged.slot].record()


class PinnedOutputs:
    """Where each step's sampled ids come back on CUDA: a pinned host buffer and an event per
    step in flight, allocated once and reused. Allocating both every step cost the host an
    allocation and an event creation per step for nothing. A buffer returns to the free list
    only once its step's ids have been read, so a step can never overwrite ids a caller has
    yet to read, however many steps are in flight."""

    def __init__(self) -> None:
        self._free: collections.deque[tuple[torch.Tensor, torch.cuda.Event]] = collections.deque()
        self.allocated = 0  # buffers made so far: as many as steps were ever in flight at once

    def copy_back(
        self, tokens: torch.Tensor, stream: torch.cuda.Stream
    ) -> tuple[Callable[[], list], Callable[[], bool]]:
        """Queue the copy of `tokens` (on `stream`) into a reused pinned buffer. Returns the
        wait (the ids as lists, once; the buffer is then free again) and the poll."""
        n, shape = tokens.numel(), tokens.shape
        host, ready = self._take(n, tokens.dtype)
        host[:n].copy_(tokens.reshape(-1), non_blocking=True)
        ready.record(stream)
        read: list[list] = []

        def wait() -> list:
            if not read:
                ready.synchronize()
                read.append(host[:n].view(shape).tolist())
                self._free.append((host, ready))
            return read[0]

        return wait, ready.query

    def _take(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.cuda.Event]:
        while self._free:
            host, ready = self._free.popleft()
            if host.numel() >= n and host.dtype == dtype:
                return host, ready
        size = max(256, 1 << max(n - 1, 0).bit_length())  # room for the next larger steps too
        self.allocated += 1
        return torch.empty(size, dtype=dtype, pin_memory=True), torch.cuda.Event()


def to_device(value: T, device: torch.device) -> T:
    """A host tensor, or a frozen dataclass of them (the step's sampling parameters), on
    `device`. On CUDA each goes through pinned memory, so the copy does not wait; the caching
    host allocator keeps that memory until the copy has run. A dataclass's tensors travel
    packed, in one copy (`packed_copy`)."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.pin_memory().to(device, non_blocking=True)  # type: ignore[return-value]
    tensors = {
        field.name: item
        for field in dataclasses.fields(value)  # type: ignore[arg-type]
        if isinstance(item := getattr(value, field.name), torch.Tensor)
    }
    if not tensors:  # nothing to copy (an all-greedy batch's sampling: GREEDY_BATCH)
        return value
    return dataclasses.replace(value, **packed_copy(tensors, device))  # type: ignore[type-var]


def packed_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors on `device` in one copy: packed end to end (each aligned) into one host
    buffer (pinned on CUDA: the copy does not wait), copied once, returned as views of the
    device copy with their dtypes and shapes. One copy costs the host what one small copy
    does; the sampling parameters' six were six."""
    offsets, total = {}, 0
    for name, tensor in tensors.items():
        offsets[name] = total
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    packed = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for name, tensor in tensors.items():
        start, size = offsets[name], tensor.numel() * tensor.element_size()
        packed[start : start + size].view(tensor.dtype).copy_(tensor.reshape(-1))
    moved = packed.to(device, non_blocking=True)
    return {
        name: moved[offsets[name] : offsets[name] + t.numel() * t.element_size()]
        .view(t.dtype)
        .view(t.shape)
        for name, t in tensors.items()
    }
