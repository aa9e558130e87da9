"""Engine configuration, split the way the request's path is split."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.mistral.formats import ModelFormats

_GIB = 1 << 30
_CPU_KV_ENV_VARS = ("PAGELLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")
DEFAULT_CPU_KV_CACHE_GIB = 4.0
PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclass
class ModelConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    chat_template: str | None = None
    served_model_name: str | None = None
    # steps up to this size multiply a GGUF's quantized matrices as stored; None: measured
    gguf_quantized_max_tokens: int | None = None
    # multiply the codes with activations rounded to int8 (as llama.cpp does); never under an
    # explicit float32, which means the exact dequantized model
    gguf_int8_activations: bool = True
    # a request's logits do not depend on the rest of its step (GGUF models on CPU)
    batch_invariant: bool = True
    # vLLM's --tokenizer-mode, --config-format and --load-format (pagellm.mistral.formats)
    tokenizer_mode: str = "auto"
    config_format: str = "auto"
    load_format: str = "auto"

    def formats(self) -> "ModelFormats":
        from pagellm.mistral.formats import ModelFormats

        return ModelFormats(self.tokenizer_mode, self.config_format, self.load_format)

    def int8_activations(self) -> bool:
        return self.gguf_int8_activations and self.dtype not in ("float32", "float")

    def is_gguf(self) -> bool:
        from pagellm.model.paths import resolve_model_path

        return resolve_model_path(self.model).suffix == ".gguf"


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"  # the KV cache's dtype; auto: the model's
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    offload_bytes: int = 0  # the second KV tier; 0: none
    offload_path: str | None = None  # a file to memory-map for it instead of RAM
    disable_hybrid_kv_cache_manager: bool = False  # sliding-window layers keep every block

    def cpu_kv_cache_bytes(self) -> int:
        """The CPU KV budget: explicit bytes, else the env var (GiB, like vLLM's CPU backend)."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        for name in _CPU_KV_ENV_VARS:
            value = os.environ.get(name)
            if value:
                return int(float(value) * _GIB)
        return int(DEFAULT_CPU_KV_CACHE_GIB * _GIB)

    def gpu_kv_cache_bytes(self, total: int, weights: int, activation_peak: int,
                           free: int) -> int:
        """The GPU KV budget: explicit bytes, else vLLM's share of the device
        (`gpu_memory_utilization` of `total`, less the weights and the activation peak); never
        more than that share of what is `free` now, less the activation peak, so that a
        second engine on the same GPU gets what the first left, with the same headroom,
        instead of failing to allocate it."""
        return min(self.wanted_gpu_kv_cache_bytes(total, weights, activation_peak),
                   int(free * self.gpu_memory_utilization) - activation_peak)

    def wanted_gpu_kv_cache_bytes(self, total: int, weights: int, activation_peak: int) -> int:
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        return int(total * self.gpu_memory_utilization) - weights - activation_peak


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    preemption_mode: str = "auto"
    max_loras: int = 0  # distinct LoRA adapters among the running requests; 0: LoRA is off

    def validate(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")


def parse_json_object(text: str, name: str) -> dict:
    """A flag's JSON object, or a ValueError naming the flag."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not valid JSON: {error}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object.")
    return value


def parse_kv_transfer_config(text: str, block_size: int) -> int:
    """The second-tier bytes of vLLM's `--kv-transfer-config` JSON; only the OffloadingConnector
    (KV offloading to CPU memory) exists here. Its `block_size` must be a multiple of the
    engine's; see `pagellm.core.offload` for how it is honoured."""
    config = parse_json_object(text, "kv_transfer_config")
    connector = config.get("kv_connector")
    if connector != "OffloadingConnector":
        raise ValueError(f"kv_connector {connector!r} is not supported; pagellm has only "
                         "'OffloadingConnector' (KV offloading to CPU memory).")
    extra = config.get("kv_connector_extra_config") or {}
    offload_block_size = int(extra.get("block_size", block_size))
    if offload_block_size < 1 or offload_block_size % block_size:
        raise ValueError(f"the OffloadingConnector block_size ({offload_block_size}) must be a "
                         f"multiple of the KV cache block_size ({block_size}).")
    if "cpu_bytes_to_use" not in extra:
        raise ValueError("the OffloadingConnector needs kv_connector_extra_config.cpu_bytes_to_use "
                         "(bytes of CPU memory for offloaded KV blocks).")
    return int(extra["cpu_bytes_to_use"])

