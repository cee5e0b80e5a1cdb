"""The CPU path of paged attention (backend "torch"): `kernels.paged_attention`'s function, built
from the fused attention kernel that `F.scaled_dot_product_attention` (SDPA) runs on a CPU.

That kernel is fast only when a call has the shape it takes. It wants as many query heads as
K/V heads: with `enable_gqa`, SDPA falls back to unfused matmuls that hold every score in memory.
And a mask is read for every score: for a chunk over a long cached context almost all of it says
"visible". So each kind of sequence in the batch gets a call shaped for the kernel:

- prompts (`_prompt`): L new tokens after C >= 0 cached ones; a fresh prompt (C = 0), a prefill
  chunk, a prefix-cache hit, speculative draft tokens. Attention over the context and over the
  new tokens run as two calls without masks, merged exactly by their log-sum-exps;
- decodes (L = 1 after a context) are batched: one gather of all their blocks, padded to the
  longest, and one SDPA with a length mask. A step of decodes alone (no prompt in the batch)
  goes straight there.

In both, the query heads that share a K/V head ride along as extra query rows, so each cached
K/V row is read once per K/V head and nothing is copied per query head.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

# The fused CPU kernel behind SDPA, called directly because it also returns each query row's
# log-sum-exp of scores, which the public function drops (None: a torch without it).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _rows(index: list[int], device: torch.device) -> slice | torch.Tensor:
    """Select `index` along dim 0: a free slice when consecutive, else an index tensor."""
    if index == list(range(index[0], index[0] + len(index))):
        return slice(index[0], index[0] + len(index))
    return torch.tensor(index, device=device)


def _gather(
    cache: torch.Tensor, tables: torch.Tensor, length: int, blocks: torch.Tensor | None = None
) -> torch.Tensor:
    """The first `length` positions of each table's sequence: [len(tables), length, kv_heads,
    dim]. One `index_select` over whole blocks (a memcpy per block, several times faster on CPU
    than indexing position by position). Past a shorter sequence's end the table entries are
    arbitrary: clamped to some real block, whose rows the caller masks out. `blocks`: that
    index (`_block_index`), when the caller already made it for the K cache's twin."""
    rows = min(cache.shape[1], length)
    if blocks is None:
        blocks = _block_index(cache, tables, length)
    shape = (tables.shape[0], blocks.shape[0] // tables.shape[0] * rows, *cache.shape[2:])
    # With one block (the contiguous layout's single max-length region), copy only the rows used.
    return cache[:, :rows].index_select(0, blocks).view(shape)[:, :length]


def _block_index(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The blocks holding each table's first `length` positions, one flat index for `_gather`
    (int32 as the tables are: `index_select` takes it). Entries past a sequence's end are
    arbitrary (a shorter sequence in the batch, or host lengths that are only an upper bound, as
    a captured graph's are): clamped to some real block, whose rows the mask hides."""
    blocks = tables[:, : -(-length // cache.shape[1])].reshape(-1)
    return blocks.clamp(0, cache.shape[0] - 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] -> [1, heads, tokens, dim], a view."""
    return x.transpose(0, 1)[None]


def _attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [1, heads, n, dim] over k, v [1, heads, m, dim] (causal: row i
    sees keys 0 .. i), with each row's log-sum-exp of scores [1, heads, n] in fp32."""
    if _FLASH_CPU is not None and q.device.type == "cpu":
        return _FLASH_CPU(q, k, v, is_causal=causal, scale=scale)
    scores = (q @ k.transpose(-1, -2)).float() * scale  # the same, unfused
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse[..., None]).to(v.dtype) @ v, lse


def _prompt(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_context: torch.Tensor | None,
    v_context: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """L new tokens after C cached ones: q [L, heads, dim], k_new, v_new [L, kv_heads, dim],
    k_context, v_context [C, kv_heads, dim] (None: C = 0) -> [L, heads, dim].

    The softmax over C + L positions is split at the context boundary, as flash-attention's
    cascade attention does: over the context every query sees every position (no mask), over
    the new tokens attention is plain causal. Each part is a softmax over its own keys, and its
    log-sum-exp says how much of the whole softmax's mass it holds: the exact result is the two
    outputs weighted by those shares.
    """
    length, num_heads, dim = q.shape
    num_kv_heads = k_new.shape[1]
    group = num_heads // num_kv_heads
    # New tokens: K/V repeated per query head (L rows, cheap), since causal rows cannot stack.
    k_rep, v_rep = k_new.repeat_interleave(group, dim=1), v_new.repeat_interleave(group, dim=1)
    out, lse = _attention_lse(
        _heads_first(q), _heads_first(k_rep), _heads_first(v_rep), scale, causal=True
    )
    out = out[0].float()  # [heads, L, dim]
    if k_context is not None and v_context is not None:
        # Query row (kv head g, member j, token i) is query head g * group + j: heads' order.
        stacked = q.view(length, num_kv_heads, group, dim).permute(1, 2, 0, 3)
        out_context, lse_context = _attention_lse(
            stacked.reshape(1, num_kv_heads, group * length, dim),
            _heads_first(k_context),
            _heads_first(v_context),
            scale,
            causal=False,
        )
        share = torch.sigmoid(lse_context.reshape(num_heads, length) - lse[0])  # e^a/(e^a+e^b)
        context_out = out_context.view(num_heads, length, dim).float()
        out = torch.lerp(out, context_out, share[..., None])
    return out.transpose(0, 1).to(q.dtype)


def _decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    longest: int,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, q [seqs, heads, dim]: one gather, one SDPA masked by the
    real lengths (`seq_lens`, read on the device: `longest`, from the host's lengths, is only
    an upper bound). A step runs this once per layer: it makes the block index once, for K and
    for V."""
    blocks = _block_index(k_cache, tables, longest)
    # [seqs, context, kv_heads, dim] -> [seqs, kv_heads, context, dim] (a view, no copy)
    k = _gather(k_cache, tables, longest, blocks).transpose(1, 2)
    v = _gather(v_cache, tables, longest, blocks).transpose(1, 2)
    valid = torch.arange(longest, device=q.device)[None, :] < seq_lens[:, None]
    num_seqs, num_heads, head_dim = q.shape
    grouped = q.reshape(num_seqs, k.shape[1], num_heads // k.shape[1], head_dim)
    out = F.scaled_dot_product_attention(
        grouped, k, v, attn_mask=valid[:, None, None, :], scale=scale
    )
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_attention_cpu(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor | None,
    scale: float,
    *,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
) -> torch.Tensor:
    """`kernels.paged_attention`'s "torch" backend (same arguments, no query_start_loc)."""
    if all(n == 1 for n in query_lens) and all(context_lens):  # a decode step: no prompt
        assert k_cache is not None and v_cache is not None and block_tables is not None
        longest = max(context_lens) + 1
        return _decodes(q, k_cache, v_cache, seq_lens, block_tables, longest, scale)
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(query_lens)]
    decodes: list[int] = []
    for s, (length, context) in enumerate(zip(query_lens, context_lens, strict=True)):
        rows = slice(starts[s], starts[s] + length)
        if context > 0 and length == 1:
            decodes.append(s)
            continue
        k = v = None
        if context > 0:
            assert k_cache is not None and v_cache is not None and block_tables is not None
            table = block_tables[s : s + 1]
            k, v = _gather(k_cache, table, context)[0], _gather(v_cache, table, context)[0]
        out[rows] = _prompt(q[rows], k_new[rows], v_new[rows], k, v, scale)
    if decodes:
        assert k_cache is not None and v_cache is not None and block_tables is not None
        seqs, rows = _rows(decodes, q.device), _rows([starts[s] for s in decodes], q.device)
        longest = max(context_lens[s] for s in decodes) + 1
        out[rows] = _decodes(
            q[rows], k_cache, v_cache, seq_lens[seqs], block_tables[seqs], longest, scale
        )
    return out
