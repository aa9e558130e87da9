"""The bf16 tile kernel (AMX-BF16): a GGUF's codes widened to the dense model's bf16 weights
and multiplied on AMX tiles, against the same product in float64; which step sizes use it,
and that a bf16 model loaded with it computes what its dense weights compute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_quantized import CPU, Q4_1, random_weight
from test_quantized_choices import assert_same_outputs
from tiny_models import write_tiny_gguf

import pagellm.model.loader as loader_module
from pagellm.kernels import bf16_tiles_available, quantized_linear_bf16_tiles
from pagellm.model.loader import load_model
from pagellm.model.quantized import (TORCH_INT4_BEFORE_TILES_MAX_TOKENS, Bf16Tiles,
                                     GroupQuantWeight, Linear)

pytestmark = pytest.mark.skipif(not bf16_tiles_available(),
                                reason="no AMX-BF16 tiles on this CPU (or not granted by the OS)")


def widened_weight(weight: GroupQuantWeight) -> torch.Tensor:
    """The bf16 weight the kernel widens the codes to: code * scale + (zero - offset * scale)
    in one float32 rounding (an FMA), then rounded to bf16."""
    expand = lambda t: t.double().repeat_interleave(32, dim=1)  # noqa: E731
    exact = weight.codes.double() * expand(weight.scales) + expand(weight.folded_zeros())
    return exact.float().bfloat16()


@pytest.mark.parametrize("bits,with_zeros", [(4, True), (4, False), (8, False), (8, True)],
                         ids=["Q4_1", "Q4_0", "Q8_0", "Q5_K"])
# 40 features: a pair of panels and a last, partial panel multiplied alone; 96 inputs: an odd
# number of groups. Rows: partial 16-row tiles (2, 17), a pass of two tiles then one (33 + 15
# padded), two blocks of 256 rows (300).
@pytest.mark.parametrize("tokens", [2, 17, 48, 300])
def test_tiles_multiply_the_widened_codes_with_float32_sums(bits: int, with_zeros: bool,
                                                            tokens: int) -> None:
    weight = random_weight(bits, 40, 96, with_zeros)
    if bits == 8:
        weight.codes[:, :2], weight.codes[:, 2:4] = -128, 127
    tiles = weight.bf16_tiles()
    assert tiles.codes.shape == (3, 3, 16, 16 if bits == 4 else 32)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    got = quantized_linear_bf16_tiles(x, tiles.codes, tiles.scales, tiles.zeros, 40)
    expected = x.double() @ widened_weight(weight).double().T
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 40)
    # float32 sums of 96 products in another order, one rounding to bf16 (8 bits)
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -8, atol=1e-5)


def test_tiles_are_the_dense_bf16_weights_to_their_rounding() -> None:
    """The widened weights are the dense model's, which rounds (code - offset) * scale + zero
    to bf16 in two float32 steps: at most one bf16 step apart, and nearly always equal."""
    weight = random_weight(4, 64, 256, with_zeros=True)
    dense = weight.dequantize().bfloat16()
    widened = widened_weight(weight)
    assert (widened.float() - dense.float()).abs().le(dense.float().abs() * 2 ** -7 + 1e-9).all()
    assert (widened == dense).float().mean() > 0.99


def bf16_layer(weight: GroupQuantWeight, **forms: bool) -> Linear:
    layer = Linear(weight.codes.shape[1], weight.codes.shape[0], bias=True)
    layer.weight.data = weight.dequantize()
    layer.bias.data = torch.randn(weight.codes.shape[0])
    layer = layer.to(torch.bfloat16)
    layer.attach_quantized(weight, max_tokens=512, **forms)
    return layer


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 4, 5, 12, 64])
def test_a_bf16_layer_multiplies_on_tiles_what_int4_does_not_serve(bits: int,
                                                                   tokens: int) -> None:
    """With bf16_tiles, the int8 panels are never made; torch's int4 kernel keeps 4-bit
    steps of up to TORCH_INT4_BEFORE_TILES_MAX_TOKENS tokens, and the tiles take the rest,
    computing the dense layer's result."""
    weight = random_weight(bits, 208, 288, with_zeros=bits == 4)
    layer = bf16_layer(weight, int8_activations=True, bf16_tiles=True)
    assert layer.int8_panels is None and layer.bf16_tiles is not None
    int4 = bits == 4 and tokens <= TORCH_INT4_BEFORE_TILES_MAX_TOKENS
    assert isinstance(layer.quantized_form(tokens), Bf16Tiles) != int4
    x = torch.randn(tokens, 288).bfloat16()
    dense = x.double() @ layer.weight.double().T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), dense, rtol=2e-2, atol=2e-2)


def test_float32_layers_and_sizes_that_int4_serves_keep_no_tiles() -> None:
    weight = random_weight(4, 64, 256, with_zeros=True)
    float32 = Linear(256, 64, bias=False)
    float32.attach_quantized(weight, max_tokens=64, bf16_tiles=True)
    assert float32.bf16_tiles is None
    layer = bf16_layer(weight, bf16_tiles=True)
    layer.quantized_max_tokens = TORCH_INT4_BEFORE_TILES_MAX_TOKENS
    layer.drop_unused_forms()
    assert layer.bf16_tiles is None and layer.torch_int4 is not None
    assert layer.quantized is not None
    layer.quantized_max_tokens = 0
    layer.drop_unused_forms()
    assert layer.torch_int4 is None and layer.quantized is None


def test_a_bf16_gguf_model_on_tiles_computes_what_its_dense_weights_compute(
        tiny_model_factory: Callable[[str], Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection of a bf16 model gets tiles and no int8 panels, and its prefill logits
    (to bf16's rounding) and greedy tokens are those of the dense bf16 weights alone."""
    folder = tiny_model_factory("llama")
    path = str(write_tiny_gguf(folder, tmp_path / "tiny.gguf", Q4_1, embedding_quantization=Q4_1))
    monkeypatch.setattr(loader_module, "int8_beats_dense", lambda layers, dtype: [])
    tiles = load_model(path, torch.bfloat16, CPU, tokenizer=str(folder),
                       gguf_quantized_max_tokens=512, gguf_int8_activations=True)
    dense = load_model(path, torch.bfloat16, CPU, tokenizer=str(folder),
                       gguf_quantized_max_tokens=0)
    layers = [m for m in tiles.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.bf16_tiles is not None and m.int8_panels is None for m in layers)
    for layer in layers:  # the 2-request decode steps too
        layer.torch_int4 = None
    assert_same_outputs(tiles, dense, atol=0.1)
