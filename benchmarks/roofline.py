"""Each decode step's time against its roofline bound.

A step of `batch` decoding requests at `context` tokens each must do 2 x params x batch
FLOPs of matmuls (plus attention's 4 x layers x heads x head_dim x context per request) and
read the weights in the forms it multiplies plus every request's keys and values. Its bound
is max(FLOPs / measured matmul peak, bytes / measured read bandwidth): the time it would
take if whichever resource it needs most ran at its roof. The report gives each step's time,
its bound, which roof binds, and the step's share of the bound (100% is the roof).

The KV cache holds just the largest batch and is written once before any step is timed: a
server's cache pages are faulted in by the steps that first write them, a cost of its first
minutes (about 19 ms per 2 MiB page in a VM whose host backs memory on first touch) that
would otherwise land in the steps measured here.

    python benchmarks/roofline.py
    python benchmarks/roofline.py --batches 1 16 64 256 --contexts 132 1000
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from memory_roof import read_gbps  # noqa: E402
from peers_report import machine, matmul_peak_gflops, peak_form  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.benchmarks.throughput import random_prompts, time_decode_step  # noqa: E402
from pagellm.model.quantized import Linear  # noqa: E402


def matmul_parameters(llm: LLM) -> int:
    return sum(m.in_features * m.out_features for m in llm.engine.core.loaded.model.modules()
               if isinstance(m, Linear))


def attention_flops(llm: LLM, context: int) -> int:
    arch = llm.engine.core.loaded.arch
    return 4 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * context


def warm_llm(args: argparse.Namespace, context: int) -> LLM:
    """An engine whose KV cache holds the largest batch at `context` (plus the steps), with
    every page of it already written."""
    engine_args = {"block_size": 16, **json.loads(args.engine_args)}
    per_request = -(-(context + args.steps + 64) // engine_args["block_size"])
    llm = LLM(args.model, max_num_seqs=max(args.batches), max_model_len=context + 64,
              num_gpu_blocks_override=max(args.batches) * per_request + 1, **engine_args)
    for cache in llm.engine.core.runner.kv_caches:
        cache.zero_()
    return llm


def measure(args: argparse.Namespace, peak: float, bandwidth: float) -> list[str]:
    rows = []
    for context in args.contexts:
        llm = warm_llm(args, context)
        params, vocab = matmul_parameters(llm), llm.engine.vocab_size
        for batch in args.batches:
            prompts = random_prompts(batch, context, vocab, batch)
            seconds, read = time_decode_step(llm, prompts, args.steps)
            flops = batch * (2 * params + attention_flops(llm, context))
            compute, memory = flops / (peak * 1e9), read / (bandwidth * 1e9)
            bound = max(compute, memory)
            rows.append(f"| {batch} | {context} | {seconds * 1e3:.1f} | {bound * 1e3:.1f} | "
                        f"{'compute' if compute >= memory else 'memory'} | "
                        f"{100 * bound / seconds:.1f}% |")
            print(rows[-1], flush=True)
        del llm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[132, 1000])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--engine-args", default="{}", help="JSON of more engine arguments")
    args = parser.parse_args()
    peak, bandwidth = matmul_peak_gflops(), read_gbps()
    header = [f"Machine: {machine()} ({platform.machine()}), {time.strftime('%Y-%m-%d')}",
              f"Matmul peak {peak:.1f} GFLOP/s (2048x2048 in {peak_form()}, the projections' "
              f"form), read bandwidth "
              f"{bandwidth:.1f} GB/s (`benchmarks/memory_roof.py`).", "",
              "| batch | context | step ms | bound ms | binding roof | share of bound |",
              "|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    measure(args, peak, bandwidth)


if __name__ == "__main__":
    main()
