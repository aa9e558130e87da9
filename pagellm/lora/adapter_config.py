"""A PEFT adapter's files and `adapter_config.json`, checked without torch: the engine core
checks them again when it loads the weights (peft.py), and `pagellm serve` checks each
`--lora-modules` adapter with these before it starts the engine, so that an adapter it
cannot serve stops the start in a second, not after the model loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json fields that change what an adapter computes, none implemented here.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save",
    "lora_bias": "lora_bias", "fan_in_fan_out": "fan_in_fan_out",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters", "layer_replication": "layer_replication",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)", "use_qalora": "QALoRA",
    "use_bdlora": "BD-LoRA (use_bdlora)", "megatron_config": "megatron_config",
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message says why (a 400 over HTTP)."""


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """The adapter's config file and weights file; an error if either is missing."""
    folder = Path(path).expanduser()
    config_file = folder / CONFIG_FILE
    weights = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
    if not config_file.is_file() or weights is None:
        raise LoRAAdapterError(f"No adapter found for {path}: a LoRA adapter is a folder with "
                               f"{CONFIG_FILE} and {' or '.join(WEIGHT_FILES)}.")
    return config_file, weights


def parse_config(path: str | Path, config_bytes: bytes) -> dict[str, Any]:
    try:
        config = json.loads(config_bytes)
    except ValueError as error:  # any unreadable file is the adapter's fault
        raise LoRAAdapterError(f"LoRA adapter {path} does not load: {error}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{Path(path).expanduser() / CONFIG_FILE} is not a JSON object.")
    return config


def check_adapter_config(path: str | Path) -> None:
    """The folder holds an adapter whose config this server supports (its weights' shapes
    and targets are checked against the model when the engine loads it)."""
    config_file, _ = adapter_files(path)
    check_config(parse_config(path, config_file.read_bytes()))


def check_config(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"peft_type {peft_type!r} is not supported; only LORA.")
    for name, what in _UNSUPPORTED_FIELDS.items():
        if config.get(name):
            raise LoRAAdapterError(f"{what} is not supported (adapter_config.json sets "
                                   f"{name}={config[name]!r}).")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"bias={config['bias']!r} is not supported; only 'none'.")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoRAAdapterError(f"adapter_config.json needs a positive integer r, got "
                               f"{config.get('r')!r}.")
    if not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise LoRAAdapterError("adapter_config.json's lora_alpha must be a number.")
    if not isinstance(config.get("target_modules"), (str, list)):
        raise LoRAAdapterError("adapter_config.json needs target_modules (a list of module "
                               "names or a regular expression).")
