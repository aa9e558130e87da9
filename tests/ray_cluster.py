"""A Ray cluster of two nodes on this machine, for the Ray tests (tests/test_distributed_ray.py):
a head and a second raylet of one CPU each, as `ray start --head` and `ray start --address`
make them. It runs in a process of its own, so that no Ray state reaches the pytest process;
it prints the cluster's address and lives until its stdin closes.

    python tests/ray_cluster.py
"""

from __future__ import annotations

import sys

from ray.cluster_utils import Cluster


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1,
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        print(cluster.address, flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
