"""LoRA adapters saved by peft: pagellm's greedy tokens and logprobs against peft +
transformers in float32, for every tiny model type, several adapters and the base model in
one batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lora_utils import ADAPTER_CONFIGS, reference_logprobs, save_peft_adapter

from pagellm import LLM, SamplingParams
from pagellm.lora.request import LoRARequest

STEPS = 12
NUM_LOGPROBS = 5


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(f"adapters-{tiny_model_dir.name}")
    return {name: save_peft_adapter(tiny_model_dir, root / name, seed, **config)
            for seed, (name, config) in enumerate(ADAPTER_CONFIGS.items())}


def test_adapters_and_base_in_one_batch_match_peft(tiny_model_dir: Path,
                                                   adapters: dict[str, Path]) -> None:
    names = [None, *adapters]
    requests = {name: LoRARequest(name, index, str(adapters[name]))
                for index, name in enumerate(adapters, 1)}
    batch = prompts(2 * len(names))
    chosen = [names[i % len(names)] for i in range(len(batch))]  # interleaved
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True,
                            logprobs=NUM_LOGPROBS)
    outputs = llm.generate(batch, params, use_tqdm=False,
                           lora_request=[requests.get(name) for name in chosen])
    for name in names:
        indices = [i for i, c in enumerate(chosen) if c == name]
        generated = [outputs[i].outputs[0] for i in indices]
        sequences = [(batch[i], c.token_ids) for i, c in zip(indices, generated)]
        reference = reference_logprobs(tiny_model_dir, adapters.get(name), sequences)
        for index, completion, logprobs in zip(indices, generated, reference):
            assert completion.token_ids == logprobs.argmax(-1).tolist(), (name, index)
            for step, entries in enumerate(completion.logprobs):
                for token_id, entry in entries.items():
                    assert entry.logprob == pytest.approx(float(logprobs[step][token_id]),
                                                          abs=2e-4), (name, index, step)


def test_adapters_change_the_output(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The check above is not vacuous: each adapter moves the greedy choices off the base's."""
    sequences = [(prompt, prompt[::-1] * 2) for prompt in prompts(3)]
    base = torch.cat(reference_logprobs(tiny_llama_dir, None, sequences))
    for seed, (name, config) in enumerate(ADAPTER_CONFIGS.items()):
        adapter = save_peft_adapter(tiny_llama_dir, tmp_path / name, seed, **config)
        adapted = torch.cat(reference_logprobs(tiny_llama_dir, adapter, sequences))
        changed = (adapted.argmax(-1) != base.argmax(-1)).float().mean()
        assert changed > 0.2, (name, float(changed))
