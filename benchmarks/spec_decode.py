"""What speculative decoding buys: output tokens/s of one stream and of 16 concurrent
streaming clients, without speculation and with n-gram speculation (adaptive, as served by
default, and at a fixed k), on an editing workload whose output repeats its input and on a
chat workload whose output does not; then a draft-model run on a tiny random pair of one
tokenizer (random weights: it measures the machinery's cost, not a real draft's gain).

    python benchmarks/spec_decode.py                     # all of it, about 4 minutes
    python benchmarks/spec_decode.py --only ngram --requests 4 --max-tokens 32   # a quick look

Each configuration gets its own `pagellm serve` (the embedded SmolLM2-135M for n-gram);
every request is greedy, so each configuration produces the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
from server_health import wait_healthy

from pagellm.benchmarks.datasets import prose

ROOT = Path(__file__).resolve().parent.parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
TOPICS = ["a lighthouse keeper", "the first snow", "a lost key", "a robot learning to paint",
          "a market at dawn", "two rival bakers", "a train that never stops", "an old map"]


def edit_prompts(count: int, seed: int = 0) -> list[str]:
    """Correct-and-repeat requests: the answer copies a passage of ~150 tokens."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        passage = prose(rng, 150).replace(" the ", " teh ", 3)
        prompts.append("Fix the spelling mistakes in this text and write out the whole corrected "
                       f"text, nothing else:\n\n{passage}")
    return prompts


def chat_prompts(count: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(count)]


async def one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> int:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    tokens = 0
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


async def rate(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> float:
    """Output tokens/s with `clients` streams at once working through `prompts`."""
    queue = list(prompts)
    total = 0

    async def worker(client: openai.AsyncOpenAI) -> None:
        nonlocal total
        while queue:
            tokens = await one(client, model, queue.pop(), max_tokens)
            total += tokens  # after the await: `total += await ...` would read total before it

    # closed inside this event loop (asyncio.run closes it after), not by the collector later
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="EMPTY", timeout=600) as client:
        await one(client, model, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return total / (time.perf_counter() - start)


def serve(port: int, model: str | None, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *([model] if model else []),
               "--port", str(port), "--served-model-name", "m", "--disable-log-requests",
               "--uvicorn-log-level", "warning", *extra]
    server = subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.DEVNULL)
    wait_healthy(server, f"http://127.0.0.1:{port}", timeout=600, poll_seconds=0.5)
    return server


def run_config(args: argparse.Namespace, label: str, model: str | None, extra: list[str],
               workloads: dict[str, list[str]]) -> None:
    server = serve(args.port, model, extra)
    try:
        for workload, prompts in workloads.items():
            for clients in (1, 16):
                count = args.requests if clients == 1 else max(args.requests, 16)
                figure = asyncio.run(rate(f"http://127.0.0.1:{args.port}", "m",
                                          (prompts * 16)[:count], clients, args.max_tokens))
                print(f"{label:<22} {workload:<6} {clients:>7} {figure:>9.1f}", flush=True)
    finally:
        server.terminate()
        server.wait()


def tiny_pair(folder: Path) -> tuple[str, str]:
    """(target, draft): two tiny random llamas of one tokenizer, from the tests' builder."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_model

    return (str(build_tiny_model(folder / "target", "llama", seed=0)),
            str(build_tiny_model(folder / "draft", "llama", seed=1)))


def main(args: argparse.Namespace) -> None:
    print(f"{'configuration':<22} {'load':<6} {'clients':>7} {'tok/s':>9}")
    workloads = {"edit": edit_prompts(16), "chat": chat_prompts(16)}
    if args.only in (None, "ngram"):
        for label, extra in (("none", []),
                             ("ngram adaptive", ["--speculative-config", json.dumps(NGRAM)]),
                             ("ngram fixed k=4", ["--speculative-config", json.dumps(
                                 {**NGRAM, "disable_adaptive": True})])):
            run_config(args, label, None, extra, workloads)
    if args.only in (None, "draft"):
        with tempfile.TemporaryDirectory() as folder:
            target, draft = tiny_pair(Path(folder))
            config = {"model": draft, "num_speculative_tokens": 3}
            for label, extra in (("tiny pair: none", []),
                                 ("tiny pair: draft", ["--speculative-config", json.dumps(config)]),
                                 ("tiny pair: draft k=3", ["--speculative-config", json.dumps(
                                     {**config, "disable_adaptive": True})])):
                run_config(args, label, target, ["--dtype", "float32", *extra],
                           {"chat": workloads["chat"]})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["ngram", "draft"], default=None)
    parser.add_argument("--requests", type=int, default=4, help="requests of the 1-client runs")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8131)
    main(parser.parse_args())
