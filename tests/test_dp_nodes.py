"""Data parallelism across nodes, as "nodes" on this machine: a head (`-dp 3 -dpl 1 -dpa
-dpp`) serves rank 0 and waits for ranks 1-2, which a `--headless -dpr 1` node runs; nodes
that do not fit are refused with one line while the head goes on waiting. Under an outside
load balancer (`-dpn R`), a server runs exactly rank R, its metrics labelled so."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_utils import TINY_SERVER_ARGS, RemoteServer, cli_env, free_port
from test_data_parallel import _engine_samples

from pagellm.distributed import group
from pagellm.distributed.config import ParallelArgs, bound_cores
from pagellm.distributed.dp_nodes import EngineClaim, EngineRoster
from pagellm.distributed.ray_data_parallel import (NODE_LABEL, RayEngineCores,
                                                   bundle_selectors, engine_places)
from pagellm.distributed.roster import NodeRefused

KEY = {"PAGELLM_DIST_AUTHKEY": "test-secret"}


def _headless(model: Path, port: int, *flags: str, key: str = KEY["PAGELLM_DIST_AUTHKEY"]
              ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model),
         *TINY_SERVER_ARGS, "--headless", "-dpa", "127.0.0.1", "-dpp", str(port), *flags],
        env={**cli_env(), "PAGELLM_DIST_AUTHKEY": key}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def _wait_for_line(server: RemoteServer, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, server.output()):
        assert server.process.poll() is None and time.monotonic() < deadline, server.output()
        time.sleep(0.2)


def test_a_headless_node_serves_the_ranks_the_head_waits_for(tiny_llama_dir: Path) -> None:
    port = free_port()
    head = RemoteServer(tiny_llama_dir, "-dp", "3", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp",
                        str(port), env=KEY, wait=False)
    nodes: list[subprocess.Popen] = []
    try:
        _wait_for_line(head, r"Waiting for the data parallel engines \(\d+ s\): 1 of 3 data "
                             r"parallel engines joined; missing rank\(s\) 1, 2")
        misfits = [_headless(tiny_llama_dir, port, "-dp", "2", "-dpr", "1"),
                   _headless(tiny_llama_dir, port, "-dp", "3", "-dpl", "1"),
                   _headless(tiny_llama_dir, port, "-dp", "3", "-dpr", "1", key="other")]
        nodes += [*misfits, _headless(tiny_llama_dir, port, "-dp", "3", "-dpr", "1")]
        outputs = [node.communicate(timeout=120)[0] for node in misfits]
        assert [node.returncode for node in misfits] == [1, 1, 1], outputs
        assert re.search(r"node \S+ was started with -dp 2, the head with -dp 3: start every "
                         r"node with the same -dp", outputs[0]), outputs[0]
        assert re.search(r"node \S+ is refused: -dpr 0 -dpl 1 \(data parallel rank 0\) "
                         r"overlaps the head's own rank 0; the head waits for ranks 1-2",
                         outputs[1]), outputs[1]
        assert ("The data parallel head at 127.0.0.1:%d has another key: set the same "
                "PAGELLM_DIST_AUTHKEY and -dpp on every node." % port) in outputs[2]
        head.wait_healthy()
        _check_every_rank_serves(head, tiny_llama_dir, ranks={"0", "1", "2"})
        assert "All 3 data parallel engines joined" in head.output()
    finally:
        head.stop()
        for node in nodes:
            try:
                node.wait(timeout=30)  # the head's end stops a node's engines
            except subprocess.TimeoutExpired:
                node.kill()
    output, _ = nodes[-1].communicate()
    assert nodes[-1].returncode == 0, output
    assert re.search(r"Headless node \S+: data parallel ranks 1-2 of 3 join the head", output)


def _check_every_rank_serves(server: RemoteServer, model: Path, ranks: set[str]) -> None:
    """Concurrent greedy requests all complete, each rank serves some, and each answer is
    the one the prompt gets alone, whichever rank served it."""
    client = server.client()

    def ask(index: int) -> str:
        answer = client.completions.create(model=str(model), prompt=f"Request {index} says",
                                           max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length"
        return answer.choices[0].text

    with ThreadPoolExecutor(9) as pool:
        answers = list(pool.map(ask, range(18)))
    assert [ask(index) for index in (0, 7)] == [answers[0], answers[7]]
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    served = _engine_samples(text, "vllm:request_success_total")
    assert set(served) == ranks and all(count > 0 for count in served.values()), served
    assert sum(served.values()) == 18 + 2


def test_an_outside_load_balancer_rank_serves_alone_under_its_label(
        tiny_llama_dir: Path) -> None:
    server = RemoteServer(tiny_llama_dir, "-dp", "2", "-dpn", "1")
    try:
        answer = server.client().completions.create(model=str(tiny_llama_dir), prompt="Hello",
                                                    max_tokens=3)
        assert answer.choices[0].finish_reason == "length"
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert _engine_samples(text, "vllm:request_success_total") == {"1": 1.0}
        assert _engine_samples(text, "vllm:num_requests_running") == {"1": 0.0}
        assert "Data parallel rank 1 of 2" in server.output()
    finally:
        server.stop()


def _claim(node: str, first: int, count: int, rank: int, size: int = 4) -> EngineClaim:
    return EngineClaim(node, size, first, count, rank)


def test_the_roster_admits_the_remote_ranks_and_refuses_misfits_with_one_line() -> None:
    roster = EngineRoster(ParallelArgs(data_parallel_size=4, data_parallel_size_local=1)
                          .parallel_config().data_parallel)
    assert roster.admit(_claim("pod-a", 1, 2, 2)) == 2
    roster.conns[2] = None  # type: ignore[assignment]  # (no socket here)
    assert roster.progress() == "2 of 4 data parallel engines joined; missing rank(s) 1, 3"
    refusals = [
        (_claim("pod-b", 0, 2, 0), "node pod-b is refused: -dpr 0 -dpl 2 (data parallel "
         "ranks 0-1) overlaps the head's own rank 0; the head waits for ranks 1-3"),
        (_claim("pod-c", 2, 2, 3), "node pod-c is refused: data parallel rank 2 is already "
         "held by node pod-a; give each headless node its own -dpr"),
        (_claim("pod-d", 3, 1, 3, size=5), "node pod-d was started with -dp 5, the head with "
         "-dp 4: start every node with the same -dp"),
        (_claim("pod-a", 1, 2, 2), "data parallel rank 2 of node pod-a connected twice"),
        (_claim("pod-c", 3, 1, 3), "node pod-c is refused: data parallel rank 2 is already "
         "held by node pod-a; give each headless node its own -dpr"),  # refused for good
    ]
    for claim, message in refusals:
        with pytest.raises(NodeRefused) as refused:
            roster.admit(claim)
        assert str(refused.value) == message
    assert roster.admit(_claim("pod-a", 1, 2, 1)) == 1
    assert roster.admit(_claim("pod-e", 3, 1, 3)) == 3  # the refusals took nothing


def test_the_engines_ray_puts_on_one_node_split_its_cores_in_rank_order() -> None:
    places = engine_places(["node-a", "node-b", "node-a", "node-a"])
    assert [(p.rank, p.size, p.local_index, p.local_count) for p in places] == [
        (0, 4, 0, 3), (1, 4, 0, 1), (2, 4, 1, 3), (3, 4, 2, 3)]
    ray_head = ParallelArgs(data_parallel_size=4, data_parallel_backend="ray").parallel_config()
    assert (ray_head.data_parallel.local_ranks, ray_head.data_parallel.remote_ranks) == (
        range(0, 0), range(0, 4))  # every engine joins the head as a remote one


def test_ray_keeps_the_first_dpl_ranks_on_the_head_node() -> None:
    """-dp 4 -dpl 2 -dpb ray: every engine is still a Ray actor that joins the head; Ray
    keeps ranks 0-1 on the head's node. -dpl above -dp is one line."""
    layout = ParallelArgs(data_parallel_size=4, data_parallel_size_local=2,
                          data_parallel_backend="ray").parallel_config().data_parallel
    assert (layout.local_ranks, layout.remote_ranks, layout.ray_head_ranks) == (
        range(0, 0), range(0, 4), 2)
    with pytest.raises(ValueError) as refused:
        ParallelArgs(data_parallel_size=2, data_parallel_size_local=3,
                     data_parallel_backend="ray").parallel_config()
    assert str(refused.value) == ("data_parallel_size_local 3 (-dpl, the ranks Ray keeps on "
                                  "the head node) is above data_parallel_size 2.")


