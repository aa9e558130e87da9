"""How well the paged KV cache uses its memory, against per-request preallocation.

Runs the real scheduler and KV cache manager (no model: a stand-in runner
samples a fixed token) over a mixed-length workload in a fixed KV budget and
reports, averaged over steps, the share of allocated token slots that hold no
token (waste) and the most requests it ran at once. The comparison is an
engine that reserves `max_model_len` slots per request up front, as llama.cpp's
slots and Ollama do: it fits `budget // max_model_len` requests, and its
waste is 1 - (tokens actually held / slots reserved).

    python -m pagellm.benchmarks.kv_memory --budget-tokens 65536 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pagellm.config import SchedulerConfig
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


@dataclass
class MemoryReport:
    paged_waste: float
    paged_peak_running: int
    paged_mean_running: float
    prealloc_waste: float
    prealloc_max_running: int


def mixed_workload(count: int, max_model_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths: log-normal, chat-like, capped to the context."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        prompt = min(int(rng.lognormvariate(5.0, 1.0)) + 4, max_model_len // 2)
        output = min(int(rng.lognormvariate(5.0, 0.8)) + 4, max_model_len - prompt)
        shapes.append((prompt, output))
    return shapes


def simulate(shapes: list[tuple[int, int]], budget_tokens: int, block_size: int,
             max_model_len: int) -> tuple[float, int, float, float]:
    """(waste, peak running, mean running, mean tokens held) of the paged engine."""
    config = SchedulerConfig(max_num_seqs=10_000, max_num_batched_tokens=8192,
                             max_model_len=max_model_len)
    scheduler = Scheduler(config, KVCacheManager(budget_tokens // block_size, block_size,
                                                 enable_caching=False))
    for index, (prompt, output) in enumerate(shapes):
        scheduler.add_request(Request(str(index), [1 + index % 1000] * prompt,
                                      SamplingParams(ignore_eos=True), max_tokens=output))
    waste, running, held, steps = 0.0, [], 0.0, 0
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        tokens = sum(r.num_computed_tokens for r in scheduler.running) + step.num_scheduled_tokens
        slots = sum(len(r.block_ids) for r in scheduler.running) * block_size
        waste += 1 - tokens / max(slots, 1)
        held += tokens
        running.append(len(scheduler.running))
        sampled = {s.request.request_id: [7] for s in step.scheduled if s.samples}
        scheduler.update_from_output(step, ModelRunnerOutput(sampled=sampled))
        steps += 1
    return waste / steps, max(running), sum(running) / steps, held / steps


def run(args: argparse.Namespace) -> MemoryReport:
    shapes = mixed_workload(args.num_requests, args.max_model_len, args.seed)
    waste, peak, mean, _ = simulate(shapes, args.budget_tokens, args.block_size,
                                    args.max_model_len)
    slots = args.max_model_len
    mean_len = sum(p + o / 2 for p, o in shapes) / len(shapes)  # tokens held mid-generation
    report = MemoryReport(waste, peak, mean, 1 - mean_len / slots, args.budget_tokens // slots)
    print(f"KV budget: {args.budget_tokens:,} tokens, block size {args.block_size}, "
          f"max_model_len {args.max_model_len:,}, {args.num_requests} requests "
          f"(mean prompt {sum(p for p, _ in shapes) / len(shapes):.0f}, "
          f"mean output {sum(o for _, o in shapes) / len(shapes):.0f} tokens)")
    print(f"paged:        waste {report.paged_waste:6.1%}, concurrency peak "
          f"{report.paged_peak_running}, mean {report.paged_mean_running:.1f}")
    print(f"preallocated: waste {report.prealloc_waste:6.1%}, concurrency max "
          f"{report.prealloc_max_running}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-tokens", type=int, default=65536)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
