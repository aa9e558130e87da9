"""`pagellm bench fidelity`: how close each engine choice's greedy answers are to the exact
model's, with its speed beside it.

The exact model is transformers in float32 on the same weights (a GGUF dequantized by
transformers' own loader). Over a fixed set of chat prompts shipped with pagellm, each
variant of the engine (named engine arguments) gives its greedy continuation of every
prompt, all prompts in one batch; the report gives the share identical to the exact
model's, the mean length of the prefix they share, the mean KL divergence per token from
the exact model's distribution (`fidelity_kl`), and output tokens/s. `--base-url` adds
an OpenAI-compatible server (llama.cpp's `llama-server` on the same file, say), asked one
prompt at a time on /v1/completions with the same rendered chat prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = Path(__file__).with_name("data") / "fidelity_prompts.json"
# Variants measured when none is named: the default (batch-invariant, int8 activations on a
# GGUF), the codes in float32 without int8 rounding, the exact float32 model, and the
# start-up-timed mixture of forms.
DEFAULT_VARIANTS = {
    "default": {},
    "no-int8-activations": {"gguf_int8_activations": False},
    "float32": {"dtype": "float32"},
    "timed-forms": {"batch_invariant": False},
}


@dataclass
class FidelityResult:
    variant: str
    identical: int
    prompts: int
    mean_matching_prefix: float
    output_tokens_per_s: float
    mean_kl: float | None = None  # None where the engine gave no prompt logprobs

    def row(self) -> str:
        kl = "n/a" if self.mean_kl is None else f"{self.mean_kl:.5f}"
        return (f"| {self.variant} | {self.identical}/{self.prompts} | "
                f"{self.mean_matching_prefix:.1f} | {kl} | {self.output_tokens_per_s:.1f} |")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="use the first N prompts of the set (default: all 40)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="engine arguments of a variant, e.g. "
                             "'bf16={\"dtype\": \"bfloat16\"}' (repeatable; default: "
                             + ", ".join(DEFAULT_VARIANTS) + ")")
    parser.add_argument("--base-url", default=None,
                        help="also measure this OpenAI-compatible server (e.g. llama-server)")
    parser.add_argument("--output-json", default=None, help="write the results here too")


def parse_variants(specs: list[str]) -> dict[str, dict[str, Any]]:
    if not specs:
        return dict(DEFAULT_VARIANTS)
    variants = {}
    for spec in specs:
        name, sep, arguments = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--variant takes NAME=JSON, got {spec!r}.")
        variants[name] = json.loads(arguments)
    return variants


def matching_prefix(ours: list[int], exact: list[int]) -> int:
    count = 0
    for a, b in zip(ours, exact):
        if a != b:
            break
        count += 1
    return count


def score(variant: str, answers: list[list[int]], exact: list[list[int]],
          seconds: float, kl: float | None = None) -> FidelityResult:
    prefixes = [matching_prefix(a, e) for a, e in zip(answers, exact)]
    identical = sum(a == e for a, e in zip(answers, exact))
    produced = sum(len(a) for a in answers)
    return FidelityResult(variant, identical, len(exact), sum(prefixes) / len(prefixes),
                          produced / seconds, kl)


def exact_model(model_path: Path) -> Any:
    """transformers in float32 on the same file (a GGUF is dequantized by its own loader)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = model_path.suffix == ".gguf"
    kwargs = {"gguf_file": model_path.name} if gguf else {}
    return AutoModelForCausalLM.from_pretrained(model_path.parent if gguf else model_path,
                                                dtype=torch.float32, **kwargs).eval()


def exact_answers(model: Any, prompts: list[list[int]], max_tokens: int,
                  eos_ids: list[int]) -> list[list[int]]:
    """The exact model's greedy continuations, one prompt at a time, ending at EOS as the
    engine's do."""
    import torch

    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos_ids,
                                 pad_token_id=eos_ids[0])
            answers.append(_until_eos(out[0, len(prompt):].tolist(), eos_ids))
    return answers


