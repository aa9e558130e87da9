"""A Llama-family decoder layer in three calls: C++ before its attention, the attention,
C++ after it (kernels/decoder_layer.cpp); in two where a decode-only step of the
batch-invariant engine leaves one attention kernel to choose (invariant_decode_group), the
second call writing the keys and values and attending too.

At one decoding request a layer's kernels take about 70 us, and the Python around them
(nine module calls, the projections' and norms' wrappers, a dozen views and checks) about
95 us more. The two ops run the same kernels in the same order on the same tensors, so the
bits are the modules' own. They serve the layers whose every projection multiplies only its
int8 panels (the engine's batch-invariant default on a GGUF), with no bias, q/k norm, LoRA
adapter or hook (a tensor-parallel rank's all-reduce); every other layer, and the first (its
running sum starts there) and last (its output rows) of a step, takes the modules' path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

from pagellm.kernels import DEFAULT_CACHE_DTYPES, int8_matmul_available
from pagellm.model.attention import (AttentionGroup, AttentionMetadata,
                                     attends_with_invariant_decode, paged_attention)
from pagellm.model.layers import GatedMLP, RMSNorm
from pagellm.model.quantized import Linear

if TYPE_CHECKING:
    from pagellm.model.llama import DecoderLayer


@functools.cache
def fused_layer_available() -> bool:
    return int8_matmul_available() and hasattr(torch.ops.pagellm, "attention_input")


def _int8_only(linear: torch.nn.Module) -> bool:
    return (type(linear) is Linear and linear.batch_invariant and linear.int8_panels is not None
            and linear.bias is None and not linear._forward_hooks
            and not linear._forward_pre_hooks)


def _projections(layer: DecoderLayer) -> tuple[torch.nn.Module, ...] | None:
    """None where the MLP is not a SwiGLU one (a MoE model's experts)."""
    attention, mlp = layer._modules["self_attn"], layer._modules["mlp"]
    if type(mlp) is not GatedMLP:
        return None
    return (attention._modules["qkv_proj"], attention._modules["o_proj"],
            mlp._modules["gate_up_proj"], mlp._modules["down_proj"])


@dataclasses.dataclass(frozen=True)
class FusedArgs:
    """A fusable layer's arguments to the two ops, gathered once with its check: looking
    them up on the modules at every call cost about a tenth of the Python the ops save."""

    norm_and_qkv: tuple  # attention_input's, between the running sum and the angles
    rotation: tuple[int, int]  # and after the angles: the rotated width, the head size
    output: tuple  # attention_output's, after the attention's output and the running sum
    q_size: int
    kv_size: int


def _fused_args(layer: DecoderLayer) -> FusedArgs:
    attention, mlp = layer.self_attn, layer.mlp
    norm, post = layer.input_layernorm, layer.post_attention_layernorm
    qkv, o = attention.qkv_proj.int8_panels, attention.o_proj.int8_panels
    gate_up, down = mlp.gate_up_proj.int8_panels, mlp.down_proj.int8_panels
    q_size, kv_size = attention.shard_sizes[:2]
    return FusedArgs(
        (norm.weight, norm.eps, qkv.codes, qkv.scales, qkv.zeros, attention.qkv_proj.out_features),
        (q_size + kv_size, attention.head_dim),
        (o.codes, o.scales, o.zeros, post.weight, post.eps, gate_up.codes, gate_up.scales,
         gate_up.zeros, mlp.down_proj.in_features, down.codes, down.scales, down.zeros),
        q_size, kv_size)


def can_fuse(layer: DecoderLayer, x: torch.Tensor) -> bool:
    """The full check runs once per set of projections and is kept on the layer, with the
    ops' arguments: LoRA replaces projections and parallel ranks hook them after load, which
    a later call sees (a new module, or a hook) and checks again."""
    if x.dim() != 2 or x.device.type != "cpu":
        return False
    projections = _projections(layer)
    if projections is None:
        return False
    if layer.fused_check is not None and layer.fused_check[0] == projections:
        return layer.fused_check[1] is not None and not any(
            p._forward_hooks or p._forward_pre_hooks for p in projections)
    attention = layer.self_attn
    fusable = (fused_layer_available() and attention.q_norm is None
               and type(layer.input_layernorm) is RMSNorm
               and type(layer.post_attention_layernorm) is RMSNorm
               and all(map(_int8_only, projections)))
    layer.fused_check = (projections, _fused_args(layer) if fusable else None)
    return fusable


def invariant_decode_group(metadata: AttentionMetadata, kv_cache: torch.Tensor,
                           qkv: torch.Tensor) -> AttentionGroup | None:
    """The step's one group where paged_attention would write every token's keys and values
    and attend it with the invariant decode kernel (attends_with_invariant_decode), float32
    queries in and a cache of the default library's: decode_attention_output then serves the
    layer from its attention on. None otherwise."""
    if metadata.kv_write_rows is not None or len(metadata.groups) != 1:
        return None
    group = metadata.groups[0]
    if (group.all_tokens_in_order and qkv.dtype == torch.float32
            and kv_cache.dtype in DEFAULT_CACHE_DTYPES and decode_attention_output_available()
            and attends_with_invariant_decode(group, kv_cache)):
        return group
    return None


@functools.cache
def decode_attention_output_available() -> bool:
    return fused_layer_available() and hasattr(torch.ops.pagellm, "decode_attention_output")


def fused_forward(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor,
                  angles: torch.Tensor, kv_cache: torch.Tensor,
                  metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """DecoderLayer.forward's result for a step with a running sum, all rows kept (after
    can_fuse said yes)."""
    args, attention = layer.fused_check[1], layer.self_attn
    qkv = torch.ops.pagellm.attention_input(x, residual, *args.norm_and_qkv, angles,
                                            *args.rotation)
    tokens, head_dim = qkv.shape[0], attention.head_dim
    group = invariant_decode_group(metadata, kv_cache, qkv)
    if group is not None:
        return torch.ops.pagellm.decode_attention_output(
            qkv, residual, kv_cache, metadata.slot_mapping, group.block_tables, group.seq_lens,
            attention.scale, attention.window, attention.num_heads, attention.num_kv_heads,
            head_dim, *args.output), residual
    q_end, k_end = args.q_size, args.q_size + args.kv_size
    q = qkv[:, :q_end].view(tokens, attention.num_heads, head_dim)
    k = qkv[:, q_end:k_end].view(tokens, attention.num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(tokens, attention.num_kv_heads, head_dim)
    out = paged_attention(q, k, v, kv_cache, metadata, scale=attention.scale,
                          window=attention.window)
    return torch.ops.pagellm.attention_output(out, residual, *args.output), residual
