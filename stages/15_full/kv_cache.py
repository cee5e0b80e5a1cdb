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

Prefix caching (stage 07; vLLM's automatic prefix caching, SGLang's RadixAttention): requests
often begin alike (a system prompt, a few-shot preamble, the earlier turns of a chat). A full
block is addressed by its content (prefix_cache.py), and a new request whose leading blocks are
already in the pool shares them instead of computing them again. Blocks are reference-counted;
a block nobody holds keeps its K/V in the free queue, least recently freed first, until the
pool needs it. With `prefix_caching=False` nothing is published or looked up: stage 06.

KV events (stage 10): a router in front of several replicas can only send a request to the
replica holding its prefix if it knows what each replica holds. With `kv_events=True` the
allocator records, in order, every key it publishes ("stored") and every key it drops because
its block was handed out again ("evicted"); `KVCacheManager.drain_kv_events` returns them and
starts a new list. Replaying a replica's events on an empty set gives exactly its cached keys
(the router's view, router.py). Off, the allocator records nothing and pays one `is None` test.

KV offloading (stage 12): with `record_evictions=True` the allocator also keeps each evicted
block's id and content until `KVCacheManager.drain_evictions`, so the host tier can store the
block before the step that reuses it overwrites it (offload.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from .prefix_cache import BlockContent, BlockKey, PrefixCacheStats, block_content

if TYPE_CHECKING:
    from .request import Request


class OutOfBlocksError(RuntimeError):
    """The pool has no free block left."""


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change to a replica's set of cached block keys: plain data, picklable, so that it
    can cross a process boundary. The key is the chained SHA-256 of prefix_cache.py, salt
    included, so two replicas' events about equal keys are about equal prefixes."""

    kind: Literal["stored", "evicted"]
    block_hash: BlockKey


class BlockAllocator:
    """The pool's ledger: a reference count per block, a free queue, and the cached blocks.

    A block is in use while some request's table holds it (`ref_counts[block] > 0`; with prefix
    caching several tables can hold one block). At count 0 it joins the back of the free queue
    but keeps its K/V and its key: it is still a cache hit until the allocator hands it out
    again (lazy eviction). `allocate` takes the front of the queue, the least recently freed
    block; a hit on a free block (`touch`) takes it out of the queue.

    With `record_events`, every key published (`cache`) and every key dropped (`allocate`)
    is appended to `events`, in order; otherwise `events` is None and nothing is recorded.
    """

    def __init__(
        self, num_blocks: int, record_events: bool = False, record_evictions: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.ref_counts = [0] * num_blocks
        self.contents: list[BlockContent | None] = [None] * num_blocks  # set while cached
        self.cached: dict[BlockKey, int] = {}  # key -> the block holding that content
        self.num_evictions = 0
        self.events: list[KVEvent] | None = [] if record_events else None
        # (block, what it held) per eviction, for the host tier (stage 12); None: not recorded
        self.evicted: list[tuple[int, BlockContent]] | None = [] if record_evictions else None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def allocate(self) -> int:
        """Hand out the least recently freed block (the front of the free queue), evicting
        what it cached: its key leaves `cached`, its `contents` entry becomes None, and
        `num_evictions` counts one more (a block that cached nothing is no eviction). When
        every block is in use, raise OutOfBlocksError with a message that starts "KV cache is
        full"."""
        if not self._free:
            raise OutOfBlocksError(
                f"KV cache is full: all {self.num_blocks} blocks are in use "
                "(lower max_num_seqs or max_tokens, or give the cache more memory)"
            )
        block, _ = self._free.popitem(last=False)
        content = self.contents[block]
        if content is not None:  # lazy eviction: only now does the cached content go
            self.contents[block] = None
            del self.cached[content.key]
            self.num_evictions += 1
            if self.events is not None:
                self.events.append(KVEvent("evicted", content.key))
            if self.evicted is not None:
                self.evicted.append((block, content))
        self.ref_counts[block] = 1
        return block

    def touch(self, blocks: Iterable[int]) -> None:
        """One more holder for each block (a cache hit); a free one leaves the queue."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """One holder fewer for each block; at 0 a block joins the back of the free queue, in
        the order given (a request frees its tail first, so its tail is evicted before the
        head other requests may share). Freeing a block nobody holds (a double free) is a
        bug: raise ValueError(f"block {block} freed but not allocated")."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} freed but not allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def lookup(self, content: BlockContent) -> int | None:
        """The block caching exactly this content (key and what was hashed), or None."""
        block = self.cached.get(content.key)
        if block is None or self.contents[block] != content:
            return None
        return block

    def cache(self, block: int, content: BlockContent) -> None:
        """Publish a full block under its key. When another block already holds the same
        content (two requests computed it side by side), that one stays the cached copy."""
        if content.key not in self.cached and self.contents[block] is None:
            self.cached[content.key] = block
            self.contents[block] = content
            if self.events is not None:
                self.events.append(KVEvent("stored", content.key))


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
    publishes the request's blocks as they fill, and `free` lets go tail first. With
    `kv_events`, `drain_kv_events` hands out what changed in the cache since the last call.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        kv_events: bool = False,
        record_evictions: bool = False,
    ) -> None:
        self.allocator = BlockAllocator(num_blocks, kv_events, record_evictions)
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
        full = min(num_computed_tokens, request.num_tokens) // self.block_size
        done = self._num_published.get(request.request_id, 0)
        if full <= done:
            return
        table = self.block_tables[request.request_id]
        contents = self._block_contents(request, full)
        for index in range(done, full):
            self.allocator.cache(table[index], contents[index])
        self._num_published[request.request_id] = full

    def block_contents(self, request: Request, count: int) -> list[BlockContent]:
        """The keys of the request's first `count` full blocks (what the host tier stores a
        prefix block under)."""
        return self._block_contents(request, count)

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

    def detach(self, request_id: str) -> list[int]:
        """Take a request's blocks out of its table without freeing them (a transfer still
        reads them: the caller frees them with `allocator.free` once it has drained)."""
        self._num_published.pop(request_id, None)
        self._contents.pop(request_id, None)
        return self.block_tables.pop(request_id, [])

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

    def drain_evictions(self) -> list[tuple[int, BlockContent]]:
        """(block, content) of every cached block evicted since the last call, oldest first
        (and forget them). Empty unless `record_evictions`."""
        evicted = self.allocator.evicted
        if not evicted:
            return []
        self.allocator.evicted = []
        return evicted

    def drain_kv_events(self) -> list[KVEvent]:
        """The cache's stored/evicted events since the last call, oldest first (and forget
        them). Empty when events are off."""
        events = self.allocator.events
        if not events:
            return []
        self.allocator.events = []
        return events


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
