"""A Triton matmul that dequantizes the weight inside the loop, and its PyTorch reference.

y = x @ dequantize(W).T with W in a `quant_formats` form. Grid (tile of BLOCK_M rows of x,
tile of BLOCK_N output features); a program walks K a tile of BLOCK_K at a time, loads the
weight tile's CODES [BLOCK_K, BLOCK_N] (1 byte, or half a byte, per element instead of 4),
turns them into fp32 in registers and accumulates `tl.dot(x_tile, w_tile)` in fp32. The full
fp32 weight never exists in memory, which is the point: decode is bound by weight bytes read.
The product asks for `input_precision="ieee"`, as the attention kernel does: without it an
Ampere or later GPU multiplies fp32 tiles in TF32, about 1e-3 off instead of 1e-6.

- INT8 and FP8 (per output channel): the scale factors out of the sum over K, so the loop
  multiplies raw codes and the epilogue scales each output column once.
- INT4 (groups along K): BLOCK_K divides the group size, so a K tile lies in one group and
  needs one scale (and offset) per output column. Each element's byte is loaded at k // 2 and
  its nibble selected by a shift of 4 * (k % 2) and a mask of 0xF (GemLite's shifts and masks).
- FP8: by default the codes travel as their uint8 bit patterns and are decoded with integer
  ops (sign, 4 exponent bits, 3 mantissa bits; exponent 0 is subnormal), which runs anywhere,
  GPUs without fp8 included; `native_fp8=True` loads float8e4nv and casts (Ada/Hopper and
  later; triton 3.9's interpreter runs it too, except that it reads the NaN codes 0x7F / 0xFF
  as +-480). Both are tested.

The same function on a GPU would want GemLite's split: a GEMV kernel for batch 1, split-K for
small batches, this tiled GEMM for large ones. Tested on the CPU under TRITON_INTERPRET=1
against `dequant_matmul_reference`.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.common.devices import on_device

from .formats import Fp8Weight, Int4Weight, Int8Weight

try:  # optional: the CPU paths never need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

INT8, INT4_SYMMETRIC, INT4_ASYMMETRIC, FP8, FP8_NATIVE = 0, 1, 2, 3, 4


def dequant_matmul_reference(x: torch.Tensor, weight: Any) -> torch.Tensor:
    """The definition, in plain PyTorch: dequantize the whole weight, then one matmul."""
    from .cpu_paths import dequantize

    return x.float() @ dequantize(weight).t()


if triton is not None:

    @triton.jit
    def _decode_e4m3(bits):
        """uint8 e4m3fn bit patterns -> fp32 (0x7F / 0xFF -> NaN)."""
        b = bits.to(tl.int32)
        exponent = (b >> 3) & 0xF
        mantissa = (b & 0x7).to(tl.float32)
        normal = (1.0 + mantissa / 8.0) * tl.exp2((exponent - 7).to(tl.float32))
        subnormal = mantissa / 512.0  # 2**-6 * m / 8
        value = tl.where(exponent == 0, subnormal, normal)
        value = tl.where((exponent == 15) & ((b & 0x7) == 7), float("nan"), value)
        return tl.where((b & 0x80) != 0, -value, value)

    @triton.jit
    def _dequant_matmul_kernel(
        x_ptr,
        w_ptr,
        scale_ptr,
        offset_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        stride_ym,
        FORMAT: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_mask = k_ok[:, None] & col_ok[None, :]
            if FORMAT == 1 or FORMAT == 2:  # INT4: byte k // 2, nibble k % 2
                byte = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None] // 2, w_mask, 0)
                code = ((byte.to(tl.int32) >> ((ks[:, None] % 2) * 4)) & 0xF).to(tl.float32)
                group = k0 // GROUP
                scale = tl.load(scale_ptr + cols * stride_sn + group, col_ok, 0.0)
                if FORMAT == 1:
                    w = (code - 8.0) * scale[None, :]
                else:
                    offset = tl.load(offset_ptr + cols * stride_sn + group, col_ok, 0.0)
                    w = code * scale[None, :] + offset[None, :]
            elif FORMAT == 4:  # native fp8: no `other` (0 does not cast to fp8), mask after
                raw = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], w_mask)
                w = tl.where(w_mask, raw.to(tl.float32), 0.0)
            else:
                raw = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], w_mask, 0)
                if FORMAT == 3:
                    w = _decode_e4m3(raw)
                else:
                    w = raw.to(tl.float32)
            # fp32 tiles: "ieee", or Ampere and later run the product in TF32 (10-bit mantissa).
            acc += tl.dot(x, w, input_precision="ieee")
        if FORMAT == 0 or FORMAT >= 3:  # per-channel scale, once per output column
            acc = acc * tl.load(scale_ptr + cols, col_ok, 0.0)[None, :]
        tl.store(
            y_ptr + rows[:, None] * stride_ym + cols[None, :],
            acc,
            mask=row_ok[:, None] & col_ok[None, :],
        )


def _operands(
    weight: Any, native_fp8: bool
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(format id, codes, scale, offset, group) of a weight object, as the kernel takes them."""
    if isinstance(weight, Int8Weight):
        return INT8, weight.codes, weight.scale, weight.scale, 1
    if isinstance(weight, Fp8Weight) and native_fp8:
        return FP8_NATIVE, weight.codes, weight.scale, weight.scale, 1
    if isinstance(weight, Fp8Weight):
        return FP8, weight.codes.view(torch.uint8), weight.scale, weight.scale, 1
    if isinstance(weight, Int4Weight):
        offset = weight.scale if weight.offset is None else weight.offset
        fmt = INT4_SYMMETRIC if weight.offset is None else INT4_ASYMMETRIC
        return fmt, weight.packed, weight.scale, offset.contiguous(), weight.group_size
    raise TypeError(f"the kernel takes INT8, INT4 or FP8 weights, not {type(weight).__name__}")


def dequant_matmul_triton(
    x: torch.Tensor,
    weight: Any,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
    native_fp8: bool = False,
) -> torch.Tensor:
    """x [M, K] fp32 @ dequantize(weight).T -> [M, N] fp32, dequantizing inside the kernel."""
    if triton is None:
        raise RuntimeError("the Triton kernel needs the triton package")
    fmt, codes, scale, offset, group = _operands(weight, native_fp8)
    if group > 1 and group % block_k:
        raise ValueError(f"block_k={block_k} must divide the INT4 group size {group}")
    x = x.float().contiguous()
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    with on_device(x.device):  # Triton launches on the current device
        _dequant_matmul_kernel[grid](
            x,
            codes,
            scale,
            offset,
            y,
            m,
            n,
            k,
            x.stride(0),
            codes.stride(0),
            scale.stride(0),
            y.stride(0),
            FORMAT=fmt,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return y
