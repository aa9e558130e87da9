"""A tiny in-process OpenAI-compatible server for the `bench serve` and router tests.

Word-level tokenizer (one token per whitespace-separated word), `/v1/models`, `/tokenize`
(prompt or messages), `/detokenize`, `/health`, `/metrics` (vLLM's load gauges),
`/v1/embeddings`, and completions/chat completions that stream one ` tok` chunk per
requested token with a fixed small sleep (or answer in one JSON body without `stream`).
It records every request body and its headers, its peak number of concurrent streams and
the streams cut short by the client, and can fail every k-th generation request with a
vLLM-style 400, answer every one with a status, hold the first chunk back, or break the
connection after some chunks (a replica dying mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from server_utils import free_port

MODEL_ID = "fake-model"
FAILURE_MESSAGE = "fake failure: this request was rejected"


class WordTokenizer:
    """One token per whitespace-separated word; ids assigned on first sight."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
        return [self.ids[word] for word in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


@dataclass
class FakeBehaviour:
    chunk_delay_s: float = 0.002
    send_usage: bool = True
    fail_every: int = 0
    fail_status: int = 0          # answer every generation request with this status
    first_chunk_delay_s: float = 0.0
    break_after_chunks: int = -1  # drop the connection after this many chunks
    healthy: bool = True          # /health answers 200, else 503
    waiting: int = 0              # added to vllm:num_requests_waiting in /metrics


@dataclass
class FakeState:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    tokenized: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0
    peak: int = 0
    cut_short: int = 0            # streams the client left before their end


class _BrokenStream(Exception):
    """Raised inside a stream to make the server drop the connection."""


class FakeOpenAIServer:
    def __init__(self, model_id: str = MODEL_ID, port: int | None = None) -> None:
        self.model_id = model_id
        self.tokenizer = WordTokenizer()
        self.state = FakeState()
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def reset(self, **behaviour: Any) -> None:
        self.state = FakeState(behaviour=FakeBehaviour(**behaviour))

    def _app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": self.model_id}]})
        app.get("/health")(self._health)
        app.get("/metrics")(self._metrics)
        app.post("/tokenize")(self._tokenize)
        app.post("/detokenize")(self._detokenize)
        app.post("/v1/completions")(self._generate)
        app.post("/v1/chat/completions")(self._generate)
        app.post("/v1/embeddings")(self._embeddings)
        return app

    def _health(self) -> Response:
        return Response(status_code=200 if self.state.behaviour.healthy else 503)

    def _metrics(self) -> Response:
        label = f'{{model_name="{self.model_id}"}}'
        text = (f"vllm:num_requests_running{label} {float(self.state.active)}\n"
                f"vllm:num_requests_waiting{label} {float(self.state.behaviour.waiting)}\n"
                f"vllm:kv_cache_usage_perc{label} 0.0\n")
        return Response(text, media_type="text/plain")

    async def _tokenize(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.state.tokenized.append(body)
        text = body["prompt"] if "prompt" in body else " ".join(
            f"<{m['role']}> {m['content']}" for m in body["messages"])
        tokens = self.tokenizer.encode(text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    async def _detokenize(self, request: Request) -> dict[str, Any]:
        return {"prompt": self.tokenizer.decode((await request.json())["tokens"])}

    def _record(self, request: Request, body: dict[str, Any]) -> JSONResponse | None:
        """Log the request; the failure to answer with, if the behaviour asks for one."""
        state = self.state
        state.bodies.append(body)
        state.paths.append(request.url.path)
        state.headers.append({k.lower(): v for k, v in request.headers.items()})
        every, status = state.behaviour.fail_every, state.behaviour.fail_status
        if status or (every and len(state.bodies) % every == 0):
            status = status or 400
            error = {"message": FAILURE_MESSAGE, "type": "BadRequestError", "param": None,
                     "code": status}
            return JSONResponse({"error": error}, status_code=status)
        return None

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        state = self.state
        failure = self._record(request, body)
        if failure is not None:
            return failure
        chat = request.url.path.endswith("/chat/completions")
        count = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if not body.get("stream"):
            await asyncio.sleep(state.behaviour.first_chunk_delay_s)
            return JSONResponse(_full_answer(self.model_id, chat, count))
        return StreamingResponse(self._stream(state, body, chat, count),
                                 media_type="text/event-stream")

    async def _embeddings(self, request: Request) -> Response:
        body = await request.json()
        failure = self._record(request, body)
        if failure is not None:
            return failure
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [{"object": "embedding", "index": i, "embedding": [float(len(str(text))), 1.0]}
                for i, text in enumerate(inputs)]
        return JSONResponse({"object": "list", "data": data, "model": self.model_id,
                             "usage": {"prompt_tokens": 0, "total_tokens": 0}})

    async def _stream(self, state: FakeState, body: dict[str, Any], chat: bool,
                      count: int) -> AsyncIterator[str]:
        state.active += 1
        state.peak = max(state.peak, state.active)
        behaviour, finished = state.behaviour, False
        try:
            await asyncio.sleep(behaviour.first_chunk_delay_s)
            if behaviour.break_after_chunks == 0:
                raise _BrokenStream
            if chat:  # a role-only first chunk, as chat servers send: not a token
                yield _event(_chat_chunk({"role": "assistant", "content": ""}))
            for index in range(count):
                await asyncio.sleep(behaviour.chunk_delay_s)
                if index + 1 == behaviour.break_after_chunks:
                    raise _BrokenStream
                yield _event(_chat_chunk({"content": " tok"}) if chat else _text_chunk(" tok"))
            usage = (body.get("stream_options") or {}).get("include_usage")
            if usage and behaviour.send_usage:
                yield _event({"choices": [], "usage": {"prompt_tokens": 0,
                                                       "completion_tokens": count}})
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            state.active -= 1
            if not finished and behaviour.break_after_chunks < 0:
                state.cut_short += 1


def _full_answer(model: str, chat: bool, count: int) -> dict[str, Any]:
    text = " tok" * count
    choice: dict[str, Any] = ({"message": {"role": "assistant", "content": text}} if chat
                              else {"text": text})
    return {"id": "fake-1", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "length", **choice}],
            "usage": {"prompt_tokens": 0, "completion_tokens": count, "total_tokens": count}}


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _text_chunk(text: str) -> dict[str, Any]:
    return {"object": "text_completion", "model": MODEL_ID,
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _chat_chunk(delta: dict[str, str]) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "model": MODEL_ID,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def main() -> None:
    """`python tests/fake_openai_server.py --port P`: serve until interrupted (benchmarks)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-delay-s", type=float, default=0.02)
    args = parser.parse_args()
    server = FakeOpenAIServer(port=args.port)
    server.reset(chunk_delay_s=args.chunk_delay_s)
    server.server.run()


if __name__ == "__main__":
    main()
