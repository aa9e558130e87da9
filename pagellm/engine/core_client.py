"""The engine core in a process of its own, and the client that talks to it.

HTTP parsing, tokenization, detokenization and SSE writes happen in the
front-end process; the core process only schedules, runs the model and
samples, so none of that work stalls its step loop (or holds its GIL). The
two exchange small picklable records over a pipe: requests in, per-step
token updates and scheduler stats out.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol
from multiprocessing.connection import Connection

from pagellm.core.sched_output import RequestUpdate, SchedulerStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_process import (EnginePlace, StartedCore, start_core_process,
                                         start_method)
from pagellm.engine.input_processor import ModelInfo
from pagellm.logger import init_logger
from pagellm.lora.request import LoRARequest
from pagellm.model.errors import ModelLoadError
from pagellm.request import Request, RequestStatus

logger = init_logger(__name__)
_PROGRESS_SECONDS = 15.0
@dataclass
class CoreReady:
    """Sent once the model is loaded. The front end loads its own tokenizer meanwhile
    (pagellm.model.text says why)."""

    info: ModelInfo
    model_path: str


@dataclass
class CoreFailed:
    message: str
    bad_model_file: bool = False  # a ModelLoadError: the CLI exits with code 2


@dataclass
class AddRequest:
    request: Request


@dataclass
class FinishRequests:
    request_ids: list[str]
    status: RequestStatus


@dataclass
class StepResult:
    updates: list[RequestUpdate]
    stats: SchedulerStats
    engine: int = 0  # the data parallel rank that stepped


@dataclass
class CheckKVCache:
    """Asks the core for a KVCacheReport, checked between steps."""


@dataclass
class KVCacheReport:
    """The KV cache's occupancy and the block pool's integrity check (soak tests, debugging)."""

    num_blocks: int
    used_blocks: int
    num_requests: int
    problem: str | None  # None: free + used == total, refcounts match the block tables


@dataclass
class AddLoRA:
    """Load and check an adapter (`replace`: read its files again); answered by LoRAReply."""

    lora_request: LoRARequest
    replace: bool = False


@dataclass
class RemoveLoRA:
    lora_int_id: int


@dataclass
class LoRAReply:
    error: str | None  # None: done


class Shutdown:
    """The front-end is done: the core ends (or, shared by several, forgets that one)."""


class CoreConnection(Protocol):
    """What the step loop talks through: a Connection, or a FrontEndHub of several."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...


