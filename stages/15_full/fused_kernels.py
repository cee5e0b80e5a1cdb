"""Fewer kernels per decoder layer: three Triton kernels that each do what several PyTorch calls do.

A decode step of a small batch is bound by launches, not by arithmetic: each PyTorch call on a
GPU is at least one kernel, and a layer written plainly makes about eighteen (RoPE alone is
five: a table lookup, two products, a roll and a sum; the KV write two `index_copy_`). Each
launch costs the host microseconds and the GPU a gap. These kernels fold the elementwise work
between the matmuls into three launches, as vLLM's and SGLang's custom ops do:

- `add_rms_norm`: the residual add and the RMSNorm after it, one pass over the row (the sum is
  written back as the new residual, the normalised row is the next matmul's input);
- `silu_mul`: SwiGLU's `silu(gate) * up` over the fused gate/up projection's output;
- `rope_and_cache`: rotate q and k by their positions (RoPE, the rotate-half layout of
  `model.RotaryEmbedding`) and write k and v into their slots of the paged cache.

Each has its PyTorch reference (`*_reference`), which is what the model runs on a CPU (where
one call is cheap and these small kernels only run under the Triton interpreter), and the
oracle the tests hold the kernel to. The model takes the kernels where the attention backend
is "triton" (CUDA). `STAGES_FUSED_KERNELS=0` in the environment turns them off on CUDA too
(the references run, the decode attention is neither folded nor split: kernels.py), so a GPU
run can tell a kernel's fault from the engine's (tools/gpu_bench.py --reference-kernels).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from stages.common.devices import kernel_device, on_device

try:  # Triton is optional at import time: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def add_rms_norm_reference(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h) * weight): the new residual and the normalised row."""
    total = x + h
    return total, F.rms_norm(total, weight.shape, weight, eps)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_reference(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> torch.Tensor:
    """`model.RotaryEmbedding.forward`: x [tokens, heads, dim] rotated by its positions, from a
    table [max_positions, 2, dim] of cos and of sin with its first half negated."""
    cos, signed_sin = cos_sin[positions].unsqueeze(2).unbind(1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rope_and_cache_reference(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qk [tokens, heads + kv_heads, dim] rotated and split into (q, k); k and v written to
    their slots of the caches [blocks, block_size, kv_heads, dim] (`PagedKVCache.write`)."""
    q, k = rotate_reference(qk, positions, cos_sin).split([num_heads, qk.shape[1] - num_heads], 1)
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
    return q, k


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, h_ptr, weight_ptr, total_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=valid, other=0.0)
        h = tl.load(h_ptr + row * n_cols + cols, mask=valid, other=0.0)
        total = x + h  # in the model's dtype, as the unfused add rounds it
        tl.store(total_ptr + row * n_cols + cols, total, mask=valid)
        t = total.to(tl.float32)
        mean_square = tl.sum(t * t, axis=0) / n_cols
        weight = tl.load(weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        out = t * tl.rsqrt(mean_square + eps) * weight
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < n_cols
        gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=valid, other=0.0)
        up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=valid, other=0.0)
        g = gate.to(tl.float32)
        out = g * tl.sigmoid(g) * up.to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _rope_and_cache_kernel(
        qk_ptr, v_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
        q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr,
        stride_qk_token, stride_qk_head, stride_v_token, stride_v_head,
        num_heads, num_kv_heads,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    ):  # fmt: skip
        """One (token, head) of q or k: rotate it; a k head also writes k and v to the slot."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, DIM_PAD)
        valid = d < HEAD_DIM
        partner = (d + HEAD_DIM // 2) % HEAD_DIM  # rotate-half as a roll by half the head
        position = tl.load(positions_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + position * 2 * HEAD_DIM + d, mask=valid, other=0.0)
        sin = tl.load(cos_sin_ptr + position * 2 * HEAD_DIM + HEAD_DIM + d, mask=valid, other=0.0)
        row = qk_ptr + token * stride_qk_token + head * stride_qk_head
        x = tl.load(row + d, mask=valid, other=0.0).to(tl.float32)
        x_partner = tl.load(row + partner, mask=valid, other=0.0).to(tl.float32)
        rotated = x * cos + x_partner * sin
        if head < num_heads:
            out = q_out_ptr + (token * num_heads + head) * HEAD_DIM + d
            tl.store(out, rotated.to(q_out_ptr.dtype.element_ty), mask=valid)
        else:
            kv_head = head - num_heads
            k = rotated.to(k_out_ptr.dtype.element_ty)
            tl.store(k_out_ptr + (token * num_kv_heads + kv_head) * HEAD_DIM + d, k, mask=valid)
            slot = tl.load(slot_ptr + token).to(tl.int64)
            cache_row = (slot * num_kv_heads + kv_head) * HEAD_DIM + d
            tl.store(k_cache_ptr + cache_row, k, mask=valid)
            value = tl.load(
                v_ptr + token * stride_v_token + kv_head * stride_v_head + d, mask=valid
            )
            tl.store(v_cache_ptr + cache_row, value, mask=valid)


# Read once, at import: the switch is for a whole process (a bench or a check), not per call.
FUSED_KERNELS = os.environ.get("STAGES_FUSED_KERNELS", "1") != "0"


def use_triton(t: torch.Tensor) -> bool:
    """The kernels run on CUDA tensors where Triton is installed (unless FUSED_KERNELS is off);
    a CPU runs the references (one PyTorch call is cheap there, and the kernels run only under
    the interpreter)."""
    return FUSED_KERNELS and t.is_cuda and triton is not None


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: (x + h, its normalised row)."""
    if use_triton(x):
        return add_rms_norm_triton(x.contiguous(), h.contiguous(), weight, eps)
    return add_rms_norm_reference(x, h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation over the fused gate/up projection's output."""
    if use_triton(gate_up):
        return silu_mul_triton(gate_up.contiguous())
    return silu_mul_reference(gate_up)


def rope_and_cache(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated, k and v written to their slots: (q, k)."""
    run = rope_and_cache_triton if use_triton(qk) else rope_and_cache_reference
    return run(qk, v, positions, cos_sin, num_heads, k_cache, v_cache, slot_mapping)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed; use attention_backend='torch'")


def add_rms_norm_triton(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_reference` in one kernel: one program per row (rows of x and h
    contiguous, [tokens, hidden])."""
    _require_triton()
    device = kernel_device(x=x, h=h, weight=weight)
    assert x.is_contiguous() and h.is_contiguous() and x.shape == h.shape
    total, out = torch.empty_like(x), torch.empty_like(x)
    rows, cols = x.numel() // x.shape[-1], x.shape[-1]
    with on_device(device):
        _add_rms_norm_kernel[(rows,)](x, h, weight, total, out, cols, eps, BLOCK=_block(cols))
    return total, out


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul_reference` in one kernel: grid (rows, column tiles of 1,024)."""
    _require_triton()
    device = kernel_device(gate_up=gate_up)
    assert gate_up.is_contiguous()
    cols = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1]
    out = torch.empty(*gate_up.shape[:-1], cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _block(cols))
    with on_device(device):
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, cols, BLOCK=block)
    return out


def rope_and_cache_triton(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_and_cache_reference` in one kernel: grid (tokens, heads + kv_heads). The rotation
    is computed in fp32 and rounded once (the reference rounds each product in the model's
    dtype: the same within bf16's precision, exactly the same in fp32)."""
    _require_triton()
    device = kernel_device(
        qk=qk, v=v, positions=positions, cos_sin=cos_sin, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slot_mapping,
    )  # fmt: skip
    tokens, heads, dim = qk.shape
    num_kv_heads = heads - num_heads
    assert qk.stride(-1) == 1 and v.stride(-1) == 1 and cos_sin.is_contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and dim % 2 == 0
    q = torch.empty(tokens, num_heads, dim, dtype=qk.dtype, device=qk.device)
    k = torch.empty(tokens, num_kv_heads, dim, dtype=k_cache.dtype, device=qk.device)
    with on_device(device):
        _rope_and_cache_kernel[(tokens, heads)](
            qk, v, positions, cos_sin, slot_mapping, q, k, k_cache, v_cache,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), num_heads, num_kv_heads,
            HEAD_DIM=dim, DIM_PAD=_block(dim),
        )  # fmt: skip
    return q, k
