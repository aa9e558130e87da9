"""The server of an embedding model (`--runner pooling`): the pooling routes on the same
middleware, health, drain and error handling as the generation server."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import REGISTRY, CollectorRegistry

from pagellm import __version__
from pagellm.entrypoints.openai import api_server
from pagellm.entrypoints.openai.cli_args import ServerSettings
from pagellm.entrypoints.openai.errors import documented_errors, install_error_handlers
from pagellm.entrypoints.openai.lifecycle import Drain
from pagellm.entrypoints.openai.middleware import Admission
from pagellm.entrypoints.openai.pooling_protocol import (EmbeddingRequest, RerankRequest,
                                                         ScoreRequest)
from pagellm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagellm.pooling.engine import AsyncPoolingEngine


@dataclass
class PoolingAppState:
    """What the shared routes (health, models, the drain) read, as `api_server.AppState`."""

    engine: AsyncPoolingEngine
    settings: ServerSettings
    pooling: OpenAIServingPooling
    admission: Admission
    drain: Drain
    metrics_registry: CollectorRegistry = REGISTRY


def _pooling(raw_request: Request) -> OpenAIServingPooling:
    return raw_request.app.state.pagellm.pooling


async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
    """OpenAI's embeddings, with vLLM's truncate_prompt_tokens and add_special_tokens."""
    return await api_server._respond(raw_request,
                                     _pooling(raw_request).create_embedding(request))


async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
    """Cosine similarity of text_1 with each text_2 (vLLM's /score)."""
    return await api_server._respond(raw_request, _pooling(raw_request).create_score(request))


async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
    """Documents ordered by similarity to the query (Jina's and Cohere's rerank shape)."""
    return await api_server._respond(raw_request, _pooling(raw_request).create_rerank(request))


ROUTES: list[tuple[str, str, Callable[..., Awaitable[Any]]]] = [
    ("GET", "/health", api_server.health), ("GET", "/version", api_server.version),
    ("GET", "/metrics", api_server.metrics), ("GET", "/v1/models", api_server.list_models),
    ("POST", "/v1/embeddings", create_embedding), ("POST", "/score", create_score),
    ("POST", "/v1/score", create_score), ("POST", "/rerank", create_rerank),
    ("POST", "/v1/rerank", create_rerank), ("POST", "/v2/rerank", create_rerank),
]


def build_pooling_app(engine: AsyncPoolingEngine, settings: ServerSettings) -> FastAPI:
    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagellm (pooling)", version=__version__, **docs)
    admission = Admission(settings.limits.max_concurrent_requests)
    app.state.pagellm = PoolingAppState(engine, settings,
                                        OpenAIServingPooling(engine, settings.model_names),
                                        admission,
                                        Drain(admission, settings.limits.shutdown_timeout))
    for method, path, endpoint in ROUTES:
        paths = [path]
        if path.startswith("/v1/"):
            paths.append(api_server.KSERVE_OPENAI_PREFIX + path)
        for route in paths:
            app.add_api_route(route, api_server._guarded(endpoint), methods=[method],
                              responses=documented_errors(method, path))
    install_error_handlers(app)
    api_server.add_middleware(app, settings, admission)
    return app


async def serve_pooling(settings: ServerSettings, sock: socket.socket) -> int:
    """Serve an embedding model until SIGTERM (0, after the drain); no web playground."""
    settings = dataclasses.replace(settings, frontend=False)
    engine = AsyncPoolingEngine(settings.engine_args)
    try:
        app = build_pooling_app(engine, settings)
        api_server.log_routes(app, settings)
        config = uvicorn.Config(app, host=settings.host, port=settings.port,
                                log_level=settings.uvicorn_log_level,
                                ssl_keyfile=settings.ssl_keyfile,
                                ssl_certfile=settings.ssl_certfile,
                                timeout_graceful_shutdown=api_server._UVICORN_SHUTDOWN_SECONDS)
        server = api_server._Server(config, app.state.pagellm.drain, settings)
        await server.serve(sockets=[sock])
        return server.exit_code
    finally:
        engine.shutdown()
