"""`params.json`, Mistral's own model config, as the HF config it converts to: `mistral`, or
`ministral3` where a `yarn` block extends the context.

The keys are translated to config.json's and read by arch_from_hf_config, so a native folder
gets exactly the architecture (sliding-window cap included) of its HF conversion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagellm.logger import init_logger
from pagellm.mistral.formats import PARAMS_FILE
from pagellm.model.arch import ArchConfig, arch_from_hf_config
from pagellm.model.errors import model_file_error, reading

logger = init_logger(__name__)

# params.json key -> config.json key
_REQUIRED = {"dim": "hidden_size", "n_layers": "num_hidden_layers",
             "hidden_dim": "intermediate_size", "n_heads": "num_attention_heads",
             "norm_eps": "rms_norm_eps", "vocab_size": "vocab_size"}
_OPTIONAL = {"head_dim": "head_dim", "n_kv_heads": "num_key_value_heads",
             "rope_theta": "rope_theta", "sliding_window": "sliding_window",
             "tied_embeddings": "tie_word_embeddings"}
# keys of parts pagellm does not run; each one is refused by name
_UNSUPPORTED = {"moe": "mixture-of-experts layers", "quantization": "quantized weights",
                "rope_scaling": "RoPE scaling", "lora": "LoRA weights",
                "audio_encoder": "an audio encoder"}
# params.json `yarn` key -> the HF YaRN key
_YARN = {"factor": "factor", "original_max_position_embeddings":
         "original_max_position_embeddings", "beta": "beta_fast", "alpha": "beta_slow"}
VISION_KEY = "vision_encoder"
# vLLM's context length for a params.json that names none
DEFAULT_MAX_POSITIONS = 128_000


def read_params(folder: Path) -> ArchConfig:
    """The architecture of a native Mistral folder; a ModelLoadError naming params.json and
    the key for a missing or unsupported one."""
    file = folder / PARAMS_FILE
    with reading(file, "not a readable JSON file"):
        params = json.loads(file.read_text())
    if not isinstance(params, dict):
        raise model_file_error(file, "not a JSON object")
    for key, what in _UNSUPPORTED.items():
        if params.get(key):
            raise model_file_error(file, f"the key {key!r} ({what}) is not supported")
    if params.get(VISION_KEY):
        logger.info("%s has a vision encoder: serving its language model only; requests "
                    "with images are not supported.", file)
    with reading(file, "not a usable Mistral params.json"):
        return arch_from_hf_config(hf_config(params))


def has_vision_encoder(folder: Path) -> bool:
    """Whether the folder's params.json (read by read_params first) names a vision encoder."""
    file = folder / PARAMS_FILE
    return file.is_file() and bool(json.loads(file.read_text()).get(VISION_KEY))


def hf_config(params: dict[str, Any]) -> dict[str, Any]:
    """The config.json that transformers' Mistral conversion writes for these params."""
    config: dict[str, Any] = {"model_type": "mistral"}
    config.update({hf: params[key] for key, hf in _REQUIRED.items()})
    config.update({hf: params[key] for key, hf in _OPTIONAL.items()
                   if params.get(key) is not None})
    window = config.get("sliding_window")
    if isinstance(window, list):  # per-layer windows: one value for every layer only
        if len(set(window)) != 1:
            raise ValueError(f"per-layer sliding_window {window} is not supported")
        config["sliding_window"] = window[0]
    config["max_position_embeddings"] = int(params.get("max_position_embeddings")
                                            or params.get("max_seq_len")
                                            or DEFAULT_MAX_POSITIONS)
    if params.get("yarn"):
        config["model_type"] = "ministral3"
        config["rope_parameters"] = yarn_rope(params)
    elif params.get("llama_4_scaling"):
        raise ValueError("llama_4_scaling without yarn is not supported")
    return config


def yarn_rope(params: dict[str, Any]) -> dict[str, Any]:
    """The `yarn` block (and `llama_4_scaling`) as Ministral 3's HF `rope_parameters`, the
    way transformers' conversion writes them: `apply_scale` true is YaRN's own attention
    factor, false none (mscale and mscale_all_dim both 1)."""
    yarn = dict(params["yarn"])
    if "apply_scale" not in yarn:
        raise ValueError("the yarn block does not say apply_scale")
    scale = 0.0 if yarn.pop("apply_scale") else 1.0
    rope = {"rope_type": "yarn", "rope_theta": params.get("rope_theta", 10000.0),
            "mscale": scale, "mscale_all_dim": scale}
    rope.update({hf: yarn.pop(key) for key, hf in _YARN.items() if key in yarn})
    if yarn:
        raise ValueError(f"yarn keys {sorted(yarn)} are not supported")
    llama_4 = dict(params.get("llama_4_scaling") or {})
    if llama_4:
        if llama_4.pop("original_max_position_embeddings", None) != rope.get(
                "original_max_position_embeddings"):
            raise ValueError("llama_4_scaling and yarn name different "
                             "original_max_position_embeddings")
        rope["llama_4_scaling_beta"] = llama_4.pop("beta")
        if llama_4:
            raise ValueError(f"llama_4_scaling keys {sorted(llama_4)} are not supported")
    return rope
