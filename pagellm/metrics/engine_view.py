"""The engine view's numbers: the latest scheduler record and a few minutes of throughput.

A stat logger like the others (`loggers.py`): it sees every step's records on the
front end's event loop and keeps only what the web page's engine view shows, so a
request for it costs no engine work.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from pagellm.core.block_map import (CACHED, FREE, OFFLOADED, USED, BlockMap, TierMap,
                                    free_map)
from pagellm.core.sched_output import SchedulerStats
from pagellm.metrics.stats import IterationStats

BUCKET_SECONDS = 5.0
HISTORY_BUCKETS = 60  # five minutes
STATE_NAMES = {FREE: "free", USED: "used", CACHED: "cached", OFFLOADED: "offloaded"}


@dataclass
class _Bucket:
    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # the cumulative prefix-cache counters when the bucket began (None: no record in it yet)
    prefix_queries: int | None = None
    prefix_hits: int = 0


class EngineViewRecorder:
    def __init__(self, num_blocks: int, num_buckets: int = HISTORY_BUCKETS,
                 bucket_seconds: float = BUCKET_SECONDS) -> None:
        self.bucket_seconds = bucket_seconds
        self.buckets: deque[_Bucket] = deque(maxlen=num_buckets)
        self.last: SchedulerStats | None = None
        self.last_map: BlockMap | None = free_map(num_blocks) if num_blocks else None
        self.started = time.monotonic()

    def _bucket(self, now: float) -> _Bucket:
        if not self.buckets or now - self.buckets[-1].start >= self.bucket_seconds:
            start = now if not self.buckets else self.buckets[-1].start + self.bucket_seconds
            idle = int((now - start) // self.bucket_seconds)  # empty buckets stay in the history
            start += max(0, idle - (self.buckets.maxlen or idle)) * self.bucket_seconds
            while now - start >= self.bucket_seconds:
                self.buckets.append(_Bucket(start))
                start += self.bucket_seconds
            self.buckets.append(_Bucket(start))
        return self.buckets[-1]

    def record(self, scheduler: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        if engine != 0:  # with -dp, the view shows the first engine core
            return
        bucket = self._bucket(time.monotonic())
        bucket.generation_tokens += iteration.num_generation_tokens
        if scheduler is not None:
            bucket.prompt_tokens += scheduler.num_prompt_tokens
            if bucket.prefix_queries is None:
                bucket.prefix_queries = self.last.prefix_cache_queries if self.last else 0
                bucket.prefix_hits = self.last.prefix_cache_hits if self.last else 0
            self.last = scheduler
            if scheduler.block_map is not None:
                self.last_map = scheduler.block_map

    def log(self) -> None:
        """Nothing to log: the page asks for `snapshot()`."""

    def throughput(self) -> list[dict[str, float]]:
        """Prompt and generation tokens/s per bucket, oldest first, seconds relative to now
        (the current bucket over its elapsed part)."""
        now = time.monotonic()
        self._bucket(now)
        series = []
        for bucket in self.buckets:
            span = min(self.bucket_seconds, max(now - bucket.start, 1e-3))
            series.append({"t": round(bucket.start - now, 1),
                           "prompt": bucket.prompt_tokens / span,
                           "generation": bucket.generation_tokens / span})
        return series

    def snapshot(self) -> dict[str, object]:
        stats = self.last or SchedulerStats(0, 0, 0.0, 0, 0, 0)
        tier1 = self.last_map.tier1 if self.last_map else None
        tier2 = self.last_map.tier2 if self.last_map else None
        return {
            "uptime_seconds": time.monotonic() - self.started,
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache": {"queries": stats.prefix_cache_queries,
                             "hits": stats.prefix_cache_hits,
                             "hit_rate": _ratio(stats.prefix_cache_hits,
                                                stats.prefix_cache_queries),
                             "recent_hit_rate": self._recent_hit_rate(stats)},
            "preemptions": {"total": stats.num_preemptions,
                            "swap": stats.num_preemptions_swap,
                            "recompute": stats.num_preemptions_recompute},
            "offload_usage": stats.offload.usage if stats.offload else None,
            "throughput": {"bucket_seconds": self.bucket_seconds, "series": self.throughput()},
            "blocks": _map_json(tier1) if tier1 else None,
            "offload_blocks": _map_json(tier2) if tier2 else None,
        }

    def _recent_hit_rate(self, stats: SchedulerStats) -> float | None:
        """Hits over queries since the oldest bucket of the history began."""
        first = next((b for b in self.buckets if b.prefix_queries is not None), None)
        if first is None:
            return None
        return _ratio(stats.prefix_cache_hits - first.prefix_hits,
                      stats.prefix_cache_queries - first.prefix_queries)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole > 0 else None


def _map_json(tier: TierMap) -> dict[str, object]:
    """Cells as a string of digits (the state codes), which the page draws one per square."""
    return {"num_blocks": tier.num_blocks, "blocks_per_cell": tier.blocks_per_cell,
            "cells": "".join(str(code) for code in tier.cells),
            "counts": {STATE_NAMES[code]: count for code, count in tier.counts.items()},
            "states": {str(code): name for code, name in STATE_NAMES.items()}}
