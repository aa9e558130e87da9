"""Sending a routed request upstream: pick a replica, retry, fall back, relay the answer.

The proxy walks the decision's groups in order (the target, then its allowed fallbacks)
and, within a group, its replicas as the balancer ranks them, within one retry budget for
the whole request. A backend that refuses the connection, answers 5xx or 429, or fails
before its first chunk is counted as a failure and the request moves on: nothing has reached
the client yet, so the retry is invisible. Once a chunk is relayed, the request is the
backend's. A sensitive request is checked against each backend's `local` flag right
before sending, a second lock behind the policy's candidate list.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httpx
from fastapi.responses import Response

from pagellm.logger import init_logger
from pagellm.router.backends import Backend, BackendPool
from pagellm.router.balancing import Affinity, Balancer
from pagellm.router.errors import router_error
from pagellm.router.metrics import RouterMetrics
from pagellm.router.policy import RouteDecision
from pagellm.router.relay import RelayResponse

logger = init_logger(__name__)

_RETRYABLE = frozenset({429, 500, 502, 503, 504})
ROUTE_HEADER = "x-pagellm-route"
BACKEND_HEADER = "x-pagellm-backend"


@dataclass
class Upstream:
    """One attempt's answer, its first chunk read (or the reason it failed)."""

    response: httpx.Response | None
    first: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    failure: str | None = None


class Proxy:
    def __init__(self, pool: BackendPool, balancer: Balancer, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.balancer = balancer
        self.metrics = metrics
        self.client = client

    async def forward(self, path: str, body: dict[str, Any], headers: dict[str, str],
                      decision: RouteDecision) -> Response:
        """`path` is the OpenAI path after the base URL, e.g. "/chat/completions"."""
        budget = self.pool.config.retry_budget
        first_group = decision.groups[0] if decision.groups else None
        for group in decision.groups:
            if budget <= 0:
                break
            if group != first_group:
                self.metrics.fallbacks.labels(first_group, group).inc()
            upstream_body = {**body, "model": self.pool.group_config(group).model}
            affinity = await self.balancer.affinity(group, upstream_body, headers)
            tried: set[str] = set()
            while budget > 0:
                backend = self.balancer.pick(group, affinity, tried)
                if backend is None:
                    break
                tried.add(backend.name)
                if decision.sensitive and not backend.local:
                    logger.error("Refused to send a sensitive request to non-local backend %s",
                                 backend.name)
                    continue
                budget -= 1
                response = await self._attempt(backend, path, upstream_body, affinity,
                                               decision, group)
                if response is not None:
                    return response
                self.metrics.retries.labels(group).inc()
        return self._unavailable(decision)

    def _unavailable(self, decision: RouteDecision) -> Response:
        if decision.sensitive:
            self.metrics.rejected.labels("no_local_backend").inc()
            message = ("This request contains customer data and may only be served by a local "
                       "model, but no local backend is available; it was not sent elsewhere.")
        else:
            self.metrics.rejected.labels("no_backend").inc()
            message = "No backend could serve this request; try again later."
        raise router_error(message, HTTPStatus.SERVICE_UNAVAILABLE)

    def _request(self, backend: Backend, path: str, body: dict[str, Any]) -> httpx.Request:
        headers = {"content-type": "application/json", "accept": "application/json, "
                   "text/event-stream"}
        key = backend.config.api_key()
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return self.client.build_request("POST", backend.config.url + path, headers=headers,
                                         content=json.dumps(body).encode())

    async def _open(self, backend: Backend, request: httpx.Request) -> Upstream:
        """Send, and read up to the first chunk, so a failure so far can still be retried."""
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            return Upstream(None, failure=f"{type(error).__name__}: {error}")
        try:
            if response.status_code in _RETRYABLE:
                await response.aclose()
                return Upstream(None, failure=f"HTTP {response.status_code}")
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
        except httpx.HTTPError as error:
            await response.aclose()
            return Upstream(None, failure=f"{type(error).__name__} before the first chunk")
        except BaseException:  # the client left while the backend was still silent
            await asyncio.shield(response.aclose())
            raise
        return Upstream(response, first, chunks)

    async def _attempt(self, backend: Backend, path: str, body: dict[str, Any],
                       affinity: Affinity, decision: RouteDecision,
                       group: str) -> Response | None:
        request = self._request(backend, path, body)
        self.balancer.sent(backend)
        handed_over = False
        try:
            upstream = await self._open(backend, request)
            if upstream.response is None:
                self.metrics.responses.labels(backend.name, "failed").inc()
                logger.warning("Backend %s failed (%s); %s", backend.name, upstream.failure,
                               "retrying elsewhere" if not decision.sensitive else
                               "retrying on another local backend")
                self.pool.fail(backend, upstream.failure or "")
                return None
            response = upstream.response
            self.metrics.responses.labels(backend.name, str(response.status_code)).inc()
            if response.status_code < 400:
                backend.record_success()
                self._record_prefix(group, backend, affinity)

            def done(outcome: str) -> None:
                self.balancer.finished(backend)
                if outcome == "broken":
                    self.pool.fail(backend, "stream broke")

            headers = {ROUTE_HEADER: decision.header, BACKEND_HEADER: backend.name}
            relay = RelayResponse(response, upstream.first, upstream.chunks, headers, done)
            handed_over = True
            return relay
        finally:
            if not handed_over:
                self.balancer.finished(backend)

    def _record_prefix(self, group: str, backend: Backend, affinity: Affinity) -> None:
        self.balancer.served(backend, affinity)
        if affinity.hashes:
            self.metrics.prefix_queried.labels(group).inc(len(affinity.hashes))
            self.metrics.prefix_matched.labels(group).inc(affinity.matched.get(backend.name, 0))
