"""Ray on a cluster of two nodes on this machine (a head and a second raylet, one CPU each, as
`ray start --head` and `ray start --address` make them; tests/ray_cluster.py runs it in a
process of its own, so that no Ray state reaches the pytest process), shared by the tests:

- tensor parallelism with Ray placing the ranks: the engine's two ranks on different nodes,
  the same greedy tokens and logits as the single-process engine (tests/ray_two_nodes.py);
- `-dp 2 -dpl 1 -tp 2 -dpb ray`: rank 0's engine on the head node (the API server's), rank
  1's on the other, each engine's two ranks on its own node, the single-process engine's
  greedy tokens for concurrent clients, and an engine whose actor dies is a 503 and a
  non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from server_utils import RemoteServer, cli_env
from test_data_parallel import (_engine_samples, check_both_engines_answer,
                                single_engine_answers)

pytest.importorskip("ray")
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[str, psutil.Process]]:
    """The cluster's address, and the process whose children its nodes are."""
    helper = subprocess.Popen([sys.executable, str(TESTS / "ray_cluster.py")], env=cli_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = helper.stdout.readline().strip()  # type: ignore[union-attr]
        assert address, "the Ray cluster did not start"
        yield address, psutil.Process(helper.pid)
    finally:
        helper.stdin.close()  # type: ignore[union-attr]
        helper.wait(timeout=120)


def test_ray_spreads_the_ranks_over_both_nodes(tiny_llama_dir: Path,
                                              ray_cluster: tuple[str, psutil.Process]) -> None:
    env = {**cli_env(), "RAY_ADDRESS": ray_cluster[0]}
    env["PYTHONPATH"] = f"{TESTS}:{env.get('PYTHONPATH', '')}"
    run = subprocess.run([sys.executable, str(TESTS / "ray_two_nodes.py"), str(tiny_llama_dir)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "same tokens and logits; ranks on 2 nodes" in run.stdout


def _engine_processes(cluster: psutil.Process) -> dict[str, psutil.Process]:
    """The engine cores' actor processes and their ranks' (`ray::_RankActor`), by name."""
    processes = cluster.children(recursive=True)
    found = {process.name(): process for process in processes
             if process.name().startswith("EngineCore_DP")}
    by_raylet = {process.ppid(): name for name, process in found.items()}
    for rank_actor in processes:
        if "_RankActor" in " ".join(rank_actor.cmdline()):
            found[f"{by_raylet.get(rank_actor.ppid())} rank 1"] = rank_actor
    return found


def test_ray_places_each_data_parallel_engine_and_its_ranks_on_a_node(
        tiny_llama_dir: Path, ray_cluster: tuple[str, psutil.Process]) -> None:
    expected = single_engine_answers(tiny_llama_dir)
    server = RemoteServer(tiny_llama_dir, "-dp", "2", "-dpl", "1", "-tp", "2", "-dpb", "ray",
                          env={"RAY_ADDRESS": ray_cluster[0],
                               "PAGELLM_RAY_CPUS_PER_RANK": "0.5"}, startup_timeout=300)
    try:
        check_both_engines_answer(server, tiny_llama_dir, expected)
        engines = _engine_processes(ray_cluster[1])
        raylets = {name: process.ppid() for name, process in engines.items()}
        assert len(raylets) == 4, engines  # two engines, each with its rank 1
        on_head = {rank: "--head" in psutil.Process(raylets[f"EngineCore_DP{rank}"]).cmdline()
                   for rank in (0, 1)}
        assert on_head == {0: True, 1: False}  # -dpl 1: rank 0 on the head node, 1 off it
        cores = sorted(os.sched_getaffinity(0))  # each node's: an engine's, halved
        halves = cores[:len(cores) // 2], cores[len(cores) // 2:len(cores) // 2 * 2]
        assert {name: process.cpu_affinity() for name, process in engines.items()} == {
            f"EngineCore_DP{rank}{part}": list(half) for rank in (0, 1)
            for part, half in zip(("", " rank 1"), halves)}
        _check_an_engine_death_is_a_503(server, tiny_llama_dir, engines["EngineCore_DP1"])
    finally:
        server.stop()


def _check_an_engine_death_is_a_503(server: RemoteServer, model: Path,
                                    engine: psutil.Process) -> None:
    errors: list[openai.APIStatusError] = []

    def long_request() -> None:
        try:
            server.client().completions.create(model=str(model), prompt="Once upon",
                                               max_tokens=1000, temperature=0,
                                               extra_body={"ignore_eos": True})
        except openai.APIStatusError as error:
            errors.append(error)

    threads = [threading.Thread(target=long_request) for _ in range(2)]  # one per engine
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while sum(_engine_samples(httpx.get(f"{server.url}/metrics", timeout=5).text,
                              "vllm:num_requests_running").values()) < 2:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.1)
    engine.kill()
    for thread in threads:
        thread.join(timeout=60)
    assert [error.status_code for error in errors] == [503, 503]
    assert server.process.wait(timeout=60) == 1
