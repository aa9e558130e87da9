"""Data parallelism (`-dp N`): N engine cores, each a process with its own scheduler, KV
cache and cores, behind one API server; on this node, or some on other nodes
(pagellm.distributed.dp_nodes).

`DataParallelCoreClient` has the single core client's interface, so the server above it
does not change. Each new request goes to the least loaded engine, as vLLM's coordinator
scores it (waiting x 4 + running, from the engine's latest step, plus what was sent to it
since); among equally loaded engines, to the one whose prefix cache holds most of the
prompt's leading blocks (the API server keeps an LRU of the block hashes it sent to each,
in the engine's own hash chain); then to the lowest rank. The balancer deals only in token
ids and integers.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from pagellm.core.prefix_index import PrefixIndex, block_hashes
from pagellm.core.sched_output import SchedulerStats
from pagellm.distributed.config import DataParallelConfig
from pagellm.distributed.roster import Doorman
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import (AddLoRA, AttachedEngineCoreClient, CoreReady,
                                        EngineCoreClient, KVCacheReport, LoRAReply, RemoveLoRA,
                                        StepResult)
from pagellm.engine.core_process import EnginePlace
from pagellm.logger import init_logger
from pagellm.request import Request, RequestStatus, child_request_id

if TYPE_CHECKING:
    from pagellm.distributed.ray_data_parallel import RayEngineCores

logger = init_logger(__name__)
WAITING_WEIGHT = 4  # vLLM's: a queued request counts as four running ones


@dataclass
class _EngineLoad:
    running: int = 0
    waiting: int = 0
    sent_since_step: int = 0  # requests sent after its latest step result was read

    @property
    def score(self) -> int:
        return (self.waiting + self.sent_since_step) * WAITING_WEIGHT + self.running


class DataParallelBalancer:
    def __init__(self, num_engines: int, block_size: int, capacity_blocks: int) -> None:
        self.loads = [_EngineLoad() for _ in range(num_engines)]
        self.block_size = block_size
        self.prefixes = PrefixIndex(capacity_blocks)

    def pick(self, token_ids: list[int], salt: str | None) -> int:
        """The engine for a new request, recorded as holding its prompt's blocks."""
        hashes = block_hashes(token_ids, self.block_size, salt)
        engine = min(range(len(self.loads)), key=lambda e: (
            self.loads[e].score, -self.prefixes.matched_blocks(str(e), hashes), e))
        self.prefixes.record(str(engine), hashes)
        self.loads[engine].sent_since_step += 1
        return engine

    def observe(self, engine: int, stats: SchedulerStats) -> None:
        self.loads[engine] = _EngineLoad(stats.num_running, stats.num_waiting)


