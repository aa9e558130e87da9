"""Prompt logprobs in the engine: the model's own log-softmax under teacher forcing (checked
against transformers on the tiny random models, in float32), in any batch, with a chunk
budget that splits the prompts, with prefix caching on and off (bit-exact alike), after
preemption, and without touching the cached blocks other requests share."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_manager import hash_block
from pagellm.outputs import PromptLogprobs

TOP = 3
SCORED = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
PLAIN = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_llm(model_dir: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 8 << 20)
    return LLM(str(model_dir), dtype="float32", **kwargs)


def random_prompts(count: int, seed: int, low: int = 20, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(low, high))]
            for _ in range(count)]


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts that share a 37-token prefix (two 16-token blocks and a part) with each other."""
    prefix = random_prompts(1, seed, 37, 38)[0]
    return [prefix + tail for tail in random_prompts(3, seed + 1, 1, 12)]


def teacher_forced(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 log-softmax at each position but the last: [P - 1, vocab]."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [ref(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in prompts]


def assert_teacher_forced(prompt: list[int], got: PromptLogprobs | None,
                          expected: torch.Tensor, top: int = TOP) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position, (token, entries, row) in enumerate(zip(prompt[1:], got[1:], expected), 1):
        assert entries is not None and token in entries, position
        chosen = entries[token]
        assert abs(chosen.logprob - row[token].item()) < 1e-4, position
        better = int((row > row[token] + 1e-4).sum()) + 1
        assert better <= chosen.rank <= int((row > row[token] - 1e-4).sum()) + 1, position
        best = sorted((e for e in entries.values() if e.rank <= top), key=lambda e: e.rank)
        assert [e.rank for e in best] == list(range(1, top + 1)), position
        torch.testing.assert_close(torch.tensor([e.logprob for e in best]),
                                   row.topk(top).values, atol=1e-4, rtol=0)
        for token_id, entry in entries.items():
            assert abs(entry.logprob - row[token_id].item()) < 1e-4
            assert entry.decoded_token is not None


def scored_in_a_batch(llm: LLM, prompts: list[list[int]], seed: int,
                      params: SamplingParams = SCORED) -> list[PromptLogprobs | None]:
    """`prompts` with prompt logprobs, between requests without."""
    others = random_prompts(len(prompts) + 1, seed)
    batch = [x for pair in zip(others, prompts) for x in pair] + others[len(prompts):]
    kinds = [x for pair in zip([PLAIN] * len(prompts), [params] * len(prompts)) for x in pair]
    outputs = llm.generate(batch, kinds + [PLAIN], use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in outputs[0::2])
    return [o.prompt_logprobs for o in outputs[1::2]]


def test_prompt_logprobs_are_the_models_log_softmax(tiny_model_dir: Path) -> None:
    prompts = random_prompts(3, seed=1)
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=7)
    got = scored_in_a_batch(llm, prompts, seed=2)
    for prompt, entries, expected in zip(prompts, got, teacher_forced(tiny_model_dir, prompts)):
        assert_teacher_forced(prompt, entries, expected)


@pytest.mark.parametrize("budget", [7, 2048])
def test_prefix_caching_on_and_off_both_give_the_models_log_softmax(tiny_llama_dir: Path,
                                                                    budget: int) -> None:
    prompts = shared_prefix_prompts(seed=3)
    expected = teacher_forced(tiny_llama_dir, prompts)
    for caching in (False, True):
        llm = make_llm(tiny_llama_dir, max_num_batched_tokens=budget, block_size=16,
                       enable_prefix_caching=caching)
        llm.generate(prompts[:1], PLAIN, use_tqdm=False)  # fills the cache (when on)
        got = scored_in_a_batch(llm, prompts, seed=4)
        assert (llm.engine.core.scheduler.kv.prefix_hits > 0) == caching
        for prompt, entries, reference in zip(prompts, got, expected):
            assert_teacher_forced(prompt, entries, reference)


