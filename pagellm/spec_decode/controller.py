"""How many tokens each request drafts this step: as many as pay for themselves, often none.

Measured as the engine runs:
- the step time as a line in the number of tokens it computes, t(N) = c0 + c1 N (a least
  squares fit over recent steps with forgetting, with a weak pull of the slope towards
  c0 / 64 while steps are all of one size);
- the cost of proposing, per draft token (`draft_seconds`: the draft model's forwards, or
  the n-gram lookup);
- per request, the probability `a` that a draft token is accepted given that the ones before
  it were (accepted / (accepted + rejections), decayed, starting from the engine-wide figure).

With B requests decoding, a token without speculation costs (c0 + c1 B) / B of step time.
The i-th draft token of a request costs c1 + draft_seconds more and yields a^i tokens in
expectation, so it is drafted when a^i (c0 + c1 B) / B > c1 + draft_seconds. A lone stream
(c0 dominant) drafts eagerly; a big batch, whose steps grow with every token, drafts only
what is almost always accepted. A request drafting nothing probes with one token after
`PROBE_INTERVAL` of its steps, so its estimate recovers when its text turns repetitive; each
probe rejected in a row doubles the wait (up to `MAX_PROBE_INTERVAL`), so a draft that is
never right (a poor draft model, text that never repeats) costs a vanishing share of steps
instead of a fixed one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256
_FORGET = 0.98  # weight of the past per step in the step-time fit
_DECAY = 0.9  # weight of the past per verified draft in a request's acceptance
_PRIOR_TOKENS = 64  # prior: a step of 64 tokens costs twice one of a single token


@dataclass
class _Acceptance:
    accepted: float
    rejected: float
    steps_without: int = 0
    failed_in_a_row: int = 0  # verified drafts with nothing accepted, since the last success

    @property
    def rate(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    @property
    def probe_interval(self) -> int:
        return min(PROBE_INTERVAL << min(self.failed_in_a_row, 8), MAX_PROBE_INTERVAL)

    def add(self, accepted: int, rejected: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + rejected


class SpeculationController:
    def __init__(self, max_tokens: int, adaptive: bool = True) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self._sums = [0.0] * 5  # weights, N, N^2, t, N t
        self.draft_seconds = 0.0
        self._engine = _Acceptance(1.0, 1.0)
        self._requests: dict[str, _Acceptance] = {}

    def step_cost(self) -> tuple[float, float]:
        """(c0, c1) of the step-time line; (1, 1/64) before any step was measured."""
        weight, n_sum, n2_sum, t_sum, nt_sum = self._sums
        if weight <= 0.0:
            return 1.0, 1.0 / _PRIOR_TOKENS
        mean_n, mean_t = n_sum / weight, t_sum / weight
        variance = max(n2_sum / weight - mean_n * mean_n, 0.0)
        covariance = nt_sum / weight - mean_n * mean_t
        prior_slope = mean_t / (_PRIOR_TOKENS + mean_n)
        ridge = (0.1 * mean_n) ** 2 + 1.0
        slope = max((covariance + ridge * prior_slope) / (variance + ridge), 0.0)
        return max(mean_t - slope * mean_n, 0.0), slope

    def num_tokens(self, request_id: str, batch_size: int) -> int:
        """Draft tokens for one request this step (0: none)."""
        if not self.adaptive:
            return self.max_tokens
        state = self._state(request_id)
        c0, c1 = self.step_cost()
        token_cost = (c0 + c1 * batch_size) / max(batch_size, 1)
        threshold = (c1 + self.draft_seconds) / max(token_cost, 1e-12)
        rate = min(state.rate, 1.0 - 1e-6)
        if threshold >= 1.0 or rate <= 0.0:
            count = 0
        elif threshold <= 0.0:
            count = self.max_tokens
        else:  # largest i with rate^i > threshold
            count = min(self.max_tokens, math.ceil(math.log(threshold) / math.log(rate)) - 1)
        if count > 0:
            state.steps_without = 0
            return count
        state.steps_without += 1
        if state.steps_without >= state.probe_interval:
            state.steps_without = 0
            return 1
        return 0

    def _state(self, request_id: str) -> _Acceptance:
        state = self._requests.get(request_id)
        if state is None:
            engine = self._engine
            total = engine.accepted + engine.rejected
            scale = 2.0 / total  # as much weight as two drafts
            state = _Acceptance(engine.accepted * scale, engine.rejected * scale)
            self._requests[request_id] = state
        return state

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        sums = self._sums
        for index, value in enumerate((1.0, num_tokens, num_tokens * num_tokens, seconds,
                                       num_tokens * seconds)):
            sums[index] = sums[index] * _FORGET + value

    def observe_proposal(self, num_draft_tokens: int, seconds: float) -> None:
        if num_draft_tokens:
            per_token = seconds / num_draft_tokens
            self.draft_seconds = 0.9 * self.draft_seconds + 0.1 * per_token \
                if self.draft_seconds else per_token

    def observe_draft(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        rejected = int(num_accepted < num_draft_tokens)
        state = self._state(request_id)
        state.add(num_accepted, rejected, _DECAY)
        state.failed_in_a_row = state.failed_in_a_row + 1 if num_accepted == 0 else 0
        self._engine.add(num_accepted, rejected, 0.999)

    def forget(self, live_request_ids: set[str]) -> None:
        for request_id in [r for r in self._requests if r not in live_request_ids]:
            del self._requests[request_id]
