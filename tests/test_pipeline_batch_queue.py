"""The engine core's batch queue under pipeline parallelism (-pp 2): two batches in flight
at once, the same tokens as the single-process engine (greedy, seeded, n > 1), and requests
aborted or preempted while their batch is in flight dropped cleanly, their blocks freed once.

Both engines share a KV cache of 8 blocks (128 tokens) for 8 requests of up to 40 tokens,
so requests are preempted (recomputed) along the way, some of them while in flight."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.sched_output import SchedulerStats
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request

PROMPTS = [f"{word} and then the {word} went" for word in
           ("fox", "dog", "cat", "owl", "bee", "elk", "ant", "yak")]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ENGINE = {"dtype": "float32", "kv_cache_memory": 1 << 24, "max_model_len": 64,
          "num_gpu_blocks_override": 8}


@pytest.fixture(scope="module")
def single(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), **ENGINE)


@pytest.fixture(scope="module")
def pipelined(tiny_llama_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.core.executor.shutdown()


@dataclass
class Run:
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    stats: list[SchedulerStats] = field(default_factory=list)


def _add(llm: LLM, params: SamplingParams, prefix: str) -> None:
    for index, prompt in enumerate(PROMPTS):
        llm.engine.add_request(f"{prefix}{index}", prompt, params)


def _step(llm: LLM, run: Run) -> None:
    for output in llm.engine.step():
        if output.finished:
            run.tokens[output.request_id] = [list(o.token_ids) for o in output.outputs]
    run.stats.append(llm.engine.last_stats)
    llm.engine.core.scheduler.check_integrity()


def _drain(llm: LLM, run: Run) -> Run:
    """Step the engine until it is idle, checking the block pool after every step."""
    while llm.engine.has_unfinished_requests():
        _step(llm, run)
    core = llm.engine.core
    assert not core.batch_queue and not core.scheduler.in_flight
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks
    return run


def _run(llm: LLM, params: SamplingParams, prefix: str) -> Run:
    """Each prompt's tokens (per sample) and each step's stats."""
    _add(llm, params, prefix)
    return _drain(llm, Run())


def test_two_batches_in_flight_same_greedy_tokens(single: LLM, pipelined: LLM) -> None:
    expected = _run(single, GREEDY, "greedy-")
    got = _run(pipelined, GREEDY, "greedy-")
    assert got.tokens == expected.tokens and len(got.tokens) == len(PROMPTS)
    depths = [s.batches_in_flight for s in got.stats]
    assert max(depths) == 2
    first, last = got.stats[0], got.stats[-1]
    launched = last.num_batches - first.num_batches + 1
    overlapped = last.num_overlapped_batches - first.num_overlapped_batches
    assert overlapped == depths.count(2) and overlapped > launched // 2
    assert single.engine.core.batch_queue_size == 1  # -pp 1: no queue at all
    assert {s.batches_in_flight for s in expected.stats} == {0}


@pytest.mark.parametrize("n", [1, 2])
def test_seeded_samples_match_one_process(single: LLM, pipelined: LLM, n: int) -> None:
    """A seeded row's noise depends on its seed, sibling and step only, never on the batch
    it ran in, nor on a preemption that recomputed it."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, n=n, ignore_eos=True)
    assert (_run(pipelined, params, f"seeded{n}-").tokens
            == _run(single, params, f"seeded{n}-").tokens)


def test_request_aborted_in_flight_frees_its_blocks_once(single: LLM, pipelined: LLM) -> None:
    engine, scheduler = pipelined.engine, pipelined.engine.core.scheduler
    _add(pipelined, GREEDY, "abort-")
    run = Run()
    _step(pipelined, run)
    victim = scheduler.requests["abort-0"]
    assert "abort-0" in scheduler.in_flight and victim.block_ids
    assert any(item.request is victim for item in engine.core.batch_queue[0].step.scheduled)
    engine.abort_request(["abort-0"])
    assert not victim.block_ids and "abort-0" not in scheduler.requests
    scheduler.check_integrity()
    _drain(pipelined, run)
    assert victim.num_output_tokens == 0 and victim.num_computed_tokens == 0  # result dropped
    assert "abort-0" not in run.tokens
    expected = _run(single, GREEDY, "abort-").tokens
    assert run.tokens == {k: v for k, v in expected.items() if k != "abort-0"}


def test_request_preempted_in_flight_is_recomputed(single: LLM, pipelined: LLM,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8-block cache preempts; a victim whose batch is in flight has its late token
    dropped and, recomputed once that batch is back, ends with the single engine's tokens."""
    scheduler = pipelined.engine.core.scheduler
    in_flight_victims: list[str] = []
    preempt = Scheduler._preempt

    def record(request: Request) -> None:
        if request.request_id in scheduler.in_flight:
            in_flight_victims.append(request.request_id)
        preempt(scheduler, request)

    monkeypatch.setattr(scheduler, "_preempt", record)
    got = _run(pipelined, GREEDY, "preempt-")
    assert in_flight_victims
    assert got.tokens == _run(single, GREEDY, "preempt-").tokens
