"""What LoRA costs a server: output tokens/s at 64 concurrent clients on the embedded
SmolLM2 GGUF, for base-model requests on a server without --enable-lora, and on one with
it: base-model requests only, every request on one adapter, and requests spread over 8
adapters (up to 8 in one step). Adapters are random rank-16 PEFT folders on every
projection, applied on top of the quantized base projections.

    python benchmarks/lora.py                     # starts both servers in turn
    python benchmarks/lora.py --clients 64 --rounds 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch
from safetensors.torch import save_file
from server_health import wait_healthy

from pagellm.model.loader import read_gguf
from pagellm.model.paths import default_model_path

PROJECTIONS = {"self_attn.q_proj": ("hidden", "q"), "self_attn.k_proj": ("hidden", "kv"),
               "self_attn.v_proj": ("hidden", "kv"), "self_attn.o_proj": ("q", "hidden"),
               "mlp.gate_proj": ("hidden", "inter"), "mlp.up_proj": ("hidden", "inter"),
               "mlp.down_proj": ("inter", "hidden")}
PROMPTS = ["Write a short story about a robot who learns to paint.",
           "Explain how a paged KV cache works, step by step.",
           "List ten European rivers and a fact about each.",
           "Describe the water cycle to a ten-year-old."]


def write_adapter(folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for the embedded model's shapes (small deltas)."""
    _, arch = read_gguf(default_model_path())
    sizes = {"hidden": arch.hidden_size, "inter": arch.intermediate_size,
             "q": arch.num_attention_heads * arch.head_dim,
             "kv": arch.num_key_value_heads * arch.head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for name, (source, target) in PROJECTIONS.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            inputs, outputs = sizes[source], sizes[target]
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, inputs, generator=generator) / math.sqrt(inputs))
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(outputs, rank,
                                                                    generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": [name.rpartition(".")[2] for name in PROJECTIONS]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", str(port),
               "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level",
               "warning", *extra]
    server = subprocess.Popen(command, env=os.environ.copy())
    wait_healthy(server, f"http://127.0.0.1:{port}", timeout=600, poll_seconds=1)
    return server


async def load(client: openai.AsyncOpenAI, models: list[str], clients: int, requests: int,
               max_tokens: int) -> float:
    """Output tokens/s with `clients` requests in flight, request i on models[i % len]."""
    queue = list(range(requests))
    total = 0

    async def worker() -> None:
        nonlocal total
        while queue:
            index = queue.pop()
            result = await client.completions.create(
                model=models[index % len(models)], prompt=PROMPTS[index % len(PROMPTS)],
                max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True})
            total += result.usage.completion_tokens

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return total / (time.perf_counter() - start)


async def measure(port: int, runs: dict[str, list[str]], args: argparse.Namespace) -> dict:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY",
                                timeout=600)
    await load(client, ["base"], args.clients, args.clients, 8)  # warm-up
    return {name: await load(client, models, args.clients, args.clients * args.rounds,
                             args.max_tokens) for name, models in runs.items()}


def run(port: int, extra: list[str], runs: dict[str, list[str]], args: argparse.Namespace
        ) -> dict[str, float]:
    server = start_server(port, ["--served-model-name", "base", *extra])
    try:
        return asyncio.run(measure(port, runs, args))
    finally:
        server.terminate()
        server.wait()


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as root:
        names = [f"adapter{i}" for i in range(8)]
        modules = [f"{name}={write_adapter(Path(root) / name, args.rank, i)}"
                   for i, name in enumerate(names)]
        results = run(args.port, [], {"without --enable-lora, base": ["base"]}, args)
        results |= run(args.port, ["--enable-lora", "--max-loras", "8", "--max-lora-rank",
                                   str(args.rank), "--lora-modules", *modules],
                       {"--enable-lora, base only": ["base"],
                        "--enable-lora, 1 adapter": names[:1],
                        "--enable-lora, 8 adapters mixed": names}, args)
    reference = results["without --enable-lora, base"]
    print(f"{args.clients} clients, {args.max_tokens} output tokens per request, "
          f"rank {args.rank}")
    print(f"{'run':<34} {'tok/s':>8} {'vs no LoRA':>11}")
    for name, rate in results.items():
        print(f"{name:<34} {rate:>8.1f} {100 * (rate / reference - 1):>+10.1f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client and run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--port", type=int, default=8124)
    main(parser.parse_args())
