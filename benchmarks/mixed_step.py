"""The step a server takes when a request arrives while others decode: --batch requests
decoding (prompts of --context random tokens) plus one new prompt of --prompt-len tokens,
beside the decode-only step that follows it. Prints the median ms of each over --steps
pairs; the new request is aborted after its prompt's step.

    python benchmarks/mixed_step.py
    python benchmarks/mixed_step.py --batch 63 --context 132 --prompt-len 128 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.throughput import random_prompts, start_decoding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--batch", type=int, default=63)
    parser.add_argument("--context", type=int, default=132)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch + 1,
              max_model_len=max(args.context + 2 * args.steps + 16, args.prompt_len) + 64)
    engine = llm.engine
    vocab = engine.core.loaded.arch.vocab_size
    start_decoding(llm, random_prompts(args.batch, args.context, vocab, 0), 2 * args.steps)
    new_prompts = random_prompts(args.steps, args.prompt_len, vocab, 1)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    mixed, decode_only = [], []
    for i, prompt in enumerate(new_prompts):
        engine.add_request(f"arrival-{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        mixed.append(time.perf_counter() - start)
        engine.abort_request([f"arrival-{i}"])
        start = time.perf_counter()
        engine.step()
        decode_only.append(time.perf_counter() - start)
    print(f"{args.batch} decodes at {args.context} tokens + a prompt of {args.prompt_len}: "
          f"{1e3 * statistics.median(mixed):.1f} ms a step; the decodes alone "
          f"{1e3 * statistics.median(decode_only):.1f} ms (medians of {args.steps})")


if __name__ == "__main__":
    main()
