"""The block pool: the ledger of which blocks of the paged KV cache are free.

kv_cache.py holds the K/V tensors and every request's block table; this module holds only the
block ids, so it reads, and is tested, without a tensor in sight (vLLM splits `block_pool.py`
from `kv_cache_manager.py` the same way). `allocate` hands out a block and `free` takes it back;
the pool knows nothing of requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """A free list of block ids: `allocate` pops one, `free` pushes them back."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Hand out a block nobody holds (the front of the free list); when none is left,
        raise OutOfBlocksError with a message that starts "KV cache is full" (the error a
        caller, and the tests, recognise)."""
        if not self._free:
            raise OutOfBlocksError(
                f"KV cache is full: all {self.num_blocks} blocks are in use "
                "(lower max_num_seqs or max_tokens, or give the cache more memory)"
            )
        block = self._free.popleft()
        self._in_use.add(block)
        return block

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool; freeing a block that is not in use is a bug."""
        for block in blocks:
            if block not in self._in_use:
                raise ValueError(f"block {block} freed but not allocated")
            self._in_use.remove(block)
            self._free.append(block)
