"""`pagellm rag serve`: retrieval as HTTP steps, and RAG chat completions in one call.

For a KServe `InferenceGraph`, whose Sequence router passes each step only the previous
step's response (or the original request), the useful step is `/wrapper/retrieve`: it
takes the user's chat-completions request, retrieves, and answers a ready
`/v1/chat/completions` body with the context inserted, so `retriever -> llm` is a
two-step Sequence with stock KServe. `/wrapper/embeddings` and `/wrapper/query` are the
same work split in two (embed, then search), each echoing the question onward.

`/v1/chat/completions` retrieves and asks the LLM server itself (streaming or not);
the answer carries its `sources`. If retrieval fails (Qdrant or the embeddings server
unreachable), `--on-retrieval-error soft` answers without context and says so in the
`x-rag-context: unavailable` header; `hard` answers 503, like a graph's Hard dependency.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.openai.errors import error_response
from pagellm.logger import init_logger
from pagellm.rag.embedder import Embedder, EmbeddingError
from pagellm.rag.retriever import Retriever, question_of, sources_of, with_context
from pagellm.rag.store import Hit, StoreError, VectorStore

logger = init_logger(__name__)
CONTEXT_HEADER, SOURCES_HEADER = "x-rag-context", "x-rag-sources"
_RETRIEVAL_ERRORS = (StoreError, httpx.HTTPError, EmbeddingError)


@dataclass
class ServiceSettings:
    llm_url: str | None
    llm_api_key: str | None
    top_k: int
    on_error: str  # soft | hard


class RetrievalFailed(Exception):
    pass


class RagService:
    def __init__(self, retriever: Retriever, settings: ServiceSettings) -> None:
        self.retriever = retriever
        self.settings = settings
        headers = ({"Authorization": f"Bearer {settings.llm_api_key}"}
                   if settings.llm_api_key else {})
        self.llm = httpx.AsyncClient(base_url=(settings.llm_url or "").rstrip("/"),
                                     headers=headers, timeout=httpx.Timeout(600, connect=10))

    async def retrieve(self, question: str, top_k: int | None = None) -> list[Hit] | None:
        """The hits; None when retrieval failed and the service is soft about it."""
        try:
            return await self.retriever.aretrieve(question, top_k)
        except _RETRIEVAL_ERRORS as error:
            logger.warning("Retrieval failed: %s", error)
            if self.settings.on_error == "hard":
                raise RetrievalFailed(f"Retrieval is unavailable: {error}") from None
            return None

    def context_headers(self, hits: list[Hit] | None) -> dict[str, str]:
        if hits is None:
            return {CONTEXT_HEADER: "unavailable"}
        return {CONTEXT_HEADER: "inserted" if hits else "none",
                SOURCES_HEADER: json.dumps(sources_of(hits))}


def _state(request: Request) -> RagService:
    return request.app.state.rag


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ValueError("Request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ValueError("Request body must be a JSON object.")
    return body


def _top_k(body: dict[str, Any]) -> int | None:
    value = body.get("top_k")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise ValueError("top_k must be a positive integer.")
    return value


async def wrapper_embeddings(request: Request) -> JSONResponse:
    """`{"input": text}` or a chat body -> the query's embedding, the query echoed."""
    body = await _json(request)
    query = body["input"] if isinstance(body.get("input"), str) else question_of(body)
    vector = (await _state(request).retriever.embedder.aembed([query], truncate=True))[0]
    return JSONResponse({"object": "list", "query": query, "top_k": _top_k(body),
                         "data": [{"index": 0, "object": "embedding", "embedding": vector}]})


async def wrapper_query(request: Request) -> JSONResponse:
    """`/wrapper/embeddings`' answer (or `{"query": text}`) -> the closest chunks."""
    body = await _json(request)
    service = _state(request)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ValueError("query must be a non-empty string.")
    data = body.get("data")
    top_k = _top_k(body)
    if isinstance(data, list) and data and isinstance(data[0], dict) and "embedding" in data[0]:
        retriever = service.retriever
        hits = retriever.store.query(retriever.collection, data[0]["embedding"],
                                     top_k or retriever.top_k)
    else:
        hits = await service.retriever.aretrieve(query, top_k)
    return JSONResponse({"query": query, "results": [
        {**source, "text": hit.text, "metadata": hit.metadata}
        for source, hit in zip(sources_of(hits), hits)]})


