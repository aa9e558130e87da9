"""Who joins the driver of a multi-node run: each worker's claim, the node ranks handed out,
and the one-line refusal of a node that does not fit.

Every worker connects to the driver, passes the challenge and sends a `RankClaim`: its node's
id (the head's is `HEAD_NODE_ID`; a headless node's is its host name and a random suffix),
the node rank it was started with, or None, and its index among its node's ranks. A node
started without `--node-rank` is given the lowest free node rank when its first rank
connects, so nodes started by a Deployment, which have no stable index, are numbered in the
order they join; the node's other ranks follow under its id. The driver answers each
admitted worker with its global rank (node rank x ranks per node + local index) in the
`WorkerInit` it sends, and each refused one with a `Refused` line naming it: a node started
with other sizes, a second node claiming a node rank already held, or a node beyond
`--nnodes`. A refused node does not stop the head, which goes on waiting for the nodes it
lacks and says every few seconds which ones those are.

`JoinRoster` and `accept_until_complete` are shared with the head of data parallelism across
nodes (pagellm.distributed.dp_nodes), whose remote engines join the same way.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, deliver_challenge

from pagellm.distributed.config import ParallelConfig
from pagellm.logger import init_logger

logger = init_logger(__name__)
HEAD_NODE_ID = "head"
_HANDSHAKE_SECONDS = 30
_REPORT_SECONDS = 5.0  # how often the head says whom it still waits for


@dataclass(frozen=True)
class RankClaim:
    """What a worker says once it passed the challenge."""

    node_id: str
    node_rank: int | None  # None: the driver assigns this node's rank
    local_index: int  # this rank's index among its node's ranks (its cores, too)
    layout: tuple[int, int, int]  # tensor, pipeline size and nnodes the node was started with


@dataclass(frozen=True)
class Refused:
    """The driver's answer to a worker that does not fit: one line saying why."""

    message: str


class NodeRefused(Exception):
    """A node does not fit the run; it is told why and the driver goes on waiting."""


def _sizes(layout: tuple[int, int, int]) -> str:
    return "-tp %d -pp %d --nnodes %d" % layout


class JoinRoster(ABC):
    """What the head admits, rank by rank: the connections that joined, and the one-line
    refusal of a node that does not fit, remembered so that its other ranks hear the same.
    The multi-node workers' roster (NodeRoster) and the remote data parallel engines'
    (dp_nodes.EngineRoster) differ only in the sizes a node must share with the head and in
    how a claim's rank is found."""

    claim_type: type
    port_flag: str  # the port every node must share with the head, named in a bad key's line
    rank_name: str  # "rank", "data parallel rank"

    def __init__(self, expected: int) -> None:
        self.expected = expected  # connections the head waits for
        self.conns: dict[int, Connection] = {}  # by rank
        self._refused: dict[str, str] = {}  # node id -> why

    @property
    def complete(self) -> bool:
        return len(self.conns) == self.expected

    def admit(self, claim: Any) -> int:
        """The claim's rank; NodeRefused if its node does not fit."""
        who = f"node {claim.node_id}"
        if claim.node_id in self._refused:
            raise NodeRefused(self._refused[claim.node_id])
        sizes = self._other_sizes(claim)
        if sizes is not None:
            theirs, ours, what = sizes
            self._refuse(claim.node_id, f"{who} was started with {theirs}, the head with "
                                        f"{ours}: start every node with the same {what}")
        rank = self._rank(claim, who)
        if rank in self.conns:
            raise NodeRefused(f"{self.rank_name} {rank} of {who} connected twice")
        return rank

    @abstractmethod
    def _other_sizes(self, claim: Any) -> tuple[str, str, str] | None:
        """(the node's sizes, the head's, what they are) if they differ, else None."""

    @abstractmethod
    def _rank(self, claim: Any, who: str) -> int:
        """The claim's rank, placing its node on its first claim (refusing it if it does not
        fit)."""

    @abstractmethod
    def progress(self) -> str:
        """Who joined and who is missing, for the head's log line."""

    def _refuse(self, node_id: str, message: str) -> NoReturn:
        self._refused[node_id] = message
        logger.warning("%s", message)
        raise NodeRefused(message)

    def admit_connection(self, sock: socket.socket, authkey: bytes) -> None:
        """One connection to the head's socket: admitted under its rank, or refused."""
        joined = handshake(sock, authkey, self.claim_type, self.port_flag)
        if joined is None:
            return
        conn, claim = joined
        try:
            rank = self.admit(claim)
        except NodeRefused as refusal:
            send_and_close(conn, Refused(str(refusal)))
            return
        if self._welcome(conn, rank):
            self.conns[rank] = conn

    def _welcome(self, conn: Connection, rank: int) -> bool:
        """Tell an admitted connection its rank if it waits for that; False if it is gone."""
        return True


