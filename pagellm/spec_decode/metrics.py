"""Acceptance counters, the periodic `SpecDecoding metrics:` line and the `vllm:spec_decode_*`
Prometheus counters, worded and named as vLLM's.

A draft is one request's drafted tokens in one step; its accepted tokens are those of its
drafts the target kept (the recovered or bonus token is not counted, so the mean acceptance
length, which counts it, is 1 + accepted / drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from prometheus_client import Counter

from pagellm.logger import init_logger

if TYPE_CHECKING:
    from pagellm.metrics.loggers import MetricFactory

logger = init_logger(__name__)


@dataclass
class SpecDecodingStats:
    """Cumulative over the engine's life; loggers take the difference of two records."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.accepted_per_pos[position] += 1

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.accepted_per_pos))

    def since(self, earlier: "SpecDecodingStats | None") -> "SpecDecodingStats":
        if earlier is None:
            return self.copy()
        return SpecDecodingStats(
            self.num_spec_tokens, self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [now - then for now, then in zip(self.accepted_per_pos, earlier.accepted_per_pos)])


class SpecDecodingLogging:
    """The line after the engine's stats line, for the interval since the last one; nothing
    when no draft was verified in it."""

    def __init__(self) -> None:
        self._logged: SpecDecodingStats | None = None
        self._since = time.monotonic()

    def log(self, stats: SpecDecodingStats) -> None:
        now = time.monotonic()
        delta = stats.since(self._logged)
        elapsed = max(now - self._since, 1e-9)
        self._logged, self._since = stats.copy(), now
        if delta.num_drafts == 0:
            return
        rates = ", ".join(f"{count / delta.num_drafts:.3f}" for count in delta.accepted_per_pos)
        rate = (delta.num_accepted_tokens / delta.num_draft_tokens * 100
                if delta.num_draft_tokens else float("nan"))
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f "
            "tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d "
            "tokens, Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + delta.num_accepted_tokens / delta.num_drafts,
            delta.num_accepted_tokens / elapsed, delta.num_draft_tokens / elapsed,
            delta.num_accepted_tokens, delta.num_draft_tokens, rates, rate)


class SpecDecodingProm:
    """vLLM's counters (exposed with the `_total` suffix). Acceptance rate =
    rate(accepted) / rate(draft_tokens); mean acceptance length = 1 + rate(accepted) /
    rate(num_drafts); per-position rate = accepted_per_pos / num_drafts."""

    def __init__(self, make: "MetricFactory", engine: int, num_spec_tokens: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return make.counter(name, doc, engine)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                "Number of accepted tokens.")
        per_pos = make.family(Counter, "vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.", ("position",))
        self.per_pos = [make.child(per_pos, engine, str(position))
                        for position in range(num_spec_tokens)]
        self._previous: SpecDecodingStats | None = None

    def record(self, stats: SpecDecodingStats) -> None:
        delta = stats.since(self._previous)
        self._previous = stats.copy()
        self.drafts.inc(delta.num_drafts)
        self.draft_tokens.inc(delta.num_draft_tokens)
        self.accepted.inc(delta.num_accepted_tokens)
        for counter, count in zip(self.per_pos, delta.accepted_per_pos):
            counter.inc(count)
