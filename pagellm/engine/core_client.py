"""The engine core in a process of its own, and the client that talks to it.

HTTP parsing, tokenization, detokenization and SSE writes happen in the
front-end process; the core process only schedules, runs the model and
samples, so none of that work stalls its step loop (or holds its GIL). The
two exchange small picklable records over a pipe: requests in, per-step
token updates and scheduler stats out.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from multiprocessing.connection import Connection

from pagellm.core.sched_output import RequestUpdate, SchedulerStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.input_processor import ModelInfo
from pagellm.logger import init_logger
from pagellm.request import Request, RequestStatus

logger = init_logger(__name__)


@dataclass
class CoreReady:
    """Sent once the model is loaded; the tokenizer travels pickled, which is much faster
    than parsing it again (a GGUF vocabulary takes seconds)."""

    info: ModelInfo
    model_path: str
    chat_template: str | None
    tokenizer: Any


@dataclass
class CoreFailed:
    message: str


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


class _Shutdown:
    pass


def run_engine_core(conn: Connection, args: EngineArgs) -> None:
    """Entry point of the core process: build the engine, then step while there is work."""
    from pagellm.engine.core import EngineCore
    from pagellm.engine.llm_engine import resolve_device

    try:
        core = EngineCore(args.model_config(), args.cache_config(), args.scheduler_config(),
                          resolve_device(args.device), args.grammar_config())
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        conn.send(CoreFailed(str(error)))
        return
    loaded = core.loaded
    conn.send(CoreReady(core.model_info(), str(loaded.path), loaded.chat_template,
                        loaded.tokenizer))
    try:
        _step_loop(core, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass


def _step_loop(core, conn: Connection) -> None:
    while True:
        if not core.has_unfinished_requests() and not _handle(core, conn.recv()):
            return
        changed = False
        while conn.poll():
            message = conn.recv()
            if not _handle(core, message):
                return
            changed |= isinstance(message, FinishRequests)
        if core.has_unfinished_requests():
            updates, stats = core.step()
            conn.send(StepResult(updates, stats))
        elif changed:
            conn.send(StepResult([], core.scheduler.make_stats()))


def _handle(core, message: object) -> bool:
    if isinstance(message, AddRequest):
        core.add_request(message.request)
    elif isinstance(message, FinishRequests):
        core.finish_requests(message.request_ids, message.status)
    return not isinstance(message, _Shutdown)


class EngineCoreClient:
    """Starts the core process and forwards its step results to `on_result` from a thread."""

    def __init__(self, args: EngineArgs, on_result: Callable[[StepResult], None],
                 on_dead: Callable[[], None]) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=run_engine_core, args=(child_conn, args),
                                        name="EngineCore", daemon=True)
        self._process.start()
        child_conn.close()
        self.ready = self._wait_ready()
        self._send_lock = threading.Lock()
        self._on_result, self._on_dead = on_result, on_dead
        self._reader = threading.Thread(target=self._read_results, name="EngineCoreOutput",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self) -> CoreReady:
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(
                f"the engine core process died during start-up (exit code "
                f"{self._process.exitcode}); see its log above.") from None
        if isinstance(message, CoreFailed):
            self._process.join()
            raise ValueError(message.message)
        return message

    def _read_results(self) -> None:
        try:
            while True:
                self._on_result(self._conn.recv())
        except (EOFError, OSError):
            self._on_dead()

    def _send(self, message: object) -> None:
        with self._send_lock:
            self._conn.send(message)

    def add_request(self, request: Request) -> None:
        self._send(AddRequest(request))

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        ids = list(request_ids)
        if ids:
            self._send(FinishRequests(ids, status))

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def shutdown(self) -> None:
        if self._process.is_alive():
            try:
                self._send(_Shutdown())
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        self._conn.close()
