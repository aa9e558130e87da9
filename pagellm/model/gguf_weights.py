"""Read llama.cpp GGUF tensors under HF names: as float tensors, or as codes and scales."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from pagellm.model.arch import ArchConfig
from pagellm.model.quantized import GroupQuantWeight

# Per-block GGUF tensor names (after "blk.N.") -> HF names (after "model.layers.N.").
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# Stacked experts [experts, out, in] -> each expert's projection (moe.py's names).
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
# Gemma 3 names its four norms a layer differently (ffn_norm comes before its MLP there).
_ARCH_BLOCK_NAMES = {"gemma3_text": {**_BLOCK_NAMES,
                                     "post_attention_norm": "post_attention_layernorm",
                                     "ffn_norm": "pre_feedforward_layernorm",
                                     "post_ffw_norm": "post_feedforward_layernorm"}}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
# Folded into `ArchConfig.rope_scaling` by `arch_from_gguf`.
_CONFIG_TENSORS = ("rope_freqs.weight",)
# llama.cpp reorders q/k rows of these architectures for its interleaved RoPE; Qwen's
# converters keep HF's layout.
_PERMUTED_ARCHITECTURES = ("llama", "mistral", "mixtral")
# llama.cpp stores these architectures' norms as 1 + w, HF checkpoints (and so load_weights) as w.
_NORM_PLUS_ONE_ARCHITECTURES = ("gemma3_text",)


def gguf_weights(reader: gguf.GGUFReader, arch: ArchConfig,
                 wanted: Callable[[str], bool] = lambda name: True
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor whose HF name is `wanted` (any expert's, for stacked
    experts) to float and yield it under that name and its HF shape, one matrix per
    expert."""
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        names = hf_names(tensor, arch.model_type)
        if not any(wanted(name) for name, _ in names):
            continue
        values = _dequantized(tensor)
        for name, expert in names:
            if wanted(name):
                yield name, _in_hf_layout(name, values if expert is None else values[expert],
                                          arch)


def _in_hf_layout(name: str, values: torch.Tensor, arch: ArchConfig) -> torch.Tensor:
    """Undo llama.cpp's storage conventions: norms as 1 + w, q/k rows permuted."""
    if arch.model_type in _NORM_PLUS_ONE_ARCHITECTURES and name.endswith("norm.weight"):
        values = values - 1.0
    if arch.model_type in _PERMUTED_ARCHITECTURES:
        if ".q_proj." in name:
            values = _unpermute_rows(values, arch.num_attention_heads)
        elif ".k_proj." in name:
            values = _unpermute_rows(values, arch.num_key_value_heads)
    return values


def hf_names(tensor: gguf.ReaderTensor, model_type: str | None = None
             ) -> list[tuple[str, int | None]]:
    """The HF name of each matrix a tensor holds, with its index along the tensor's first
    dimension: `blk.3.ffn_up_exps.weight` [experts, out, in] ->
    (`model.layers.3.mlp.experts.E.up_proj.weight`, E) for every expert E; any other tensor
    -> its one name (hf_name) and None."""
    parts = tensor.name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_NAMES:
        prefix = f"model.layers.{parts[1]}.mlp.experts"
        return [(f"{prefix}.{expert}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}", expert)
                for expert in range(int(tensor.shape[-1]))]
    return [(hf_name(tensor.name, model_type), None)]


def hf_name(gguf_name: str, model_type: str | None = None) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = gguf_name.split(".")
    block_names = _ARCH_BLOCK_NAMES.get(model_type or "", _BLOCK_NAMES)
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"Unexpected GGUF tensor {gguf_name!r}.")


