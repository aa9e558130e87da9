"""What JSON-schema constraints cost a server: output tokens/s and inter-token latency at
1, 16 and 64 concurrent streaming clients with every request constrained vs none, and the
time to first token of a schema the server has not seen (compiled while the request waits)
against one it has (cached) and an unconstrained request.

    python benchmarks/structured_outputs.py                 # starts `pagellm serve` (embedded)
    python benchmarks/structured_outputs.py --base-url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid

import openai
from server_health import wait_healthy

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON: name, age, city, hobbies."}]


async def one_request(client: openai.AsyncOpenAI, model: str, max_tokens: int,
                      schema: dict | None) -> tuple[float, list[float], int]:
    """(time to first token, gaps between tokens, output tokens) of one streamed request."""
    extra = {"ignore_eos": True} if schema is None else {}
    kwargs = {} if schema is None else {"response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0.7, stream=True,
        stream_options={"include_usage": True}, extra_body=extra, **kwargs)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return (stamps[0] - start if stamps else float("nan")), gaps, tokens


async def load(client: openai.AsyncOpenAI, model: str, clients: int, requests: int,
               max_tokens: int, schema: dict | None) -> tuple[float, float]:
    """(output tokens/s, mean inter-token latency in ms) with `clients` streams at once."""
    queue = list(range(requests))
    gaps: list[float] = []
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            queue.pop()
            _, request_gaps, tokens = await one_request(client, model, max_tokens, schema)
            gaps.extend(request_gaps)
            total += tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return total / (time.perf_counter() - start), statistics.mean(gaps) * 1e3


async def first_seen_ttft(client: openai.AsyncOpenAI, model: str) -> dict[str, float]:
    """Median TTFT (ms) of 3 never-seen schemas, of the last one again, and unconstrained."""
    fresh, cached, plain = [], [], []
    for _ in range(3):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                           f"id_{uuid.uuid4().hex[:8]}": {"type": "integer"}}}
        fresh.append((await one_request(client, model, 8, schema))[0])
        cached.append((await one_request(client, model, 8, schema))[0])
        plain.append((await one_request(client, model, 8, None))[0])
    return {name: statistics.median(values) * 1e3
            for name, values in (("first-seen schema", fresh), ("cached schema", cached),
                                 ("unconstrained", plain))}


def start_server(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", str(port),
               "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "warning"]
    server = subprocess.Popen(command, env=os.environ.copy())
    wait_healthy(server, f"http://127.0.0.1:{port}", timeout=600, poll_seconds=1)
    return server


async def main(args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key="EMPTY", timeout=600)
    print(f"{'clients':>7} {'mode':>12} {'tok/s':>8} {'ITL ms':>8}")
    for clients in args.clients:
        rates = {}
        for mode, schema in (("unconstrained", None), ("json_schema", SCHEMA)):
            rate, itl = await load(client, args.model, clients, max(clients, args.min_requests),
                                   args.max_tokens, schema)
            rates[mode] = rate
            print(f"{clients:>7} {mode:>12} {rate:>8.1f} {itl:>8.1f}")
        print(f"{'':>7} {'slowdown':>12} {100 * (1 - rates['json_schema'] / rates['unconstrained']):>7.1f}%")
    for name, value in (await first_seen_ttft(client, args.model)).items():
        print(f"TTFT {name}: {value:.0f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8123)
    arguments = parser.parse_args()
    process = None
    if arguments.base_url is None:
        process = start_server(arguments.port)
        arguments.base_url = f"http://127.0.0.1:{arguments.port}"
    try:
        asyncio.run(main(arguments))
    finally:
        if process is not None:
            process.terminate()
            process.wait()
