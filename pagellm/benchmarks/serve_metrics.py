"""Metrics of a `pagellm bench serve` run, printed as vLLM's result block and saved as its JSON."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np

from pagellm.benchmarks.datasets import TextTokenizer
from pagellm.benchmarks.serve_client import RequestOutput

# key -> (section title, short name), in vLLM's order.
METRICS: dict[str, tuple[str, str]] = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
WIDTH = 50


@dataclass(frozen=True)
class MetricStats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
        values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
        return cls(float(values.mean()), float(np.median(values)), float(values.std()),
                   {p: float(np.percentile(values, p)) for p in percentiles})


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    peak_output_throughput: float
    peak_concurrency: int
    stats: dict[str, MetricStats]

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration

    @property
    def output_throughput(self) -> float:
        return self.total_output / self.duration

    @property
    def total_token_throughput(self) -> float:
        return (self.total_input + self.total_output) / self.duration


@dataclass(frozen=True)
class RunInfo:
    """What was benchmarked, and how: the non-measured fields of the result JSON."""

    backend: str
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    percentile_metrics: tuple[str, ...]
    percentiles: tuple[float, ...]


def count_output_tokens(outputs: Sequence[RequestOutput], tokenizer: TextTokenizer) -> list[int]:
    """Each request's output tokens: the server's `usage.completion_tokens` when it sent one,
    else the generated text's token count; 0 for failed requests."""
    counts = []
    for output in outputs:
        if not output.success:
            counts.append(0)
        elif output.usage_tokens is not None:
            counts.append(output.usage_tokens)
        else:
            counts.append(len(tokenizer.encode(output.generated_text)))
    return counts


def request_tpot(output: RequestOutput, output_tokens: int) -> float | None:
    """(latency - TTFT) / (output tokens - 1); undefined below two output tokens."""
    if not output.success or output_tokens < 2:
        return None
    return (output.latency - output.ttft) / (output_tokens - 1)


def metric_series(outputs: Sequence[RequestOutput],
                  output_lens: Sequence[int]) -> dict[str, list[float]]:
    """Per-metric samples in seconds, from successful requests (ITL: every gap of every one)."""
    done = [(o, n) for o, n in zip(outputs, output_lens) if o.success]
    tpots = [request_tpot(o, n) for o, n in done]
    return {"ttft": [o.ttft for o, _ in done],
            "tpot": [t for t in tpots if t is not None],
            "itl": [gap for o, _ in done for gap in o.itl],
            "e2el": [o.latency for o, _ in done]}


def peak_output_throughput(outputs: Sequence[RequestOutput]) -> float:
    """Most streamed text chunks received within one whole second counted from the first
    request's start (vLLM's buckets: one chunk is one token for a token-by-token stream)."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0
    origin = min(o.start_time for o in done)
    buckets: Counter[int] = Counter()
    for output in done:
        arrival = output.start_time + output.ttft
        for gap in (0.0, *output.itl):
            arrival += gap
            buckets[int(arrival - origin)] += 1
    return float(max(buckets.values()))


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at one instant (from their start and end times). vLLM counts
    requests active in the same whole second instead, which can exceed --max-concurrency."""
    events = sorted([(o.start_time, 1) for o in outputs] + [(o.end_time, -1) for o in outputs])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


def compute_metrics(outputs: Sequence[RequestOutput], output_lens: Sequence[int],
                    duration: float, percentiles: Sequence[float]) -> BenchmarkMetrics:
    series = metric_series(outputs, output_lens)
    done = [(o, n) for o, n in zip(outputs, output_lens) if o.success]
    return BenchmarkMetrics(
        completed=len(done), failed=len(outputs) - len(done),
        total_input=sum(o.prompt_len for o, _ in done), total_output=sum(n for _, n in done),
        duration=duration, peak_output_throughput=peak_output_throughput(outputs),
        peak_concurrency=peak_concurrency(outputs),
        stats={key: MetricStats.of(values, percentiles) for key, values in series.items()})


def percentile_label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _line(label: str, value: int | float) -> str:
    if isinstance(value, int):
        return f"{label:<40} {value:<10}"
    return f"{label:<40} {value:<10.2f}"


def format_result(metrics: BenchmarkMetrics, info: RunInfo) -> str:
    """vLLM's `Serving Benchmark Result` block."""
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}",
             _line("Successful requests:", metrics.completed),
             _line("Failed requests:", metrics.failed)]
    if info.max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", info.max_concurrency))
    if not math.isinf(info.request_rate):
        lines.append(_line("Request rate configured (RPS):", float(info.request_rate)))
    lines += [_line("Benchmark duration (s):", metrics.duration),
              _line("Total input tokens:", metrics.total_input),
              _line("Total generated tokens:", metrics.total_output),
              _line("Request throughput (req/s):", metrics.request_throughput),
              _line("Output token throughput (tok/s):", metrics.output_throughput),
              _line("Peak output token throughput (tok/s):", metrics.peak_output_throughput),
              _line("Peak concurrent requests:", float(metrics.peak_concurrency)),
              _line("Total token throughput (tok/s):", metrics.total_token_throughput)]
    for key in info.percentile_metrics:
        title, short = METRICS[key]
        stats = metrics.stats[key]
        lines += [f"{title:-^{WIDTH}}", _line(f"Mean {short} (ms):", stats.mean),
                  _line(f"Median {short} (ms):", stats.median)]
        lines += [_line(f"P{percentile_label(p)} {short} (ms):", value)
                  for p, value in stats.percentiles.items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_json(metrics: BenchmarkMetrics, info: RunInfo, outputs: Sequence[RequestOutput],
                output_lens: Sequence[int]) -> dict[str, Any]:
    """vLLM's result JSON: run settings, totals, per-metric summaries (ms), per-request lists
    (seconds), plus `failed`, `e2els` and the peaks."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": info.backend,
        "model_id": info.model_id, "tokenizer_id": info.tokenizer_id,
        "num_prompts": info.num_prompts,
        "request_rate": "inf" if math.isinf(info.request_rate) else info.request_rate,
        "burstiness": info.burstiness, "max_concurrency": info.max_concurrency,
        "duration": metrics.duration, "completed": metrics.completed, "failed": metrics.failed,
        "total_input_tokens": metrics.total_input, "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.peak_output_throughput,
        "max_concurrent_requests": metrics.peak_concurrency,
    }
    for key, stats in metrics.stats.items():
        result[f"mean_{key}_ms"] = stats.mean
        result[f"median_{key}_ms"] = stats.median
        result[f"std_{key}_ms"] = stats.std
        result.update({f"p{percentile_label(p)}_{key}_ms": v for p, v in stats.percentiles.items()})
    result.update({
        "input_lens": [o.prompt_len for o in outputs], "output_lens": list(output_lens),
        "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
        "e2els": [o.latency for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs]})
    return result
