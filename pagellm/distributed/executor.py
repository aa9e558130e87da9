"""The multiprocess executor: one engine's tensor x pipeline ranks on one machine.

Rank 0 (the driver) lives in the engine core's process, next to the one scheduler; ranks
1..N-1 are worker processes (`python -m pagellm.distributed.worker`) connected back to it
over an authenticated local socket. Each step the driver sends the workers the step's
integer plan (`StepChunk`s: token ids, start positions, block tables, samples per chunk),
never tensors they can build themselves; the tensors they exchange go over the process group
inside the model (pagellm.distributed.model): gloo on CPU, NCCL between GPUs. Only rank 0
samples.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import socket
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Protocol
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pagellm.config import ModelConfig
from pagellm.distributed.config import ParallelConfig, layer_partition
from pagellm.distributed.group import (ParallelGroup, RankInfo, check_gpus, free_port,
                                       init_rank, join_timeout, pin_threads, rank_device,
                                       rendezvous_host)
from pagellm.distributed.model import ParallelCausalLM
from pagellm.distributed.nodes import (NODES_WAIT_ENV, node_authkey, start_worker_process,
                                       worker_env)
from pagellm.distributed.roster import (HEAD_NODE_ID, Doorman, JoinWait, NodeRoster, RankClaim,
                                        accept_until_complete)
from pagellm.distributed.sharding import ShardLayout
from pagellm.logger import init_logger
from pagellm.model.arch import ArchConfig
from pagellm.model.loader import LoadedModel, load_model
from pagellm.worker.model_runner import ModelRunner, StepInputs
from pagellm.worker.step_chunk import StepChunk

logger = init_logger(__name__)
_WATCH_SECONDS = 0.5


class WorkerProcess(Protocol):
    """What the executor needs of a worker: a subprocess.Popen, or a Ray actor's handle."""

    pid: int | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass
class WorkerInit:
    info: RankInfo
    model_config: ModelConfig
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    block_size: int


@dataclass
class WorkerFailed:
    message: str


@dataclass
class AllocateKVCache:
    num_blocks: int


class WorkerReady:
    """A worker finished the stage it was asked for (loading, or allocating its KV cache)."""


class StopWorker:
    pass


def load_rank_model(config: ModelConfig, dtype: torch.dtype, group: ParallelGroup
                    ) -> tuple[LoadedModel, ShardLayout]:
    """This rank's shard of the model, wrapped with its communication; `arch` stays the
    whole model's (vocabulary, context length)."""
    layouts: list[ShardLayout] = []

    def shard_for(arch: ArchConfig) -> ShardLayout:
        layouts.append(ShardLayout(arch, group.info))
        return layouts[0]

    loaded = load_model(config.model, dtype, rank_device(group.info), config.tokenizer,
                        config.gguf_quantized_max_tokens, config.int8_activations(),
                        config.batch_invariant, shard_for=shard_for,
                        formats=config.formats())
    loaded.model = ParallelCausalLM(loaded.model, layouts[0], group)
    logger.info("Rank %d holds %s", group.info.rank, layouts[0].describe())
    return loaded, layouts[0]


