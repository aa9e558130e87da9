"""Which part of each checkpoint tensor a rank keeps, Megatron-style as vLLM shards Llama.

Column-parallel (rows of the weight split): q/k/v and gate/up. Row-parallel (columns split,
one all-reduce after): o_proj and down_proj, whose bias only tp rank 0 adds. Query heads split
evenly; key/value heads too, or are replicated when there are fewer than ranks. The vocabulary
(embedding and output head) is padded to a multiple of 64 and split by rows. A pipeline stage
keeps only its layers (renumbered from 0), the first the embedding, the last the head.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.distributed.config import get_pp_indices
from pagellm.distributed.group import RankInfo
from pagellm.model.arch import ArchConfig
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import WeightShard, materialize
from pagellm.model.quantized import CODE_BLOCK, GroupQuantWeight, Linear

VOCAB_PADDING = 64
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Cut:
    """Keep [start, stop) along `dim` (0: rows, 1: columns), zero-padded to `rows` rows;
    `zero`: keep a tensor of zeros instead (a row-parallel bias off tp rank 0)."""

    dim: int
    start: int
    stop: int
    rows: int | None = None
    zero: bool = False


def check_shardable(arch: ArchConfig, tp: int) -> None:
    """vLLM's conditions for splitting a model over `tp` ranks, and what pagellm's ranks
    cannot split yet: the experts of a mixture-of-experts model."""
    if arch.num_experts:
        raise ValueError(f"{arch.model_type} is a mixture-of-experts model, which pagellm does "
                         "not split over ranks yet (tensor or pipeline parallelism): serve it "
                         "in one process.")
    if arch.num_attention_heads % tp:
        raise ValueError(f"Total number of attention heads ({arch.num_attention_heads}) must "
                         f"be divisible by tensor parallel size ({tp}).")
    kv = arch.num_key_value_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"Total number of key/value heads ({kv}) must be divisible by "
                         f"tensor parallel size ({tp}), or divide it (to be replicated).")
    if arch.intermediate_size % tp:
        raise ValueError(f"intermediate_size ({arch.intermediate_size}) must be divisible by "
                         f"tensor parallel size ({tp}).")


class ShardLayout(WeightShard):
    """One rank's share of a model: its local architecture and the cut of every weight."""

    sliced = True

    def __init__(self, arch: ArchConfig, info: RankInfo) -> None:
        check_shardable(arch, info.tp_size)
        self.arch, self.info = arch, info
        tp, rank = info.tp_size, info.tp_rank
        self.layers = get_pp_indices(arch.num_hidden_layers, info.pp_rank, info.pp_size)
        heads, kv = arch.num_attention_heads // tp, arch.num_key_value_heads
        self.kv_heads = max(1, kv // tp)
        kv_start = rank * self.kv_heads if kv >= tp else rank // (tp // kv)
        padded = -(-arch.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
        self.vocab_rows = -(-padded // tp)
        intermediate = arch.intermediate_size // tp
        self.ranges = {"q": (rank * heads * arch.head_dim, (rank + 1) * heads * arch.head_dim),
                       "kv": (kv_start * arch.head_dim,
                              (kv_start + self.kv_heads) * arch.head_dim),
                       "mlp": (rank * intermediate, (rank + 1) * intermediate)}
        self.vocab_start = rank * self.vocab_rows
        self.owns_embedding = info.is_first_stage or (info.is_last_stage
                                                      and arch.tie_word_embeddings)
        self.local_arch = dataclasses.replace(
            arch, num_attention_heads=heads, num_key_value_heads=self.kv_heads,
            intermediate_size=intermediate, num_hidden_layers=self.layers[1] - self.layers[0],
            vocab_size=self.vocab_rows)

    def instantiate(self, arch: ArchConfig, dtype: torch.dtype,
                    device: torch.device) -> LlamaForCausalLM:
        """This rank's model, uninitialized: its heads, its layers, its rows of the vocabulary
        (none of the embedding off the stages that look tokens up, no head off the last)."""
        from pagellm.distributed.model import VocabParallelEmbedding

        local = self.local_arch
        with torch.device("meta"):
            net = LlamaForCausalLM(local)
            rows = self.vocab_rows if self.owns_embedding else 0
            net.model.embed_tokens = VocabParallelEmbedding(rows, local.hidden_size,
                                                            self.vocab_start)
            if not self.info.is_last_stage:
                with warnings.catch_warnings():  # "zero-element tensors": as meant
                    warnings.simplefilter("ignore", UserWarning)
                    net.lm_head = Linear(local.hidden_size, 0, bias=False)
                net.lm_head.dense_released = True  # loads nothing, is never called
        return materialize(net, dtype, device).eval().requires_grad_(False)

    def describe(self) -> str:
        """This rank's share, for its start-up line."""
        arch, local = self.arch, self.local_arch
        return (f"layers [{self.layers[0]}, {self.layers[1]}) of {arch.num_hidden_layers}, "
                f"{local.num_attention_heads} of {arch.num_attention_heads} query heads, "
                f"{self.kv_heads} of {arch.num_key_value_heads} key/value heads, vocabulary "
                f"rows [{self.vocab_start}, {self.vocab_start + self.vocab_rows})")

    def wanted(self, needs_dense: Callable[[str], bool]) -> Callable[[str], bool]:
        def wanted(name: str) -> bool:
            local = self.local_name(name)
            return local is not None and needs_dense(local)

        return wanted

    def local_name(self, name: str) -> str | None:
        """The checkpoint name in this rank's model (layers renumbered), None: not here."""
        if name == _VOCAB[1] and not self.info.is_last_stage:
            return None
        match = _LAYER.match(name)
        if match is None:
            return name
        index = int(match.group(1))
        start, stop = self.layers
        if not start <= index < stop:
            return None
        return f"model.layers.{index - start}.{name[match.end():]}"

    def cut(self, name: str) -> Cut | None:
        """None: kept whole (norms, and every tensor when nothing is split)."""
        if name in _VOCAB:
            owned = (self.owns_embedding if name == _VOCAB[0] else self.info.is_last_stage)
            start = min(self.vocab_start, self.arch.vocab_size) if owned else 0
            stop = min(self.vocab_start + self.vocab_rows, self.arch.vocab_size) if owned else 0
            return Cut(0, start, stop, rows=self.vocab_rows if owned else 0)
        if self.info.tp_size == 1:
            return None
        parts = name.split(".")
        projection, kind = parts[-2] if len(parts) > 1 else "", parts[-1]
        if projection in _COLUMN:
            return Cut(0, *self.ranges[_COLUMN[projection]])
        if projection in _ROW:
            if kind == "bias":
                return Cut(0, 0, 0, zero=True) if self.info.tp_rank else None
            return Cut(1, *self.ranges[_ROW[projection]])
        return None

    def dense(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of each (name, tensor or safetensors slice) it keeps."""
        for name, tensor in weights:
            local = self.local_name(name)
            if local is None:
                continue
            yield local, cut_dense(tensor, self.cut(name))

    def quantized(self, weights: Iterable[tuple[str, GroupQuantWeight]]
                  ) -> Iterator[tuple[str, GroupQuantWeight]]:
        """The codes as stored, cut by rows or by whole groups of columns; a projection whose
        cut splits a group keeps no quantized form (it multiplies its float weights)."""
        for name, weight in weights:
            local = self.local_name(name)
            if local is None or (name in _VOCAB and not self.info.is_last_stage):
                continue  # only the output head multiplies the vocabulary's codes
            cut = self.cut(name)
            if cut is not None and cut.dim == 1 and (cut.start % CODE_BLOCK
                                                     or cut.stop % CODE_BLOCK):
                continue
            yield local, weight if cut is None else cut_quantized(weight, cut)


def cut_dense(tensor: Any, cut: Cut | None) -> torch.Tensor:
    """`tensor` may be a safetensors slice: only the cut is then read from the file."""
    if cut is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    if cut.zero:
        full = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        return torch.zeros_like(full)
    part = tensor[cut.start:cut.stop] if cut.dim == 0 else tensor[:, cut.start:cut.stop]
    return _pad_rows(part.contiguous(), cut.rows)


def cut_quantized(weight: GroupQuantWeight, cut: Cut) -> GroupQuantWeight:
    if cut.zero:
        return weight.map_rows(torch.zeros_like)
    if cut.dim == 0:
        return weight.map_rows(lambda rows: _pad_rows(rows[cut.start:cut.stop].contiguous(),
                                                      cut.rows))
    first, last = cut.start // weight.group_size, cut.stop // weight.group_size
    zeros = None if weight.zeros is None else weight.zeros[:, first:last].contiguous()
    return GroupQuantWeight(weight.codes[:, cut.start:cut.stop].contiguous(),
                            weight.scales[:, first:last].contiguous(), zeros, weight.bits)


def _pad_rows(tensor: torch.Tensor, rows: int | None) -> torch.Tensor:
    if rows is None or tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])
