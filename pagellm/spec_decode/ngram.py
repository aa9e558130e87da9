"""Prompt lookup: the tokens that followed the last time the context's tail occurred.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the last n tokens of prompt +
output are searched for earlier in the context; at the first n that matches, the k tokens
after its most recent earlier occurrence are the draft. Recent occurrences are preferred
because an edit or a summary follows the text it is copying from where it last was. It costs
one vectorised scan of the context per n, on the CPU, and proposes nothing (costing the step
nothing) where the tail never occurred before.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `token_ids`; fewer where the match is near the end."""
        if k < 1 or len(token_ids) <= self.lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.lookup_max, len(tokens) - 1), self.lookup_min - 1, -1):
            start = self._last_earlier_match(tokens, n)
            if start is not None:
                return tokens[start + n:start + n + k].tolist()
        return []

    @staticmethod
    def _last_earlier_match(tokens: np.ndarray, n: int) -> int | None:
        """Start of the latest occurrence of the last n tokens that ends before the last token."""
        tail = tokens[-n:]
        body = tokens[:-1]
        candidates = np.flatnonzero(body[:len(body) - n + 1] == tail[0])
        for offset in range(1, n):
            if candidates.size == 0:
                return None
            candidates = candidates[body[candidates + offset] == tail[offset]]
        return int(candidates[-1]) if candidates.size else None
