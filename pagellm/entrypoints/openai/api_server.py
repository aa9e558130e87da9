"""The OpenAI-compatible HTTP server: FastAPI app factory and `run_server` (uvicorn)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from pydantic import BaseModel

from pagellm import __version__
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.client_hub import FrontEndPlace
from pagellm.entrypoints.openai.cli_args import ServerSettings
from pagellm.entrypoints.openai.errors import (ENGINE_DEAD_MESSAGE, OpenAIError,
                                               documented_errors, error_response,
                                               install_error_handlers, to_openai_error)
from pagellm.entrypoints.openai.frontend import (PUBLIC_PATHS, add_engine_stats, add_playground,
                                                 ready_line)
from pagellm.entrypoints.openai.lifecycle import SHUTDOWN_MESSAGE, Drain, DrainingServer
from pagellm.entrypoints.openai.middleware import (OPEN_PATHS, Admission, AdmissionMiddleware,
                                                   APIKeyMiddleware, BodyLimitMiddleware)
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, DetokenizeResponse, ModelCard,
                                                 ModelList, TokenizeChatRequest,
                                                 TokenizeCompletionRequest, TokenizeResponse)
from pagellm.entrypoints.openai.responses.objects import ResponseObject
from pagellm.entrypoints.openai.responses.protocol import ResponsesRequest
from pagellm.entrypoints.openai.responses.serving import DeletedResponse, OpenAIServingResponses
from pagellm.entrypoints.openai.responses.store import ResponseStore
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_lora import LoRAAdapters, add_lora_routes
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.logger import init_logger
from pagellm.structured_outputs.backend import import_backends_in_background

logger = init_logger(__name__)

# KServe's own OpenAI runtime answers under this prefix (its KSERVE_OPENAI_ROUTE_PREFIX), so
# the /v1 routes answer there too: KServe clients and InferenceGraph steps call either alike.
KSERVE_OPENAI_PREFIX = "/openai"
_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer
# After the drain (or engine death), how long uvicorn waits for connections to close.
_UVICORN_SHUTDOWN_SECONDS = 5


@dataclass
class AppState:
    engine: AsyncLLM
    settings: ServerSettings
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    tokenization: OpenAIServingTokenization
    admission: Admission
    drain: Drain
    lora: LoRAAdapters | None = None  # with --enable-lora
    metrics_registry: CollectorRegistry = REGISTRY  # every process's, with several front ends


def _state(raw_request: Request) -> AppState:
    return raw_request.app.state.pagellm


async def _until_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def _respond(raw_request: Request,
                   call: Coroutine[Any, Any, BaseModel | AsyncIterator[str]]) -> Response:
    """Run a request; a client that leaves first gets its engine requests aborted, and so
    does one still running when a shutdown's timeout ends it (a 503)."""
    state = _state(raw_request)
    if state.engine.errored:
        call.close()
        raise OpenAIError(ENGINE_DEAD_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE)
    work = asyncio.ensure_future(call)
    watcher = asyncio.ensure_future(_until_disconnect(raw_request))
    cut = asyncio.ensure_future(state.drain.cut.wait())
    try:
        done, _ = await asyncio.wait({work, watcher, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watcher, cut, work):
            task.cancel()  # a no-op once it is done
    if work not in done:
        await asyncio.gather(work, return_exceptions=True)  # its engine requests are aborted
        if cut in done:
            raise OpenAIError(SHUTDOWN_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
    result = work.result()
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(state.drain.until_cut(result), media_type="text/event-stream")


def _guarded(endpoint: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Any error becomes an OpenAI-shaped answer here, inside the route, so that even a 500
    leaves the connection usable (past this point Starlette would drop it)."""

    @functools.wraps(endpoint)
    async def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return await endpoint(*args, **kwargs)
        except Exception as error:
            converted = to_openai_error(error)
            return error_response(converted.message, converted.status, converted.param)

    return guarded


async def health(raw_request: Request) -> Response:
    """200 while the engine runs; 503 once its process has died or while the server drains."""
    state = _state(raw_request)
    if state.engine.errored:
        return error_response(ENGINE_DEAD_MESSAGE, HTTPStatus.SERVICE_UNAVAILABLE)
    if state.admission.draining:
        return error_response("The server is shutting down.", HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=HTTPStatus.OK)


async def version() -> JSONResponse:
    """The pagellm version."""
    return JSONResponse({"version": __version__})


async def metrics(raw_request: Request) -> Response:
    """Prometheus text with vLLM's `vllm:` metric names."""
    return Response(generate_latest(_state(raw_request).metrics_registry),
                    media_type=CONTENT_TYPE_LATEST)


async def kv_cache(raw_request: Request) -> JSONResponse:
    """KV blocks in use and the block pool's integrity check (soak tests: 0 leaked blocks)."""
    report = await _state(raw_request).engine.check_kv_cache()
    return JSONResponse(dataclasses.asdict(report))


async def list_models(raw_request: Request) -> ModelList:
    """The served model names, with their context length, then the LoRA adapters."""
    state = _state(raw_request)
    root = state.settings.engine_args.model or state.settings.model_names[0]
    max_model_len = state.engine.info.max_model_len
    adapters = state.lora.model_cards(max_model_len) if state.lora is not None else []
    return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_model_len)
                           for name in state.settings.model_names] + adapters)


async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    """OpenAI's text completions, streamed as Server-Sent Events with `stream: true`."""
    return await _respond(raw_request, _state(raw_request).completion.create_completion(request))


