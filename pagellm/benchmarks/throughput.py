"""`pagellm bench throughput`: offline output tokens/s at several batch sizes.

Each batch size runs that many prompts at once (random token ids, fixed input
and output lengths, EOS ignored), so the figure is the engine's throughput at
that concurrency. `--hf-baseline` runs the same prompts through Hugging Face
transformers `generate()`, one prompt at a time, on the same weights.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagellm.distributed.config import add_parallel_cli_args
from pagellm.engine.arg_utils import EngineArgs
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine and torch load when a benchmark runs, not when `pagellm` parses
    from pagellm.entrypoints.llm import LLM


@dataclass
class ThroughputResult:
    label: str
    num_requests: int
    seconds: float
    input_tokens: int
    output_tokens: int

    def line(self) -> str:
        total = self.input_tokens + self.output_tokens
        return (f"[{self.label}] Throughput: {self.num_requests / self.seconds:.2f} requests/s, "
                f"{total / self.seconds:.2f} total tokens/s, "
                f"{self.output_tokens / self.seconds:.2f} output tokens/s")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser, skip=("max_num_seqs",))
    add_parallel_cli_args(parser)  # -tp, -pp and the executor, as `serve` takes them
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,8,32,64",
                        help="comma-separated concurrency levels")
    parser.add_argument("--hf-baseline", type=int, default=0, metavar="N",
                        help="also time N prompts through transformers generate(), one at a time")
    parser.add_argument("--decode-steps", type=int, default=0, metavar="N",
                        help="also time N decode steps of each full batch (after its prefill)")


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def run(args: argparse.Namespace) -> list[ThroughputResult]:
    from pagellm.entrypoints.llm import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.max_num_seqs = max(batch_sizes)
    llm = LLM(**vars(engine_args))
    vocab = llm.engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(random_prompts(1, args.input_len, vocab, 0), params, use_tqdm=False)  # warm-up
    results = []
    for batch in batch_sizes:
        prompts = random_prompts(batch, args.input_len, vocab, batch)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.append(ThroughputResult(f"pagellm batch={batch}", batch, seconds,
                                        batch * args.input_len, produced))
        print(results[-1].line(), flush=True)
    for batch in batch_sizes if args.decode_steps else ():
        seconds, read = time_decode_step(llm, random_prompts(batch, args.input_len, vocab, batch),
                                         args.decode_steps)
        print(f"[pagellm batch={batch}] decode step: {seconds * 1000:.1f} ms, "
              f"{batch / seconds:.1f} output tokens/s, reads {read / 1e6:.1f} MB "
              f"({read / seconds / 1e9:.1f} GB/s)", flush=True)
    if args.hf_baseline:
        results.append(run_hf_baseline(llm, args, random_prompts(args.hf_baseline, args.input_len,
                                                                 vocab, 1)))
        print(results[-1].line(), flush=True)
    return results


def start_decoding(llm: LLM, prompts: list[list[int]], steps: int) -> list[str]:
    """Adds greedy requests for the prompts and steps the engine until every one of them has
    its first token, so that each of the next `steps` steps decodes the whole batch; returns
    their request ids."""
    engine = llm.engine
    # Each prompt computed once first, so that the requests below find it in the prefix cache
    # and the whole batch decodes within a step or two. Otherwise a large batch of long
    # prompts (256 of 1,000 tokens) took so many chunked steps that its first requests had
    # decoded their tokens and finished before its last ones started.
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        engine.step()
    return ids


def time_decode_step(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Mean seconds of one engine step once every prompt of the batch is decoding, and the
    mean bytes such a step reads: the weights in the forms it multiplies, and every
    request's keys and values so far."""
    engine = llm.engine
    ids = start_decoding(llm, prompts, steps)
    core, scheduler = engine.core, engine.core.scheduler
    weights = core.loaded.model.weight_bytes_read(len(prompts))
    token_bytes = core.runner.block_bytes() / core.cache_config.block_size
    contexts = sum(r.num_computed_tokens + 1 for r in scheduler.running)
    start = time.perf_counter()
    for _ in range(steps):
        if len(scheduler.running) != len(prompts) or scheduler.waiting:
            raise RuntimeError(f"{len(scheduler.running)} of {len(prompts)} requests decoding: "
                               "the KV cache or max_num_seqs is too small for this batch")
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    engine.abort_request(ids)
    mean_context_bytes = (contexts + len(prompts) * (steps - 1) / 2) * token_bytes
    return seconds, weights + mean_context_bytes


def run_hf_baseline(llm: LLM, args: argparse.Namespace,
                    prompts: list[list[int]]) -> ThroughputResult:
    """transformers generate() on the same weights, one request at a time.

    A GGUF runs in float32, which transformers' packed GGUF kernels recommend as
    their fastest; an HF folder runs in the engine's dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = llm.engine.core.loaded.path
    gguf = path.suffix == ".gguf"
    kwargs = {"gguf_file": path.name} if gguf else {}
    dtype = torch.float32 if gguf else llm.engine.core.dtype
    model = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, dtype=dtype,
                                                 **kwargs)
    model.eval()
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.output_len, min_new_tokens=args.output_len)
            produced += out.shape[1] - ids.shape[1]
    return ThroughputResult("transformers generate() batch=1", len(prompts),
                            time.perf_counter() - start, len(prompts) * args.input_len, produced)
