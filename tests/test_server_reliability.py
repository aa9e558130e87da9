"""Inputs that must not break or stall the server, and its security flags.

Every client mistake is a 4xx in OpenAI's shape on a connection that stays open;
large inputs are tokenized off the event loop; the body size and the number of
requests in flight are limited; the API key, docs, /metrics, CORS and TLS flags do
what vLLM's do.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from pagellm.entrypoints.openai.drain_budget import DrainBudget
from server_utils import RemoteServer, assert_clean_shutdown
from test_server_errors import assert_error

API_KEY = "sk-reliability-secret-77"
BODY_LIMIT = 4_000_000
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RemoteServer]:
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(API_KEY + "\n")
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny", "--api-key-file",
                          str(key_file), "--max-request-body-bytes", str(BODY_LIMIT),
                          "--max-concurrent-requests", "2", "--uvicorn-log-level", "info",
                          # a fuzzed request without a length generates to the context's end
                          "--max-model-len", "64")
    remote.api_key = API_KEY
    yield remote
    output = remote.stop()
    assert_clean_shutdown(output)
    assert API_KEY not in output  # neither the flags nor the access log show it


def post(server: RemoteServer, path: str, body: Any,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, verify=server.verify,
                      headers=server.headers() if headers is None else headers)


def raw_json(value: Any) -> bytes:
    """JSON as a client writes it: a lone surrogate is the escape `\\ud800`, valid JSON."""
    return json.dumps(value, ensure_ascii=True).encode()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/completions", {**COMPLETION, "prompt": "\udfff"}),
    ("/v1/completions", {**COMPLETION, "stop": ["x\ud800"]}),
    ("/tokenize", {"prompt": "\ud800"}),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"name": "\ud83d"}}),
])
def test_lone_surrogates_are_400_on_a_connection_that_stays_open(
        server: RemoteServer, path: str, body: dict[str, Any]) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {**server.headers(), "Content-Type": "application/json"}
    connection.request("POST", path, raw_json(body), headers)
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 400 and error["type"] == "BadRequestError"
    assert "surrogate" in error["message"]
    assert not response.will_close
    sock = connection.sock
    connection.request("POST", "/v1/completions", raw_json(COMPLETION), headers)
    follow_up = connection.getresponse()
    assert follow_up.status == 200 and json.loads(follow_up.read())["choices"]
    assert connection.sock is sock  # the same connection served both
    connection.close()


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {**COMPLETION, "prompt": [[False]]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [True, 2]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "4"}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "messages"),
    ("/detokenize", {"tokens": ["0"]}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
])
def test_coercible_types_are_rejected(server: RemoteServer, path: str, body: dict[str, Any],
                                      field: str) -> None:
    error = assert_error(post(server, path, body), 400, "BadRequestError", field)
    assert error["param"] == field


def test_body_limit_is_413_while_reading(server: RemoteServer) -> None:
    big = {**COMPLETION, "prompt": "x" * (BODY_LIMIT + 1)}
    assert_error(post(server, "/v1/completions", big), 413, "RequestTooLargeError",
                 f"limit of {BODY_LIMIT} bytes")

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 65536 + 1):
            yield b"y" * 65536
        yield b'"}'

    chunked = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                         headers={**server.headers(), "Content-Type": "application/json"})
    assert_error(chunked, 413, "RequestTooLargeError")
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


def _head_only(server: RemoteServer, source: str, length: int,
               headers: dict[str, str] | None = None
               ) -> tuple[socket.socket, http.client.HTTPResponse]:
    """A request from `source` declaring a `length`-byte body, none of which is sent."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60,
                                    source_address=(source, 0))
    headers = server.headers() if headers is None else headers
    auth = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: "
                 f"application/json\r\nContent-Length: {length}\r\n\r\n".encode())
    response = http.client.HTTPResponse(sock)
    response.begin()
    return sock, response


