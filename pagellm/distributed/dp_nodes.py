"""Data parallelism across nodes (`-dpl`, `-dpr`, `-dpa`, `-dpp`), as vLLM lays it out.

The head (`pagellm serve M -dp 4 -dpl 2 -dpa A -dpp P`) runs the API server and the engine
cores of ranks 0-1, and listens at A:P for the others; `-dpl 0` leaves it the API server
only. Each other node (`pagellm serve M --headless -dp 4 -dpl 2 -dpr 2 -dpa A -dpp P`) starts
one engine core process per rank it holds. Each connects to A:P (retrying until the head
listens), passes the challenge of the multi-node ranks (`PAGELLM_DIST_AUTHKEY`, else a key
derived from the port) and says which rank it is; once admitted it is the same engine core
the head would have started, its socket standing in for the pipe. The head waits for every
rank, saying every few seconds which are missing, and refuses with one line a node that does
not fit: started with another `-dp`, or holding ranks the head or another node holds.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge
from typing import NoReturn

from pagellm.distributed.config import DataParallelConfig
from pagellm.distributed.nodes import (NODES_WAIT_ENV, connect_to, new_node_id, node_authkey,
                                       supervise)
from pagellm.distributed.roster import (Doorman, NodeRefused, Refused, send_and_close,
                                        handshake)
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import (AttachedEngineCoreClient, EnginePlace, StepResult,
                                        run_engine_core, start_method)
from pagellm.logger import init_logger

logger = init_logger(__name__)
_REPORT_SECONDS = 5.0
_PORT_FLAG = "-dpp"


@dataclass(frozen=True)
class EngineClaim:
    """What a remote engine core says once it passed the challenge."""

    node_id: str
    size: int  # the -dp its node was started with
    first: int  # its node's ranks: -dpr ...
    count: int  # ... and -dpl
    rank: int  # this engine's

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.count)


@dataclass(frozen=True)
class Admitted:
    rank: int


def _ranks(ranks: range) -> str:
    """"rank 2", "ranks 2-3": the ranks named in the log lines."""
    return f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"


class EngineRoster:
    """The remote engines that joined the head, by rank, and which node holds which rank."""

    def __init__(self, config: DataParallelConfig) -> None:
        self.size, self.expected = config.size, config.remote_ranks
        self.head_ranks = config.local_ranks
        self.conns: dict[int, Connection] = {}
        self.holders: dict[int, str] = {}  # rank -> node id
        self._refused: dict[str, str] = {}  # node id -> why

    @property
    def complete(self) -> bool:
        return len(self.conns) == len(self.expected)

    def admit(self, claim: EngineClaim) -> int:
        """The claim's rank; NodeRefused if its node does not fit."""
        who = f"node {claim.node_id}"
        if claim.node_id in self._refused:
            raise NodeRefused(self._refused[claim.node_id])
        if claim.size != self.size:
            self._refuse(claim.node_id, f"{who} was started with -dp {claim.size}, the head "
                                        f"with -dp {self.size}: start every node with the "
                                        "same -dp")
        if self.holders.get(claim.rank) != claim.node_id:
            self._place(claim, who)
        if claim.rank in self.conns:
            raise NodeRefused(f"data parallel rank {claim.rank} of {who} connected twice")
        return claim.rank

    def _place(self, claim: EngineClaim, who: str) -> None:
        """A node's first engine: all its ranks must be free ones the head waits for."""
        ranks, flags = claim.ranks, f"-dpr {claim.first} -dpl {claim.count}"
        ours = [rank for rank in ranks if rank in self.head_ranks]
        if ours:
            self._refuse(claim.node_id, f"{who} is refused: {flags} (data parallel "
                                        f"{_ranks(ranks)}) overlaps the head's own "
                                        f"{_ranks(self.head_ranks)}; the head waits for "
                                        f"{_ranks(self.expected)}")
        held = [rank for rank in ranks if rank in self.holders]
        if held:
            self._refuse(claim.node_id, f"{who} is refused: data parallel rank {held[0]} is "
                                        f"already held by node {self.holders[held[0]]}; "
                                        "give each headless node its own -dpr")
        for rank in ranks:
            self.holders[rank] = claim.node_id
        logger.info("Node %s joined: data parallel %s", claim.node_id, _ranks(ranks))

    def _refuse(self, node_id: str, message: str) -> NoReturn:
        self._refused[node_id] = message
        logger.warning("%s", message)
        raise NodeRefused(message)

    def progress(self) -> str:
        joined = len(self.head_ranks) + len(self.conns)
        missing = [str(rank) for rank in self.expected if rank not in self.conns]
        return (f"{joined} of {self.size} data parallel engines joined; missing rank(s) "
                + ", ".join(missing))

    def admit_connection(self, sock: socket.socket, authkey: bytes) -> None:
        """One connection to the head's socket: admitted under its rank, or refused."""
        joined = handshake(sock, authkey, EngineClaim, _PORT_FLAG)
        if joined is None:
            return
        conn, claim = joined
        try:
            rank = self.admit(claim)
        except NodeRefused as refusal:
            send_and_close(conn, Refused(str(refusal)))
            return
        try:
            conn.send(Admitted(rank))
        except OSError:  # gone already: it may come back
            conn.close()
            return
        self.conns[rank] = conn


