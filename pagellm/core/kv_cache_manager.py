"""Hands out KV blocks to requests as their tokens arrive, and takes them back.

With prefix caching, each full block of a request is named by a hash chained
from its parent block's hash, its token ids and extra keys (the request's
`cache_salt`). A new request starts from the longest run of cached blocks
matching its tokens, but always computes at least its last token, whose
logits it needs.
"""

from __future__ import annotations

import hashlib
from array import array

from pagellm.core.block_pool import BlockHash, BlockPool
from pagellm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: BlockHash | None, token_ids: list[int], salt: str | None) -> BlockHash:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else (salt or "").encode())
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_queries = 0
        self.prefix_hits = 0

    def hash_new_blocks(self, request: Request) -> None:
        """Hash the request's blocks that its tokens have filled since the last call."""
        if not self.enable_caching:
            return
        hashes, size = request.block_hashes, self.block_size
        for index in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[index * size:(index + 1) * size]
            hashes.append(hash_block(parent, tokens, request.cache_salt))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the request's tokens, leaving one to compute."""
        if not self.enable_caching or request.num_computed_tokens or request.block_ids:
            return []
        blocks = []
        for block_hash in request.block_hashes[:(request.num_tokens - 1) // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_prefix_lookup(self, request: Request, computed_blocks: list[int]) -> None:
        if self.enable_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          computed_blocks: list[int] = ()) -> int:
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = cdiv(num_computed + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids) - len(computed_blocks))

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[int] = ()) -> bool:
        """Cached blocks that nobody holds count as free; taking them back uses them up."""
        reclaimed = sum(1 for block in computed_blocks if self.pool.ref_counts[block] == 0)
        needed = self.num_blocks_needed(request, num_new_tokens, computed_blocks)
        return needed <= self.pool.num_free_blocks - reclaimed

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] = ()) -> list[int]:
        """Take back `computed_blocks` (advancing the computed count past them) and give the
        request blocks for `num_new_tokens` more tokens; returns the new block ids."""
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens += len(computed_blocks) * self.block_size
            request.num_cached_blocks = len(request.block_ids)
        new_blocks = self.pool.get_new_blocks(self.num_blocks_needed(request, num_new_tokens))
        request.block_ids.extend(new_blocks)
        self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Blocks full once this step's tokens are written join the cache; in a step every
        layer writes its K/V before attending, so a hit in the same step reads valid data."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.block_ids[index], request.block_hashes[index])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so that a chain's tail is evicted first."""
        self.pool.free_blocks(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share the parent's full prompt blocks.

        The partial last block is not shared: the child recomputes those few
        tokens into a block of its own, which is cheaper than copying it.
        """
        num_full = parent.num_prompt_tokens // self.block_size
        shared = parent.block_ids[:num_full]
        self.pool.touch(shared)
        child.block_ids = list(shared)
        child.num_computed_tokens = num_full * self.block_size
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_cached_blocks = min(num_full, parent.num_cached_blocks)

    def usage(self) -> float:
        return self.pool.usage()

    def check_integrity(self, requests: list[Request]) -> None:
        self.pool.check_integrity(r.block_ids for r in requests)