def test_oversized_bodies_past_the_address_budget_are_closed_unread(
        server: RemoteServer) -> None:
    """Each address (here 127.0.0.3 and .4, loopback too) has its oversized bodies read
    to the end before the 413 while its drain budget lasts; past it, the 413 comes at once,
    without the body, and the connection closes."""
    budget = DrainBudget().burst_bytes

    def client(source: str) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60,
                            headers={**server.headers(), "Content-Type": "application/json"})

    with client("127.0.0.3") as flooder:
        drained = flooder.post(f"{server.url}/v1/completions", content=b"x" * budget)
        assert_error(drained, 413, "RequestTooLargeError", f"limit of {BODY_LIMIT} bytes")
        assert drained.headers.get("connection") != "close"  # read to the end: kept open
    sock, refused = _head_only(server, "127.0.0.3", budget)  # budget spent: not waited for
    assert refused.status == 413 and refused.will_close
    assert json.loads(refused.read())["error"]["type"] == "RequestTooLargeError"
    assert sock.recv(1) == b""  # and the server closed the connection
    sock.close()
    with client("127.0.0.4") as other:
        answer = other.post(f"{server.url}/v1/completions", content=b"x" * (BODY_LIMIT + 1))
        assert_error(answer, 413, "RequestTooLargeError")
        assert answer.headers.get("connection") != "close"


def test_a_refusal_before_the_body_closes_instead_of_reading_it(server: RemoteServer) -> None:
    """A 401 (or 429, 503) is decided from the headers: the declared 64 MiB body, never sent,
    is not waited for, and the connection closes rather than drain it."""
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        sock, refused = _head_only(server, "127.0.0.5", 64 << 20, headers)
        assert refused.status == 401 and refused.will_close
        assert json.loads(refused.read())["error"]["type"] == "AuthenticationError"
        assert sock.recv(1) == b""
        sock.close()


def test_wrong_method_is_405_with_allow(server: RemoteServer) -> None:
    response = httpx.get(f"{server.url}/v1/completions", headers=server.headers())
    assert_error(response, 405, "MethodNotAllowedError")
    assert response.headers["allow"] == "POST"
    assert "GET" in httpx.post(f"{server.url}/health").headers["allow"]


def test_bearer_scheme_is_case_insensitive(server: RemoteServer) -> None:
    for scheme in ("bearer", "BEARER", "Bearer"):
        response = post(server, "/v1/completions", COMPLETION,
                        headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200, response.text
    for wrong in (f"Basic {API_KEY}", f"Bearer {API_KEY}x", API_KEY):
        response = httpx.post(f"{server.url}/v1/completions", json=COMPLETION,
                              headers={"Authorization": wrong})
        assert_error(response, 401, "AuthenticationError")
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # open by default


def test_cors_is_off_by_default(server: RemoteServer) -> None:
    response = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "https://elsewhere.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in response.headers


def test_openapi_documents_the_errors(server: RemoteServer) -> None:
    schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers()).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "401", "413", "429", "503"} <= responses.keys()
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")


class HeldRequest:
    """A completion whose body is sent in two parts, the second only on `finish()`: it is
    in flight (or refused, which can be read at once) from the first part on."""

    def __init__(self, server: RemoteServer) -> None:
        body = raw_json(COMPLETION)
        self.rest = body[10:]
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        auth = "".join(f"{name}: {value}\r\n" for name, value in server.headers().items())
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        self.sock.sendall(head.encode() + body[:10])

    def response(self) -> tuple[int, dict[str, Any]]:
        answer = http.client.HTTPResponse(self.sock)
        answer.begin()
        status, payload = answer.status, json.loads(answer.read())
        self.sock.close()
        return status, payload

    def finish(self) -> tuple[int, dict[str, Any]]:
        self.sock.sendall(self.rest)
        return self.response()


def hold_requests(server: RemoteServer, limit: int) -> list[HeldRequest]:
    """`limit` requests in flight for sure: one more than that is sent, and the one the
    server refused (429) is the one that answers before its body is complete."""
    held = [HeldRequest(server) for _ in range(limit + 1)]
    readable, _, _ = select.select([h.sock for h in held], [], [], 60)
    refused = next(h for h in held if h.sock is readable[0])
    status, payload = refused.response()
    assert status == 429 and payload["error"]["type"] == "RateLimitError", payload
    return [h for h in held if h is not refused]


def test_concurrency_limit_is_429(server: RemoteServer) -> None:
    held = hold_requests(server, limit=2)
    refused = post(server, "/v1/chat/completions", CHAT)
    assert_error(refused, 429, "RateLimitError", "--max-concurrent-requests")
    assert refused.headers["retry-after"] == "1"
    assert httpx.get(f"{server.url}/health").status_code == 200  # never limited
    assert [h.finish()[0] for h in held] == [200, 200]
    assert post(server, "/v1/completions", COMPLETION).status_code == 200


