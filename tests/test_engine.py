"""The whole engine on tiny random models: equivalence, chunking, preemption, sampling, n."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def make_llm(model_dir: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 8 << 20)
    return LLM(str(model_dir), dtype="float32", **kwargs)


def mixed_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    scheduler = llm.engine.core.scheduler
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir, max_model_len=256)


def test_greedy_tokens_match_transformers(tiny_model_dir: Path):
    llm = make_llm(tiny_model_dir)
    prompts = mixed_prompts(6)
    # min_tokens masks every end token, as transformers' min_new_tokens does.
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)
    ours = token_ids(llm.generate(prompts, params, use_tqdm=False))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=32, min_new_tokens=32, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
    assert_all_blocks_free(llm)


def test_chunked_prefill_gives_the_same_tokens(tiny_llama_dir: Path, llama: LLM):
    prompts = mixed_prompts(5, seed=1)
    whole = token_ids(llama.generate(prompts, GREEDY, use_tqdm=False))
    chunked = make_llm(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=7)
    assert token_ids(chunked.generate(prompts, GREEDY, use_tqdm=False)) == whole
    assert_all_blocks_free(chunked)


def test_preemption_gives_the_same_tokens(tiny_llama_dir: Path, llama: LLM):
    prompts = mixed_prompts(8, seed=2)
    expected = token_ids(llama.generate(prompts, GREEDY, use_tqdm=False))
    tight = make_llm(tiny_llama_dir, max_model_len=80, block_size=4, num_gpu_blocks_override=24)
    assert token_ids(tight.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(tight)


def test_prompt_alone_equals_prompt_in_a_batch_of_16(llama: LLM):
    prompts = mixed_prompts(16, seed=3)
    alone = token_ids(llama.generate(prompts[7], GREEDY, use_tqdm=False))
    batch = token_ids(llama.generate(prompts, GREEDY, use_tqdm=False))
    assert batch[7] == alone[0]


def test_seeded_sampling_is_the_same_in_any_batch(llama: LLM):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    noise = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(6, seed=4)
    alone = token_ids(llama.generate(prompts[0], seeded, use_tqdm=False))
    mixed = llama.generate(prompts, [noise, noise, noise, seeded, noise, noise], use_tqdm=False)
    swapped = llama.generate(prompts[::-1], [noise] * 2 + [seeded] + [noise] * 3, use_tqdm=False)
    assert token_ids([mixed[3]])[0] == token_ids([swapped[2]])[0]
    assert token_ids(llama.generate(prompts[3], seeded, use_tqdm=False)) == token_ids([mixed[3]])
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
    assert token_ids(llama.generate(prompts[0], other_seed, use_tqdm=False)) != alone


def test_stop_strings_end_and_trim_the_text(llama: LLM):
    prompt = mixed_prompts(1, seed=5)[0]
    full = llama.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    head = full[: full.index(stop)]
    out = llama.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (head, "stop", stop)
    kept = llama.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, stop=stop,
                                                 include_stop_str_in_output=True),
                          use_tqdm=False)[0].outputs[0]
    assert kept.text == head + stop
    assert_all_blocks_free(llama)


def test_n_sequences_share_a_prompt(llama: LLM):
    prompt = mixed_prompts(1, seed=6)[0]
    greedy = llama.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=16,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in greedy.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert greedy.outputs[0].token_ids == token_ids(llama.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False))[0]
    sampled = llama.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) == 4
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in sampled.outputs)
    assert_all_blocks_free(llama)


def test_logprobs_rank_the_greedy_token_first(llama: LLM):
    out = llama.generate(mixed_prompts(1, seed=8)[0],
                         SamplingParams(temperature=0.0, max_tokens=4, logprobs=3),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token_id, entries in zip(out.token_ids, out.logprobs):
        assert entries[token_id].rank == 1
        assert len(entries) == 3
        assert max(e.logprob for e in entries.values()) == entries[token_id].logprob
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_abort_frees_blocks_mid_generation(llama: LLM):
    engine = llama.engine
    for index, prompt in enumerate(mixed_prompts(3, seed=9)):
        engine.add_request(f"abort-{index}", prompt, GREEDY)
    engine.step()
    engine.step()
    finals = engine.abort_request(["abort-0", "abort-1", "abort-2"])
    assert [f.outputs[0].finish_reason for f in finals] == ["abort"] * 3
    assert_all_blocks_free(llama)


def test_chat_applies_the_template(llama: LLM):
    messages = [{"role": "user", "content": "Hello!"}]
    out = llama.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    expected = llama.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=False)
    assert llama.get_tokenizer().decode(out.prompt_token_ids) == expected


def test_prompt_longer_than_the_context_is_rejected(llama: LLM):
    with pytest.raises(ValueError, match="longer than the maximum model length of 256"):
        llama.generate([5] * 300, GREEDY, use_tqdm=False)


def test_kv_budget_too_small_names_the_largest_max_model_len(tiny_llama_dir: Path):
    with pytest.raises(ValueError, match="largest max_model_len that fits is 64"):
        make_llm(tiny_llama_dir, max_model_len=512, block_size=16, num_gpu_blocks_override=4)


def test_prefix_caching_gives_the_same_tokens(tiny_llama_dir: Path, llama: LLM):
    system = mixed_prompts(1, seed=10)[0] * 3  # a shared prefix several blocks long
    prompts = [system + tail for tail in mixed_prompts(6, seed=11)]
    cold = make_llm(tiny_llama_dir, max_model_len=256, enable_prefix_caching=False)
    expected = token_ids(cold.generate(prompts, GREEDY, use_tqdm=False))
    kv = llama.engine.core.scheduler.kv
    hits_before = kv.prefix_hits
    assert token_ids(llama.generate(prompts[:1], GREEDY, use_tqdm=False)) == expected[:1]
    assert token_ids(llama.generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert kv.prefix_hits - hits_before >= 6 * (len(system) // 16) * 16
    assert_all_blocks_free(llama)


# fp8's tolerance: e4m3 keeps 3 bits of mantissa to bf16's 7, and this random model's
# logprobs moved by up to 0.40 (e4m3) and 0.33 (e5m2); unread or misread keys move them by nats
@pytest.mark.parametrize("name,dtype,ratio,tolerance", [
    ("bfloat16", torch.bfloat16, 2, 2e-2), ("fp8", torch.float8_e4m3fn, 4, 0.5),
    ("fp8_e5m2", torch.float8_e5m2, 4, 0.5)])
def test_a_narrower_kv_cache_under_float32_holds_more_blocks(
        tiny_llama_dir: Path, llama: LLM, name: str, dtype: torch.dtype, ratio: int,
        tolerance: float):
    """Same budget, a half (bf16) or a quarter (fp8) of the bytes per block; the first
    token's distribution (its logits read the prompt's keys, rounded to the cache's dtype)
    stays within that rounding of float32's."""
    narrow = make_llm(tiny_llama_dir, max_model_len=256, kv_cache_dtype=name)
    wide_blocks = llama.engine.core.num_blocks
    assert ratio * wide_blocks <= narrow.engine.core.num_blocks < ratio * (wide_blocks + 1)
    assert narrow.engine.core.runner.kv_caches[0].dtype == dtype
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    prompts = mixed_prompts(4, seed=12)
    for wide, rounded in zip(llama.generate(prompts, params, use_tqdm=False),
                             narrow.generate(prompts, params, use_tqdm=False)):
        wide_top, rounded_top = wide.outputs[0].logprobs[0], rounded.outputs[0].logprobs[0]
        for token_id in wide_top.keys() & rounded_top.keys():
            assert rounded_top[token_id].logprob == pytest.approx(wide_top[token_id].logprob,
                                                                  abs=tolerance)
        assert len(wide_top.keys() & rounded_top.keys()) >= 3
    assert_all_blocks_free(narrow)


