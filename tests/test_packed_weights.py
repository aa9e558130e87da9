"""bf16 float weights kept in oneDNN's blocked layout on CPUs that multiply bf16 natively:
the same products as the plain matmul, the plain copy freed unless the embeddings share it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_models import PagedCache, greedy_decode

import pagellm.model.loader as loader_module
from pagellm.model.loader import load_model
from pagellm.model.quantized import Linear
from pagellm.model.torch_matmul import packed_weights_supported

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packed_weights_supported(torch.bfloat16, CPU),
                                reason="oneDNN has no bf16 matmul on this CPU")


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_weight_multiplies_as_the_plain_one(tokens: int, bias: bool) -> None:
    torch.manual_seed(tokens)
    layer = Linear(96, 80, bias=bias).to(torch.bfloat16)
    plain_weight = layer.weight.detach().clone()
    x = torch.randn(tokens, 96).bfloat16()
    expected = F.linear(x, plain_weight, layer.bias)
    layer.pack_dense(shared=False)
    assert layer.weight.numel() == 0 and layer.packed_bytes() >= plain_weight.numel() * 2
    torch.testing.assert_close(layer(x), expected)  # bf16's tolerance: kernels may differ


def test_a_shared_weight_stays_a_parameter() -> None:
    layer = Linear(64, 48, bias=False).to(torch.bfloat16)
    weight = layer.weight
    layer.pack_dense(shared=True)
    assert layer.weight is weight and layer.packed is not None


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # output projection: own, tied
def test_a_bf16_model_packs_every_projection_and_decodes_the_same(
        tiny_model_factory: Callable[[str], Path], model_type: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = str(tiny_model_factory(model_type))
    packed = load_model(folder, torch.bfloat16, CPU)
    monkeypatch.setattr(loader_module, "packed_weights_supported", lambda dtype, device: False)
    plain = load_model(folder, torch.bfloat16, CPU)
    layers = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * packed.arch.num_hidden_layers + 1
    assert all(layer.packed is not None for layer in layers)
    tied = packed.model.lm_head_is_tied
    assert tied == (model_type == "qwen2")
    freed = [layer.weight.numel() == 0 for layer in layers]
    assert freed == [True] * (len(layers) - 1) + [not tied]
    assert packed.model.num_weights() == plain.model.num_weights()
    prompts = [list(range(3, 30)), list(range(50, 58))]
    results = {}
    for label, loaded in (("packed", packed), ("plain", plain)):
        cache = PagedCache(loaded.arch, torch.bfloat16)
        prefill = cache.step(loaded.model, list(enumerate(prompts)))
        results[label] = (prefill, greedy_decode(cache, loaded.model, prefill, 12))
    torch.testing.assert_close(results["packed"][0], results["plain"][0], atol=2e-2, rtol=2e-2)
    assert results["packed"][1] == results["plain"][1]
