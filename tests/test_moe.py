"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) against
Hugging Face transformers, and their experts computed once per active expert for the whole
step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_models import assert_matches_transformers

from pagellm.distributed.sharding import check_shardable
from pagellm.model.arch import arch_from_hf_config
from pagellm.model.layers import GatedMLP
from pagellm.model.loader import LoadedModel, load_model
from pagellm.model.moe import SparseMoE

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def tiny_moe_dir(request: pytest.FixtureRequest,
                 tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory(request.param)


def test_prefill_and_decode_match_transformers(tiny_moe_dir: Path) -> None:
    loaded = assert_matches_transformers(tiny_moe_dir)
    moe_layers = [i for i, layer in enumerate(loaded.model.model.layers)
                  if isinstance(layer.mlp, SparseMoE)]
    assert moe_layers == {"mixtral": [0, 1], "qwen2_moe": [1],
                          "qwen3_moe": [0]}[loaded.arch.model_type]
    shared = [layer.mlp.shared_expert is not None for layer in loaded.model.model.layers
              if isinstance(layer.mlp, SparseMoE)]
    assert all(shared) if loaded.arch.model_type == "qwen2_moe" else not any(shared)


def first_moe(loaded: LoadedModel) -> SparseMoE:
    return next(layer.mlp for layer in loaded.model.model.layers
                if isinstance(layer.mlp, SparseMoE))


def test_router_matches_transformers_normalisation(tiny_moe_dir: Path) -> None:
    loaded = load_model(str(tiny_moe_dir), torch.float32, CPU)
    moe = first_moe(loaded)
    x = torch.randn(7, loaded.arch.hidden_size)
    experts, weights = moe.route(x)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    chosen = probs.gather(1, experts)
    normalized = loaded.arch.model_type == "mixtral"
    assert moe.normalize == normalized
    expected = chosen / chosen.sum(-1, keepdim=True) if normalized else chosen
    torch.testing.assert_close(weights, expected)
    assert torch.equal(probs.topk(2, dim=-1).indices, experts)


def test_experts_run_once_per_step_for_all_their_tokens(tiny_moe_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60-token step calls each MoE layer's experts at most once each (4), not per token,
    and its shared expert, if any, once for all 60."""
    loaded = load_model(str(tiny_moe_dir), torch.float32, CPU)
    rows: list[int] = []
    forward = GatedMLP.forward
    monkeypatch.setattr(GatedMLP, "forward", lambda self, x: rows.append(len(x)) or forward(self, x))
    moe = first_moe(loaded)
    x = torch.randn(60, loaded.arch.hidden_size)
    out = moe(x)
    if moe.shared_expert is not None:
        assert rows.pop() == 60
    assert len(rows) <= len(moe.experts) and sum(rows) == 60 * moe.top_k
    rows.clear()
    one_by_one = torch.cat([moe(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(out, one_by_one, atol=1e-5, rtol=1e-5)


def test_qwen2_moe_config_switches(tiny_model_factory: Callable[[str], Path]) -> None:
    """Qwen2-MoE's q/k/v bias follows `qkv_bias`; its shared expert's size is read."""
    config = json.loads((tiny_model_factory("qwen2_moe") / "config.json").read_text())
    arch = arch_from_hf_config(config)
    assert (arch.attention_bias, arch.shared_expert_intermediate_size) == (True, 160)
    assert arch.dense_layers == [0] and not arch.norm_topk_prob
    assert not arch_from_hf_config({**config, "qkv_bias": False}).attention_bias


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_splitting_experts_over_ranks_is_refused_in_one_line(
        model_type: str, tiny_model_factory: Callable[[str], Path]) -> None:
    config = json.loads((tiny_model_factory(model_type) / "config.json").read_text())
    with pytest.raises(ValueError, match=rf"^{model_type} is a mixture-of-experts model, "
                                         r"which pagellm does not split over ranks yet") as error:
        check_shardable(arch_from_hf_config(config), tp=1)
    assert "\n" not in str(error.value)
