"""The naive baseline: Hugging Face transformers + FastAPI, one `generate()` at a time.

No batching, no paged KV cache, no scheduler: each request takes an asyncio lock and runs
`model.generate()` on a one-worker thread pool, so requests queue behind each other. It
loads the same SmolLM2-135M Q4_1 GGUF as pagellm (dequantised by transformers, float32)
and serves `/v1/completions` (plain or SSE-streamed), `/v1/models` and `/health`:

    python benchmarks/naive_server.py --port 8001
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from pagellm.model.paths import default_model_path


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):
    prompt: str
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


class TokenQueue(BaseStreamer):
    """Hands each generated token id to the event loop (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.tokens: queue.Queue[int | None] = queue.Queue()
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            for token in value.reshape(-1).tolist():
                self.tokens.put(token)
        self.prompt_seen = True

    def end(self) -> None:
        self.tokens.put(None)


class Cancelled(StoppingCriteria):
    """Stops generation once the client has gone away."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> bool:
        return self.event.is_set()


class NaiveEngine:
    def __init__(self) -> None:
        path = default_model_path()
        self.name = path.stem
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.lock = asyncio.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1)

    def generate(self, request: CompletionRequest, streamer: BaseStreamer | None = None,
                 cancelled: Cancelled | None = None) -> tuple[int, list[int]]:
        """Prompt length and the generated token ids."""
        ids = self.tokenizer(request.prompt, return_tensors="pt").input_ids
        sampling: dict[str, Any] = ({"do_sample": True, "temperature": request.temperature}
                                    if request.temperature > 0 else {"do_sample": False})
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
                min_new_tokens=request.max_tokens if request.ignore_eos else None,
                pad_token_id=self.tokenizer.eos_token_id, streamer=streamer,
                stopping_criteria=[cancelled] if cancelled else None, **sampling)
        return ids.shape[1], out[0, ids.shape[1]:].tolist()

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(request_id: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                         "finish_reason": finish}]}


def finish_reason(request: CompletionRequest, generated: int) -> str:
    return "length" if generated >= request.max_tokens else "stop"


async def stream_events(engine: NaiveEngine, request: CompletionRequest,
                        request_id: str) -> AsyncIterator[str]:
    """SSE chunks, one per token that completes printable text, while holding the lock."""
    async with engine.lock:
        streamer, cancelled = TokenQueue(), Cancelled()
        job = asyncio.get_running_loop().run_in_executor(
            engine.pool, engine.generate, request, streamer, cancelled)
        job.add_done_callback(lambda _: streamer.tokens.put(None))  # also when it raised
        try:
            tokens: list[int] = []
            sent = ""
            while (token := await asyncio.to_thread(streamer.tokens.get)) is not None:
                tokens.append(token)
                text = engine.decode(tokens)
                if len(text) > len(sent) and not text.endswith("\ufffd"):
                    chunk = completion(request_id, engine.name, text[len(sent):], None)
                    sent = text
                    yield f"data: {json.dumps(chunk)}\n\n"
            prompt_len, generated = await job
        finally:
            cancelled.event.set()
    finish = completion(request_id, engine.name, "", finish_reason(request, len(generated)))
    yield f"data: {json.dumps(finish)}\n\n"
    if request.stream_options and request.stream_options.include_usage:
        last = completion(request_id, engine.name, "", None) | {
            "choices": [], "usage": usage(prompt_len, len(generated))}
        yield f"data: {json.dumps(last)}\n\n"
    yield "data: [DONE]\n\n"


def build_app(engine: NaiveEngine) -> FastAPI:
    app = FastAPI(title="naive transformers baseline")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.name, "object": "model",
                                            "owned_by": "naive-baseline"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if request.stream:
            return StreamingResponse(stream_events(engine, request, request_id),
                                     media_type="text/event-stream")
        async with engine.lock:
            prompt_len, generated = await asyncio.get_running_loop().run_in_executor(
                engine.pool, engine.generate, request)
        body = completion(request_id, engine.name, engine.decode(generated),
                          finish_reason(request, len(generated)))
        return body | {"usage": usage(prompt_len, len(generated))}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(build_app(NaiveEngine()), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