def run_engine_core(conn: CoreConnection, args: EngineArgs,
                    place: EnginePlace = EnginePlace()) -> None:
    """Entry point of the core process: build the engine, then step while there is work.
    `conn` is a pipe to the API server, a socket to the head node's, or a FrontEndHub of
    several API server processes' pipes.

    Ctrl-C reaches the whole process group; only the server acts on it (it drains, then
    stops this process through the pipe), so that it is not taken for an engine death.
    Data parallel engines each take their share of their node's cores."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from pagellm.engine.core import EngineCore
    from pagellm.engine.llm_engine import resolve_device
    from pagellm.platform import name_this_process

    name_this_process(place.name)

    if place.size > 1:
        from pagellm.distributed.group import pin_engine

        logger.info("Data parallel rank %d of %d on cores %s", place.rank, place.size,
                    pin_engine(place.local_index, place.local_count,
                               args.tensor_parallel_size * args.pipeline_parallel_size))

    try:
        core = EngineCore(args.model_config(), args.cache_config(), args.scheduler_config(),
                          resolve_device(args.device), args.grammar_config(),
                          args.speculative(), args.parallel_config(), args.lora_config())
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        conn.send(CoreFailed(str(error), isinstance(error, ModelLoadError)))
        return
    conn.send(CoreReady(core.model_info(), str(core.loaded.path)))
    try:
        _step_loop(core, conn, place.rank)
    except (EOFError, ConnectionError, KeyboardInterrupt):  # the server is gone
        pass


# Seconds without a message before an idle core faults its KV cache's pages in: a server
# between bursts, not one between the requests of a client that is still sending.
_IDLE_SECONDS = 1.0


def _step_loop(core, conn: CoreConnection, engine: int) -> None:
    while True:
        if not core.has_unfinished_requests():
            if not conn.poll(_IDLE_SECONDS):  # idle a while: fault the KV cache in, piecewise
                while not conn.poll() and core.runner.fault_in_kv_cache():
                    pass
            if not _handle(core, conn, conn.recv()):
                return
        changed = False
        while conn.poll():
            message = conn.recv()
            if not _handle(core, conn, message):
                return
            changed |= isinstance(message, FinishRequests)
        if core.has_unfinished_requests():
            updates, stats = core.step()
            conn.send(StepResult(updates, stats, engine))
        elif changed:
            conn.send(StepResult([], core.make_stats(), engine))


def _handle(core, conn: CoreConnection, message: object) -> bool:
    if isinstance(message, AddRequest):
        core.add_request(message.request)
    elif isinstance(message, FinishRequests):
        core.finish_requests(message.request_ids, message.status)
    elif isinstance(message, CheckKVCache):
        conn.send(_kv_cache_report(core.scheduler))
    elif isinstance(message, (AddLoRA, RemoveLoRA)):
        conn.send(_lora_reply(core, message))
    return not isinstance(message, Shutdown)


def _lora_reply(core, message: AddLoRA | RemoveLoRA) -> LoRAReply:
    try:
        if isinstance(message, AddLoRA):
            core.add_lora(message.lora_request, message.replace)
        else:
            core.remove_lora(message.lora_int_id)
    except ValueError as error:
        return LoRAReply(str(error))
    return LoRAReply(None)


def _kv_cache_report(scheduler) -> KVCacheReport:
    pool = scheduler.kv.pool
    try:
        scheduler.check_integrity()
        problem = None
    except AssertionError as error:
        problem = str(error) or "the block pool's integrity check failed"
    return KVCacheReport(pool.num_blocks, pool.num_used_blocks, len(scheduler.requests),
                         problem)


class EngineCoreClient:
    """Starts the core process and hands its step results to `on_result` on the event loop
    that reads them.

    The constructor returns once the process is started, so that several engines load at
    once; then `wait_ready()` and `start_reading(loop)`. `started`: a process started
    already (by `pagellm serve`, before it imported torch)."""

    def __init__(self, args: EngineArgs, on_result: Callable[[StepResult], None],
                 on_dead: Callable[[], None], place: EnginePlace = EnginePlace(),
                 default_start: str = "spawn", started: StartedCore | None = None) -> None:
        started = started or start_core_process(args, place, start_method(default_start))
        self._process = started.process
        self._attach(started.conn, on_result, on_dead)

    def _attach(self, conn: Connection, on_result: Callable[[StepResult], None],
                on_dead: Callable[[], None]) -> None:
        self._conn = conn
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = threading.Event()  # the core's end of the connection closed
        self._send_lock = threading.Lock()
        self._kv_reports: list[Future[KVCacheReport]] = []
        self._lora_replies: list[Future[LoRAReply]] = []
        self._on_result, self._on_dead = on_result, on_dead

    def start_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on `loop` reads the connection whenever it has data, and calls
        `on_result` and `on_dead` itself. A reader thread would have to wake the loop for
        every step (call_soon_threadsafe): in a 2-core VM that wake-up took 18% of the API
        server's samples at one client."""
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._read_available)

    def wait_ready(self) -> CoreReady:
        self.ready = self._wait_ready()
        return self.ready

    def _wait_ready(self) -> CoreReady:
        start = time.monotonic()
        while self.alive and not self._conn.poll(_PROGRESS_SECONDS):
            logger.info("Still starting the engine (%.0f s so far)", time.monotonic() - start)
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(self._died_starting()) from None
        if isinstance(message, CoreFailed):
            self._reap()
            raise (ModelLoadError if message.bad_model_file else ValueError)(message.message)
        return message

    def _reap(self) -> None:
        self._process.join()

    def _died_starting(self) -> str:
        self._reap()
        return (f"the engine core process died during start-up (exit code "
                f"{self._process.exitcode}); see its log above.")

    def _read_available(self) -> None:
        """Every message that has arrived. `poll` says one has begun; the core writes each
        message in one go, so `recv` waits at most for the rest of it."""
        try:
            while self._conn.poll():
                message = self._conn.recv()
                if isinstance(message, KVCacheReport):
                    self._kv_reports.pop(0).set_result(message)
                elif isinstance(message, LoRAReply):
                    self._lora_replies.pop(0).set_result(message)
                else:
                    self._on_result(message)
        except (EOFError, OSError):
            self._stop_reading()
            self.closed.set()
            for waiting in [*self._kv_reports, *self._lora_replies]:
                waiting.set_exception(RuntimeError("the engine core process died"))
            self._on_dead()

    def _stop_reading(self) -> None:
        if self._loop is not None and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
        self._loop = None

    def _send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def add_request(self, request: Request) -> None:
        self._send(AddRequest(request))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        ids = list(request_ids)
        if ids:
            self._send(FinishRequests(ids, status))

    def check_kv_cache(self) -> Future[KVCacheReport]:
        report: Future[KVCacheReport] = Future()
        with self._send_lock:  # the replies come in the order of the asks
            self._kv_reports.append(report)
            self._conn.send(CheckKVCache())
        return report

    def lora_call(self, message: AddLoRA | RemoveLoRA) -> Future[LoRAReply]:
        reply: Future[LoRAReply] = Future()
        with self._send_lock:  # the replies come in the order of the asks
            self._lora_replies.append(reply)
            self._conn.send(message)
        return reply

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def shutdown(self) -> None:
        self._stop_reading()
        if self._process.is_alive():
            try:
                self._send(Shutdown())
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        self._conn.close()


class _ProcessElsewhere:
    """The process of an engine core this one does not own (another node's, or the
    server's parent's), as far as its client sees it: alive while its connection is open."""

    exitcode = None

    def __init__(self, client: EngineCoreClient) -> None:
        self._closed = client.closed

    def is_alive(self) -> bool:
        return not self._closed.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._closed.wait(timeout)

    def kill(self) -> None:
        """Its owner ends it: closing the connection, as shutdown does next, tells it to."""


class AttachedEngineCoreClient(EngineCoreClient):
    """An engine core started by another process, through a connection to it: the same
    messages as through a core's pipe. `where` names it in the start-up error."""

    def __init__(self, conn: Connection, where: str, on_result: Callable[[StepResult], None],
                 on_dead: Callable[[], None]) -> None:
        self._attach(conn, on_result, on_dead)
        self._process = _ProcessElsewhere(self)
        self.where = where

    def _reap(self) -> None:
        """Nothing to wait for here: the process is its owner's."""

    def _died_starting(self) -> str:
        return (f"the engine core of {self.where} closed its connection during start-up; "
                "see its log.")
