"""GGUF quantized matrices multiplied as stored: every kernel on them (pagellm's float and
int8 ones, AMX's, torch's int4) against the dequantized matmul, and whole models within the
quantization's error. The file's groups read exactly: test_gguf_quants.py. Which kernel a
step size gets, and which forms a layer keeps: test_quantized_choices.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from test_models import PagedCache, greedy_decode
from tiny_models import write_tiny_gguf

import pagellm.model.quantized as quantized_module
from pagellm.kernels import cpu_kernels_available, int8_matmul_available, quantized_linear_int8
from pagellm.model.arch import ArchConfig
from pagellm.model.gguf_weights import gguf_quantized_weights
from pagellm.model.llama import LlamaForCausalLM
from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.quantized import GroupQuantWeight, Int8Panels, Linear
from pagellm.model.torch_matmul import TORCH_INT4_MAX_TOKENS

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ compiler")
needs_int8 = pytest.mark.skipif(not int8_matmul_available(),
                                reason="no AVX2: the int8 kernel is not built")

CPU = torch.device("cpu")
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def random_weight(bits: int, rows: int, cols: int, with_zeros: bool,
                  group_size: int = 32) -> GroupQuantWeight:
    """Scales and zeros per `group_size` inputs: 16 is Q6_K's, with zeros a fused projection
    of Q4_K and Q6_K shards."""
    generator = torch.Generator().manual_seed(bits * 1000 + rows)
    codes = (torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
             if bits == 4 else
             torch.randint(-128, 128, (rows, cols), generator=generator, dtype=torch.int8))
    groups = (rows, cols // group_size)
    scales = torch.rand(groups, generator=generator) * 0.02 + 0.001
    zeros = torch.randn(groups, generator=generator) * 0.05 if with_zeros else None
    return GroupQuantWeight(codes, scales, zeros, bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits,with_zeros,group_size",
                         [(4, True, 32), (4, False, 32), (8, False, 32), (8, False, 16),
                          (8, True, 16)], ids=["Q4_1", "Q4_0", "Q8_0", "Q6_K", "Q4_K+Q6_K"])
# Up to 11 tokens: passes over the weights, 4 rows each (full, partial and both). From 12:
# panels of 16 features (here 12 full and a partial one), tiles of 6 rows (partial ones
# included), inputs in chunks (160 + 128), and blocks of 192 rows (two for 200 tokens).
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 16, 23, 200])
def test_kernel_matches_the_dequantized_matmul(bits: int, with_zeros: bool, group_size: int,
                                               dtype: torch.dtype, tokens: int) -> None:
    weight = random_weight(bits, 203, 288, with_zeros, group_size)
    layer = Linear(288, 203, bias=True)
    layer.weight.data = weight.dequantize()
    layer.bias.data = torch.randn(203)
    layer = layer.to(dtype)
    layer.attach_quantized(weight, max_tokens=256)
    layer.torch_int4 = None  # pagellm's kernel at every size (torch's: the next test)
    x = torch.randn(tokens, 288).to(dtype)
    expected = x.float() @ weight.dequantize().T + layer.bias.float()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (tokens, 203)
    if dtype == torch.float32:  # float32 sums of 288 products, in another order
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    else:  # float32 math, one rounding of the output (and of the bias add) to bf16
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("with_zeros", [True, False], ids=["Q4_1", "Q4_0"])
@pytest.mark.parametrize("tokens", [1, 5, 8, 9])
def test_torch_int4_serves_small_bf16_steps_with_the_same_weights(
        with_zeros: bool, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to TORCH_INT4_MAX_TOKENS tokens, a bf16 layer's 4-bit codes go through torch's
    int4 kernel (scales and zeros rounded to bf16), beyond it through pagellm's."""
    weight = random_weight(4, 208, 288, with_zeros)
    layer = Linear(288, 208, bias=True)
    layer.bias.data = torch.randn(208)
    layer = layer.to(torch.bfloat16)
    layer.attach_quantized(weight, max_tokens=256)
    assert layer.torch_int4 is not None
    calls = count_kernel_calls(monkeypatch)
    x = torch.randn(tokens, 288).bfloat16()
    expected = x.float() @ weight.dequantize().T + layer.bias.float()
    torch.testing.assert_close(layer(x).float(), expected, atol=3e-2, rtol=1e-2)
    assert calls[0] == (0 if tokens <= TORCH_INT4_MAX_TOKENS else 1)


