"""A projection with adapters: the base matmul once for the step, then each adapter's delta
over its own tokens.

The step's adapter tokens are laid out once per step (`RowGroups`): their row indices
sorted by slot, and one segment per slot. A projection gathers those rows, and per segment
shrinks them to the adapter's rank and expands them back (two small matmuls on a contiguous
slice, at the adapter's own rank: ranks differ freely within a step), then adds the deltas
into the base output in one `index_add_`. The loop runs over the step's adapters (at most
`--max-loras`), never over requests. A step without adapter tokens has no mapping and each
projection is exactly its base.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagellm.lora.peft import LoRAWeights
from pagellm.model.quantized import Linear


@dataclass
class RowGroups:
    rows: torch.Tensor  # [N] rows of the step that use an adapter, sorted by slot
    segments: list[tuple[int, int, int]]  # (slot, start, end) ranges of `rows`

    @staticmethod
    def of(slots: np.ndarray, device: torch.device) -> RowGroups | None:
        """From each row's slot (-1: the base model); None when no row has an adapter."""
        rows = np.flatnonzero(slots >= 0)
        if rows.size == 0:
            return None
        rows = rows[np.argsort(slots[rows], kind="stable")]
        ids, starts, counts = np.unique(slots[rows], return_index=True, return_counts=True)
        segments = [(int(s), int(a), int(a + c)) for s, a, c in zip(ids, starts, counts)]
        return RowGroups(torch.from_numpy(rows).to(device), segments)


@dataclass
class StepMapping:
    """The step's rows by adapter slot: all its tokens, and the rows the last layer keeps
    after attention (`output_rows`: the tokens that sample), told apart by their count."""

    num_tokens: int
    tokens: RowGroups
    num_outputs: int
    outputs: RowGroups | None

    def groups_for(self, num_rows: int) -> RowGroups | None:
        if num_rows == self.num_tokens:
            return self.tokens
        if num_rows == self.num_outputs:
            return self.outputs
        raise AssertionError(f"a projection got {num_rows} rows in a step of "
                             f"{self.num_tokens} tokens and {self.num_outputs} outputs")


class StepState:
    """Shared by every LoRALinear of a model: the current step's mapping, or None."""

    def __init__(self) -> None:
        self.mapping: StepMapping | None = None


class LoRALinear(nn.Module):
    """`base` plus, for rows with an adapter, that adapter's delta. Slot weights are
    preallocated at the largest rank (`max_rank` per shard) and used at each adapter's own."""

    def __init__(self, base: Linear, num_shards: int, num_slots: int, max_rank: int,
                 state: StepState, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.state = state
        rank = num_shards * max_rank
        self.lora_a = torch.zeros(num_slots, rank, base.in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(num_slots, base.out_features, rank, dtype=dtype, device=device)
        self.ranks = [0] * num_slots  # 0: the slot's adapter leaves this projection alone

    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        if weights is None:
            self.ranks[slot] = 0
            return
        rank = weights.rank
        self.lora_a[slot, :rank].copy_(weights.a)
        self.lora_b[slot, :, :rank].copy_(weights.b)
        self.ranks[slot] = rank

    def slot_bytes(self) -> int:
        return (self.lora_a.numel() + self.lora_b.numel()) * self.lora_a.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        mapping = self.state.mapping
        if mapping is None:
            return out
        groups = mapping.groups_for(x.shape[0])
        if groups is not None:
            self._add_deltas(out, x, groups)
        return out

    def _add_deltas(self, out: torch.Tensor, x: torch.Tensor, groups: RowGroups) -> None:
        gathered = x.index_select(0, groups.rows)
        delta = torch.empty(gathered.shape[0], out.shape[1], dtype=x.dtype, device=x.device)
        for slot, start, end in groups.segments:
            rank = self.ranks[slot]
            if rank == 0:
                delta[start:end].zero_()
                continue
            shrunk = torch.mm(gathered[start:end], self.lora_a[slot, :rank].t())
            torch.mm(shrunk, self.lora_b[slot, :, :rank].t(), out=delta[start:end])
        out.index_add_(0, groups.rows, delta.to(out.dtype))