def test_ray_pins_the_head_ranks_placement_groups_by_node_label(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """-dp 2 -dpl 1 -tp 2: rank 0's bundles on the head's node, rank 1's on any other; when Ray
    places only some in time, the line says how many and that -dpl pins them."""
    monkeypatch.delenv("PAGELLM_RAY_CPUS_PER_RANK", raising=False)
    selectors: list[list[dict[str, str]] | None] = []

    def placement_group(bundles: list, strategy: str,
                        bundle_label_selector: list[dict[str, str]] | None) -> SimpleNamespace:
        selectors.append(bundle_label_selector)
        return SimpleNamespace(ready=lambda: len(selectors))

    cores = RayEngineCores.__new__(RayEngineCores)  # no Ray: only what _reserve asks of it
    cores.head_node = "head-id"
    cores.ray = SimpleNamespace(util=SimpleNamespace(placement_group=placement_group),
                                wait=lambda refs, num_returns, timeout: (refs[:1], refs[1:]),
                                cluster_resources=lambda: {"CPU": 2.0})
    layout = ParallelArgs(data_parallel_size=2, data_parallel_size_local=1,
                          data_parallel_backend="ray").parallel_config().data_parallel
    with pytest.raises(ValueError) as refused:
        cores._reserve(layout, 2)
    assert selectors == [[{NODE_LABEL: "head-id"}] * 2, [{NODE_LABEL: "!head-id"}] * 2]
    assert str(refused.value) == (
        "Ray placed 1 of 2 data parallel engines within 60 s: each needs 2 x 1 CPU "
        "(PAGELLM_RAY_CPUS_PER_RANK per rank) on one node, 1 of them on the head node (-dpl), "
        "and the cluster has 2 CPUs; add nodes with `ray start --address`.")
    assert bundle_selectors(0, None, "head-id", 2) is None  # without -dpl, Ray picks


def test_an_api_server_only_head_waits_for_every_rank() -> None:
    config = ParallelArgs(data_parallel_size=4, data_parallel_size_local=0).parallel_config()
    assert (config.data_parallel.local_ranks, config.data_parallel.remote_ranks) == (
        range(0, 0), range(0, 4))
    node = ParallelArgs(data_parallel_size=4, headless=True).parallel_config().data_parallel
    assert (node.local_ranks, node.remote_ranks) == (range(0, 4), range(0))


@pytest.mark.parametrize("flags, message", [
    ({"data_parallel_start_rank": 2}, r"start_rank 2 runs engines only: add --headless"),
    ({"data_parallel_start_rank": 2, "data_parallel_size_local": 3, "headless": True},
     r"ranks 2-4 \(-dpr 2 -dpl 3\) go beyond data_parallel_size 4"),
    ({"data_parallel_size_local": 0, "headless": True}, "with data_parallel_size_local 0 runs "
                                                        "nothing"),
    ({"data_parallel_rank": 4}, "data_parallel_rank 4 must be below data_parallel_size 4"),
    ({"data_parallel_rank": 1, "data_parallel_size_local": 1}, "leave out -dpl, -dpr and "
                                                               "--headless"),
    ({"data_parallel_backend": "ray", "data_parallel_size_local": 2, "headless": True},
     "data_parallel_backend 'ray' places every engine on the Ray cluster's nodes itself: "
     "leave out --headless."),
    ({"data_parallel_backend": "ray", "data_parallel_rank": 1}, "leave out -dpn."),
    ({"data_parallel_backend": "ray", "data_parallel_start_rank": 2,
      "data_parallel_size_local": 2}, "leave out -dpr."),
    ({"data_parallel_backend": "ray", "api_server_count": 2},
     "api_server_count 2 with data_parallel_backend 'ray' is not supported"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
     r"data parallelism combined with distributed_executor_backend 'ray' \(use "
     r"data_parallel_backend 'ray'\) is not supported"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "data parallelism combined with --nnodes"),
])
def test_inconsistent_data_parallel_layouts_are_one_line(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelArgs(data_parallel_size=4, **flags).parallel_config()


@pytest.mark.parametrize("engine, rank, cores", [
    (0, 0, [0]), (0, 1, [1, 2]), (1, 0, [3, 5]), (1, 1, [6, 7])])
def test_bound_threads_give_engine_0_its_ranks_first(
        monkeypatch: pytest.MonkeyPatch, engine: int, rank: int, cores: list[int]) -> None:
    """-dp 2 -tp 2: four core sets, engine 0's two ranks, then engine 1's (vLLM's order)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1-2|3,5|6-7")
    assert bound_cores(rank, 2, engine, 2) == cores
    assert ParallelArgs(data_parallel_size=2, tensor_parallel_size=2).parallel_config()


def test_ray_ranks_get_their_share_of_their_engines_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """-dpb ray -tp 2: an engine core on cores 4-7 hands its rank actors (which do not inherit
    its cores) their halves, as its worker processes would take them."""
    monkeypatch.setattr(group.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert group.rank_shares(2) == "4,5|6,7"
    monkeypatch.setenv("PAGELLM_CPU_OMP_THREADS_BIND", group.rank_shares(2))
    assert bound_cores(1, 2) == [6, 7]


def test_bound_threads_of_another_count_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with pytest.raises(ValueError) as refused:
        ParallelArgs(data_parallel_size=2, tensor_parallel_size=2).parallel_config()
    assert str(refused.value) == ("VLLM_CPU_OMP_THREADS_BIND=0|1 lists 2 core sets for 2 data "
                                  "parallel engines x 2 ranks; separate one set per rank "
                                  "with '|', engine 0's ranks first.")
    # a head serving the API only pins nothing; a node's sets are for the engines it runs
    assert ParallelArgs(data_parallel_size=2, tensor_parallel_size=2,
                        data_parallel_size_local=0).parallel_config()
    assert ParallelArgs(data_parallel_size=4, tensor_parallel_size=2, data_parallel_rank=3
                        ).parallel_config().data_parallel.rank == 3
    with pytest.raises(ValueError, match="with data_parallel_backend 'ray' .* is not supported"):
        ParallelArgs(data_parallel_size=2, data_parallel_backend="ray").parallel_config()
