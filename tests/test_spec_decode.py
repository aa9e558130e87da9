"""Speculative decoding: configuration, proposers, the rejection sampler's distribution, the
controller's rule, and end to end on the embedded model, where batch invariance makes greedy
and seeded outputs with speculation identical to those without."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from scipy.stats import chisquare, chi2_contingency

from pagellm import LLM, SamplingParams
from pagellm.spec_decode.config import parse_speculative_config
from pagellm.spec_decode.controller import (MAX_PROBE_INTERVAL, PROBE_INTERVAL,
                                            SpeculationController)
from pagellm.metrics.loggers import MetricFactory
from pagellm.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm, SpecDecodingStats
from pagellm.spec_decode.ngram import NgramProposer
from pagellm.spec_decode.rejection_sampler import accept_matching, rejection_sample

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_adaptive": True}
REPEATING = [
    "Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple,",
    "Copy: the cat sat on the mat. the cat sat on the mat. the cat sat on",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3",
    "Fix the typo and print the code again: def add(a, b):\n    retrun a + b\n",
    "Write a haiku about the sea.",
    "Summarise: The river rose. The river rose again. The river rose a third time.",
]


def test_config_json_dict_and_old_flags() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
                                      '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min) == ("ngram", 5, 4, 2)
    draft = parse_speculative_config({"model": "/m", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.draft_sample_method) == ("draft_model", "/m", "greedy")
    old = parse_speculative_config(None, "[ngram]", 3, 4)
    assert (old.method, old.num_speculative_tokens, old.prompt_lookup_max,
            old.prompt_lookup_min) == ("ngram", 3, 4, 4)
    assert parse_speculative_config(None, "/draft", 2).model == "/draft"
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("config, needle", [
    ('{"method": "ngram"', "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2}, "prompt_lookup_max"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}, "at least 1"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2, "typo": 1}, "unsupported keys"),
    ({"method": "ngram", "num_speculative_tokens": "3", "prompt_lookup_max": 2}, "integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min <="),
])
def test_bad_configs_are_refused(config, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_speculative_config(config)


def test_both_spellings_at_once_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        parse_speculative_config({"model": "/m", "num_speculative_tokens": 2}, num_tokens=2)


def test_ngram_proposes_what_followed_the_latest_occurrence() -> None:
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert proposer.propose([7, 1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]  # the latest one
    assert proposer.propose([1, 2, 3, 9, 1, 2], 5) == [3, 9, 1, 2]  # shorter near the end
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert NgramProposer(2, 2).propose([5, 1, 6, 1], 2) == []  # only a 1-gram matches


def test_matching_accepts_the_draft_while_it_equals_the_samples() -> None:
    assert accept_matching([4, 5, 6], [4, 5]) == [4, 5, 6]  # all accepted, bonus
    assert accept_matching([4, 7, 6], [4, 5]) == [4, 7]
    assert accept_matching([9, 5, 6], [4, 5]) == [9]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Each output position follows the target's p whatever the draft's q: the first token's
    marginal, and the second one's given the first was accepted (p here ignores context)."""
    generator = torch.Generator().manual_seed(0)
    vocab, trials = 6, 6000
    target = torch.tensor([[0.4, 0.3, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.2, 0.3, 0.3],
                           [1 / 6] * 6])
    draft = torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(trials):
        tokens = [int(torch.multinomial(row, 1, generator=generator)) for row in draft]
        output = rejection_sample(target, draft, tokens, generator)
        first[output[0]] += 1
        if len(output) > 1:
            second[output[1]] += 1
    assert chisquare(first, target[0] * trials).pvalue > 1e-3
    assert chisquare(second, target[1] * second.sum()).pvalue > 1e-3


def test_the_controller_drafts_for_a_lone_stream_and_not_for_a_big_batch() -> None:
    controller = SpeculationController(max_tokens=5)
    for tokens, seconds in ((1, 0.010), (8, 0.011), (64, 0.020), (256, 0.050)) * 10:
        controller.observe_step(tokens, seconds)
    for _ in range(60):
        controller.observe_draft("good", 5, 5)
        controller.observe_draft("bad", 5, 0)
        controller.observe_draft("half", 2, 1)
    assert controller.num_tokens("good", batch_size=1) == 5
    assert controller.num_tokens("half", batch_size=1) == 5
    assert controller.num_tokens("bad", batch_size=1) == 0
    assert controller.num_tokens("half", batch_size=256) == 0
    assert controller.num_tokens("good", batch_size=256) == 5
    assert SpeculationController(3, adaptive=False).num_tokens("any", 512) == 3


