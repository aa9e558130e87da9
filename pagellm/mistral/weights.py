"""`consolidated*.safetensors`: Mistral's tensor names onto the HF names the model loads.

Mistral's checkpoints keep each head's q/k rows in the rotary layout of the original code,
where rows (2i, 2i+1) are rotated as a pair; HF's Llama/Mistral rotate row i with row
i + head_dim/2. transformers' conversion reorders the rows (its `permute`); the same
reordering is done here as the tensors are read, so the model and its numerics are those
of the converted HF folder.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagellm.model.arch import ArchConfig
from pagellm.model.errors import model_file_error, reading

_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attention.wq.weight": "self_attn.q_proj.weight",
          "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight",
          "attention.wo.weight": "self_attn.o_proj.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight",
          "attention_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight"}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# the vision encoder and its adapter to the language model (Pixtral, Mistral 3)
VISION_PREFIXES = ("vision_encoder.", "vision_language_adapter.", "patch_merger.",
                   "pre_mm_projector_norm.")


def hf_name(name: str) -> str | None:
    """The HF name of a Mistral tensor; None for one that no text model has."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _LAYER:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"


def to_half_split(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Interleaved rotary rows (Mistral's) -> half-split ones (HF's), per head."""
    rows, cols = weight.shape
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2)
            .reshape(rows, cols))


def to_interleaved(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of to_half_split: what Mistral's checkpoints store."""
    rows, cols = weight.shape
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2)
            .reshape(rows, cols))


def consolidated_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("consolidated*.safetensors"))
    if not files:
        raise model_file_error(folder, "no consolidated*.safetensors weights (Mistral's format)")
    return files


def mistral_weights(folder: Path, arch: ArchConfig, vision: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of the consolidated files, q/k rows in HF's rotary layout; a tensor
    no text model has fails naming its file. `vision`: params.json has a vision encoder,
    whose tensors are skipped (the language model is served alone)."""
    for file in consolidated_files(folder):
        with reading(file, "not a readable safetensors file"):
            handle = safe_open(file, framework="pt", device="cpu")
        for name in handle.keys():
            if vision and name.startswith(VISION_PREFIXES):
                continue
            target = hf_name(name)
            if target is None:
                raise model_file_error(file, f"unexpected tensor {name!r} for a Mistral "
                                             "text model")
            tensor = handle.get_tensor(name)
            if name.endswith("attention.wq.weight"):
                tensor = to_half_split(tensor, arch.num_attention_heads)
            elif name.endswith("attention.wk.weight"):
                tensor = to_half_split(tensor, arch.num_key_value_heads)
            yield target, tensor
