"""Prompts for `pagellm bench serve`: random, ShareGPT and prefix-repetition datasets.

Prompt lengths are counted with a `TextTokenizer`: the server's `/tokenize` endpoint or a
local Hugging Face tokenizer. Text is built from a list of common English words (each one
token, with its leading space, in usual BPE vocabularies) and then cut to the exact length.

ShareGPT cannot be downloaded here, so `make-sharegpt` writes a synthetic file in its format:
    python -m pagellm.benchmarks.datasets make-sharegpt --out sharegpt.json --num 2000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DATASET_NAMES = ("random", "sharegpt", "prefix-repetition")
WORDS: tuple[str, ...] = tuple("""
the of and to in is that it for was on are as with his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing see
him two has look more day could go come did number sound no most people my over know water than
call first who may down side now find any new work part take get place made live where after back
little only round man year show every good me give our under name very through just form great
think say help low line turn cause much mean before move right boy old too same tell does set
three want air well also play small end put home read hand large add even land here must big high
such follow act why ask men change light kind off need house picture try us again animal point
mother world near build earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city
tree cross farm hard start might story saw far sea draw left late run while press close night
real life few north open together next white children begin got walk example paper group always
music those both mark often letter until river car feet care second book carry science eat room
friend idea fish mountain stop once base hear horse cut sure watch color face wood main enough
""".split())
# ShareGPT's own filter, as `vllm bench serve` applies it.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
_FIT_ATTEMPTS = 4
_HUMAN_ROLES = ("human", "user")
_GPT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing")


class TextTokenizer(Protocol):
    """What prompt building needs: text -> ids (no special tokens) and back."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    # a whole chat (system, earlier turns) for openai-chat; None sends `prompt` as one user turn
    messages: tuple[dict[str, str], ...] | None = None


@dataclass(frozen=True)
class LogNormalShape:
    """Token lengths drawn from a log-normal with this median and sigma, clipped to [1, maximum]."""

    median: float
    sigma: float
    maximum: int

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.maximum, max(1, value))


# Synthetic ShareGPT V3 shape (see `synthetic_sharegpt`).
SHAREGPT_PROMPT_SHAPE = LogNormalShape(median=120.0, sigma=1.3, maximum=4096)
SHAREGPT_REPLY_SHAPE = LogNormalShape(median=150.0, sigma=1.0, maximum=4096)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--sharegpt-output-len", type=int, default=None,
                        help="output length for every ShareGPT request (default: the reply's)")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--random-prefix-len", type=int, default=0,
                        help="tokens of one prefix shared by every random prompt")
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)


def sample_requests(args: argparse.Namespace, tokenizer: TextTokenizer) -> list[SampleRequest]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1.")
    rng = random.Random(args.seed)
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path; ShareGPT cannot be "
                             "downloaded here. Write a synthetic file with `python -m "
                             "pagellm.benchmarks.datasets make-sharegpt --out FILE`.")
        return sample_sharegpt(Path(args.dataset_path), args.num_prompts, tokenizer, rng,
                               args.sharegpt_output_len)
    if args.dataset_name == "prefix-repetition":
        return sample_prefix_repetition(
            tokenizer, rng, args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len)
    return sample_random(tokenizer, rng, args.num_prompts, args.random_input_len,
                         args.random_output_len, args.random_range_ratio, args.random_prefix_len)


def prose(rng: random.Random, num_tokens: int) -> str:
    """About `num_tokens` tokens of sentences: each word and each full stop is about one token."""
    sentences = []
    left = num_tokens
    while left > 0:
        count = min(max(left - 1, 1), rng.randint(5, 16))
        words = rng.choices(WORDS, k=count)
        stop = "." if left > count else ""
        sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + stop)
        left -= count + len(stop)
    return " ".join(sentences)


def fit_text(tokenizer: TextTokenizer, head: str, target: int,
             rng: random.Random) -> tuple[str, int]:
    """`head` plus random sentences, cut to `target` tokens. Returns the text and its token
    count after re-tokenizing, which is `target` unless the tokenizer merges across the cut."""
    text = head
    ids = tokenizer.encode(text) if text else []
    for _ in range(_FIT_ATTEMPTS):
        while len(ids) < target:
            addition = prose(rng, target - len(ids))
            text = f"{text} {addition}" if text else addition
            ids = tokenizer.encode(text)
        if len(ids) > target:
            text = tokenizer.decode(ids[:target])
            ids = tokenizer.encode(text)
        if len(ids) == target:
            break
    return text, len(ids)


