"""Multi-node runs without Ray (`--nnodes N --node-rank R --master-addr A --master-port P`).

The world's ranks split evenly over the nodes, in order: node 0 runs the API server, the
engine core with the driver (rank 0) and its other local ranks, and listens for every
worker at A:P; each other node runs `pagellm serve MODEL ... --headless`, which starts its
ranks as worker processes that connect to A:P (retrying until the head is up) and then
serve the driver's steps exactly as local workers do. A headless node started without
`--node-rank` is given one by the head in the order nodes join (pagellm.distributed.roster),
so that identical pods (a Deployment's, KServe's workers) need no index of their own.

The ranks authenticate with a key both sides derive: `PAGELLM_DIST_AUTHKEY` if set (the
same value on every node), else one derived from the master port, which only keeps
unrelated runs apart (not from the address, which the head may know as its IP and the
other nodes by a service name); like torch.distributed's own rendezvous, the master port
belongs on a private network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection

from pagellm.distributed.config import ParallelConfig
from pagellm.distributed.roster import RankClaim
from pagellm.logger import init_logger

logger = init_logger(__name__)
AUTHKEY_ENV = "PAGELLM_DIST_AUTHKEY"
WORKER_ADDRESS_ENV = "PAGELLM_WORKER_ADDRESS"  # host:port of the driver's socket
WORKER_AUTHKEY_ENV = "PAGELLM_WORKER_AUTHKEY"
WORKER_CLAIM_ENV = "PAGELLM_WORKER_CLAIM"  # the RankClaim it sends, as JSON
CONNECT_SECONDS_ENV = "PAGELLM_WORKER_CONNECT_TIMEOUT"  # how long a worker retries the driver
NODES_WAIT_ENV = "PAGELLM_NODES_WAIT_SECONDS"  # how long the head waits for the other nodes
_REPORT_SECONDS = 10.0


def node_authkey(port: int) -> bytes:
    """The key of a multi-node run whose head listens at `port` (--master-port, or -dpp)."""
    secret = os.environ.get(AUTHKEY_ENV) or f"pagellm:{port}"
    return hashlib.sha256(secret.encode()).digest()


def connect_to(address: str, what: str) -> Connection:
    """The head's socket at host:port; a secondary node may start before the head listens,
    or before its name resolves (a Service whose pod is not scheduled yet)."""
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    deadline = start + float(os.environ.get(CONNECT_SECONDS_ENV, "300"))
    report = start + _REPORT_SECONDS
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            break
        except OSError as error:  # refused, unresolved, unreachable: the head is not up yet
            now = time.monotonic()
            if now > deadline:
                raise SystemExit(f"no {what} at {address} after {now - start:.0f} s "
                                 f"({CONNECT_SECONDS_ENV}): {error}") from None
            if now > report:
                logger.info("Waiting for the %s at %s (%.0f s): %s", what, address,
                            now - start, error)
                report += _REPORT_SECONDS
            time.sleep(1.0)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Connection(sock.detach())


def worker_env(address: str, authkey: bytes, claim: RankClaim) -> dict[str, str]:
    """What a worker process needs to find and join the driver, and say who it is."""
    # c10d's C++ stack traces would bury the driver's one-line error
    return {WORKER_ADDRESS_ENV: address, WORKER_AUTHKEY_ENV: authkey.hex(),
            WORKER_CLAIM_ENV: json.dumps(dataclasses.asdict(claim)),
            "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "FATAL")}


def read_claim(env: Mapping[str, str]) -> RankClaim:
    fields = json.loads(env[WORKER_CLAIM_ENV])
    return RankClaim(**{**fields, "layout": tuple(fields["layout"])})


def start_worker_process(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagellm.distributed.worker"],
                            env={**os.environ, **env})


def new_node_id() -> str:
    """A headless node's name in the head's log: its host name (a pod's name) and a random
    suffix, so that two nodes on one host stay apart."""
    return f"{socket.gethostname()}-{secrets.token_hex(2)}"


def run_headless(parallel: ParallelConfig) -> int:
    """A secondary node: its ranks' processes until they end (the driver stopped them, or
    one failed); SIGTERM or Ctrl-C stops them. The exit code is the worst of theirs."""
    per_node, node_rank = parallel.ranks_per_node, parallel.node_rank
    address = f"{parallel.master_addr}:{parallel.master_port}"
    authkey = node_authkey(parallel.master_port)
    node_id = new_node_id()
    if node_rank is None:
        logger.info("Headless node %s of %d: %d rank(s) join the driver at %s, which gives "
                    "this node its rank", node_id, parallel.nnodes, per_node, address)
    else:
        logger.info("Headless node %d of %d: ranks %d-%d join the driver at %s", node_rank,
                    parallel.nnodes, node_rank * per_node, (node_rank + 1) * per_node - 1,
                    address)
    processes = [start_worker_process(worker_env(
        address, authkey, RankClaim(node_id, node_rank, index, parallel.layout)))
        for index in range(per_node)]
    return supervise(node_id, lambda: any(p.poll() is None for p in processes),
                     lambda: [p.terminate() for p in processes if p.poll() is None],
                     lambda: [p.returncode for p in processes])


def supervise(node_id: str, running: Callable[[], bool], stop: Callable[[], object],
              exit_codes: Callable[[], list[int]]) -> int:
    """A headless node's processes, until they all end; SIGTERM or Ctrl-C stops them. The
    exit code is the worst of theirs."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop())
    signal.signal(signal.SIGINT, lambda signum, frame: stop())
    while running():
        time.sleep(0.5)
    codes = exit_codes()
    logger.info("Headless node %s: ranks ended with exit codes %s", node_id, codes)
    return max((abs(code) for code in codes), default=0)
