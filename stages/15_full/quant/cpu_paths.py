"""Every way this PyTorch build can multiply by a quantized weight on an x86 CPU.

A weight-only format saves memory; whether it also saves time depends on the matmul. Dequantizing
the whole matrix to fp32 before every call reads the small codes but then writes and reads a full
fp32 copy, so it is slower than fp32 itself. The fused ops dequantize a tile at a time in
registers and read only the codes: `torch._weight_int8pack_mm` (INT8 per channel) and
`torch._weight_int4pack_mm_for_cpu` after `_convert_weight_to_int4pack_for_cpu` (INT4 groups,
gpt-fast's CPU path). Two more ops quantize the activations too, which changes the numbers, so
they count as other formats (W8A8, W4A8) and are never picked for a weight-only format:
fbgemm's `quantized.linear_dynamic` and `_dyn_quant_matmul_4bit` (KleidiAI on Arm, a
fallback on x86), and `torch._scaled_mm` with fp8 activations.

Measured on this build (docs/quant_cpu_paths.md): the fused INT8/INT4 ops are vectorized
(AVX-512) only for bf16 activations; with fp32 activations they fall back to a scalar loop
10-40x slower than fp32 itself. So each has a "_bf16" variant that rounds x to bf16 (and the
scales to bf16), the way gpt-fast runs them: a small change of numbers, like running the
model in bf16, which gets its own tolerance and its own winner (`FASTEST_BF16`).

Each `CpuPath` prepares its operand once from a quantized weight and then runs `x @ W.T`. A
path is correct when it matches `reference_matmul` (the dequantized weight in float64) within
`WEIGHT_ONLY_TOLERANCE`; `measure_cpu_paths.py` times them, and `FASTEST` records its verdict.
It holds on CPUs like the measured one; `fastest_path` takes `PORTABLE` elsewhere (README).

Not every machine runs every path. A build may lack an op or a variant of it (torch 2.11's CPU
`_scaled_mm` takes only per-tensor scales); a CPU may lack the instructions an op needs (oneDNN's
bf16 reorder wants AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and raises on an AVX2 EPYC). So on first
use `registry()` runs every fused path once at a real layer's shape and checks its answer; the
ones that fail are left out with their reason. A path that still fails later, at a shape the
probe did not try, is moved out by `Registry.disable` and the portable path of its format
takes its place for the rest of the run: no configuration crashes for want of an instruction.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stages.common.cpu_capability import Registry, fast_bf16_cpu, forced_cpu_class, probe_each

from .formats import (
    E4M3_MAX,
    FP8_DTYPE,
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    int4_codes,
    int4_scales_and_zeros,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

FORMATS = ("fp32", "int8", "int4", "fp8")
WeightObject = Any  # torch.Tensor (fp32) | Int8Weight | Int4Weight | Fp8Weight
ACTIVATIONS = ("fp32", "bf16", "int8", "fp8")  # what a path does to x before the matmul
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2, "int8": 5e-2, "fp8": 5e-2}  # relative, vs float64


@dataclass(frozen=True)
class CpuPath:
    name: str
    fmt: str
    prepare: Callable[[WeightObject], Any]
    run: Callable[[torch.Tensor, Any], torch.Tensor]
    activations: str = "fp32"  # fp32: exact weight-only; bf16: x rounded; int8 / fp8: W8A8
    needs: Callable[[WeightObject], bool] = lambda w: True  # shapes or variants it can take

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.activations]


def dequantize(weight: WeightObject) -> torch.Tensor:
    """Any weight object -> its fp32 matrix [N, K]."""
    if isinstance(weight, torch.Tensor):
        return weight.float()
    if isinstance(weight, Int8Weight):
        return dequantize_int8(weight)
    if isinstance(weight, Int4Weight):
        return dequantize_int4(weight)
    if isinstance(weight, Fp8Weight):
        return dequantize_fp8(weight)
    raise TypeError(f"not a weight: {type(weight).__name__}")


def reference_matmul(x: torch.Tensor, weight: WeightObject) -> torch.Tensor:
    """The definition: x @ dequantize(W).T in float64, returned as fp32."""
    return (x.double() @ dequantize(weight).double().t()).float()


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.double() - reference.double()).norm() / reference.double().norm()).item()


# ---- fp32 -------------------------------------------------------------------------------------


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)


def _onednn_run(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


# ---- INT8 -------------------------------------------------------------------------------------


def _int8_convert_then_scale(x: torch.Tensor, q: Int8Weight) -> torch.Tensor:
    """gpt-fast's form: the per-channel scale factors out of the sum, applied to the output."""
    return F.linear(x, q.codes.to(x.dtype)) * q.scale


