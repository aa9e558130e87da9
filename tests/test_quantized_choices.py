"""Which form of a quantized projection each step size multiplies, and which forms the loader
keeps: timed choices (their verdicts forced where a test needs one), freed forms, and the
bytes a step reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from test_models import PagedCache, greedy_decode
from test_quantized import CPU, Q4_1, needs_int8, random_weight
from tiny_models import write_tiny_gguf

import pagellm.model.gguf_weights as gguf_weights_module
import pagellm.model.loader as loader_module
import pagellm.model.quantized as quantized_module
import pagellm.model.quantized_timing as timing_module
from pagellm.kernels import cpu_kernels_available
from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.quantized import ANY_TOKENS, Linear
from pagellm.model.quantized_timing import measure_max_tokens

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
PROJECTION_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_torch_int4_is_kept_or_dropped_for_whole_shapes() -> None:
    layers = []
    for rows, dtype in ((64, torch.bfloat16), (64, torch.bfloat16), (96, torch.bfloat16),
                        (64, torch.float32), (72, torch.bfloat16)):  # 72: not whole 16s
        layer = Linear(256, rows, bias=False).to(dtype)
        layer.attach_quantized(random_weight(4, rows, 256, with_zeros=True), max_tokens=16)
        layers.append(layer)
    assert [layer.torch_int4 is not None for layer in layers] == [True, True, True, False, False]
    kept = dict(entry.split() for entry in timing_module.choose_torch_int4(layers))
    assert set(kept) <= {"256x64", "256x96"}
    assert [layer.torch_int4 is not None for layer in layers] == [
        "256x64" in kept, "256x64" in kept, "256x96" in kept, False, False]
    for layer, shape in zip(layers[:3], ("256x64", "256x64", "256x96"), strict=True):
        served = int(kept.get(shape, 0))  # the sizes it won from 1 on, the rest to the kernel
        assert served in {0, *timing_module.INT4_CANDIDATE_TOKENS}
        assert layer.torch_int4_max_tokens == served
        x = torch.randn(max(served, 1), 256).bfloat16()
        assert (layer.quantized_form(x.shape[0]) is layer.torch_int4) == (served > 0)


@needs_int8
def test_bytes_read_are_those_of_the_form_a_step_multiplies() -> None:
    """208 x 288 in bf16 (9 groups of 32 per row, 13 panels): torch's int4 codes and bf16
    scale-zero pairs up to 8 tokens, pagellm's packed codes and float32 scales and zeros
    up to 11, the int8 panels from 12 (two codes per byte), the bf16 weight past the
    quantized maximum."""
    layer = Linear(288, 208, bias=False).to(torch.bfloat16)
    layer.attach_quantized(random_weight(4, 208, 288, with_zeros=True), max_tokens=64,
                           int8_activations=True)
    codes, float32_pairs = 208 * 288 // 2, 2 * 208 * 9 * 4
    panels = 13 * 16 * 288 // 2 + 2 * 13 * 9 * 16 * 4
    assert [layer.bytes_read(tokens) for tokens in (1, 8, 9, 11, 12, 64, 65)] == [
        codes + 208 * 9 * 2 * 2, codes + 208 * 9 * 2 * 2, codes + float32_pairs,
        codes + float32_pairs, panels, panels, 208 * 288 * 2]


def test_max_tokens_are_measured_per_layer_shape() -> None:
    """Each shape gets a candidate size (or 0), set on every layer of that shape."""
    layers = []
    for rows in (512, 512, 1024):
        layer = Linear(1024, rows, bias=False)
        weight = random_weight(4, rows, 1024, with_zeros=True)
        layer.weight.data = weight.dequantize()
        layer.attach_quantized(weight, max_tokens=0)
        layers.append(layer)
    sizes = measure_max_tokens(layers, torch.float32)
    assert sorted(sizes) == ["1024x1024 Q4", "1024x512 Q4"]
    assert set(sizes.values()) <= {0, *timing_module.CANDIDATE_MAX_TOKENS[:-1],
                                   ANY_TOKENS}
    assert [layer.quantized_max_tokens for layer in layers] == [
        sizes["1024x512 Q4"], sizes["1024x512 Q4"], sizes["1024x1024 Q4"]]


def test_a_lone_win_or_loss_does_not_decide_the_step_size() -> None:
    """Candidates 1, 2, 4, 8, 12, 16, 32, 64, 128, 512, 1024, 2048."""
    decide = timing_module.max_tokens_from_wins
    assert len(timing_module.CANDIDATE_MAX_TOKENS) == 12
    o, x = True, False
    assert decide([o, o, o, x, x, x, x, x, x, x, x, o]) == 4
    assert decide([o, x, o, o, o, o, x, x, x, x, x, x]) == 16
    assert decide([o, o, o, x, o, o, o, x, x, x, x, x]) == 32
    assert decide([o, x, x, x, x, x, x, x, x, x, x, x]) == 1
    assert decide([x, o, x, x, x, x, x, x, x, x, x, x]) == 0
    assert decide([o] * 10 + [x, x]) == 512
    assert decide([o] * 11 + [x]) == 1024
    assert decide([o] * 12) == ANY_TOKENS
    assert decide([x] * 12) == 0


@needs_int8
def test_the_int8_probe_answers_for_whole_shapes_and_only_int8_layers() -> None:
    """One layer per shape is timed; the verdict covers every layer of that shape, and a
    layer without int8 panels is never among the winners."""
    layers = []
    for rows, int8 in ((512, True), (512, True), (256, True), (512, False)):
        layer = Linear(1024, rows, bias=False)
        layer.attach_quantized(random_weight(4, rows, 1024, with_zeros=True), max_tokens=0,
                               int8_activations=int8)
        layers.append(layer)
    winners = timing_module.int8_beats_dense(layers, torch.float32)
    assert layers[3] not in winners
    assert (layers[0] in winners) == (layers[1] in winners)
    assert set(winners) <= set(layers[:3])


def load_measured_int8(path: str, folder: Path, monkeypatch: pytest.MonkeyPatch,
                       int8_wins: bool) -> tuple[LoadedModel, list[str]]:
    """The GGUF with step sizes left to measure under int8 activations, the probe's verdict
    forced (it is a timing), and the names of the tensors that were dequantized."""
    monkeypatch.setattr(loader_module, "int8_beats_dense",
                        lambda layers, dtype: list(layers) if int8_wins else [])
    dequantized: list[str] = []
    dequantize = gguf_weights_module._dequantized
    monkeypatch.setattr(gguf_weights_module, "_dequantized",
                        lambda tensor: dequantized.append(tensor.name) or dequantize(tensor))
    loaded = load_model(path, torch.float32, CPU, tokenizer=str(folder),
                        gguf_quantized_max_tokens=None, gguf_int8_activations=True)
    return loaded, dequantized


def assert_same_outputs(loaded: LoadedModel, reference: LoadedModel, atol: float = 1e-6) -> None:
    prompts = [list(range(3, 30)), list(range(50, 58))]
    results = {}
    for label, model in (("loaded", loaded), ("reference", reference)):
        cache = PagedCache(model.arch)
        prefill = cache.step(model.model, list(enumerate(prompts)))
        results[label] = (prefill, greedy_decode(cache, model.model, prefill, 8))
    torch.testing.assert_close(results["loaded"][0], results["reference"][0], atol=atol, rtol=0)
    assert results["loaded"][1] == results["reference"][1]


@needs_int8
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # output projection: own, tied
def test_int8_projections_that_beat_dense_keep_only_their_quantized_weights(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path, model_type: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the int8 path beats the dense matmul, a 4-bit projection under int8
    activations never gets float weights (they are not even dequantized), yet computes what
    it computed with both forms; a tied output projection keeps them, as they are also the
    embeddings."""
    folder = tiny_model_factory(model_type)
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1, embedding_quantization=Q4_1))
    both = load_model(path, torch.float32, CPU, tokenizer=str(folder),
                      gguf_quantized_max_tokens=1024, gguf_int8_activations=True)
    only, dequantized = load_measured_int8(path, folder, monkeypatch, int8_wins=True)
    tied = model_type == "qwen2"
    assert only.model.lm_head_is_tied == tied
    names = [t.name for t in gguf.GGUFReader(path).tensors if t.name != "rope_freqs.weight"]
    assert "token_embd.weight" in dequantized and ("output.weight" in names) != tied
    assert sorted(dequantized) == sorted(n for n in names if n != "output.weight" and not any(
        f"{projection}.weight" in n for projection in PROJECTION_TENSORS))  # biases are loaded
    released = [m.dense_released for m in only.model.modules() if isinstance(m, Linear)]
    assert released == [True] * 4 * only.arch.num_hidden_layers + [not tied]
    assert only.model.model.layers[0].mlp.gate_up_proj.weight.numel() == 0
    assert only.model.weight_bytes() < both.model.weight_bytes()
    assert_same_outputs(only, both)