def probe_gaps(controller: SpeculationController, request_id: str, probes: int,
               accepted: int) -> list[int]:
    """Steps between the probes of a request drafting nothing, each probe verified with
    `accepted` tokens accepted."""
    gaps, steps = [], 0
    while len(gaps) < probes:
        steps += 1
        if controller.num_tokens(request_id, batch_size=1):
            controller.observe_draft(request_id, 1, accepted)
            gaps.append(steps)
            steps = 0
    return gaps


def test_probes_back_off_while_rejected_and_recover_once_accepted() -> None:
    controller = SpeculationController(max_tokens=4)
    for tokens, seconds in ((1, 0.010), (64, 0.020)) * 10:
        controller.observe_step(tokens, seconds)
    controller.observe_proposal(4, 0.04)  # a draft token costs a whole step: never pays
    controller.observe_draft("r", 4, 0)
    gaps = probe_gaps(controller, "r", 7, accepted=0)
    assert gaps == [PROBE_INTERVAL * 2, PROBE_INTERVAL * 4, PROBE_INTERVAL * 8,
                    MAX_PROBE_INTERVAL, MAX_PROBE_INTERVAL, MAX_PROBE_INTERVAL,
                    MAX_PROBE_INTERVAL]
    assert probe_gaps(controller, "r", 1, accepted=1) == [MAX_PROBE_INTERVAL]
    assert probe_gaps(controller, "r", 1, accepted=0) == [PROBE_INTERVAL]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_metrics_and_log_line_as_vllm() -> None:
    stats = SpecDecodingStats(3)
    stats.observe(3, 2)
    stats.observe(3, 0)
    registry = CollectorRegistry()
    SpecDecodingProm(MetricFactory(registry, "m"), 0, 3).record(stats)
    assert registry.get_sample_value("vllm:spec_decode_num_drafts_total",
                                     {"model_name": "m", "engine": "0"}) == 2
    assert registry.get_sample_value("vllm:spec_decode_num_draft_tokens_total",
                                     {"model_name": "m", "engine": "0"}) == 6
    assert registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_total",
                                     {"model_name": "m", "engine": "0"}) == 2
    assert registry.get_sample_value("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                     {"model_name": "m", "engine": "0", "position": "1"}) == 1
    handler = _Lines()
    logging.getLogger("pagellm.spec_decode.metrics").addHandler(handler)
    try:
        SpecDecodingLogging().log(stats)
        SpecDecodingLogging().log(SpecDecodingStats(3))  # no draft in the interval: no line
    finally:
        logging.getLogger("pagellm.spec_decode.metrics").removeHandler(handler)
    [line] = handler.lines
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.00, Accepted "
                           "throughput: ")
    assert line.endswith("Accepted: 2 tokens, Drafted: 6 tokens, Per-position acceptance rate: "
                         "0.500, 0.500, 0.000, Avg Draft acceptance rate: 33.3%")


def _llm(**kwargs) -> LLM:
    return LLM(kv_cache_memory=64 << 20, max_model_len=512, **kwargs)


@pytest.fixture(scope="module")
def outputs_without(smollm2_gguf: Path) -> dict[str, list]:
    llm = _llm()
    return {name: llm.generate(REPEATING, params, use_tqdm=False)
            for name, params in PARAMS.items()}


PARAMS = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=m, logprobs=3)
               for m in (40, 7, 33, 40, 2, 25)],
    "seeded": [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=30)
               for s in range(len(REPEATING))],
    "stops": [SamplingParams(temperature=0.0, max_tokens=40, stop=["date", "mat."],
                             stop_token_ids=[28]) for _ in REPEATING],
}


def signature(outputs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
             [sorted(step.items()) for step in o.outputs[0].logprobs or []]) for o in outputs]


def test_ngram_outputs_equal_those_without_speculation(outputs_without: dict[str, list]) -> None:
    """Greedy (tokens and logprobs), seeded, stop strings and max_tokens, all requests in
    one batch; the drafts are really used (and many accepted)."""
    llm = _llm(speculative_config=NGRAM)
    for name, params in PARAMS.items():
        got = llm.generate(REPEATING, params, use_tqdm=False)
        assert signature(got) == signature(outputs_without[name]), name
        assert all(len(o.outputs[0].token_ids) <= p.max_tokens for o, p in zip(got, params))
    stats = llm.engine.core.spec_decoder.stats
    assert stats.num_drafts > 20 and stats.num_accepted_tokens > stats.num_drafts
    core = llm.engine.core
    core.scheduler.check_integrity()
    assert core.scheduler.kv.usage() == 0.0  # no block of a rejected draft is left behind


def test_adaptive_speculation_stays_exact(outputs_without: dict[str, list]) -> None:
    llm = _llm(speculative_config={**NGRAM, "disable_adaptive": False},
               max_num_batched_tokens=24)
    got = llm.generate(REPEATING, PARAMS["greedy"], use_tqdm=False)
    assert signature(got) == signature(outputs_without["greedy"])
