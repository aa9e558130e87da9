"""`pagellm bench fidelity` on the embedded GGUF: the exact float32 engine reproduces
transformers' float32 answers, and the report says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import math

import pytest
import torch

from pagellm.benchmarks import fidelity, fidelity_kl
from pagellm.entrypoints.cli import build_parser
from smollm2_reference import TransformersReference


def test_fidelity_scores_the_exact_model_as_identical(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, smollm2_gguf: Path,
        smollm2_transformers: TransformersReference) -> None:
    # the session's transformers model of the same file: loading it again takes 15-20 s
    def shared_exact_model(path: Path) -> Any:
        assert path == smollm2_gguf
        return smollm2_transformers.model

    monkeypatch.setattr(fidelity, "exact_model", shared_exact_model)
    out = tmp_path / "fidelity.json"
    args = build_parser().parse_args([
        "bench", "fidelity", "--num-prompts", "3", "--max-tokens", "12",
        "--variant", 'float32={"dtype": "float32"}', "--variant", "default={}",
        "--output-json", str(out)])
    results = args.handler(args)
    by_variant = {r.variant: r for r in results}
    exact = by_variant["float32"]
    assert (exact.identical, exact.prompts) == (3, 3) and exact.mean_matching_prefix > 0
    # the exact engine's distributions are transformers' own; int8 activations move them
    assert 0 <= exact.mean_kl < 1e-5 < by_variant["default"].mean_kl
    assert [r["variant"] for r in json.loads(out.read_text())] == ["float32", "default"]
    assert "| float32 | 3/3 |" in capsys.readouterr().out


def test_matching_prefix_counts_until_the_first_difference() -> None:
    assert fidelity.matching_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    result = fidelity.score("x", [[1, 2], [3]], [[1, 2], [4]], seconds=1.0)
    assert (result.identical, result.mean_matching_prefix, result.output_tokens_per_s) == (
        1, 1.0, 3.0)


def test_a_variant_needs_a_name_and_json() -> None:
    with pytest.raises(ValueError, match="NAME=JSON"):
        fidelity.parse_variants(['{"dtype": "float32"}'])


def test_kl_over_the_known_tokens_and_the_rest() -> None:
    exact = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64).log()
    engine = {0: math.log(0.4), 1: math.log(0.4)}  # the rest holds 0.2 on both sides
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert fidelity_kl.coarse_kl(exact, engine) == pytest.approx(expected, rel=1e-9)
    assert fidelity_kl.coarse_kl(exact, {0: math.log(0.5)}) == pytest.approx(0, abs=1e-12)


def test_coarse_kl_is_a_lower_bound_that_is_exact_on_the_whole_vocabulary() -> None:
    generator = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(50, generator=generator, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(50, generator=generator, dtype=torch.float64), -1)
    full = float((p.exp() * (p - q)).sum())
    top = q.topk(5).indices.tolist()
    assert fidelity_kl.coarse_kl(p, {t: float(q[t]) for t in top}) < full
    whole = {t: float(q[t]) for t in range(50)}
    assert fidelity_kl.coarse_kl(p, whole) == pytest.approx(full, rel=1e-9)
