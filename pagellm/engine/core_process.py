"""Starting an engine core's process, with nothing heavier than the standard library imported.

`pagellm serve` forks its engine core before it imports torch: the core then imports torch
and the model code and loads the weights on one core while the server imports its own
(torch, transformers, the HTTP front end) on the other. A fork before torch is imported is
safe with CUDA too, since nothing of CUDA exists yet to be inherited. This module therefore
imports no part of the engine at its top; the process's entry point imports it."""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.engine.arg_utils import EngineArgs

START_METHOD_ENV_VARS = ("PAGELLM_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD")


def start_method(default: str = "spawn") -> str:
    """How the engine core process starts: vLLM's VLLM_WORKER_MULTIPROC_METHOD (or its
    PAGELLM_ twin) if set, else `default`. `spawn` is safe in any process; `pagellm serve`
    asks for `fork` where that is safe (see launch.engine_start_method)."""
    for name in START_METHOD_ENV_VARS:
        value = os.environ.get(name)
        if value:
            if value not in ("fork", "spawn", "forkserver"):
                raise ValueError(f"{name}={value}: use fork, spawn or forkserver.")
            return value
    return default


@dataclass(frozen=True)
class EnginePlace:
    """Which data parallel rank an engine core is, and its share of its node's cores: the
    `local_index`-th of the `local_count` engines this node runs."""

    rank: int = 0
    size: int = 1
    local_index: int = 0
    local_count: int = 1

    @property
    def name(self) -> str:
        return "EngineCore" if self.size == 1 else f"EngineCore_DP{self.rank}"


@dataclass(frozen=True)
class StartedCore:
    """An engine core process just started, and the server's end of its pipe."""

    process: BaseProcess
    conn: Connection


def start_core_process(args: EngineArgs, place: EnginePlace, method: str) -> StartedCore:
    context = multiprocessing.get_context(method)
    conn, child_conn = context.Pipe()
    process = context.Process(target=_core_main, name=place.name, daemon=True,
                              args=(child_conn, args, place))
    process.start()
    child_conn.close()
    return StartedCore(process, conn)


def _core_main(conn: Connection, args: EngineArgs, place: EnginePlace) -> None:
    from pagellm.engine.core_client import run_engine_core

    run_engine_core(conn, args, place)
