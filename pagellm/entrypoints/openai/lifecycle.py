"""How the server stops: a graceful drain on SIGTERM, a non-zero exit when the engine dies.

On the first SIGTERM (or Ctrl-C) the server keeps its socket open but admits no new
API request (503) and /health answers 503, so Kubernetes takes it out of rotation;
requests in flight run for up to `--shutdown-timeout` seconds. Those still running
then are ended: a stream with an in-band error event and `data: [DONE]`, any other
request with a 503. Then uvicorn closes the connections and the process exits 0,
after the engine core. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator
from http import HTTPStatus
from types import FrameType

import uvicorn

from pagellm.entrypoints.openai.errors import OpenAIError, stream_error_event
from pagellm.entrypoints.openai.middleware import Admission
from pagellm.logger import init_logger

logger = init_logger(__name__)

SHUTDOWN_MESSAGE = "The server is shutting down; the request was ended before it finished."
# Once requests are told to end, how long they get to write their last bytes.
_FLUSH_SECONDS = 5.0
_POLL_SECONDS = 0.05


class Drain:
    def __init__(self, admission: Admission, timeout: float) -> None:
        self.admission = admission
        self.timeout = timeout
        self.cut = asyncio.Event()  # set when in-flight requests must end now

    async def run(self) -> None:
        self.admission.draining = True
        logger.info("Shutting down: no new requests; %d in flight may run for up to %.0f s "
                    "(--shutdown-timeout).", self.admission.in_flight, self.timeout)
        if await self._wait_idle(self.timeout):
            return
        logger.warning("Shutdown timeout reached; ending %d request(s) still in flight.",
                       self.admission.in_flight)
        self.cut.set()
        await self._wait_idle(_FLUSH_SECONDS)

    async def _wait_idle(self, seconds: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.admission.in_flight and loop.time() < deadline:
            await asyncio.sleep(_POLL_SECONDS)
        return not self.admission.in_flight

    async def until_cut(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's events, ended by an error event and [DONE] if the drain cuts it."""
        cut = asyncio.ensure_future(self.cut.wait())
        step: asyncio.Future[str] | None = None
        try:
            while True:
                step = asyncio.ensure_future(anext(events))
                await asyncio.wait({step, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    break
                try:
                    event = step.result()
                except StopAsyncIteration:
                    return
                step = None
                yield event
        finally:  # cut, finished, or the client left (this generator is closed)
            cut.cancel()
            if step is not None and not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
            await events.aclose()  # aborts the engine requests behind the stream
        yield stream_error_event(OpenAIError(SHUTDOWN_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE))
        yield "data: [DONE]\n\n"


class DrainingServer(uvicorn.Server):
    """uvicorn, with the drain before its own shutdown and an exit code for engine death."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler. Not recorded in `_captured_signals`, which uvicorn re-raises
        after serving: the process would then die of the signal instead of exiting 0."""
        if self._draining is not None or self._loop is None or self.should_exit:
            logger.warning("%s again: exiting without waiting for requests.",
                           signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.drain.run()
        self.should_exit = True

    def exit_for_engine_death(self) -> None:
        """The requests in flight have their error; exit non-zero so a supervisor restarts us."""
        logger.error("Exiting because the engine core process died.")
        self.exit_code = 1
        self.drain.admission.draining = True
        self.should_exit = True
