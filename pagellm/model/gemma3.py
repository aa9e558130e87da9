"""Gemma 3 (text): Llama's decoder with Gemma's changes, over the same paged KV cache.

- Interleaved layers: most attend a sliding window of recent keys with their own RoPE base
  (`rope_local_base_freq`, 10k), every sixth attends every key with the global base and
  the checkpoint's RoPE scaling.
- Four norms a layer: before and after attention, before and after the MLP; all of them,
  and the per-head q/k norms, scale by `1 + w`. HF checkpoints store `w`, GGUF files
  `1 + w`: the model holds `1 + w`, so the shared RMSNorm (and its CPU kernel) applies it.
- GeGLU MLP with tanh-approximated GELU; embeddings scaled by sqrt(hidden) rounded to the
  model's dtype; attention scaled by `query_pre_attn_scalar ** -0.5`; logits optionally
  capped by `cap * tanh(logits / cap)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import gelu_tanh_and_mul, use_cpu_kernels
from pagellm.model.arch import ArchConfig, gguf_field, gguf_rope_scaling, hf_rope
from pagellm.model.attention import AttentionMetadata
from pagellm.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagellm.model.llama import Attention, LlamaForCausalLM

if TYPE_CHECKING:  # gguf is imported where a file is read (loader.py says why)
    import gguf

SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_PATTERN = 6  # every sixth layer is global (Gemma 3's layout and llama.cpp's)
_LOCAL_ROPE_THETA = 10000.0


def default_layer_types(num_layers: int, pattern: int = _DEFAULT_PATTERN) -> list[str]:
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


def gemma3_arch_from_hf_config(config: dict[str, Any]) -> ArchConfig:
    """A `gemma3_text` config.json (transformers 4 or 5 layout)."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {config['hidden_activation']!r} is not "
                         "supported (only gelu_pytorch_tanh).")
    if config.get("attn_logit_softcapping") or config.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with attention logit softcapping or bidirectional attention "
                         "is not supported.")
    num_layers, num_heads = config["num_hidden_layers"], config["num_attention_heads"]
    rope_theta, rope_scaling = hf_rope(config, FULL)
    local_params = (config.get("rope_parameters") or {}).get(SLIDING) or {}
    local_theta = local_params.get("rope_theta", config.get("rope_local_base_freq",
                                                            _LOCAL_ROPE_THETA))
    pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
    bias = bool(config.get("attention_bias", False))
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    return ArchConfig(
        model_type="gemma3_text",
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        sliding_window=int(config.get("sliding_window") or 4096),
        layer_types=list(config.get("layer_types")
                         or default_layer_types(num_layers, pattern or _DEFAULT_PATTERN)),
        local_rope_theta=float(local_theta),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or head_dim),
        final_logit_softcapping=config.get("final_logit_softcapping"),
    )


def gemma3_arch_from_gguf(reader: gguf.GGUFReader) -> ArchConfig:
    """llama.cpp's `gemma3.*` metadata; the layer pattern and the local RoPE base are not
    stored there (llama.cpp fixes them as Gemma 3 does: every sixth layer global, 10k)."""
    tensors = {t.name: t for t in reader.tensors}
    num_heads = int(gguf_field(reader, "gemma3.attention.head_count"))
    hidden = int(gguf_field(reader, "gemma3.embedding_length"))
    num_layers = int(gguf_field(reader, "gemma3.block_count"))
    head_dim = int(gguf_field(reader, "gemma3.attention.key_length", hidden // num_heads))
    cap = gguf_field(reader, "gemma3.final_logit_softcapping", None)
    bos, eos = (gguf_field(reader, f"tokenizer.ggml.{key}_token_id", None) for key in ("bos", "eos"))
    return ArchConfig(
        model_type="gemma3_text",
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, "gemma3.feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(gguf_field(reader, "gemma3.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(gguf_field(reader, "gemma3.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf_field(reader, "gemma3.rope.freq_base", 1000000.0)),
        rope_scaling=gguf_rope_scaling(reader, "gemma3", tensors.get("rope_freqs.weight")),
        max_position_embeddings=int(gguf_field(reader, "gemma3.context_length", 131072)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        qk_norm=True,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        sliding_window=int(gguf_field(reader, "gemma3.attention.sliding_window", 4096)),
        layer_types=default_layer_types(num_layers),
        local_rope_theta=_LOCAL_ROPE_THETA,
        query_pre_attn_scalar=float(head_dim),
        final_logit_softcapping=None if cap is None else float(cap),
    )


class GeGLUMLP(GatedMLP):
    """`down(gelu_tanh(gate(x)) * up(x))`, gate and up fused as in the SwiGLU MLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_cpu_kernels(gate_up):
            return self.down_proj(gelu_tanh_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_type: str) -> None:
        super().__init__()
        self.is_sliding = layer_type == SLIDING
        self.self_attn = Attention(arch)
        self.self_attn.scale = float(arch.query_pre_attn_scalar or arch.head_dim) ** -0.5
        self.self_attn.window = int(arch.sliding_window or 0) if self.is_sliding else 0
        self.mlp = GeGLUMLP(arch.hidden_size, arch.intermediate_size)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(arch.hidden_size, arch.rms_norm_eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, angles: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's normalized MLP output, the running sum before it), as Llama's
        layers: the next layer's first norm adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, angles, kv_cache, metadata,
                                                         output_rows))
        if output_rows is not None:
            residual = residual[output_rows]
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size), freeze=True)
        layer_types = arch.layer_types or default_layer_types(arch.num_hidden_layers)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(arch, kind) for kind in layer_types)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                          arch.rope_theta, arch.rope_scaling)
        self.local_rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                                arch.local_rope_theta or _LOCAL_ROPE_THETA, None)
        self.embed_scale = arch.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """As Llama's DecoderModel: the last layer computes past its attention only the
        `output_rows`."""
        embeddings = self.embed_tokens(input_ids)
        hidden = embeddings * torch.tensor(self.embed_scale, dtype=embeddings.dtype)
        residual = None
        global_angles = self.rotary_emb(positions)
        local_angles = self.local_rotary_emb(positions)
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            angles = local_angles if layer.is_sliding else global_angles
            rows = output_rows if index == last else None
            hidden, residual = layer(hidden, residual, angles, kv_cache, metadata.for_layer(index),
                                     rows)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Llama's parameter names (fused qkv_proj and gate_up_proj) plus Gemma's two extra norms
    a layer; every norm holds `1 + w`."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__(arch, decoder=Gemma3Model(arch))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.arch.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors as a Gemma 3 checkpoint stores them (norms as `w`)."""
        super().load_weights(_norms_plus_one(weights))


def _norms_plus_one(weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """In float32 as Gemma's norm computes `1 + w`, whatever the checkpoint's dtype."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor
