"""`params.json`, Mistral's own model config, as the HF `mistral` config it converts to.

The keys are translated to config.json's and read by arch_from_hf_config, so a native folder
gets exactly the architecture (sliding-window cap included) of its HF conversion.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagellm.model.arch import ArchConfig, arch_from_hf_config
from pagellm.model.errors import model_file_error, reading

# params.json key -> config.json key
_REQUIRED = {"dim": "hidden_size", "n_layers": "num_hidden_layers",
             "hidden_dim": "intermediate_size", "n_heads": "num_attention_heads",
             "norm_eps": "rms_norm_eps", "vocab_size": "vocab_size"}
_OPTIONAL = {"head_dim": "head_dim", "n_kv_heads": "num_key_value_heads",
             "rope_theta": "rope_theta", "sliding_window": "sliding_window",
             "tied_embeddings": "tie_word_embeddings"}
# keys of parts pagellm does not run; each one is refused by name
_UNSUPPORTED = {"moe": "mixture-of-experts layers", "vision_encoder": "a vision encoder",
                "quantization": "quantized weights", "yarn": "YaRN RoPE scaling",
                "llama_4_scaling": "Llama 4 attention scaling",
                "rope_scaling": "RoPE scaling", "lora": "LoRA weights",
                "audio_encoder": "an audio encoder"}
# vLLM's context length for a params.json that names none
DEFAULT_MAX_POSITIONS = 128_000


def read_params(folder: Path) -> ArchConfig:
    """The architecture of a native Mistral folder; a ModelLoadError naming params.json and
    the key for a missing or unsupported one."""
    file = folder / "params.json"
    with reading(file, "not a readable JSON file"):
        params = json.loads(file.read_text())
    if not isinstance(params, dict):
        raise model_file_error(file, "not a JSON object")
    for key, what in _UNSUPPORTED.items():
        if params.get(key):
            raise model_file_error(file, f"the key {key!r} ({what}) is not supported")
    with reading(file, "not a usable Mistral params.json"):
        return arch_from_hf_config(hf_config(params))


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
    return config
