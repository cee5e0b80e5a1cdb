"""A quantized paged KV cache: 1-byte codes with one scale per (block, KV head).

Stage 03's pool stores K and V as [num_blocks, block_size, kv_heads, head_dim] in the model's
dtype. Here each element is one byte (INT8, or FP8 e4m3 kept as its bit pattern), and every
(block, head) has an fp32 scale = amax / 127 (INT8) or amax / 448 (FP8). A byte budget then
holds ~4x the fp32 blocks and ~2x the bf16 ones, less the scales' share: 4 bytes per
block_size * head_dim codes (0.4% at 16 x 64), see `kv_bytes_per_block`.

Quantize on write, dequantize on read. Tokens arrive a few at a time, so a block's range is
known only once it is full. A write whose values exceed the block's current range raises the
scale and requantizes the codes already there. Raised by a power of two (at least doubled), so
(a) FP8 codes move by whole binades and stay exact (bar values that fall into the subnormals),
and (b) INT8's repeated re-roundings sum to at most one step of the final scale: s/2 + s/4 +
s/8 + ... < s. Raising the scale to exactly the new amax instead would let a block growing one
token at a time re-round sixteen times (measured: errors of several steps). The price is a
scale up to 2x the block's amax / qmax, one bit of range in the worst case. A write at offset 0
starts a block afresh (blocks fill in order, so offset 0 means a new owner) and resets its
scales: stale values of a freed block never widen a new one's range. vLLM and SGLang use one
scale per tensor, from calibration or 1.0; per-block scales need no calibration.

Error bounds per element, s the (block, head) scale when read: INT8 |err| <= s / 2 when the
block was written at once (a prefill), < s after growth; FP8 |err| <= max(|x| * 2**-4,
s * 2**-10) at once, <= |x| * 2**-4 + s * 2**-9 after growth.

In the engine (`EngineConfig.kv_cache_dtype`): the runner sizes the pool with
`kv_cache_block_bytes`, so one `kv_cache_bytes` budget buys ~4x the fp32 blocks, and builds it
with `make_kv_cache`. Attention writes the step's K/V through `write`, then reads
`step_blocks`: the dequantized blocks the step's block tables name and the tables renumbered
into them. Whatever attention reads from the pool goes through the codes: the context (earlier
chunks, decode steps, prefix hits) and, for decodes and on the Triton path, the step's own
token; the CPU path's prompt tokens attend to their fresh K/V.

No host synchronisation in a layer: the write and the read use only fixed-size device ops,
so the host never waits for the GPU mid-forward. A `nonzero` over the growing (block, head)
pairs, a boolean-mask index or a `torch.unique` of the tables would each size a tensor by its
values. Instead the write reduces into per-block tensors (`scatter_reduce`) and re-encodes, for
each new token, its whole block (unchanged where the scale stays): block_size times the new
tokens' own codes per layer, the price of not counting the growing blocks on the host (a
kernel would re-encode per (block, head) instead). `step_blocks` sizes its pool from the
host's copies of the lengths (`blocks_in_use`).

A block is its codes and its scales: whatever copies blocks between pools copies both
(`block_tensors`): stage 12's host tier (swap, evicted prefix blocks) and stage 13's transfer
to a decode engine. A block copied back keeps its scale; the next write at an offset past 0
grows it as if the block had never left.
"""

from __future__ import annotations

import functools

import torch

from ..kv_cache import PagedKVCache
from .formats import E4M3_MAX, FP8_DTYPE, INT8_MAX

KV_FORMATS = ("int8", "fp8")
_TINY = 1e-12


