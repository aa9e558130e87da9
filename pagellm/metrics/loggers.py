"""Stat loggers: the periodic log line and the Prometheus metrics, with vLLM's wording and names."""

from __future__ import annotations

import time
from typing import Any, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from pagellm.core.sched_output import KVTransferStats, OffloadStats, SchedulerStats
from pagellm.logger import init_logger
from pagellm.lora.metrics import LoRAMetrics
from pagellm.metrics.stats import IterationStats
from pagellm.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm

logger = init_logger(__name__)

LOG_INTERVAL_SECONDS = 10.0


class StatLogger(Protocol):
    """`engine`: the data parallel rank whose step produced the record (0 without -dp)."""

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None: ...

    def log(self) -> None: ...


class LoggingStatLogger:
    """Logs throughput and queue state every interval while the engine has had work; one
    per engine core, each line headed by its rank as vLLM's are. `engine_tokens`: count the
    tokens the engine generated from its own record, not from this front end's requests
    (which are only part of them when several API server processes share the engine)."""

    def __init__(self, kv_label: str = "KV cache usage", engine: int = 0,
                 engine_tokens: bool = False) -> None:
        self.kv_label = kv_label
        self.engine = engine
        self.engine_tokens = engine_tokens
        self.last: SchedulerStats | None = None
        self._logged: SchedulerStats | None = None
        self._hit_rate = 0.0
        self._reset(time.monotonic())
        self._logged_idle = True
        self._spec_decoding = SpecDecodingLogging()

    def _reset(self, now: float) -> None:
        self.since = now
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        if engine != self.engine:
            return
        if scheduler is not None:
            self.prompt_tokens += scheduler.num_prompt_tokens
            self.last = scheduler
        if not self.engine_tokens:
            self.generation_tokens += iteration.num_generation_tokens
        elif scheduler is not None:
            self.generation_tokens += scheduler.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        stats = self.last
        if stats is None:
            return
        idle = not (self.prompt_tokens or self.generation_tokens or stats.num_running
                    or stats.num_waiting)
        if idle and self._logged_idle:
            self._reset(now)
            return
        elapsed = max(now - self.since, 1e-9)
        previous, self._logged = self._logged, stats
        self._update_hit_rate(stats, previous)
        logger.info(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
            "tokens/s, Running: %d reqs, Waiting: %d reqs, Preemptions: %d, %s: %.1f%%, "
            "Prefix cache hit rate: %.1f%%", self.engine, self.prompt_tokens / elapsed,
            self.generation_tokens / elapsed, stats.num_running, stats.num_waiting,
            stats.num_preemptions, self.kv_label, stats.kv_cache_usage * 100,
            self._hit_rate * 100)
        if stats.offload is not None:
            log_transfers(stats.offload, previous.offload if previous else None)
        if stats.spec_decoding is not None:
            self._spec_decoding.log(stats.spec_decoding)
        self._logged_idle = idle
        self._reset(now)

    def _update_hit_rate(self, stats: SchedulerStats, previous: SchedulerStats | None) -> None:
        """Hit tokens / queried tokens since the last line; unchanged when nothing was queried."""
        queries = stats.prefix_cache_queries - (previous.prefix_cache_queries if previous else 0)
        hits = stats.prefix_cache_hits - (previous.prefix_cache_hits if previous else 0)
        if queries > 0:
            self._hit_rate = hits / queries


def transfers_since(offload: OffloadStats, previous: OffloadStats | None) -> KVTransferStats:
    return offload.transfers.since(previous.transfers) if previous else offload.transfers


def log_transfers(offload: OffloadStats, previous: OffloadStats | None) -> None:
    """The part vLLM logs after the stats line when offloading: the interval's transfers
    (bytes, seconds, number of batched copies) and the second tier's usage now."""
    delta = transfers_since(offload, previous)
    values = (("cpu_cache_usage_perc", round(offload.usage, 4)),
              ("store_bytes", delta.store_bytes), ("store_time", round(delta.store_seconds, 6)),
              ("store_size_count", delta.num_stores), ("load_bytes", delta.load_bytes),
              ("load_time", round(delta.load_seconds, 6)), ("load_size_count", delta.num_loads))
    logger.info("KV Transfer metrics: %s",
                ", ".join(f"vllm:kv_offload_{name}={value}" for name, value in values))