def rounded_to_int8(x: torch.Tensor) -> torch.Tensor:
    """x with each group of 32 inputs rounded to int8 steps of max |x| / 127, as floats
    (scaled by 127 / max |x| as the kernel does: x / step can round the other way)."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    largest = groups.abs().amax(-1, keepdim=True)
    # a tensor divided: `127 / largest` is 127 * (1 / largest), off by an ulp at times, which
    # moves values at ties (bf16 inputs have many) by a step
    inverse = torch.tensor(127.0) / largest
    steps = torch.round(groups * torch.where(largest > 0, inverse, 0.0))
    return (steps * (largest / 127)).reshape(x.shape)


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits,with_zeros,group_size",
                         [(4, True, 32), (4, False, 32), (8, False, 32), (8, True, 32),
                          (8, False, 16), (8, True, 16)],
                         ids=["Q4_1", "Q4_0", "Q8_0", "Q5_K", "Q6_K", "Q4_K+Q6_K"])
# From 12 tokens: tiles of 3 rows (13: a partial one), panels of 16 features (12 full and a
# partial one), inputs in chunks (160 + 128), blocks of 192 rows (385: three). Below 12,
# the float32 passes: no rounding.
@pytest.mark.parametrize("tokens", [4, 12, 13, 200, 385])
def test_int8_kernel_multiplies_the_codes_with_int8_rounded_activations(
        bits: int, with_zeros: bool, group_size: int, dtype: torch.dtype, tokens: int) -> None:
    weight = random_weight(bits, 203, 288, with_zeros, group_size)
    if bits == 8:  # the extremes: |-128| is vpmaddubsw's unsigned 128, 2 * 128 * 127 < 2^15
        weight.codes[:, :2], weight.codes[:, 2:4] = -128, 127
    layer = Linear(288, 203, bias=False).to(dtype)
    layer.attach_quantized(weight, max_tokens=1024, int8_activations=True)
    layer.torch_int4 = None  # pagellm's kernels below 12 tokens
    x = torch.randn(tokens, 288, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    x[0, :32] = 0.0  # a group of zeros: step 0
    x[1, 40] = 50.0  # an outlier that coarsens its group's steps
    inputs = x.float() if tokens < 12 else rounded_to_int8(x)
    expected = inputs @ weight.dequantize().T
    got = layer(x)
    assert got.dtype == dtype and got.shape == (tokens, 203)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)
    if tokens >= 12:  # and the rounding is visible
        assert (got.float() - x.float() @ weight.dequantize().T).abs().max() > 1e-3


@needs_int8
@pytest.mark.parametrize("rows,cols,group_size,with_zeros",
                         [(203, 288, 32, True), (37, 2048, 32, False), (5, 32, 32, True),
                          (250, 96, 16, True)], ids=["Q4_1", "Q4_0-2048", "one-group", "halves"])
def test_4_bit_codes_two_per_byte_give_the_products_of_the_rounded_activations(
        rows: int, cols: int, group_size: int, with_zeros: bool) -> None:
    """Unpacked in registers (or, on AMX tiles from 12 rows, into the bytes the tiles load),
    the codes two per byte give float32's sums of the product with the int8-rounded
    activations, from 1 row to 70 (tiles whole and partial, and a partial panel of
    features). Groups of 16: the kernel's half groups."""
    weight = random_weight(4, rows, cols, with_zeros, group_size)
    panels = weight.int8_panels()
    assert panels.codes.dtype == torch.uint8 and 2 * panels.codes.numel() == 16 * (
        (rows + 15) // 16) * cols
    reference = weight.as_8_bit().dequantize()  # 8-bit codes take the scales' group size
    generator = torch.Generator().manual_seed(rows)
    for dtype, tolerance in ((torch.float32, {"atol": 1e-4, "rtol": 1e-5}),
                             (torch.bfloat16, {"atol": 2e-2, "rtol": 1e-2})):
        for tokens in range(1, 71):
            x = torch.randn(tokens, cols, generator=generator).to(dtype)
            got = quantized_linear_int8(x, panels.codes, panels.scales, panels.zeros, rows)
            torch.testing.assert_close(got.float(), rounded_to_int8(x) @ reference.T,
                                       **tolerance)


@needs_int8
@pytest.mark.parametrize("bits,with_zeros", [(4, True), (4, False), (8, False)],
                         ids=["Q4_1", "Q4_0", "Q8_0"])
def test_float16_scales_and_zeros_give_the_float32_ones_results(bits: int,
                                                                 with_zeros: bool) -> None:
    """GGUF stores these types' scales (and Q4_1's minimums) in float16: panels keep them so,
    half the bytes, every result equal to the bit (from 8 rows on AMX tiles, where the CPU
    has them) to the float32 ones' (which another library multiplies). Scales that
    float16 does not hold (as a K-quant's products of two scales) stay float32."""
    weight = random_weight(bits, 203, 288, with_zeros)
    weight.scales = weight.scales.half().float()
    if with_zeros:  # Q4_1's are its minimum m plus 8 scales (gguf_weights._q4_groups)
        weight.zeros = weight.zeros.half().float() + 8 * weight.scales
    panels = weight.int8_panels()
    assert panels.scales.dtype == panels.zeros.dtype == torch.float16
    wide = Int8Panels(panels.codes, panels.scales.float(), panels.zeros.float())
    generator = torch.Generator().manual_seed(bits)
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (*range(1, 18), 64, 200):
            x = torch.randn(tokens, 288, generator=generator).to(dtype)
            assert torch.equal(quantized_linear_int8(x, wide.codes, wide.scales, wide.zeros,
                                                     203),
                               quantized_linear_int8(x, panels.codes, panels.scales,
                                                     panels.zeros, 203)), (dtype, tokens)
    inexact = random_weight(bits, 203, 288, with_zeros).int8_panels()
    assert inexact.scales.dtype == inexact.zeros.dtype == torch.float32


@needs_int8
def test_layers_keep_4_bit_codes_two_per_byte() -> None:
    """A decode step reads every weight: half the bytes of a code each, on every CPU (the
    AMX kernel unpacks a panel before its tiles load it); 8-bit codes keep a byte each."""
    for bits, per_byte in ((4, 2), (8, 1)):
        layer = Linear(288, 203, bias=False)
        layer.attach_batch_invariant(random_weight(bits, 203, 288, True), int8_activations=True)
        assert layer.int8_panels is not None
        assert layer.int8_panels.codes.numel() * per_byte == 208 * 288


AVX2_INT8_PRODUCTS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_quantized import int8_products
torch.save(int8_products(), sys.argv[2])
"""


def int8_products() -> list[torch.Tensor]:
    """The int8 kernel's outputs for 4-bit and 8-bit codes, float32 and bf16, 12 to 50 rows
    (whole and partial tiles of 16), an odd number of groups (9) and a partial panel; and 150
    rows times 38 panels, where the AMX kernel takes each thread's panels 16 at a time."""
    outputs = []
    cases = ((4, torch.float32, 50, 203), (4, torch.bfloat16, 12, 203),
             (8, torch.float32, 33, 203), (8, torch.bfloat16, 16, 203),
             (4, torch.float32, 150, 600), (8, torch.bfloat16, 150, 600))
    for bits, dtype, tokens, features in cases:
        weight = random_weight(bits, features, 288, with_zeros=bits == 4)
        layer = Linear(288, features, bias=False).to(dtype)
        layer.attach_quantized(weight, max_tokens=1024, int8_activations=True)
        x = torch.randn(tokens, 288, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        outputs.append(layer.quantized_forward(x))
    return outputs


@needs_int8
@pytest.mark.skipif("amx_int8" not in Path("/proc/cpuinfo").read_text(),
                    reason="no AMX tiles on this CPU")
def test_amx_tiles_give_the_avx2_kernels_results_exactly(tmp_path: Path) -> None:
    """The same integer sums, then the same float32 operations in the same order per group:
    equal to the bit, with PAGELLM_AMX=0 keeping the AVX2 kernel in another process."""
    saved = tmp_path / "avx2.pt"
    subprocess.run([sys.executable, "-c", AVX2_INT8_PRODUCTS, str(Path(__file__).parent),
                    str(saved)], env={**os.environ, "PAGELLM_AMX": "0"}, check=True)
    for amx, avx2 in zip(int8_products(), torch.load(saved), strict=True):
        assert torch.equal(amx, avx2)


@needs_int8
def test_int8_products_do_not_depend_on_how_many_threads_share_them(on_one_thread) -> None:
    """A server's engine may run on fewer threads than a test's (VLLM_CPU_OMP_THREADS_BIND,
    data-parallel ranks): one thread, then the pool (twice), give the same bits."""
    alone = on_one_thread(int8_products)
    for _ in range(2):
        for shared, single in zip(int8_products(), alone, strict=True):
            assert torch.equal(shared, single)


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    kernel = quantized_module.quantized_linear

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(quantized_module, "quantized_linear", counting)
    return calls


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # output projection: own, tied
def test_small_steps_use_the_quantized_weights_with_the_same_results(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path, model_type: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tiny_model_factory(model_type)
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1, embedding_quantization=Q8_0))
    dense = load_model(path, torch.float32, CPU, tokenizer=str(folder))
    small = load_model(path, torch.float32, CPU, tokenizer=str(folder),
                       gguf_quantized_max_tokens=2)
    layers = [m for m in small.model.modules() if isinstance(m, Linear) and m.quantized_max_tokens]
    assert len(layers) == 4 * small.arch.num_hidden_layers + 1  # qkv, o, gate_up, down; lm_head
    assert small.model.lm_head.quantized is not None and small.model.lm_head.quantized.bits == 8
    assert small.model.lm_head_is_tied == (model_type == "qwen2")
    calls = count_kernel_calls(monkeypatch)
    prompts = [list(range(3, 30)), list(range(50, 58))]
    results = {}
    for label, loaded in (("dense", dense), ("quantized", small)):
        cache = PagedCache(loaded.arch)
        prefill = cache.step(loaded.model, list(enumerate(prompts)))
        # 35 tokens, then 2 rows (the prompts' last tokens): in the last layer's o_proj,
        # gate_up and down, and in lm_head
        assert calls[0] == (4 if label == "quantized" else 0)
        decode = cache.step(loaded.model, [(0, [7]), (1, [9])])
        results[label] = (prefill, decode, greedy_decode(cache, loaded.model, decode, 16))
    assert calls[0] > len(layers)  # two-token steps of the quantized model
    torch.testing.assert_close(results["quantized"][0], results["dense"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(results["quantized"][1], results["dense"][1], atol=1e-4, rtol=1e-4)
    assert results["quantized"][2] == results["dense"][2]


def teacher_forced_logits(model: LlamaForCausalLM, arch: ArchConfig, dtype: torch.dtype,
                          prompts: list[list[int]], continuations: list[list[int]]) -> torch.Tensor:
    """Logits of each step when both requests are fed the given continuations, 2 tokens a step."""
    cache = PagedCache(arch, dtype, num_blocks=64, block_size=16)
    steps = [cache.step(model, list(enumerate(prompts)))]
    for i in range(len(continuations[0])):
        steps.append(cache.step(model, [(r, [c[i]]) for r, c in enumerate(continuations)]))
    return torch.stack(steps[1:])


def test_smollm2_quantized_decode_is_as_close_to_float32_as_bf16(
        smollm2_gguf: Path, smollm2_float32: LoadedModel) -> None:
    """In bf16, the quantized path's decode logits stay about as close to the float32
    dequantized model as the bf16 dequantized ones: it multiplies in float32 and rounds its
    inputs and outputs to bf16 (measured 1.45x the bf16 model's error on an AVX2 CPU; a
    wrong code or scale layout gives errors many times larger)."""
    reference = smollm2_float32
    arch = reference.arch
    prompts = [reference.tokenizer.encode(text) for text in
               ("The capital of France is", "Once upon a time, in a small village,")]
    cache = PagedCache(arch, num_blocks=64, block_size=16)
    continuations = greedy_decode(cache, reference.model,
                                  cache.step(reference.model, list(enumerate(prompts))), 12)
    expected = teacher_forced_logits(reference.model, arch, torch.float32, prompts, continuations)
    dense = copy.deepcopy(reference.model).to(torch.bfloat16)
    small = copy.deepcopy(dense)
    attached = small.attach_quantized_weights(
        gguf_quantized_weights(gguf.GGUFReader(smollm2_gguf), arch), 16)
    assert len(attached) == 4 * arch.num_hidden_layers + 1  # and the tied Q8_0 output head
    errors = {}
    for label, model in (("dense", dense), ("quantized", small)):
        logits = teacher_forced_logits(model, arch, torch.bfloat16, prompts, continuations)
        errors[label] = (logits - expected).abs().mean().item()
        assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert errors["quantized"] <= 2 * errors["dense"]


def prefill_logits(loaded: LoadedModel, prompts: list[list[int]],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The last token's logits of each prompt, all prompts in one step."""
    cache = PagedCache(loaded.arch, dtype, num_blocks=64, block_size=16)
    return cache.step(loaded.model, list(enumerate(prompts))).float()


@needs_int8
def test_int8_activations_move_logits_far_less_than_the_quantization(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path) -> None:
    """Rounding activations to int8 moves a prefill's logits a small fraction of the way
    that quantizing the weights to 4 bits moved them from the original model (measured
    8.5%)."""
    folder = tiny_model_factory("llama")
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1, embedding_quantization=Q8_0))
    original = load_model(str(folder), torch.float32, CPU)
    dequantized = load_model(path, torch.float32, CPU, tokenizer=str(folder))
    int8 = load_model(path, torch.float32, CPU, tokenizer=str(folder),
                      gguf_quantized_max_tokens=1024, gguf_int8_activations=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, original.arch.vocab_size, (24,), generator=generator).tolist()
               for _ in range(6)]
    logits = {label: prefill_logits(loaded, prompts) for label, loaded in
              (("original", original), ("dequantized", dequantized), ("int8", int8))}
    quantization = (logits["dequantized"] - logits["original"]).abs().mean()
    rounding = (logits["int8"] - logits["dequantized"]).abs().mean()
    assert 0 < rounding <= 0.25 * quantization


@needs_int8
def test_smollm2_int8_prefill_stays_about_as_close_to_float32_as_bf16(
        smollm2_gguf: Path, smollm2_float32: LoadedModel) -> None:
    """SmolLM2's prefill logits with int8 activations stay within 4x the bf16 model's
    distance from the float32 dequantized model (measured 2.3x; llama.cpp's own logits for
    this file are about as far from float32 as ours), with the same next token."""
    reference = smollm2_float32
    int8 = copy.deepcopy(reference)
    int8.model.attach_quantized_weights(
        gguf_quantized_weights(gguf.GGUFReader(smollm2_gguf), reference.arch), 1024,
        int8_activations=True)
    bf16 = copy.deepcopy(reference)
    bf16.model.to(torch.bfloat16)
    prompts = [reference.tokenizer.encode(text) for text in
               ("The capital of France is Paris, and the capital of Germany is",
                "Once upon a time, in a small village, there lived an old man who")]
    expected = prefill_logits(reference, prompts)
    errors = {}
    for label, loaded, dtype in (("int8", int8, torch.float32), ("bf16", bf16, torch.bfloat16)):
        logits = prefill_logits(loaded, prompts, dtype)
        errors[label] = (logits - expected).abs().mean().item()
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
    assert 0 < errors["int8"] <= 4 * errors["bf16"]


