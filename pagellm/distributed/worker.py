"""A worker rank (1..N-1) of the multiprocess executor: `python -m pagellm.distributed.worker`.

It connects back to the driver, joins the process group, loads its shard, allocates its KV
cache, then runs every step plan the driver sends until told to stop or the driver is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, answer_challenge

import torch

from pagellm.distributed.executor import (AllocateKVCache, StopWorker,
                                          WorkerFailed, WorkerInit, WorkerReady, load_rank_model)
from pagellm.distributed.group import PreflightError, init_rank, pin_threads
from pagellm.distributed.nodes import (CONNECT_SECONDS_ENV, WORKER_ADDRESS_ENV,
                                       WORKER_AUTHKEY_ENV, WORKER_RANK_ENV)
from pagellm.kernels import cpu_kernels_available
from pagellm.logger import init_logger
from pagellm.worker.model_runner import ModelRunner

logger = init_logger(__name__)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the driver's process dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _connect() -> Connection:
    """The driver's socket; a headless node may start before the head node listens."""
    host, _, port = os.environ[WORKER_ADDRESS_ENV].rpartition(":")
    deadline = time.monotonic() + float(os.environ.get(CONNECT_SECONDS_ENV, "300"))
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    answer_challenge(conn, bytes.fromhex(os.environ[WORKER_AUTHKEY_ENV]))
    conn.send(int(os.environ[WORKER_RANK_ENV]))
    return conn


def _start(conn: Connection, init: WorkerInit) -> ModelRunner:
    info = init.info
    pin_threads(info.local_rank, info.local_world_size)  # this node's cores
    cpu_kernels_available()
    group = init_rank(info)
    loaded, layout = load_rank_model(init.model_config, init.dtype, group)
    conn.send(WorkerReady())
    message = conn.recv()
    assert isinstance(message, AllocateKVCache)
    config = init.model_config
    runner = ModelRunner(loaded.model, layout.local_arch, init.block_size, torch.device("cpu"),
                         init.dtype, config.seed, init.kv_cache_dtype, config.batch_invariant)
    runner.allocate_kv_cache(message.num_blocks)
    conn.send(WorkerReady())
    return runner


def main() -> int:
    """A worker process of the multiprocess executor."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops the driver, which stops us
    return serve_rank()


def serve_rank() -> int:
    """Connect to the driver named by the environment and run its steps until it stops us
    (a worker process's body, or a Ray actor's)."""
    conn = _connect()
    init = conn.recv()
    try:
        runner = _start(conn, init)
    except (ValueError, FileNotFoundError, PreflightError) as error:
        conn.send(WorkerFailed(str(error)))
        return 1
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver is gone
            return 0
        if isinstance(message, StopWorker):
            return 0
        runner.compute(message)


if __name__ == "__main__":
    sys.exit(main())
