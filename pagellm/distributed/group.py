"""The process group of one engine: who a rank is, its tensor and pipeline groups, the
collectives the model calls, and the preflight every rank runs before any weight loads.

Ranks are laid out as vLLM lays them out: global rank = pp_rank * tp_size + tp_rank; rank 0
(the driver, in the engine core's process) samples. CPU ranks talk over gloo; CUDA ranks over
NCCL, one GPU each (a node's ranks take its GPUs in order, after those of the data parallel
engines before theirs).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagellm.distributed.config import bound_cores
from pagellm.logger import init_logger

logger = init_logger(__name__)

HOST_IP_ENV_VARS = ("PAGELLM_HOST_IP", "VLLM_HOST_IP")
ENGINE_SLOT_ENV = "PAGELLM_DP_ENGINE_SLOT"  # "index/count" of a rank's engine on its node
TIMEOUT_ENV_VAR = "PAGELLM_DIST_TIMEOUT"  # seconds a rank may take to join and to preflight
DEFAULT_JOIN_TIMEOUT = 20.0


class PreflightError(RuntimeError):
    """A rank could not join or talk: one line naming it and what to set."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    tp_size: int
    pp_size: int
    init_method: str  # tcp://address:port of the rendezvous
    nnodes: int = 1  # the ranks split evenly over the nodes, in order
    device_type: str = "cpu"  # or "cuda"

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


class ParallelGroup:
    """This rank's view of the world: its tensor parallel group and its pipeline neighbours."""

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self._tp_groups = [dist.new_group(list(range(stage * info.tp_size,
                                                     (stage + 1) * info.tp_size)))
                           for stage in range(info.pp_size)]
        self.tp_group = self._tp_groups[info.pp_rank]
        self.tp_root = info.pp_rank * info.tp_size  # global rank of tp rank 0 of this stage
        self.last_root = (info.pp_size - 1) * info.tp_size  # the rank that has the logits
        # the logits go back to rank 0 on a group of their own: NCCL ignores tags and keeps
        # one order per pair of ranks, in which rank 0's send of the next step's hidden
        # states would wait for the last stage, itself waiting to send this step's logits
        self.logits_group = (dist.new_group([0, self.last_root]) if info.pp_size > 1
                             else None)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.info.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def gather_to_root(self, local: torch.Tensor) -> torch.Tensor | None:
        """The tensor parallel shards cat along the last dim on this stage's tp rank 0."""
        if self.info.tp_size == 1:
            return local
        local = local.contiguous()
        parts = ([torch.empty_like(local) for _ in range(self.info.tp_size)]
                 if self.info.tp_rank == 0 else None)
        dist.gather(local, parts, dst=self.tp_root, group=self.tp_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send_next(self, tensor: torch.Tensor, tag: int = 0) -> dist.Work:
        """Start sending to the next stage, without waiting; the caller keeps `tensor` until
        the work is done."""
        return dist.isend(tensor, self.info.rank + self.info.tp_size, tag=tag)

    def recv_previous(self, tensor: torch.Tensor, tag: int = 0) -> torch.Tensor:
        dist.recv(tensor, self.info.rank - self.info.tp_size, tag=tag)
        return tensor


def join_timeout() -> float:
    return float(os.environ.get(TIMEOUT_ENV_VAR, DEFAULT_JOIN_TIMEOUT))


def rendezvous_host() -> str:
    """The address ranks meet at: the node's advertised IP if set, else loopback."""
    return next((os.environ[name] for name in HOST_IP_ENV_VARS if os.environ.get(name)),
                "127.0.0.1")


def free_port(host: str = "") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def rank_device(info: RankInfo) -> torch.device:
    """A CUDA rank's GPU: the node's GPUs go to its data parallel engines in turn, then to
    each engine's ranks in order."""
    if info.device_type != "cuda":
        return torch.device("cpu")
    engine, _ = engine_slot()
    return torch.device("cuda", engine * info.local_world_size + info.local_rank)


def check_gpus(info: RankInfo) -> None:
    """One line before any process starts when this node has too few GPUs for its ranks."""
    engine, engines = engine_slot()
    needed, seen = engines * info.local_world_size, torch.cuda.device_count()
    if needed > seen:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"tensor parallel size {info.tp_size} x pipeline parallel size {info.pp_size} "
            f"puts {info.local_world_size} CUDA ranks on this node"
            + (f" for each of its {engines} data parallel engines" if engines > 1 else "")
            + f", one GPU each: {needed} GPUs are needed and {seen} are visible"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + "; lower the parallel sizes or add GPUs.")


