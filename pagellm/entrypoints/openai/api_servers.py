"""`pagellm serve --api-server-count N`: N API server processes in front of the engine cores.

Each API server process (`APIServer_0` ..) is a whole front end: HTTP, tokenization, chat
templates, detokenization and streaming, which are Python and hold one process's GIL. The
parent binds N listening sockets to the one port with SO_REUSEPORT, so the kernel spreads
new connections over the processes by their address hash (one shared socket would let
whichever process woke first accept a whole burst: asyncio accepts up to 100 at once). It
then starts the engine cores (`-dp` of them), each with one pipe per front end
(engine/client_hub.py), starts the front ends, and supervises: SIGTERM or Ctrl-C drains
every front end and then stops the engines; a front end that dies stops the others and the
server exits non-zero; an engine that dies makes every front end answer 503 and exit 1.

Metrics use prometheus_client's multiprocess mode: each process writes its own files under
PROMETHEUS_MULTIPROC_DIR (a fresh folder unless set) and any front end's /metrics sums them.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, multiprocess, values

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.client_hub import FrontEndHub, FrontEndPlace
from pagellm.engine.core_client import run_engine_core
from pagellm.engine.core_process import EnginePlace, start_method
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.api_server import serve
from pagellm.entrypoints.openai.cli_args import ServerSettings
from pagellm.entrypoints.openai.launch import bind_socket, engine_start_method
from pagellm.logger import init_logger, name_process_lines
from pagellm.model.errors import ModelLoadError
from pagellm.platform import name_this_process

logger = init_logger(__name__)
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
SERVED_BY_HEADER = b"pagellm-api-server"
_ENGINE_EXIT_SECONDS = 10.0


def check_supported(settings: ServerSettings) -> None:
    """The servers that several front ends do not run yet, refused in one line."""
    count = settings.engine_args.api_server_count
    if settings.engine_args.runner_kind() == "pooling":
        raise ValueError(f"api_server_count {count} with a pooling (embedding) model is not "
                         "supported by pagellm yet; serve it with one API server.")
    if settings.engine_args.enable_lora and settings.lora.runtime_updating:
        raise ValueError(f"api_server_count {count} with runtime LoRA loading "
                         "(VLLM_ALLOW_RUNTIME_LORA_UPDATING) is not supported by pagellm yet: "
                         "each API server would keep its own list; use --lora-modules.")


def bind_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """One socket per front end on host:port. A plain bind first, so that a port in use,
    even by another server's SO_REUSEPORT group, fails now rather than sharing its traffic."""
    bind_socket(host, port).close()
    sockets = []
    try:
        for _ in range(count):
            family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                                 type=socket.SOCK_STREAM)[0]
            sockets.append(socket.socket(family, kind, proto))
            sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sockets[-1].bind(address)
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sockets


@dataclass
class _Server:
    """What the parent started, and what each forked child must close: its copies of the
    other processes' pipe ends and sockets (a pipe end left open in another process would
    hide the death of the process at its end)."""

    sockets: list[socket.socket]
    pipes: list[list[tuple[Connection, Connection]]]  # [engine][front end]: (engine's, front end's)
    engines: list[BaseProcess] = field(default_factory=list)
    front_ends: list[BaseProcess] = field(default_factory=list)

    def everything(self) -> list[Any]:
        return [*self.sockets, *(conn for row in self.pipes for pair in row for conn in pair)]

    def close(self) -> None:
        for item in self.everything():
            item.close()


