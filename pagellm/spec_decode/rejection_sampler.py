"""Which draft tokens a verifying step keeps, so that every output token still follows the
target model's distribution (Leviathan et al. 2023; Chen et al. 2023).

A draft token x at position i, drawn from the draft's q, is accepted with probability
min(1, p(x) / q(x)), p being the target's (processed) distribution there. On the first
rejection the output is a token drawn from the residual max(0, p - q), normalised, and the
step ends; when all are accepted, a bonus token is drawn from p after the last draft.

Where q is one-hot at x (n-gram drafts, greedy drafts) the acceptance probability is p(x) and
the residual is p with x removed, so the rule is the same as sampling y ~ p and accepting
while y == x, y being the output where they differ. `accept_matching` does exactly that with
the tokens the sampler drew at each position with the noise it would have used without
speculation: greedy rows accept while the draft equals the argmax, and a seeded row gives
the very tokens it gives without speculation.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MIX = 0x9E3779B97F4A7C15
_U63 = (1 << 63) - 1


def seeded_generator(seed: int, words: tuple[int, ...], device: torch.device) -> torch.Generator:
    """A generator that is a pure function of a request's seed and `words` (its sibling
    index, its step, ...), so that its draws do not depend on the rest of the batch."""
    mixed = seed & _U63
    for word in words:
        mixed = ((mixed ^ word) * _MIX) & _U63
    generator = torch.Generator(device=device)
    generator.manual_seed(mixed)
    return generator


def accept_matching(sampled: list[int], draft: list[int]) -> list[int]:
    """The output of a step that sampled `sampled` [len(draft) + 1] at the draft's positions:
    the draft while it matches, then the first sampled token that differs (or the bonus)."""
    for index, token in enumerate(draft):
        if sampled[index] != token:
            return sampled[:index + 1]
    return sampled[:len(draft) + 1]


def rejection_sample(target_probs: Tensor, draft_probs: Tensor, draft: list[int],
                     generator: torch.Generator | None) -> list[int]:
    """The output for `draft` [k] drawn from `draft_probs` [k, V], verified against
    `target_probs` [k + 1, V] (the last row for the bonus token)."""
    k = len(draft)
    positions = torch.arange(k, device=target_probs.device)
    tokens = torch.tensor(draft, dtype=torch.long, device=target_probs.device)
    p = target_probs[positions, tokens]
    q = draft_probs[positions, tokens]
    uniforms = torch.rand(k, generator=generator, device=target_probs.device,
                          dtype=target_probs.dtype)
    # u < p / q, written without the division (q may be 0 for a token the draft forced)
    rejected = (uniforms * q >= p).tolist()
    for index, reject in enumerate(rejected):
        if reject:
            residual = (target_probs[index] - draft_probs[index]).clamp_min_(0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself
                residual = target_probs[index]
            recovered = torch.multinomial(residual, 1, generator=generator)
            return draft[:index] + [int(recovered)]
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    return draft + [int(bonus)]
