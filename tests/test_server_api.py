"""The OpenAI-compatible server, end to end: a real `pagellm serve` on a tiny random model,
driven through the official `openai` SDK (and httpx where the SDK hides the wire)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import RemoteServer, assert_clean_shutdown, run_cli

MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Tell me a story about a robot."}]
PROMPT = "Once upon a time there was a small village"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny", "tiny-alias")
    yield remote
    assert_clean_shutdown(remote.stop())


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


def greedy_chat(client: openai.OpenAI, max_tokens: int = 12, **kwargs: object) -> str:
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                              max_tokens=max_tokens, **kwargs)
    return response.choices[0].message.content


def test_health_version_models(server: RemoteServer, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "tiny-alias"]
    assert models[0].owned_by == "pagellm"
    assert models[0].model_extra["max_model_len"] == 1024


def test_completion_usage_and_length(server: RemoteServer, client: openai.OpenAI) -> None:
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7,
                                         temperature=0, extra_body={"ignore_eos": True})
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == count
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == count + 7


def test_completion_prompt_forms(server: RemoteServer, client: openai.OpenAI) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text
    from_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert from_ids.choices[0].text == text
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "Hello!"], max_tokens=6,
                                      temperature=0, n=2)
    assert [c.index for c in sorted(batch.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text
    id_batch = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=6,
                                         temperature=0)
    assert id_batch.choices[0].text == text and len(id_batch.choices) == 2
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + text


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                     temperature=0).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_stream_wire_format(server: RemoteServer) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert len(chunks) <= 10 + 2  # one chunk per engine step at most


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    text = greedy_chat(client, max_tokens=24)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                            max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_chat_usage_matches_tokenize(server: RemoteServer, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="tiny-alias", messages=MESSAGES,
                                              max_completion_tokens=5, temperature=0)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    assert response.model == "tiny-alias" and response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == tokenized["count"]
    assert response.usage.completion_tokens <= 5


def test_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=30, max_completion_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"


def test_n_and_seed(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, n=2, temperature=1.0, seed=seed, max_tokens=16,
            extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == 2 * 16
        return [c.message.content for c in sorted(response.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert len(first) == 2
    assert sample(1234) == first
    assert sample(99) != first


def test_stop_string(client: openai.OpenAI) -> None:
    text = greedy_chat(client, max_tokens=24, extra_body={"ignore_eos": True})
    stop = text[6:9]
    stopped = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                             max_tokens=24, stop=[stop])
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_content_parts_equal_string(client: openai.OpenAI) -> None:
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Tell me a story "},
                                          {"type": "text", "text": "about a robot."}]}]
    joined = [{"role": "system", "content": "You are brief."},
              {"role": "user", "content": "Tell me a story \nabout a robot."}]
    with_parts = client.chat.completions.create(model="tiny", messages=parts, temperature=0,
                                                max_tokens=8)
    with_text = client.chat.completions.create(model="tiny", messages=joined, temperature=0,
                                               max_tokens=8)
    assert with_parts.choices[0].message.content == with_text.choices[0].message.content


def test_tool_and_assistant_roles(client: openai.OpenAI) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Once there was a robot."},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
                {"role": "user", "content": "Go on."}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert response.usage.completion_tokens <= 3


def test_logprobs(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                          max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                           temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))


def test_tokenize_detokenize_round_trip(server: RemoteServer) -> None:
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "prompt": PROMPT})
    body = tokenized.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert PROMPT in detokenized.json()["prompt"]
    plain = httpx.post(f"{server.url}/tokenize",
                       json={"prompt": PROMPT, "add_special_tokens": False}).json()
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": plain["tokens"]})
    assert detokenized.json()["prompt"] == PROMPT


async def _stream_chat(client: openai.AsyncOpenAI, index: int) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"Story number {index}"}],
        max_tokens=32, temperature=0.8, seed=index, stream=True)
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_32_concurrent_streams(server: RemoteServer) -> None:
    async def run_all() -> list[tuple[str, str | None]]:
        async with server.async_client() as client:
            return await asyncio.gather(*(_stream_chat(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    assert all(finish in ("stop", "length") for _, finish in results)


def _wait_idle(server: RemoteServer, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = (metrics["vllm:num_requests_running"] == 0
                and metrics["vllm:num_requests_waiting"] == 0
                and metrics["vllm:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_disconnect_mid_stream_aborts(server: RemoteServer) -> None:
    before = _wait_idle(server)["vllm:generation_tokens_total"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metrics()["vllm:num_requests_running"] == 1
    after = _wait_idle(server)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] - before < 1000


def test_disconnect_before_answer_aborts(server: RemoteServer) -> None:
    """A non-streamed request whose client hangs up is aborted too."""
    before = _wait_idle(server)["vllm:generation_tokens_total"]
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1000,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while server.metrics()["vllm:num_requests_running"] < 1:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.01)
    after = _wait_idle(server)
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:generation_tokens_total"] - before < 1000


def test_chat_cli_against_server(server: RemoteServer, client: openai.OpenAI) -> None:
    expected = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hello"}],
        temperature=0, max_tokens=6).choices[0].message.content
    result = run_cli("chat", "--base-url", f"{server.url}/v1", "--system-prompt", "Be brief.",
                     "--temperature", "0", "--max-tokens", "6", stdin="Hello\n\nAnd then?\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(expected + "\n")
    assert result.stdout.count("\n") >= 2
