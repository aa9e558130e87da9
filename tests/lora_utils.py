"""Random LoRA adapters saved by `peft` itself, and the peft + transformers reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# several ranks, rsLoRA, a regex target, rank and alpha patterns, "all-linear"
ADAPTER_CONFIGS: dict[str, dict[str, Any]] = {
    "every-projection": {"r": 8, "lora_alpha": 16, "target_modules": PROJECTIONS},
    "rslora-regex": {"r": 4, "lora_alpha": 8, "use_rslora": True,
                     "target_modules": r".*\.(q_proj|v_proj|down_proj)"},
    "patterns": {"r": 8, "lora_alpha": 8, "target_modules": "all-linear",
                 "rank_pattern": {"o_proj": 2, "layers.1.mlp.up_proj": 16},
                 "alpha_pattern": {"k_proj": 32}},
}


def save_peft_adapter(model_dir: Path, folder: Path, seed: int, **config: Any) -> Path:
    """A random (not zero-initialized) adapter on the model, saved by peft."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():  # deltas of the size of the weights', not larger
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.3)
    model.save_pretrained(folder)
    return folder


def edit_adapter_config(source: Path, folder: Path, **changes: Any) -> Path:
    """A copy of an adapter with some adapter_config.json fields changed."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    weights = source / "adapter_model.safetensors"
    (folder / weights.name).write_bytes(weights.read_bytes())
    return folder


@torch.no_grad()
def reference_logprobs(model_dir: Path, adapter: Path | None,
                       sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per (prompt, generated tokens): the float32 log-probabilities that peft + transformers
    (the base model with `adapter` None) give each generated position, `[len(generated),
    vocab]`, from one forward over the whole sequence. Greedy decoding generated exactly
    those tokens iff each is the argmax of its row."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    for prompt, generated in sequences:
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
        results.append(torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1))
    return results


@torch.no_grad()
def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of peft + transformers (float32), no end token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
