"""Noise for the exponential race, as log(q) with q ~ Exp(1).

argmax(probs / q) == argmax(logits - log q), so the sampler never needs a softmax.

Seeded rows get counter-based noise: a pure function of (seed, seed_stream,
step, vocab index), so a row's tokens do not depend on what else is in the
batch or where the row sits. All hashing is 32-bit arithmetic carried in int64
tensors; every product stays below 2**63 so nothing overflows on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_BIT31 = 1 << 31
_GOLDEN = 0x9E3779B9
_SEED_SALT = 0x243F6A88
_UNIFORM_SCALE = 2.0 ** -24


def _mul32_(x: Tensor, constant: int, scratch: Tensor) -> Tensor:
    """x = (x * constant) mod 2**32 in place, for 0 <= x < 2**32, never leaving int64 range."""
    if constant < _BIT31:
        return x.mul_(constant).bitwise_and_(_MASK32)
    torch.bitwise_and(x, 1, out=scratch).bitwise_left_shift_(31)  # x * 2**31 mod 2**32
    return x.mul_(constant - _BIT31).add_(scratch).bitwise_and_(_MASK32)


def _xorshift_(x: Tensor, shift: int, scratch: Tensor) -> Tensor:
    torch.bitwise_right_shift(x, shift, out=scratch)
    return x.bitwise_xor_(scratch)


def fmix32_(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with good avalanche), in place."""
    scratch = torch.empty_like(x)
    _xorshift_(x, 16, scratch)
    _mul32_(x, 0x85EBCA6B, scratch)
    _xorshift_(x, 13, scratch)
    _mul32_(x, 0xC2B2AE35, scratch)
    return _xorshift_(x, 16, scratch)


def seeded_row_keys(seeds: Tensor, streams: Tensor, steps: Tensor) -> Tensor:
    """One 32-bit key per row from its (seed mod 2**64, stream, step); int64 in, int64 out."""
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    key = fmix32_(seed_lo ^ _SEED_SALT)
    for word in (seed_hi, streams & _MASK32, steps & _MASK32):
        key = fmix32_(key ^ word)
    return key


def seeded_log_exponential(keys: Tensor, vocab_size: int) -> Tensor:
    """log Exp(1) noise [rows, vocab] from a splitmix-style hash of (row key, vocab index)."""
    weyl = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    weyl = _mul32_(weyl, _GOLDEN, torch.empty_like(weyl))
    bits = fmix32_((keys.unsqueeze(1) + weyl.unsqueeze(0)).bitwise_and_(_MASK32))
    # The top 24 bits give a float32-exact uniform strictly inside (0, 1).
    uniform = bits.bitwise_right_shift_(8).to(torch.float32)
    return uniform.add_(0.5).mul_(_UNIFORM_SCALE).log_().neg_().log_()


def random_log_exponential(num_rows: int, vocab_size: int, device: torch.device,
                           generator: torch.Generator | None) -> Tensor:
    """log Exp(1) noise from `generator`, via q = -log(U); U = 0 gives +inf, which only excludes a token."""
    uniform = torch.rand(num_rows, vocab_size, device=device, dtype=torch.float32, generator=generator)
    return uniform.log_().neg_().log_()