def _until_eos(tokens: list[int], eos_ids: list[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i]
    return tokens


@dataclass
class EngineRun:
    answers: list[list[int]]
    seconds: float
    prompts: list[list[int]]  # the rendered chat prompts
    model_path: Path
    eos_token_ids: list[int]
    tokenizer: Any
    llm: Any


def engine_answers(model: str | None, arguments: dict[str, Any], messages: list[str],
                   max_tokens: int) -> EngineRun:
    """One variant's greedy answers, all prompts in one batch after a warm-up."""
    from pagellm import LLM, SamplingParams

    llm = LLM(model, **{"kv_cache_memory": 256 << 20, "max_model_len": 2048, **arguments})
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": m}])
               for m in messages]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(prompts[:2], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    loaded = llm.engine.core.loaded
    # token_ids end with the EOS token that stopped a sequence, as vLLM's do; the scores
    # compare what comes before it
    answers = [_until_eos(list(o.outputs[0].token_ids), loaded.eos_token_ids) for o in outputs]
    return EngineRun(answers, seconds, prompts, loaded.path, loaded.eos_token_ids,
                     llm.get_tokenizer(), llm)


@dataclass
class ExactReference:
    answers: list[list[int]]
    logprobs: list[Any]  # per prompt, the full distributions at the answer's positions


def exact_reference(engine: EngineRun, max_tokens: int) -> ExactReference:
    from pagellm.benchmarks import fidelity_kl

    model = exact_model(engine.model_path)
    answers = exact_answers(model, engine.prompts, max_tokens, engine.eos_token_ids)
    return ExactReference(answers, fidelity_kl.exact_logprobs(model, engine.prompts, answers))


def server_answers(base_url: str, tokenizer: Any, prompts: list[list[int]],
                   max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy completions of the rendered chat prompts, re-tokenized for comparison."""
    import httpx

    answers, seconds = [], 0.0
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=600) as client:
        for prompt in prompts:
            start = time.perf_counter()
            reply = client.post("/v1/completions", json={
                "prompt": tokenizer.decode(prompt), "max_tokens": max_tokens,
                "temperature": 0.0})
            reply.raise_for_status()
            seconds += time.perf_counter() - start
            text = reply.json()["choices"][0]["text"]
            answers.append(tokenizer.encode(text, add_special_tokens=False))
    return answers, seconds


def run(args: argparse.Namespace) -> list[FidelityResult]:
    from pagellm.benchmarks import fidelity_kl  # torch: not at the CLI's import

    messages = json.loads(PROMPTS.read_text())[:args.num_prompts]
    results, exact, first = [], None, None
    for name, arguments in parse_variants(args.variant).items():
        engine = engine_answers(args.model, arguments, messages, args.max_tokens)
        if exact is None:
            first, exact = engine, exact_reference(engine, args.max_tokens)
        kl = fidelity_kl.mean_kl(exact.logprobs, fidelity_kl.engine_logprobs(
            engine.llm, engine.prompts, exact.answers))
        results.append(score(name, engine.answers, exact.answers, engine.seconds, kl))
        print(results[-1].row(), flush=True)
        engine.llm = None  # one engine's KV cache at a time
    if args.base_url:
        answers, seconds = server_answers(args.base_url, first.tokenizer, first.prompts,
                                          args.max_tokens)
        results.append(score(args.base_url, answers, exact.answers, seconds))
    print_report(results, args.max_tokens)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return results


def print_report(results: list[FidelityResult], max_tokens: int) -> None:
    print(f"\nGreedy continuations ({max_tokens} tokens) against transformers float32 on the "
          "same weights:")
    print("| variant | identical | mean matching prefix (tokens) | mean KL per token | "
          "output tok/s |")
    print("|---|---|---|---|---|")
    for result in results:
        print(result.row())
