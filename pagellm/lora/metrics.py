"""LoRA's metrics: vLLM's `vllm:lora_requests_info` byte for byte (gateways route on it) and
pagellm's per-adapter request counter."""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from pagellm.metrics.loggers import MetricFactory


@dataclass
class LoRAStats:
    """Sent with every step's stats while LoRA is enabled; counts per adapter name."""

    max_loras: int
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)  # cumulative, since start


class LoRAMetrics:
    def __init__(self, make: "MetricFactory", engine: int) -> None:
        # vLLM's labels, in vLLM's order; the value is the time of the last update, so that
        # of the label sets exported, consumers take the latest
        self.info = make.family(Gauge, "vllm:lora_requests_info", "Running stats on lora requests.",
                                ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                                engine_labels=False)
        self.requests = make.family(Counter, "pagellm:lora_requests",
                                    "Requests received per LoRA adapter.", ("lora_name",))
        self._make, self.engine = make, engine
        self._counted: dict[str, int] = {}

    def record(self, stats: LoRAStats) -> None:
        self.info.labels(str(stats.max_loras), ",".join(stats.waiting),
                         ",".join(stats.running)).set_to_current_time()
        for name, total in stats.requests.items():
            delta = total - self._counted.get(name, 0)
            if delta > 0:
                self._make.child(self.requests, self.engine, name).inc(delta)
            self._counted[name] = total
