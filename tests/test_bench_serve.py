"""`pagellm bench serve` against an in-process fake streaming OpenAI server."""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_openai_server import FAILURE_MESSAGE, MODEL_ID, FakeOpenAIServer, WordTokenizer
from server_utils import free_port
from tiny_models import build_tiny_tokenizer

from pagellm.benchmarks import datasets
from pagellm.benchmarks.serve import (add_cli_args, arrival_intervals, parse_metric_args, run,
                                      send_offsets)
from pagellm.benchmarks.serve_client import LocalTokenizer, RequestOutput
from pagellm.benchmarks.serve_metrics import compute_metrics

BANNER = "============ Serving Benchmark Result ============"
HEAD_LABELS = ["Successful requests:", "Failed requests:"]
TAIL_LABELS = ["Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
               "Request throughput (req/s):", "Output token throughput (tok/s):",
               "Peak output token throughput (tok/s):", "Peak concurrent requests:",
               "Total token throughput (tok/s):"]
SECTIONS = {"ttft": ("---------------Time to First Token----------------", "TTFT"),
            "tpot": ("-----Time per Output Token (excl. 1st token)------", "TPOT"),
            "itl": ("---------------Inter-token Latency----------------", "ITL"),
            "e2el": ("----------------End-to-end Latency----------------", "E2EL")}
INT_LABELS = {"Successful requests:", "Failed requests:", "Maximum request concurrency:",
              "Total input tokens:", "Total generated tokens:"}


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server(fake_server: FakeOpenAIServer) -> FakeOpenAIServer:
    fake_server.reset()
    return fake_server


