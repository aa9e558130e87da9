"""Engine configuration, split the way the request's path is split."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

_GIB = 1 << 30
_CPU_KV_ENV_VARS = ("PAGELLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")
DEFAULT_CPU_KV_CACHE_GIB = 4.0


@dataclass
class ModelConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    chat_template: str | None = None
    served_model_name: str | None = None


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True

    def cpu_kv_cache_bytes(self) -> int:
        """The CPU KV budget: explicit bytes, else the env var (GiB, like vLLM's CPU backend)."""
        if self.kv_cache_memory is not None:
            return int(self.kv_cache_memory)
        for name in _CPU_KV_ENV_VARS:
            value = os.environ.get(name)
            if value:
                return int(float(value) * _GIB)
        return int(DEFAULT_CPU_KV_CACHE_GIB * _GIB)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")


@dataclass
class DeviceConfig:
    device: torch.device = field(default_factory=lambda: torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"))
