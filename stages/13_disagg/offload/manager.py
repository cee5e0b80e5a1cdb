"""The host tier's ledger: which keys it holds, in which host block, and which may be evicted.

It runs beside the scheduler and never touches a tensor (vLLM's `OffloadingManager`,
`v1/kv_offload/abstract.py`, and its `LRUOffloadingManager`). The worker side moves the bytes;
this decides where they go:

    lookup(keys)         how many leading keys are stored *and ready* (a hit)
    prepare_load(keys)   their host blocks; each takes a reference until complete_load
    touch(keys)          mark recently used (least recently used is evicted first)
    prepare_store(keys)  host blocks for the keys not yet held, evicting least recently used
                         ready blocks nobody references; None when not enough can be evicted
    complete_store(keys, success)   ready (loadable) from now on; a failed store frees them
    discard(keys)        drop keys nobody needs any more (a swapped-in request's blocks)

Invariants, asserted: a block is evicted only at reference count 0 with no store in flight; a
key is invisible to `lookup` until its store completes; a failed store frees its blocks.

A key is any hashable: the prefix tier keys a block by its content (prefix_cache.BlockContent,
the chained hash and what was hashed, so a hit is exact); a swapped-out request keys its blocks
by (request, preemption, index).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class HostBlock:
    """One host block's state: where it is, who reads it, whether its bytes have landed."""

    block_id: int
    ready: bool = False  # False while its store is in flight: invisible, not evictable
    ref_count: int = 0  # loads in flight reading it


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What a store needs: the keys to store (those not held already), their host blocks in
    the same order, and the keys evicted to make room."""

    keys_to_store: tuple[Hashable, ...]
    host_blocks: tuple[int, ...]
    keys_evicted: tuple[Hashable, ...]


class LRUOffloadManager:
    """A fixed pool of host blocks with an LRU order over the keys it holds."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.blocks: OrderedDict[Hashable, HostBlock] = OrderedDict()  # LRU first
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, keys: Iterable[Hashable]) -> int:
        """How many of `keys`, from the first, are held and ready (a store in flight is not)."""
        hits = 0
        for key in keys:
            block = self.blocks.get(key)
            if block is None or not block.ready:
                break
            hits += 1
        return hits

    def prepare_load(self, keys: Sequence[Hashable]) -> list[int]:
        """The host blocks of `keys` (all ready), each referenced until `complete_load`."""
        found = []
        for key in keys:
            block = self.blocks[key]
            assert block.ready, f"load of {key!r} before its store completed"
            block.ref_count += 1
            found.append(block.block_id)
        return found

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Mark `keys` most recently used (the first of them the most: it is the prefix every
        later one depends on, so it should be the last to go)."""
        for key in reversed(list(keys)):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def complete_load(self, keys: Iterable[Hashable]) -> None:
        """The loads of `keys` ended: one reference fewer each."""
        for key in keys:
            block = self.blocks[key]
            assert block.ref_count > 0, f"complete_load of {key!r} without a prepare_load"
            block.ref_count -= 1

    def prepare_store(self, keys: Iterable[Hashable]) -> PrepareStoreOutput | None:
        """Host blocks for the keys not held yet, not ready until `complete_store`. Evicts least
        recently used ready blocks at reference 0 to make room, never one of `keys` (the caller
        counts on the held ones staying: evicting one would lose it); None (and nothing
        changes) when that is not enough."""
        asked = list(dict.fromkeys(keys))
        wanted = [k for k in asked if k not in self.blocks]
        shortfall = len(wanted) - len(self._free)
        victims: list[Hashable] = []
        if shortfall > 0:
            keep = set(asked)
            for key, block in self.blocks.items():
                if block.ready and block.ref_count == 0 and key not in keep:
                    victims.append(key)
                    if len(victims) == shortfall:
                        break
            else:
                return None
        for key in victims:
            self._evict(key)
        host_blocks = []
        for key in wanted:
            block = HostBlock(self._free.pop())
            self.blocks[key] = block
            host_blocks.append(block.block_id)
        return PrepareStoreOutput(tuple(wanted), tuple(host_blocks), tuple(victims))

    def complete_store(self, keys: Iterable[Hashable], success: bool = True) -> None:
        """The store of `keys` ended: ready from now on, or, if it failed, freed."""
        for key in keys:
            block = self.blocks.get(key)
            if block is None or block.ready:
                continue
            if success:
                block.ready = True
            else:
                del self.blocks[key]
                self._free.append(block.block_id)

    def discard(self, keys: Iterable[Hashable]) -> None:
        """Free ready, unreferenced `keys` now (they will never be read again)."""
        for key in keys:
            block = self.blocks.get(key)
            if block is not None and block.ready and block.ref_count == 0:
                self._evict(key, counted=False)

    def _evict(self, key: Hashable, counted: bool = True) -> None:
        block = self.blocks[key]
        assert block.ready and block.ref_count == 0, (
            f"host block {block.block_id} evicted while in use (ready={block.ready}, "
            f"references={block.ref_count})"
        )
        del self.blocks[key]
        self._free.append(block.block_id)
        self.num_evictions += counted

    def check(self) -> None:
        """Every block is free or held by exactly one key (a test's leak check)."""
        held = [b.block_id for b in self.blocks.values()]
        assert len(set(held)) == len(held), "a host block is held under two keys"
        assert sorted(held + self._free) == list(range(self.num_blocks)), "a host block leaked"
