"""The router's HTTP server: an OpenAI-compatible front for groups of backends.

A request's path: parse the body -> `Policy.decide` (privacy check, the model's rules,
fallbacks) -> `Proxy.forward` (balancer picks a replica, retries, falls back) ->
`RelayResponse` (the backend's answer streamed through as it arrives). Pooled
`httpx.AsyncClient`s carry every upstream call: one for generation, one for probes and
`/tokenize`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from pagellm.logger import init_logger
from pagellm.router.backends import BackendPool
from pagellm.router.balancing import Balancer
from pagellm.router.complexity import ComplexityEstimator
from pagellm.router.config import RouterConfig
from pagellm.router.errors import error_response, install_error_handlers, router_error
from pagellm.router.metrics import RouterMetrics
from pagellm.router.policy import Policy, RouteDecision
from pagellm.router.proxy import ROUTE_HEADER, Proxy
from pagellm.router.relay import until_disconnect

logger = init_logger(__name__)

_CLIENT_CLOSED_REQUEST = 499
# The OpenAI path after the base URL ("/v1" + this), for every route the router forwards.
FORWARDED = {"/v1/chat/completions": "/chat/completions", "/v1/completions": "/completions",
             "/v1/embeddings": "/embeddings"}


@dataclass
class RouterState:
    config: RouterConfig
    client: httpx.AsyncClient      # generation requests
    control: httpx.AsyncClient     # probes and /tokenize
    pool: BackendPool
    balancer: Balancer
    metrics: RouterMetrics
    policy: Policy
    proxy: Proxy


def _state(request: Request) -> RouterState:
    return request.app.state.router


def build_state(config: RouterConfig) -> RouterState:
    # Two pools: httpx scans every pooled connection on each request, so the short control
    # calls are kept off the pool that holds one connection per open stream.
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=512)
    timeout = httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s)
    client = httpx.AsyncClient(limits=limits, timeout=timeout)
    control = httpx.AsyncClient(timeout=config.connect_timeout_s)
    pool = BackendPool(config, control)
    for backend in pool.all():
        backend.config.api_key()   # a missing key fails at start-up, not on the first call
    balancer = Balancer(pool, control)
    metrics = RouterMetrics(pool)
    estimator = ComplexityEstimator(config.complexity, pool, control, metrics.complexity)
    policy = Policy(config, balancer.count_tokens, estimator)
    return RouterState(config, client, control, pool, balancer, metrics, policy,
                       Proxy(pool, balancer, metrics, client))


async def health(request: Request) -> Response:
    pool = _state(request).pool
    if any(pool.available(group) for group in pool.groups):
        return Response(status_code=HTTPStatus.OK)
    return error_response("No backend is available.", HTTPStatus.SERVICE_UNAVAILABLE)


async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


async def list_models(request: Request) -> JSONResponse:
    created = int(time.time())
    return JSONResponse({"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "pagellm-router"}
        for name in _state(request).config.public_models]})


async def _body(request: Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise router_error("Request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise router_error("Request body must be a JSON object.")
    return body


def _log_decision(model: str, decision: RouteDecision) -> None:
    """The decision and nothing of the body: prompts stay out of the router's logs."""
    logger.info("Routed model=%s rule=%s groups=%s sensitive=%s", model, decision.rule,
                ",".join(decision.groups) or "-", decision.sensitive)


async def _decide(state: RouterState, body: dict, headers: dict[str, str]) -> RouteDecision:
    public = state.config.public_models
    model = body.get("model", public[0])
    if model not in public:
        raise router_error(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND)
    info = state.policy.request_info({**body, "model": model}, headers)
    decision = await state.policy.decide(info)
    state.metrics.decisions.labels(model, decision.rule, decision.groups[0] if
                                   decision.groups else "none",
                                   str(decision.sensitive).lower()).inc()
    _log_decision(model, decision)
    return decision


async def forward(request: Request) -> Response:
    """Route and forward; a client that leaves before the answer starts cancels the upstream
    call (afterwards `RelayResponse` watches it)."""
    state = _state(request)
    body = await _body(request)
    headers = {name.lower(): value for name, value in request.headers.items()}
    decision = await _decide(state, body, headers)
    work = asyncio.ensure_future(state.proxy.forward(FORWARDED[request.url.path], body,
                                                     headers, decision))
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work.cancel()
    if work not in done:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    try:
        return work.result()
    except HTTPException as error:
        response = error_response(str(error.detail), HTTPStatus(error.status_code))
        response.headers[ROUTE_HEADER] = decision.header
        return response


def build_app(config: RouterConfig) -> FastAPI:
    state = build_state(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.pool.probe_once()
        state.pool.start()
        try:
            yield
        finally:
            await state.pool.stop()
            await state.client.aclose()
            await state.control.aclose()

    app = FastAPI(title="pagellm router", lifespan=lifespan)
    app.state.router = state
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    for path in FORWARDED:
        app.add_api_route(path, forward, methods=["POST"])
    install_error_handlers(app)
    return app
