"""`--data-parallel-backend ray` (`-dpb ray`): the data parallel engine cores as Ray actors,
placed across the nodes of a Ray cluster by one command on the head.

Each rank gets a placement group of its own: one bundle per tensor x pipeline rank
(`PAGELLM_RAY_CPUS_PER_RANK` CPUs each, default 1), all on one node (STRICT_PACK), so that an
engine's ranks talk over that node's loopback. Ray picks the node; with `-dpl L` (vLLM's
`-dp 4 -dpl 2 -dpb ray`), ranks 0..L-1 go to the head's node (the API server's) and the
others to any other node, by the `ray.io/node-id` label Ray gives every node. The engine
core's actor runs in bundle 0 next to its rank 0, and with `-tp`/`-pp` the Ray executor puts
the other ranks in the group's other bundles. The actor runs the same engine core loop as a
`--headless` node's engine process: it connects back to the head over TCP, passes the
challenge (a random key made for this run) and serves the head through that socket, so the
API server talks to it exactly as to a remote engine of `-dpl`/`-dpa` (its death closes the
socket: the server answers 503 and exits non-zero). The engines Ray puts on one node split
that node's cores, as the engines of one `pagellm serve -dp N` do.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import time
from collections import Counter
from typing import Any

from pagellm.distributed.config import DEFAULT_DP_ADDRESS, DataParallelConfig
from pagellm.distributed.dp_nodes import EngineClaim, HeadSocket, serve_head
from pagellm.distributed.group import HOST_IP_ENV_VARS
from pagellm.distributed.ray_executor import (CPUS_PER_RANK_ENV, RayWorker, connect_ray,
                                              cpus_per_rank, forwarded_env)
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_process import EnginePlace
from pagellm.logger import init_logger

logger = init_logger(__name__)
PLACEMENT_SECONDS = 60.0
NODE_LABEL = "ray.io/node-id"  # Ray labels every node with its id; "!id": any other node


def bundle_selectors(rank: int, head_ranks: int | None, head_node: str,
                     world: int) -> list[dict[str, str]] | None:
    """The label selectors of rank `rank`'s `world` bundles: on the head's node for the first
    `head_ranks` ranks (-dpl), on any other for the rest; None without -dpl (Ray picks)."""
    if head_ranks is None:
        return None
    return [{NODE_LABEL: head_node if rank < head_ranks else f"!{head_node}"}] * world


def engine_places(nodes: list[str]) -> list[EnginePlace]:
    """Each rank's place, given the node Ray put it on: the engines of one node split its
    cores between them, in rank order."""
    on_node, seen = Counter(nodes), Counter[str]()
    places = []
    for rank, node in enumerate(nodes):
        places.append(EnginePlace(rank, len(nodes), seen[node], on_node[node]))
        seen[node] += 1
    return places


class RayEngineCores:
    """Reserves the placement groups, opens the head's socket and starts one engine actor
    per rank; `check` says whether one ended before joining, `shutdown` ends them all."""

    def __init__(self, args: EngineArgs, config: DataParallelConfig) -> None:
        self.ray = connect_ray("data_parallel_backend 'ray'")
        self.workers: list[RayWorker] = []
        self.groups: list[Any] = []  # Ray's PlacementGroup, by rank
        self.head_node: str = self.ray.get_runtime_context().get_node_id()  # the API server's
        # the actors reach the head at the address Ray knows this node by, unless -dpa
        host = (config.address if config.address != DEFAULT_DP_ADDRESS
                else self.ray.util.get_node_ip_address())
        self.head = HeadSocket(socket.create_server((host, 0)), secrets.token_bytes(32))
        try:
            self._reserve(config, args.tensor_parallel_size * args.pipeline_parallel_size)
            self._start(args)
        except BaseException:
            self.head.server.close()
            self.shutdown()
            raise

    def _reserve(self, config: DataParallelConfig, world: int) -> None:
        cpus, size, on_head = cpus_per_rank(), config.size, config.ray_head_ranks
        self.groups = [self.ray.util.placement_group(
            [{"CPU": cpus}] * world, strategy="STRICT_PACK",
            bundle_label_selector=bundle_selectors(rank, on_head, self.head_node, world))
            for rank in range(size)]
        ready, _ = self.ray.wait([group.ready() for group in self.groups], num_returns=size,
                                 timeout=PLACEMENT_SECONDS)
        if len(ready) < size:
            total = self.ray.cluster_resources().get("CPU", 0)
            pinned = "" if on_head is None else f", {on_head} of them on the head node (-dpl)"
            raise ValueError(f"Ray placed {len(ready)} of {size} data parallel engines within "
                             f"{PLACEMENT_SECONDS:g} s: each needs {world} x {cpus:g} CPU "
                             f"({CPUS_PER_RANK_ENV} per rank) on one node{pinned}, and the "
                             f"cluster has {total:g} CPUs; add nodes with `ray start "
                             f"--address`.")

    def _start(self, args: EngineArgs) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        names = {node["NodeID"]: f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}"
                 for node in self.ray.nodes()}
        nodes = [self.ray.util.placement_group_table(group)["bundles_to_node_id"][0]
                 for group in self.groups]
        env = forwarded_env(leave_out=HOST_IP_ENV_VARS)  # an engine's ranks share its node
        for place, group, node in zip(engine_places(nodes), self.groups, nodes):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            actor = self.ray.remote(num_cpus=0, scheduling_strategy=strategy)(
                _EngineActor).remote()
            claim = EngineClaim(names.get(node, node[:8]), place.size, place.rank, 1,
                                place.rank)
            result = actor.run.remote(self.head.address, self.head.authkey, claim, args,
                                      place, env)
            self.workers.append(RayWorker(self.ray, actor, result))
        logger.info("Ray placed %d data parallel engines on %d node(s), %d on the head node",
                    len(nodes), len(set(nodes)), nodes.count(self.head_node))

    def check(self) -> None:
        """Raises if an engine's actor ended before it joined the head."""
        for rank, worker in enumerate(self.workers):
            if worker.poll() is not None:
                raise RuntimeError(f"the engine core of data parallel rank {rank} (a Ray "
                                   f"actor) ended during start-up with exit code "
                                   f"{worker.returncode}; see its log above.")

    def shutdown(self) -> None:
        """After the head closed their sockets: each actor's loop ends; removing its
        placement group ends the actor and its ranks' actors either way."""
        deadline = time.monotonic() + 10
        for worker in self.workers:
            try:
                worker.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for group in self.groups:
            self.ray.util.remove_placement_group(group)


class _EngineActor:
    """A data parallel engine core in a Ray worker process; its one call lasts as long as the
    engine serves the head."""

    def run(self, address: str, authkey: bytes, claim: EngineClaim, args: EngineArgs,
            place: EnginePlace, env: dict[str, str]) -> int:
        os.environ.update(env)
        logger.info("Engine core of data parallel rank %d in Ray actor pid %d on node %s",
                    place.rank, os.getpid(), claim.node_id)
        return serve_head(address, authkey, claim, args, place)
