"""Live state of every backend: health, ejection, and the load figures balancing reads.

Load is never only a scraped figure: between two scrapes the router adds the requests it
sent and removes those that finished since the scrape (its own in-flight count), so a
burst is spread at once instead of piling onto the replica that looked idle last second.
A backend that fails `max_failures` times in a row, or whose `/health` does not answer,
is ejected; a probe (or, for unprobed providers, the cooldown) brings it back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pagellm.logger import init_logger
from pagellm.router.config import BackendConfig, GroupConfig, RouterConfig

logger = init_logger(__name__)

_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass
class Backend:
    config: BackendConfig
    group: str
    probed: bool
    in_flight: int = 0
    running: float = 0.0           # last scrape of the replica's own gauges
    waiting: float = 0.0
    kv_usage: float = 0.0
    in_flight_at_scrape: int = 0
    healthy: bool = True
    failures: int = 0
    ejected_until: float = 0.0     # no way back in before this

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def local(self) -> bool:
        return self.config.local

    @property
    def load(self) -> float:
        """Requests on the replica now: the scrape, corrected by what the router did since."""
        scraped = self.running + self.waiting + self.in_flight - self.in_flight_at_scrape
        return max(float(self.in_flight), scraped)

    def available(self, now: float) -> bool:
        return self.healthy or (not self.probed and now >= self.ejected_until)

    def record_success(self) -> None:
        self.failures = 0
        if not self.healthy:
            logger.info("Backend %s is back in rotation", self.name)
        self.healthy = True

    def record_failure(self, reason: str, max_failures: int, cooldown_s: float) -> bool:
        """Count a failure; returns True when it ejects the backend. An ejected backend
        stays out for `cooldown_s` even if its /health answers, so one whose health
        endpoint is fine but whose requests fail does not flap back in at every probe."""
        self.failures += 1
        if self.failures < max_failures:
            return False
        was_healthy = self.healthy
        self.healthy = False
        self.ejected_until = time.monotonic() + cooldown_s
        if was_healthy:
            logger.warning("Backend %s ejected after %d failure(s): %s", self.name,
                           self.failures, reason)
        return was_healthy

    def apply_scrape(self, text: str) -> None:
        values = parse_gauges(text)
        for metric, attribute in _GAUGES.items():
            setattr(self, attribute, values.get(metric, 0.0))
        self.in_flight_at_scrape = self.in_flight


def parse_gauges(text: str) -> dict[str, float]:
    """Sum each of the load gauges over its label sets (one per served model name)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _GAUGES:
            try:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return values


class BackendPool:
    """All backends by group, and the probe loop that keeps their health and load fresh."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.groups: dict[str, list[Backend]] = {
            name: [Backend(b, name, group.probe) for b in group.backends]
            for name, group in config.groups.items()}
        self.on_eject: list[Callable[[Backend], None]] = []  # e.g. a metrics counter
        self._task: asyncio.Task | None = None

    def group_config(self, name: str) -> GroupConfig:
        return self.config.groups[name]

    def all(self) -> list[Backend]:
        return [backend for backends in self.groups.values() for backend in backends]

    def available(self, group: str) -> list[Backend]:
        now = time.monotonic()
        return [backend for backend in self.groups[group] if backend.available(now)]

    def fail(self, backend: Backend, reason: str, probe: bool = False) -> None:
        """A failed request, or a failed probe (`probe`: out at once, and back in as soon
        as a probe succeeds)."""
        max_failures, cooldown = ((1, 0.0) if probe else
                                  (self.config.max_failures, self.config.cooldown_s))
        if backend.record_failure(reason, max_failures, cooldown):
            for callback in self.on_eject:
                callback(backend)

    async def probe_once(self) -> None:
        probed = [backend for backend in self.all() if backend.probed]
        await asyncio.gather(*(self._probe(backend) for backend in probed))

    async def _probe(self, backend: Backend) -> None:
        timeout = self.config.connect_timeout_s
        try:
            health = await self.client.get(f"{backend.config.root}/health", timeout=timeout)
            if health.status_code != 200:
                raise httpx.HTTPStatusError(f"/health answered {health.status_code}",
                                            request=health.request, response=health)
            scrape = await self.client.get(f"{backend.config.root}/metrics", timeout=timeout)
        except httpx.HTTPError as error:
            # a replica that cannot answer /health is not worth a client's request to find out
            self.fail(backend, f"probe: {type(error).__name__}: {error}", probe=True)
            return
        if scrape.status_code == 200:
            backend.apply_scrape(scrape.text)
        if time.monotonic() >= backend.ejected_until:
            backend.record_success()

    async def _loop(self) -> None:
        while True:   # the first probe ran before the server took requests
            await asyncio.sleep(self.config.probe_interval_s)
            await self.probe_once()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