async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    """OpenAI's chat completions, streamed as Server-Sent Events with `stream: true`."""
    return await _respond(raw_request, _state(raw_request).chat.create_chat_completion(request))


async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    """OpenAI's Responses API; `stream: true` sends its typed events."""
    return await _respond(raw_request, _state(raw_request).responses.create(request))


async def retrieve_response(response_id: str, raw_request: Request) -> ResponseObject:
    """A stored response (`store: true`, OpenAI's default), while the bounded store keeps it."""
    return _state(raw_request).responses.retrieve(response_id)


async def delete_response(response_id: str, raw_request: Request) -> DeletedResponse:
    """Forget a stored response."""
    return _state(raw_request).responses.delete(response_id)


async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest,
                   raw_request: Request) -> TokenizeResponse:
    """A prompt or chat messages to token ids, as the completion routes would see them."""
    return await _state(raw_request).tokenization.tokenize(request)


async def detokenize(request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
    """Token ids to text."""
    return await _state(raw_request).tokenization.detokenize(request)


ROUTES: list[tuple[str, str, Callable[..., Awaitable[Any]]]] = [
    ("GET", "/health", health), ("GET", "/version", version), ("GET", "/metrics", metrics),
    ("GET", "/v1/models", list_models), ("POST", "/v1/completions", create_completion),
    ("POST", "/v1/chat/completions", create_chat_completion),
    ("POST", "/v1/responses", create_response), ("GET", "/v1/responses/{response_id}",
                                                 retrieve_response),
    ("DELETE", "/v1/responses/{response_id}", delete_response), ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize), ("GET", "/debug/kv-cache", kv_cache),
]


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pagellm", version=__version__, **docs)
    serving_args = (engine, settings.model_names, settings.log_requests)
    admission = Admission(settings.limits.max_concurrent_requests)
    chat = OpenAIServingChat(*serving_args, tools=settings.tools)
    responses = OpenAIServingResponses(chat, ResponseStore(settings.limits.responses_store_size))
    app.state.pagellm = AppState(engine, settings, OpenAIServingCompletion(*serving_args), chat,
                                 responses, OpenAIServingTokenization(*serving_args), admission,
                                 Drain(admission, settings.limits.shutdown_timeout))
    if settings.engine_args.enable_lora:
        lora = app.state.pagellm.lora = LoRAAdapters(engine, settings.lora,
                                                     settings.model_names)
        if settings.lora.runtime_updating:
            add_lora_routes(app, lora)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, _guarded(endpoint), methods=[method],
                          responses=documented_errors(method, path))
        if path.startswith("/v1/"):
            app.add_api_route(KSERVE_OPENAI_PREFIX + path, _guarded(endpoint), methods=[method],
                              responses=documented_errors(method, path))
    add_engine_stats(app, engine)
    if settings.frontend:
        add_playground(app)
    install_error_handlers(app)
    add_middleware(app, settings, admission)
    return app


def add_middleware(app: FastAPI, settings: ServerSettings, admission: Admission) -> None:
    """Outermost first: CORS, the API key, admission (limit, drain), the body-size limit."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_request_body_bytes)
    app.add_middleware(AdmissionMiddleware, admission=admission, open_paths=OPEN_PATHS)
    if settings.api_key:
        open_paths = OPEN_PATHS - {"/metrics"} if settings.metrics_need_key else OPEN_PATHS
        if settings.frontend:
            open_paths |= PUBLIC_PATHS
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, open_paths=open_paths)
    if settings.cors is not None:
        cors = settings.cors
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods,
                           allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)


def log_routes(app: FastAPI, settings: ServerSettings) -> None:
    scheme = "https" if settings.ssl_certfile else "http"
    logger.info("Starting pagellm API server on %s://%s:%d", scheme, settings.host,
                settings.port)
    logger.info("Available routes are:")
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods:
            logger.info("Route: %s, Methods: %s", getattr(route, "path", "?"),
                        ", ".join(sorted(methods)))


class _Server(DrainingServer):
    """Says where to point a browser and an SDK once the socket accepts requests."""

    def __init__(self, config: uvicorn.Config, drain: Drain, settings: ServerSettings) -> None:
        super().__init__(config, drain)
        self.settings = settings

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            logger.info(ready_line(self.settings.host, self.settings.port,
                                   self.settings.frontend))
            import_backends_in_background()


async def serve(settings: ServerSettings, sock: socket.socket, engine: AsyncLLM,
                front_end: FrontEndPlace | None = None) -> int:
    """Serve until SIGTERM (exit code 0, after the drain) or engine death (1). `engine` may
    still be loading (launch.py); it is waited for here. `front_end`: this is one of several
    API server processes (api_servers.py)."""
    try:
        engine.wait_ready()
        app = build_app(engine, settings)
        if front_end is not None:
            from pagellm.entrypoints.openai.api_servers import adapt_app

            adapt_app(app, front_end)
        if app.state.pagellm.lora is not None:
            await app.state.pagellm.lora.load_modules()
        if front_end is None or front_end.index == 0:
            log_routes(app, settings)
        config = uvicorn.Config(app, host=settings.host, port=settings.port,
                                log_level=settings.uvicorn_log_level,
                                ssl_keyfile=settings.ssl_keyfile,
                                ssl_certfile=settings.ssl_certfile,
                                timeout_graceful_shutdown=_UVICORN_SHUTDOWN_SECONDS)
        server = _Server(config, app.state.pagellm.drain, settings)
        engine.on_death(server.exit_for_engine_death)
        await server.serve(sockets=[sock])
        return server.exit_code
    finally:
        engine.shutdown()
