"""Architecture description shared by the supported decoder families.

Llama, Mistral, Qwen2 and Qwen3 differ only in a few switches (q/k/v bias,
per-head q/k norm, RoPE scaling), so one `ArchConfig` read from either an HF
`config.json` or GGUF metadata drives a single model class. Gemma 3 adds its
sliding-window layers and its own scales (read in gemma3.py, modelled there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagellm.logger import init_logger

if TYPE_CHECKING:  # gguf is imported where a file is read (loader.py says why)
    import gguf

logger = init_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral",
                         "qwen2_moe", "qwen3_moe", "ministral3")
# GGUF `general.architecture` names that differ from the HF model type (llama.cpp writes
# Mixtral as `llama` with experts: see gguf_model_type)
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn")
# the keys each RoPE type reads (layers.py); another key is refused rather than ignored
_ROPE_KEYS = {"linear": {"factor"}, "freq_factors": {"factors"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"},
              "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "attention_factor", "truncate"}}


@dataclass
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    o_proj_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    # Gemma 3: keys a sliding-window layer sees, each layer's "sliding_attention" or
    # "full_attention", the RoPE base of the sliding layers, the attention scale's
    # denominator and the tanh cap of the logits (None: not used)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (moe.py): experts per MoE layer (0: a dense model), experts each
    # token runs, their hidden size, whether the chosen experts' weights are renormalized to
    # sum to 1, the layers that keep a dense MLP, and the hidden size of the shared expert
    # every token also runs (0: none)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    dense_layers: list[int] | None = None
    shared_expert_intermediate_size: int = 0
    # Ministral 3: queries scaled by 1 + beta * log(1 + floor(position / positions)), with
    # `positions` YaRN's original_max_position_embeddings (0.0: no scaling)
    llama_4_scaling_beta: float = 0.0
    llama_4_scaling_positions: int = 0

    def __post_init__(self) -> None:
        check_model_type(self.model_type)
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"Unsupported RoPE scaling {rope_type!r}; supported RoPE types are: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
        unknown = set(self.rope_scaling or {}) - {"rope_type"} - _ROPE_KEYS.get(rope_type, set())
        if unknown:
            raise ValueError(f"RoPE scaling {rope_type!r} with {', '.join(sorted(unknown))} is "
                             "not supported.")
        missing = {"yarn": {"factor", "original_max_position_embeddings"}}.get(
            rope_type, set()) - set(self.rope_scaling or {})
        if missing:
            raise ValueError(f"RoPE scaling {rope_type!r} needs {', '.join(sorted(missing))}.")
        if self.llama_4_scaling_beta and self.llama_4_scaling_positions <= 0:
            raise ValueError("llama_4_scaling_beta needs the RoPE scaling's "
                             "original_max_position_embeddings.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads}).")


def check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"Unsupported model_type {model_type!r}; supported model types are: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}.")


def arch_from_hf_config(config: dict[str, Any]) -> ArchConfig:
    """Read a `config.json` dict (transformers 4 or 5 layout)."""
    from pagellm.model.vision_language import is_vision_language, text_config
    if is_vision_language(config):
        return arch_from_hf_config(text_config(config))
    model_type = config.get("model_type")
    check_model_type(model_type)
    if model_type == "gemma3_text":
        from pagellm.model.gemma3 import gemma3_arch_from_hf_config
        return gemma3_arch_from_hf_config(config)
    if model_type in MOE_MODEL_TYPES:
        from pagellm.model.moe import moe_arch_from_hf_config
        return moe_arch_from_hf_config(config)
    if config.get("mlp_bias"):
        raise ValueError("Models with mlp_bias=True are not supported.")
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = hf_rope(config)
    beta = (rope_scaling or {}).pop("llama_4_scaling_beta", None)
    if beta is not None and model_type != "ministral3":
        raise ValueError(f"llama_4_scaling_beta is only read for ministral3, not {model_type}.")
    bias = bool(config.get("attention_bias", False))
    return ArchConfig(
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_hf_max_positions(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=True if model_type == "qwen2" else bias,
        o_proj_bias=bias and model_type in ("llama", "qwen3"),
        qk_norm=model_type == "qwen3",
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        llama_4_scaling_beta=float(beta or 0.0),
        llama_4_scaling_positions=int((rope_scaling or {}).get(
            "original_max_position_embeddings", 0)) if beta else 0,
    )


def hf_rope(config: dict[str, Any], layer_type: str | None = None
             ) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 nests RoPE in `rope_parameters` (per layer type where layers differ, as
    Gemma 3's); 4 used `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    params.pop("max_position_embeddings", None)  # Ministral 3 repeats the model's here
    if rope_type == "default" and "llama_4_scaling_beta" not in params:
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _hf_max_positions(config: dict[str, Any]) -> int:
    """Cap the context at the sliding window: attention is then exact without a window mask."""
    max_positions = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window",
                             config["model_type"] in ("mistral", "ministral3"))
    if window and uses_window and window < max_positions:
        logger.warning("Sliding-window attention is not implemented; limiting the context to the "
                       "window of %d tokens.", window)
        return int(window)
    return max_positions


def arch_from_gguf(reader: gguf.GGUFReader) -> ArchConfig:
    """Read llama.cpp metadata (`{arch}.block_count`, ...) into an `ArchConfig`."""
    arch = gguf_field(reader, "general.architecture")
    model_type = gguf_model_type(reader, arch)
    check_model_type(model_type)
    if arch == "gemma3":
        from pagellm.model.gemma3 import gemma3_arch_from_gguf
        return gemma3_arch_from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    config = ArchConfig(
        model_type=model_type,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(gguf_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(reader, arch, tensors.get("rope_freqs.weight")),
        max_position_embeddings=int(gguf_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        o_proj_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=_optional_int(gguf_field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_id=_optional_int(gguf_field(reader, "tokenizer.ggml.eos_token_id", None)),
    )
    if model_type in MOE_MODEL_TYPES:
        from pagellm.model.moe import moe_arch_from_gguf
        return moe_arch_from_gguf(reader, arch, config)
    return config


def gguf_model_type(reader: gguf.GGUFReader, arch: str) -> str:
    """The HF model type of a GGUF `general.architecture`: `llama` with experts is Mixtral."""
    if arch == "llama" and int(gguf_field(reader, "llama.expert_count", 0)) > 0:
        return "mixtral"
    return _GGUF_MODEL_TYPES.get(arch, arch)


def gguf_rope_scaling(reader: gguf.GGUFReader, arch: str,
                       freqs: gguf.ReaderTensor | None) -> dict[str, Any] | None:
    """llama.cpp bakes Llama 3 scaling into a `rope_freqs` tensor of per-frequency divisors."""
    if freqs is not None:
        from gguf.quants import dequantize

        factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64).reshape(-1)
        return {"rope_type": "freq_factors", "factors": factors.tolist()}
    if gguf_field(reader, f"{arch}.rope.scaling.type", "none") != "linear":
        return None
    factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor"))
    return {"rope_type": "linear", "factor": factor}


_MISSING = object()


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}.")
        return default
    return field.contents()


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