def _forked(inherited: list[Any]) -> None:
    """A child's start: the parent's signal handlers and copies of others' pipes go."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    for item in inherited:
        item.close()


def _engine_main(conns: list[Connection], args: EngineArgs, place: EnginePlace,
                 inherited: list[Any]) -> None:
    _forked(inherited)
    name_process_lines(place.name)
    run_engine_core(FrontEndHub(conns), args, place)


def _start_engines(server: _Server, args: EngineArgs) -> None:
    method = start_method(engine_start_method())
    context = multiprocessing.get_context(method)
    config = args.parallel_config().data_parallel
    local = config.local_ranks
    for index, (rank, row) in enumerate(zip(local, server.pipes)):
        place = EnginePlace(rank, config.size, index, len(local))
        mine = [engine_end for engine_end, _ in row]
        # a forked child holds copies of everything; a spawned one only what it is given
        inherited = [item for item in server.everything() if item not in mine] \
            if method == "fork" else []
        server.engines.append(context.Process(target=_engine_main, name=place.name,
                                              daemon=True, args=(mine, args, place, inherited)))
        server.engines[-1].start()


def _front_end_main(place: FrontEndPlace, settings: ServerSettings, sock: socket.socket,
                    inherited: list[Any]) -> None:
    """A front end: its own process group, so that a terminal's Ctrl-C reaches only the
    parent, which drains every front end once; it dies with the parent."""
    from pagellm.distributed.worker import die_with_parent

    _forked(inherited)
    os.setpgrp()
    die_with_parent()
    name_this_process(place.name)
    name_process_lines(place.name)
    values.ValueClass = values.get_value_class()  # prometheus_client read the env at import
    try:
        engine = AsyncLLM.from_engine_args(settings.engine_args, log_stats=settings.log_stats,
                                           wait=False, front_end=place)
        code = asyncio.run(serve(settings, sock, engine, place))
    except (ModelLoadError, ValueError, FileNotFoundError) as error:
        if place.index == 0:  # the same settings and engines fail every front end alike
            print(f"pagellm: error: {error}", file=sys.stderr)
        code = 2 if isinstance(error, ModelLoadError) else 1
    sys.exit(code)


def _start_front_ends(server: _Server, settings: ServerSettings) -> None:
    context = multiprocessing.get_context("fork")  # no CUDA and no thread here yet
    for index, sock in enumerate(server.sockets):
        conns = tuple(row[index][1] for row in server.pipes)
        place = FrontEndPlace(index, len(server.sockets), conns)
        inherited = [item for item in server.everything()
                     if item is not sock and item not in conns]
        server.front_ends.append(context.Process(target=_front_end_main, name=place.name,
                                                 args=(place, settings, sock, inherited)))
        server.front_ends[-1].start()


@contextmanager
def _metrics_dir() -> Iterator[None]:
    """PROMETHEUS_MULTIPROC_DIR: the user's (which must start empty), else a fresh folder
    removed at exit."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        yield
        return
    folder = tempfile.mkdtemp(prefix="pagellm-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = folder
    try:
        yield
    finally:
        del os.environ[MULTIPROC_DIR_ENV]
        shutil.rmtree(folder, ignore_errors=True)


def run_api_servers(settings: ServerSettings) -> int:
    """Start the engines and the front ends; the exit code is 0 after a requested stop."""
    check_supported(settings)
    count = settings.engine_args.api_server_count
    sockets = bind_sockets(settings.host, settings.port, count)
    engines = len(settings.engine_args.parallel_config().data_parallel.local_ranks)
    context = multiprocessing.get_context("fork")
    server = _Server(sockets, [[context.Pipe() for _ in range(count)] for _ in range(engines)])
    logger.info("Starting %d API server processes and %d engine core(s)", count, engines)
    supervisor = _Supervisor(server)
    with _metrics_dir(), supervisor.handling_signals():
        try:
            _start_engines(server, settings.engine_args)
            _start_front_ends(server, settings)
        finally:
            server.close()
        supervisor.tell_front_ends()  # a signal may have come before the last one started
        return supervisor.run()


class _Supervisor:
    """Waits for the processes. Each SIGTERM or SIGINT is passed on to every front end once:
    the first drains it, a second ends it at once, as for one server."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.stops = 0  # stop requests: signals, or 1 for a front end that died
        self._told: dict[int, int] = {}  # pid -> stop requests passed on to it
        self.engine_died = False
        self.exit_code = 0

    @contextmanager
    def handling_signals(self) -> Iterator[None]:
        handlers = {sig: signal.signal(sig, self._on_signal)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stops += 1
        self.tell_front_ends()

    def tell_front_ends(self) -> None:
        for process in self.server.front_ends:
            while process.is_alive() and self._told.get(process.pid, 0) < self.stops:
                os.kill(process.pid, signal.SIGTERM)
                self._told[process.pid] = self._told.get(process.pid, 0) + 1

    def run(self) -> int:
        try:
            self._wait_front_ends()
        finally:
            self._stop_engines()
        return self.exit_code

    def _wait_front_ends(self) -> None:
        running = {process.sentinel: process for process in self.server.front_ends}
        engines = {process.sentinel: process for process in self.server.engines}
        while running:
            ended = wait([*running, *engines])
            for sentinel in sorted(ended, key=lambda ended: ended not in engines):
                if sentinel in engines:
                    self._engine_ended(engines.pop(sentinel))
                else:
                    self._front_end_ended(running.pop(sentinel))

    def _engine_ended(self, process: BaseProcess) -> None:
        """Its front ends see its connection close: they fail its requests and exit 1."""
        process.join()
        if not self.stops:
            self.engine_died = True
            logger.error("%s exited with code %s; the API servers stop.", process.name,
                         process.exitcode)

    def _front_end_ended(self, process: BaseProcess) -> None:
        process.join()
        code = process.exitcode or 0
        if self.stops and code in (0, -signal.SIGTERM):  # it stopped as it was told to
            return
        self.exit_code = self.exit_code or (code if code > 0 else 1)
        if self.stops or self.engine_died:
            return
        logger.error("%s exited with code %s; stopping the other API servers.", process.name,
                     code)
        self.stops = 1
        self.tell_front_ends()

    def _stop_engines(self) -> None:
        """An engine core ends once its front ends have all left; one that does not is
        killed."""
        for process in self.server.engines:
            process.join(_ENGINE_EXIT_SECONDS)
            if process.is_alive():
                logger.warning("%s did not stop; killing it.", process.name)
                process.kill()
                process.join()


class ServedByMiddleware:
    """Names the API server process that answered (`pagellm-api-server: 1`): which one took
    a connection is the kernel's choice, and its log lines carry the same name."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.value = str(index).encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (SERVED_BY_HEADER, self.value)]
            await send(message)

        await self.app(scope, receive, send_named)


def adapt_app(app: FastAPI, place: FrontEndPlace) -> None:
    """What differs in one of several front ends: /metrics sums every process's metric
    files, and each answer names its process."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    app.state.pagellm.metrics_registry = registry
    app.add_middleware(ServedByMiddleware, index=place.index)
