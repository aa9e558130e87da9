"""Error answers of the server: OpenAI's shape and vLLM's statuses, with `--api-key` on.

Every client mistake is a 4xx `{"error": {"message", "type", "param", "code"}}`, and the
server keeps answering afterwards. The last test kills the engine process (503s, then the
server exits).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from server_utils import RemoteServer, assert_clean_shutdown, engine_core_pid

API_KEY = "sk-test-123"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


# A custom --chat-template (a file): the contents of the messages, joined by " | ".
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} | {% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RemoteServer]:
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny", "--chat-template",
                          str(template), api_key=API_KEY)
    yield remote
    assert_clean_shutdown(remote.stop())


def post(server: RemoteServer, path: str, body: Any = None, content: str | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, content=content,
                      headers=server.headers() if headers is None else headers, timeout=30)


def assert_error(response: httpx.Response, status: int, err_type: str,
                 contains: str = "") -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["type"] == err_type
    assert contains in error["message"]
    return error


@pytest.mark.parametrize("path,body,contains,param", [
    ("/v1/chat/completions", {**CHAT, "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -1}, "max_tokens must be at least 1", None),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, "n must be between 1 and", None),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages must not be empty", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]},
     "role", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "type 'text'", "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "logprobs", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias", None),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}}, "out-of-vocab", "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}},
     "stream_options", None),
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"}, "messages",
     "messages"),
    ("/v1/completions", {**COMPLETION, "suffix": "!"}, "suffix", "suffix"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**6]}, "out of vocabulary", None),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt cannot be empty", "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "only allowed with echo",
     "max_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": -1},
     "prompt_logprobs must be between 0 and 20", None),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 21},
     "logprobs must be between 0 and 20", None),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 21},
     "prompt_logprobs must be between 0 and 20", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens must be at least 1", None),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, "stop strings", None),
    ("/detokenize", {"tokens": [-3]}, "out of vocabulary", None),
])
def test_bad_request(server: RemoteServer, path: str, body: dict, contains: str,
                     param: str | None) -> None:
    error = assert_error(post(server, path, body), 400, "BadRequestError", contains)
    assert error["param"] == param


def test_malformed_json(server: RemoteServer) -> None:
    response = post(server, "/v1/chat/completions", content='{"model": "tiny", "messages": [',
                    headers={**server.headers(), "Content-Type": "application/json"})
    assert_error(response, 400, "BadRequestError", "not valid JSON")
    not_object = post(server, "/v1/completions", body=["a", "list"])
    assert_error(not_object, 400, "BadRequestError")
    not_finite = post(server, "/v1/chat/completions",
                      content=json.dumps({**CHAT, "repetition_penalty": float("inf")}),
                      headers={**server.headers(), "Content-Type": "application/json"})
    assert_error(not_finite, 400, "BadRequestError", "finite")


def test_context_length_messages(server: RemoteServer) -> None:
    huge = assert_error(post(server, "/v1/completions", {**COMPLETION, "max_tokens": 10**12}),
                        400, "BadRequestError", "maximum context length is 1024 tokens")
    prompt_tokens = post(server, "/tokenize", {"prompt": "Hello"}).json()["count"]
    assert (f"you requested {10**12 + prompt_tokens} tokens ({prompt_tokens} in the messages, "
            f"{10**12} in the completion)") in huge["message"]
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "robot " * 2000}]}
    assert_error(post(server, "/v1/chat/completions", long_prompt), 400, "BadRequestError",
                 "input tokens")


def test_unknown_model_and_route(server: RemoteServer) -> None:
    error = assert_error(post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-9"}),
                         404, "NotFoundError")
    assert error["message"] == "The model `gpt-9` does not exist."
    assert_error(post(server, "/v1/nothing-here", {}), 404, "NotFoundError")


def test_sdk_raises_typed_errors(server: RemoteServer) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=0)
    assert bad.value.body["code"] == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_stream_request_errors_come_before_the_stream(server: RemoteServer) -> None:
    body = {**CHAT, "stream": True, "chat_template_kwargs": {"messages": []}}
    assert_error(post(server, "/v1/chat/completions", body), 400, "BadRequestError",
                 "chat_template_kwargs")
    assert_error(post(server, "/v1/completions", {**COMPLETION, "stream": True, "n": 0}), 400,
                 "BadRequestError", "n must be")


def test_api_key_required(server: RemoteServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        assert_error(post(server, "/v1/chat/completions", CHAT, headers=headers), 401,
                     "AuthenticationError")
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert_error(post(server, "/tokenize", {"prompt": "x"}, headers={}), 401,
                 "AuthenticationError")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="bad", max_retries=0).models.list()
    assert server.client().models.list().data[0].id == "tiny"
    for open_path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{server.url}{open_path}").status_code == 200


def test_chat_template_flag_is_used(server: RemoteServer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert rendered == post(server, "/tokenize", {"prompt": "Be brief. | Hi"}).json()["tokens"]


def test_server_still_serves_after_errors(server: RemoteServer) -> None:
    response = server.client().chat.completions.create(model="tiny", messages=CHAT["messages"],
                                                       max_tokens=3)
    assert response.usage.completion_tokens <= 3


def test_engine_death_ends_streams_and_exits_non_zero(server: RemoteServer) -> None:
    """In-flight streams get a 503 event and [DONE] at once; then the server exits with a
    non-zero code, so that a supervisor restarts it."""
    body = {**COMPLETION, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                      headers=server.headers(), timeout=30) as response:
        lines = (line for line in response.iter_lines() if line)
        next(lines)
        os.kill(engine_core_pid(server.process.pid), signal.SIGKILL)
        events = list(lines)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert server.process.wait(timeout=30) == 1
    assert "Exiting because the engine core process died." in server.output()