def _dequantized(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """GGUF lists dimensions fastest-first, so the torch shape is the reverse. Q8_0 and Q8_K
    weights are each one product of a code and a scale, exact in float32, so their groups
    give gguf's values: gguf-py has no dequantizer for Q8_K, and its numpy took 0.53 s for
    SmolLM2's Q8_0 embedding table (a first start's), against 0.17 s."""
    shape = [int(d) for d in reversed(tensor.shape)]  # stacked experts: [experts, out, in]
    groups = _EXACT_PRODUCT_READERS.get(tensor.tensor_type)
    if groups is not None:
        return groups(tensor).dequantize().reshape(shape)
    values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if not values.flags.writeable:  # an unquantized tensor is a view of the read-only file map
        values = np.array(values)
    return torch.from_numpy(values)


def _unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head `(2, d/2) -> (d/2, 2)` row reordering of q/k."""
    rest = weight.shape[1:]
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def gguf_quantized_weights(reader: gguf.GGUFReader,
                           arch: ArchConfig) -> Iterator[tuple[str, GroupQuantWeight]]:
    """The Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 / Q8_K matrices as codes
    with per-group scales, under HF names.

    Each format is exactly `(code - offset) * scale + zero` per group of 32 weights (16 for
    Q6_K): Q4_0 stores `d * (code - 8)`, Q4_1 `d * code + m`, Q8_0 `d * code` (signed codes),
    Q4_K and Q5_K `d * sc * code - dmin * mn`, with 6-bit sc and mn per group of 32 and fp16
    d and dmin per 256 (exact in float32: an 11-bit mantissa times a 6-bit integer), Q6_K
    `d * sc * (code - 32)` with int8 sc per 16 and fp16 d per 256 (11 + 7 + 5 bits, exact
    too), Q8_K `d * code` with float32 d per 256. Q5_K's 5-bit and Q6_K's 6-bit codes are
    kept as 8-bit ones (Q6_K's signed, code - 32). Stacked experts (`ffn_*_exps`) are read
    as one matrix of all their rows, then cut into one per expert.
    """
    for tensor in reader.tensors:
        if tensor.tensor_type not in _GROUP_READERS or tensor.name in _CONFIG_TENSORS:
            continue
        names = hf_names(tensor, arch.model_type)
        weight = _GROUP_READERS[tensor.tensor_type](tensor)
        rows = weight.codes.shape[0] // len(names)  # stacked experts: each one's rows
        for name, expert in names:
            # a copy, not a view: tensors sharing memory cannot be saved (prepared_weights.py)
            part = weight if expert is None else weight.map_rows(
                lambda t, start=expert * rows: t[start:start + rows].clone())
            yield name, _unpermuted_groups(name, part, arch)


def _unpermuted_groups(name: str, weight: GroupQuantWeight,
                       arch: ArchConfig) -> GroupQuantWeight:
    """q/k rows in HF's order (see _in_hf_layout)."""
    if arch.model_type not in _PERMUTED_ARCHITECTURES:
        return weight
    heads = (arch.num_attention_heads if ".q_proj." in name
             else arch.num_key_value_heads if ".k_proj." in name else 0)
    return weight.map_rows(lambda rows: _unpermute_rows(rows, heads)) if heads else weight


def _blocks(tensor: gguf.ReaderTensor, header: int, code_bytes: int) -> tuple[np.ndarray, int, int]:
    """The tensor's blocks (of 32 weights, 256 for K-quants) as rows of bytes, and its
    (rows, cols): stacked experts' rows one expert after the other."""
    cols = int(tensor.shape[0])
    rows = int(np.prod(tensor.shape[1:]))
    return np.asarray(tensor.data, dtype=np.uint8).reshape(-1, header + code_bytes), rows, cols


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _q4_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 32 weights: fp16 d (Q4_1: then fp16 m), then 16 bytes holding codes
    0..15 of the block in their low nibbles and codes 16..31 in their high nibbles."""
    with_min = tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1
    blocks, rows, cols = _blocks(tensor, 4 if with_min else 2, 16)
    scale = _fp16(blocks, 0)
    packed = blocks[:, -16:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1)
    zeros = (torch.from_numpy((_fp16(blocks, 2) + 8 * scale).reshape(rows, cols // 32))
             if with_min else None)
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(scale.reshape(rows, cols // 32)),
                            zeros=zeros, bits=4)


def _q8_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 32 weights: fp16 d, then 32 signed bytes."""
    blocks, rows, cols = _blocks(tensor, 2, 32)
    codes = blocks[:, 2:].copy().view(np.int8)
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(_fp16(blocks, 0).reshape(rows, cols // 32)),
                            zeros=None, bits=8)


def _q5_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 32 weights: fp16 d (Q5_1: then fp16 m), 4 bytes whose bit j is the fifth bit
    of code j, then Q4_0's 16 bytes of low nibbles. Q5_0 stores `d * (code - 16)`, kept as
    signed 8-bit codes; Q5_1 `d * code + m`, as 8-bit codes 0..31 with zeros m."""
    with_min = tensor.tensor_type == gguf.GGMLQuantizationType.Q5_1
    header = 4 if with_min else 2
    blocks, rows, cols = _blocks(tensor, header + 4, 16)
    scale = _fp16(blocks, 0)
    high = blocks[:, header:header + 4].copy().view("<u4")  # [blocks, 1]
    high_bits = (high >> np.arange(32, dtype=np.uint32)[None, :]) & 1
    packed = blocks[:, -16:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1) | (high_bits << 4)
    codes = codes.astype(np.int8) if with_min else (codes.astype(np.int16) - 16).astype(np.int8)
    zeros = torch.from_numpy(_fp16(blocks, 2).reshape(rows, cols // 32)) if with_min else None
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(scale.reshape(rows, cols // 32)),
                            zeros=zeros, bits=8)


def _k_scales_and_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A K-quant block's fp16 d and dmin, then 12 bytes holding 8 six-bit scales and 8
    six-bit mins (groups 0-3 in the low 6 bits of bytes 0-3 and 4-7; groups 4-7 with their
    low 4 bits in bytes 8-11 and their top 2 in the spare bits of bytes 0-7) -> each group's
    d * sc and dmin * mn, [blocks, 8]."""
    packed = blocks[:, 4:16]
    low, high, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([low & 63, (extra & 0x0F) | ((low >> 6) << 4)], axis=1)
    mn = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=1)
    return _fp16(blocks, 0) * sc, _fp16(blocks, 2) * mn


def _k_nibbles(packed: np.ndarray) -> np.ndarray:
    """128 bytes per block, each 32 holding a group pair, the first group in the low
    nibbles -> [blocks, 8 groups, 32]."""
    pairs = packed.reshape(-1, 4, 1, 32)
    return np.concatenate([pairs & 0x0F, pairs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 256 weights: scales and mins (_k_scales_and_mins), then 128 bytes of
    codes (_k_nibbles)."""
    blocks, rows, cols = _blocks(tensor, 16, 128)
    scale, minimum = _k_scales_and_mins(blocks)
    codes = _k_nibbles(blocks[:, 16:])
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(scale.reshape(rows, cols // 32)),
                            zeros=torch.from_numpy((8 * scale - minimum).reshape(rows, cols // 32)),
                            bits=4)


def _q5_k_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 256 weights: scales and mins (_k_scales_and_mins); 32 bytes whose bit g of
    byte i is the fifth bit of group g's code i; then the low 4 bits as Q4_K's codes."""
    blocks, rows, cols = _blocks(tensor, 48, 128)
    scale, minimum = _k_scales_and_mins(blocks)
    high_bits = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (_k_nibbles(blocks[:, 48:]) | (high_bits << 4)).astype(np.int8)
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(scale.reshape(rows, cols // 32)),
                            zeros=torch.from_numpy(-minimum.reshape(rows, cols // 32)), bits=8)


def _q6_k_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 256 weights: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales
    (one per 16 weights), fp16 d. Weights 0-127 and 128-255 are two halves alike: in each,
    byte l of its 64 low bytes holds weight l (l < 32) or 32 + l in its low nibble and 64 + l
    or 96 + l in its high one; byte l of its 32 high bytes, bits 2j..2j+1, weight 32j + l."""
    blocks, rows, cols = _blocks(tensor, 0, 210)
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = (low & 0x0F).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)
    codes = (codes.astype(np.int16) - 32).astype(np.int8)
    scales = _fp16(blocks, 208) * blocks[:, 192:208].copy().view(np.int8)
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(scales.reshape(rows, cols // 16)),
                            zeros=None, bits=8)


def _q8_k_groups(tensor: gguf.ReaderTensor) -> GroupQuantWeight:
    """Blocks of 256 weights: float32 d, 256 signed bytes, then 16 int16 sums of 16 codes
    each (for llama.cpp's dot products; not needed here)."""
    blocks, rows, cols = _blocks(tensor, 4, 288)
    scale = np.repeat(blocks[:, :4].copy().view(np.float32), 8, axis=1)
    codes = blocks[:, 4:260].copy().view(np.int8)
    return GroupQuantWeight(codes=torch.from_numpy(codes.reshape(rows, cols)),
                            scales=torch.from_numpy(scale.reshape(rows, cols // 32)),
                            zeros=None, bits=8)


_GROUP_READERS = {gguf.GGMLQuantizationType.Q4_0: _q4_groups,
                  gguf.GGMLQuantizationType.Q4_1: _q4_groups,
                  gguf.GGMLQuantizationType.Q4_K: _q4_k_groups,
                  gguf.GGMLQuantizationType.Q5_K: _q5_k_groups,
                  gguf.GGMLQuantizationType.Q5_0: _q5_groups,
                  gguf.GGMLQuantizationType.Q5_1: _q5_groups,
                  gguf.GGMLQuantizationType.Q6_K: _q6_k_groups,
                  gguf.GGMLQuantizationType.Q8_0: _q8_groups,
                  gguf.GGMLQuantizationType.Q8_K: _q8_k_groups}
# Types whose weights are each one product of a code and a scale, exact in float32: their
# groups dequantize to gguf's very values (_dequantized).
_EXACT_PRODUCT_READERS = {kind: _GROUP_READERS[kind] for kind in (
    gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q8_K)}

_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                gguf.GGMLQuantizationType.BF16)
# Read through gguf-py's reference dequantizer into float weights at load time.
_DEQUANTIZED_TYPES = (gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q3_K)
READABLE_TYPES = (*_FLOAT_TYPES, *_GROUP_READERS, *_DEQUANTIZED_TYPES)


def check_tensor_types(reader: gguf.GGUFReader) -> None:
    """Fail on the first tensor of a type pagellm does not read, naming it and the type."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in READABLE_TYPES:
            names = ", ".join(kind.name for kind in READABLE_TYPES)
            raise ValueError(f"tensor {tensor.name!r} has the GGUF type "
                             f"{tensor.tensor_type.name}, which pagellm does not read "
                             f"(it reads {names})")
