"""KV blocks for a model with sliding-window layers: one block table per layer group.

The groups (`KVCacheLayout`) share one `BlockPool`; a request's first group's table is
`Request.block_ids`, the others' `Request.group_block_ids`, all of the same length: entry i
is the block of tokens i x block_size.. in every group. A sliding-window group gives a block
back once no query to come sees it: a query at position p sees keys p - window + 1 .. p, and
the next queries start at the request's computed count. The entry then names the null block
(block 0, held by the manager, never written), so that positions stay aligned and attention,
which reads no block before a query's window, needs no other change.

Prefix caching (vLLM's rule): each group caches its blocks under the chained hash and its
group number. A hit of h blocks needs a full-attention group's blocks 0..h-1 and a sliding
group's only those the queries from position h x block_size see (the window before it): the
longest h that every group has. A block given back keeps its hash until it is evicted, so a
later request whose window ends there takes it back; one whose window reaches a block evicted
meanwhile gets a shorter hit.

The second KV tier is not used with groups (the engine turns this manager off with KV
offloading, as vLLM does with KV connectors), and a request owing prompt logprobs takes no
prefix hit (vLLM skips the cache for them too): its hit positions are recomputed, and a sliding
group would have given back the blocks their queries read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagellm.core.block_pool import BlockHash
from pagellm.core.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.kv_layout import KVCacheLayout
from pagellm.request import Request


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, layout: KVCacheLayout,
                 enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.windows = layout.windows
        self.null_block = self.pool.get_new_blocks(1)[0]

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block table of each group (the lists themselves)."""
        if len(request.group_block_ids) != len(self.windows) - 1:
            request.group_block_ids = [[] for _ in self.windows[1:]]
        return [request.block_ids, *request.group_block_ids]

    def _first_visible_block(self, window: int, position: int) -> int:
        """The first block that queries at `position` and later see in a group."""
        return max(0, position - window + 1) // self.block_size if window else 0

    @staticmethod
    def _key(block_hash: BlockHash, group: int) -> BlockHash:
        return block_hash + bytes((group,))

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The first group's blocks of the longest hit every group has (see the module)."""
        if (not self.enable_caching or request.num_computed_tokens or request.block_ids
                or request.first_unscored_position < request.num_prompt_tokens - 1):
            return []
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        cached = [[self.pool.get_cached_block(self._key(h, group)) for h in hashes]
                  for group in range(len(self.windows))]
        length = len(hashes)
        for blocks, window in zip(cached, self.windows):
            if not window:
                length = min(length, next((i for i, b in enumerate(blocks) if b is None),
                                          length))
        while True:
            fits = min(self._sliding_hit(blocks, window, length)
                       for blocks, window in zip(cached, self.windows) if window)
            if fits == length:
                return cached[0][:length]
            length = fits

    def _sliding_hit(self, blocks: list[int | None], window: int, length: int) -> int:
        """The longest hit up to `length` blocks whose window a sliding group has cached."""
        while length:
            first = self._first_visible_block(window, length * self.block_size)
            missing = [i for i in range(first, length) if blocks[i] is None]
            if not missing:
                return length
            length = missing[-1]  # a hit past a missing block would need it
        return 0

    def _group_hits(self, request: Request, num_hits: int) -> list[list[int]]:
        """Each group's table entries for the request's `num_hits` hit blocks."""
        hits = []
        for group, window in enumerate(self.windows):
            first = self._first_visible_block(window, num_hits * self.block_size)
            blocks = [self.pool.get_cached_block(self._key(h, group))
                      for h in request.block_hashes[first:num_hits]]
            assert None not in blocks, "a prefix hit changed before it was taken"
            hits.append([self.null_block] * first + blocks)
        return hits

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: Sequence[int] = (),
                     offloaded_blocks: Sequence[int] = ()) -> bool:
        """First gives back the blocks no query to come sees: they are free for this step."""
        self._release_out_of_window(request)
        reclaimed = 0
        if computed_blocks:
            hits = self._group_hits(request, len(computed_blocks))
            reclaimed = sum(1 for blocks in hits for block in blocks
                            if block != self.null_block and self.pool.ref_counts[block] == 0)
        needed = len(self.windows) * self.num_blocks_needed(request, num_new_tokens,
                                                            computed_blocks)
        return needed <= self.pool.num_free_blocks - reclaimed

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] = (),
                       offloaded_blocks: Sequence[int] = ()) -> list[int]:
        """Take back the groups' hit blocks, give back what left the windows, then give each
        group blocks for `num_new_tokens` more tokens; returns the new blocks, by group."""
        tables = self.tables(request)
        if computed_blocks:
            for table, blocks in zip(tables, self._group_hits(request, len(computed_blocks))):
                self.pool.touch(block for block in blocks if block != self.null_block)
                table.extend(blocks)
            request.num_computed_tokens += len(computed_blocks) * self.block_size
            request.num_cached_blocks = len(request.block_ids)
        self._release_out_of_window(request)
        count = self.num_blocks_needed(request, num_new_tokens)
        new_blocks = self._get_new_blocks(count * len(tables))
        for index, table in enumerate(tables):
            table.extend(new_blocks[index * count:(index + 1) * count])
        self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
        return new_blocks

    def _release_out_of_window(self, request: Request) -> None:
        """Give back each sliding group's blocks before the window of the request's next
        query (they leave the table front first, so the older is evicted first)."""
        if not request.block_ids:
            return
        for window, table in zip(self.windows, self.tables(request)):
            if not window:
                continue
            end = min(self._first_visible_block(window, request.num_computed_tokens),
                      len(table))
            start = end
            while start and table[start - 1] != self.null_block:
                start -= 1
            self.pool.free_blocks(table[start:end])
            table[start:end] = [self.null_block] * (end - start)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for group, table in enumerate(self.tables(request)):
            for index in range(request.num_cached_blocks, num_full):
                if table[index] != self.null_block:
                    self.pool.cache_block(table[index],
                                          self._key(request.block_hashes[index], group))
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _held(self, blocks: Iterable[int]) -> list[int]:
        return [block for block in blocks if block != self.null_block]

    def free_unused_tail(self, request: Request) -> None:
        keep = max(cdiv(request.num_computed_tokens, self.block_size), request.num_cached_blocks)
        for table in self.tables(request):
            self.pool.free_blocks(self._held(reversed(table[keep:])))
            del table[keep:]

    def free(self, request: Request) -> None:
        """Each group's blocks, tail first, so that a chain's tail is evicted first."""
        for table in self.tables(request):
            self.pool.free_blocks(self._held(reversed(table)))
        request.block_ids = []
        request.group_block_ids = []
        request.num_cached_blocks = 0
        request.num_kv_reused_tokens = 0

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares the parent's full prompt blocks in every group, or none where a
        sliding group gave back a block its first query would see (then it recomputes)."""
        parent_tables = self.tables(parent)
        num_full = parent.num_prompt_tokens // self.block_size
        for window, table in zip(self.windows, parent_tables):
            first = self._first_visible_block(window, num_full * self.block_size)
            if self.null_block in table[first:num_full]:
                num_full = 0
        for shared, table in zip(parent_tables, self.tables(child)):
            table[:] = shared[:num_full]
            self.pool.touch(self._held(table))
        child.num_computed_tokens = num_full * self.block_size
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_cached_blocks = min(num_full, parent.num_cached_blocks)

    def usage(self) -> float:
        """Of the blocks requests can hold: the null block aside, as vLLM counts."""
        return (self.pool.num_used_blocks - 1) / (self.pool.num_blocks - 1)

    def check_integrity(self, requests: list[Request]) -> None:
        """The pool's check over every group's table (the null block held once, by the
        manager), and each request's tables of one length."""
        tables = []
        for request in requests:
            group_tables = self.tables(request)
            assert len({len(table) for table in group_tables}) == 1, request.request_id
            tables.extend(self._held(table) for table in group_tables)
        self.pool.check_integrity([*tables, [self.null_block]])
