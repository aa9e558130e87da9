"""Each layer's attention metadata where layer groups have block tables of their own
(`KVCacheLayout`, sliding-window layers): the t-th layer of every group shares KV tensor t,
and a group's layers read and write the blocks of that group's tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagellm.core.kv_layout import KVCacheLayout
from pagellm.model.attention import AttentionMetadata, with_block_tables

if TYPE_CHECKING:
    from pagellm.worker.step_chunk import StepChunk


def layer_metadata(metadata: AttentionMetadata, layout: KVCacheLayout,
                   chunks: Sequence["StepChunk"], positions: list[np.ndarray],
                   write_rows: np.ndarray | None, block_size: int) -> list[AttentionMetadata]:
    """Group 0's metadata is `metadata`; group g's has the chunks' tables of group g and the
    slots of each chunk's `positions` in them (only `write_rows`' where it is set)."""
    by_group = [metadata]
    device = metadata.slot_mapping.device
    for group in range(layout.num_groups - 1):
        tables = [chunk.group_block_ids[group] for chunk in chunks]
        slots = np.concatenate([np.asarray(table, dtype=np.int64)[pos // block_size] * block_size
                                + pos % block_size for table, pos in zip(tables, positions)])
        if write_rows is not None:
            slots = slots[write_rows]
        by_group.append(with_block_tables(metadata, tables, torch.from_numpy(slots).to(device)))
    return [by_group[group] for group in layout.layer_groups]
