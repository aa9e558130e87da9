"""PEFT LoRA adapters, read from the folder `peft` saves and checked against the model.

An adapter is `adapter_config.json` plus `adapter_model.safetensors` (or `.bin`). Each
adapted projection has `lora_A` `[r, in]` and `lora_B` `[out, r]`, and adds
`scaling * B @ A` to its weight, with `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)`
under `use_rslora`), r and alpha per module from `rank_pattern` / `alpha_pattern`.

The model fuses q/k/v into one projection and gate/up into another, so the shards' A
matrices are stacked into one `[sum r, in]` and their B matrices, scaled, laid
block-diagonally into one `[out, sum r]`: one shrink and one expand per fused projection.

Whatever this cannot serve exactly fails here, at load, with the reason: DoRA,
`modules_to_save`, biases, embeddings or the output head, a target list that matches none
of the model's projections, ranks above `--max-lora-rank`, shapes of another model.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pagellm.lora.adapter_config import (LoRAAdapterError, adapter_files, check_config,
                                         parse_config)

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
# Modules a target list may name that have no LoRA support here.
UNSUPPORTED_MODULES = ("lm_head", "model.embed_tokens")


@dataclass(frozen=True)
class ProjectionShape:
    """One of the model's (possibly fused) projections: its inputs and, per shard in order,
    the Hugging Face module name and its output rows."""

    in_features: int
    shards: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.shards)


ModelLayout = dict[str, ProjectionShape]  # our module name -> its shape


@dataclass
class LoRAWeights:
    """One projection's adapter: delta = (x @ a.T) @ b.T, the scaling folded into b."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class AdapterFiles:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    content_hash: bytes  # of the config and weight files' bytes


def read_adapter_files(path: str | Path) -> AdapterFiles:
    config_file, weights = adapter_files(path)
    config_bytes, weight_bytes = config_file.read_bytes(), weights.read_bytes()
    config = parse_config(path, config_bytes)
    try:
        if weights.suffix == ".safetensors":
            tensors = load_file(weights)
        else:
            tensors = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as error:  # any unreadable file is the adapter's fault
        raise LoRAAdapterError(f"LoRA adapter {path} does not load: {error}") from None
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    digest.update(weight_bytes)
    return AdapterFiles(config, tensors, digest.digest())


def targets(config: dict[str, Any], key: str) -> bool:
    """PEFT's rule: a regex matches the full module name, a list entry the name or its
    last dotted parts; "all-linear" every projection but the output head."""
    target = config["target_modules"]
    if target == "all-linear" or target == ["all-linear"]:
        return key not in UNSUPPORTED_MODULES
    if isinstance(target, str):
        return re.fullmatch(target, key) is not None
    return key in target or any(key.endswith("." + name) for name in target)


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern that ends the name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def module_scaling(config: dict[str, Any], key: str) -> tuple[int, float]:
    """(rank, scaling) of module `key` as PEFT computes them."""
    rank = _pattern_value(config.get("rank_pattern") or {}, key, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Module name -> {"A": lora_A, "B": lora_B}; any other tensor is unsupported."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        if match is None:
            raise LoRAAdapterError(f"{name} is unsupported LoRA weight (only lora_A/lora_B of "
                                   "the decoder's projections are).")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise LoRAAdapterError(f"LoRA weights of {module} lack lora_{missing}.")
    return pairs


def _check_targets(config: dict[str, Any], layout: ModelLayout,
                   pairs: dict[str, dict[str, torch.Tensor]]) -> None:
    names = [hf for shape in layout.values() for hf, _ in shape.shards]
    matched = [key for key in names if targets(config, key)]
    unsupported = [key for key in UNSUPPORTED_MODULES if targets(config, key)]
    if unsupported:
        raise LoRAAdapterError(f"target_modules {config['target_modules']!r} include "
                               f"{', '.join(unsupported)}, which LoRA cannot adapt here.")
    if not matched or not pairs:
        raise LoRAAdapterError(f"target_modules {config['target_modules']!r} match no module of "
                               "this model (its projections are q_proj, k_proj, v_proj, "
                               "o_proj, gate_proj, up_proj and down_proj).")
    stray = sorted(set(pairs) - set(matched))
    if stray:
        raise LoRAAdapterError(f"LoRA weights for {stray[0]}, which is not a projection of this "
                               "model that target_modules names.")


def load_adapter(path: str | Path, layout: ModelLayout, max_rank: int,
                 dtype: torch.dtype) -> tuple[dict[str, LoRAWeights], bytes]:
    """Our module name -> its fused weights, and the adapter's content hash."""
    files = read_adapter_files(path)
    check_config(files.config)
    pairs = _pairs(files.tensors)
    _check_targets(files.config, layout, pairs)
    fused = {}
    for module, shape in layout.items():
        parts = [(index, hf) for index, (hf, _) in enumerate(shape.shards) if hf in pairs]
        if parts:
            fused[module] = _fuse(files.config, shape, [(i, hf, pairs[hf]) for i, hf in parts],
                                  max_rank, dtype)
    return fused, files.content_hash


def _fuse(config: dict[str, Any], shape: ProjectionShape,
          parts: list[tuple[int, str, dict[str, torch.Tensor]]], max_rank: int,
          dtype: torch.dtype) -> LoRAWeights:
    """Stack the shards' A matrices; lay their scaled B matrices block-diagonally."""
    offsets = [0]
    for _, rows in shape.shards:
        offsets.append(offsets[-1] + rows)
    total_rank = sum(pair["A"].shape[0] for _, _, pair in parts)
    a_rows, b = [], torch.zeros(shape.out_features, total_rank, dtype=torch.float32)
    column = 0
    for index, hf, pair in parts:
        rank, scaling = module_scaling(config, hf)
        a, b_part = pair["A"].float(), pair["B"].float()
        rows = shape.shards[index][1]
        if a.shape != (rank, shape.in_features) or b_part.shape != (rows, rank):
            raise LoRAAdapterError(
                f"LoRA weights of {hf} have shapes {tuple(a.shape)} and {tuple(b_part.shape)}; "
                f"this model needs {(rank, shape.in_features)} and {(rows, rank)} (rank {rank} "
                "from adapter_config.json): an adapter of another model?")
        if rank > max_rank:
            raise LoRAAdapterError(f"LoRA rank {rank} of {hf} is greater than max_lora_rank "
                                   f"{max_rank} (--max-lora-rank).")
        a_rows.append(a)
        b[offsets[index]:offsets[index + 1], column:column + rank] = b_part * scaling
        column += rank
    return LoRAWeights(torch.cat(a_rows).to(dtype).contiguous(), b.to(dtype).contiguous())
