"""Mixtral and Qwen3-MoE GGUF files (llama.cpp's stacked `ffn_*_exps` experts) against
Hugging Face transformers, with the experts' quantized matrices kept as stored.

Qwen3-MoE's reference is transformers' own GGUF loader on the same file. transformers does
not read a Mixtral GGUF (a `llama` with experts), so Mixtral's reference is transformers on
the HF weights that the file was written from, each quantized matrix replaced by gguf-py's
quantization and dequantization of it (blocks run along the rows' inputs, so llama.cpp's
reordering of q/k rows and the stacking of experts change no value).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from gguf.quants import dequantize, quantize
from test_models import PROMPTS, PagedCache, assert_matches_reference, transformers_gguf_model
from tiny_models import write_tiny_gguf
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig

from pagellm.kernels import cpu_kernels_available
from pagellm.model.arch import ArchConfig, arch_from_gguf
from pagellm.model.gguf_weights import gguf_quantized_weights, gguf_weights
from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.moe import SparseMoE
from pagellm.model.quantized import Linear

CPU = torch.device("cpu")
Q4_0, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
# (tiny model, quantization of every layer matrix but the routers)
CASES = [("mixtral", Q4_0), ("qwen3_moe_gguf", Q8_0)]
STEPS = 16


@pytest.fixture(scope="module", params=CASES, ids=["mixtral-Q4_0", "qwen3moe-Q8_0"])
def moe_gguf(request: pytest.FixtureRequest, tiny_model_factory: Callable[[str], Path],
             tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, Path, gguf.GGMLQuantizationType]:
    """-> (the HF folder, the GGUF written from it, the quantization)."""
    model, kind = request.param
    folder = tiny_model_factory(model)
    path = write_tiny_gguf(folder, tmp_path_factory.mktemp("moe-gguf") / f"{model}.gguf", kind)
    return folder, path, kind


def quantization_round_trip(ref: PreTrainedModel, kind: gguf.GGMLQuantizationType) -> None:
    """Each layer matrix the GGUF writer quantizes (all but the routers) as gguf-py
    dequantizes its quantization."""
    with torch.no_grad():
        for name, param in ref.model.layers.named_parameters():
            if param.dim() >= 2 and not name.endswith(".mlp.gate.weight"):
                stored = quantize(param.numpy(), kind)
                param.copy_(torch.from_numpy(dequantize(stored, kind)))


def reference_model(folder: Path, path: Path, kind: gguf.GGMLQuantizationType,
                    arch: ArchConfig) -> PreTrainedModel:
    if arch.model_type == "mixtral":
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        quantization_round_trip(ref, kind)
        return ref
    config = Qwen3MoeConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size, num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps, rope_theta=arch.rope_theta,
        max_position_embeddings=arch.max_position_embeddings, num_experts=arch.num_experts,
        num_experts_per_tok=arch.num_experts_per_tok,
        moe_intermediate_size=arch.moe_intermediate_size, norm_topk_prob=arch.norm_topk_prob)
    ref, parsed = transformers_gguf_model(path, arch, config)
    keys = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "hidden_size",
            "num_hidden_layers", "head_dim", "num_key_value_heads")
    assert {key: parsed[key] for key in keys} == {key: getattr(config, key) for key in keys}
    return ref


@pytest.fixture(scope="module")
def reference(moe_gguf: tuple[Path, Path, gguf.GGMLQuantizationType]) -> PreTrainedModel:
    folder, path, kind = moe_gguf
    return reference_model(folder, path, kind, arch_from_gguf(gguf.GGUFReader(path)))


def assert_gguf_matches(loaded: LoadedModel, ref: PreTrainedModel) -> None:
    """Prefill logits within 1e-4, then identical greedy tokens, the prompts batched."""
    assert all(isinstance(layer.mlp, SparseMoE) for layer in loaded.model.model.layers)
    prompts = [loaded.tokenizer.encode(text) for text in PROMPTS]
    generated = assert_matches_reference(loaded, ref, prompts, STEPS, atol=1e-4)
    assert sum(map(len, generated)) >= len(prompts) * STEPS // 2


def test_dequantized_moe_gguf_matches_transformers(
        moe_gguf: tuple[Path, Path, gguf.GGMLQuantizationType], reference: PreTrainedModel
) -> None:
    folder, path, _ = moe_gguf
    loaded = load_model(str(path), torch.float32, CPU, tokenizer=str(folder))
    expected = ("mixtral", 4, 2) if "mixtral" in folder.name else ("qwen3_moe", 4, 2)
    assert (loaded.arch.model_type, loaded.arch.num_experts,
            loaded.arch.num_experts_per_tok) == expected and loaded.arch.norm_topk_prob
    assert_gguf_matches(loaded, reference)


@pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
def test_moe_gguf_multiplies_expert_codes_as_stored(
        moe_gguf: tuple[Path, Path, gguf.GGMLQuantizationType], reference: PreTrainedModel
) -> None:
    """The engine's batch-invariant GGUF load: every expert keeps only the file's codes and
    scales (no float copy), and the model is still transformers' to 1e-4; a second start
    reads the same model back from the prepared-weights cache."""
    folder, path, kind = moe_gguf
    loaded, again = (load_model(str(path), torch.float32, CPU, tokenizer=str(folder),
                                gguf_quantized_max_tokens=None, batch_invariant=True)
                     for _ in range(2))
    prompt = [(0, list(range(3, 40)))]
    # not bit for bit: the cache's float weights (router, output head) are mapped at other
    # alignments, where the float32 matmul rounds differently by an ulp
    torch.testing.assert_close(PagedCache(again.arch).step(again.model, prompt),
                               PagedCache(loaded.arch).step(loaded.model, prompt),
                               atol=1e-5, rtol=0)
    moe = loaded.model.model.layers[0].mlp
    experts = [m for e in moe.experts for m in e.modules() if isinstance(m, Linear)]
    assert len(experts) == 2 * loaded.arch.num_experts
    bits = 4 if kind == Q4_0 else 8
    assert all(e.weight.numel() == 0 and e.quantized.bits == bits for e in experts)
    assert moe.gate.weight.numel() > 0 and moe.gate.quantized is None  # the F32 router
    assert_gguf_matches(loaded, reference)


def test_each_expert_is_its_slice_of_the_stacked_tensor(
        moe_gguf: tuple[Path, Path, gguf.GGMLQuantizationType]) -> None:
    """Expert e of `blk.1.ffn_{gate,up,down}_exps` is row block e of gguf-py's
    dequantization of the whole tensor, as codes and as float."""
    _, path, _ = moe_gguf
    reader = gguf.GGUFReader(path)
    arch = arch_from_gguf(reader)
    codes = dict(gguf_quantized_weights(reader, arch))
    dense = dict(gguf_weights(reader, arch))
    for tensor in reader.tensors:
        if not (tensor.name.startswith("blk.1.") and "_exps" in tensor.name):
            continue
        stacked = dequantize(tensor.data, tensor.tensor_type)
        stacked = torch.from_numpy(stacked.reshape([int(d) for d in reversed(tensor.shape)]))
        proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[
            tensor.name.split(".")[2].split("_")[1]]
        for expert in range(arch.num_experts):
            name = f"model.layers.1.mlp.experts.{expert}.{proj}.weight"
            assert torch.equal(codes[name].dequantize(), stacked[expert])
            assert torch.equal(dense[name], stacked[expert])