@pytest.mark.parametrize("name", ["fp8_inc", "int4"])
def test_an_unsupported_kv_cache_dtype_is_rejected_before_loading(name: str):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype=name).cache_config()


def test_decode_step_reads_the_weights_and_every_context(llama: LLM):
    """bench throughput's memory figure: float32 weights of every projection, plus each
    request's keys and values over the timed steps (a prompt, its first token, then one
    more token a step)."""
    from pagellm.benchmarks.throughput import time_decode_step

    arch = llama.engine.core.loaded.arch
    projections = (arch.hidden_size * (arch.num_attention_heads + 2 * arch.num_key_value_heads)
                   * arch.head_dim + arch.num_attention_heads * arch.head_dim * arch.hidden_size
                   + 3 * arch.hidden_size * arch.intermediate_size)
    weights = 4 * (arch.num_hidden_layers * projections + arch.hidden_size * arch.vocab_size)
    token = 4 * 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    _, read = time_decode_step(llama, [[5] * 20, [7] * 20, [9] * 20], steps=5)
    assert read == weights + 3 * (20 + 1 + (5 - 1) / 2) * token
    assert_all_blocks_free(llama)


def test_an_engine_core_loads_no_tokenizer_until_something_needs_it(tiny_llama_dir: Path):
    """Behind an API server the engine core starts without the tokenizer (the server loads
    its own meanwhile): its import and load were a second of every restart. A grammar, a
    draft model or the offline LLM load it at first use."""
    from pagellm.engine.core import EngineCore
    from pagellm.model.text import TokenizerSpec

    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=8 << 20)
    core = EngineCore(args.model_config(), args.cache_config(), args.scheduler_config(),
                      torch.device("cpu"), args.grammar_config())
    info = core.model_info()
    assert "text" not in vars(core.loaded)
    assert (info.model_type, info.tokenizer_spec) == ("llama",
                                                      TokenizerSpec(tiny_llama_dir, None, "hf"))
    tokenizer = core.loaded.tokenizer
    assert core.loaded.eos_token_ids[0] == tokenizer.eos_token_id
