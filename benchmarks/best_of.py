"""The best of a few timed calls: on a shared host, the run least disturbed by others."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(call: Callable[[], object], tries: int) -> float:
    """The fastest of `tries` timed calls, after one untimed warm-up call."""
    call()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
