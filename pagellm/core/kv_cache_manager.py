"""Hands out KV blocks to requests as their tokens arrive, and takes them back.

With prefix caching, each full block of a request is named by a hash chained
from its parent block's hash, its token ids and extra keys (the request's
`cache_salt`, and the content hash of its LoRA adapter, so that an adapter reloaded under
the same name never reuses KV computed with its old weights). A new request starts
from the longest run of cached blocks matching its tokens, but always computes at
least its last token, whose logits it needs.

A request asking for prompt logprobs needs the logits of every prompt position, which
come from hidden states that no cache keeps. vLLM therefore skips the cache for such
requests; here a hit still counts: the request shares the cached blocks (it takes no
fresh blocks for them, evicts nothing for them, and its KV for those positions is the
cached one), but its compute resumes at the first position it has not scored
(`resume_position`), and the runner recomputes the hit positions without writing their
slots (`Request.num_kv_reused_tokens`), so that a shared block is never rewritten. The
step's forward then attends the very keys a cache-off run writes (the default path is
batch-invariant), so prompt logprobs are identical with caching on and off. The cost is
the recompute of the hit positions, which vLLM pays too, less the blocks it takes.

With a second tier (`OffloadPool`), a cached block evicted from the first
tier is stored there first, a prefix that left the first tier is loaded back
into fresh blocks, and a preempted request can be swapped out and in. The
manager only decides: it collects the block pairs to copy and the scheduler
hands them to the model runner in the step's `SchedulerOutput`, where stores
run before loads and both before the forward.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from pagellm.core.block_pool import BlockHash, BlockPool
from pagellm.core.offload import OffloadPool
from pagellm.request import Request

BlockPair = tuple[int, int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: BlockHash | None, token_ids: list[int], salt: str | None,
               lora_hash: bytes | None = None) -> BlockHash:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent if parent is not None else (salt or "").encode())
    if parent is None and lora_hash is not None:
        digest.update(lora_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 offload: OffloadPool | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.offload = offload
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._stores: list[BlockPair] = []
        self._loads: list[BlockPair] = []
        self._step_held: list[int] = []

    def hash_new_blocks(self, request: Request) -> None:
        """Hash the request's blocks that its tokens have filled since the last call."""
        if not self.enable_caching:
            return
        hashes, size = request.block_hashes, self.block_size
        for index in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[index * size:(index + 1) * size]
            hashes.append(hash_block(parent, tokens, request.cache_salt, request.lora_hash))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the request's tokens, leaving one to compute."""
        return self._prefix_run(request, 0, self.pool.get_cached_block)

    def get_offloaded_blocks(self, request: Request, num_cached: int) -> list[int]:
        """Tier-2 blocks continuing the request's hash chain after its `num_cached` tier-1 hits."""
        if self.offload is None:
            return []
        return self._prefix_run(request, num_cached, self.offload.lookup)

    def _prefix_run(self, request: Request, start: int,
                    lookup: Callable[[BlockHash], int | None]) -> list[int]:
        if not self.enable_caching or request.num_computed_tokens or request.block_ids:
            return []
        blocks = []
        for block_hash in request.block_hashes[start:(request.num_tokens - 1) // self.block_size]:
            block = lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def resume_position(self, request: Request, num_hits: int = 0) -> int:
        """The position the request's compute starts at after `num_hits` prefix-hit blocks:
        past them, or at its first unscored prompt position when it owes prompt logprobs."""
        start = request.num_computed_tokens + num_hits * self.block_size
        unscored = request.first_unscored_position
        if unscored < request.num_prompt_tokens - 1:
            start = min(start, unscored)
        return start

    def record_prefix_lookup(self, request: Request, computed_blocks: list[int]) -> None:
        if self.enable_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          computed_blocks: Sequence[int] = (),
                          offloaded_blocks: Sequence[int] = ()) -> int:
        """Fresh tier-1 blocks for `num_new_tokens` more tokens, for the loads of offloaded
        prefix blocks and, for a swapped-out request, for the blocks it brings back."""
        num_hits = len(computed_blocks) + len(offloaded_blocks)
        num_known = request.num_computed_tokens + num_hits * self.block_size
        end = max(num_known, self.resume_position(request, num_hits) + num_new_tokens)
        return max(0, cdiv(end, self.block_size) - len(request.block_ids) - len(computed_blocks))

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: Sequence[int] = (),
                     offloaded_blocks: Sequence[int] = ()) -> bool:
        """Cached blocks that nobody holds count as free; taking them back uses them up."""
        reclaimed = sum(1 for block in computed_blocks if self.pool.ref_counts[block] == 0)
        needed = self.num_blocks_needed(request, num_new_tokens, computed_blocks, offloaded_blocks)
        return needed <= self.pool.num_free_blocks - reclaimed

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] = (),
                       offloaded_blocks: Sequence[int] = ()) -> list[int]:
        """Bring a swapped-out request's blocks back, take back `computed_blocks`, load
        `offloaded_blocks` into fresh blocks (advancing the computed count past both) and give
        the request blocks for `num_new_tokens` more tokens; returns the blocks for new tokens."""
        if request.swapped_block_ids:
            sources, request.swapped_block_ids = request.swapped_block_ids, []
            self._load_into_new_blocks(request, sources)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens += len(computed_blocks) * self.block_size
            request.num_cached_blocks = len(request.block_ids)
        if offloaded_blocks:
            self.offload.hold(offloaded_blocks)
            self._load_into_new_blocks(request, offloaded_blocks)
            request.num_computed_tokens += len(offloaded_blocks) * self.block_size
        resume = self.resume_position(request)
        if resume < request.num_computed_tokens:  # hits it scores: KV reused, not rewritten
            request.num_kv_reused_tokens = request.num_computed_tokens
            request.num_computed_tokens = resume
        new_blocks = self._get_new_blocks(self.num_blocks_needed(request, num_new_tokens))
        request.block_ids.extend(new_blocks)
        self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def _load_into_new_blocks(self, request: Request, sources: Sequence[int]) -> None:
        """Load held tier-2 blocks into fresh tier-1 blocks; they stay held until the step's
        transfers are taken, so that no store of this step overwrites them first."""
        targets = self._get_new_blocks(len(sources))
        self._loads.extend(zip(sources, targets))
        self._step_held.extend(sources)
        request.block_ids.extend(targets)

    def _get_new_blocks(self, count: int) -> list[int]:
        """Tier-1 blocks for new content; the prefixes they held are stored to tier 2 first."""
        blocks = self.pool.get_new_blocks(count)
        evicted = self.pool.take_evicted()
        if self.offload is not None:
            for block, block_hash in evicted:
                target = self.offload.store(block_hash)
                if target is not None:
                    self._stores.append((block, target))
                    self._step_held.append(target)
        return blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Blocks full once this step's tokens are written join the cache; in a step every
        layer writes its K/V before attending, so a hit in the same step reads valid data."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.block_ids[index], request.block_hashes[index])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def free_unused_tail(self, request: Request) -> None:
        """Return the blocks past the request's computed tokens (rejected draft tokens had
        them); they hold no hash, since only blocks of real tokens are ever hashed."""
        keep = max(cdiv(request.num_computed_tokens, self.block_size), request.num_cached_blocks)
        if len(request.block_ids) > keep:
            self.pool.free_blocks(reversed(request.block_ids[keep:]))
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so that a chain's tail is evicted first."""
        self.pool.free_blocks(reversed(request.block_ids))
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_kv_reused_tokens = 0
        if request.swapped_block_ids:
            self.offload.release(request.swapped_block_ids)
            request.swapped_block_ids = []

    def can_swap_out(self, request: Request) -> bool:
        return (self.offload is not None and bool(request.block_ids)
                and len(request.block_ids) <= self.offload.num_free_blocks)

    def swap_out(self, request: Request) -> None:
        """Copy the request's blocks to tier 2 and free them; its computed count stays."""
        targets = self.offload.allocate(len(request.block_ids))
        self._stores.extend(zip(request.block_ids, targets))
        self.free(request)
        request.swapped_block_ids = targets

    def take_transfers(self) -> tuple[list[BlockPair], list[BlockPair]]:
        """This step's (tier-1, tier-2) stores and (tier-2, tier-1) loads; the tier-2 blocks they
        touch are released, since the runner copies them before the next step is scheduled."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        if self._step_held:
            self.offload.release(self._step_held)
            self._step_held = []
        return stores, loads

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
        """Both tiers, between steps: tier-1 blocks held by block tables, tier-2 blocks by
        swapped-out requests only."""
        self.pool.check_integrity(r.block_ids for r in requests)
        if self.offload is not None:
            assert not self._step_held, "transfers were not taken"
            self.offload.check_integrity(r.swapped_block_ids for r in requests)
