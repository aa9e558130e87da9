"""GGUF Q4 matrices kept in 4 bits for small steps: the same weights as the dequantized model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from test_models import PagedCache, greedy_decode
from tiny_models import write_tiny_gguf

from pagellm.model.arch import ArchConfig, arch_from_gguf
from pagellm.model.gguf_weights import gguf_int4_weights, gguf_weights
from pagellm.model.int4 import Linear
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import load_model

CPU = torch.device("cpu")
Q4_0, Q4_1 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("quantization", [Q4_0, Q4_1], ids=["Q4_0", "Q4_1"])
def test_int4_groups_are_the_dequantized_weights(tiny_model_factory: Callable[[str], Path],
                                                 tmp_path: Path,
                                                 quantization: gguf.GGMLQuantizationType) -> None:
    path = write_tiny_gguf(tiny_model_factory("llama"), tmp_path / "tiny.gguf", quantization)
    reader = gguf.GGUFReader(path)
    arch = arch_from_gguf(reader)
    dense = dict(gguf_weights(reader, arch))
    packed = dict(gguf_int4_weights(reader, arch))
    projections = sorted(name for name in dense if name.split(".")[-2] in PROJECTIONS)
    assert len(projections) == len(PROJECTIONS) * arch.num_hidden_layers
    assert sorted(packed) == projections
    for name, weight in packed.items():  # q/k rows unpermuted like the dense ones
        assert weight.codes.dtype == torch.uint8 and int(weight.codes.max()) <= 15
        torch.testing.assert_close(weight.dequantize(), dense[name], atol=1e-6, rtol=0)


def count_int4_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    kernel = torch._weight_int4pack_mm_for_cpu

    def counting(*args: object) -> torch.Tensor:
        calls[0] += 1
        return kernel(*args)

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", counting)
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_small_steps_run_in_4_bits_with_the_same_results(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path, model_type: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_model_factory(model_type)
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1))
    dense = load_model(path, torch.float32, CPU, tokenizer=str(folder))
    small = load_model(path, torch.float32, CPU, tokenizer=str(folder), gguf_int4_max_tokens=2)
    layers = [m for m in small.model.modules() if isinstance(m, Linear) and m.int4_max_tokens]
    assert len(layers) == 4 * small.arch.num_hidden_layers  # qkv, o, gate_up, down
    calls = count_int4_calls(monkeypatch)
    prompts = [list(range(3, 30)), list(range(50, 58))]
    results = {}
    for label, loaded in (("dense", dense), ("int4", small)):
        cache = PagedCache(loaded.arch)
        prefill = cache.step(loaded.model, list(enumerate(prompts)))
        assert calls[0] == 0  # 35 tokens: the dense weights
        decode = cache.step(loaded.model, [(0, [7]), (1, [9])])
        results[label] = (prefill, decode, greedy_decode(cache, loaded.model, decode, 16))
    assert calls[0] > 0  # two-token steps of the int4 model
    torch.testing.assert_close(results["int4"][1], results["dense"][1], atol=1e-4, rtol=1e-4)
    assert results["int4"][2] == results["dense"][2]


def teacher_forced_logits(model: LlamaForCausalLM, arch: ArchConfig, dtype: torch.dtype,
                          prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """Logits of each step when both requests are fed the given continuations, 2 tokens a step."""
    cache = PagedCache(arch, dtype, num_blocks=64, block_size=16)
    steps = [cache.step(model, list(enumerate(prompts)))]
    for i in range(len(continuations[0])):
        steps.append(cache.step(model, [(r, [c[i]]) for r, c in enumerate(continuations)]))
    return torch.stack(steps[1:])


def test_smollm2_int4_decode_is_as_close_to_float32_as_bf16(smollm2_gguf: Path) -> None:
    """In bf16, the 4-bit path's decode logits stay about as close to the float32 dequantized
    model as the bf16 dequantized ones: its only extra error is the bf16 rounding of the
    per-group scales and zeros (measured 1.1-1.6x the bf16 error; a wrong code or scale
    layout gives errors many times larger)."""
    reference = load_model(None, torch.float32, CPU)
    arch = reference.arch
    prompts = [reference.tokenizer.encode(text) for text in
               ("The capital of France is", "Once upon a time, in a small village,")]
    cache = PagedCache(arch, num_blocks=64, block_size=16)
    continuations = greedy_decode(cache, reference.model,
                                  cache.step(reference.model, list(enumerate(prompts))), 12)
    expected = teacher_forced_logits(reference.model, arch, torch.float32, prompts, continuations)
    dense = copy.deepcopy(reference.model).to(torch.bfloat16)
    small = copy.deepcopy(dense)
    attached = small.attach_int4_weights(gguf_int4_weights(gguf.GGUFReader(smollm2_gguf), arch), 16)
    assert len(attached) == 4 * arch.num_hidden_layers
    errors = {}
    for label, model in (("dense", dense), ("int4", small)):
        logits = teacher_forced_logits(model, arch, torch.bfloat16, prompts, continuations)
        errors[label] = (logits - expected).abs().mean().item()
        assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert errors["int4"] <= 2 * errors["dense"]
