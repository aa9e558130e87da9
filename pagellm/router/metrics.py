"""The router's `/metrics`: every routing decision, retry, fallback and ejection, counted.

Backend gauges are read from the live state at scrape time, so they are never older than
the scrape. The registry is the router's own, so several routers can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pagellm.router.backends import Backend, BackendPool


class _BackendCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauges = {
            "healthy": ("1 while the backend is in rotation", lambda b: float(b.healthy)),
            "in_flight": ("Requests the router has in flight there", lambda b: b.in_flight),
            "load": ("Estimated requests on the backend (scrape + router's own since)",
                     lambda b: b.load),
            "kv_cache_usage_perc": ("Last scraped KV cache usage, 0..1", lambda b: b.kv_usage),
        }
        for name, (doc, read) in gauges.items():
            family = GaugeMetricFamily(f"pagellm_router_backend_{name}", doc,
                                       labels=["group", "backend"])
            for backend in self.pool.all():
                family.add_metric([backend.group, backend.name], read(backend))
            yield family


class RouterMetrics:
    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.decisions = Counter("pagellm_router_decisions", "Routing decisions by rule and "
                                 "target group.", ["model", "rule", "target", "sensitive"],
                                 registry=registry)
        self.responses = Counter("pagellm_router_responses", "Upstream answers by backend and "
                                 "HTTP status.", ["backend", "status"], registry=registry)
        self.retries = Counter("pagellm_router_retries", "Requests sent again to another "
                               "replica or group after a failure.", ["group"], registry=registry)
        self.fallbacks = Counter("pagellm_router_fallbacks", "Requests moved to a fallback "
                                 "group.", ["source", "target"], registry=registry)
        self.rejected = Counter("pagellm_router_rejected", "Requests answered 503 by the "
                                "router itself.", ["reason"], registry=registry)
        self.ejections = Counter("pagellm_router_ejections", "Backends taken out of "
                                 "rotation.", ["backend"], registry=registry)
        self.prefix_queried = Counter("pagellm_router_prefix_blocks_queried", "Prompt blocks "
                                      "looked up by prefix routing.", ["group"],
                                      registry=registry)
        self.prefix_matched = Counter("pagellm_router_prefix_blocks_matched", "Prompt blocks "
                                      "found on the replica chosen.", ["group"],
                                      registry=registry)
        self.complexity = Counter("pagellm_router_complexity", "Complexity tiers given, by "
                                  "source: heuristic, classifier or classifier-error.",
                                  ["tier", "source"], registry=registry)
        registry.register(_BackendCollector(pool))
        pool.on_eject.append(self._ejected)

    def _ejected(self, backend: Backend) -> None:
        self.ejections.labels(backend.name).inc()
