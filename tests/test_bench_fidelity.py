"""`pagellm bench fidelity` on the embedded GGUF: the exact float32 engine reproduces
transformers' float32 answers, and the report says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm.benchmarks import fidelity
from pagellm.entrypoints.cli import build_parser


def test_fidelity_scores_the_exact_model_as_identical(tmp_path: Path, capsys) -> None:
    out = tmp_path / "fidelity.json"
    args = build_parser().parse_args([
        "bench", "fidelity", "--num-prompts", "3", "--max-tokens", "12",
        "--variant", 'float32={"dtype": "float32"}', "--variant", "default={}",
        "--output-json", str(out)])
    results = args.handler(args)
    exact = {r.variant: r for r in results}["float32"]
    assert (exact.identical, exact.prompts) == (3, 3) and exact.mean_matching_prefix > 0
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
