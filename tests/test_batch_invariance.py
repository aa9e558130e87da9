"""Batch invariance on the default path: the embedded GGUF with its default settings gives
each request the same logits (compared through their top logprobs, exactly) alone, in
batches of any size beside other requests, with any chunk budget, from a prefix cached in
either KV tier, after preemption by swap or by recompute, and after a restart; seeded
sampling therefore reproduces exactly. `--dtype float32` is the exact dequantized model."""

from __future__ import annotations

import random

import pytest

from smollm2_reference import TransformersReference

from pagellm import LLM, SamplingParams

STEPS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=STEPS, seed=7, logprobs=5,
                        ignore_eos=True)
WORDS = ["river", "stone", "city", "music", "war", "bread", "north", "queen", "engine", "salt"]


def default_llm(**kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 64 << 20)
    kwargs.setdefault("max_model_len", 512)
    return LLM(**kwargs)


def probe_prompts(tokenizer) -> list[list[int]]:
    """Prompts of lengths around block and chunk boundaries."""
    rng = random.Random(0)
    texts = ["The history of " + " ".join(rng.choice(WORDS) for _ in range(words))
             for words in (1, 6, 14, 31, 47, 90)]
    return [tokenizer.encode(text) for text in texts]


def other_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randrange(2, 150))]
            for _ in range(count)]


def signature(output) -> tuple:
    """A sequence's tokens and every step's top logprobs, as exact floats."""
    completion = output.outputs[0]
    return completion.token_ids, [sorted(step.items()) for step in completion.logprobs]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple]:
    return [signature(o) for o in llm.generate(prompts, params, use_tqdm=False)]


def alone(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[tuple]:
    return [run(llm, [p], params)[0] for p in prompts]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return default_llm(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return probe_prompts(llm.get_tokenizer())


@pytest.fixture(scope="module")
def reference(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt alone in its steps, computed from scratch."""
    return alone(llm, prompts)


@pytest.mark.parametrize("batch", [1, 7])
def test_logits_do_not_depend_on_the_rest_of_the_batch(llm: LLM, prompts, reference,
                                                       batch: int):
    others = other_prompts(batch - 1, seed=batch)
    for i, prompt in enumerate(prompts):
        at = i % batch
        mixed = run(llm, others[:at] + [prompt] + others[at:])
        assert mixed[at] == reference[i], f"prompt {i} in a batch of {batch}"


def test_logits_do_not_depend_on_a_full_batch_of_64(llm: LLM, prompts, reference):
    """Every probe at once, spread among 58 other requests: one batch of 64 per step."""
    batch = other_prompts(64 - len(prompts), seed=64)
    positions = [1 + 11 * i for i in range(len(prompts))]
    for position, prompt in zip(positions, prompts):  # increasing: each lands where named
        batch.insert(position, prompt)
    mixed = run(llm, batch)
    assert len(batch) == 64
    assert [mixed[at] for at in positions] == reference


def test_all_probes_together_equal_each_alone(llm: LLM, prompts, reference):
    assert run(llm, prompts) == reference


@pytest.mark.parametrize("budget", [7, 64, 2048])
def test_logits_do_not_depend_on_the_chunk_budget_or_a_restart(prompts, reference,
                                                               budget: int):
    chunked = default_llm(max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert run(chunked, prompts + other_prompts(5, seed=budget))[:len(prompts)] == reference


def test_logits_do_not_depend_on_prefix_hits_in_either_tier(prompts, reference):
    # A cache of 24 blocks of 16 tokens: after the others ran, the prompts' blocks are in the
    # second tier only and are loaded back from there.
    cached = default_llm(num_gpu_blocks_override=24, max_model_len=256, kv_offloading_size=0.05)
    scheduler = cached.engine.core.scheduler
    short = [p for p in prompts if len(p) < 120]
    assert alone(cached, short) == reference[:len(short)]
    assert alone(cached, short) == reference[:len(short)]
    assert scheduler.kv.prefix_hits > 0
    run(cached, other_prompts(6, seed=3))
    loaded = scheduler.transfers.loaded_blocks
    assert alone(cached, short) == reference[:len(short)]
    assert scheduler.transfers.loaded_blocks > loaded


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_logits_survive_preemption(prompts, reference, mode: str):
    tight = default_llm(num_gpu_blocks_override=20, max_model_len=256, preemption_mode=mode,
                        kv_offloading_size=0.05 if mode == "swap" else None,
                        enable_prefix_caching=False)
    short = [p for p in prompts if len(p) < 120]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=20, ignore_eos=True)
    expected = alone(tight, short, params)
    together = run(tight, short + other_prompts(6, seed=4), params)[:len(short)]
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert together == expected
    assert [tokens[:STEPS] for tokens, _ in expected] == [t for t, _ in reference[:len(short)]]


def test_seeded_sampling_reproduces_in_any_batch(llm: LLM, prompts):
    expected = alone(llm, prompts, SEEDED)
    mixed = run(llm, other_prompts(9, seed=5) + prompts, SEEDED)[9:]
    assert mixed == expected


def test_float32_is_the_exact_dequantized_model(smollm2_transformers: TransformersReference):
    exact = default_llm(dtype="float32")
    loaded = exact.engine.core.loaded
    assert all(m.int8_panels is None for m in loaded.model.modules() if hasattr(m, "int8_panels"))
    tokenizer = exact.get_tokenizer()
    chat = exact.engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    prompts = [chat] + [tokenizer.encode(text) for text in
                        ("The capital of France is", "def fibonacci(n):",
                         "Once upon a time, in a small village,")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ours = [o.outputs[0].token_ids for o in exact.generate(prompts, params, use_tqdm=False)]
    for tokens, prompt in zip(ours, prompts):
        assert tokens == smollm2_transformers.greedy(prompt, 24)
    assert "Paris" in tokenizer.decode(ours[0])
