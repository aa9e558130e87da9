"""The pool of KV cache blocks: ids, reference counts and the free queue.

Blocks are plain integers indexing the model runner's KV tensors. The free
queue is an ordered dict so that allocation from the front, release to the
back and removal of any block are all O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by requests (0-1), as in `vllm:kv_cache_usage_perc`."""
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, only {len(self._free)} free.")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share_blocks(self, block_ids: Iterable[int]) -> None:
        """Add a holder to blocks that are already in use."""
        for block in block_ids:
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"block {block} is free and cannot be shared.")
            self.ref_counts[block] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; blocks nobody holds go to the back of the queue."""
        for block in block_ids:
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"block {block} freed more often than allocated.")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def check_integrity(self, block_tables: Iterable[list[int]] = ()) -> None:
        """Assert free + used == total and that refcounts match the given block tables."""
        expected = [0] * self.num_blocks
        for table in block_tables:
            for block in table:
                expected[block] += 1
        used = sum(1 for count in self.ref_counts if count > 0)
        assert used + len(self._free) == self.num_blocks, (used, len(self._free), self.num_blocks)
        assert all((count == 0) == (block in self._free) for block, count in enumerate(self.ref_counts))
        assert self.ref_counts == expected, "refcounts do not match the live block tables"
