"""A sampled token's log probability, as the engine core reports it to the front end.

Its own torch-free module: the scheduler, the requests and the front end carry these
without importing the sampler (and torch) that computes them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely token
    top: list[tuple[int, float]]  # (token id, logprob), best first
