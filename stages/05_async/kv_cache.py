"""The paged KV cache: one pool of fixed-size blocks that every request shares.

Stage 01 gave each request its own contiguous buffer, reserved up front for the longest the
request could grow. Shared by many requests, that wastes most of the memory: a reservation for
1024 tokens holds 100 real ones for most of its life. Paging (vLLM's PagedAttention) cuts the
memory into blocks of `block_size` tokens, hands a request a new block only when its last one is
full, and records where its blocks are in a per-request *block table*:

    position p of a request lives in block  block_table[p // block_size]
                                  at slot   p % block_size
    flat slot index (for writes):           block_table[p // block_size] * block_size
                                              + p % block_size          (the slot mapping)

At most one partly filled block per request is wasted. A contiguous reservation is the special
case of one block of `max_model_len` tokens per request, which is how `kv_layout="contiguous"`
is run for comparison.

Which blocks are free is block_pool.py's ledger; this module holds the tensors and the tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .block_pool import BlockAllocator


class PagedKVCache:
    """K and V pools for all layers: `k[layer]` is `[num_blocks, block_size, kv_heads, dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store new tokens' K/V ([tokens, kv_heads, dim]) at their flat slot indices."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    @property
    def total_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KVCacheManager:
    """Owns the allocator and every request's block table, growing a table as tokens arrive.

    It lives with the scheduler, which decides who gets memory; the model runner only ever
    sees the block ids the scheduler sends it (vLLM V1 splits the two the same way).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in order

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's table cover positions 0..num_tokens-1 (its cached tokens plus
        this step's new ones), allocating the blocks that are missing. All or nothing: when the
        pool cannot supply every block, nothing changes and the answer is False."""
        held = self.block_tables.get(request_id)
        if held is not None and len(held) * self.block_size >= num_tokens:
            return True  # most decode steps: the last block still has room (checked per request)
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > self.allocator.num_free:
            if not table:
                del self.block_tables[request_id]
            return False
        table.extend(self.allocator.allocate() for _ in range(missing))
        return True

    def free(self, request_id: str) -> None:
        """Give back every block of a request (finished, aborted or preempted)."""
        self.allocator.free(self.block_tables.pop(request_id, []))

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of positions start..end-1 of a sequence with this block table."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int, useful_blocks: int) -> int:
    """Blocks a memory budget buys, capped where more would sit idle; at least one must fit."""
    if budget_bytes < bytes_per_block:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no block of {bytes_per_block} bytes; "
            "raise kv_cache_bytes or lower block_size / max_model_len"
        )
    return min(budget_bytes // bytes_per_block, useful_blocks)
