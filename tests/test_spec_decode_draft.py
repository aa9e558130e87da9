"""Speculative decoding with a draft model, on a tiny random pair of one tokenizer: the
target is a tiny llama as a quantized GGUF (batch invariant), the draft either the same
weights as a Hugging Face folder (drafts mostly accepted) or other random weights (mostly
rejected, so the residual distribution does the work)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from scipy.stats import chi2_contingency
from tiny_models import build_tiny_model, write_tiny_gguf

from pagellm import LLM, SamplingParams

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
PROMPTS = [[5, 9, 13, 21, 34, 55, 89], [100, 101, 102, 100, 101, 102, 100], [7] * 12,
           list(range(200, 240))]


@pytest.fixture(scope="module")
def pair(tiny_model_factory: Callable[[str], Path],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """(target GGUF, its tokenizer folder = the same-weights draft, an other-weights draft)."""
    folder = tiny_model_factory("llama")
    target = write_tiny_gguf(folder, tmp_path_factory.mktemp("target") / "tiny.gguf", Q4_1,
                             embedding_quantization=Q8_0)
    other = build_tiny_model(tmp_path_factory.mktemp("other-draft"), "llama", seed=1)
    return str(target), str(folder), str(other)


def _llm(pair: tuple[str, str, str], draft: str | None = None, **spec) -> LLM:
    config = None
    if draft is not None:
        config = {"model": draft, "num_speculative_tokens": 3, "disable_adaptive": True, **spec}
    return LLM(pair[0], tokenizer=pair[1], dtype="float32", max_model_len=256,
               kv_cache_memory=16 << 20, speculative_config=config)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_same_logprobs(outputs, plain, exact: bool) -> None:
    """Bit-identical where the engine is batch-invariant (its CPU kernels): verifying drafts
    attends several tokens of a request in one pass, where a plain decode attends one. On
    CUDA the pass's shape picks other kernels, which round differently."""
    got = [o.outputs[0].logprobs for o in outputs]
    want = [o.outputs[0].logprobs for o in plain]
    if exact:
        assert got == want
        return
    flat = [(token, entry) for steps in got for step in steps for token, entry in step.items()]
    expected = [(token, entry) for steps in want for step in steps
                for token, entry in step.items()]
    assert [token for token, _ in flat] == [token for token, _ in expected]
    assert ([entry.logprob for _, entry in flat]
            == pytest.approx([entry.logprob for _, entry in expected], abs=1e-4))


def test_greedy_with_a_draft_model_equals_greedy_without(pair: tuple[str, str, str]) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (24, 5, 17, 24)]
    plain = _llm(pair).generate(PROMPTS, params, use_tqdm=False)
    for draft in pair[1:]:
        llm = _llm(pair, draft)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert _tokens(outputs) == _tokens(plain)
        _assert_same_logprobs(outputs, plain, exact=llm.engine.core.device.type == "cpu")
        stats = llm.engine.core.spec_decoder.stats
        assert stats.num_drafts > 10
        llm.engine.core.scheduler.check_integrity()
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # the other draft misses


def _second_tokens(llm: LLM, count: int) -> Counter:
    params = SamplingParams(temperature=1.0, top_k=12, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([PROMPTS[0]] * count, params, use_tqdm=False)
    return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outputs)


@pytest.mark.parametrize("draft_index", [1, 2])
def test_probabilistic_drafts_keep_the_target_distribution(pair: tuple[str, str, str],
                                                           draft_index: int) -> None:
    """The second and third tokens (verified ones) of many samples, with and without a
    probabilistic draft: one distribution (a chi-square test of homogeneity)."""
    count = 500
    plain = _second_tokens(_llm(pair), count)
    llm = _llm(pair, pair[draft_index], draft_sample_method="probabilistic")
    spec = _second_tokens(llm, count)
    assert llm.engine.core.spec_decoder.stats.num_draft_tokens > count  # two per request
    common = [key for key in plain if plain[key] + spec[key] >= 10]
    rows = [[plain[key] for key in common], [spec[key] for key in common]]
    rows[0].append(count - sum(rows[0]))
    rows[1].append(count - sum(rows[1]))
    assert chi2_contingency(rows).pvalue > 1e-3


def test_seeded_probabilistic_drafts_reproduce(pair: tuple[str, str, str]) -> None:
    llm = _llm(pair, pair[2], draft_sample_method="probabilistic")
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=12, ignore_eos=True)
              for s in range(4)]
    first = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert _tokens(llm.generate(PROMPTS[::-1], params[::-1], use_tqdm=False)) == first[::-1]


def test_a_draft_with_another_vocabulary_is_refused(pair: tuple[str, str, str],
                                                    smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match="does not share the target model's tokenizer"):
        _llm(pair, str(smollm2_gguf))
