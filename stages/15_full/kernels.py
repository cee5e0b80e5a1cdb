"""Paged attention for any mix of prompts and decodes: one call, K/V read through block tables.

A step's batch is flat: T query tokens that belong to S sequences. Sequence s owns the query rows
q[query_start_loc[s] : query_start_loc[s + 1]] (its query_len L >= 1) and has seq_lens[s] =
context + L tokens in all, `context` of them cached by earlier steps. Its query i sits at position
context + i and attends to positions 0 .. context + i: the whole cached context, and the new
tokens causally. A fresh prompt is context 0, a decode is L = 1, a prompt continuing a cached
prefix is both > 0; one function covers them all, like vLLM's unified attention. When it runs,
the K/V of every position (cached and new) are already in the pool: position p of sequence s is
in slot p % block_size of block block_tables[s, p // block_size].

Three implementations of that one function:

- `unified_attention_reference`: plain PyTorch, the definition. Per sequence, gather its K/V
  through the block table and run softmax attention with a causal mask offset by the context.
- `unified_attention_triton`: a Triton kernel. Grid (sequence, kv head, tile of BLOCK_Q query
  tokens). A program stacks its query tokens x the GROUP query heads that share its kv head into
  one [BLOCK_M, head_dim] matrix, so each K/V row loaded serves all of them (grouped-query
  attention for free, and a matrix tall enough for `tl.dot`). It walks positions TILE at a time up
  to the causal limit of its last query, looks up each position's block, loads K/V straight from
  the pool and keeps an online softmax in fp32: K/V are read once and never copied. The default
  on CUDA; tested on the CPU under TRITON_INTERPRET=1.
- `decode_attention_split_triton`: flash-decoding for a batch of decodes over long contexts.
  One program per (sequence, kv head) leaves most of a GPU idle when the batch is small: batch 1
  of SmolLM2 is 3 programs on a GPU of 132 multiprocessors, each walking the whole context
  alone. Here each sequence's context is cut into `num_splits` chunks, one program each, that
  write a partial output and its log-sum-exp; a second kernel merges them exactly (the
  softmax of the whole context is the partial outputs weighted by exp(lse_i - lse)). The chunk
  size is computed per sequence inside the kernel, so any length is covered by the same grid
  (a CUDA graph replays it at every context); a chunk past the end writes an empty partial.
  `decode_splits` picks the count: 1 unless the batch fills too few programs and the context
  is long. `unified_attention_triton` takes this path for a decode-only batch when it pays.
- `decode_attention_rope_cache_triton`: the decode step's attention with the two jobs before
  it folded in, so a decode layer launches one kernel fewer. Each program rotates its query
  heads itself (RoPE, from the raw projection), and the program whose chunk holds the new
  position rotates the new key and writes it and the value to their slot before it reads the
  context: no other program reads that position, so nothing races. Same results as
  `fused_kernels.rope_and_cache` followed by the split or unified kernel.
- `paged_attention`, the dispatcher the model calls: backend "triton" runs the kernel; "torch"
  runs `cpu_attention.paged_attention_cpu`, the same function shaped for the fused attention
  kernel PyTorch has on a CPU.

Shapes: q [T, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
head_dim]; query_start_loc [S + 1] and seq_lens [S] (int32); block_tables [S, max_blocks] (int32,
unused entries arbitrary). Query head h reads kv head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from stages.common.devices import kernel_device, on_device

from .cpu_attention import paged_attention_cpu
from .fused_kernels import FUSED_KERNELS

try:  # Triton is optional at import time: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [L, heads, dim] are the last L of the N positions in k, v [N, kv_heads,
    dim]; query i sits at position N - L + i and sees keys 0 .. N - L + i."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # heads first
    num_queries, num_keys = q.shape[1], k.shape[1]
    mask = None  # without a cached prefix, plain causal attention
    if num_keys > num_queries:  # a causal mask whose diagonal is shifted by the context
        rows = torch.arange(num_queries, device=q.device)[:, None] + num_keys - num_queries
        mask = torch.arange(num_keys, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
    )  # enable_gqa: query head h reads kv head h // group, without copying K/V per query head
    return out.transpose(0, 1)


def unified_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The definition: per sequence, gather its K/V position by position, then attend."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        positions = torch.arange(seq_len, device=q.device)
        blocks = block_tables[s, positions // block_size].long()
        k = k_cache[blocks, positions % block_size]  # [seq_len, kv_heads, head_dim]
        v = v_cache[blocks, positions % block_size]
        rows = slice(starts[s], starts[s + 1])
        out[rows] = _attend(q[rows], k, v, scale)
    return out


if triton is not None:

    @triton.jit
    def _unified_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, scale,
        stride_q_token, stride_q_head, stride_o_token, stride_o_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table_seq,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        TILE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        q_block = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= query_len:
            return  # the grid is sized for the longest query; this sequence is shorter
        context = tl.load(seq_lens_ptr + seq) - query_len
        # Row r of this program's matrix: query token r // GROUP of the tile, head r % GROUP of
        # the group. The last rows are padding when BLOCK_M is not a multiple of GROUP.
        r = tl.arange(0, BLOCK_M)
        q_index = q_block * BLOCK_Q + r // GROUP  # index among this sequence's query tokens
        heads = kv_head * GROUP + r % GROUP
        row_valid = (r < BLOCK_Q * GROUP) & (q_index < query_len)
        d = tl.arange(0, DIM_PAD)
        dim_valid = d < HEAD_DIM  # head_dim padded to a power of two
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(
            q_ptr
            + (q_start + q_index)[:, None] * stride_q_token
            + heads[:, None] * stride_q_head
            + d[None, :],
            mask=q_mask,
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_M, DIM_PAD]
        q_pos = context + q_index  # each row's position in its sequence
        # The tile's last query sees positions up to kv_end - 1; nothing after it is read.
        kv_end = context + tl.minimum((q_block + 1) * BLOCK_Q, query_len)
        t = tl.arange(0, TILE)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        for start in range(0, kv_end, TILE):
            pos = start + t  # [TILE] key positions
            kv_valid = pos < kv_end
            # Which block holds each position, and which slot inside it.
            block = tl.load(
                block_tables_ptr + seq * stride_table_seq + pos // BLOCK_SIZE,
                mask=kv_valid,
                other=0,
            ).to(tl.int64)
            slot = pos % BLOCK_SIZE
            kv_mask = kv_valid[:, None] & dim_valid[None, :]
            k = tl.load(
                k_cache_ptr
                + block[:, None] * stride_k_block
                + slot[:, None] * stride_k_slot
                + kv_head * stride_k_head
                + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(DOT_DTYPE)  # [TILE, DIM_PAD]
            v = tl.load(
                v_cache_ptr
                + block[:, None] * stride_v_block
                + slot[:, None] * stride_v_slot
                + kv_head * stride_v_head
                + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(DOT_DTYPE)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, TILE]
            # Causal: a query sees keys up to its own position. Position 0 is always visible,
            # so every row has a finite max after the first tile (no NaN from -inf - -inf).
            visible = kv_valid[None, :] & (pos[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            # Online softmax: rescale what was accumulated so far to the new running max.
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            running_sum = running_sum * correction + tl.sum(p, axis=1)
            running_max = new_max
        out = acc / running_sum[:, None]
        tl.store(
            out_ptr
            + (q_start + q_index)[:, None] * stride_o_token
            + heads[:, None] * stride_o_head
            + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


MIN_SPLIT_TOKENS = 256  # a chunk shorter than this costs more in the merge than it saves
MAX_SPLITS = 16


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many chunks each decode's context is cut into (a power of two; 1: no split): enough
    programs to give every multiprocessor two, but no chunk under MIN_SPLIT_TOKENS positions.
    A batch that fills the device already, or short contexts, get 1."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = min(MAX_SPLITS, -(-2 * num_sms // programs), max_seq_len // MIN_SPLIT_TOKENS)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1


def _sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; the CPU, which runs kernels only under the
    interpreter (the tests), counts as 8."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


if triton is not None:

    @triton.jit
    def _attend_chunk(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end, scale,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head, stride_table_seq, d, dim_valid,
        BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        DIM_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        """The attention of q [BLOCK_M, DIM_PAD] over positions start .. end - 1 of one
        sequence's kv head, walked TILE at a time through its block table with an online
        softmax: (output [BLOCK_M, DIM_PAD] fp32, log-sum-exp [BLOCK_M]); an empty chunk (it
        starts past the sequence's end) gives zeros and -inf. Shared by the decode kernels."""
        t = tl.arange(0, TILE)
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        for tile_start in range(start, end, TILE):
            pos = tile_start + t
            kv_valid = pos < end
            block = tl.load(
                block_tables_ptr + seq * stride_table_seq + pos // BLOCK_SIZE,
                mask=kv_valid,
                other=0,
            ).to(tl.int64)
            slot = pos % BLOCK_SIZE
            kv_mask = kv_valid[:, None] & dim_valid[None, :]
            k_rows = block[:, None] * stride_k_block + slot[:, None] * stride_k_slot
            k = tl.load(
                k_cache_ptr + k_rows + kv_head * stride_k_head + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(DOT_DTYPE)  # [TILE, DIM_PAD]
            v_rows = block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
            v = tl.load(
                v_cache_ptr + v_rows + kv_head * stride_v_head + d[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(DOT_DTYPE)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, TILE]
            scores = tl.where(kv_valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            running_sum = running_sum * correction + tl.sum(p, axis=1)
            running_max = new_max
        empty = running_sum == 0.0  # a chunk that starts past the sequence's end
        safe_sum = tl.where(empty, 1.0, running_sum)
        out = acc / safe_sum[:, None]
        lse = tl.where(empty, float("-inf"), running_max + tl.log(safe_sum))
        return out, lse

    @triton.jit
    def _split_decode_kernel(
        partial_ptr, lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, scale,
        stride_q_token, stride_q_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table_seq, num_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        token = tl.load(query_start_loc_ptr + seq)  # a decode: its one query token
        seq_len = tl.load(seq_lens_ptr + seq)
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE  # per sequence, whole tiles
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)
        # Row r: query head r of the kv head's group (rows past GROUP are padding for tl.dot).
        r = tl.arange(0, BLOCK_M)
        heads = kv_head * GROUP + r
        row_valid = r < GROUP
        d = tl.arange(0, DIM_PAD)
        dim_valid = d < HEAD_DIM
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(
            q_ptr + token * stride_q_token + heads[:, None] * stride_q_head + d[None, :],
            mask=q_mask,
            other=0.0,
        ).to(DOT_DTYPE)  # [BLOCK_M, DIM_PAD]
        out, lse = _attend_chunk(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end, scale,
            stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head, stride_table_seq, d, dim_valid,
            BLOCK_M, BLOCK_SIZE, TILE, DIM_PAD, DOT_DTYPE,
        )  # fmt: skip
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # [seq, head, split], flat
        tl.store(partial_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        tl.store(lse_ptr + row, lse, mask=row_valid)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, partial_ptr, lse_ptr, stride_o_token, stride_o_head, query_start_loc_ptr,
        num_heads, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head = tl.program_id(1)
        rows = (seq * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
        lse = tl.load(lse_ptr + rows)
        weights = tl.exp(lse - tl.max(lse, axis=0))  # chunk 0 is never empty: a finite max
        weights = weights / tl.sum(weights, axis=0)
        d = tl.arange(0, DIM_PAD)
        dim_valid = d < HEAD_DIM
        partial = tl.load(
            partial_ptr + rows[:, None] * HEAD_DIM + d[None, :],
            mask=dim_valid[None, :],
            other=0.0,
        )
        out = tl.sum(partial * weights[:, None], axis=0)
        token = tl.load(query_start_loc_ptr + seq)
        tl.store(
            out_ptr + token * stride_o_token + head * stride_o_head + d,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_valid,
        )


def decode_attention_split_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
) -> torch.Tensor:
    """Decode-only attention (one query token per sequence) with each context cut into
    `num_splits` chunks (a power of two): grid (seqs, kv_heads, num_splits) writes each
    chunk's partial output and log-sum-exp in fp32, then grid (seqs, heads) merges them. Same
    arguments and result as `unified_attention_triton` on such a batch."""
    if triton is None:
        raise RuntimeError("triton is not installed; use attention_backend='torch'")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    device = kernel_device(
        q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables,
    )  # fmt: skip
    num_seqs, num_heads, head_dim = seq_lens.shape[0], q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, device=q.device)
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(k_cache.dtype)
    if dot_dtype is None or os.environ.get("TRITON_INTERPRET") == "1":
        dot_dtype = tl.float32
    dim_pad = max(16, _next_power_of_2(head_dim))
    with on_device(device):  # Triton launches on the current device
        _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            partial, lse, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), num_heads,
            GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
            BLOCK_M=max(16, _next_power_of_2(group)), TILE=32, NUM_SPLITS=num_splits,
            DOT_DTYPE=dot_dtype,
        )  # fmt: skip
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, partial, lse, out.stride(0), out.stride(1), query_start_loc, num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _rope_cache_decode_kernel(
        out_ptr, partial_ptr, lse_ptr, qk_ptr, v_new_ptr, positions_ptr, cos_sin_ptr, slot_ptr,
        k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, scale,
        stride_qk_token, stride_qk_head, stride_vn_token, stride_vn_head,
        stride_o_token, stride_o_head,
        stride_k_block, stride_k_slot, stride_k_head,
        stride_v_block, stride_v_slot, stride_v_head,
        stride_table_seq, num_heads,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        token = tl.load(query_start_loc_ptr + seq)  # a decode: its one query token
        seq_len = tl.load(seq_lens_ptr + seq)
        chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE  # as _split_decode_kernel
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)
        d = tl.arange(0, DIM_PAD)
        dim_valid = d < HEAD_DIM
        partner = (d + HEAD_DIM // 2) % HEAD_DIM  # rotate-half as a roll by half the head
        position = tl.load(positions_ptr + token).to(tl.int64)
        cos = tl.load(cos_sin_ptr + position * 2 * HEAD_DIM + d, mask=dim_valid, other=0.0)
        sin = tl.load(
            cos_sin_ptr + position * 2 * HEAD_DIM + HEAD_DIM + d, mask=dim_valid, other=0.0
        )
        # The GROUP query heads of this kv head, rotated here and rounded to the model's dtype
        # as `rope_and_cache` stores them.
        r = tl.arange(0, BLOCK_M)
        heads = kv_head * GROUP + r
        row_valid = r < GROUP
        q_mask = row_valid[:, None] & dim_valid[None, :]
        q_rows = qk_ptr + token * stride_qk_token + heads[:, None] * stride_qk_head
        x = tl.load(q_rows + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
        x_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
        q = (x * cos[None, :] + x_partner * sin[None, :]).to(qk_ptr.dtype.element_ty)
        q = q.to(DOT_DTYPE)  # [BLOCK_M, DIM_PAD]
        # The new position's key and value go to their slot, written by the one program whose
        # chunk holds that position (no other program reads it), before that chunk is read.
        if (start <= seq_len - 1) & (seq_len - 1 < end):
            k_row = qk_ptr + token * stride_qk_token + (num_heads + kv_head) * stride_qk_head
            k_x = tl.load(k_row + d, mask=dim_valid, other=0.0).to(tl.float32)
            k_partner = tl.load(k_row + partner, mask=dim_valid, other=0.0).to(tl.float32)
            k_new = (k_x * cos + k_partner * sin).to(k_cache_ptr.dtype.element_ty)
            slot = tl.load(slot_ptr + token).to(tl.int64)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            k_dest = block * stride_k_block + offset * stride_k_slot + kv_head * stride_k_head
            tl.store(k_cache_ptr + k_dest + d, k_new, mask=dim_valid)
            v_new = tl.load(
                v_new_ptr + token * stride_vn_token + kv_head * stride_vn_head + d,
                mask=dim_valid,
            )
            v_dest = block * stride_v_block + offset * stride_v_slot + kv_head * stride_v_head
            tl.store(v_cache_ptr + v_dest + d, v_new, mask=dim_valid)
        tl.debug_barrier()  # the writes above, seen by every thread of the program below
        out, lse = _attend_chunk(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end, scale,
            stride_k_block, stride_k_slot, stride_k_head,
            stride_v_block, stride_v_slot, stride_v_head, stride_table_seq, d, dim_valid,
            BLOCK_M, BLOCK_SIZE, TILE, DIM_PAD, DOT_DTYPE,
        )  # fmt: skip
        if NUM_SPLITS == 1:  # the whole context: the output itself, no merge
            o_rows = token * stride_o_token + heads[:, None] * stride_o_head
            tl.store(out_ptr + o_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            row = (seq * num_heads + heads) * NUM_SPLITS + split  # [seq, head, split], flat
            tl.store(partial_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
            tl.store(lse_ptr + row, lse, mask=row_valid)


def decode_attention_rope_cache_triton(
    qk: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
) -> torch.Tensor:
    """A decode-only batch's attention from the raw projections: `fused_kernels.rope_and_cache`
    (q and k rotated, k and v written to their slots) and the decode attention after it, in
    one kernel, or two where the context is split (`decode_splits`, as
    `unified_attention_triton` picks them; the merge is `_merge_splits_kernel`).

    qk [T, heads + kv_heads, dim] (q heads first, unrotated), v_new [T, kv_heads, dim],
    positions [T], cos_sin [max_position, 2 * dim] (`RotaryEmbedding.cos_sin`), one query token
    per sequence. Returns the attention output [T, heads, dim]; the cache holds the new K/V."""
    if triton is None:
        raise RuntimeError("triton is not installed; use attention_backend='torch'")
    device = kernel_device(
        qk=qk, v_new=v_new, positions=positions, cos_sin=cos_sin, k_cache=k_cache,
        v_cache=v_cache, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables,
    )  # fmt: skip
    num_seqs, head_dim = seq_lens.shape[0], qk.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads = qk.shape[1] - num_kv_heads
    group = num_heads // num_kv_heads
    assert qk.stride(-1) == 1 and v_new.stride(-1) == 1 and cos_sin.is_contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and head_dim % 2 == 0
    splits = _decode_num_splits(qk, num_seqs, num_kv_heads, max_seq_len)
    out = torch.empty(qk.shape[0], num_heads, head_dim, dtype=qk.dtype, device=qk.device)
    partial = lse = out  # unused with one split (the kernel writes the output itself)
    if splits > 1:
        partial = torch.empty(num_seqs, num_heads, splits, head_dim, device=qk.device)
        lse = torch.empty(num_seqs, num_heads, splits, device=qk.device)
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(k_cache.dtype)
    if dot_dtype is None or os.environ.get("TRITON_INTERPRET") == "1":
        dot_dtype = tl.float32
    dim_pad = max(16, _next_power_of_2(head_dim))
    with on_device(device):
        _rope_cache_decode_kernel[(num_seqs, num_kv_heads, splits)](
            out, partial, lse, qk, v_new, positions, cos_sin, slot_mapping, k_cache, v_cache,
            query_start_loc, seq_lens, block_tables, scale,
            qk.stride(0), qk.stride(1), v_new.stride(0), v_new.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), num_heads,
            GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
            BLOCK_M=max(16, _next_power_of_2(group)), TILE=32, NUM_SPLITS=splits,
            DOT_DTYPE=dot_dtype,
        )  # fmt: skip
        if splits > 1:
            _merge_splits_kernel[(num_seqs, num_heads)](
                out, partial, lse, out.stride(0), out.stride(1), query_start_loc, num_heads,
                HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits,
            )  # fmt: skip
    return out


def _decode_num_splits(t: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """`decode_splits` for a decode-only batch on `t`'s device, from the host-side longest
    context alone, never from whether a CUDA graph is being captured: a graph's warm-up and its
    capture must launch the same `NUM_SPLITS` specialisation, or the capture is the first launch
    of a new one (a module load inside the capture, which fails). The graph path declares every
    row's context as the graphs' longest (`GraphPlan.max_context`), so both ask for the same
    count, and that count serves any real context (each chunk's size is computed per sequence
    inside the kernel). With the fused kernels off (`fused_kernels.FUSED_KERNELS`), 1."""
    if not FUSED_KERNELS:
        return 1
    return decode_splits(num_seqs, num_kv_heads, max_seq_len, _sms(t.device))


def unified_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Launch the kernel: grid = (num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q)).
    `max_query_len` sizes the grid; pass it from the host to avoid a device sync. A batch of
    decodes whose longest context (`max_seq_len`, from the host) is long enough to split, with
    too few programs to fill the device, goes to `decode_attention_split_triton` instead.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use attention_backend='torch'")
    if max_query_len == 1 and max_seq_len is not None:
        splits = _decode_num_splits(q, seq_lens.shape[0], k_cache.shape[2], max_seq_len)
        if splits > 1:
            return decode_attention_split_triton(
                q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, splits
            )
    device = kernel_device(
        q=q, k_cache=k_cache, v_cache=v_cache, query_start_loc=query_start_loc,
        seq_lens=seq_lens, block_tables=block_tables,
    )  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    block_m = max(16, _next_power_of_2(group))  # tl.dot wants every matrix side >= 16
    block_q = block_m // group  # query tokens per program
    grid = (seq_lens.shape[0], num_kv_heads, triton.cdiv(max_query_len, block_q))
    # Matrix products run in the cache's 16-bit dtype on a GPU (tensor cores), but the CPU
    # interpreter keeps bf16 as raw uint16 bits and cannot multiply them: fp32 there.
    dot_dtype = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(k_cache.dtype)
    if dot_dtype is None or os.environ.get("TRITON_INTERPRET") == "1":
        dot_dtype = tl.float32
    with on_device(device):  # Triton launches on the current device
        _unified_attention_kernel[grid](
            out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, DIM_PAD=max(16, _next_power_of_2(head_dim)),
            BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=32, DOT_DTYPE=dot_dtype,
        )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor | None,
    scale: float,
    *,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    backend: str = "torch",
) -> torch.Tensor:
    """Attention of a mixed batch with the chosen implementation.

    k_new, v_new [T, kv_heads, dim] are this step's K/V (already written to the cache as well).
    `query_lens` and `context_lens` are the host's copy of the lengths, so no device sync. The
    cache and tables may be None when every context is 0 (a forward that keeps no cache).
    """
    if backend != "triton":
        return paged_attention_cpu(
            q, k_new, v_new, k_cache, v_cache, seq_lens, block_tables, scale,
            query_lens=query_lens, context_lens=context_lens,
        )  # fmt: skip
    if k_cache is None or v_cache is None or block_tables is None:
        # Nothing is cached: this step's own K/V are a pool of one-slot blocks, and the block
        # table of a sequence simply lists its rows.
        k_cache, v_cache = k_new.unsqueeze(1), v_new.unsqueeze(1)
        offsets = torch.arange(max(query_lens), device=query_start_loc.device, dtype=torch.int32)
        block_tables = query_start_loc[:-1, None] + offsets[None, :]
    return unified_attention_triton(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in zip(context_lens, query_lens, strict=True)),
    )  # fmt: skip


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """'auto' -> the Triton kernel on CUDA, the PyTorch path elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if name not in ("triton", "torch"):
        raise ValueError(f"attention_backend must be 'auto', 'triton' or 'torch', got {name!r}")
    return name
