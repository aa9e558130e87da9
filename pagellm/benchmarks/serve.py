"""`pagellm bench serve`: load-test any OpenAI-compatible server, with `vllm bench serve`'s
flags and result block.

Requests stream (`stream_options.include_usage`) and are sent at `--request-rate` per second
(gamma-distributed gaps: Poisson arrivals for `--burstiness 1`; `inf` sends all at once),
at most `--max-concurrency` at a time. TTFT is the first text chunk, ITL each later chunk's gap,
TPOT = (latency - TTFT) / (output tokens - 1), output tokens from `usage.completion_tokens`
or else by tokenizing the text. Prompts are sized with the server's `/tokenize` unless
`--tokenizer` names a local one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from pagellm.benchmarks.datasets import SampleRequest, add_dataset_args, sample_requests
from pagellm.benchmarks.serve_client import (
    BACKENDS,
    DEFAULT_ENDPOINTS,
    Endpoint,
    RequestOutput,
    auth_headers,
    env_api_key,
    fetch_model_id,
    open_tokenizer,
    send_request,
)
from pagellm.benchmarks.serve_metrics import (
    METRICS,
    RunInfo,
    compute_metrics,
    count_output_tokens,
    format_result,
    result_json,
)

REQUEST_TIMEOUT_S = 6 * 60 * 60.0
SETUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Traffic:
    """When requests are sent: rate (req/s, may be inf), burstiness, concurrency cap, seed."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int


@dataclass(frozen=True)
class BenchmarkRun:
    outputs: list[RequestOutput]
    duration: float


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="openai",
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    parser.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None,
                        help="API path (default: /v1/completions or /v1/chat/completions)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--tokenizer", default=None,
                        help="local HF tokenizer folder or .gguf file (default: the server's "
                             "/tokenize, else the embedded model's tokenizer)")
    add_dataset_args(parser)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second; inf sends them all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send vLLM's ignore_eos so every request generates max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help=f"comma-separated, of {','.join(METRICS)}")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,99")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")


def arrival_intervals(num: int, request_rate: float, burstiness: float,
                      rng: random.Random) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness, mean=1/rate); zeros for rate inf."""
    if math.isinf(request_rate):
        return [0.0] * num
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


def send_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent. The cumulative gaps are rescaled
    so that the last request goes out at num / rate: the run keeps the configured mean rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive.")
    offsets = []
    total = 0.0
    for gap in arrival_intervals(num, request_rate, burstiness, random.Random(seed)):
        total += gap
        offsets.append(total)
    if math.isinf(request_rate) or total == 0.0:
        return offsets
    return [offset * (num / request_rate) / total for offset in offsets]


async def benchmark(endpoint: Endpoint, samples: Sequence[SampleRequest], traffic: Traffic,
                    disable_tqdm: bool = False) -> BenchmarkRun:
    """Send every sample at its offset (waiting for a concurrency slot) and gather outputs."""
    offsets = send_offsets(len(samples), traffic.request_rate, traffic.burstiness, traffic.seed)
    connections = traffic.max_concurrency or len(samples)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    slots = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else None
    progress = tqdm(total=len(samples), disable=disable_tqdm)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:
        start = time.perf_counter()

        async def one(sample: SampleRequest, offset: float) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with slots or contextlib.nullcontext():
                output = await send_request(client, endpoint, sample)
            progress.update(1)
            return output

        outputs = await asyncio.gather(*(one(s, o) for s, o in zip(samples, offsets)))
        duration = time.perf_counter() - start
    progress.close()
    return BenchmarkRun(list(outputs), duration)


def parse_metric_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    selected = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in selected if m not in METRICS]
    if unknown:
        raise ValueError(f"Unknown --percentile-metrics {unknown}; choose from {list(METRICS)}.")
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p.strip())
    if any(not 0 < p < 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be between 0 and 100.")
    return selected, percentiles


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def print_traffic(traffic: Traffic) -> None:
    shape = "Poisson process" if traffic.burstiness == 1.0 else "Gamma distribution"
    print(f"Traffic request rate: {traffic.request_rate}")
    print(f"Burstiness factor: {traffic.burstiness} ({shape})")
    print(f"Maximum request concurrency: {traffic.max_concurrency}", flush=True)


def report_failures(outputs: Sequence[RequestOutput]) -> None:
    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"{len(failed)} of {len(outputs)} requests failed. First error: {failed[0].error}")


def result_path(args: argparse.Namespace, info: RunInfo, date: str) -> Path:
    concurrency = f"-concurrency{info.max_concurrency}" if info.max_concurrency else ""
    name = args.result_filename or (f"{info.backend}-{args.request_rate}qps{concurrency}-"
                                    f"{info.model_id.split('/')[-1]}-{date}.json")
    return Path(args.result_dir or ".") / name


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Benchmark the server, print vLLM's result block, and return (and maybe save) the JSON."""
    selected, percentiles = parse_metric_args(args)
    traffic = Traffic(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    base_url = base_url_of(args)
    api_key = env_api_key()
    with httpx.Client(base_url=base_url, headers=auth_headers(api_key),
                      timeout=SETUP_TIMEOUT_S) as client:
        try:
            model = args.model or fetch_model_id(client)
            tokenizer, tokenizer_id = open_tokenizer(args.tokenizer, client, model)
        except httpx.TransportError as error:
            raise ValueError(f"Cannot reach the server at {base_url}: {error}") from error
        samples = sample_requests(args, tokenizer)
        endpoint = Endpoint(base_url + (args.endpoint or DEFAULT_ENDPOINTS[args.backend]),
                            args.backend, model, api_key, args.ignore_eos, args.temperature)
        print_traffic(traffic)
        bench = asyncio.run(benchmark(endpoint, samples, traffic, args.disable_tqdm))
        output_lens = count_output_tokens(bench.outputs, tokenizer)
    info = RunInfo(args.backend, model, tokenizer_id, len(samples), args.request_rate,
                   args.burstiness, args.max_concurrency, selected, percentiles)
    metrics = compute_metrics(bench.outputs, output_lens, bench.duration, percentiles)
    report_failures(bench.outputs)
    print(format_result(metrics, info), flush=True)
    result = result_json(metrics, info, bench.outputs, output_lens)
    if args.save_result:
        path = result_path(args, info, result["date"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        print(f"Saved the result to {path}")
    return result
