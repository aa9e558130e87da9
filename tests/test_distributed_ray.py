"""Tensor parallelism with Ray placing the ranks: a Ray cluster of two nodes on this machine
(a head and a second raylet, one CPU each, as `ray start --head` and `ray start --address`
make them), the engine's worker rank on the second node, and the same greedy tokens and
logits as the single-process engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_distributed import ENGINE, _check_same, _shutdown

from pagellm import LLM

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")


@pytest.fixture
def two_node_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_ray_places_the_worker_rank_on_the_other_node(tiny_llama_dir: Path,
                                                        two_node_cluster: object) -> None:
    single = LLM(str(tiny_llama_dir), **ENGINE)
    parallel = LLM(str(tiny_llama_dir), tensor_parallel_size=2,
                   distributed_executor_backend="ray", **ENGINE)
    try:
        _check_same(single, parallel)
        placement = ray.util.placement_group_table(parallel.engine.core.executor.placement)
        nodes = placement["bundles_to_node_id"]
        head = two_node_cluster.head_node.node_id
        assert nodes[0] == head and nodes[1] != head  # rank 0 here, rank 1 on the other node
    finally:
        _shutdown(parallel)
