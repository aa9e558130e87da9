"""Relaying an upstream answer to the client, chunk by chunk, as it arrives.

Each chunk read from the backend is written to the client at once (no buffering, no
re-framing of the SSE events). The client connection is watched at the same time: when
the client leaves, the upstream response is closed, which closes its connection and makes
the backend abort the request and free its KV blocks, instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pagellm.logger import init_logger

logger = init_logger(__name__)

# The error event a stream ends with when its backend fails after the first chunk.
STREAM_BROKEN = (b'data: {"error": {"message": "The backend failed while streaming the answer.",'
                 b' "type": "ServiceUnavailableError", "param": null, "code": 503}}\n\n')


async def until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """The backend's status and body, with the router's own headers, streamed through."""

    def __init__(self, upstream: httpx.Response, first: bytes, chunks: AsyncIterator[bytes],
                 headers: dict[str, str], on_done: Callable[[str], None]) -> None:
        super().__init__(status_code=upstream.status_code, headers=headers,
                         media_type=upstream.headers.get("content-type"))
        # the length is the backend's business: the body is relayed as it comes
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.upstream = upstream
        self.first = first
        self.chunks = chunks
        self.on_done = on_done   # called once with "complete", "disconnected" or "broken"
        self.outcome = "complete"

    async def _pump(self, send: Send) -> None:
        if self.first:
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as error:
            logger.warning("Backend stream broke after the first chunk: %s",
                           type(error).__name__)
            self.outcome = "broken"
            if self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                await send({"type": "http.response.body", "body": STREAM_BROKEN,
                            "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watch = asyncio.ensure_future(until_disconnect(receive))
            try:
                done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
                # the client left, or its socket failed under a send
                if pump not in done or pump.exception() is not None:
                    self.outcome = "disconnected"
            finally:
                pump.cancel()
                watch.cancel()
                await asyncio.gather(pump, watch, return_exceptions=True)
        finally:
            await asyncio.shield(self.upstream.aclose())
            self.on_done(self.outcome)
