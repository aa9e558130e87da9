"""The HTTP side of `pagellm bench serve`: streamed requests to any OpenAI-compatible server,
its model list, and tokenizers (the server's `/tokenize` or a local one)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagellm.benchmarks.datasets import SampleRequest, TextTokenizer

BACKENDS = ("openai", "openai-chat")
DEFAULT_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


class StreamError(Exception):
    """The server reported an error inside an otherwise successful stream."""


@dataclass
class RequestOutput:
    """One request's timings (seconds, `time.perf_counter` clock) and result."""

    prompt_len: int
    start_time: float = 0.0
    end_time: float = 0.0
    success: bool = False
    generated_text: str = ""
    usage_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send the benchmark's requests."""

    url: str
    backend: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0

    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def payload(self, sample: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        if self.backend == "openai-chat":
            body["messages"] = (list(sample.messages) if sample.messages is not None
                                else [{"role": "user", "content": sample.prompt}])
            body["max_completion_tokens"] = sample.expected_output_len
        else:
            body["prompt"] = sample.prompt
            body["max_tokens"] = sample.expected_output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def env_api_key() -> str | None:
    """`OPENAI_API_KEY`, as `vllm bench serve` reads it."""
    return os.environ.get("OPENAI_API_KEY") or None


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint,
                       sample: SampleRequest) -> RequestOutput:
    """Stream one request; failures are recorded in the output, never raised."""
    output = RequestOutput(prompt_len=sample.prompt_len, start_time=time.perf_counter())
    try:
        async with client.stream("POST", endpoint.url, json=endpoint.payload(sample),
                                 headers=endpoint.headers()) as response:
            if response.status_code != 200:
                output.error = error_message(response.status_code, await response.aread())
            else:
                await read_stream(response, endpoint.backend, output)
    except (httpx.HTTPError, StreamError, ValueError) as error:
        output.error = str(error) or type(error).__name__
    output.end_time = time.perf_counter()
    return output


async def read_stream(response: httpx.Response, backend: str, output: RequestOutput) -> None:
    """Fill `output` from a server-sent-events body. TTFT is the first chunk carrying text;
    each later text chunk adds an inter-token latency; latency ends at the last text chunk."""
    last = output.start_time
    async for line in response.aiter_lines():
        data = line[len("data:"):].strip() if line.startswith("data:") else None
        if not data:
            continue
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise StreamError(_message_of(chunk))
        text = chunk_text(chunk, backend)
        if text:
            now = time.perf_counter()
            if output.generated_text:
                output.itl.append(now - last)
            else:
                output.ttft = now - output.start_time
            output.generated_text += text
            last = now
        usage = chunk.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            output.usage_tokens = int(usage["completion_tokens"])
    output.latency = last - output.start_time
    output.success = bool(output.generated_text)
    if not output.success:
        output.error = "The stream ended without any generated text."


def chunk_text(chunk: dict[str, Any], backend: str) -> str:
    """The generated text in one streamed chunk (reasoning text counts as output)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if backend == "openai-chat":
        delta = choices[0].get("delta") or {}
        parts = (delta.get("reasoning_content"), delta.get("reasoning"), delta.get("content"))
        return "".join(part for part in parts if part)
    return choices[0].get("text") or ""


def error_message(status: int, body: bytes) -> str:
    """`HTTP 400: <message>` from an OpenAI-style error body, or the raw body."""
    text = body.decode(errors="replace").strip()
    try:
        message = _message_of(json.loads(text))
    except (ValueError, AttributeError):
        message = text
    return f"HTTP {status}: {message or httpx.codes.get_reason_phrase(status)}"


def _message_of(body: dict[str, Any]) -> str:
    error = body.get("error", body)
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


def fetch_model_id(client: httpx.Client) -> str:
    """The first model id the server lists at GET /v1/models."""
    response = client.get("/v1/models")
    if response.status_code != 200:
        raise ValueError("Could not list the server's models: "
                         f"{error_message(response.status_code, response.content)}; pass --model.")
    models = response.json().get("data") or []
    if not models:
        raise ValueError("The server lists no models at /v1/models; pass --model.")
    return str(models[0]["id"])


class ServerTokenizer:
    """The server's `POST /tokenize` and `POST /detokenize` (vLLM's shapes)."""

    def __init__(self, client: httpx.Client, model: str) -> None:
        self.client = client
        self.model = model

    def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return list(self._post("/tokenize", body)["tokens"])

    def decode(self, ids: list[int]) -> str:
        return str(self._post("/detokenize", {"model": self.model, "tokens": ids})["prompt"])

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.client.post(path, json=body)
        if response.status_code != 200:
            raise ValueError(f"{path}: {error_message(response.status_code, response.content)}")
        return response.json()


class LocalTokenizer:
    """A Hugging Face tokenizer loaded from a local folder or .gguf file."""

    def __init__(self, path: Path) -> None:
        from pagellm.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(path)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def open_tokenizer(tokenizer: str | None, client: httpx.Client,
                   model: str) -> tuple[TextTokenizer, str]:
    """The tokenizer and its id: `--tokenizer` if given, else the server's /tokenize if it
    works, else the embedded default model's tokenizer."""
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise ValueError(f"--tokenizer {tokenizer!r} is not a local path; tokenizers cannot "
                             "be downloaded here. Pass a Hugging Face folder or a .gguf file.")
        return LocalTokenizer(path), str(path)
    server = ServerTokenizer(client, model)
    try:
        server.encode("Hello world")
        return server, str(client.base_url).rstrip("/") + "/tokenize"
    except (ValueError, KeyError) as error:
        from pagellm.model.paths import default_model_path

        path = default_model_path()
        print(f"The server's /tokenize is unusable ({error}); counting tokens with {path.name}.")
        return LocalTokenizer(path), str(path)
