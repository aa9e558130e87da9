"""Balancing decisions of `pagellm router` across two fake replicas, backend by backend."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from fake_openai_server import FakeOpenAIServer
from router_utils import RouterServer, wait_for


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    servers = (FakeOpenAIServer("m"), FakeOpenAIServer("m"))
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def a(pair: tuple[FakeOpenAIServer, FakeOpenAIServer]) -> FakeOpenAIServer:
    pair[0].reset()
    return pair[0]


@pytest.fixture
def b(pair: tuple[FakeOpenAIServer, FakeOpenAIServer]) -> FakeOpenAIServer:
    pair[1].reset()
    return pair[1]


def config(a: FakeOpenAIServer, b: FakeOpenAIServer, balancing: str,
           **group: Any) -> dict[str, Any]:
    return {"groups": {"m": {"local": True, "balancing": balancing,
                             "backends": [a.url, b.url], **group}}}


def send(router: RouterServer, content: str = "hi", system: str | None = None,
         **kwargs: Any) -> str:
    """One chat request; returns the root URL of the replica that served it."""
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    raw = router.client().chat.completions.with_raw_response.create(
        model="m", max_tokens=2, messages=messages, **kwargs)
    return raw.headers["x-pagellm-backend"].removesuffix("/v1")


def open_stream(router: RouterServer) -> tuple[Any, str]:
    """A streaming request left open (in flight); returns it and the replica's root URL."""
    raw = router.client(timeout=60).chat.completions.with_raw_response.create(
        model="m", max_tokens=1000, stream=True, messages=[{"role": "user", "content": "hi"}])
    return raw.parse(), raw.headers["x-pagellm-backend"].removesuffix("/v1")


def test_round_robin_alternates(a: FakeOpenAIServer, b: FakeOpenAIServer) -> None:
    with RouterServer(config(a, b, "round_robin")) as router:
        served = [send(router) for _ in range(6)]
    assert served[0::2] == [served[0]] * 3
    assert served[1::2] == [served[1]] * 3
    assert {served[0], served[1]} == {a.url, b.url}


def test_least_loaded_ties_rotate_so_no_replica_starves(a: FakeOpenAIServer,
                                                        b: FakeOpenAIServer) -> None:
    with RouterServer(config(a, b, "least_loaded")) as router:
        served = Counter(send(router) for _ in range(10))
    assert served == {a.url: 5, b.url: 5}


def test_least_loaded_reads_the_replicas_queues(a: FakeOpenAIServer,
                                                b: FakeOpenAIServer) -> None:
    a.reset(waiting=5)
    with RouterServer(config(a, b, "least_loaded")) as router:
        wait_for(lambda: router.backend(a.url).waiting == 5, "a scrape of a's queue")
        assert [send(router) for _ in range(4)] == [b.url] * 4


def test_burst_between_scrapes_counts_the_routers_own_requests(
        a: FakeOpenAIServer, b: FakeOpenAIServer) -> None:
    """One scrape at start says a has 3 queued, b none; no scrape follows. The router's own
    in-flight count makes b look busy as it fills, so the burst is not all sent to b."""
    a.reset(waiting=3, chunk_delay_s=0.05)
    b.reset(chunk_delay_s=0.05)
    with RouterServer({**config(a, b, "least_loaded"), "probe_interval_s": 600}) as router:
        streams = [open_stream(router) for _ in range(5)]
        served = [url for _, url in streams]
        for stream, _ in streams:
            stream.close()
    assert served[:3] == [b.url] * 3       # b: 0, 1, 2 in flight against a's 3
    assert Counter(served) == {a.url: 1, b.url: 4}   # then a tie, and the other one


def test_session_affinity_keeps_a_session_on_its_replica(a: FakeOpenAIServer,
                                                         b: FakeOpenAIServer) -> None:
    with RouterServer(config(a, b, "session")) as router:
        by_session = {}
        for session in ("alice", "bob", "carol", "dave"):
            served = {send(router, extra_headers={"x-session-id": session}) for _ in range(3)}
            assert len(served) == 1
            by_session[session] = served.pop()
        # a session whose replica leaves moves; the others stay put
        gone = by_session["alice"]
        other = b.url if gone == a.url else a.url
        router.backend(gone).healthy = False
        router.backend(gone).ejected_until = float("inf")
        assert send(router, extra_headers={"x-session-id": "alice"}) == other
        for session, url in by_session.items():
            if url == other:
                assert send(router, extra_headers={"x-session-id": session}) == other


# "<system> policy0 ... policy38": 40 tokens, ten blocks of 4; "<user> question N" follows
SYSTEM_P = " ".join(f"policy{i}" for i in range(39))
SYSTEM_Q = " ".join(f"manual{i}" for i in range(39))


def test_prefix_routing_follows_the_prefix_and_spills_off_a_saturated_replica(
        a: FakeOpenAIServer, b: FakeOpenAIServer) -> None:
    group = {"block_size": 4, "load_penalty": 2.0}
    with RouterServer(config(a, b, "prefix", **group)) as router:
        first = send(router, "question one", system=SYSTEM_P)
        other = b.url if first == a.url else a.url
        # the same long system prompt: the replica that holds its blocks, every time
        assert [send(router, f"question {n}", system=SYSTEM_P) for n in range(2, 6)] == \
            [first] * 4
        # a new prefix matches nowhere: the tie rotates; it then sticks where it went
        q_home = send(router, "question one", system=SYSTEM_Q)
        assert send(router, "question two", system=SYSTEM_Q) == q_home
        # `first` now reports 20 queued requests: 10 matched blocks - 2 x 20 loses to 0
        saturated = a if first == a.url else b
        saturated.reset(waiting=20)
        wait_for(lambda: router.backend(first).waiting == 20, "a scrape of the queue")
        assert send(router, "question six", system=SYSTEM_P) == other
        metrics = router.metrics_text()
    # the prompts were tokenized by the replicas themselves, with the served model's name
    tokenized = a.state.tokenized + b.state.tokenized
    assert tokenized and all(body["model"] == "m" and "messages" in body for body in tokenized)
    queried = _sample(metrics, "pagellm_router_prefix_blocks_queried_total")
    matched = _sample(metrics, "pagellm_router_prefix_blocks_matched_total")
    assert queried == 8 * 10                       # eight requests of ten full blocks
    assert matched == 4 * 10 + 10                  # four P follow-ups, one Q follow-up


def _sample(metrics: str, name: str) -> float:
    line = next(line for line in metrics.splitlines() if line.startswith(name))
    return float(line.rsplit(" ", 1)[1])