def test_large_input_is_tokenized_off_the_event_loop(server: RemoteServer) -> None:
    """While a 2 MB prompt is tokenized, /health and small requests are still answered."""
    results: list[httpx.Response] = []
    prompt = "the quick brown fox jumps over the lazy dog " * 48_000
    thread = threading.Thread(target=lambda: results.append(
        post(server, "/tokenize", {"prompt": prompt})))
    thread.start()
    answered_meanwhile = 0
    while thread.is_alive():  # a connection per call, as before, but no SSL context each time
        if httpx.get(f"{server.url}/health", timeout=60,
                     verify=server.verify).status_code == 200 and thread.is_alive():
            answered_meanwhile += 1
        time.sleep(0.02)  # leaves the server's tokenizer the other core
    thread.join()
    assert results[0].status_code == 200 and results[0].json()["count"] > 100_000
    assert answered_meanwhile > 0
    long_chat = {**CHAT, "messages": [{"role": "user", "content": prompt}]}
    assert_error(post(server, "/v1/chat/completions", long_chat), 400, "BadRequestError",
                 "maximum context length is 64 tokens")


def test_kv_cache_debug_endpoint(server: RemoteServer) -> None:
    assert post(server, "/v1/completions", {**COMPLETION, "n": 3}).status_code == 200
    report = httpx.get(f"{server.url}/debug/kv-cache", headers=server.headers()).json()
    assert report == {"num_blocks": 512, "used_blocks": 0, "num_requests": 0, "problem": None}
    assert httpx.get(f"{server.url}/debug/kv-cache").status_code == 401


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


def test_locked_down_server(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """TLS, the key from the environment, /metrics behind it, no docs, CORS for one origin."""
    key, cert = _self_signed(tmp_path)
    origin = "https://app.example"
    remote = RemoteServer(tiny_llama_dir, "--served-model-name", "tiny", "--ssl-keyfile",
                          str(key), "--ssl-certfile", str(cert), "--disable-fastapi-docs",
                          "--enable-metrics-auth", "--allowed-origins", json.dumps([origin]),
                          tls_cert=cert, env={"PAGELLM_API_KEY": API_KEY})
    remote.api_key = API_KEY
    try:
        client = httpx.Client(verify=remote.verify, timeout=60)
        auth = remote.headers()
        assert client.post(f"{remote.url}/v1/completions", json=COMPLETION,
                           headers=auth).status_code == 200
        assert remote.client(http_client=client).models.list().data[0].id == "tiny"
        assert client.get(f"{remote.url}/metrics").status_code == 401
        assert client.get(f"{remote.url}/metrics", headers=auth).status_code == 200
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert client.get(f"{remote.url}{path}", headers=auth).status_code == 404
        preflight = client.options(f"{remote.url}/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == origin
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{remote.port}/health", timeout=5)
    finally:
        assert_clean_shutdown(remote.stop())


@pytest.fixture
def api_schema(server: RemoteServer) -> schemathesis.BaseSchema:
    """The server's own OpenAPI document, for schemathesis to generate requests from."""
    document = httpx.get(f"{server.url}/openapi.json", headers=server.headers()).json()
    return schemathesis.openapi.from_dict(document)


# The routes under KServe's `/openai` prefix are the same endpoints again: fuzzed once.
fuzzed = schemathesis.pytest.from_fixture("api_schema").exclude(path_regex="^/openai/")

# Generated lengths are capped: a fuzzed request is about its shape, and one that asks for
# the whole context (times `n`) would only make the server generate for minutes.
LENGTH_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4,
               "min_tokens": 4, "n": 2, "best_of": 2}


def cap_lengths(body: Any) -> None:
    """Lowers, in place, every positive integer under a LENGTH_CAPS key above its cap; other
    values (negative, zero, of the wrong type) stay as generated, for the server to judge."""
    if isinstance(body, dict):
        for key, value in body.items():
            cap = LENGTH_CAPS.get(key)
            if cap is not None and type(value) is int and value > cap:
                body[key] = cap
            else:
                cap_lengths(value)
    elif isinstance(body, list):
        for item in body:
            cap_lengths(item)


@fuzzed.parametrize()
@hypothesis.settings(max_examples=15, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_openapi_fuzzing_finds_no_server_error(case: schemathesis.Case,
                                               server: RemoteServer) -> None:
    """Generated bodies, valid and not: never a 5xx, and only statuses the schema lists."""
    cap_lengths(case.body)
    case.call_and_validate(base_url=server.url, headers=server.headers(), timeout=120,
                           checks=[not_a_server_error, status_code_conformance])
