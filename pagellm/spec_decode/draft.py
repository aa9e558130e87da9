"""The draft of one request for one step: what the proposer guessed, and what verifying it
needs besides the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Draft:
    """`token_ids` follow the request's last token. `probs` [len, vocab] is the distribution
    each was sampled from (a draft model sampling probabilistically), None where every draft
    token is one-hot (n-gram, greedy drafts). `grammars[i]` is the request's grammar after the
    first i draft tokens (structured outputs), None without a grammar."""

    token_ids: list[int]
    probs: Tensor | None = None
    grammars: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncate(self, length: int) -> None:
        del self.token_ids[length:]
        if self.probs is not None:
            self.probs = self.probs[:length]
        if self.grammars is not None:
            del self.grammars[length + 1:]
