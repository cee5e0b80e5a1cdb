"""A host-sync detector that works on the CPU: `record_host_syncs()` counts the calls that would
make the host wait for a GPU.

On CUDA, `torch.cuda.set_sync_debug_mode("error")` catches a synchronisation when it happens.
A CPU has nothing to wait for, so here the calls themselves are counted: reading a tensor's
values on the host (`tolist`, `item`, `cpu`, `numpy`, `bool()`, `int()`, `float()`), and the
ops whose output size depends on the values (`nonzero`, `unique`, a boolean-mask index,
`masked_select`, `bincount`, which on CUDA reads its max, `repeat_interleave` with tensor
repeats and no `output_size`, one-argument `torch.where`), and a Python number stored into one
element (`x[i] = 0`: on CUDA the number is a host tensor copied in with a blocking copy; a slice,
`x[i:i + 1] = 0` or `x[i:].zero_()`, is filled on the device instead). Each is patched with a
wrapper that records its name and then runs the original. Code that passes on the CPU under
this detector has no such call in the path it ran; what torch does inside its C++ ops is not
seen (see the CUDA tests for that).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Tensor methods that copy values to the host, or whose output size depends on them.
TENSOR_METHODS = (
    "tolist", "item", "cpu", "numpy", "nonzero", "unique", "unique_consecutive", "bincount",
    "masked_select", "argwhere", "__bool__", "__int__", "__float__",
)  # fmt: skip
TORCH_FUNCTIONS = (
    "nonzero",
    "unique",
    "unique_consecutive",
    "bincount",
    "masked_select",
    "argwhere",
)


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _mask_index(index: object) -> bool:
    """Whether an index (or any part of an index tuple) is a boolean mask: a nonzero inside."""
    parts = index if isinstance(index, tuple | list) else (index,)
    return any(_is_mask(part) for part in parts)


def _scalar_into_one_element(self: torch.Tensor, index: object, value: tuple[Any, ...]) -> bool:
    """`x[i, j] = 3.0`: integer indices down to a single element and a Python number stored."""
    parts = index if isinstance(index, tuple) else (index,)
    integers = all(isinstance(part, int) and not isinstance(part, bool) for part in parts)
    number = bool(value) and isinstance(value[0], int | float | bool)
    return number and integers and len(parts) == self.dim()


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str | torch.device) and torch.device(device).type == "cpu"


@contextlib.contextmanager
def record_host_syncs() -> Iterator[list[str]]:
    """Within the block, every host-sync call is appended (by name) to the yielded list. A call
    made inside another recorded call (`Tensor.unique` calls `torch.unique`) counts once."""
    calls: list[str] = []
    saved: list[tuple[Any, str, Any, bool]] = []
    depth = [0]

    def patch(owner: Any, name: str, make: Callable[[Any], Callable[..., str | None]]) -> None:
        """Wrap owner.name: `make(original)` says what a call is (None: not a sync)."""
        original = getattr(owner, name)
        saved.append((owner, name, original, name in vars(owner)))
        classify = make(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return original(*args, **kwargs)
            found = classify(*args, **kwargs)
            if found is not None:
                calls.append(found)
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(owner, name, wrapper)

    def always(name: str) -> Callable[[Any], Callable[..., str | None]]:
        return lambda _original: lambda *args, **kwargs: name

    for name in TENSOR_METHODS:
        patch(torch.Tensor, name, always(f"Tensor.{name}"))
    for name in TORCH_FUNCTIONS:
        patch(torch, name, always(f"torch.{name}"))

    def indexing(_original: Any) -> Callable[..., str | None]:
        return lambda self, index, *value: "mask index" if _mask_index(index) else None

    def to(_original: Any) -> Callable[..., str | None]:
        return lambda self, *args, **kwargs: "Tensor.to(cpu)" if _to_cpu(args, kwargs) else None

    def repeat_interleave(_original: Any) -> Callable[..., str | None]:
        def classify(*args: Any, **kwargs: Any) -> str | None:
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            sized = kwargs.get("output_size") is not None
            return "repeat_interleave" if isinstance(repeats, torch.Tensor) and not sized else None

        return classify

    def where(_original: Any) -> Callable[..., str | None]:
        return lambda *args, **kwargs: (
            "torch.where(condition)" if len(args) + len(kwargs) == 1 else None
        )

    patch(torch.Tensor, "__getitem__", indexing)

    def setitem(_original: Any) -> Callable[..., str | None]:
        def classify(self: torch.Tensor, index: object, *value: Any) -> str | None:
            if _mask_index(index):
                return "mask index"
            return (
                "scalar into one element" if _scalar_into_one_element(self, index, value) else None
            )

        return classify

    patch(torch.Tensor, "__setitem__", setitem)
    patch(torch.Tensor, "to", to)
    patch(torch.Tensor, "repeat_interleave", repeat_interleave)
    patch(torch, "repeat_interleave", repeat_interleave)
    patch(torch, "where", where)
    try:
        yield calls
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:  # inherited (Tensor's methods are TensorBase's): remove the shadow
                delattr(owner, name)