def _encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Values already divided by their scale -> stored codes (int8, or fp8 bits as uint8)."""
    if fmt == "int8":
        return torch.round(x).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).view(torch.uint8)


def _decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return codes.float() if fmt == "int8" else codes.view(FP8_DTYPE).float()


def _qmax(fmt: str) -> float:
    return float(INT8_MAX) if fmt == "int8" else E4M3_MAX


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: str | torch.dtype
) -> int:
    """Bytes of one block across layers, K and V: codes plus scales for a quantized `fmt`."""
    if isinstance(fmt, torch.dtype):
        element = torch.empty((), dtype=fmt).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element
    if fmt not in KV_FORMATS:
        raise ValueError(f"KV format must be a dtype or one of {KV_FORMATS}, got {fmt!r}")
    codes = block_size * num_kv_heads * head_dim
    scales = num_kv_heads * 4
    return 2 * num_layers * (codes + scales)


def _raised(old: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
    """The smallest old * 2**n >= needed (n >= 1); `needed` itself for an empty block."""
    doublings = torch.ceil(torch.log2(needed / old.clamp(min=_TINY))).clamp(min=1)
    return torch.where(old > 0, old * torch.exp2(doublings), needed)


class QuantizedPagedKVCache:
    """`PagedKVCache`'s interface (`k`, `v` [layers, blocks, block_size, heads, dim], `write`
    by flat slots, `num_blocks`, `block_size`, `total_bytes`) over 1-byte codes and scales."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: str,
        device: torch.device | None = None,
    ) -> None:
        if fmt not in KV_FORMATS:
            raise ValueError(f"KV format must be one of {KV_FORMATS}, got {fmt!r}")
        self.fmt, self.num_blocks, self.block_size = fmt, num_blocks, block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        code_dtype = torch.int8 if fmt == "int8" else torch.uint8
        self.k = torch.zeros(shape, dtype=code_dtype, device=device)
        self.v = torch.zeros(shape, dtype=code_dtype, device=device)
        scale_shape = (num_layers, num_blocks, num_kv_heads)
        self.k_scale = torch.zeros(scale_shape, device=device)
        self.v_scale = torch.zeros(scale_shape, device=device)

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-block tensors besides the codes, block on dim 1 (see `block_tensors`)."""
        return self.k_scale, self.v_scale

    @property
    def total_bytes(self) -> int:
        tensors = (self.k, self.v, self.k_scale, self.v_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new tokens' K/V ([tokens, kv_heads, dim]) at their flat slot indices."""
        self._write(self.k[layer], self.k_scale[layer], k, slots)
        self._write(self.v[layer], self.v_scale[layer], v, slots)

    @torch.no_grad()
    def _write(
        self, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Encode `x` ([tokens, heads, dim]) at `slots` into one layer's `codes` and `scales`: a
        block begun at offset 0 forgets its scales; a block whose range the new values exceed
        raises its scale by a power of two and re-encodes the codes it holds; then the new
        tokens are encoded with their block's scale."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        # Per block, over the tokens written to it: was it begun afresh (a token at offset 0),
        # and the largest new value per head. Reductions into [num_blocks] tensors, read back
        # per token: every token of a block sees the same numbers, so the writes below that
        # repeat a block write the same values.
        begun = torch.zeros_like(scales[:, 0]).scatter_reduce_(
            0, blocks, (offsets == 0).to(scales.dtype), "amax"
        )
        token_amax = x.float().abs().amax(dim=-1)  # [tokens, heads]
        rows = blocks[:, None].expand_as(token_amax)
        block_amax = torch.zeros_like(scales).scatter_reduce_(0, rows, token_amax, "amax")
        old = torch.where(begun[blocks, None] > 0, 0.0, scales[blocks])  # [tokens, heads]
        needed = block_amax[blocks] / _qmax(self.fmt)
        grow = needed > old
        new = torch.where(grow, _raised(old, needed), old)
        # Re-encode the codes a growing (block, head) holds with its new scale; the others are
        # written back unchanged. Per token, a whole block: no count of growing blocks needed.
        held = codes[blocks]  # [tokens, block_size, heads, dim]
        values = _decode(held, self.fmt) * old[:, None, :, None]
        again = _encode(values / new[:, None, :, None], self.fmt)
        codes[blocks] = torch.where(grow[:, None, :, None], again, held)
        scales[blocks] = new
        token_scale = new.clamp(min=_TINY)[..., None]  # [tokens, heads, 1]
        flat = codes.view(-1, *codes.shape[2:])
        flat[slots] = _encode(x.float() / token_scale, self.fmt)

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of these blocks, [len(block_ids), block_size, heads, dim] fp32
        (what an attention kernel does per tile, in registers, instead of materializing)."""
        k = (
            _decode(self.k[layer, block_ids], self.fmt)
            * self.k_scale[layer, block_ids][:, None, :, None]
        )
        v = (
            _decode(self.v[layer, block_ids], self.fmt)
            * self.v_scale[layer, block_ids][:, None, :, None]
        )
        return k, v

    def step_blocks(
        self,
        layer: int,
        block_tables: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        seq_lens: torch.Tensor | None = None,
        num_used: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What attention reads this step: the dequantized K and V (in `dtype`, the
        queries') of the blocks the step's tables name, as a small pool [n, block_size, heads,
        dim], and the tables renumbered into it. Only the step's blocks are decoded (a GPU
        kernel would decode each tile in registers instead), so the float copy lasts one
        layer and is the size of the step's context.

        The pool's size must be known on the host without reading the tables: a deduplicated
        pool (`torch.unique`) would cost a sync per layer. Given `seq_lens` (device) and
        `num_used`, the number of blocks they cover (sum of ceil(len / block_size), from the
        host's copies of the lengths), the pool holds each sequence's blocks in use, then one
        spare row that the padding entries point at. Without them it holds every table entry,
        padding included. A block two sequences share (a prefix hit) is decoded once for each."""
        tables = block_tables.long()
        if seq_lens is None or num_used is None:
            compact = torch.arange(tables.numel(), device=tables.device).view_as(tables)
            source = tables.reshape(-1)
        else:
            in_use = (seq_lens.long() + self.block_size - 1) // self.block_size  # [seqs]
            first = torch.cumsum(in_use, 0) - in_use  # each sequence's first row in the pool
            column = torch.arange(tables.shape[1], device=tables.device)
            used = column[None, :] < in_use[:, None]
            compact = torch.where(used, first[:, None] + column, num_used)
            source = torch.empty(num_used + 1, dtype=torch.long, device=tables.device)
            source[compact.reshape(-1)] = tables.reshape(-1)  # padding: all to the spare row
            # The spare row: any block, never read. A slice filled on the device: `source[i] = 0`
            # copies a host scalar into one element, a blocking copy (a sync) on CUDA.
            source[num_used:].zero_()
        k, v = self.read_blocks(layer, source)
        return k.to(dtype), v.to(dtype), compact.to(block_tables.dtype)


@functools.lru_cache(maxsize=4)  # once per step, not per layer: the same tuples every layer
def blocks_in_use(query_lens: tuple[int, ...], context_lens: tuple[int, ...], size: int) -> int:
    """How many blocks the step's sequences cover: sum of ceil((context + new) / size)."""
    return sum(-(-(q + c) // size) for q, c in zip(query_lens, context_lens, strict=True))


def block_tensors(pool: object) -> tuple[torch.Tensor, ...]:
    """Every tensor that holds a block's state, each [num_layers, num_blocks, ...]: `k` and `v`,
    then the pool's `scales` if it has any (a quantized cache, or a host pool made like one).
    Copying a block means copying index `block` of dim 1 of each, in this order."""
    return (pool.k, pool.v, *getattr(pool, "scales", ()))  # type: ignore[attr-defined]


def kv_cache_block_bytes(
    kv_cache_dtype: str,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: torch.dtype,
) -> int:
    """One block's bytes for `EngineConfig.kv_cache_dtype`: "auto" is the model's dtype."""
    fmt = model_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return kv_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, fmt)


def make_kv_cache(
    kv_cache_dtype: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    model_dtype: torch.dtype,
    device: torch.device,
) -> PagedKVCache | QuantizedPagedKVCache:
    """The pool for `kv_cache_dtype`: stage 03's `PagedKVCache` for "auto", else 1-byte codes."""
    shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    if kv_cache_dtype == "auto":
        return PagedKVCache(*shape, model_dtype, device)
    return QuantizedPagedKVCache(*shape, kv_cache_dtype, device)
