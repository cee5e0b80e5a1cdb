"""Paged attention for decode: one query token per sequence, K/V read through a block table.

Two implementations of the same function, `paged_attention(q, k_cache, v_cache, block_tables,
context_lens, scale)`:

- `paged_attention_triton`: a Triton kernel, one program per (sequence, kv head). It walks the
  sequence's context tile by tile, looks up which block holds each position, loads those K/V
  rows straight from the pool and keeps a running (online) softmax, so K/V are read exactly once
  and never copied. The default on CUDA; tested on the CPU under TRITON_INTERPRET=1.
- `paged_attention_reference`: plain PyTorch. It gathers each sequence's blocks into a padded
  tensor and runs ordinary attention with a length mask. Clear, and the fastest correct path on
  a CPU, at the price of one extra copy of the K/V it reads.

Shapes: q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size,
num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] (int32, unused entries arbitrary);
context_lens [num_seqs] (int32, >= 1). Query head h reads kv head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional at import time: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gather each sequence's K/V blocks through its block table, then masked attention.

    The gather is one `index_select` over whole blocks (a memcpy per block, several times faster
    on CPU than advanced indexing); shorter sequences are padded to the longest and the padding
    is masked out. The query heads of one KV group ride along as SDPA's query-length axis, so GQA
    needs no copy of K/V per query head.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_context = int(context_lens.max())
    num_blocks = -(-max_context // block_size)
    # With one block (the contiguous layout's single max-length region), copy only the rows used.
    rows = min(block_size, max_context)
    blocks = block_tables[:, :num_blocks].reshape(-1).long()
    shape = (num_seqs, num_blocks * rows, num_kv_heads, head_dim)
    # [seqs * blocks, rows, kv_heads, dim] -> [seqs, kv_heads, context, dim] (a view, no copy)
    k = k_cache[:, :rows].index_select(0, blocks).view(shape)[:, :max_context].transpose(1, 2)
    v = v_cache[:, :rows].index_select(0, blocks).view(shape)[:, :max_context].transpose(1, 2)
    positions = torch.arange(max_context, device=q.device)
    valid = positions[None, :] < context_lens[:, None]  # [seqs, context]
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


if triton is not None:

    @triton.jit
    def _paged_attention_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale,
        stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table_seq,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, TILE)
        heads = kv_head * GROUP + g
        q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
            mask=q_mask,
            other=0.0,
        ).to(tl.float32)  # [GROUP_PAD, DIM_PAD]
        context = tl.load(context_lens_ptr + seq)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        for start in range(0, context, TILE):
            pos = start + t  # [TILE] token positions in this sequence
            valid = pos < context
            # Which block holds each position, and which slot inside it.
            block = tl.load(
                block_tables_ptr + seq * stride_table_seq + pos // BLOCK_SIZE, mask=valid, other=0
            ).to(tl.int64)
            slot = pos % BLOCK_SIZE
            kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(
                k_cache_ptr
                + block[:, None] * stride_k_block
                + slot[:, None] * stride_k_slot
                + kv_head * stride_k_head
                + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)  # [TILE, DIM_PAD]
            v = tl.load(
                v_cache_ptr
                + block[:, None] * stride_v_block
                + slot[:, None] * stride_v_slot
                + kv_head * stride_v_head
                + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, TILE]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # Online softmax: rescale what was accumulated so far to the new running max.
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            acc = acc * correction[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            running_sum = running_sum * correction + tl.sum(p, axis=1)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(
            out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Launch the Triton decode kernel: grid = (num_seqs, num_kv_heads)."""
    if triton is None:
        raise RuntimeError("triton is not installed; use attention_backend='torch'")
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    tile = min(_next_power_of_2(block_size), 32)
    _paged_attention_decode_kernel[(num_seqs, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=_next_power_of_2(group),
        HEAD_DIM=head_dim, DIM_PAD=_next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, TILE=tile,
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    backend: str = "torch",
) -> torch.Tensor:
    """Decode attention over a paged KV cache with the chosen implementation."""
    if backend == "triton":
        return paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """'auto' -> the Triton kernel on CUDA, the PyTorch path elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if name not in ("triton", "torch"):
        raise ValueError(f"attention_backend must be 'auto', 'triton' or 'torch', got {name!r}")
    return name
