"""The block pool: the ledger of which blocks of the paged KV cache are free.

kv_cache.py holds the K/V tensors and every request's block table; this module holds only the
block ids, so it reads, and is tested, without a tensor in sight (vLLM splits `block_pool.py`
from `kv_cache_manager.py` the same way). `allocate` hands out a block and `free` takes it back;
the pool knows nothing of requests.

Prefix caching (stage 07): the pool also indexes full blocks by their content key (`cache`,
`lookup`), counts the tables that hold each block (`touch`, `free`), and evicts lazily: a freed
block keeps its key in the free queue until `allocate` hands it out again.

KV events (stage 10): a router in front of several replicas can only send a request to the
replica holding its prefix if it knows what each replica holds. With `kv_events=True` the
allocator records, in order, every key it publishes ("stored") and every key it drops because
its block was handed out again ("evicted"); `KVCacheManager.drain_kv_events` returns them and
starts a new list. Replaying a replica's events on an empty set gives exactly its cached keys
(the router's view, frontend/router.py). Off, the allocator records nothing and pays one `is None`
test.

KV offloading (stage 12): with `record_evictions=True` the allocator also keeps each evicted
block's id and content until `KVCacheManager.drain_evictions`, so the host tier can store the
block before the step that reuses it overwrites it (offload/connector.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .prefix_cache import BlockContent, BlockKey


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
