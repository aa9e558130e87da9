"""`pagellm router` as a proxy, through the `openai` SDK in front of fake backends:
retries and their budget, errors passed through, streams relayed chunk by chunk and
identical to the backend's, disconnects on either side, replicas that die or stop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from fake_openai_server import FakeOpenAIServer, FakeState
from router_gateway import LONG_TASK, a, b, chat, ext, fakes, gateway_config  # noqa: F401
from router_utils import RouterServer, wait_for


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
        # 3 s: enough for the router to have forwarded the request even on a loaded 2-core
        # machine (with 0.5 s, a CI run once saw the client leave before any backend had it)
        with pytest.raises(openai.APITimeoutError):
            router.client(timeout=3.0).chat.completions.create(
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
