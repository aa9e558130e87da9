"""Speed of paged attention for decodes on SmolLM2's shape, for each cache dtype and kernel:
the decode kernel, the prefill kernel that batch-invariant steps sent decodes to, or the
decode kernel bit-identical to it that they send decodes to now ("invariant").

A decode step's attention over 30 layers: 64 requests (9 query heads, 3 kv heads of 64),
each with its own blocks of 16 tokens drawn at random from a cache three times larger,
as a long-running server's free list hands them out. Each layer has its own cache, so the
keys and values come from memory, not from the last level cache; in 2 MiB pages, as the
engine allocates them. Median of 9 steps, in ms.

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --batch 64 --context 160 1000 --dtypes bfloat16
    python benchmarks/decode_attention.py --kernels decode prefill invariant --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagellm.kernels import (cpu_kernels_available, paged_decode_attention,
                             paged_decode_attention_invariant, paged_prefill_attention)
from pagellm.platform import zeros_in_huge_pages

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30


def step_ms(batch: int, context: int, dtype: torch.dtype, kernel: str, steps: int = 9) -> float:
    blocks_per_request = -(-context // BLOCK_SIZE)
    num_blocks = 3 * batch * blocks_per_request
    shape = (LAYERS, 2, KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
    cache = zeros_in_huge_pages(shape, dtype)  # as the engine allocates it
    cache.copy_(torch.randn(shape))
    tables = torch.randperm(num_blocks)[:batch * blocks_per_request].view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    query = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    ones, starts = torch.ones(batch, dtype=torch.int64), torch.arange(batch)

    def attend(layer_cache: torch.Tensor) -> None:
        if kernel == "decode":
            paged_decode_attention(query, layer_cache, tables, seq_lens, HEAD_DIM ** -0.5)
        elif kernel == "invariant":
            paged_decode_attention_invariant(query, layer_cache, tables, seq_lens,
                                             HEAD_DIM ** -0.5)
        else:
            paged_prefill_attention(query, layer_cache, tables, seq_lens, starts, ones, batch,
                                    HEAD_DIM ** -0.5)

    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        for layer in range(LAYERS):
            attend(cache[layer])
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, nargs="+", default=[160, 1000])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float8_e4m3fn", "float32"])
    parser.add_argument("--kernels", nargs="+", default=["decode", "prefill", "invariant"],
                        choices=["decode", "prefill", "invariant"])
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("the CPU kernels are not available on this machine")
    for name in args.dtypes:
        for context in args.context:
            for kernel in args.kernels:
                ms = step_ms(args.batch, context, getattr(torch, name), kernel)
                print(f"{name:14s} {kernel:9s} kernel, batch {args.batch} context {context:5d}: "
                      f"{ms:7.1f} ms per step of {LAYERS} layers")


if __name__ == "__main__":
    main()
