"""`pagellm serve`'s start-up, in the order that brings `/health` up soonest.

The port is bound first (a busy port fails in a second). Then the engine core process is
forked before torch is imported, as soon as the arguments are parsed: it imports torch and
the model code and loads the weights on one core while the server imports its own modules
(transformers' tokenizers, the HTTP front end) on the other, and only then waits for it. The
server itself never imports torch. This module therefore imports neither torch nor the
engine at its top."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys

from pagellm.distributed.config import DataParallelConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_process import (EnginePlace, StartedCore, start_core_process,
                                         start_method)
from pagellm.entrypoints.openai.cli_args import ServerSettings


def engine_start_method() -> str:
    """Fork the engine core unless told otherwise: it then begins with torch and the model
    code already imported, seconds sooner than a fresh interpreter. Safe in `pagellm serve`,
    which has run no torch operation and started no thread yet; not with CUDA, which must
    not be initialised before a fork, and not for engines made inside other programs."""
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second, not after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def run_headless_node(args: EngineArgs) -> int:
    """Data parallel engine cores (`-dp`), or tensor and pipeline ranks (`--nnodes`)."""
    parallel = args.parallel_config()
    if parallel.data_parallel.headless:
        from pagellm.distributed.dp_nodes import run_headless_engines

        return run_headless_engines(args, engine_start_method())
    from pagellm.distributed.nodes import run_headless

    return run_headless(parallel)


def run_server(args: argparse.Namespace) -> None:
    settings = ServerSettings.from_args(args)
    if settings.engine_args.headless:  # a secondary node: engine ranks, no API server
        raise SystemExit(run_headless_node(settings.engine_args))
    if settings.engine_args.api_server_count > 1:
        from pagellm.entrypoints.openai.api_servers import run_api_servers

        exit_code = run_api_servers(settings)
    else:
        exit_code = _run_one_server(settings)
    if exit_code:
        raise SystemExit(exit_code)


def _run_one_server(settings: ServerSettings) -> int:
    sock = bind_socket(settings.host, settings.port)
    try:
        return asyncio.run(_serving(settings, sock))
    finally:
        sock.close()


def _serving(settings: ServerSettings, sock: socket.socket):
    """The coroutine that serves: an embedding model's, or a generative one's with its
    engine cores already starting."""
    if settings.engine_args.runner_kind() == "pooling":
        from pagellm.entrypoints.openai.pooling_server import serve_pooling

        return serve_pooling(settings, sock)
    started = _start_engine_core_early(settings.engine_args)
    from pagellm.engine.async_llm import AsyncLLM

    # only cores not started yet need a start method, whose CUDA check imports torch: the
    # API server of a forked core never does (1.3 s of a restart on its core)
    default_start = engine_start_method() if started is None else "fork"
    engine = AsyncLLM.from_engine_args(settings.engine_args, log_stats=settings.log_stats,
                                       default_start=default_start, wait=False,
                                       started=started)
    try:
        from pagellm.entrypoints.openai.api_server import serve
    except BaseException:
        engine.shutdown()
        raise
    return serve(settings, sock, engine)


def _start_engine_core_early(args: EngineArgs) -> StartedCore | None:
    """The one engine core of a server, forked before this process imports torch; None where
    the server runs several (-dp), or where torch is imported already (a server started
    inside another program), which the usual start then handles."""
    data_parallel = DataParallelConfig.from_args(args)
    ranks = data_parallel.served_ranks
    if "torch" in sys.modules or len(ranks) != 1:
        return None
    return start_core_process(args, EnginePlace(ranks[0], data_parallel.size),
                              start_method("fork"))
