"""The engine's LoRA settings, with vLLM's names, limits and defaults."""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's allowed --max-lora-rank values
POSSIBLE_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    max_loras: int = 1  # distinct adapters in one step (slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # loaded adapters kept in host memory; None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank not in POSSIBLE_MAX_RANKS:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of "
                             f"{POSSIBLE_MAX_RANKS}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}).")
