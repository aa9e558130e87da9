"""Run by tests/test_distributed_ray.py in a process of its own (a Ray driver and its
cluster must not outlive one test in the pytest process): a two-node Ray cluster on this
machine, TP=2 on Ray against the single-process engine. Prints what it found; exit code 0
when the tokens and logits agree and the ranks sit on two nodes.

    python tests/ray_two_nodes.py MODEL_DIR
"""

from __future__ import annotations

import os
import sys

import ray
from ray.cluster_utils import Cluster
from test_distributed import ENGINE, _check_same, _shutdown

from pagellm import LLM


def main(model: str) -> int:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        single = LLM(model, **ENGINE)
        parallel = LLM(model, tensor_parallel_size=2, distributed_executor_backend="ray",
                       **ENGINE)
        try:
            _check_same(single, parallel)
            placement = ray.util.placement_group_table(parallel.engine.core.executor.placement)
            nodes = set(placement["bundles_to_node_id"].values())
        finally:
            _shutdown(parallel)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"same tokens and logits; ranks on {len(nodes)} nodes", flush=True)
    return 0 if len(nodes) == 2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