class DataParallelCoreClient:
    """One EngineCoreClient per rank, by rank: this node's started side by side, the other
    nodes' joining over their sockets. As with EngineCoreClient, the constructor
    starts this node's engines, `wait_ready()` waits for them all, then `start_reading(loop)`."""

    def __init__(self, args: EngineArgs, config: DataParallelConfig,
                 on_result: Callable[[StepResult], None], on_dead: Callable[[], None],
                 default_start: str = "spawn",
                 attached: tuple[Connection, ...] | None = None) -> None:
        """`attached`: connections to engine cores the server's parent process started (one
        of several API server processes), by rank; else this process starts them."""
        self._on_result, self._on_dead = on_result, on_dead
        self._config, self._block_size = config, args.block_size
        self._doorman: Doorman | None = None
        self._ray: RayEngineCores | None = None
        local = config.local_ranks
        if attached is None:
            self.clients = [EngineCoreClient(args, self._observe, on_dead,
                                             EnginePlace(rank, config.size, index, len(local)),
                                             default_start=default_start)
                            for index, rank in enumerate(local)]
        else:
            self.clients = [AttachedEngineCoreClient(conn, f"data parallel rank {rank}",
                                                     self._observe, on_dead)
                            for rank, conn in zip(local, attached)]
        if config.backend == "ray":  # Ray's actors start their engines as these do
            from pagellm.distributed import ray_data_parallel

            self._ray = ray_data_parallel.RayEngineCores(args, config)
        self._owner: dict[str, int] = {}  # request id (each of its n sequences) -> engine

    def wait_ready(self) -> CoreReady:
        try:
            if self._config.remote_ranks:
                self.clients += self._join_remote(self._config, self._on_dead)
            for client in self.clients:
                client.wait_ready()
            _check_same_model(self.clients)
        except BaseException:
            self.shutdown()
            raise
        self.ready: CoreReady = self.clients[0].ready
        blocks = min(client.ready.info.num_kv_blocks for client in self.clients)
        self.balancer = DataParallelBalancer(self._config.size, self._block_size, max(blocks, 1))
        logger.info("Data parallel: %d engine cores, each with %s KV blocks",
                    self._config.size, f"{blocks:,}")
        return self.ready

    def start_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        for client in self.clients:
            client.start_reading(loop)

    def _join_remote(self, config: DataParallelConfig,
                     on_dead: Callable[[], None]) -> list[EngineCoreClient]:
        """The other nodes' engines (-dpb ray: Ray's actors), by rank, once all joined."""
        from pagellm.distributed.dp_nodes import join_remote_engines, listen, remote_engine_client

        def check_started() -> None:
            dead = [client for client in self.clients if not client.alive]
            if dead:
                raise RuntimeError(dead[0]._died_starting())
            if self._ray is not None:
                self._ray.check()

        head = self._ray.head if self._ray is not None else listen(config)
        roster, self._doorman = join_remote_engines(config, check_started, head)
        return [remote_engine_client(roster.conns[rank], rank, roster.holders[rank],
                                     self._observe, on_dead)
                for rank in config.remote_ranks]

    def _observe(self, result: StepResult) -> None:
        self.balancer.observe(result.engine, result.stats)
        for update in result.updates:
            if update.finished:
                self._owner.pop(update.request_id, None)
        self._on_result(result)

    def add_request(self, request: Request) -> None:
        salt = request.cache_salt
        if request.lora_request is not None:  # adapters' blocks never match the base model's
            salt = f"{salt or ''}\x00{request.lora_request.lora_name}"
        engine = self.balancer.pick(request.prompt_token_ids, salt)
        for index in range(request.sampling_params.n):
            self._owner[child_request_id(request.request_id, index)] = engine
        self.clients[engine].add_request(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self._owner.pop(request_id, None)
            if engine is not None:
                by_engine.setdefault(engine, []).append(request_id)
        for engine, ids in by_engine.items():
            self.clients[engine].finish_requests(ids, status)

    def check_kv_cache(self) -> Future[KVCacheReport]:
        """Every engine's report, summed; the first problem found, naming its engine."""
        reports = [client.check_kv_cache() for client in self.clients]
        combined: Future[KVCacheReport] = Future()

        def combine(_: Future[KVCacheReport]) -> None:
            if combined.done() or not all(report.done() for report in reports):
                return
            try:
                parts = [report.result() for report in reports]
            except RuntimeError as error:
                combined.set_exception(error)
                return
            problems = [f"engine {engine}: {part.problem}"
                        for engine, part in enumerate(parts) if part.problem]
            combined.set_result(KVCacheReport(
                sum(p.num_blocks for p in parts), sum(p.used_blocks for p in parts),
                sum(p.num_requests for p in parts), problems[0] if problems else None))

        for report in reports:
            report.add_done_callback(combine)
        return combined

    def lora_call(self, message: AddLoRA | RemoveLoRA) -> Future[LoRAReply]:
        """Every engine loads (or drops) the adapter; the first error is the answer."""
        replies = [client.lora_call(message) for client in self.clients]
        combined: Future[LoRAReply] = Future()

        def combine(_: Future[LoRAReply]) -> None:
            if combined.done() or not all(reply.done() for reply in replies):
                return
            try:
                errors = [reply.result().error for reply in replies]
            except RuntimeError as error:
                combined.set_exception(error)
                return
            combined.set_result(LoRAReply(next((e for e in errors if e), None)))

        for reply in replies:
            reply.add_done_callback(combine)
        return combined

    @property
    def alive(self) -> bool:
        return all(client.alive for client in self.clients)

    def shutdown(self) -> None:
        if self._doorman is not None:
            self._doorman.stop()
        for client in self.clients:
            client.shutdown()
        if self._ray is not None:
            self._ray.shutdown()


def _check_same_model(clients: list[EngineCoreClient]) -> None:
    """Every rank must serve rank 0's model, whatever its KV cache (nodes differ)."""
    first = dataclasses.replace(clients[0].ready.info, num_kv_blocks=0)
    for rank, client in enumerate(clients):
        info = dataclasses.replace(client.ready.info, num_kv_blocks=0)
        if info != first:
            raise ValueError(f"data parallel rank {rank} serves another model than rank 0 "
                             f"({info} against {first}): start every node with the same "
                             "model and flags.")
