"""Where a decode step's time goes, op by op: torch.profiler over decode steps of a full batch
(prompts of --input-len random tokens), on the CPU or the GPU the engine picks. Prints the
mean step time without the profiler, then the ops by host time and, on CUDA, by device time.

    python benchmarks/profile_decode.py /tmp/smollm2-1.7b --batch 64
    python benchmarks/profile_decode.py --batch 16 --steps 4    # the embedded GGUF
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from pagellm import LLM
from pagellm.benchmarks.throughput import random_prompts, start_decoding, time_decode_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, kv_cache_memory=4 << 30,
              max_model_len=args.input_len + 4 * args.steps + 64)
    # Every page of the cache written once, as in a server that has run for a while: a fresh
    # engine's first touch of each page made writing the cache 8% of a batch-256 step.
    for cache in llm.engine.core.runner.kv_caches:
        cache.zero_()
    vocab = llm.engine.core.loaded.arch.vocab_size
    prompts = [random_prompts(args.batch, args.input_len, vocab, seed) for seed in range(3)]
    time_decode_step(llm, prompts[0], args.steps)  # warm-up
    seconds, _ = time_decode_step(llm, prompts[1], 2 * args.steps)
    print(f"batch {args.batch}: {seconds * 1e3:.2f} ms a decode step", flush=True)
    cuda = llm.engine.core.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ids = start_decoding(llm, prompts[2], args.steps)
    with profile(activities=activities) as profiled:
        for _ in range(args.steps):
            llm.engine.step()
    llm.engine.abort_request(ids)
    table = profiled.key_averages()
    print(f"{args.steps} decode steps, by host time")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if cuda:
        print(f"{args.steps} decode steps, by device time")
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