def uniform_lengths(rng: random.Random, count: int, length: int, ratio: float) -> list[int]:
    """`count` integers uniform in [floor(length*(1-ratio)), ceil(length*(1+ratio))], >= 1."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}.")
    low = max(1, math.floor(length * (1 - ratio)))
    high = max(low, math.ceil(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def sample_random(tokenizer: TextTokenizer, rng: random.Random, num: int, input_len: int,
                  output_len: int, range_ratio: float, prefix_len: int) -> list[SampleRequest]:
    """Prompts of `prefix_len` shared tokens plus a random part of about `input_len` tokens."""
    input_lens = uniform_lengths(rng, num, input_len, range_ratio)
    output_lens = uniform_lengths(rng, num, output_len, range_ratio)
    prefix = fit_text(tokenizer, "", prefix_len, rng)[0] if prefix_len > 0 else ""
    samples = []
    for in_len, out_len in zip(input_lens, output_lens):
        text, count = fit_text(tokenizer, prefix, prefix_len + in_len, rng)
        samples.append(SampleRequest(text, count, out_len))
    return samples


def sample_prefix_repetition(tokenizer: TextTokenizer, rng: random.Random, num: int,
                             prefix_len: int, suffix_len: int, num_prefixes: int,
                             output_len: int) -> list[SampleRequest]:
    """`num_prefixes` distinct prefixes, each shared by about num/num_prefixes prompts that
    differ in their random suffix; the prompts are shuffled."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("prefix-repetition needs at least one prefix of at least one token.")
    prefixes = [fit_text(tokenizer, "", prefix_len, rng)[0] for _ in range(num_prefixes)]
    samples = []
    for index in range(num):
        text, count = fit_text(tokenizer, prefixes[index % num_prefixes],
                               prefix_len + suffix_len, rng)
        samples.append(SampleRequest(text, count, output_len))
    rng.shuffle(samples)
    return samples


def sharegpt_pairs(entries: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, first gpt turn after it) of each conversation that has both."""
    pairs = []
    for entry in entries:
        turns = entry.get("conversations") or []
        human = next((i for i, t in enumerate(turns) if t.get("from") in _HUMAN_ROLES), None)
        if human is None:
            continue
        reply = next((t for t in turns[human + 1:] if t.get("from") in _GPT_ROLES), None)
        if reply is not None:
            pairs.append((turns[human].get("value") or "", reply.get("value") or ""))
    return pairs


def keep_sharegpt(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's filter: drop prompts or replies under 4 tokens, prompts over 1024 tokens and
    pairs over 2048 tokens together (the reply check is skipped for a fixed output length)."""
    if prompt_len < SHAREGPT_MIN_LEN or (not fixed_output and output_len < SHAREGPT_MIN_LEN):
        return False
    total = prompt_len + output_len
    return prompt_len <= SHAREGPT_MAX_PROMPT_LEN and total <= SHAREGPT_MAX_TOTAL_LEN


def sample_sharegpt(path: Path, num: int, tokenizer: TextTokenizer, rng: random.Random,
                    output_len: int | None = None) -> list[SampleRequest]:
    """`num` shuffled, filtered ShareGPT requests; repeated in order if the file has fewer."""
    pairs = sharegpt_pairs(json.loads(path.read_text()))
    rng.shuffle(pairs)
    samples: list[SampleRequest] = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if keep_sharegpt(prompt_len, reply_len, output_len is not None):
            samples.append(SampleRequest(prompt, prompt_len, reply_len))
            if len(samples) == num:
                return samples
    if not samples:
        raise ValueError(f"{path} has no conversation that passes the ShareGPT length filter.")
    print(f"Only {len(samples)} ShareGPT requests pass the filter; repeating them to {num}.")
    return [samples[i % len(samples)] for i in range(num)]


def synthetic_sharegpt(num: int, seed: int) -> list[dict[str, Any]]:
    """`num` two-turn conversations in ShareGPT's format with ShareGPT-like token lengths.

    Lengths are log-normal, independent for prompt and reply, clipped to [1, 4096]:
    - prompts: median 120, sigma 1.3 -> mean about 280 before filtering;
    - replies: median 150, sigma 1.0 -> mean about 250 before filtering.
    Targets: ShareGPT V3 prompts have a median near 100 tokens, a mean of 200-300 and a long
    tail; replies a mean of 200-250. Public `vllm bench serve` logs on
    ShareGPT_V3_unfiltered_cleaned_split.json (1000 prompts, seed 0, Llama-3 tokenizer) report
    215,196 total input tokens (mean 215 after the filter) and about 197-199k generated tokens.
    After vLLM's filter this shape gives prompts with mean about 190 and median about 110, and
    replies with mean about 230: a single log-normal has less mass between 300 and 1024 tokens
    than the real data, so the filtered prompt mean lands somewhat under 215.
    """
    rng = random.Random(seed)
    entries = []
    for index in range(num):
        prompt = prose(rng, SHAREGPT_PROMPT_SHAPE.sample(rng))
        reply = prose(rng, SHAREGPT_REPLY_SHAPE.sample(rng))
        entries.append({"id": f"synthetic-{seed}-{index}",
                        "conversations": [{"from": "human", "value": prompt},
                                          {"from": "gpt", "value": reply}]})
    return entries


def write_sharegpt(path: Path, num: int, seed: int = 0) -> Path:
    """Write `synthetic_sharegpt(num, seed)` as JSON to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(synthetic_sharegpt(num, seed), indent=1))
    return path


def add_make_sharegpt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--num", type=int, default=2000, help="number of conversations")
    parser.add_argument("--seed", type=int, default=0)


def run_make_sharegpt(args: argparse.Namespace) -> Path:
    path = write_sharegpt(args.out, args.num, args.seed)
    print(f"Wrote {args.num} synthetic ShareGPT conversations to {path}")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagellm.benchmarks.datasets")
    commands = parser.add_subparsers(dest="command", required=True)
    add_make_sharegpt_args(commands.add_parser(
        "make-sharegpt", help="write a synthetic ShareGPT-format JSON file"))
    run_make_sharegpt(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
