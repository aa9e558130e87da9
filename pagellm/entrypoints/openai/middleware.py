"""ASGI layers in front of the routes: the API key, the body-size limit, admission.

Each answers in OpenAI's error shape and never reads more of a request than it must.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.drain_budget import DrainBuckets
from pagellm.entrypoints.openai.errors import error_response

# Probes and scrapers: no key, no admission limit, no body.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class APIKeyMiddleware:
    """Every route but the open ones needs `Authorization: Bearer <key>`; the scheme is
    matched case-insensitively (RFC 9110), the key in constant time."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(
                    given.strip().encode(), self.expected):
                response = error_response("Invalid or missing API key; send `Authorization: "
                                          "Bearer <key>`.", HTTPStatus.UNAUTHORIZED)
                await close_if_a_body_follows(response, scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def close_if_a_body_follows(response: Response, scope: Scope) -> Response:
    """An answer sent before the request's body is read closes the connection if a body is
    on its way: kept open, the connection would have uvicorn read and drop all of that body
    first, however large, so a flood of refused 20 MB bodies would cost what served ones do."""
    headers = Headers(scope=scope)
    if (headers.get("content-length", "0") not in ("", "0")
            or "chunked" in headers.get("transfer-encoding", "").lower()):
        response.headers["connection"] = "close"
    return response


class BodyLimitMiddleware:
    """A 413 for a body over `max_bytes`, decided from Content-Length when there is one,
    else while the chunks arrive: the body is read (and buffered) here, then replayed to
    the route, so an oversized one is never held in full nor parsed. Before the 413, the
    rest of an oversized body is read and dropped while the client address's drain budget
    covers it, so that the client, still sending, sees the answer; beyond the budget the
    connection closes with the rest unread."""

    def __init__(self, app: ASGIApp, max_bytes: int, buckets: DrainBuckets | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.buckets = DrainBuckets() if buckets is None else buckets
        self.sleep = sleep

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        length = int(declared) if declared.isdigit() else None
        too_large = length is not None and length > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        more = True
        while more and not too_large:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            too_large = size > self.max_bytes
        if too_large:
            await self._too_large(scope, receive, send, more, length)
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, more: bool,
                         length: int | None) -> None:
        """`more`: whether some of the body is unread."""
        address = (scope.get("client") or ("",))[0]
        if more and self._worth_draining(scope, address, length):
            unread = await self._drain(address, receive)
            if unread is None:
                return  # the client left
            more = unread
        if more and not _waits_for_continue(scope):  # refused by the budget: held a while
            await self.sleep(self.buckets.answer_delay(address, length))
        response = error_response(f"Request body is larger than the server's limit of "
                                  f"{self.max_bytes} bytes (--max-request-body-bytes).",
                                  HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        if more:
            response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)

    def _worth_draining(self, scope: Scope, address: str, length: int | None) -> bool:
        """An undeclared body is drained while the budget lasts. A declared one (`length`,
        none of it read) only if the budget covers all of it, a part being wasted on a
        client that gets a reset anyway; and not if the client waits for `100 Continue`:
        it has sent nothing and will read the 413."""
        if length is None:
            return True
        return not _waits_for_continue(scope) and length <= self.buckets.available(address)

    async def _drain(self, address: str, receive: Receive) -> bool | None:
        """Read and drop the body while `address`'s budget lasts: whether some is left
        unread, None if the client left."""
        more = True
        while more and self.buckets.available(address) > 0:
            message = await receive()
            if message["type"] != "http.request":
                return None
            self.buckets.charge(address, len(message.get("body", b"")))
            more = message.get("more_body", False)
        return more


def _waits_for_continue(scope: Scope) -> bool:
    return Headers(scope=scope).get("expect", "").lower() == "100-continue"


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body as one message, then the real channel (for the disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


@dataclass
class Admission:
    """Requests on the API routes in flight, the limit on them, and whether the server is
    draining (shutting down): then new ones get a 503 and /health turns 503."""

    max_in_flight: int | None = None
    in_flight: int = 0
    draining: bool = False


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, admission: Admission, open_paths: frozenset[str]) -> None:
        self.app = app
        self.admission = admission
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        admission = self.admission
        if admission.draining:
            response = error_response("The server is shutting down.",
                                      HTTPStatus.SERVICE_UNAVAILABLE)
        elif (admission.max_in_flight is not None
              and admission.in_flight >= admission.max_in_flight):
            response = error_response(
                f"Too many requests in flight (the server's limit is {admission.max_in_flight}, "
                "--max-concurrent-requests); retry later.", HTTPStatus.TOO_MANY_REQUESTS)
        else:
            admission.in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                admission.in_flight -= 1
            return
        response.headers["retry-after"] = "1"
        await close_if_a_body_follows(response, scope)(scope, receive, send)
