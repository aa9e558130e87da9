"""A picture of the KV cache for the engine view: each block's state, a few thousand cells at most.

The first tier's blocks are free (no holder, no content worth keeping), used (held by a
request) or cached (no holder, but they keep a prefix's hash and can be taken back by a
request with that prefix). The second tier's blocks are empty or offloaded (a prefix
evicted from the first tier, or a swapped-out request's blocks). A big cache is shown in
cells of several blocks, each cell in the state of most of its blocks; the counts are
always exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagellm.core.block_pool import BlockPool
from pagellm.core.offload import OffloadPool

FREE, USED, CACHED, OFFLOADED = 0, 1, 2, 3
MAX_CELLS = 2048


@dataclass
class TierMap:
    """One tier's states, `blocks_per_cell` blocks per cell (the last cell may hold fewer)."""

    num_blocks: int
    blocks_per_cell: int
    cells: bytes
    counts: dict[int, int]


@dataclass
class BlockMap:
    tier1: TierMap
    tier2: TierMap | None = None


def _tier_map(states: np.ndarray, codes: tuple[int, ...], max_cells: int) -> TierMap:
    num_blocks = len(states)
    per_cell = max(1, -(-num_blocks // max_cells))
    counts = {code: int(np.count_nonzero(states == code)) for code in codes}
    if per_cell == 1:
        return TierMap(num_blocks, 1, states.tobytes(), counts)
    num_cells = -(-num_blocks // per_cell)
    padded = np.full(num_cells * per_cell, -1, dtype=np.int16)
    padded[:num_blocks] = states
    groups = padded.reshape(num_cells, per_cell)
    votes = np.stack([np.count_nonzero(groups == code, axis=1) for code in codes])
    cells = np.asarray(codes, dtype=np.uint8)[votes.argmax(axis=0)]
    return TierMap(num_blocks, per_cell, cells.tobytes(), counts)


def free_map(num_blocks: int, max_cells: int = MAX_CELLS) -> BlockMap:
    """The map of a cache nobody has used yet."""
    return BlockMap(_tier_map(np.zeros(num_blocks, dtype=np.uint8), (FREE, USED, CACHED),
                              max_cells))


def _held_and_hashed(ref_counts: list[int], hashes: list[bytes | None]
                     ) -> tuple[np.ndarray, np.ndarray]:
    held = np.asarray(ref_counts) > 0
    hashed = np.fromiter((h is not None for h in hashes), dtype=bool, count=len(hashes))
    return held, hashed


def block_map(pool: BlockPool, offload: OffloadPool | None,
              max_cells: int = MAX_CELLS) -> BlockMap:
    held, hashed = _held_and_hashed(pool.ref_counts, pool.block_hashes)
    states = np.where(held, USED, np.where(hashed, CACHED, FREE)).astype(np.uint8)
    tier2 = None
    if offload is not None:
        held2, hashed2 = _held_and_hashed(offload.ref_counts, offload.block_hashes)
        tier2 = _tier_map(np.where(held2 | hashed2, OFFLOADED, FREE).astype(np.uint8),
                          (FREE, OFFLOADED), max_cells)
    return BlockMap(_tier_map(states, (FREE, USED, CACHED), max_cells), tier2)
