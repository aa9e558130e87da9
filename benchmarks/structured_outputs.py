"""What JSON-schema constraints cost a server: output tokens/s and inter-token latency at
1, 16 and 64 concurrent streaming clients with every request constrained vs none, and the
time to first token of a schema the server has not seen (compiled while the request waits)
against one it has (cached) and an unconstrained request.

Like is compared with like: a constrained answer ends when its JSON does, so the
unconstrained run that follows gives each request exactly the output length its
constrained counterpart had (`ignore_eos`, `max_tokens` = that length): both runs make the
same number of tokens in the same number of steps, and tok/s differ only by the cost of
the constraint. ITL is per output token (a request's last token time minus its first,
over its tokens after the first): one decode step's time at that batch size.

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
from dataclasses import dataclass

import openai
from server_health import wait_healthy

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON: name, age, city, hobbies."}]


@dataclass
class Streamed:
    ttft: float  # seconds to the first content token
    decode_time: float  # seconds from the first content token to the last
    tokens: int  # output tokens (usage)


@dataclass
class LoadResult:
    tokens_per_s: float
    itl_ms: float  # per output token after the first, over all requests
    lengths: list[int]  # output tokens of request i


async def one_request(client: openai.AsyncOpenAI, model: str, max_tokens: int,
                      schema: dict | None) -> Streamed:
    """One streamed request: constrained by `schema`, or unconstrained running to max_tokens."""
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
    if not stamps:
        return Streamed(float("nan"), 0.0, tokens)
    return Streamed(stamps[0] - start, stamps[-1] - stamps[0], tokens)


async def load(client: openai.AsyncOpenAI, model: str, clients: int,
               max_tokens: list[int], schema: dict | None) -> LoadResult:
    """`clients` streams at once work through one request per entry of `max_tokens`."""
    queue = list(enumerate(max_tokens))
    results: dict[int, Streamed] = {}

    async def worker() -> None:
        while queue:
            index, budget = queue.pop(0)
            results[index] = await one_request(client, model, budget, schema)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    done = [results[i] for i in range(len(max_tokens))]
    later_tokens = sum(max(r.tokens - 1, 0) for r in done)
    return LoadResult(tokens_per_s=sum(r.tokens for r in done) / elapsed,
                      itl_ms=1e3 * sum(r.decode_time for r in done) / max(later_tokens, 1),
                      lengths=[r.tokens for r in done])


async def compare(client: openai.AsyncOpenAI, model: str, clients: int, requests: int,
                  max_tokens: int) -> None:
    """Constrained first; then unconstrained with the constrained answers' lengths."""
    constrained = await load(client, model, clients, [max_tokens] * requests, SCHEMA)
    free = await load(client, model, clients, [max(n, 1) for n in constrained.lengths], None)
    for mode, result in (("unconstrained", free), ("json_schema", constrained)):
        print(f"{clients:>7} {mode:>13} {result.tokens_per_s:>8.1f} {result.itl_ms:>8.1f} "
              f"{statistics.mean(result.lengths):>8.1f}")
    slower = 100 * (1 - constrained.tokens_per_s / free.tokens_per_s)
    longer = 100 * (constrained.itl_ms / free.itl_ms - 1)
    print(f"{'':>7} {'cost':>13} {slower:>7.1f}% {longer:>7.1f}%")


async def first_seen_ttft(client: openai.AsyncOpenAI, model: str) -> dict[str, float]:
    """Median TTFT (ms) of 3 never-seen schemas, of the last one again, and unconstrained."""
    fresh, cached, plain = [], [], []
    for _ in range(3):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"],
                                           f"id_{uuid.uuid4().hex[:8]}": {"type": "integer"}}}
        fresh.append((await one_request(client, model, 8, schema)).ttft)
        cached.append((await one_request(client, model, 8, schema)).ttft)
        plain.append((await one_request(client, model, 8, None)).ttft)
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
    await one_request(client, args.model, 8, SCHEMA)  # the schema compiled, the server warm
    print(f"{'clients':>7} {'mode':>13} {'tok/s':>8} {'ITL ms':>8} {'tokens':>8}")
    for clients in args.clients:
        await compare(client, args.model, clients, max(clients, args.min_requests),
                      args.max_tokens)
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