@dataclass
class HeadSocket:
    """Where the head waits for the remote engines, and the key they must hold."""

    server: socket.socket
    authkey: bytes

    @property
    def address(self) -> str:
        return "%s:%d" % self.server.getsockname()[:2]


def listen(config: DataParallelConfig) -> HeadSocket:
    """-dpa:-dpp, with the key every node derives (PAGELLM_DIST_AUTHKEY, else from -dpp)."""
    return HeadSocket(socket.create_server((config.address, config.rpc_port)),
                      node_authkey(config.rpc_port))


def join_remote_engines(config: DataParallelConfig, check: Callable[[], None],
                        head: HeadSocket) -> tuple[EngineRoster, Doorman]:
    """Wait at `head` until every remote rank joined (`check` raises if the head's own
    engines died meanwhile); then late nodes still hear why they are not taken."""
    roster = EngineRoster(config)
    logger.info("Waiting at %s for data parallel %s to join", head.address,
                _ranks(config.remote_ranks))
    try:
        _accept(head.server, head.authkey, roster, check)
    except BaseException:  # the engines that joined hear that the head is gone
        head.server.close()
        for conn in roster.conns.values():
            conn.close()
        raise
    return roster, Doorman(head.server, roster, head.authkey, EngineClaim)


def _accept(server: socket.socket, authkey: bytes, roster: EngineRoster,
            check: Callable[[], None]) -> None:
    wait = float(os.environ.get(NODES_WAIT_ENV, "300"))
    start = time.monotonic()
    report = start + _REPORT_SECONDS
    server.settimeout(1.0)
    while not roster.complete:
        check()
        now = time.monotonic()
        if now > start + wait:
            address = "%s:%d" % server.getsockname()[:2]
            raise RuntimeError(f"the other nodes' engines did not join the head at {address} "
                               f"within {wait:g} s ({NODES_WAIT_ENV}): {roster.progress()}.")
        if now > report:
            logger.info("Waiting for the data parallel engines (%.0f s): %s", now - start,
                        roster.progress())
            report += _REPORT_SECONDS
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        roster.admit_connection(sock, authkey)
    logger.info("All %d data parallel engines joined", roster.size)


def remote_engine_client(conn: Connection, rank: int, node_id: str,
                         on_result: Callable[[StepResult], None],
                         on_dead: Callable[[], None]) -> AttachedEngineCoreClient:
    """The engine core of a rank on another node, through its socket."""
    return AttachedEngineCoreClient(conn, f"data parallel rank {rank} (node {node_id})",
                                    on_result, on_dead)


def run_headless_engines(args: EngineArgs, default_start: str) -> int:
    """A secondary node: one engine core process per rank it holds, each joining the head;
    they run until the head stops them. The exit code is the worst of theirs."""
    config = args.parallel_config().data_parallel
    address = f"{config.address}:{config.rpc_port}"
    authkey, node_id, ranks = node_authkey(config.rpc_port), new_node_id(), config.local_ranks
    logger.info("Headless node %s: data parallel %s of %d join the head at %s", node_id,
                _ranks(ranks), config.size, address)
    context = multiprocessing.get_context(start_method(default_start))
    processes = []
    for index, rank in enumerate(ranks):
        place = EnginePlace(rank, config.size, index, len(ranks))
        claim = EngineClaim(node_id, config.size, ranks[0], len(ranks), rank)
        processes.append(context.Process(target=_remote_engine, name=place.name,
                                         args=(address, authkey, claim, args, place)))
        processes[-1].start()
    return supervise(node_id, lambda: any(p.is_alive() for p in processes),
                     lambda: [p.terminate() for p in processes if p.is_alive()],
                     lambda: [p.exitcode or 0 for p in processes])


def _remote_engine(address: str, authkey: bytes, claim: EngineClaim, args: EngineArgs,
                   place: EnginePlace) -> None:
    """An engine core process on a secondary node: join the head, then serve it."""
    from pagellm.distributed.worker import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its node stops it with SIGTERM
    sys.exit(serve_head(address, authkey, claim, args, place))


def serve_head(address: str, authkey: bytes, claim: EngineClaim, args: EngineArgs,
               place: EnginePlace) -> int:
    """Join the head and run its engine core until the head stops it (0), or 1 if it was
    not admitted (a secondary node's process, or a Ray actor's method)."""
    conn = _join_head(address, authkey, claim)
    if conn is None:
        return 1
    with conn:
        run_engine_core(conn, args, place)
    return 0


def _join_head(address: str, authkey: bytes, claim: EngineClaim) -> Connection | None:
    """Say which rank this engine is, or log in one line why the head said no."""
    conn = connect_to(address, "data parallel head")
    try:
        answer_challenge(conn, authkey)
        conn.send(claim)
        reply = conn.recv()
    except AuthenticationError:
        logger.error("The data parallel head at %s has another key: set the same "
                     "PAGELLM_DIST_AUTHKEY and -dpp on every node.", address)
        return None
    except (EOFError, OSError):
        logger.error("The data parallel head at %s closed the connection before admitting "
                     "rank %d; see the head's log.", address, claim.rank)
        return None
    if isinstance(reply, Refused):
        logger.error("%s", reply.message)
        return None
    logger.info("Data parallel rank %d joined the head at %s", claim.rank, address)
    return conn
