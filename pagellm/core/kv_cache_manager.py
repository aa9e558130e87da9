"""Hands out KV blocks to requests as their tokens arrive, and takes them back."""

from __future__ import annotations

from pagellm.core.block_pool import BlockPool
from pagellm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(request, num_new_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int]:
        """Give `request` blocks for `num_new_tokens` more tokens; returns the new block ids."""
        new_blocks = self.pool.get_new_blocks(self.num_blocks_needed(request, num_new_tokens))
        request.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so that a chain's tail is reused first."""
        self.pool.free_blocks(reversed(request.block_ids))
        request.block_ids = []

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share the parent's full prompt blocks.

        The partial last block is not shared: the child recomputes those few
        tokens into a block of its own, which is cheaper than copying it.
        """
        num_full = parent.num_prompt_tokens // self.block_size
        shared = parent.block_ids[:num_full]
        self.pool.share_blocks(shared)
        child.block_ids = list(shared)
        child.num_computed_tokens = num_full * self.block_size

    def usage(self) -> float:
        return self.pool.usage()

    def check_integrity(self, requests: list[Request]) -> None:
        self.pool.check_integrity(r.block_ids for r in requests)
