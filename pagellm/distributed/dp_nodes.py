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
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge

from pagellm.distributed.config import DataParallelConfig
from pagellm.distributed.nodes import (NODES_WAIT_ENV, connect_to, new_node_id, node_authkey,
                                       supervise)
from pagellm.distributed.roster import (Doorman, JoinRoster, JoinWait, Refused,
                                        accept_until_complete)
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import AttachedEngineCoreClient, StepResult, run_engine_core
from pagellm.engine.core_process import EnginePlace, start_method
from pagellm.logger import init_logger

logger = init_logger(__name__)
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


class EngineRoster(JoinRoster):
    """The remote engines that joined the head, by rank, and which node holds which rank."""

    claim_type = EngineClaim
    port_flag = _PORT_FLAG
    rank_name = "data parallel rank"

    def __init__(self, config: DataParallelConfig) -> None:
        super().__init__(len(config.remote_ranks))
        self.size, self.expected_ranks = config.size, config.remote_ranks
        self.head_ranks = config.local_ranks
        self.holders: dict[int, str] = {}  # rank -> node id

    def _other_sizes(self, claim: EngineClaim) -> tuple[str, str, str] | None:
        if claim.size == self.size:
            return None
        return f"-dp {claim.size}", f"-dp {self.size}", "-dp"

    def _rank(self, claim: EngineClaim, who: str) -> int:
        if self.holders.get(claim.rank) != claim.node_id:
            self._place(claim, who)
        return claim.rank

    def _place(self, claim: EngineClaim, who: str) -> None:
        """A node's first engine: all its ranks must be free ones the head waits for."""
        ranks, flags = claim.ranks, f"-dpr {claim.first} -dpl {claim.count}"
        ours = [rank for rank in ranks if rank in self.head_ranks]
        if ours:
            self._refuse(claim.node_id, f"{who} is refused: {flags} (data parallel "
                                        f"{_ranks(ranks)}) overlaps the head's own "
                                        f"{_ranks(self.head_ranks)}; the head waits for "
                                        f"{_ranks(self.expected_ranks)}")
        held = [rank for rank in ranks if rank in self.holders]
        if held:
            self._refuse(claim.node_id, f"{who} is refused: data parallel rank {held[0]} is "
                                        f"already held by node {self.holders[held[0]]}; "
                                        "give each headless node its own -dpr")
        for rank in ranks:
            self.holders[rank] = claim.node_id
        logger.info("Node %s joined: data parallel %s", claim.node_id, _ranks(ranks))

    def progress(self) -> str:
        joined = len(self.head_ranks) + len(self.conns)
        missing = [str(rank) for rank in self.expected_ranks if rank not in self.conns]
        return (f"{joined} of {self.size} data parallel engines joined; missing rank(s) "
                + ", ".join(missing))

    def _welcome(self, conn: Connection, rank: int) -> bool:
        """An engine waits to hear that it was admitted before it loads its model."""
        try:
            conn.send(Admitted(rank))
        except OSError:  # gone already: it may come back
            conn.close()
            return False
        return True


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
    wait = float(os.environ.get(NODES_WAIT_ENV, "300"))

    def timed_out(progress: str) -> str:
        return (f"the other nodes' engines did not join the head at {head.address} within "
                f"{wait:g} s ({NODES_WAIT_ENV}): {progress}.")

    try:
        accept_until_complete(head.server, head.authkey, roster, check,
                              JoinWait(wait, timed_out, "the data parallel engines"))
    except BaseException:  # the engines that joined hear that the head is gone
        head.server.close()
        for conn in roster.conns.values():
            conn.close()
        raise
    logger.info("All %d data parallel engines joined", roster.size)
    return roster, Doorman(head.server, roster, head.authkey)


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
