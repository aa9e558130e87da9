"""The second KV tier (host memory or a file): block ids, prefix hashes, LRU; and the swap cost.

Integers only: the model runner holds the tensors, this pool decides which of
its blocks hold what. A tier-2 block is in one of three states:

- empty: no content, nobody holds it;
- cached: holds the KV of one prefix block, named by its chained hash, and
  waits in LRU order (an `OrderedDict`, front = least recently used) to be
  loaded back or overwritten;
- held: a swapped-out request owns it, or this step's transfers read or write
  it. Held blocks are never evicted, so a block is the target of at most one
  store per step and a load source is never overwritten before it is read.

New content takes an empty block first, else evicts the least recently used
cached one, all in O(1).

Tier-2 blocks have the engine's block size. vLLM's OffloadingConnector takes a
`block_size` (64 by default) that must be a multiple of the GPU block size and
groups that many tokens per CPU block; pagellm checks the multiple and accepts
the value, but offloads at engine-block granularity, so that each tier-2 block
is named by exactly one hash of the prefix chain and a partially filled group
never has to be tracked. The byte budget is honoured either way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pagellm.core.block_pool import BlockHash


class OffloadPool:
    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV offloading tier needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can take new content: empty ones and cached ones nobody holds."""
        return len(self._empty) + len(self._lru)

    def usage(self) -> float:
        """Fraction of blocks holding content, cached or held (`kv_offload_cpu_cache_usage_perc`)."""
        return 1.0 - len(self._empty) / self.num_blocks

    def lru_order(self) -> list[int]:
        """Cached blocks nobody holds, least recently used first (for tests and debugging)."""
        return list(self._lru)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def store(self, block_hash: BlockHash) -> int | None:
        """A held block to receive the prefix block `block_hash`; None if the prefix is here
        already (it becomes the most recently used) or every block is held."""
        block = self.cached.get(block_hash)
        if block is not None:
            if block in self._lru:
                self._lru.move_to_end(block)
            return None
        if not self.num_free_blocks:
            return None
        block = self._take()
        self.block_hashes[block] = block_hash
        self.cached[block_hash] = block
        return block

    def allocate(self, count: int) -> list[int]:
        """`count` held blocks without a hash, e.g. for a swapped-out request."""
        if count > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {count} offload blocks, only {self.num_free_blocks} free.")
        return [self._take() for _ in range(count)]

    def _take(self) -> int:
        if self._empty:
            block = self._empty.popitem(last=False)[0]
        else:
            block = self._lru.popitem(last=False)[0]
            del self.cached[self.block_hashes[block]]
            self.block_hashes[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block

    def hold(self, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._lru[block]
            self.ref_counts[block] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one holder; a block nobody holds becomes the most recently used cached block,
        or empty if it has no hash."""
        for block in block_ids:
            if self.ref_counts[block] < 1:
                raise RuntimeError(f"offload block {block} released more often than held.")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                queue = self._empty if self.block_hashes[block] is None else self._lru
                queue[block] = None

    def check_integrity(self, held_lists: Iterable[list[int]] = ()) -> None:
        """Assert free + used == total, refcounts match the holders (no block held twice), the
        hash index is consistent and each block nobody holds is in the queue its hash implies."""
        expected = [0] * self.num_blocks
        for held in held_lists:
            for block in held:
                expected[block] += 1
        assert self.ref_counts == expected, "offload refcounts do not match the swapped requests"
        assert max(expected, default=0) <= 1, "an offload block is held twice"
        used = sum(1 for count in self.ref_counts if count > 0)
        assert used + self.num_free_blocks == self.num_blocks
        assert not self._empty.keys() & self._lru.keys()
        for block, count in enumerate(self.ref_counts):
            hashed = self.block_hashes[block] is not None
            assert (block in self._lru) == (count == 0 and hashed), block
            assert (block in self._empty) == (count == 0 and not hashed), block
        assert len(self.cached) == sum(1 for h in self.block_hashes if h is not None)
        assert all(self.block_hashes[block] == h for h, block in self.cached.items())


@dataclass(frozen=True)
class SwapCostModel:
    """Estimated seconds to preempt a request by recomputing it or by swapping it.

    Recompute re-runs the prefill of its n computed tokens: 2 flops per weight
    per token plus attention, 2 x (layers x heads x head_dim) x n^2 flops in
    all (QK^T and AV over a growing context), at `flops_per_second`. Swap
    copies its blocks out and back: twice a transfer of fixed cost
    `copy_latency` (launches, synchronization) plus bytes / bandwidth. The
    fixed cost makes recompute win for short contexts and the n^2 attention
    term makes swap win for long ones.
    """

    num_params: int
    attention_width: int
    block_bytes: int
    flops_per_second: float
    copy_latency: float
    copy_bytes_per_second: float

    def recompute_seconds(self, num_tokens: int) -> float:
        flops = 2 * self.num_params * num_tokens + 2 * self.attention_width * num_tokens ** 2
        return flops / self.flops_per_second

    def swap_seconds(self, num_blocks: int) -> float:
        return 2 * (self.copy_latency + num_blocks * self.block_bytes / self.copy_bytes_per_second)

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_seconds(num_blocks) < self.recompute_seconds(num_tokens)
