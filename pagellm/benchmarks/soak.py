"""A soak of a running pagellm server: many mixed requests, some clients that leave early,
some malformed bodies; then the server must be back where it started.

The mix: chat and completions, streamed or not, `n` of 1 or 2, stop strings, short and
long prompts. `disconnect_fraction` of the clients hang up at a random point (mid-stream
or while waiting), `malformed_fraction` send a body that must get a 4xx. A valid request
fails if it does not end as it should: 200, `n` choices each with a finish reason, and a
stream ending in `[DONE]` with no error event. At the end the KV cache must be empty and
the block pool's integrity check clean (`GET /debug/kv-cache`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

_WORDS = ("river stone light garden window paper music winter orange silver market "
          "engine forest letter bridge candle ocean mirror shadow harbor").split()
_MALFORMED: list[tuple[str, bytes]] = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"'),
    ("/v1/completions", b'{"prompt": [[false]], "max_tokens": 4}'),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}'),
    ("/v1/chat/completions", b'{"messages": "not a list"}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}'),
    ("/tokenize", b'{"tokens": ["0"]}'),
]


@dataclass
class SoakConfig:
    num_requests: int = 300
    concurrency: int = 24
    disconnect_fraction: float = 0.10
    malformed_fraction: float = 0.01
    long_prompt_words: int = 300
    max_tokens: int = 32
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    max_seconds: float | None = None  # stop sending new requests after this long


@dataclass
class SoakResult:
    valid_ok: int = 0
    disconnected: int = 0
    malformed_rejected: int = 0
    failures: list[str] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    kv_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> int:
        return self.valid_ok + self.disconnected + self.malformed_rejected + len(self.failures)


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _valid_body(rng: random.Random, config: SoakConfig) -> tuple[str, dict[str, Any]]:
    words = config.long_prompt_words if rng.random() < 0.25 else rng.randint(3, 30)
    body: dict[str, Any] = {"max_tokens": rng.randint(4, config.max_tokens),
                            "n": rng.choice((1, 1, 2)), "stream": rng.random() < 0.5,
                            "temperature": rng.choice((0.0, 0.8)), "seed": rng.randint(0, 99)}
    if config.model:
        body["model"] = config.model
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(_WORDS)[:3], "\n\n"]
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [
            {"role": "user", "content": _prompt(rng, words)}]}
    return "/v1/completions", {**body, "prompt": _prompt(rng, words)}


def _check_json(body: dict[str, Any], n: int) -> str | None:
    choices = body.get("choices", [])
    if len(choices) != n or any(c.get("finish_reason") is None for c in choices):
        return f"expected {n} finished choices, got {json.dumps(choices)[:200]}"
    return None


def _check_stream(events: list[str], n: int) -> str | None:
    if not events or events[-1] != "[DONE]":
        return f"stream did not end with [DONE]: {events[-2:]}"
    finished: set[int] = set()
    for event in events[:-1]:
        data = json.loads(event)
        if "error" in data:
            return f"error event: {data['error']}"
        finished |= {c["index"] for c in data["choices"] if c.get("finish_reason")}
    return None if len(finished) == n else f"{len(finished)} of {n} choices finished"


async def _valid(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                 hang_up_after: int | None) -> str | None:
    """None when the request ended as it should (or was left as planned); else the fault."""
    if not body["stream"]:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            return f"{path}: HTTP {response.status_code} {response.text[:200]}"
        return _check_json(response.json(), body["n"])
    events: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return f"{path}: HTTP {response.status_code} {(await response.aread())[:200]!r}"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if hang_up_after is not None and len(events) >= hang_up_after:
                return None  # leaving the block closes the connection mid-stream
    return _check_stream(events, body["n"])


async def _one(client: httpx.AsyncClient, rng: random.Random, config: SoakConfig,
               result: SoakResult) -> None:
    roll = rng.random()
    if roll < config.malformed_fraction:
        path, raw = rng.choice(_MALFORMED)
        response = await client.post(path, content=raw,
                                     headers={"Content-Type": "application/json"})
        result.statuses[response.status_code] += 1
        if 400 <= response.status_code < 500:
            result.malformed_rejected += 1
        else:
            result.failures.append(f"malformed {raw[:40]!r}: HTTP {response.status_code}")
        return
    path, body = _valid_body(rng, config)
    if roll < config.malformed_fraction + config.disconnect_fraction:
        result.disconnected += 1
        hang_up_after = rng.randint(1, 6) if body["stream"] else None
        try:  # a non-streamed request is abandoned after a random wait
            fault = await asyncio.wait_for(_valid(client, path, body, hang_up_after),
                                           timeout=rng.uniform(0.05, 1.5))
        except asyncio.TimeoutError:
            fault = None
        if fault is not None:
            result.failures.append(fault)
        return
    fault = await _valid(client, path, body, None)
    if fault is None:
        result.valid_ok += 1
    else:
        result.failures.append(fault)


async def kv_cache_when_idle(client: httpx.AsyncClient, timeout: float = 60) -> dict[str, Any]:
    """The KV cache report once no request is left in the engine (aborts land a step late)."""
    deadline = time.monotonic() + timeout
    while True:
        report = (await client.get("/debug/kv-cache")).json()
        if report["num_requests"] == 0 and report["used_blocks"] == 0:
            return report
        if time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.2)


async def run_soak(base_url: str, config: SoakConfig) -> SoakResult:
    rng = random.Random(config.seed)
    seeds = [rng.random() for _ in range(config.num_requests)]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    result = SoakResult()
    limits = httpx.Limits(max_connections=config.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600,
                                 limits=limits) as client:
        queue: asyncio.Queue[float] = asyncio.Queue()
        for seed in seeds:
            queue.put_nowait(seed)

        start = time.perf_counter()
        stop_at = start + config.max_seconds if config.max_seconds else float("inf")

        async def worker() -> None:
            while not queue.empty() and time.perf_counter() < stop_at:
                seed = queue.get_nowait()
                try:
                    await _one(client, random.Random(seed), config, result)
                except httpx.HTTPError as error:
                    result.failures.append(f"{type(error).__name__}: {error}")

        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
        result.seconds = time.perf_counter() - start
        result.kv_cache = await kv_cache_when_idle(client)
    return result
