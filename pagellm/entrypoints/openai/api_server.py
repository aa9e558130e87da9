"""The OpenAI-compatible HTTP server: FastAPI app factory and `run_server` (uvicorn)."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm import __version__
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.cli_args import ServerSettings
from pagellm.entrypoints.openai.errors import (ENGINE_DEAD_MESSAGE, OpenAIError, error_response,
                                               install_error_handlers)
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, DetokenizeResponse, ModelCard,
                                                 ModelList, TokenizeChatRequest,
                                                 TokenizeCompletionRequest, TokenizeResponse)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.logger import init_logger

logger = init_logger(__name__)

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
_GRACEFUL_SHUTDOWN_SECONDS = 5


@dataclass
class AppState:
    engine: AsyncLLM
    settings: ServerSettings
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization


class APIKeyMiddleware:
    """Every route but the open ones needs `Authorization: Bearer <key>` (constant-time check)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                response = error_response("Invalid or missing API key; send `Authorization: "
                                          "Bearer <key>`.", HTTPStatus.UNAUTHORIZED)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _state(raw_request: Request) -> AppState:
    return raw_request.app.state.pagellm


async def _until_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _respond(raw_request: Request,
                   call: Coroutine[Any, Any, BaseModel | AsyncIterator[str]]) -> Response:
    """Run a request; a client that leaves first gets its engine requests aborted."""
    if _state(raw_request).engine.errored:
        call.close()
        raise OpenAIError(ENGINE_DEAD_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE)
    work = asyncio.ensure_future(call)
    watcher = asyncio.ensure_future(_until_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work.cancel()  # a no-op once it is done
    if work not in done:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    result = work.result()
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream")


async def health(raw_request: Request) -> Response:
    if _state(raw_request).engine.errored:
        return error_response(ENGINE_DEAD_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=HTTPStatus.OK)


async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def list_models(raw_request: Request) -> ModelList:
    state = _state(raw_request)
    root = state.settings.engine_args.model or state.settings.model_names[0]
    return ModelList(data=[ModelCard(id=name, root=root,
                                     max_model_len=state.engine.info.max_model_len)
                           for name in state.settings.model_names])


async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return await _respond(raw_request, _state(raw_request).completion.create_completion(request))


async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    return await _respond(raw_request, _state(raw_request).chat.create_chat_completion(request))


async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest,
                   raw_request: Request) -> TokenizeResponse:
    return _state(raw_request).tokenization.tokenize(request)


async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    return _state(raw_request).tokenization.detokenize(request)


ROUTES: list[tuple[str, str, Callable[..., Awaitable[Any]]]] = [
    ("GET", "/health", health), ("GET", "/version", version), ("GET", "/metrics", metrics),
    ("GET", "/v1/models", list_models), ("POST", "/v1/completions", create_completion),
    ("POST", "/v1/chat/completions", create_chat_completion), ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
]


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="pagellm", version=__version__)
    serving_args = (engine, settings.model_names, settings.log_requests)
    app.state.pagellm = AppState(engine, settings, OpenAIServingCompletion(*serving_args),
                                 OpenAIServingChat(*serving_args, tools=settings.tools),
                                 OpenAIServingTokenization(*serving_args))
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second, not after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def log_routes(app: FastAPI, settings: ServerSettings) -> None:
    logger.info("Starting pagellm API server on http://%s:%d", settings.host, settings.port)
    logger.info("Available routes are:")
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods:
            logger.info("Route: %s, Methods: %s", getattr(route, "path", "?"),
                        ", ".join(sorted(methods)))


async def serve(settings: ServerSettings, sock: socket.socket) -> None:
    engine = AsyncLLM.from_engine_args(settings.engine_args, log_stats=settings.log_stats)
    try:
        app = build_app(engine, settings)
        log_routes(app, settings)
        config = uvicorn.Config(app, host=settings.host, port=settings.port,
                                log_level=settings.uvicorn_log_level,
                                timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_SECONDS)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        engine.shutdown()


def run_server(args: argparse.Namespace) -> None:
    settings = ServerSettings.from_args(args)
    sock = bind_socket(settings.host, settings.port)
    try:
        asyncio.run(serve(settings, sock))
    finally:
        sock.close()
