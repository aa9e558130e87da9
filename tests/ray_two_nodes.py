"""Run by tests/test_distributed_ray.py in a process of its own (a Ray driver must not outlive
one test in the pytest process), on the two-node cluster of tests/ray_cluster.py that
RAY_ADDRESS names: TP=2 on Ray against the single-process engine. Prints what it found; exit
code 0 when the tokens and logits agree and the ranks sit on two nodes.

    RAY_ADDRESS=HOST:PORT python tests/ray_two_nodes.py MODEL_DIR
"""

from __future__ import annotations

import sys

import ray
from test_distributed import ENGINE, _check_same, _shutdown

from pagellm import LLM


def main(model: str) -> int:
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
    print(f"same tokens and logits; ranks on {len(nodes)} nodes", flush=True)
    return 0 if len(nodes) == 2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
