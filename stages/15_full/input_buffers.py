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
  its staging copy: the host waits for it (normally long done) before writing that copy again.

On a CPU "pinned" memory is ordinary memory and the event is a threading.Event the worker
thread sets; the code is the same, so the test suite runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T")


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

    def wait(self) -> None:
        """Block the host until the copy has read the slot."""
        self._queued.wait()
        if self._cuda is not None:
            self._cuda.synchronize()


@dataclass(frozen=True, slots=True)
class Staged:
    """One step's staged inputs: which staging slot holds them, and how many of each."""

    slot: int
    lengths: dict[str, int]


class InputBuffers:
    """Named 1-D device tensors that persist across steps, each filled from two host staging
    tensors (pinned on CUDA) used in turn. Multi-dimensional inputs are stored flat."""

    def __init__(
        self,
        sizes: dict[str, tuple[int, torch.dtype]],
        device: torch.device,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self.device, self.stream = device, stream
        self.device_tensors: dict[str, torch.Tensor] = {}
        self.host: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._host_np: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] = ({}, {})
        self._done = (CopyDone(device), CopyDone(device))
        self._next_slot = 0
        for name, (size, dtype) in sizes.items():
            self._allocate(name, size, dtype)

    def _allocate(self, name: str, size: int, dtype: torch.dtype) -> None:
        pin = self.device.type == "cuda"
        # Allocated on the step stream: freeing one (after a growth) is ordered after the
        # steps that read it, as the caching allocator orders frees within a stream.
        on_stream = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with on_stream:
            self.device_tensors[name] = torch.zeros(size, dtype=dtype, device=self.device)
        for host, host_np in zip(self.host, self._host_np, strict=True):
            host[name] = torch.zeros(size, dtype=dtype, pin_memory=pin)
            host_np[name] = host[name].numpy()

    def stage(self, values: dict[str, Sequence[int]]) -> tuple[Staged, dict[str, torch.Tensor]]:
        """Write one step's values into the next staging slot. Returns the handle for
        `copy_to_device` and the device views the step will read (filled once it has run)."""
        slot = self._next_slot
        self._next_slot ^= 1
        self._done[slot].wait()  # the copy two steps back may still be reading this slot
        lengths = {}
        for name, vals in values.items():
            n = len(vals)
            if n > self.device_tensors[name].numel():  # rare: grow to the next power of two
                self._done[slot ^ 1].wait()
                self._allocate(name, 1 << (n - 1).bit_length(), self.device_tensors[name].dtype)
            self._host_np[slot][name][:n] = vals
            lengths[name] = n
        self._done[slot].expect()
        views = {name: self.device_tensors[name][:n] for name, n in lengths.items()}
        return Staged(slot, lengths), views

    def copy_to_device(self, staged: Staged) -> None:
        """Queue the copies of a staged step into the device tensors. Call it where the step
        runs (the step stream on CUDA, the worker thread on a CPU), in launch order."""
        host = self.host[staged.slot]
        for name, n in staged.lengths.items():
            self.device_tensors[name][:n].copy_(host[name][:n], non_blocking=True)
        self._done[staged.slot].record()


def to_device(value: T, device: torch.device) -> T:
    """A host tensor, or a frozen dataclass of them (the step's sampling parameters), on
    `device`. On CUDA each goes through pinned memory, so the copy does not wait; the caching
    host allocator keeps that memory until the copy has run."""
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.pin_memory().to(device, non_blocking=True)  # type: ignore[return-value]
    moved = {}
    for field in dataclasses.fields(value):  # type: ignore[arg-type]
        item = getattr(value, field.name)
        moved[field.name] = to_device(item, device) if isinstance(item, torch.Tensor) else item
    return type(value)(**moved)
