"""A tiny in-process streaming OpenAI-compatible server for the `bench serve` tests.

Word-level tokenizer (one token per whitespace-separated word), `/v1/models`, `/tokenize`,
`/detokenize`, and streamed completions/chat completions that emit one ` tok` chunk per
requested token with a fixed small sleep. It records request bodies and its peak number of
concurrent streams, and can fail every k-th generation request with a vLLM-style 400.
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


@dataclass
class FakeState:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    active: int = 0
    peak: int = 0


class FakeOpenAIServer:
    def __init__(self) -> None:
        self.tokenizer = WordTokenizer()
        self.state = FakeState()
        self.port = free_port()
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
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL_ID}]})
        app.post("/tokenize")(self._tokenize)
        app.post("/detokenize")(self._detokenize)
        app.post("/v1/completions")(self._generate)
        app.post("/v1/chat/completions")(self._generate)
        return app

    async def _tokenize(self, request: Request) -> dict[str, Any]:
        tokens = self.tokenizer.encode((await request.json())["prompt"])
        return {"tokens": tokens, "count": len(tokens), "max_model_len": 4096}

    async def _detokenize(self, request: Request) -> dict[str, Any]:
        return {"prompt": self.tokenizer.decode((await request.json())["tokens"])}

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        state = self.state
        state.bodies.append(body)
        state.paths.append(request.url.path)
        every = state.behaviour.fail_every
        if every and len(state.bodies) % every == 0:
            error = {"message": FAILURE_MESSAGE, "type": "BadRequestError", "param": None,
                     "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        chat = request.url.path.endswith("/chat/completions")
        count = body.get("max_completion_tokens") or body["max_tokens"]
        return StreamingResponse(self._stream(state, body, chat, count),
                                 media_type="text/event-stream")

    async def _stream(self, state: FakeState, body: dict[str, Any], chat: bool,
                      count: int) -> AsyncIterator[str]:
        state.active += 1
        state.peak = max(state.peak, state.active)
        try:
            if chat:  # a role-only first chunk, as chat servers send: not a token
                yield _event(_chat_chunk({"role": "assistant", "content": ""}))
            for _ in range(count):
                await asyncio.sleep(state.behaviour.chunk_delay_s)
                yield _event(_chat_chunk({"content": " tok"}) if chat else _text_chunk(" tok"))
            usage = (body.get("stream_options") or {}).get("include_usage")
            if usage and state.behaviour.send_usage:
                yield _event({"choices": [], "usage": {"prompt_tokens": 0,
                                                       "completion_tokens": count}})
            yield "data: [DONE]\n\n"
        finally:
            state.active -= 1


def _event(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _text_chunk(text: str) -> dict[str, Any]:
    return {"object": "text_completion", "model": MODEL_ID,
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _chat_chunk(delta: dict[str, str]) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "model": MODEL_ID,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