@needs_int8
def test_int8_projections_that_lose_to_dense_keep_float_weights_and_measured_forms(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the dense matmul wins (AMX), every projection loads its float weights, gets a
    measured step size, and keeps only the forms that size uses: int8 panels from
    INT8_MIN_TOKENS on, codes above 0. The results are those of the same sizes set by hand."""
    folder = tiny_model_factory("llama")
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1, embedding_quantization=Q4_1))
    measured, dequantized = load_measured_int8(path, folder, monkeypatch, int8_wins=False)
    names = [t.name for t in gguf.GGUFReader(path).tensors if t.name != "rope_freqs.weight"]
    assert sorted(dequantized) == sorted(n for n in names if not n.endswith(".bias"))
    layers = [m for m in measured.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * measured.arch.num_hidden_layers + 1
    for layer in layers:
        assert not layer.dense_released and layer.weight.numel() > 0
        size = layer.quantized_max_tokens
        assert size in {0, *timing_module.CANDIDATE_MAX_TOKENS[:-1], ANY_TOKENS}
        assert (layer.quantized is not None) == (size > 0)
        assert (layer.int8_panels is not None) == (size >= quantized_module.INT8_MIN_TOKENS)
    by_hand = load_model(path, torch.float32, CPU, tokenizer=str(folder),
                         gguf_quantized_max_tokens=1024, gguf_int8_activations=True)
    for layer, twin in zip(layers, (m for m in by_hand.model.modules() if isinstance(m, Linear)),
                           strict=True):
        twin.quantized_max_tokens = layer.quantized_max_tokens
        twin.drop_unused_forms()
    assert_same_outputs(measured, by_hand)
