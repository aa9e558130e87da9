"""The pool of KV cache blocks: ids, reference counts, the free queue and the prefix cache.

Blocks are plain integers indexing the model runner's KV tensors. A full
block may carry the hash of its contents (chained from its parent block, so a
hash names a whole prefix). Blocks nobody holds wait in the free queue in LRU
order and keep their hash: a later request with the same prefix takes them
back ("touch"), and only when a block is handed out for new tokens is its old
content forgotten (lazy eviction); the pool reports each such (block, hash)
pair through `take_evicted`, so that a second tier can keep a copy. The free
queue is an ordered dict, so allocation from the front, release to the back
and removal of any block are all O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

BlockHash = bytes


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0
        self._evicted: list[tuple[int, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included: all can be handed out."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by requests (0-1), as in `vllm:kv_cache_usage_perc`."""
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, count: int) -> list[int]:
        """Hand out `count` blocks from the front of the queue, evicting what they cached."""
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, only {len(self._free)} free.")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            self._forget(block)
            self.ref_counts[block] = 1
        return blocks

    def _forget(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            self.block_hashes[block] = None
            del self.cached[block_hash]
            self.num_evictions += 1
            self._evicted.append((block, block_hash))

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """The (block, hash) pairs evicted since the last call; the blocks still hold that
        content until this step's forward writes into them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a holder to each block, taking free (cached) ones off the free queue."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def cache_block(self, block: int, block_hash: BlockHash) -> None:
        """Record a full block's hash; a prefix cached already under another block keeps it."""
        if self.block_hashes[block] is not None or block_hash in self.cached:
            return
        self.block_hashes[block] = block_hash
        self.cached[block_hash] = block

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; blocks nobody holds go to the back of the queue."""
        for block in block_ids:
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"block {block} freed more often than allocated.")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def free_queue(self) -> list[int]:
        """The free blocks in eviction order (for tests and debugging)."""
        return list(self._free)

    def check_integrity(self, block_tables: Iterable[list[int]] = ()) -> None:
        """Assert free + used == total, refcounts match the block tables, the cache index is
        consistent (cached blocks = blocks with a hash, free or used)."""
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                expected[block] += 1
        used = sum(1 for count in self.ref_counts if count > 0)
        assert used + len(self._free) == self.num_blocks, (used, len(self._free), self.num_blocks)
        assert all((count == 0) == (block in self._free) for block, count in enumerate(self.ref_counts))
        assert self.ref_counts == expected, "refcounts do not match the live block tables"
        hashed = {block for block, h in enumerate(self.block_hashes) if h is not None}
        assert set(self.cached.values()) == hashed
        assert all(self.block_hashes[block] == h for h, block in self.cached.items())
