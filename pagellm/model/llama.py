"""One decoder serving Llama, Mistral, Ministral 3, Qwen2 and Qwen3 over the paged KV cache.

The forward pass takes the whole step as one flat token dimension (no batch
dimension): prefill chunks and decode tokens of all requests side by side.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from pagellm.model.arch import ArchConfig
from pagellm.model.attention import AttentionMetadata, paged_attention
from pagellm.model.fused_layer import FusedArgs, can_fuse, fused_forward
from pagellm.model.quantized import ANY_TOKENS, GroupQuantWeight, Linear
from pagellm.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, rotate_

# HF projection name -> (our fused projection, index of its shard along the output rows)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_SHARD_COUNTS = Counter(fused for fused, _ in _FUSED_SHARDS.values())
# Checkpoint entries that are not parameters here (old exports saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = arch.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.shard_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(arch.hidden_size, q_size + 2 * kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(q_size, arch.hidden_size, bias=arch.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5
        self.window = 0  # > 0: a sliding-window layer, whose queries see that many keys

    def forward(self, x: torch.Tensor, angles: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, output_rows: torch.Tensor | None = None,
                query_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's keys and values go to the cache; the output is `output_rows`' only
        (all rows if None). `query_scales` `[T]` multiply each token's rotated query."""
        qkv = self.qkv_proj(x)
        num_tokens, q_size, kv_size = qkv.shape[0], *self.shard_sizes[:2]
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads,
                                                                 self.head_dim))
            rotate_(q, angles)
            rotate_(k, angles)
        else:  # queries and keys sit side by side in the fused output: one rotation
            rotate_(qkv[:, :q_size + kv_size].view(num_tokens, -1, self.head_dim), angles)
            q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        if query_scales is not None:
            q = q * query_scales.to(q.dtype)[:, None, None]
        out = paged_attention(q, k, v, kv_cache, metadata, scale=self.scale, window=self.window)
        return self.o_proj(out if output_rows is None else out[output_rows])


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # (projections, fused_layer's arguments where it serves them): see can_fuse
        self.fused_check: tuple[tuple[nn.Module, ...], FusedArgs | None] | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, angles: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata,
                output_rows: torch.Tensor | None = None,
                query_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the running sum before it): the next norm adds them.
        With `output_rows`, of those rows only (their keys and values are all cached)."""
        if (residual is not None and output_rows is None and query_scales is None
                and can_fuse(self, x)):
            return fused_forward(self, x, residual, angles, kv_cache, metadata)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, angles, kv_cache, metadata, output_rows, query_scales)
        if output_rows is not None:
            residual = residual[output_rows]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        # weights come from load_weights: no random init, whose normal_ on the meta device
        # imported torch._dynamo, 1.5 s of every start
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(arch.vocab_size, arch.hidden_size), freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                          arch.rope_theta, arch.rope_scaling)
        self.llama_4_scaling = (arch.llama_4_scaling_beta, arch.llama_4_scaling_positions)

    def query_scales(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Ministral 3's per-token query scale, `1 + beta * log(1 + floor(pos / n))`: 1 within
        the original context of n positions, growing slowly past it (None without beta)."""
        beta, original = self.llama_4_scaling
        if not beta:
            return None
        return 1 + beta * torch.log(1 + torch.div(positions, original, rounding_mode="floor")
                                      .float())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer computes past its attention only the `output_rows` that are asked
        for: a prompt's other tokens need nothing beyond their keys and values there, which
        spares the o_proj and MLP of one layer in a prefill (2.8% of SmolLM2's)."""
        hidden, residual = self.run_layers(self.embed_tokens(input_ids), None, positions,
                                           kv_caches, metadata, output_rows)
        return self.norm(hidden, residual)[0]

    def run_layers(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                   positions: torch.Tensor, kv_caches: list[torch.Tensor],
                   metadata: AttentionMetadata, output_rows: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers alone (a pipeline stage runs its own): -> (hidden, residual)."""
        angles, scales = self.rotary_emb(positions), self.query_scales(positions)
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rows = output_rows if index == last else None
            hidden, residual = layer(hidden, residual, angles, kv_cache, metadata, rows, scales)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF's, except the fused `qkv_proj` and `gate_up_proj`."""

    def __init__(self, arch: ArchConfig, decoder: nn.Module | None = None) -> None:
        """`decoder`: another family's decoder with the same interface (Gemma 3's)."""
        super().__init__()
        self.arch = arch
        self.model = DecoderModel(arch) if decoder is None else decoder
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Flat `[T]` token ids and positions -> final hidden states `[T, hidden]`, or
        `[len(output_rows), hidden]` of those tokens only (every token's KV is cached)."""
        return self.model(input_ids, positions, kv_caches, metadata, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> `[N, vocab]` in the model's dtype: the sampler widens to float32
        only the rows and steps that need more than an argmax."""
        return self.lm_head(hidden)

    @property
    def lm_head_is_tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, stacking q/k/v and gate/up; every parameter must be set."""
        tied = self.arch.tie_word_embeddings
        params = {name: param for name, param in self.named_parameters()
                  if not (tied and name == "lm_head.weight") and self.needs_dense(name)}
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            if (hf_name.endswith(_IGNORED_SUFFIXES) or (tied and hf_name == "lm_head.weight")
                    or not self.needs_dense(hf_name)):
                continue
            name, shard = _fused_name(hf_name)
            if name not in params:
                raise ValueError(f"Unexpected weight {hf_name!r} for a "
                                 f"{self.arch.model_type} model.")
            target = params[name].data
            if shard is not None:
                target = self._shard(target, name, shard)
            if target.shape != tensor.shape:
                raise ValueError(f"Weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}.")
            target.copy_(tensor)
            loaded.add((name, shard))
        self._check_complete(params, loaded)

    def needs_dense(self, hf_name: str) -> bool:
        """False for the weight (not the bias) of a projection that keeps only its quantized
        form."""
        if not hf_name.endswith(".weight"):
            return True
        try:
            module = self.get_submodule(_fused_name(hf_name)[0].rpartition(".")[0])
        except AttributeError:  # not a parameter of this model: load_weights says so
            return True
        return not getattr(module, "dense_released", False)

    def weight_bytes(self) -> int:
        """Float parameters, packed float weights and quantized forms together."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        return dense + sum(m.quantized_bytes() + m.packed_bytes() for m in self.modules()
                           if isinstance(m, Linear))

    def num_weights(self) -> int:
        """Parameters, counting a projection whose float weight is not a parameter (held
        quantized or packed instead) at its shape."""
        return sum(p.numel() for p in self.parameters()) + sum(
            m.in_features * m.out_features for m in self.modules()
            if isinstance(m, Linear) and m.weight.numel() == 0)

    def weight_bytes_read(self, tokens: int) -> int:
        """Bytes of the projections' weights that a step of `tokens` tokens, all of them
        sampling, multiplies (the memory traffic of a decode step, with the KV cache)."""
        return sum(m.bytes_read(tokens) for m in self.modules() if isinstance(m, Linear))

    def pack_dense_weights(self) -> None:
        """oneDNN's layout for every float weight of a projection (Linear.pack_dense)."""
        for module in self.modules():
            if (isinstance(module, Linear) and not module.dense_released
                    and module.quantized_max_tokens != ANY_TOKENS):
                module.pack_dense(shared=module is self.lm_head and self.lm_head_is_tied)

    def attach_quantized_weights(self, weights: Iterable[tuple[str, GroupQuantWeight]],
                                 max_tokens: int, int8_activations: bool = False,
                                 bf16_tiles: bool = False,
                                 batch_invariant: bool = False) -> list[Linear]:
        """Give projections their quantized form for steps of at most `max_tokens` tokens
        (every step, in one form, if `batch_invariant`). A fused projection gets one only if
        every shard has one; a tied output projection gets the embeddings'. Returns the
        layers that did."""
        shards: dict[str, dict[int | None, GroupQuantWeight]] = {}
        for hf_name, weight in weights:
            if hf_name == "model.embed_tokens.weight" and self.arch.tie_word_embeddings:
                hf_name = "lm_head.weight"
            name, shard = _fused_name(hf_name)
            shards.setdefault(name.removesuffix(".weight"), {})[shard] = weight
        attached = []
        for name, parts in shards.items():
            layer = self.get_submodule(name)
            if not isinstance(layer, Linear) or set(parts) != set(_shards_of(name + ".weight")):
                continue
            weight = GroupQuantWeight.cat([parts[key] for key in sorted(parts, key=_order)])
            if batch_invariant:
                layer.attach_batch_invariant(weight, int8_activations)
            else:
                layer.attach_quantized(weight, max_tokens, int8_activations, bf16_tiles)
            attached.append(layer)
        return attached

    def _shard(self, fused: torch.Tensor, name: str, shard: int) -> torch.Tensor:
        sizes = self.get_submodule(name.rsplit(".", 2)[0]).shard_sizes
        return fused.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _check_complete(self, params: dict[str, nn.Parameter],
                        loaded: set[tuple[str, int | None]]) -> None:
        head = ("lm_head.weight", None)
        expected = {(name, shard) for name in params for shard in _shards_of(name)}
        missing = expected - loaded - {head}
        if head not in loaded and self.needs_dense(head[0]):
            # tied, or no output projection saved: share the embeddings
            self.lm_head.weight = self.model.embed_tokens.weight
        if missing:
            names = sorted(name for name, _ in missing)
            raise ValueError(f"Checkpoint is missing {len(names)} weight(s), e.g. {names[:5]}.")


def _fused_name(hf_name: str) -> tuple[str, int | None]:
    """`...self_attn.k_proj.weight` -> (`...self_attn.qkv_proj.weight`, 1)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
        fused, shard = _FUSED_SHARDS[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return hf_name, None


def _order(shard: int | None) -> int:
    return -1 if shard is None else shard


def _shards_of(name: str) -> list[int | None]:
    parts = name.split(".")
    count = _SHARD_COUNTS.get(parts[-2], 0) if len(parts) >= 2 else 0
    return list(range(count)) if count else [None]
