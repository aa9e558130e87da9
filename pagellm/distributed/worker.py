"""A worker rank (1..N-1) of the multiprocess executor: `python -m pagellm.distributed.worker`.

It connects back to the driver, joins the process group, loads its shard, allocates its KV
cache, then runs every step plan the driver sends until told to stop or the driver is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge

from pagellm.distributed.executor import (AllocateKVCache, StopWorker,
                                          WorkerFailed, WorkerInit, WorkerReady, load_rank_model)
from pagellm.distributed.group import (PreflightError, check_gpus, init_rank, pin_threads,
                                       rank_device)
from pagellm.distributed.nodes import (WORKER_ADDRESS_ENV, WORKER_AUTHKEY_ENV, connect_to,
                                       read_claim)
from pagellm.distributed.roster import RankClaim, Refused
from pagellm.kernels import cpu_kernels_available
from pagellm.logger import init_logger
from pagellm.worker.model_runner import ModelRunner

logger = init_logger("pagellm.distributed.worker")  # not __main__: run with -m
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: the kernel kills this worker when the driver's process dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _join(claim: RankClaim) -> tuple[Connection, WorkerInit] | None:
    """Say who this rank is and get its work, or log in one line why the driver said no."""
    address = os.environ[WORKER_ADDRESS_ENV]
    conn = connect_to(address, "driver")
    try:
        answer_challenge(conn, bytes.fromhex(os.environ[WORKER_AUTHKEY_ENV]))
        conn.send(claim)
        init = conn.recv()
    except AuthenticationError:
        logger.error("The driver at %s has another key: set the same PAGELLM_DIST_AUTHKEY "
                     "and --master-port on every node.", address)
        return None
    except (EOFError, OSError):
        logger.error("The driver at %s closed the connection before giving rank %d of node "
                     "%s its work; see the driver's log.", address, claim.local_index,
                     claim.node_id)
        return None
    if isinstance(init, Refused):
        logger.error("%s", init.message)
        return None
    if claim.node_rank is None:
        logger.info("Rank %d of node %s is global rank %d (node %d)", claim.local_index,
                    claim.node_id, init.info.rank, init.info.rank // init.info.local_world_size)
    return conn, init


def _start(conn: Connection, init: WorkerInit) -> ModelRunner:
    info = init.info
    pin_threads(info.local_rank, info.local_world_size)  # this node's cores
    if info.device_type == "cuda":
        check_gpus(info)  # this node's GPUs
    else:
        cpu_kernels_available()
    group = init_rank(info)
    loaded, layout = load_rank_model(init.model_config, init.dtype, group)
    conn.send(WorkerReady())
    message = conn.recv()
    assert isinstance(message, AllocateKVCache)
    config = init.model_config
    runner = ModelRunner(loaded.model, layout.local_arch, init.block_size, rank_device(info),
                         init.dtype, config.seed, init.kv_cache_dtype, config.batch_invariant)
    runner.allocate_kv_cache(message.num_blocks)
    conn.send(WorkerReady())
    return runner


def main() -> int:
    """A worker process of the multiprocess executor."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops the driver, which stops us
    return serve_rank()


def serve_rank() -> int:
    """Connect to the driver named by the environment and run its steps until it stops us
    (a worker process's body, or a Ray actor's)."""
    joined = _join(read_claim(os.environ))
    if joined is None:
        return 1
    conn, init = joined
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
