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

Prefix caching (stage 07; vLLM's automatic prefix caching, SGLang's RadixAttention): requests
often begin alike (a system prompt, a few-shot preamble, the earlier turns of a chat). A full
block is addressed by its content (prefix_cache.py), and a new request whose leading blocks are
already in the pool shares them instead of computing them again. Blocks are reference-counted;
a block nobody holds keeps its K/V in the free queue, least recently freed first, until the
pool needs it. With `prefix_caching=False` nothing is published or looked up: stage 06.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .block_pool import BlockAllocator
from .prefix_cache import BlockContent, PrefixCacheStats, block_content

if TYPE_CHECKING:
    from .request import Request


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

    Prefix caching: `find_cached_prefix` looks a new request's full blocks up by their chained
    keys, `allocate_slots` takes the hits into its table (shared, not copied), `cache_blocks`
    publishes the request's blocks as they fill, and `free` lets go tail first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_tables: dict[str, list[int]] = {}  # request id -> its blocks, in order
        self._contents: dict[str, list[BlockContent]] = {}  # request id -> its full blocks' keys
        self._num_published: dict[str, int] = {}  # request id -> its leading blocks in the cache
        self.stats = PrefixCacheStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The longest run of the request's leading full blocks found in the cache (up to the
        first miss), as block ids. It never covers the last token: that token's logits are
        what the request samples from. Nothing is found when caching is off."""
        if not self.enable_caching:
            return []
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for content in self._block_contents(request, limit):
            block = self.allocator.lookup(content)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Make the request's table cover positions 0..num_tokens-1, starting from
        `cached_blocks` (a new request's prefix hit) and allocating the blocks still missing.
        All or nothing: when the pool cannot supply every block, nothing changes and the answer
        is False. A hit on a free block takes that block off the free queue, so it counts."""
        table = self.block_tables.get(request_id, [])
        if table and not cached_blocks and len(table) * self.block_size >= num_tokens:
            return True  # most decode steps: the last block still has room (checked per request)
        missing = self.blocks_needed(num_tokens) - len(table) - len(cached_blocks)
        revived = sum(self.allocator.ref_counts[b] == 0 for b in cached_blocks)
        if missing + revived > self.allocator.num_free:
            return False
        table = self.block_tables.setdefault(request_id, [])
        if cached_blocks:
            self.allocator.touch(cached_blocks)  # before allocating: never evict a hit
            table.extend(cached_blocks)
            self._num_published[request_id] = len(table)
        table.extend(self.allocator.allocate() for _ in range(missing))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full once `num_computed_tokens` are computed
        (and whose tokens the host knows), so later requests can hit them. Called when the step
        that computes them is scheduled: steps run in order, so any reader comes after."""
        if not self.enable_caching:
            return
        done = self._num_published.get(request.request_id, 0)
        if num_computed_tokens < (done + 1) * self.block_size:  # most calls: no block filled
            return
        full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if full <= done:
            return
        table = self.block_tables[request.request_id]
        contents = self._block_contents(request, full)
        for index in range(done, full):
            self.allocator.cache(table[index], contents[index])
        self._num_published[request.request_id] = full

    def _block_contents(self, request: Request, count: int) -> list[BlockContent]:
        """The keys of the request's first `count` full blocks, chained and computed once."""
        contents = self._contents.setdefault(request.request_id, [])
        size = self.block_size
        while len(contents) < count:
            index = len(contents)
            tokens = request.token_ids_between(index * size, (index + 1) * size)
            parent = contents[-1].key if contents else None
            contents.append(block_content(parent, tokens, None if index else request.cache_salt))
        return contents[:count]

    def free(self, request_id: str) -> None:
        """Give back every block of a request (finished, aborted or preempted), tail first:
        a cached block stays a hit until the pool needs it."""
        self.allocator.free(reversed(self.block_tables.pop(request_id, [])))
        self._num_published.pop(request_id, None)
        self._contents.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks that positions 0..num_tokens-1 need; free the rest, tail first
        (speculative decoding: the blocks that held only rejected drafts)."""
        table = self.block_tables.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if table is not None and len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.allocator.free(reversed(extra))

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