class MultiprocExecutor:
    """Starts the workers, joins the process group with them and loads rank 0's shard."""

    def __init__(self, parallel: ParallelConfig, device: torch.device) -> None:
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor and pipeline parallelism run on CPU (gloo) or CUDA "
                             f"(NCCL) ranks, not on {device.type}.")
        self.parallel = parallel
        multi_node = parallel.nnodes > 1
        host = parallel.master_addr if multi_node else rendezvous_host()
        self.init_method = f"tcp://{host}:{free_port()}"
        self.info = RankInfo(0, parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                             self.init_method, parallel.nnodes, device.type)
        if device.type == "cuda":
            check_gpus(self.info)
        self.processes: list[WorkerProcess] = []
        self.conns: list[Connection] = []
        self.doormen: list[Doorman] = []
        self.layout: ShardLayout | None = None
        # rank 0 pins the threads of the process it runs in: put them back at the end
        self._finalizer = weakref.finalize(self, _stop_workers, self.conns, self.processes,
                                           self.doormen, os.sched_getaffinity(0),
                                           torch.get_num_threads())

    def load(self, config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: torch.dtype,
             block_size: int) -> LoadedModel:
        """Start every rank, run the preflight, load each rank's shard (workers in parallel
        with the driver)."""
        local = self.info.local_world_size
        logger.info("Starting %d worker processes for tensor parallel size %d x pipeline "
                    "parallel size %d (backend %s, rendezvous %s, %d node(s))", local - 1,
                    self.info.tp_size, self.info.pp_size, self.info.backend, self.init_method,
                    self.info.nnodes)
        try:
            # before rank 0 pins itself: each worker takes its share of all this process's
            # cores (a data parallel engine's share of the node), not of rank 0's
            self._start_workers(config, dtype, kv_cache_dtype, block_size)
            logger.info("Rank 0 on cores %s", pin_threads(0, local))
            group = init_rank(self.info)
            loaded, self.layout = load_rank_model(config, dtype, group)
            self._wait_workers("loading its shard")
        except BaseException:  # stop the workers, give this process its cores back
            self.shutdown()
            raise
        return loaded

    def _start_workers(self, config: ModelConfig, dtype: torch.dtype,
                       kv_cache_dtype: torch.dtype, block_size: int) -> None:
        parallel = self.parallel
        if parallel.nnodes > 1:  # the other nodes' ranks know where and how to join
            host, port = parallel.master_addr, parallel.master_port
            authkey = node_authkey(port)
        else:
            host, port, authkey = self.driver_host(), 0, secrets.token_bytes(32)
        server = socket.create_server((host, port))
        roster = NodeRoster(parallel)
        try:
            address = "%s:%d" % (host, server.getsockname()[1])
            for index in range(1, parallel.ranks_per_node):
                claim = RankClaim(HEAD_NODE_ID, 0, index, parallel.layout)
                self.processes.append(self.start_worker(index,
                                                        worker_env(address, authkey, claim)))
            self._accept(server, authkey, roster)
        except BaseException:  # the ranks that joined hear that the driver is gone
            server.close()
            for conn in roster.conns.values():
                conn.close()
            raise
        if parallel.nnodes > 1:  # late or extra nodes still hear why they are not taken
            self.doormen.append(Doorman(server, roster, authkey))
        else:
            server.close()
        self.conns.extend(roster.conns[rank] for rank in sorted(roster.conns))
        for rank, conn in enumerate(self.conns, start=1):
            info = RankInfo(rank, self.info.tp_size, self.info.pp_size, self.init_method,
                            self.info.nnodes, self.info.device_type)
            conn.send(WorkerInit(info, config, dtype, kv_cache_dtype, block_size))

    def driver_host(self) -> str:
        """Where the workers reach the driver: on one machine, loopback."""
        return "127.0.0.1"

    def start_worker(self, rank: int, env: dict[str, str]) -> "WorkerProcess":
        """Rank `rank`'s process, told by `env` where the driver is."""
        return start_worker_process(env)

    def _accept(self, server: socket.socket, authkey: bytes, roster: NodeRoster) -> None:
        """Each worker connects, passes the challenge and says who it is; on several nodes,
        a line every few seconds says which nodes are still missing."""
        single = self.info.nnodes == 1
        # a cold import is slow; other nodes may start after this one
        wait = (max(60.0, 3 * join_timeout()) if single else
                float(os.environ.get(NODES_WAIT_ENV, max(300.0, 15 * join_timeout()))))
        master = f"{self.parallel.master_addr}:{self.parallel.master_port}"

        def check() -> None:
            dead = [p.pid for p in self.processes if p.poll() is not None]
            if dead:
                raise RuntimeError(f"worker process(es) {dead} did not start; see their log "
                                   "above.")

        def timed_out(progress: str) -> str:
            if single:
                return "worker process(es) not connecting did not start; see their log above."
            return (f"the other nodes did not join the driver at {master} within {wait:g} s "
                    f"({NODES_WAIT_ENV}): {progress}.")

        accept_until_complete(server, authkey, roster, check,
                              JoinWait(wait, timed_out, None if single else "the nodes"))
        if not single:
            logger.info("All %d nodes joined: %d ranks", self.info.nnodes, self.info.world_size)

    def _wait_workers(self, stage: str) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                message = conn.recv()
            except EOFError:
                raise RuntimeError(f"worker rank {rank} died while {stage}; see its log "
                                   "above.") from None
            if isinstance(message, WorkerFailed):
                raise ValueError(message.message)

    def driver_runner(self, model: ParallelCausalLM, arch: ArchConfig,
                      *args: object) -> "DriverRunner":
        """Rank 0's runner over its shard, for the model runner's other arguments."""
        assert self.layout is not None
        return DriverRunner(self, arch, model, self.layout.local_arch, *args)

    def send_step(self, chunks: list[StepChunk]) -> None:
        for conn in self.conns:
            conn.send(chunks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The last stage of start-up; from here on a worker's death ends the engine."""
        for conn in self.conns:
            conn.send(AllocateKVCache(num_blocks))
        self._wait_workers("allocating its KV cache")
        threading.Thread(target=self._watch_workers, name="WorkerMonitor", daemon=True).start()

    def _watch_workers(self) -> None:
        """A dead rank leaves the others waiting in a collective: in the engine core's own
        process (a child of the server, which then answers 503 and exits non-zero), exit at
        once; in a process of the user's (the offline LLM), the next step fails instead."""
        while self._finalizer.alive:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is None or not self._finalizer.alive:
                    continue
                logger.error("Worker rank %d (pid %d) died with exit code %s; the engine "
                             "stops.", rank, process.pid, process.returncode)
                if multiprocessing.parent_process() is not None:
                    os._exit(1)
                return
            time.sleep(_WATCH_SECONDS)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine core keeps in flight: one per pipeline stage (see EngineCore)."""
        return self.info.pp_size

    def max_layers_per_stage(self, arch: ArchConfig) -> int:
        return max(layer_partition(arch.num_hidden_layers, self.info.pp_size))

    def shutdown(self) -> None:
        self._finalizer()


def _stop_workers(conns: list[Connection], processes: list["WorkerProcess"],
                  doormen: list[Doorman], cores: set[int], threads: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    for doorman in doormen:
        doorman.stop()
    for conn in conns:
        try:
            conn.send(StopWorker())
        except OSError:
            pass
        conn.close()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


class DriverRunner(ModelRunner):
    """Rank 0's model runner: the same steps, with the plan sent to the workers first and a
    KV cache sized so that the stage holding the most layers fits its budget."""

    def __init__(self, executor: MultiprocExecutor, full_arch: ArchConfig,
                 *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.executor = executor
        self._max_layers = executor.max_layers_per_stage(full_arch)

    def block_bytes(self) -> int:
        return super().block_bytes() // self.arch.num_hidden_layers * self._max_layers

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.executor.allocate_kv_cache(num_blocks)
        super().allocate_kv_cache(num_blocks)

    def prepare_inputs(self, chunks: list[StepChunk]) -> StepInputs:
        self.executor.send_step(chunks)
        return super().prepare_inputs(chunks)