async def wrapper_retrieve(request: Request) -> Response:
    """A chat-completions body -> the same body with the retrieved context inserted."""
    body = await _json(request)
    service = _state(request)
    hits = await service.retrieve(question_of(body), _top_k(body))
    out = with_context(body, hits or [])
    out.pop("top_k", None)
    return JSONResponse(out, headers=service.context_headers(hits))


async def chat_completions(request: Request) -> Response:
    """Retrieve, then generate with the LLM server; `sources` in the answer."""
    body = await _json(request)
    service = _state(request)
    if not service.settings.llm_url:
        return error_response("This service has no --llm-url to generate with; use "
                              "/wrapper/retrieve to get a body for your LLM.",
                              HTTPStatus.NOT_IMPLEMENTED)
    hits = await service.retrieve(question_of(body), _top_k(body))
    upstream = with_context(body, hits or [])
    upstream.pop("top_k", None)
    sources = sources_of(hits or [])
    headers = service.context_headers(hits)
    if not body.get("stream"):
        answer = await service.llm.post("/v1/chat/completions", json=upstream)
        content = answer.json()
        if answer.status_code == 200:
            content["sources"] = sources
        return JSONResponse(content, status_code=answer.status_code, headers=headers)
    request_ = service.llm.build_request("POST", "/v1/chat/completions", json=upstream)
    response = await service.llm.send(request_, stream=True)
    if response.status_code != 200:
        content = await response.aread()
        await response.aclose()
        return Response(content, status_code=response.status_code,
                        media_type="application/json", headers=headers)
    return StreamingResponse(_with_sources(response, sources), media_type="text/event-stream",
                             headers=headers)


async def _with_sources(response: httpx.Response, sources: list[dict]) -> AsyncIterator[str]:
    """The LLM's events as they come, the first chunk carrying `sources`."""
    first = True
    try:
        async for line in response.aiter_lines():
            if first and line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                chunk["sources"] = sources
                line, first = "data: " + json.dumps(chunk), False
            if line:
                yield line + "\n\n"
    finally:
        await response.aclose()


async def health() -> Response:
    return Response(status_code=HTTPStatus.OK)


def build_service_app(service: RagService) -> FastAPI:
    app = FastAPI(title="pagellm rag")
    app.state.rag = service
    app.add_api_route("/health", health, methods=["GET"])
    for path, endpoint in (("/wrapper/embeddings", wrapper_embeddings),
                           ("/wrapper/query", wrapper_query),
                           ("/wrapper/retrieve", wrapper_retrieve),
                           ("/v1/chat/completions", chat_completions)):
        app.add_api_route(path, endpoint, methods=["POST"])

    @app.exception_handler(RetrievalFailed)
    async def unavailable(_: Request, error: RetrievalFailed) -> JSONResponse:
        return error_response(str(error), HTTPStatus.SERVICE_UNAVAILABLE)

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, error: ValueError) -> JSONResponse:
        return error_response(str(error), HTTPStatus.BAD_REQUEST)

    @app.exception_handler(httpx.HTTPError)
    async def llm_down(_: Request, error: httpx.HTTPError) -> JSONResponse:
        return error_response(f"The LLM server did not answer: {error}", HTTPStatus.BAD_GATEWAY)

    @app.exception_handler(StoreError)
    async def store_down(_: Request, error: StoreError) -> JSONResponse:
        return error_response(str(error), HTTPStatus.SERVICE_UNAVAILABLE)

    return app


def run_service(args: argparse.Namespace, store: VectorStore, embedder: Embedder) -> None:
    settings = ServiceSettings(args.llm_url, args.llm_api_key, args.top_k,
                               args.on_retrieval_error)
    retriever = Retriever(store, embedder, args.collection, args.top_k)
    app = build_service_app(RagService(retriever, settings))
    logger.info("pagellm rag serve: collection %r in %s, LLM %s, retrieval errors %s; "
                "listening on http://%s:%d", args.collection, store.settings.describe(),
                args.llm_url or "(none)", args.on_retrieval_error, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
