"""How many bytes of its oversized request bodies the server reads and drops for each client
address before answering the 413.

A client still sending its body when the server answers and closes gets a reset, and its
kernel may throw the answer away unread; reading the rest of the body first (nginx's
lingering close) lets it see the 413. But each drained byte crosses the cores that run the
model: a few clients posting 20 MB bodies back to back cost gigabytes a minute. A token
bucket per address keeps the courtesy for a client's occasional oversized body and
refuses it to a flood: past its budget, the connection closes with the body unread, after
a short wait (the time the budget needs to cover the body, at most a couple of seconds)
during which nothing of it is read: a flooder that reconnects at once would otherwise cost
the server a connection and a 413 many times a second, and its own CPU a body's copy each.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class DrainBudget:
    """Each address may have `burst_bytes` drained at once (so also the most of any one
    body), refilled at `burst_bytes` per `refill_seconds`; at most `max_addresses` are
    tracked at a time. A body refused unread is answered after the time the budget needs to
    cover it, at most `max_answer_delay_seconds`."""

    burst_bytes: int = 64 << 20
    refill_seconds: float = 10.0
    max_addresses: int = 4096
    max_answer_delay_seconds: float = 2.0


@dataclass
class _Bucket:
    tokens: float  # bytes it may still have drained, as of `stamp`
    stamp: float


class DrainBuckets:
    """The budget left to each address that was charged lately. An address not stored has
    a full bucket: one whose bucket has refilled is forgotten, and so is the one charged
    longest ago once `max_addresses` are stored, so the table cannot grow without end."""

    def __init__(self, budget: DrainBudget = DrainBudget(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self.clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently charged first

    def __len__(self) -> int:
        return len(self._buckets)

    def available(self, address: str) -> int:
        """Bytes `address` may still have read and dropped now."""
        now = self._expire()
        bucket = self._buckets.get(address)
        return self.budget.burst_bytes if bucket is None else int(self._refilled(bucket, now))

    def answer_delay(self, address: str, nbytes: int | None) -> float:
        """Seconds to hold the answer to a body of `nbytes` (None: unknown, taken as the
        whole burst) refused unread: until the budget would cover it, within the cap."""
        wanted = min(self.budget.burst_bytes if nbytes is None else nbytes,
                     self.budget.burst_bytes)
        rate = self.budget.burst_bytes / self.budget.refill_seconds
        missing = max(0, wanted - self.available(address))
        return min(self.budget.max_answer_delay_seconds, missing / rate)

    def charge(self, address: str, nbytes: int) -> None:
        """Take `nbytes` read and dropped from `address`'s budget (it stops at zero)."""
        now = self._expire()
        bucket = self._buckets.pop(address, None)
        tokens = self.budget.burst_bytes if bucket is None else self._refilled(bucket, now)
        self._buckets[address] = _Bucket(max(0.0, tokens - nbytes), now)
        if len(self._buckets) > self.budget.max_addresses:
            self._buckets.popitem(last=False)

    def _refilled(self, bucket: _Bucket, now: float) -> float:
        rate = self.budget.burst_bytes / self.budget.refill_seconds
        return min(float(self.budget.burst_bytes), bucket.tokens + (now - bucket.stamp) * rate)

    def _expire(self) -> float:
        """Forget the buckets full again (charged a whole refill period ago); they are the
        first ones, the table being in the order of the charges. Returns the time now."""
        now = self.clock()
        while self._buckets:
            address, bucket = next(iter(self._buckets.items()))
            if now - bucket.stamp < self.budget.refill_seconds:
                break
            del self._buckets[address]
        return now