def test_prefix_caching_on_and_off_are_bit_exact_on_the_default_path(smollm2_gguf: Path
                                                                      ) -> None:
    """The embedded GGUF with its defaults is batch-invariant: the cached keys a scored
    request attends equal those it would write itself, to the bit."""
    results = {}
    for caching in (False, True):
        llm = LLM(kv_cache_memory=64 << 20, max_model_len=256, max_num_batched_tokens=7,
                  enable_prefix_caching=caching)
        tokenizer = llm.get_tokenizer()
        prefix = tokenizer.encode("The history of the river city is a story of salt, bread "
                                  "and music, told by the queen of the north to her engine")
        prompts = [prefix + tokenizer.encode(tail) for tail in (" men.", " and the war.")]
        llm.generate(prompts[:1], PLAIN, use_tqdm=False)
        results[caching] = scored_in_a_batch(llm, prompts, seed=9)
        assert (llm.engine.core.scheduler.kv.prefix_hits > 0) == caching
    assert results[True] == results[False]  # exact floats, ranks and texts


def test_recompute_preemption_neither_repeats_nor_loses_entries(tiny_llama_dir: Path) -> None:
    prompts = random_prompts(4, seed=5, low=30, high=70)
    roomy = make_llm(tiny_llama_dir, max_model_len=128, block_size=4)
    expected = [o.prompt_logprobs for o in roomy.generate(prompts, SCORED, use_tqdm=False)]
    tight = make_llm(tiny_llama_dir, max_model_len=128, block_size=4, num_gpu_blocks_override=40,
                     max_num_batched_tokens=9, preemption_mode="recompute")
    long_runs = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=TOP)
    got = scored_in_a_batch(tight, prompts, seed=6, params=long_runs)
    assert tight.engine.core.scheduler.num_preemptions > 0
    for prompt, entries, reference in zip(prompts, got, expected):
        assert entries is not None and len(entries) == len(prompt)
        for ours, theirs in zip(entries[1:], reference[1:]):
            assert ours.keys() == theirs.keys()
            for token_id, entry in ours.items():
                assert abs(entry.logprob - theirs[token_id].logprob) < 1e-5
                assert entry.rank == theirs[token_id].rank


def test_cached_blocks_are_shared_and_never_rewritten(tiny_llama_dir: Path) -> None:
    llm = make_llm(tiny_llama_dir, block_size=16, max_num_batched_tokens=7)
    prompts = shared_prefix_prompts(seed=7)
    llm.generate(prompts[:1], PLAIN, use_tqdm=False)
    core = llm.engine.core
    kv, runner = core.scheduler.kv, core.runner
    hits, evictions = kv.prefix_hits, kv.pool.num_evictions
    cached = [kv.pool.get_cached_block(h) for h in _block_hashes(prompts[1])[:2]]
    assert None not in cached
    before = [cache[:, :, cached].clone() for cache in runner.kv_caches]
    # beside others, its chunks split otherwise than the first prompt's: keys written again
    # would differ in their last bits
    scored = scored_in_a_batch(llm, prompts[1:2], seed=10)[0]
    assert kv.prefix_hits >= hits + 32 and kv.pool.num_evictions == evictions
    assert all(torch.equal(cache[:, :, cached], old) for cache, old in zip(runner.kv_caches,
                                                                           before))
    assert_teacher_forced(prompts[1], scored, teacher_forced(tiny_llama_dir, prompts[1:2])[0])


def _block_hashes(prompt: list[int]) -> list[bytes]:
    size, hashes = 16, []
    for index in range(len(prompt) // size):
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 prompt[index * size:(index + 1) * size], None))
    return hashes


def test_n_samples_carry_one_set_of_prompt_logprobs(tiny_llama_dir: Path) -> None:
    prompt = random_prompts(1, seed=8)[0]
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=7)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=0)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert_teacher_forced(prompt, output.prompt_logprobs,
                          teacher_forced(tiny_llama_dir, [prompt])[0], top=0)


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_rejected(value: int) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=value)
