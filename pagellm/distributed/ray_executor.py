"""`--distributed-executor-backend ray`: the same ranks as the multiprocess executor, with
Ray placing the workers across the nodes of a cluster.

The driver (rank 0) stays in the engine core's process; each other rank is a Ray actor
whose one method runs the worker's loop (`pagellm.distributed.worker.main`), so the
workers' protocol, the gloo group and the preflight are the multiprocess executor's. A
placement group reserves one bundle per rank, the driver's on its own node, and packs the
rest onto the fewest nodes that hold them, as vLLM's Ray executor does. The cluster is the
one `ray start --head` / `ray start --address=HEAD:6379` made (or `RAY_ADDRESS` names); with
none running, Ray starts a local one. Workers reach the driver at `VLLM_HOST_IP` (or
`PAGELLM_HOST_IP`), which multi-node runs must set to an address the other nodes can reach.
"""

from __future__ import annotations

import os
import subprocess

from pagellm.distributed.config import THREADS_BIND_ENV_VARS, ParallelConfig
from pagellm.distributed.executor import MultiprocExecutor
from pagellm.distributed.group import ENGINE_SLOT_ENV, rank_shares, rendezvous_host
from pagellm.logger import init_logger

logger = init_logger(__name__)
CPUS_PER_RANK_ENV = "PAGELLM_RAY_CPUS_PER_RANK"


def connect_ray(what: str = "distributed_executor_backend 'ray'"):
    """The `ray` module, connected to the cluster (`RAY_ADDRESS`, else the one `ray start`
    made on this machine, else a new local one); inside an actor, to the actor's."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"{what} needs Ray: pip install 'ray>=2.40'.") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                 log_to_driver=True)
    return ray


def cpus_per_rank() -> float:
    return float(os.environ.get(CPUS_PER_RANK_ENV, "1"))


def forwarded_env(leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's pagellm, vLLM and gloo settings, for an actor on another node to run
    with (Ray actors do not inherit the driver's environment)."""
    return {name: value for name, value in os.environ.items()
            if name.startswith(("PAGELLM_", "VLLM_", "GLOO_")) and name not in leave_out}


def _run_worker(env: dict[str, str]) -> int:
    """The body of a rank's actor: the multiprocess worker's loop, told where the driver is."""
    os.environ.update(env)
    from pagellm.distributed.worker import serve_rank

    return serve_rank()


class RayWorker:
    """A rank's actor, with the part of subprocess.Popen's interface the executor uses."""

    def __init__(self, ray, actor, result) -> None:
        self._ray, self._actor, self._result = ray, actor, result
        self.pid: int | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, _ = self._ray.wait([self._result], timeout=0)
            if done:
                try:
                    self.returncode = int(self._ray.get(self._result))
                except Exception:  # noqa: BLE001 (the actor died: its own log says why)
                    self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        done, _ = self._ray.wait([self._result], timeout=timeout)
        if not done:
            raise subprocess.TimeoutExpired("ray actor", timeout or 0)
        return self.poll() or 0

    def kill(self) -> None:
        self._ray.kill(self._actor, no_restart=True)
        self.returncode = -9


class RayExecutor(MultiprocExecutor):
    """Rank r runs in bundle r of the placement group: the one this engine core's actor was
    placed in (-dpb ray: one group per data parallel rank), else one made here."""

    def __init__(self, parallel: ParallelConfig, device) -> None:
        if device.type == "cuda":  # its bundles would have to hold GPUs, and be tested so
            raise ValueError("distributed_executor_backend 'ray' places CPU ranks; CUDA ranks "
                             "run with 'mp' (--nnodes for several nodes) in pagellm for now.")
        self.ray = connect_ray()
        super().__init__(parallel, device)
        self.placement = self.ray.util.get_current_placement_group()
        self._own_placement = self.placement is None
        if self._own_placement:
            cpus = cpus_per_rank()
            driver_node = f"node:{self.ray.util.get_node_ip_address()}"
            bundles = [{"CPU": cpus, driver_node: 0.001}] + [
                {"CPU": cpus} for _ in range(self.info.world_size - 1)]
            self.placement = self.ray.util.placement_group(bundles, strategy="PACK")
            self.ray.get(self.placement.ready(), timeout=60)
            logger.info("Ray placement group of %d bundles of %g CPU (rank 0 on this node)",
                        len(bundles), cpus)

    def driver_host(self) -> str:
        return rendezvous_host()

    def start_worker(self, rank: int, env: dict[str, str]) -> RayWorker:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.placement,
                                                    placement_group_bundle_index=rank)
        actor_class = self.ray.remote(num_cpus=0, scheduling_strategy=strategy)(_RankActor)
        env = {**forwarded_env(), **env}
        if not self._own_placement:  # -dpb ray: the engine's ranks share its node and cores
            env.update({THREADS_BIND_ENV_VARS[0]: rank_shares(self.info.world_size),
                        ENGINE_SLOT_ENV: "0/1"})
        actor = actor_class.remote()
        return RayWorker(self.ray, actor, actor.run.remote(env))

    def shutdown(self) -> None:
        super().shutdown()
        if self._own_placement:
            self.ray.util.remove_placement_group(self.placement)


class _RankActor:
    def run(self, env: dict[str, str]) -> int:
        return _run_worker(env)