def _fbgemm_prepack(q: Int8Weight) -> Any:
    zero_points = torch.zeros_like(q.scale, dtype=torch.long)
    with warnings.catch_warnings():  # torch deprecates quantized tensors; this path needs one
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(
            q.codes, q.scale.double(), zero_points, 0
        )
    return torch.ops.quantized.linear_prepack(qweight, None)


# ---- INT4 -------------------------------------------------------------------------------------


def _int4pack_prepare(q: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, int]:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4_codes(q).to(torch.int32), 1)
    return packed, int4_scales_and_zeros(q), q.group_size


def _int4pack_run(x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    packed, scales_and_zeros, group_size = state
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def _int4pack_prepare_bf16(q: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, int]:
    packed, scales_and_zeros, group_size = _int4pack_prepare(q)
    return packed, scales_and_zeros.to(torch.bfloat16), group_size


def _bf16(op: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[torch.Tensor, Any], Any]:
    """Run `op` on bf16 activations, return fp32."""
    return lambda x, state: op(x.to(torch.bfloat16), state).float()


def _dyn4_prepare(q: Int4Weight) -> tuple[torch.Tensor, int, int, int]:
    n, k = q.shape
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(q.packed, q.scale, None, q.group_size, k, n)
    return packed, q.group_size, k, n


def _dyn4_run(x: torch.Tensor, state: tuple[torch.Tensor, int, int, int]) -> torch.Tensor:
    packed, group_size, k, n = state
    return torch.ops.aten._dyn_quant_matmul_4bit(x, packed, group_size, k, n)


# ---- a batch of rows: one bf16 GEMM -----------------------------------------------------------


def _dense_bf16_prepare(weight: WeightObject) -> torch.Tensor:
    """The weight dequantized once to bf16 and packed for oneDNN. The fused INT8/INT4 ops run
    one activation row at a time (a GEMV per row); past a few rows one bf16 GEMM over this copy
    is faster. It costs memory: 2 bytes a weight held beside the codes the batch-1 path reads."""
    return _onednn_pack(dequantize(weight).to(torch.bfloat16))


# ---- FP8 --------------------------------------------------------------------------------------


_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()  # code -> value


def _fp8_table_dequant_matmul(x: torch.Tensor, q: Fp8Weight) -> torch.Tensor:
    """Dequantize by table lookup (256 entries) instead of the element-wise fp8 cast."""
    values = _E4M3_TABLE[q.codes.view(torch.uint8).to(torch.int32)]
    return F.linear(x, values) * q.scale


def _fp8_scaled_mm(x: torch.Tensor, q: Fp8Weight) -> torch.Tensor:
    """W8A8 fp8: each activation row gets its own scale too (amax / 448)."""
    x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    x_fp8 = (x / x_scale).to(FP8_DTYPE)
    w_scale = q.scale[None, :].contiguous()
    return torch._scaled_mm(x_fp8, q.codes.t(), x_scale, w_scale, out_dtype=torch.float32)


def _same(w: WeightObject) -> WeightObject:
    return w


KNOWN_PATHS: tuple[CpuPath, ...] = (  # every path this file defines, runnable here or not
    CpuPath("fp32_linear", "fp32", _same, lambda x, w: F.linear(x, w)),
    CpuPath("fp32_onednn_packed", "fp32", _onednn_pack, _onednn_run),
    CpuPath(
        "bf16_onednn_packed",
        "fp32",
        lambda w: _onednn_pack(w.to(torch.bfloat16)),
        _bf16(_onednn_run),
        activations="bf16",
    ),
    CpuPath("int8_dequant_matmul", "int8", _same, lambda x, q: F.linear(x, dequantize_int8(q))),
    CpuPath("int8_convert_matmul_scale", "int8", _same, _int8_convert_then_scale),
    CpuPath(
        "int8_weight_int8pack_mm",
        "int8",
        _same,
        lambda x, q: torch.ops.aten._weight_int8pack_mm(x, q.codes, q.scale),
    ),
    CpuPath(
        "int8_weight_int8pack_mm_bf16",
        "int8",
        lambda q: (q.codes, q.scale.to(torch.bfloat16)),
        _bf16(lambda x, s: torch.ops.aten._weight_int8pack_mm(x, *s)),
        activations="bf16",
    ),
    CpuPath(
        "w8a8_fbgemm_linear_dynamic",
        "int8",
        _fbgemm_prepack,
        lambda x, packed: torch.ops.quantized.linear_dynamic(x, packed),
        activations="int8",
    ),
    CpuPath(
        "int8_dense_bf16_onednn",
        "int8",
        _dense_bf16_prepare,
        _bf16(_onednn_run),
        activations="bf16",
    ),
    CpuPath("int4_dequant_matmul", "int4", _same, lambda x, q: F.linear(x, dequantize_int4(q))),
    CpuPath(
        "int4_weight_int4pack_mm_for_cpu",
        "int4",
        _int4pack_prepare,
        _int4pack_run,
        needs=lambda q: q.shape[0] % 16 == 0,  # the packing works on 16 output rows at a time
    ),
    CpuPath(
        "int4_weight_int4pack_mm_for_cpu_bf16",
        "int4",
        _int4pack_prepare_bf16,
        _bf16(_int4pack_run),
        activations="bf16",
        needs=lambda q: q.shape[0] % 16 == 0,
    ),
    CpuPath(
        "w4a8_dyn_quant_matmul_4bit",
        "int4",
        _dyn4_prepare,
        _dyn4_run,
        activations="int8",
        needs=lambda q: q.offset is None,  # scales only: symmetric INT4
    ),
    CpuPath(
        "int4_dense_bf16_onednn",
        "int4",
        _dense_bf16_prepare,
        _bf16(_onednn_run),
        activations="bf16",
    ),
    CpuPath("fp8_dequant_matmul", "fp8", _same, lambda x, q: F.linear(x, dequantize_fp8(q))),
    CpuPath("fp8_table_dequant_matmul", "fp8", _same, _fp8_table_dequant_matmul),
    CpuPath(
        "w8a8_fp8_scaled_mm",
        "fp8",
        _same,
        _fp8_scaled_mm,
        activations="fp8",
    ),
    CpuPath(
        "fp8_dense_bf16_onednn",
        "fp8",
        _dense_bf16_prepare,
        _bf16(_onednn_run),
        activations="bf16",
    ),
)


# ---- which paths run here ---------------------------------------------------------------------

PROBE_SHAPE = (960, 576)  # SmolLM2-135M's fused q/k/v projection, [out, in]: a real layer
PROBE_ROWS = (1, 7)  # a decode step and a prefill chunk


def probe(path: CpuPath) -> None:
    """Prepare and run `path` at a real layer's shape, for a decode row and a prefill chunk, and
    check its answer; raise where it cannot. A missing op, one that needs instructions this CPU
    lacks and one that is wrong here (a platform's kernel never measured) fail now, not later."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(PROBE_SHAPE, generator=generator) * 0.02
    quantize = {
        "fp32": lambda _: w,
        "int8": lambda _: quantize_int8(w),
        "int4": lambda symmetric: quantize_int4(w, 64, symmetric),
        "fp8": lambda _: quantize_fp8(w),
    }[path.fmt]
    weight = quantize(False)
    if not path.needs(weight):  # the W4A8 op takes scales only
        weight = quantize(True)
    state = path.prepare(weight)
    for rows in PROBE_ROWS:
        x = torch.randn(rows, PROBE_SHAPE[1], generator=generator)
        error = relative_error(path.run(x, state), reference_matmul(x, weight))
        if not error <= path.tolerance:  # NaN fails too
            raise ArithmeticError(
                f"{path.name} is off by {error:.2e} (its bound: {path.tolerance:.0e}) "
                f"at {rows} x {PROBE_SHAPE[1]} @ {PROBE_SHAPE[1]} x {PROBE_SHAPE[0]}"
            )


def available(paths: tuple[CpuPath, ...], check: Callable[[CpuPath], object] = probe) -> Registry:
    """The paths `check` passes, and why each other one was left out. The portable paths are
    plain BLAS and casts: every build runs them, they are not checked and never leave."""
    return probe_each({path.name: path for path in paths}, check, set(PORTABLE.values()))


@functools.cache
def registry() -> Registry[CpuPath]:
    """This machine's paths, probed on first use (about 60 ms) and kept for the process."""
    return available(KNOWN_PATHS)


# The fastest correct path per (format, activations allowed, batch rows), measured by
# `tools/quant/measure_cpu_paths.py` on an AVX-512 CPU with native bf16 (docs/quant_cpu_paths.md).
# Batch 1 is a decode step, 32 stands for "more". "bf16" allows paths that round the activations
# to bf16 (or keep fp32). At batch 1 a format runs an op that reads its own codes (the bytes it
# saves); at 32 rows a bf16 copy through one GEMM (`_dense_bf16_prepare`) wins where it runs.
FASTEST: dict[tuple[str, str, int], str] = {
    ("fp32", "fp32", 1): "fp32_onednn_packed",
    ("fp32", "fp32", 32): "fp32_onednn_packed",
    ("fp32", "bf16", 1): "bf16_onednn_packed",
    ("fp32", "bf16", 32): "bf16_onednn_packed",
    ("int8", "fp32", 1): "int8_weight_int8pack_mm",
    ("int8", "fp32", 32): "int8_convert_matmul_scale",
    ("int8", "bf16", 1): "int8_weight_int8pack_mm_bf16",
    ("int8", "bf16", 32): "int8_dense_bf16_onednn",
    ("int4", "fp32", 1): "int4_weight_int4pack_mm_for_cpu",
    ("int4", "fp32", 32): "int4_dequant_matmul",
    ("int4", "bf16", 1): "int4_weight_int4pack_mm_for_cpu_bf16",
    ("int4", "bf16", 32): "int4_dense_bf16_onednn",
    ("fp8", "fp32", 1): "fp8_dequant_matmul",
    ("fp8", "fp32", 32): "fp8_dequant_matmul",
    ("fp8", "bf16", 1): "fp8_dequant_matmul",
    ("fp8", "bf16", 32): "fp8_dense_bf16_onednn",
}

# Elsewhere: ops every CPU build vectorizes (BLAS, casts), never the fused ops' scalar loops.
PORTABLE: dict[str, str] = {
    "fp32": "fp32_linear",
    "int8": "int8_convert_matmul_scale",
    "int4": "int4_dequant_matmul",
    "fp8": "fp8_dequant_matmul",
}


def like_the_measured_cpu() -> bool:
    """The rule: `FASTEST` holds on its class of CPU, AVX-512 with native bf16 (`fast_bf16_cpu`:
    elsewhere the fused ops are scalar or emulated loops), unless `STAGES_CPU_CLASS` says which
    class to run as (stages/common/cpu_capability.py)."""
    forced = forced_cpu_class()
    return fast_bf16_cpu() if forced is None else forced


MEASURED_CPU_CLASS = like_the_measured_cpu()  # decided once, at import: the same all run long


def fastest_path(
    fmt: str, rows: int, activations: str = "fp32", measured_class: bool | None = None
) -> CpuPath:
    """On a CPU of the measured class (`MEASURED_CPU_CLASS` unless `measured_class` says), the
    winner at the nearer of batch 1 and 32; elsewhere, or where the winner does not run here,
    `PORTABLE`'s path."""
    measured = MEASURED_CPU_CLASS if measured_class is None else measured_class
    name = FASTEST[(fmt, activations, 1 if rows <= 4 else 32)] if measured else PORTABLE[fmt]
    paths = registry().by_name
    return paths.get(name) or paths[PORTABLE[fmt]]
