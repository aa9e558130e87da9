"""`pagellm rag serve`: the KServe graph steps, RAG chat completions through the openai
SDK (streamed too), and soft or hard answers when Qdrant is down."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagellm.rag.embedder import Embedder
from pagellm.rag.ingest import ingest
from pagellm.rag.retriever import Retriever
from pagellm.rag.service import RagService, ServiceSettings, build_service_app
from pagellm.rag.store import StoreSettings, VectorStore
from tests.rag_utils import minilm_path
from tests.server_utils import REPO_ROOT, RemoteServer, cli_env, free_port

QUESTION = "When do backups run?"
CHAT = {"model": "tiny", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}]}


@pytest.fixture(scope="module")
def llm(tiny_server: RemoteServer) -> RemoteServer:
    """The tiny llama as "tiny", shared with test_metrics.py (shared_servers.py)."""
    return tiny_server


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(str(minilm_path()))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory, embedder: Embedder) -> Path:
    docs = tmp_path_factory.mktemp("docs")
    (docs / "ops.md").write_text("# Ops\n\n## Backups\n\nBackups run nightly to S3.\n\n"
                                 "## Upgrades\n\nUpgrade on Tuesdays.\n")
    path = tmp_path_factory.mktemp("store") / "qdrant"
    store = VectorStore(StoreSettings(path=str(path)))
    ingest([str(docs)], "ops", store, embedder, progress=False)
    store.close()
    return path


@pytest.fixture(scope="module")
def service(store_path: Path, llm: RemoteServer) -> Iterator[str]:
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.cli", "rag", "serve", "--collection",
         "ops", "--qdrant-path", str(store_path), "--llm-url", llm.url, "--top-k", "2",
         "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=cli_env(),
        cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    else:
        log.seek(0)
        raise RuntimeError(f"rag serve did not start:\n{log.read()}")
    yield url
    process.terminate()
    process.wait(timeout=15)


def test_retriever_body_is_accepted_by_the_llm(service: str, llm: RemoteServer) -> None:
    """KServe Sequence `retriever -> llm`: step 2 receives step 1's response as it is."""
    step1 = httpx.post(f"{service}/wrapper/retrieve", json=CHAT, timeout=60)
    assert step1.status_code == 200 and step1.headers["x-rag-context"] == "inserted"
    body = step1.json()
    system = body["messages"][0]
    assert system["role"] == "system" and "Backups run nightly to S3." in system["content"]
    assert "[1] Ops > Backups (" in system["content"]
    assert body["messages"][1:] == CHAT["messages"] and body["max_tokens"] == 4
    sources = json.loads(step1.headers["x-rag-sources"])
    assert sources[0]["breadcrumb"] == "Ops > Backups"
    step2 = httpx.post(f"{llm.url}/v1/chat/completions", content=step1.content,
                       headers={"content-type": "application/json"}, timeout=60)
    assert step2.status_code == 200, step2.text
    assert step2.json()["usage"]["prompt_tokens"] > 20  # the context reached the model


def test_embeddings_then_query_steps_echo_the_question(service: str) -> None:
    step1 = httpx.post(f"{service}/wrapper/embeddings", json=CHAT, timeout=60).json()
    assert step1["query"] == QUESTION and len(step1["data"][0]["embedding"]) == 384
    step2 = httpx.post(f"{service}/wrapper/query", json=step1, timeout=60).json()
    assert step2["query"] == QUESTION
    assert step2["results"][0]["text"] == "Backups run nightly to S3."
    assert step2["results"][0]["score"] > step2["results"][1]["score"]
    bad = httpx.post(f"{service}/wrapper/query", json={"query": ""}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


def test_one_call_rag_chat_through_the_sdk(service: str) -> None:
    client = openai.OpenAI(base_url=f"{service}/v1", api_key="EMPTY", max_retries=0)
    answer = client.chat.completions.create(**CHAT)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.model_extra["sources"][0]["breadcrumb"] == "Ops > Backups"
    assert answer.usage.prompt_tokens > 20
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert chunks[0].model_extra["sources"][0]["source"].endswith("ops.md")
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_qdrant_down(mode: str, llm: RemoteServer, embedder: Embedder) -> None:
    dead = VectorStore(StoreSettings(url=f"http://127.0.0.1:{free_port()}"))
    service = RagService(Retriever(dead, embedder, "ops"),
                         ServiceSettings(llm.url, None, 2, mode))
    app = build_service_app(service)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rag") as client:
            return await client.post("/v1/chat/completions", json=CHAT, timeout=60)

    answer = asyncio.run(call())
    if mode == "soft":
        assert answer.status_code == 200 and answer.headers["x-rag-context"] == "unavailable"
        assert answer.json()["sources"] == []
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
    else:
        assert answer.status_code == 503
        assert "Retrieval is unavailable" in answer.json()["error"]["message"]
