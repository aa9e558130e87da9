"""Multi-node runs without Ray (`--nnodes N --node-rank R --master-addr A --master-port P`).

The world's ranks split evenly over the nodes, in order: node 0 runs the API server, the
engine core with the driver (rank 0) and its other local ranks, and listens for every
worker at A:P; each other node runs `pagellm serve MODEL ... --headless`, which starts its
ranks as worker processes that connect to A:P (retrying until the head is up) and then
serve the driver's steps exactly as local workers do.

The ranks authenticate with a key both sides derive: `PAGELLM_DIST_AUTHKEY` if set (the
same value on every node), else one derived from A:P, which only keeps unrelated runs
apart; like torch.distributed's own rendezvous, the master port belongs on a private
network.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

from pagellm.distributed.config import ParallelConfig
from pagellm.logger import init_logger

logger = init_logger(__name__)
AUTHKEY_ENV = "PAGELLM_DIST_AUTHKEY"
WORKER_ADDRESS_ENV = "PAGELLM_WORKER_ADDRESS"  # host:port of the driver's socket
WORKER_AUTHKEY_ENV = "PAGELLM_WORKER_AUTHKEY"
WORKER_RANK_ENV = "PAGELLM_WORKER_RANK"
CONNECT_SECONDS_ENV = "PAGELLM_WORKER_CONNECT_TIMEOUT"  # how long a worker retries the driver


def node_authkey(parallel: ParallelConfig) -> bytes:
    secret = os.environ.get(AUTHKEY_ENV) or f"pagellm:{parallel.master_addr}:{parallel.master_port}"
    return hashlib.sha256(secret.encode()).digest()


def worker_env(address: str, authkey: bytes, rank: int) -> dict[str, str]:
    """What a worker process needs to find and join the driver."""
    # c10d's C++ stack traces would bury the driver's one-line error
    return {WORKER_ADDRESS_ENV: address, WORKER_AUTHKEY_ENV: authkey.hex(),
            WORKER_RANK_ENV: str(rank),
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL")}


def start_worker_process(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagellm.distributed.worker"],
                            env={**os.environ, **env})


def node_ranks(parallel: ParallelConfig) -> range:
    per_node = parallel.ranks_per_node
    return range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node)


def run_headless(parallel: ParallelConfig) -> int:
    """A secondary node: its ranks' processes until they end (the driver stopped them, or
    one failed); SIGTERM or Ctrl-C stops them. The exit code is the worst of theirs."""
    ranks = node_ranks(parallel)
    address = f"{parallel.master_addr}:{parallel.master_port}"
    authkey = node_authkey(parallel)
    logger.info("Headless node %d of %d: ranks %d-%d join the driver at %s",
                parallel.node_rank, parallel.nnodes, ranks[0], ranks[-1], address)
    processes = [start_worker_process(worker_env(address, authkey, rank)) for rank in ranks]

    def stop(signum: int, frame: object) -> None:
        for process in processes:
            if process.poll() is None:
                process.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while any(process.poll() is None for process in processes):
        time.sleep(0.5)
    codes = [process.returncode for process in processes]
    logger.info("Headless node %d: ranks ended with exit codes %s", parallel.node_rank, codes)
    return max((abs(code) for code in codes), default=0)