class NodeRoster(JoinRoster):
    """The connections of the ranks that joined, by global rank, and which node holds which
    node rank (node 0 is the driver's own)."""

    claim_type = RankClaim
    port_flag = "--master-port"
    rank_name = "rank"

    def __init__(self, parallel: ParallelConfig) -> None:
        super().__init__(parallel.world_size - 1)
        self.layout = parallel.layout
        self.nnodes, self.per_node = parallel.nnodes, parallel.ranks_per_node
        self.holders: dict[int, str] = {0: HEAD_NODE_ID}  # node rank -> node id
        self._node_of: dict[str, int] = {HEAD_NODE_ID: 0}

    def _other_sizes(self, claim: RankClaim) -> tuple[str, str, str] | None:
        if claim.layout == self.layout:
            return None
        return _sizes(claim.layout), _sizes(self.layout), "sizes"

    def _rank(self, claim: RankClaim, who: str) -> int:
        node_rank = self._node_of.get(claim.node_id)
        if node_rank is None:
            node_rank = self._place(claim, who)
        return node_rank * self.per_node + claim.local_index

    def _place(self, claim: RankClaim, who: str) -> int:
        """A node's first rank: the node rank it claims, or the lowest free one."""
        if claim.node_rank is None:
            free = [rank for rank in range(1, self.nnodes) if rank not in self.holders]
            if not free:
                self._refuse(claim.node_id, f"{who} is refused: all {self.nnodes} nodes of "
                                            f"--nnodes {self.nnodes} have joined")
            node_rank = free[0]
        else:
            node_rank = claim.node_rank
            holder = self.holders.get(node_rank)
            if holder is not None:
                self._refuse(claim.node_id, f"{who} is refused: node rank {node_rank} is "
                                            f"already held by node {holder}; give each "
                                            "headless node its own --node-rank, or none")
        self.holders[node_rank] = claim.node_id
        self._node_of[claim.node_id] = node_rank
        ranks = range(node_rank * self.per_node, (node_rank + 1) * self.per_node)
        if claim.node_id != HEAD_NODE_ID:
            logger.info("Node %s joined as node %d of %d (%s): ranks %d-%d", claim.node_id,
                        node_rank, self.nnodes,
                        "its --node-rank" if claim.node_rank is not None else "in join order",
                        ranks[0], ranks[-1])
        return node_rank

    def progress(self) -> str:
        """Which nodes joined, which have part of their ranks, and which are missing."""
        counts = {node: 0 for node in self.holders}
        counts[0] += 1  # the driver
        for rank in self.conns:
            counts[rank // self.per_node] += 1
        whole = sum(1 for count in counts.values() if count == self.per_node)
        parts = [f"{whole} of {self.nnodes} nodes joined"]
        parts += [f"node {node} ({self.holders[node]}) has {count} of {self.per_node} ranks"
                  for node, count in sorted(counts.items()) if count < self.per_node]
        missing = [str(node) for node in range(self.nnodes) if node not in self.holders]
        if missing:
            parts.append("missing node rank(s) " + ", ".join(missing))
        return "; ".join(parts)


@dataclass(frozen=True)
class JoinWait:
    """How long the head waits for its roster to fill, and what it says meanwhile."""

    seconds: float
    timed_out: Callable[[str], str]  # the roster's progress -> the error's line
    waiting_for: str | None = None  # "the nodes": logged with the progress every few seconds


def accept_until_complete(server: socket.socket, authkey: bytes, roster: JoinRoster,
                          check: Callable[[], None], wait: JoinWait) -> None:
    """Admit connections to the head's socket until the roster is complete; `check` raises
    if what the head started itself died meanwhile."""
    start = time.monotonic()
    report = start + _REPORT_SECONDS
    server.settimeout(1.0)
    while not roster.complete:
        check()
        now = time.monotonic()
        if now > start + wait.seconds:
            raise RuntimeError(wait.timed_out(roster.progress()))
        if wait.waiting_for is not None and now > report:
            logger.info("Waiting for %s (%.0f s): %s", wait.waiting_for, now - start,
                        roster.progress())
            report += _REPORT_SECONDS
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        roster.admit_connection(sock, authkey)


def handshake(sock: socket.socket, authkey: bytes, claim_type: type,
              port_flag: str = "--master-port") -> tuple[Connection, Any] | None:
    """The challenge and the claim (a `claim_type`); a stray or mis-keyed connection is
    logged and dropped."""
    peer = "%s:%s" % sock.getpeername()[:2]
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages, sent at once
    _receive_timeout(sock, _HANDSHAKE_SECONDS)  # a silent peer must not stall the driver
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        claim = conn.recv()
    except (EOFError, ConnectionError):  # a port check (a liveness probe) says nothing
        logger.debug("A connection from %s closed before it said who it is", peer)
        conn.close()
        return None
    except (AuthenticationError, OSError) as error:
        logger.warning("A connection from %s to the head was dropped (%s): every node must "
                       "share PAGELLM_DIST_AUTHKEY and %s", peer, type(error).__name__,
                       port_flag)
        conn.close()
        return None
    if not isinstance(claim, claim_type):
        logger.warning("A connection from %s sent %r, not a %s: dropped", peer, claim,
                       claim_type.__name__)
        conn.close()
        return None
    with socket.socket(fileno=os.dup(conn.fileno())) as view:
        _receive_timeout(view, 0)  # from here on, steps may be far apart
    return conn, claim


def _receive_timeout(sock: socket.socket, seconds: int) -> None:
    """A blocking read of the descriptor gives up after `seconds` (0: never); unlike
    settimeout, this keeps the descriptor blocking, as Connection needs it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))


def send_and_close(conn: Connection, message: object) -> None:
    try:
        conn.send(message)
    except OSError:
        pass
    conn.close()


class Doorman:
    """After start-up, the head's socket stays open so that a node arriving late (one too
    many, or restarted) hears why it is not taken, instead of retrying a closed port."""

    def __init__(self, server: socket.socket, roster: JoinRoster, authkey: bytes) -> None:
        self._server, self._roster, self._authkey = server, roster, authkey
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="NodeDoorman", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._server.settimeout(0.5)
        while not self._stop.is_set():
            try:
                sock, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            joined = handshake(sock, self._authkey, self._roster.claim_type,
                               self._roster.port_flag)
            if joined is None:
                continue
            conn, claim = joined
            message = f"node {claim.node_id} is refused: the engine already runs"
            try:
                self._roster.admit(claim)  # every rank is taken: this refuses and says why
            except NodeRefused as refusal:
                message = str(refusal)
            send_and_close(conn, Refused(message))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._server.close()
