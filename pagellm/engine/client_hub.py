"""One engine core serving several API server processes (`--api-server-count N`).

The engine core's step loop reads and writes one connection. With N front-end processes,
`FrontEndHub` stands in for it over one connection per front-end:

- Request ids are made the front-end's own on the way in, prefixed by its index (`1|cmpl-..`),
  and the prefix is taken off on the way out, so two front-ends may use the same id.
- Each step's token updates go only to the front-end whose requests they are; its scheduler
  stats go to every front-end, whose balancers (`-dp`) and engine views need every engine's
  load after every step, whichever front-end sent the work.
- A reply (KV cache report, LoRA load) goes to the front-end whose ask is being handled; the
  start-up's CoreReady or CoreFailed, sent before any ask, to all.
- A front-end that leaves (shutdown, or its process died) has its requests aborted, which
  frees their blocks; the engine core ends once every front-end has left.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from pagellm.engine.core_client import AddRequest, FinishRequests, Shutdown, StepResult
from pagellm.logger import init_logger
from pagellm.request import RequestStatus, child_request_id

logger = init_logger(__name__)
_SEPARATOR = "|"


@dataclass(frozen=True)
class FrontEndPlace:
    """Which of the server's `count` API server processes this is, and its connections to
    the engine cores it serves, by data parallel rank."""

    index: int
    count: int
    conns: tuple[Connection, ...]

    @property
    def name(self) -> str:
        return f"APIServer_{self.index}"

    @property
    def records_engine_stats(self) -> bool:
        """The engines' own figures (queue gauges, prompt tokens, the periodic log line) are
        recorded by one front-end, so that the scrape, which sums the processes' counters,
        counts them once."""
        return self.index == 0


class FrontEndHub:
    """The connections of N front-ends, read and written as the step loop's one."""

    def __init__(self, conns: list[Connection]) -> None:
        self._conns = dict(enumerate(conns))
        self._index = {id(conn): client for client, conn in self._conns.items()}
        self._requests: dict[int, set[str]] = {client: set() for client in self._conns}
        self._asker: int | None = None
        self._aborts: list[FinishRequests] = []  # the requests of front-ends that left

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self._aborts) or bool(wait(list(self._conns.values()), timeout))

    def recv(self) -> object:
        """The next message of any front-end. Never blocks after `poll()` said yes: a
        front-end found gone yields the abort of its requests."""
        if not self._aborts and not self._conns:
            raise EOFError("every API server process has left")
        if self._aborts:
            return self._aborts.pop(0)
        conn = wait(list(self._conns.values()))[0]
        client = self._index[id(conn)]
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
        if message is None or isinstance(message, Shutdown):
            self._leave(client)
            return self._aborts.pop(0)
        self._asker = client
        return self._inbound(client, message)

    def _inbound(self, client: int, message: object) -> object:
        prefix = f"{client}{_SEPARATOR}"
        if isinstance(message, AddRequest):
            request = message.request
            request.request_id = prefix + request.request_id
            self._requests[client].update(child_request_id(request.request_id, index)
                                          for index in range(request.sampling_params.n))
        elif isinstance(message, FinishRequests):
            message.request_ids = [prefix + request_id for request_id in message.request_ids]
            self._requests[client].difference_update(message.request_ids)
        return message

    def send(self, message: object) -> None:
        if isinstance(message, StepResult):
            self._publish(message)
        elif self._asker is not None:
            self._send_to(self._asker, message)
        else:
            for client in list(self._conns):
                self._send_to(client, message)

    def _publish(self, result: StepResult) -> None:
        """Each front-end's updates, with every front-end getting the step's stats."""
        updates: dict[int, list] = {client: [] for client in self._conns}
        for update in result.updates:
            owner, _, update.request_id = update.request_id.partition(_SEPARATOR)
            client = int(owner)
            if update.parent_id is not None:
                update.parent_id = update.parent_id.partition(_SEPARATOR)[2]
            if update.finished:
                self._requests[client].discard(f"{owner}{_SEPARATOR}{update.request_id}")
            if client in updates:  # else its front-end left: the abort is on its way
                updates[client].append(update)
        for client, mine in updates.items():
            self._send_to(client, StepResult(mine, result.stats, result.engine))

    def _send_to(self, client: int, message: object) -> None:
        conn = self._conns.get(client)
        if conn is None:
            return
        try:
            conn.send(message)
        except OSError:  # its process died: its requests are aborted
            self._leave(client)

    def _leave(self, client: int) -> None:
        conn = self._conns.pop(client)
        del self._index[id(conn)]
        conn.close()
        if self._asker == client:
            self._asker = None
        ids = sorted(self._requests.pop(client))
        if ids:
            logger.info("API server %d left with %d request(s) in flight; aborting them.",
                        client, len(ids))
        self._aborts.append(FinishRequests(ids, RequestStatus.FINISHED_ABORTED))
