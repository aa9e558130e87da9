"""The per-address budget of oversized request bodies read and dropped before the 413: the
bucket's arithmetic on an injected clock, and the body-limit middleware counting exactly
what it reads of each body (the server-level behaviour is in test_server_reliability.py)."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message, Scope

from pagellm.entrypoints.openai.drain_budget import DrainBudget, DrainBuckets
from pagellm.entrypoints.openai.middleware import BodyLimitMiddleware

BUDGET = DrainBudget(burst_bytes=1000, refill_seconds=10.0, max_addresses=3,
                     max_answer_delay_seconds=5.0)
LIMIT = 100  # the middleware's max_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bucket_spends_refills_and_stops_at_zero() -> None:
    clock = Clock()
    buckets = DrainBuckets(BUDGET, clock)
    assert buckets.available("a") == 1000 and len(buckets) == 0  # never charged: full
    buckets.charge("a", 300)
    assert buckets.available("a") == 700
    clock.now = 1.0  # 100 bytes a second
    assert buckets.available("a") == 800
    clock.now = 3.5
    assert buckets.available("a") == 1000  # full, not more
    buckets.charge("a", 1500)
    assert buckets.available("a") == 0  # not in debt
    clock.now = 6.0
    assert buckets.available("a") == 250
    assert buckets.available("b") == 1000  # another address: its own budget


def test_bucket_table_stays_bounded() -> None:
    clock = Clock()
    buckets = DrainBuckets(BUDGET, clock)
    for second, address in enumerate("abcd"):
        clock.now = float(second)
        buckets.charge(address, 1000)
    assert len(buckets) == 3  # the cap: "a", charged longest ago, is forgotten
    assert buckets.available("a") == 1000
    assert buckets.available("b") == 200
    clock.now = 11.5  # "b" (charged at 1) has refilled and expires; "c" (at 2) not yet
    assert buckets.available("x") == 1000
    assert len(buckets) == 2
    clock.now = 13.0
    assert buckets.available("c") == 1000 and len(buckets) == 0


class Upload:
    """An ASGI request whose body of `size` bytes arrives in `piece`-byte chunks, with or
    without Content-Length; it counts the bytes the middleware reads."""

    def __init__(self, size: int, address: str = "10.0.0.1", declared: bool = True,
                 piece: int = 50, expect: bool = False) -> None:
        headers = [(b"content-length", str(size).encode())] if declared else []
        if expect:
            headers.append((b"expect", b"100-continue"))
        self.scope: Scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                             "headers": headers, "client": (address, 40000)}
        self.size, self.piece, self.read = size, piece, 0
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        chunk = min(self.piece, self.size - self.read)
        self.read += chunk
        return {"type": "http.request", "body": b"x" * chunk,
                "more_body": self.read < self.size}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    def answer(self) -> tuple[int, bool]:
        """The status, and whether the connection is to close."""
        start = self.sent[0]
        return start["status"], (b"connection", b"close") in start["headers"]


async def _never_called(scope: Scope, receive: object, send: object) -> None:
    raise AssertionError("an oversized body reached the route")


def post(middleware: BodyLimitMiddleware, upload: Upload) -> Upload:
    asyncio.run(middleware(upload.scope, upload.receive, upload.send))
    return upload


@pytest.fixture
def clock() -> Clock:
    return Clock()


class Sleeps(list):
    """Records the delays the middleware asks for, without waiting."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def middleware(clock: Clock, sleeps: Sleeps) -> BodyLimitMiddleware:
    return BodyLimitMiddleware(_never_called, LIMIT, DrainBuckets(BUDGET, clock), sleeps)


def test_declared_bodies_are_drained_while_the_budget_covers_them(
        middleware: BodyLimitMiddleware, clock: Clock) -> None:
    for _ in range(2):
        upload = post(middleware, Upload(400))
        assert upload.read == 400 and upload.answer() == (413, False)  # read to the end
    past = post(middleware, Upload(400))  # 200 left: not worth reading part of it
    assert past.read == 0 and past.answer() == (413, True)
    other = post(middleware, Upload(400, address="10.0.0.2"))
    assert other.read == 400 and other.answer() == (413, False)
    clock.now = 2.0  # 200 more bytes of budget: 400 again
    again = post(middleware, Upload(400))
    assert again.read == 400 and again.answer() == (413, False)
    assert post(middleware, Upload(1001, address="10.0.0.3")).read == 0  # over any budget


def test_undeclared_bodies_are_drained_while_the_budget_lasts(
        middleware: BodyLimitMiddleware) -> None:
    first = post(middleware, Upload(1050, declared=False))
    # 150 read to find it too large, then 900 drained: 100 of the budget left
    assert first.read == 1050 and first.answer() == (413, False)
    second = post(middleware, Upload(1050, declared=False))
    assert second.read == 150 + 100 and second.answer() == (413, True)
    third = post(middleware, Upload(1050, declared=False))
    assert third.read == 150 and third.answer() == (413, True)


def test_a_client_waiting_for_continue_is_answered_unread(
        middleware: BodyLimitMiddleware) -> None:
    upload = post(middleware, Upload(400, expect=True))
    assert upload.read == 0 and upload.answer() == (413, True)
    assert post(middleware, Upload(1000)).read == 1000  # and its budget is untouched


def test_a_body_within_the_limit_reaches_the_route(clock: Clock) -> None:
    received: list[Message] = []

    async def route(scope: Scope, receive: object, send: object) -> None:
        received.append(await receive())  # type: ignore[operator]

    post(BodyLimitMiddleware(route, LIMIT, DrainBuckets(BUDGET, clock)), Upload(LIMIT, piece=30))
    assert received == [{"type": "http.request", "body": b"x" * LIMIT, "more_body": False}]


def test_a_body_refused_unread_is_answered_once_the_budget_would_cover_it(
        middleware: BodyLimitMiddleware, clock: Clock, sleeps: Sleeps) -> None:
    """100 bytes of budget a second; the answer waits for what the body lacks, at most 5 s."""
    post(middleware, Upload(800))  # drained: no wait, 200 left
    post(middleware, Upload(500))  # 300 missing
    post(middleware, Upload(5000))  # over any budget: the whole burst (800 missing), capped
    post(middleware, Upload(900, declared=False))  # the 200 left drained, the rest unknown
    assert post(middleware, Upload(400, expect=True)).read == 0  # waits for Continue: at once
    assert sleeps == [3.0, 5.0, 5.0]
    clock.now = 10.0
    assert post(middleware, Upload(900)).read == 900 and sleeps == [3.0, 5.0, 5.0]
