"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's layers with a routed
MLP.

Each token's router picks its `num_experts_per_tok` experts from a softmax over all of them
(renormalized over the chosen ones where the model does: Mixtral always, Qwen3-MoE with
`norm_topk_prob`). The step's (token, expert) pairs are then sorted by expert, and every
expert that any token chose multiplies all of its tokens at once: one gate/up and one down
matmul per active expert for the whole batch, whatever its size, through the same `Linear`
projections (packed float weights, or a GGUF's codes as stored) as the dense MLP. Each
expert is a `GatedMLP`, so the checkpoints' per-expert names (`experts.3.gate_proj`,
Mixtral's `experts.3.w1`, a GGUF's stacked experts once cut by gguf_weights.hf_names) load
through Llama's fused-shard loading. Qwen2-MoE adds a shared expert that every token runs, its
output scaled by a sigmoid gate of the token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.model.arch import ArchConfig, arch_from_hf_config, gguf_field
from pagellm.model.layers import GatedMLP
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.quantized import Linear

if TYPE_CHECKING:  # gguf is imported where a file is read (loader.py says why)
    import gguf

# The dense family whose attention each MoE type shares.
_DENSE_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
# Mixtral's checkpoint names -> Llama's.
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.",
                  ".w2.": ".down_proj."}


def moe_arch_from_hf_config(config: dict[str, Any]) -> ArchConfig:
    model_type = config["model_type"]
    dense = arch_from_hf_config({**config, "model_type": _DENSE_FAMILY[model_type]})
    if model_type == "mixtral":
        return dataclasses.replace(dense, model_type=model_type,
                                   num_experts=config["num_local_experts"],
                                   num_experts_per_tok=config["num_experts_per_tok"],
                                   moe_intermediate_size=config["intermediate_size"],
                                   norm_topk_prob=True, dense_layers=[])
    step = config.get("decoder_sparse_step", 1) or 1
    # transformers 5 writes `num_local_experts` for Qwen3-MoE too; 4 wrote `num_experts`
    num_experts = config.get("num_local_experts", config.get("num_experts", 0))
    layers = range(dense.num_hidden_layers)
    dense_layers = [i for i in layers if i in (config.get("mlp_only_layers") or [])
                    or num_experts == 0 or (i + 1) % step != 0]
    return dataclasses.replace(dense, model_type=model_type, num_experts=num_experts,
                               num_experts_per_tok=config["num_experts_per_tok"],
                               moe_intermediate_size=config["moe_intermediate_size"],
                               norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                               dense_layers=dense_layers,
                               # Qwen2-MoE: q/k/v bias unless `qkv_bias` is false
                               attention_bias=dense.attention_bias
                               and bool(config.get("qkv_bias", True)),
                               shared_expert_intermediate_size=config.get(
                                   "shared_expert_intermediate_size", 0))


def moe_arch_from_gguf(reader: gguf.GGUFReader, arch: str, dense: ArchConfig) -> ArchConfig:
    """llama.cpp's expert keys (`{arch}.expert_count`, `.expert_used_count` and, for
    Qwen3-MoE, `.expert_feed_forward_length`) on top of the attention read by
    arch_from_gguf. As in llama.cpp, every layer is routed and the chosen experts' weights
    are renormalized, in both architectures: a GGUF carries no `norm_topk_prob`, and
    transformers' GGUF loader sets it likewise."""
    return dataclasses.replace(
        dense, num_experts=int(gguf_field(reader, f"{arch}.expert_count")),
        num_experts_per_tok=int(gguf_field(reader, f"{arch}.expert_used_count")),
        moe_intermediate_size=int(gguf_field(reader, f"{arch}.expert_feed_forward_length",
                                             dense.intermediate_size)),
        norm_topk_prob=True, dense_layers=[])


class SparseMoE(nn.Module):
    """A router (`gate`) over `experts`, each a SwiGLU MLP; where the model has one, a
    `shared_expert` for every token, scaled by sigmoid(`shared_expert_gate`(x))."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        size = arch.moe_intermediate_size or arch.intermediate_size
        self.top_k, self.normalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.gate = Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(arch.hidden_size, size)
                                     for _ in range(arch.num_experts))
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(arch.hidden_size, arch.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> each token's chosen experts [T, k] and their weights [T, k] (x's dtype), from a
        float32 softmax over all experts."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each expert's rows in one matmul, then each token's k outputs summed in ascending
        expert order, as transformers adds them. No index_add_: torch opens a parallel
        region for it at any size, which on a busy CPU cost 50 ms a call at one token."""
        experts, weights = self.route(x)
        experts, choice = experts.sort(dim=-1)  # a token's experts in ascending order
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert
        tokens = order // self.top_k
        pair_weights = weights.gather(-1, choice).reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        pairs = x.new_empty(len(flat), x.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            pairs[start:end] = self.experts[expert](x[tokens[start:end]]) * pair_weights[start:end]
            start = end
        by_token = pairs[torch.argsort(order)].view(len(x), self.top_k, x.shape[1])
        out = by_token[:, 0]
        for k in range(1, self.top_k):
            out = out + by_token[:, k]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's model with a SparseMoE in place of the MLP of every layer not in
    `arch.dense_layers`."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__(arch)
        dense = set(arch.dense_layers or [])
        for index, layer in enumerate(self.model.layers):
            if index not in dense:
                layer.mlp = SparseMoE(arch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_llama_names(weights) if self.arch.model_type == "mixtral"
                             else weights)


def _llama_names(weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        for old, new in _MIXTRAL_NAMES.items():
            name = name.replace(old, new)
        yield name, tensor
