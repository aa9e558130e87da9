"""Do huge request bodies stall everyone else? `/health` latency and the inter-token latency
of 16 streams, first alone, then while 4 clients send 20 MB chat bodies back to back.

Two servers: the default `--max-request-body-bytes` (16 MiB: the bodies get a 413, read
and dropped first while the client address's drain budget lasts, past it at once with the
connection closed) and one that accepts them (they are parsed, tokenized in the tokenizer
worker process, and refused as longer than the context).

    PYTHONPATH=$PWD python3 benchmarks/body_flood.py --seconds 45
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from pagellm.model.paths import default_model_path  # noqa: E402
from server_utils import RemoteServer  # noqa: E402

STREAMS = 16
FLOODERS = 4


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def stream_forever(client: httpx.AsyncClient, stop: float, gaps: list[float]) -> None:
    body = {"model": "flood", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 64, "ignore_eos": True, "stream": True}
    while time.perf_counter() < stop:
        last = None
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def probe_health(client: httpx.AsyncClient, stop: float, latencies: list[float]) -> None:
    while time.perf_counter() < stop:
        start = time.perf_counter()
        await client.get("/health")
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.05)


async def flood(client: httpx.AsyncClient, stop: float, body: bytes,
                answers: Counter) -> None:
    """Counts the answers by status; "413 + close" is a 413 sent before the body was read
    (the client's drain budget spent), "reset" a connection closed before any answer."""
    while time.perf_counter() < stop:
        try:
            response = await client.post("/v1/chat/completions", content=body,
                                         headers={"Content-Type": "application/json"})
        except httpx.TransportError:
            answers["reset"] += 1
            continue
        closed = response.headers.get("connection") == "close"
        answers[f"{response.status_code}{' + close' if closed else ''}"] += 1


async def measure(url: str, seconds: float, body: bytes | None) -> dict[str, object]:
    stop = time.perf_counter() + seconds
    gaps: list[float] = []
    health: list[float] = []
    answers: Counter = Counter()
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=64)) as client:
        tasks = [stream_forever(client, stop, gaps) for _ in range(STREAMS)]
        tasks.append(probe_health(client, stop, health))
        if body is not None:
            tasks += [flood(client, stop, body, answers) for _ in range(FLOODERS)]
        await asyncio.gather(*tasks)
    return {"health_p50_ms": percentile(health, 50) * 1e3,
            "health_p99_ms": percentile(health, 99) * 1e3,
            "health_max_ms": max(health) * 1e3, "itl_p50_ms": percentile(gaps, 50) * 1e3,
            "itl_p99_ms": percentile(gaps, 99) * 1e3, "tokens": len(gaps),
            "flood_answers": dict(answers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--seconds", type=float, default=45.0, help="length of each phase")
    parser.add_argument("--body-mb", type=float, default=20.0)
    args = parser.parse_args()
    model = Path(args.model) if args.model else default_model_path()
    text = "the quick brown fox jumps over the lazy dog " * int(args.body_mb * 1e6 / 44)
    body = json.dumps({"model": "flood", "max_tokens": 8,
                       "messages": [{"role": "user", "content": text}]}).encode()
    print(f"flood body: {len(body) / 1e6:.1f} MB; {STREAMS} streams, {FLOODERS} flooders, "
          f"{args.seconds:.0f} s per phase")
    for label, extra in (("default limit (16 MiB)", ()),
                         ("limit raised to 64 MB", ("--max-request-body-bytes", "64000000"))):
        remote = RemoteServer(model, "--served-model-name", "flood", "--max-model-len", "2048",
                              *extra, startup_timeout=600)
        try:
            for phase, flood_body in (("alone", None), ("under flood", body)):
                figures = asyncio.run(measure(remote.url, args.seconds, flood_body))
                print(f"{label:24s} {phase:12s} " + ", ".join(
                    f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in figures.items()))
        finally:
            remote.stop()


if __name__ == "__main__":
    main()
