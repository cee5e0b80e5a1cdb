"""What this CPU can run: its class, and which of a set of kernels actually run here.

CPUs of one architecture differ by 2-3x and take different kernels: an AVX-512 CPU with native
bf16 runs torch's fused INT8/INT4 ops and oneDNN's bf16 vectorized; an AVX2 EPYC runs the same
ops as scalar loops, and oneDNN's bf16 reorder raises there; an Arm server or a Mac has other
kernels again. Two rules keep an engine correct on all of them:

- a choice measured on one class of CPU is applied only on that class (`fast_bf16_cpu`), and
  `STAGES_CPU_CLASS=measured|portable` forces either answer, so the suite can run as the other
  class on any machine (`make test-avx2` also lowers torch's and oneDNN's kernels to AVX2);
- a kernel is offered only once it has run here (`probe_each`), and one that fails later is
  taken out for the rest of the run (`Registry.disable`) instead of failing every request.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

logger = logging.getLogger(__name__)

CPU_CLASS_VARIABLE = "STAGES_CPU_CLASS"  # "measured" or "portable" (docs/tests.md)
CPU_CLASSES = ("measured", "portable")
T = TypeVar("T")


def fast_bf16_cpu() -> bool:
    """AVX-512 (torch's CPU capability) with native bf16: where the fused CPU ops and oneDNN's
    bf16 run vectorized. `ATEN_CPU_CAPABILITY=avx2` lowers torch's capability, so the answer
    follows it; Arm's capabilities (DEFAULT, SVE256) are never this class."""
    native_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and bool(native_bf16())


def forced_cpu_class() -> bool | None:
    """`STAGES_CPU_CLASS`: True for "measured", False for "portable", None when unset."""
    value = os.environ.get(CPU_CLASS_VARIABLE, "").strip().lower()
    if value and value not in CPU_CLASSES:
        raise ValueError(f"{CPU_CLASS_VARIABLE} must be 'measured' or 'portable', got {value!r}")
    return value == "measured" if value else None


def describe_cpu_class(measured: bool) -> str:
    """One line for logs and test failures: the class assumed, and what it was decided from."""
    forced = os.environ.get(CPU_CLASS_VARIABLE, "").strip()
    why = (
        f"forced by {CPU_CLASS_VARIABLE}={forced}"
        if forced
        else f"torch capability {torch.backends.cpu.get_cpu_capability()}, AVX-512 bf16 "
        f"{'yes' if fast_bf16_cpu() else 'no or unused'}"
    )
    return f"{'measured' if measured else 'portable'} CPU class ({why})"


def one_line(error: BaseException) -> str:
    """An error as one line: its type and its message's last line (torch's own are long)."""
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[-1]}"


@dataclass
class Registry(Generic[T]):
    """The kernels that run here (`by_name`) and why each other one does not (`unavailable`:
    name -> reason). `fallbacks` are the plain ones every build runs: they never leave."""

    by_name: dict[str, T]
    unavailable: dict[str, str] = field(default_factory=dict)
    fallbacks: frozenset[str] = frozenset()

    def disable(self, name: str, error: BaseException) -> None:
        """`name` failed at use: leave it out for the rest of the run, and say so once."""
        if name in self.fallbacks:
            raise RuntimeError(f"{name} is a fallback: nothing can take its place") from error
        if self.by_name.pop(name, None) is None:
            return
        self.unavailable[name] = one_line(error)
        logger.warning(
            "CPU path %s failed at use (%s); the portable path takes its place from now on",
            name,
            self.unavailable[name],
        )


def probe_each(
    kernels: Mapping[str, T], check: Callable[[T], object], fallbacks: Collection[str] = ()
) -> Registry[T]:
    """Run `check` on every kernel but the fallbacks; keep the ones it passes, and say why each
    other one was left out (its error, one line)."""
    kept: dict[str, T] = {}
    left_out: dict[str, str] = {}
    for name, kernel in kernels.items():
        try:
            if name not in fallbacks:
                check(kernel)
        except Exception as exc:  # any failure: not in this build, not on this CPU, or wrong
            left_out[name] = one_line(exc)
            logger.info("CPU path %s is unavailable here: %s", name, left_out[name])
        else:
            kept[name] = kernel
    return Registry(kept, left_out, frozenset(fallbacks))
