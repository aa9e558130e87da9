"""Ministral 3 (`ministral3`): YaRN RoPE scaling and the query scale by position, against
transformers on tiny random weights whose prompts cross the original context several times;
the same weights in Mistral's native layout (with a vision encoder) and inside an HF
`mistral3` vision-language folder load the same language model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tiny_mistral import (MINISTRAL3_ROPE, TEKKEN_VOCAB, build_tiny_hf_ministral3,
                          write_hf_mistral3, write_native_ministral3)
from transformers import AutoModelForCausalLM

from pagellm.entrypoints.llm import LLM
from pagellm.mistral.formats import ModelFormats
from pagellm.model.arch import arch_from_hf_config
from pagellm.model.loader import load_model
from pagellm.sampling_params import SamplingParams
from test_models import PagedCache, greedy_decode, reference_greedy, reference_last_logits

CPU = torch.device("cpu")
HF_MISTRAL_TOKENIZER = ModelFormats(tokenizer_mode="mistral")
STEPS = 12


def prompts(count: int = 3, seed: int = 0) -> list[list[int]]:
    """Token ids of 20 to 90 tokens: past 16, 32, 48 and 64 positions, where the query
    scale steps up."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(100, TEKKEN_VOCAB) for _ in range(rng.randrange(20, 90))]
            for _ in range(count)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ministral3")
    hf = build_tiny_hf_ministral3(root / "hf")
    return {"hf": hf, "native": write_native_ministral3(hf, root / "native"),
            "mistral3": write_hf_mistral3(hf, root / "mistral3")}


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folders["hf"], dtype=torch.float32).eval()


def test_yarn_and_query_scale_change_the_reference(folders: dict[str, Path],
                                                   reference: torch.nn.Module,
                                                   tmp_path: Path) -> None:
    """The comparisons below can fail: without YaRN, or without the query scale, the same
    weights give other logits (so a model ignoring either differs from transformers)."""
    ids = prompts(1)[0]
    expected = reference_last_logits(reference, ids)
    for rope in ({**MINISTRAL3_ROPE, "factor": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                 {**MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.0}):
        other = build_tiny_hf_ministral3(tmp_path / str(len(list(tmp_path.iterdir()))),
                                         rope=rope)
        plain = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
        assert (reference_last_logits(plain, ids) - expected).abs().max() > 1e-2


def test_arch_reads_yarn_and_llama_4_scaling(folders: dict[str, Path]) -> None:
    arch = arch_from_hf_config(json.loads((folders["hf"] / "config.json").read_text()))
    assert arch.model_type == "ministral3"
    assert arch.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 16, "beta_fast": 8.0,
                                 "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}
    assert (arch.llama_4_scaling_beta, arch.llama_4_scaling_positions) == (0.5, 16)


def test_batched_prefill_and_decode_match_transformers(folders: dict[str, Path],
                                                       reference: torch.nn.Module) -> None:
    loaded = load_model(str(folders["hf"]), torch.float32, CPU, formats=HF_MISTRAL_TOKENIZER)
    batch = prompts()
    cache = PagedCache(loaded.arch, num_blocks=128, block_size=4)
    logits = cache.step(loaded.model, list(enumerate(batch)))
    for row, ids in zip(logits, batch):
        torch.testing.assert_close(row, reference_last_logits(reference, ids), atol=1e-4,
                                   rtol=1e-4)
    for ours, ids in zip(greedy_decode(cache, loaded.model, logits, STEPS), batch):
        expected = reference_greedy(reference, ids, STEPS)
        assert ours[:len(expected)] == expected


def test_prefill_in_chunks_beside_a_decode(folders: dict[str, Path],
                                           reference: torch.nn.Module) -> None:
    """Chunks that start past the original context scale their queries by their own
    positions, not the chunk's."""
    loaded = load_model(str(folders["hf"]), torch.float32, CPU, formats=HF_MISTRAL_TOKENIZER)
    long, short = prompts(2, seed=1)
    long = (long * 3)[:100]
    cache = PagedCache(loaded.arch)
    first = cache.step(loaded.model, [(0, long[:37]), (1, short)])
    token = int(first[1].argmax())
    second = cache.step(loaded.model, [(0, long[37:70]), (1, [token])])
    third = cache.step(loaded.model, [(0, long[70:])])
    for ours, ids in ((first[0], long[:37]), (second[0], long[:70]), (third[0], long),
                      (second[1], short + [token])):
        torch.testing.assert_close(ours, reference_last_logits(reference, ids), atol=1e-4,
                                   rtol=1e-4)


def test_engine_chunked_prefill_gives_transformers_tokens(folders: dict[str, Path],
                                                          reference: torch.nn.Module) -> None:
    llm = LLM(str(folders["hf"]), dtype="float32", tokenizer_mode="mistral", max_model_len=128,
              max_num_batched_tokens=8, kv_cache_memory=8 << 20)
    batch = prompts(seed=2)
    outputs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=STEPS),
                           use_tqdm=False)
    for output, ids in zip(outputs, batch):
        expected = reference_greedy(reference, ids, STEPS)
        assert list(output.outputs[0].token_ids)[:len(expected)] == expected


@pytest.mark.parametrize("name", ["native", "mistral3"])
def test_other_layouts_load_the_same_language_model(folders: dict[str, Path],
                                                    name: str) -> None:
    """params.json's yarn/llama_4_scaling/vision_encoder and consolidated vision tensors, or
    the HF vision-language folder: the text model's logits, identical to the HF folder's."""
    hf = load_model(str(folders["hf"]), torch.float32, CPU, formats=HF_MISTRAL_TOKENIZER)
    other = load_model(str(folders[name]), torch.float32, CPU, formats=HF_MISTRAL_TOKENIZER)
    assert other.arch.rope_scaling == hf.arch.rope_scaling
    assert (other.arch.llama_4_scaling_beta, other.arch.llama_4_scaling_positions) == (0.5, 16)
    batch = prompts(seed=3)
    logits = [PagedCache(loaded.arch).step(loaded.model, list(enumerate(batch)))
              for loaded in (hf, other)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=0)
