"""`pagellm router` through the `openai` SDK, in front of fake OpenAI-compatible backends.

Two fake local replicas and a fake external provider record every body they receive, so
each privacy test can check what left: a request carrying customer data must never appear
in the external fake's log, whatever fails.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from fake_openai_server import FakeOpenAIServer, FakeState
from router_utils import RouterServer, wait_for

EXTERNAL_KEY = "sk-external-secret-123"
TENANT_KEY = "tenant-acme-key"
LONG_TASK = ("Design the architecture of a distributed payment system, compare the trade-off "
             "between two algorithm choices and explain why, step by step.")


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, FakeOpenAIServer]]:
    servers = {"a": FakeOpenAIServer("local-model"), "b": FakeOpenAIServer("local-model"),
               "ext": FakeOpenAIServer("cloud-model")}
    for server in servers.values():
        server.start()
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def a(fakes: dict[str, FakeOpenAIServer]) -> FakeOpenAIServer:
    fakes["a"].reset()
    return fakes["a"]


@pytest.fixture
def b(fakes: dict[str, FakeOpenAIServer]) -> FakeOpenAIServer:
    fakes["b"].reset()
    return fakes["b"]


@pytest.fixture
def ext(fakes: dict[str, FakeOpenAIServer], monkeypatch: pytest.MonkeyPatch
        ) -> FakeOpenAIServer:
    monkeypatch.setenv("ROUTER_TEST_EXTERNAL_KEY", EXTERNAL_KEY)
    monkeypatch.setenv("ROUTER_TEST_ACME_KEY", TENANT_KEY)
    fakes["ext"].reset()
    return fakes["ext"]


def gateway_config(a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer,
                   balancing: str = "least_loaded", **extra: Any) -> dict[str, Any]:
    """The seeds' set-up: customer data local, complex or long tasks external, and by
    default (the riskiest choice for a leak) external first, local as fallback."""
    return {
        "groups": {
            "local": {"model": "local-model", "local": True, "balancing": balancing,
                      "backends": [a.url, b.url]},
            "cloud": {"model": "cloud-model", "probe": False,
                      "api_key_env": "ROUTER_TEST_EXTERNAL_KEY", "backends": [ext.url]},
        },
        "models": {"assistant": {
            "default": "cloud", "fallbacks": ["local"],
            "rules": [{"name": "simple", "when": {"complexity": "simple"}, "target": "local"},
                      {"name": "complex", "when": {"complexity": "complex"},
                       "target": "cloud"}]}},
        "tenants": {"acme": "ROUTER_TEST_ACME_KEY"},
        "privacy": {"customer_names": ["Jane Doe"], "patterns": {"contract": r"CT-\d{6}"},
                    "tenants": ["acme"]},
        "max_failures": 1,
        **extra,
    }


def chat(router: RouterServer, content: str, **kwargs: Any) -> Any:
    """A chat request through the SDK; returns the raw response (headers + parsed)."""
    api_key = kwargs.pop("api_key", "EMPTY")
    return router.client(api_key=api_key).chat.completions.with_raw_response.create(
        model=kwargs.pop("model", "assistant"), max_tokens=4,
        messages=[{"role": "user", "content": content}], **kwargs)


def contents(server: FakeOpenAIServer) -> str:
    return repr(server.state.bodies)


SENSITIVE = {
    "email": "Write to jane.roe@example.com about the invoice.",
    "phone": "Call the customer back on +1 415-555-2671 today.",
    "iban": "Refund to DE89 3704 0044 0532 0130 00 please.",
    "credit_card": "The card 4111 1111 1111 1111 was charged twice.",
    "national_id": "Her social security number is 123-45-6789.",
    "customer_name": "Summarise the complaint from jane doe.",
    "pattern:contract": "What does contract CT-123456 say about refunds?",
}


@pytest.mark.parametrize("entity", sorted(SENSITIVE))
def test_customer_data_stays_local(entity: str, a: FakeOpenAIServer, b: FakeOpenAIServer,
                                   ext: FakeOpenAIServer) -> None:
    # Appended to a complex task, which would otherwise go to the external provider.
    text = f"{LONG_TASK} {SENSITIVE[entity]}"
    with RouterServer(gateway_config(a, b, ext)) as router:
        raw = chat(router, text)
    assert raw.headers["x-pagellm-route"] == (f"rule=privacy(pii:{entity}); target=local; "
                                              f"sensitive=true")
    assert raw.parse().model == "local-model"
    assert ext.state.bodies == []
    assert SENSITIVE[entity] in contents(a) + contents(b)


def test_complex_goes_out_and_simple_stays(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                           ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        complex_raw = chat(router, LONG_TASK)
        simple_raw = chat(router, "What is the capital of France?")
    assert complex_raw.headers["x-pagellm-route"] == ("rule=complex; target=cloud; "
                                                      "sensitive=false")
    assert complex_raw.parse().model == "cloud-model"
    assert [body["model"] for body in ext.state.bodies] == ["cloud-model"]
    assert simple_raw.headers["x-pagellm-route"] == "rule=simple; target=local; sensitive=false"
    # the provider gets its own key, never the client's
    assert ext.state.headers[0]["authorization"] == f"Bearer {EXTERNAL_KEY}"


def test_tag_and_tenant_mark_customer_data(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                           ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        tagged = chat(router, LONG_TASK, extra_headers={"x-pagellm-tags": "x, customer-data"})
        tenant = chat(router, LONG_TASK, api_key=TENANT_KEY)
        other = chat(router, LONG_TASK, api_key="someone-else")
    assert "privacy(tag:customer-data)" in tagged.headers["x-pagellm-route"]
    assert "privacy(tenant:acme)" in tenant.headers["x-pagellm-route"]
    assert "rule=complex" in other.headers["x-pagellm-route"]
    assert len(ext.state.bodies) == 1
    assert all("authorization" not in h or h["authorization"] != f"Bearer {TENANT_KEY}"
               for h in a.state.headers + b.state.headers + ext.state.headers)


def test_token_id_prompt_cannot_be_scanned_so_stays_local(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        raw = router.client().completions.with_raw_response.create(
            model="cloud", prompt=[1, 2, 3], max_tokens=2)
    assert "privacy(pii:unscannable)" in raw.headers["x-pagellm-route"]
    assert ext.state.bodies == []


def test_sensitive_request_gets_503_when_every_local_replica_fails(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    a.reset(fail_status=500)
    b.reset(fail_status=503)
    with RouterServer(gateway_config(a, b, ext)) as router:
        with pytest.raises(openai.APIStatusError) as caught:
            chat(router, SENSITIVE["email"])
        metrics = router.metrics_text()
    assert caught.value.status_code == 503
    assert "customer data" in caught.value.message
    assert caught.value.response.headers["x-pagellm-route"].endswith("sensitive=true")
    assert len(a.state.bodies) == len(b.state.bodies) == 1   # each local replica tried once
    assert ext.state.bodies == []
    assert 'pagellm_router_rejected_total{reason="no_local_backend"} 1.0' in metrics


def test_sensitive_request_gets_503_when_local_replicas_are_down(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    a.reset(healthy=False)
    b.reset(healthy=False)
    with RouterServer(gateway_config(a, b, ext)) as router:
        with pytest.raises(openai.APIStatusError) as caught:
            chat(router, SENSITIVE["iban"], stream=True)
    assert caught.value.status_code == 503
    assert a.state.bodies == b.state.bodies == ext.state.bodies == []


def test_detector_error_fails_closed(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                     ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        def broken(body: dict[str, Any]) -> list[Any]:
            raise RuntimeError("detector crashed")
        router.state.policy.detector.scan = broken
        raw = chat(router, LONG_TASK)
    assert raw.headers["x-pagellm-route"] == ("rule=privacy(detector-error); target=local; "
                                              "sensitive=true")
    assert ext.state.bodies == []


def test_sensitive_retry_stays_on_local_replicas(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                                 ext: FakeOpenAIServer) -> None:
    a.reset(break_after_chunks=0)   # a accepts, then drops the connection before any chunk
    with RouterServer(gateway_config(a, b, ext, balancing="round_robin")) as router:
        answers = [chat(router, SENSITIVE["phone"], stream=True) for _ in range(2)]
        text = [list(raw.parse()) for raw in answers]
        assert not router.backend(a.url).healthy   # ejected after its failure
    assert all(raw.headers["x-pagellm-backend"] == f"{b.url}/v1" for raw in answers)
    assert all(chunks for chunks in text)
    assert len(a.state.bodies) == 1
    assert ext.state.bodies == []


def test_non_sensitive_falls_back_to_local_when_external_fails(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    ext.reset(fail_status=502)
    with RouterServer(gateway_config(a, b, ext)) as router:
        raw = chat(router, LONG_TASK)
        metrics = router.metrics_text()
    assert raw.parse().model == "local-model"
    assert raw.headers["x-pagellm-route"] == "rule=complex; target=cloud; sensitive=false"
    assert len(ext.state.bodies) == 1
    assert 'pagellm_router_fallbacks_total{source="cloud",target="local"} 1.0' in metrics


def test_retry_budget_bounds_attempts(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                      ext: FakeOpenAIServer) -> None:
    for server in (a, b, ext):
        server.reset(fail_status=503)
    with RouterServer(gateway_config(a, b, ext, retry_budget=2)) as router:
        with pytest.raises(openai.APIStatusError) as caught:
            chat(router, LONG_TASK)
    assert caught.value.status_code == 503
    assert len(ext.state.bodies) + len(a.state.bodies) + len(b.state.bodies) == 2


def test_client_errors_pass_through_without_retry(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                                  ext: FakeOpenAIServer) -> None:
    a.reset(fail_status=400)
    b.reset(fail_status=400)
    with RouterServer(gateway_config(a, b, ext)) as router:
        with pytest.raises(openai.BadRequestError):
            chat(router, "hello", model="local")
    assert len(a.state.bodies) + len(b.state.bodies) == 1


def test_models_health_and_bad_requests(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                        ext: FakeOpenAIServer) -> None:
    with RouterServer(gateway_config(a, b, ext)) as router:
        client = router.client()
        assert [m.id for m in client.models.list()] == ["assistant", "local", "cloud"]
        assert httpx.get(f"{router.url}/health").status_code == 200
        with pytest.raises(openai.NotFoundError):
            chat(router, "hi", model="nope")
        bad = httpx.post(f"{router.url}/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
        embedded = client.embeddings.create(model="local", input=["one", "three"])
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "BadRequestError"
    assert [len(item.embedding) for item in embedded.data] == [2, 2]


def test_streaming_equals_backend_stream(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                         ext: FakeOpenAIServer) -> None:
    direct = openai.OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0)
    request = {"model": "local-model", "max_tokens": 6, "stream": True,
               "stream_options": {"include_usage": True},
               "messages": [{"role": "user", "content": "hi"}]}
    expected = [chunk.model_dump() for chunk in direct.chat.completions.create(**request)]
    with RouterServer(gateway_config(a, b, ext)) as router:
        routed = [chunk.model_dump() for chunk in router.client().chat.completions.create(
            **{**request, "model": "local"})]
    assert routed == expected
    assert len(routed) == 8   # role chunk, six tokens, usage


class GatedFake(FakeOpenAIServer):
    """Streams `open_chunks` chunks, then waits for `gate` before the rest."""

    def __init__(self, open_chunks: int) -> None:
        super().__init__("local-model")
        self.gate = threading.Event()
        self.open_chunks = open_chunks

    async def _stream(self, state: FakeState, body: dict[str, Any], chat: bool,
                      count: int) -> AsyncIterator[str]:
        sent = 0
        async for event in super()._stream(state, body, chat, count):
            if sent == self.open_chunks:
                while not self.gate.is_set():
                    await asyncio.sleep(0.01)
            sent += 1
            yield event


def test_stream_is_relayed_chunk_by_chunk(ext: FakeOpenAIServer) -> None:
    """The first chunks reach the client while the backend still holds the rest back: the
    router does not wait for the answer to end (nor for a buffer to fill)."""
    gated = GatedFake(open_chunks=3)
    gated.start()
    try:
        config = {"groups": {"local": {"local": True, "backends": [gated.url],
                                       "model": "local-model"}}}
        with RouterServer(config) as router:
            stream = router.client(timeout=30).chat.completions.create(
                model="local", max_tokens=5, stream=True,
                messages=[{"role": "user", "content": "hi"}])
            early = [next(stream) for _ in range(3)]
            assert not gated.gate.is_set()
            gated.gate.set()
            late = list(stream)
    finally:
        gated.gate.set()
        gated.stop()
    assert [c.choices[0].delta.content for c in early] == ["", " tok", " tok"]
    assert len(late) == 3


def test_client_disconnect_aborts_upstream(a: FakeOpenAIServer, b: FakeOpenAIServer,
                                           ext: FakeOpenAIServer) -> None:
    a.reset(chunk_delay_s=0.02)
    b.reset(chunk_delay_s=0.02)
    with RouterServer(gateway_config(a, b, ext)) as router:
        body = {"model": "local", "max_tokens": 2000, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: a.state.cut_short + b.state.cut_short == 1, "upstream abort")
        wait_for(lambda: all(bk.in_flight == 0 for bk in router.state.pool.all()),
                 "in-flight counts back to zero")
    assert a.state.active == b.state.active == 0


def test_client_leaving_before_the_first_chunk_cancels_the_attempt(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    a.reset(first_chunk_delay_s=60)
    b.reset(first_chunk_delay_s=60)
    with RouterServer(gateway_config(a, b, ext)) as router:
        with pytest.raises(openai.APITimeoutError):
            router.client(timeout=0.5).chat.completions.create(
                model="local", max_tokens=2, stream=True,
                messages=[{"role": "user", "content": "hi"}])
        # the router gave the attempt up with its client, long before the backend answers
        wait_for(lambda: all(bk.in_flight == 0 for bk in router.state.pool.all()),
                 "the upstream attempt to be cancelled", timeout=20)
        assert len(a.state.bodies) + len(b.state.bodies) == 1
        assert all(bk.healthy for bk in router.state.pool.all())   # not the backend's fault


def test_replica_dying_mid_stream_ends_the_stream_with_an_error(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    a.reset(break_after_chunks=3)
    b.reset(break_after_chunks=3)
    with RouterServer(gateway_config(a, b, ext)) as router:
        stream = router.client(timeout=30).chat.completions.create(
            model="local", max_tokens=10, stream=True,
            messages=[{"role": "user", "content": "hi"}])
        received = []
        with pytest.raises(openai.APIError, match="failed while streaming"):
            for chunk in stream:
                received.append(chunk)
        wait_for(lambda: all(bk.in_flight == 0 for bk in router.state.pool.all()),
                 "in-flight counts back to zero")
    assert len(received) == 3   # the role chunk and two tokens, then the error event
    assert len(a.state.bodies) + len(b.state.bodies) == 1   # not retried once relayed


def test_stopped_replica_is_retried_elsewhere_and_probed_back(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    dead = FakeOpenAIServer("local-model")
    dead.start()
    with RouterServer(gateway_config(dead, b, ext, balancing="round_robin",
                                     probe_interval_s=30)) as router:
        dead.stop()
        answers = [chat(router, "hello", model="local") for _ in range(3)]
        assert {raw.headers["x-pagellm-backend"] for raw in answers} == {f"{b.url}/v1"}
        assert not router.backend(dead.url).healthy
        assert ('pagellm_router_backend_healthy{backend="%s/v1",group="local"} 0.0' % dead.url
                in router.metrics_text())
    b.reset(healthy=False)
    with RouterServer(gateway_config(a, b, ext)) as router:
        assert not router.backend(b.url).healthy   # the first probe runs before serving
        b.reset(healthy=True)
        wait_for(lambda: router.backend(b.url).healthy, "probe bringing b back")


def test_external_key_and_bodies_are_never_logged(
        a: FakeOpenAIServer, b: FakeOpenAIServer, ext: FakeOpenAIServer) -> None:
    ext.reset(fail_status=503)
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger("pagellm").addHandler(handler)
    try:
        with RouterServer(gateway_config(a, b, ext)) as router:
            chat(router, LONG_TASK)
            chat(router, SENSITIVE["email"])
            metrics = router.metrics_text()
    finally:
        logging.getLogger("pagellm").removeHandler(handler)
    logged = log.getvalue()
    assert "Routed model=assistant rule=complex" in logged
    assert "failed (HTTP 503)" in logged
    for secret in (EXTERNAL_KEY, "jane.roe@example.com", LONG_TASK[:40]):
        assert secret not in logged + metrics