_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
_TRANSFER_SIZE_BUCKETS = [1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class MetricFactory:
    """vLLM's metric families in one registry, labelled `model_name` and `engine` (the data
    parallel rank, "0" without -dp); each family is made once and shared by the engines."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name
        self._families: dict[str, Any] = {}

    def family(self, kind: type, name: str, doc: str, extra_labels: tuple[str, ...] = (),
               engine_labels: bool = True, **options: Any) -> Any:
        """`engine_labels=False`: a family with only `extra_labels` (vLLM's info gauges)."""
        if name not in self._families:
            labels = ["model_name", "engine"] if engine_labels else []
            if kind is Gauge:  # with several API server processes, one sets each gauge
                options.setdefault("multiprocess_mode", "mostrecent")
            self._families[name] = kind(name, doc, [*labels, *extra_labels],
                                        registry=self.registry, **options)
        return self._families[name]

    def child(self, family: Any, engine: int, *extra_values: str) -> Any:
        return family.labels(self.model_name, str(engine), *extra_values)

    def gauge(self, name: str, doc: str, engine: int) -> Gauge:
        return self.child(self.family(Gauge, name, doc), engine)

    def counter(self, name: str, doc: str, engine: int) -> Counter:
        return self.child(self.family(Counter, name, doc), engine)

    def histogram(self, name: str, doc: str, buckets: list[float], engine: int) -> Histogram:
        return self.child(self.family(Histogram, name, doc, buckets=buckets), engine)


class _OffloadMetrics:
    """vLLM's OffloadingConnector family; registered once the engine reports a second tier."""

    def __init__(self, make: MetricFactory, engine: int) -> None:
        gauge, counter, histogram = _for_engine(make, engine)
        self.usage = gauge("vllm:kv_offload_cpu_cache_usage_perc",
                           "CPU KV offloading usage. 1 means 100 percent.")
        self.allocation = gauge("vllm:kv_offload_cpu_allocation_size",
                                "Bytes of CPU memory allocated for offloaded KV blocks.")
        self.store_bytes = counter("vllm:kv_offload_store_bytes",
                                   "Total bytes stored from GPU to offload storage.")
        self.store_time = counter("vllm:kv_offload_store_time",
                                  "Total store time from GPU to offload storage, in seconds.")
        self.store_size = histogram("vllm:kv_offload_store_size",
                                    "Histogram of KV offload store operation size, in bytes.",
                                    _TRANSFER_SIZE_BUCKETS)
        self.load_bytes = counter("vllm:kv_offload_load_bytes",
                                  "Total bytes loaded from offload storage to GPU.")
        self.load_time = counter("vllm:kv_offload_load_time",
                                 "Total load time from offload storage to GPU, in seconds.")
        self.load_size = histogram("vllm:kv_offload_load_size",
                                   "Histogram of KV offload load operation size, in bytes.",
                                   _TRANSFER_SIZE_BUCKETS)

    def record(self, offload: OffloadStats, previous: OffloadStats | None) -> None:
        self.usage.set(offload.usage)
        self.allocation.set(offload.allocation_bytes)
        delta = transfers_since(offload, previous)
        self.store_bytes.inc(delta.store_bytes)
        self.store_time.inc(delta.store_seconds)
        self.load_bytes.inc(delta.load_bytes)
        self.load_time.inc(delta.load_seconds)
        for _ in range(delta.num_stores):  # one per step unless records were skipped
            self.store_size.observe(delta.store_bytes / delta.num_stores)
        for _ in range(delta.num_loads):
            self.load_size.observe(delta.load_bytes / delta.num_loads)


def _for_engine(make: MetricFactory, engine: int) -> tuple[Any, Any, Any]:
    """gauge(name, doc), counter(name, doc), histogram(name, doc, buckets) of one engine."""
    return (lambda name, doc: make.gauge(name, doc, engine),
            lambda name, doc: make.counter(name, doc, engine),
            lambda name, doc, buckets: make.histogram(name, doc, buckets, engine))


class PrometheusStatLogger:
    """vLLM's metric names and types for one engine core, labelled `model_name` and
    `engine`. `factory`: the families already made for the other engines of this server;
    without it, a new engine replaces the metrics of any previous one in the registry.
    `engine_stats` False: only this front end's requests' figures (latencies, tokens,
    finished requests), another API server process records the engine's own."""

    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY,
                 engine: int = 0, factory: MetricFactory | None = None,
                 engine_stats: bool = True) -> None:
        if factory is None:
            _unregister_vllm_metrics(registry)
            factory = MetricFactory(registry, model_name)
        self._make, self.engine, self.engine_stats = factory, engine, engine_stats
        gauge, counter, histogram = _for_engine(factory, engine)
        self._offload: _OffloadMetrics | None = None
        self._spec_decoding: SpecDecodingProm | None = None
        self._batches: tuple[Counter, Counter] | None = None  # under pipeline parallelism
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.swaps = counter("vllm:num_preemptions_swap",
                             "Cumulative number of preemptions that swapped the KV cache out.")
        self.recomputes = counter("vllm:num_preemptions_recompute",
                                  "Cumulative number of preemptions that drop the KV cache and "
                                  "recompute it.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self._success = factory.family(Counter, "vllm:request_success",
                                       "Count of successfully processed requests.",
                                       ("finished_reason",))
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _E2E_BUCKETS)
        self.request_prompt = histogram("vllm:request_prompt_tokens",
                                        "Number of prefill tokens processed.", _TOKEN_BUCKETS)
        self.request_generation = histogram("vllm:request_generation_tokens",
                                            "Number of generation tokens processed.", _TOKEN_BUCKETS)
        self._previous: SchedulerStats | None = None
        self._lora: LoRAMetrics | None = None

    @classmethod
    def for_engines(cls, model_name: str, engines: list[int],
                    registry: CollectorRegistry = REGISTRY,
                    engine_stats: bool = True) -> list["PrometheusStatLogger"]:
        """One per data parallel rank, sharing the families."""
        first = cls(model_name, registry, engines[0], engine_stats=engine_stats)
        return [first, *(cls(model_name, registry, engine, first._make, engine_stats)
                         for engine in engines[1:])]

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        if engine != self.engine:
            return
        if scheduler is not None and self.engine_stats:
            self.running.set(scheduler.num_running)
            self.waiting.set(scheduler.num_waiting)
            self.kv_usage.set(scheduler.kv_cache_usage)
            self.prompt_tokens.inc(scheduler.num_prompt_tokens)
            self._count_deltas(scheduler)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration.finished_requests:
            self._make.child(self._success, self.engine, finished.finish_reason).inc()
            self.e2e.observe(finished.e2e_latency)
            self.request_prompt.observe(finished.num_prompt_tokens)
            self.request_generation.observe(finished.num_generation_tokens)

    def _count_deltas(self, stats: SchedulerStats) -> None:
        previous = self._previous or SchedulerStats(0, 0, 0.0, 0, 0, 0)
        self.preemptions.inc(stats.num_preemptions - previous.num_preemptions)
        self.prefix_queries.inc(stats.prefix_cache_queries - previous.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits - previous.prefix_cache_hits)
        self.swaps.inc(stats.num_preemptions_swap - previous.num_preemptions_swap)
        self.recomputes.inc(stats.num_preemptions_recompute - previous.num_preemptions_recompute)
        if stats.offload is not None:
            if self._offload is None:
                self._offload = _OffloadMetrics(self._make, self.engine)
            self._offload.record(stats.offload, previous.offload)
        if stats.spec_decoding is not None:
            if self._spec_decoding is None:
                self._spec_decoding = SpecDecodingProm(self._make, self.engine,
                                                       stats.spec_decoding.num_spec_tokens)
            self._spec_decoding.record(stats.spec_decoding)
        if stats.num_batches:
            self._count_batches(stats, previous)
        if stats.lora is not None:
            if self._lora is None:
                self._lora = LoRAMetrics(self._make, self.engine)
            self._lora.record(stats.lora)
        self._previous = stats

    def _count_batches(self, stats: SchedulerStats, previous: SchedulerStats) -> None:
        """The batch queue's batches, and those launched while another was in flight: their
        ratio is how much of the time the pipeline stages computed at once."""
        if self._batches is None:
            counter = _for_engine(self._make, self.engine)[1]
            self._batches = (
                counter("pagellm:pipeline_batches", "Batches the engine core launched."),
                counter("pagellm:pipeline_overlapped_batches",
                        "Batches launched while another was in flight (pipeline parallelism)."))
        launched, overlapped = self._batches
        launched.inc(stats.num_batches - previous.num_batches)
        overlapped.inc(stats.num_overlapped_batches - previous.num_overlapped_batches)

    def log(self) -> None:
        """Prometheus is scraped, not pushed."""


def _unregister_vllm_metrics(registry: CollectorRegistry) -> None:
    """A new engine in the same process replaces the previous one's metrics."""
    for collector in list(registry._collector_to_names):
        names = registry._collector_to_names.get(collector, ())
        if any(name.startswith(("vllm:", "pagellm:")) for name in names):
            registry.unregister(collector)
