"""What a request names to be served by an adapter, spelled as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT folder.

    `base_model_name` is what `/v1/models` reports as the adapter's `parent`.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