def init_rank(info: RankInfo) -> ParallelGroup:
    """Join the group (gloo, or NCCL for CUDA ranks) within the timeout, then run the
    preflight; any failure is a PreflightError of one line."""
    timeout = join_timeout()
    interface = "NCCL_SOCKET_IFNAME" if info.backend == "nccl" else "GLOO_SOCKET_IFNAME"
    hint = ("check that every rank can reach it; set VLLM_HOST_IP (or PAGELLM_HOST_IP) to "
            f"this node's reachable address and {interface} to its interface")
    if info.device_type == "cuda":
        torch.cuda.set_device(rank_device(info))
    try:
        dist.init_process_group(info.backend, init_method=info.init_method, rank=info.rank,
                                world_size=info.world_size,
                                timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError, OSError) as error:
        _forget_failed_group()
        raise PreflightError(f"rank {info.rank} could not join the process group at "
                             f"{info.init_method} within {timeout:g} s (backend "
                             f"{info.backend}): {_first_line(error)}; {hint}.") from None
    group = ParallelGroup(info)
    try:
        _preflight(group)
    except RuntimeError as error:
        _forget_failed_group()
        raise PreflightError(f"rank {info.rank}: the preflight all-reduce / send-recv over "
                             f"{info.init_method} failed (backend {info.backend}): "
                             f"{_first_line(error)}; {hint}.") from None
    return group


def _forget_failed_group() -> None:
    """After a failed join, the next group this process makes must be named as a fresh
    process's is: torch counts groups per process (a rendezvous that timed out is counted
    too) and names the store keys by that count, so a leftover count makes the next join
    wait for keys a fresh worker never writes."""
    if dist.is_initialized():
        dist.destroy_process_group()  # resets the count
    else:
        from torch.distributed import distributed_c10d

        distributed_c10d._world.group_count = 0


def _preflight(group: ParallelGroup) -> None:
    """One all-reduce over the world and one send/recv around a ring, before any weight loads:
    a rank that cannot talk fails here in seconds instead of hanging the first step."""
    info = group.info
    start, device = time.perf_counter(), rank_device(info)
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    if int(total.item()) != info.world_size:
        raise RuntimeError(f"the all-reduce summed {int(total.item())}, not {info.world_size}")
    if info.world_size > 1:
        right, left = (info.rank + 1) % info.world_size, (info.rank - 1) % info.world_size
        sent = torch.tensor([info.rank], device=device)
        got = torch.empty(1, dtype=torch.long, device=device)
        # one batch: NCCL runs it as one group call, where two ranks that both sent first and
        # received second could wait on each other
        requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, right),
                                           dist.P2POp(dist.irecv, got, left)])
        for request in requests:
            request.wait()
        if int(got.item()) != left:
            raise RuntimeError(f"the ring send/recv got {int(got.item())}, not {left}")
    host = info.init_method.removeprefix("tcp://").rpartition(":")[0]
    logger.info("Preflight of rank %d (tp %d, pp %d) passed in %.3f s: address %s, interface "
                "%s, backend %s%s", info.rank, info.tp_rank, info.pp_rank,
                time.perf_counter() - start, host, interface_of(host, info.backend),
                info.backend, f", {device}" if device.type == "cuda" else "")


def interface_of(address: str, backend: str = "gloo") -> str:
    """The network interface the backend uses: GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME), else
    the one holding `address`."""
    chosen = os.environ.get(f"{backend.upper()}_SOCKET_IFNAME")
    if chosen:
        return chosen
    try:
        import psutil
    except ImportError:
        return "unknown"
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == address for entry in addresses):
            return name
    return "unknown"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def pin_threads(rank: int, world_size: int) -> list[int]:
    """Give this rank its own cores (its set of VLLM_CPU_OMP_THREADS_BIND's `0-1|2-3` if set,
    else an even split of the cores this process may use: its engine's share) and one torch
    thread per core."""
    engine, engines = engine_slot()
    cores = bound_cores(rank, world_size, engine, engines) or _share(rank, world_size)
    return _pin(cores)


def pin_engine(index: int, count: int, world_size: int) -> list[int]:
    """A data parallel engine core process, the `index`-th of the `count` its node runs:
    pin it to its ranks' core sets (or to an even share of the node's cores), and tell its
    ranks' processes which engine's sets are theirs."""
    os.environ[ENGINE_SLOT_ENV] = f"{index}/{count}"
    bound = [bound_cores(rank, world_size, index, count) or [] for rank in range(world_size)]
    return _pin(sorted({core for cores in bound for core in cores}) or _share(index, count))


def rank_shares(world_size: int) -> str:
    """This process's cores split evenly between `world_size` ranks, written as
    VLLM_CPU_OMP_THREADS_BIND is: for ranks that do not inherit their engine's cores (Ray
    actors on its node), as worker processes do."""
    return "|".join(",".join(map(str, _share(rank, world_size))) for rank in range(world_size))


def engine_slot() -> tuple[int, int]:
    """Which of its node's data parallel engines this process belongs to, and how many there
    are: (0, 1) without data parallelism."""
    index, _, count = os.environ.get(ENGINE_SLOT_ENV, "0/1").partition("/")
    return int(index), int(count)


def _share(index: int, count: int) -> list[int]:
    available = sorted(os.sched_getaffinity(0))
    share = max(1, len(available) // count)
    return available[index * share:(index + 1) * share] or [available[index % len(available)]]


def _pin(cores: list[int]) -> list[int]:
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