def bench_args(server: FakeOpenAIServer, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(["--base-url", server.url, "--disable-tqdm", "--num-prompts", "6",
                              "--random-input-len", "16", "--random-output-len", "5", *extra])


def result_block(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index(BANNER)
    end = lines.index("=" * 50, start)
    return lines[start:end + 1]


def check_layout(block: list[str], head: list[str], metrics: list[str],
                 percentiles: list[str]) -> None:
    """Labels in vLLM's order, left in 40 columns; values after one space, left in 10."""
    expected: list[str] = [BANNER, *HEAD_LABELS, *head, *TAIL_LABELS]
    for key in metrics:
        title, short = SECTIONS[key]
        expected += [title, f"Mean {short} (ms):", f"Median {short} (ms):"]
        expected += [f"P{p} {short} (ms):" for p in percentiles]
    expected.append("=" * 50)
    labels = []
    for line in block:
        match = re.fullmatch(r"(.{40}) (\S+) *", line)
        if line in (BANNER, "=" * 50) or line.startswith("-"):
            assert len(line) == 50
            labels.append(line)
            continue
        assert match and len(line) == 51, line
        label, value = match.group(1).rstrip(), match.group(2)
        assert re.fullmatch(r"\d+" if label in INT_LABELS else r"\d+\.\d\d", value), line
        labels.append(label)
    assert labels == expected


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_run_both_backends(server: FakeOpenAIServer, backend: str, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    result = run(bench_args(server, "--backend", backend, "--ignore-eos", "--save-result",
                            "--result-dir", str(tmp_path), "--percentile-metrics",
                            "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"))
    out = capsys.readouterr().out
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_input_tokens"] == 6 * 16 and result["input_lens"] == [16] * 6
    assert result["total_output_tokens"] == 6 * 5 and result["output_lens"] == [5] * 6
    assert result["model_id"] == MODEL_ID and result["tokenizer_id"].endswith("/tokenize")
    check_layout(result_block(out), [], ["ttft", "tpot", "itl", "e2el"], ["50", "99"])
    path = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    assert server.state.paths == [path] * 6
    for body in server.state.bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["model"] == MODEL_ID
        assert body["max_completion_tokens" if backend == "openai-chat" else "max_tokens"] == 5
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved == result
    # TPOT: the per-request formula over the recorded timings, averaged.
    tpots = [(e - t) / (n - 1) for e, t, n in zip(saved["e2els"], saved["ttfts"],
                                                   saved["output_lens"])]
    assert saved["mean_tpot_ms"] == pytest.approx(statistics.fmean(tpots) * 1000, rel=1e-9)
    assert all(len(itl) == 4 for itl in saved["itls"])
    assert saved["generated_texts"] == [" tok" * 5] * 6 and saved["errors"] == [""] * 6
    for key in ("date", "backend", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "median_ttft_ms", "std_itl_ms", "p99_e2el_ms"):
        assert key in saved
    assert saved["request_rate"] == "inf" and saved["backend"] == backend


def test_failures_are_counted_and_first_error_printed(
        server: FakeOpenAIServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.reset(fail_every=3)
    result = run(bench_args(server, "--backend", "openai-chat"))
    out = capsys.readouterr().out
    assert (result["completed"], result["failed"]) == (4, 2)
    assert f"2 of 6 requests failed. First error: HTTP 400: {FAILURE_MESSAGE}" in out
    assert result["total_input_tokens"] == 4 * 16 and result["total_output_tokens"] == 4 * 5
    assert sorted(result["errors"]) == ["", "", "", ""] + [f"HTTP 400: {FAILURE_MESSAGE}"] * 2
    block = result_block(out)
    assert "Failed requests:                         2         " in block


def test_max_concurrency_and_request_rate(server: FakeOpenAIServer,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    server.reset(chunk_delay_s=0.005)
    result = run(bench_args(server, "--num-prompts", "8", "--max-concurrency", "2",
                            "--request-rate", "200", "--metric-percentiles", "99.9"))
    block = result_block(capsys.readouterr().out)
    assert server.state.peak <= 2 and 1 <= result["max_concurrent_requests"] <= 2
    assert result["completed"] == 8 and result["max_concurrency"] == 2
    check_layout(block, ["Maximum request concurrency:", "Request rate configured (RPS):"],
                 ["ttft", "tpot", "itl"], ["99.9"])
    assert "Maximum request concurrency:             2         " in block
    assert "Request rate configured (RPS):           200.00    " in block
    assert "p99.9_ttft_ms" in result


def test_sharegpt_without_usage_counts_by_tokenizing(server: FakeOpenAIServer,
                                                     tmp_path: Path) -> None:
    server.reset(send_usage=False, chunk_delay_s=0.0005)
    path = datasets.write_sharegpt(tmp_path / "sharegpt.json", 40, seed=1)
    args = bench_args(server, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                      "--num-prompts", "4", "--seed", "2")
    expected = datasets.sample_sharegpt(path, 4, WordTokenizer(), random.Random(2))
    result = run(args)
    assert result["input_lens"] == [s.prompt_len for s in expected]
    assert result["output_lens"] == [s.expected_output_len for s in expected]
    assert result["total_output_tokens"] == sum(s.expected_output_len for s in expected)


def test_compute_metrics_formulas() -> None:
    outputs = [RequestOutput(10, start_time=0.0, end_time=0.55, success=True, ttft=0.1,
                             itl=[0.1, 0.1, 0.1, 0.1], latency=0.5),
               RequestOutput(20, start_time=0.2, end_time=0.45, success=True, ttft=0.2,
                             latency=0.2),
               RequestOutput(30, start_time=0.3, end_time=0.35, error="HTTP 500: boom"),
               RequestOutput(40, start_time=0.7, end_time=2.5, success=True, ttft=0.4,
                             itl=[0.3, 0.3], latency=1.0)]
    metrics = compute_metrics(outputs, [5, 1, 0, 4], duration=2.0, percentiles=[50])
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.total_input, metrics.total_output) == (70, 10)
    # TPOT = (latency - ttft) / (tokens - 1): 0.4/4 and 0.6/3; the 1-token request has none.
    assert metrics.stats["tpot"].mean == pytest.approx((0.1 + 0.2) / 2 * 1000)
    assert metrics.stats["ttft"].mean == pytest.approx((0.1 + 0.2 + 0.4) / 3 * 1000)
    assert metrics.stats["itl"].median == pytest.approx(100.0)
    assert metrics.stats["e2el"].percentiles[50] == pytest.approx(500.0)
    assert metrics.peak_concurrency == 3
    # Chunks arrive at 0.1..0.5 (5), 0.4 (1), 1.1, 1.4, 1.7 (3): 6 within second 0.
    assert metrics.peak_output_throughput == 6.0
    assert metrics.total_token_throughput == pytest.approx((70 + 10) / 2.0)


def test_send_offsets_and_arrival_intervals() -> None:
    assert send_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5
    offsets = send_offsets(400, 20.0, 1.0, seed=3)
    assert len(offsets) == 400 and offsets == sorted(offsets)
    assert offsets[-1] == pytest.approx(400 / 20.0)
    assert offsets == send_offsets(400, 20.0, 1.0, seed=3) != send_offsets(400, 20.0, 1.0, 4)
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        gaps = arrival_intervals(20000, 20.0, burstiness, random.Random(0))
        assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.05)
    with pytest.raises(ValueError):
        send_offsets(3, 0.0, 1.0, seed=0)


def test_synthetic_sharegpt_shape(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    assert datasets.main(["make-sharegpt", "--out", str(path), "--num", "2000",
                          "--seed", "0"]) == 0
    entries = json.loads(path.read_text())
    assert len(entries) == 2000 and len({e["id"] for e in entries}) == 2000
    assert all([t["from"] for t in e["conversations"]] == ["human", "gpt"] for e in entries)

    def tokens(text: str) -> int:  # prose: each word and each full stop is one token
        return len(text.split()) + text.count(".")

    prompts = [tokens(e["conversations"][0]["value"]) for e in entries]
    replies = [tokens(e["conversations"][1]["value"]) for e in entries]
    assert 90 <= statistics.median(prompts) <= 150 and 200 <= statistics.fmean(prompts) <= 330
    assert 120 <= statistics.median(replies) <= 180 and 200 <= statistics.fmean(replies) <= 290
    assert max(prompts) > 1024 and max(replies) > 1024
    kept = [p for p, r in zip(prompts, replies) if datasets.keep_sharegpt(p, r, False)]
    assert 0.85 < len(kept) / len(entries) < 0.99 and 160 <= statistics.fmean(kept) <= 230


def test_sharegpt_loader_filters_like_vllm(tmp_path: Path) -> None:
    def conversation(*turns: tuple[str, int]) -> dict:
        return {"conversations": [{"from": who, "value": " ".join(["w"] * n)}
                                  for who, n in turns]}

    entries = [conversation(("human", 10), ("gpt", 20)),       # kept
               conversation(("system", 5), ("user", 8), ("assistant", 6)),  # kept
               conversation(("human", 3), ("gpt", 20)),        # prompt < 4
               conversation(("human", 10), ("gpt", 3)),        # reply < 4
               conversation(("human", 1025), ("gpt", 10)),     # prompt > 1024
               conversation(("human", 1000), ("gpt", 1049)),   # total > 2048
               conversation(("human", 10)),                    # no reply
               {"id": "empty"}]
    path = tmp_path / "real.json"
    path.write_text(json.dumps(entries))
    samples = datasets.sample_sharegpt(path, 4, WordTokenizer(), random.Random(0))
    assert sorted({(s.prompt_len, s.expected_output_len) for s in samples}) == [(8, 6), (10, 20)]
    assert len(samples) == 4
    fixed = datasets.sample_sharegpt(path, 10, WordTokenizer(), random.Random(0), output_len=3)
    assert sorted({s.prompt_len for s in fixed}) == [8, 10, 1000]
    assert {s.expected_output_len for s in fixed} == {3}


def test_random_and_prefix_repetition_lengths() -> None:
    tokenizer = WordTokenizer()
    samples = datasets.sample_random(tokenizer, random.Random(0), 50, 20, 10, 0.5, 7)
    targets = datasets.uniform_lengths(random.Random(0), 50, 20, 0.5)
    assert [s.prompt_len for s in samples] == [7 + t for t in targets]
    assert all(len(tokenizer.encode(s.prompt)) == s.prompt_len for s in samples)
    assert all(10 <= t <= 30 for t in targets) and len(set(targets)) > 5
    assert len({tuple(s.prompt.split()[:7]) for s in samples}) == 1
    assert all(5 <= s.expected_output_len <= 15 for s in samples)
    repeated = datasets.sample_prefix_repetition(tokenizer, random.Random(0), 12, 8, 4, 3, 7)
    assert [(s.prompt_len, s.expected_output_len) for s in repeated] == [(12, 7)] * 12
    assert sorted(Counter(tuple(s.prompt.split()[:8]) for s in repeated).values()) == [4, 4, 4]
    with pytest.raises(ValueError):
        datasets.uniform_lengths(random.Random(0), 1, 10, 1.0)


def test_local_tokenizer_exact_lengths(server: FakeOpenAIServer, tmp_path: Path) -> None:
    folder = tmp_path / "tokenizer"
    build_tiny_tokenizer(add_bos=True).save_pretrained(folder)
    result = run(bench_args(server, "--tokenizer", str(folder), "--num-prompts", "3",
                            "--random-input-len", "40", "--random-prefix-len", "8"))
    assert result["tokenizer_id"] == str(folder) and result["input_lens"] == [48] * 3
    prompts = [b["prompt"] for b in server.state.bodies]
    tokenizer = LocalTokenizer(folder)
    assert [len(tokenizer.encode(p)) for p in prompts] == [48] * 3


def test_unreachable_server_is_one_clear_error() -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    port = str(free_port())
    for extra in ([], ["--model", "named"]):
        with pytest.raises(ValueError, match="Cannot reach the server"):
            run(parser.parse_args(["--port", port, "--disable-tqdm", *extra]))


def test_bad_metric_flags(server: FakeOpenAIServer) -> None:
    with pytest.raises(ValueError, match="Unknown --percentile-metrics"):
        parse_metric_args(bench_args(server, "--percentile-metrics", "ttft,latency"))
    with pytest.raises(ValueError, match="between 0 and 100"):
        parse_metric_args(bench_args(server, "--metric-percentiles", "100"))
