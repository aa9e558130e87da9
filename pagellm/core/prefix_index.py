"""Which engine or replica holds which prompt prefix, in the engine's own block hashes.

A prompt's tokens are cut into full blocks of the engines' block size and hashed with the
engine's chained `hash_block` (parent hash, token ids, the request's `cache_salt`), so a
balancer's view of a prefix names exactly the blocks an engine's prefix cache holds. Each
engine has an LRU of the chains sent to it, of about its KV cache's capacity, so prefixes
it must have evicted stop attracting requests. Used by `pagellm router` across replicas and
by the API server across its data parallel engine cores.
"""

from __future__ import annotations

from collections import OrderedDict

from pagellm.core.kv_cache_manager import hash_block


def block_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start:start + block_size], salt))
    return hashes


class PrefixIndex:
    """Per-replica LRU sets of block hashes."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._held: dict[str, OrderedDict[bytes, None]] = {}

    def matched_blocks(self, backend: str, hashes: list[bytes]) -> int:
        """How many leading blocks of the chain the replica holds (its cache hit, in blocks)."""
        held = self._held.get(backend)
        if held is None:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in held:
                break
            count += 1
        return count

    def record(self, backend: str, hashes: list[bytes]) -> None:
        """The replica now holds the chain: newest use last, oldest evicted past capacity."""
        held = self._held.setdefault(backend, OrderedDict())
        for block_hash in hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, backend: str) -> None:
        """A replica that was ejected may have restarted with an empty cache."""
        self._held.pop(backend, None)
