"""Data parallelism: the balancer's choices, exactly, and a `-dp 2` server through the openai
SDK (every request served, both engines used, metrics per engine, blocks all freed)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from server_utils import RemoteServer

from pagellm.core.sched_output import SchedulerStats
from pagellm.distributed.data_parallel import DataParallelBalancer
from pagellm.entrypoints.llm import LLM
from pagellm.sampling_params import SamplingParams

BLOCK = 4


def stats(running: int, waiting: int) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0.0, 0, 0, 0)


def test_new_requests_go_to_the_least_loaded_engine_counting_what_was_sent_since() -> None:
    balancer = DataParallelBalancer(3, BLOCK, capacity_blocks=100)
    balancer.observe(0, stats(running=2, waiting=0))
    balancer.observe(1, stats(running=0, waiting=1))   # one waiting weighs four running
    balancer.observe(2, stats(running=3, waiting=0))
    prompt = list(range(3))                            # shorter than a block: no prefix
    # scores 2, 4, 3; a request sent counts as waiting until the engine's next step
    assert [balancer.pick(prompt, None) for _ in range(4)] == [0, 2, 1, 0]
    balancer.observe(1, stats(running=1, waiting=0))   # engine 1's step: its queue drained
    assert balancer.pick(prompt, None) == 1


def test_among_equals_the_engine_holding_the_prefix_wins() -> None:
    balancer = DataParallelBalancer(2, BLOCK, capacity_blocks=100)
    shared = list(range(100, 112))                     # three full blocks
    assert balancer.pick(shared + [1], None) == 0
    balancer.observe(0, stats(running=1, waiting=0))
    balancer.observe(1, stats(running=1, waiting=0))
    assert balancer.pick(shared + [2], None) == 0      # equal load: engine 0 holds the blocks
    assert balancer.pick(shared + [3], "other salt") == 1  # another salt: other blocks
    balancer.observe(0, stats(running=3, waiting=0))
    balancer.observe(1, stats(running=1, waiting=0))
    assert balancer.pick(shared + [4], None) == 1      # the prefix never outweighs load


def test_the_offline_engine_refuses_data_parallelism(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="runs in `pagellm serve`"):
        LLM(str(tiny_llama_dir), data_parallel_size=2)


def _engine_samples(text: str, name: str) -> dict[str, float]:
    pattern = re.compile(rf'^{re.escape(name)}{{engine="(\d+)"[^}}]*}} (\S+)$')
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = pattern.match(line)
        if match:
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[2])
    return totals


def test_two_engines_serve_concurrent_clients(tiny_llama_dir: Path) -> None:
    server = RemoteServer(tiny_llama_dir, "-dp", "2")
    try:
        client = server.client()

        def ask(index: int) -> str:
            answer = client.completions.create(
                model=str(tiny_llama_dir), prompt=f"Request number {index} says", max_tokens=6,
                temperature=0, n=1 + index % 2, extra_body={"ignore_eos": True})
            assert all(choice.finish_reason == "length" for choice in answer.choices)
            return answer.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(24)))
        alone = [ask(index) for index in (0, 5)]
        assert alone == [answers[0], answers[5]]  # greedy: the same whichever engine ran it
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        served = _engine_samples(text, "vllm:request_success_total")
        assert set(served) == {"0", "1"} and all(count > 0 for count in served.values())
        assert sum(served.values()) == 24 + 2   # one per request, whatever its n
        report = httpx.get(f"{server.url}/debug/kv-cache", timeout=30).json()
        assert report["used_blocks"] == 0 and report["num_requests"] == 0
        assert report["problem"] is None
        assert re.findall(r"Data parallel rank (\d) of 2", server.output()) in (["0", "1"],
                                                                              ["1", "0"])
    finally:
        server.stop()


PROMPTS = [f"Request number {index} says" for index in range(8)]
_GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def single_engine_answers(model: Path) -> list[str]:
    """The single-process engine's greedy answers to PROMPTS."""
    single = LLM(str(model), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24)
    return [output.outputs[0].text for output in single.generate(PROMPTS, _GREEDY)]


def check_both_engines_answer(server: RemoteServer, model: Path, expected: list[str]) -> None:
    """PROMPTS from 8 clients at once: every answer is `expected`'s, whichever of the two
    engines served it, and each engine served some."""
    client = server.client()

    def ask(prompt: str) -> str:
        return client.completions.create(model=str(model), prompt=prompt,
                                         max_tokens=_GREEDY.max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, PROMPTS)) == expected
    served = _engine_samples(httpx.get(f"{server.url}/metrics", timeout=5).text,
                             "vllm:request_success_total")
    assert set(served) == {"0", "1"} and sum(served.values()) == len(PROMPTS)


def test_each_engine_drives_its_own_tensor_parallel_ranks(tiny_llama_dir: Path) -> None:
    """-dp 2 -tp 2: two engine cores of two ranks each; every answer is the single-process
    engine's, whichever engine served it."""
    expected = single_engine_answers(tiny_llama_dir)
    server = RemoteServer(tiny_llama_dir, "-dp", "2", "-tp", "2")
    try:
        check_both_engines_answer(server, tiny_llama_dir, expected)
        assert server.output().count("Starting 1 worker processes for tensor parallel size "
                                     "2") == 2
    finally:
        server.stop()


def test_bound_threads_pin_each_engines_ranks_to_their_sets(tiny_llama_dir: Path) -> None:
    """-dp 2 -tp 2 with VLLM_CPU_OMP_THREADS_BIND="0|1|1|0": engine 0's ranks take the first
    two sets, engine 1's the next two; each engine core process holds its rank 0's cores,
    its worker its rank 1's."""
    server = RemoteServer(tiny_llama_dir, "-dp", "2", "-tp", "2",
                          env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|1|0"})
    try:
        answer = server.client().completions.create(model=str(tiny_llama_dir), prompt="Hello",
                                                    max_tokens=2)
        assert answer.choices[0].finish_reason == "length"
        cores = {}
        for engine in psutil.Process(server.process.pid).children():
            workers = engine.children()
            assert [" ".join(worker.cmdline()).count("pagellm.distributed.worker")
                    for worker in workers] == [1]
            cores[engine.name()] = (engine.cpu_affinity(), workers[0].cpu_affinity())
        assert cores == {"EngineCore_DP0": ([0], [1]), "EngineCore_DP1": ([1], [0])}
    finally:
        server.stop()
