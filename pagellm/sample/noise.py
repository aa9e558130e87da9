"""Noise for the exponential race, as log(q) with q ~ Exp(1).

argmax(probs / q) == argmax(logits - log q), so the sampler never needs a softmax.

The noise is counter-based: a hash of (row key, vocab index). A seeded row's key is
a pure function of (seed, seed_stream, step), so its tokens do not depend on what
else is in the batch or where the row sits; other rows draw their key from the
engine's generator. On CPU one kernel hashes and subtracts in a single pass. The
torch version carries the 32-bit hashing in int64 tensors; every product stays
below 2**63 so nothing overflows on any device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pagellm.kernels import subtract_log_exponential_, use_cpu_kernels

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


def hashed_log_exponential(keys: Tensor, vocab_size: int) -> Tensor:
    """log Exp(1) noise [rows, vocab] from a splitmix-style hash of (row key, vocab index)."""
    weyl = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    weyl = _mul32_(weyl, _GOLDEN, torch.empty_like(weyl))
    bits = fmix32_((keys.unsqueeze(1) + weyl.unsqueeze(0)).bitwise_and_(_MASK32))
    # The top 24 bits give a float32-exact uniform strictly inside (0, 1).
    uniform = bits.bitwise_right_shift_(8).to(torch.float32)
    return uniform.add_(0.5).mul_(_UNIFORM_SCALE).log_().neg_().log_()


def random_row_keys(num_rows: int, device: torch.device,
                    generator: torch.Generator | None) -> Tensor:
    """32-bit noise keys [num_rows] int64 drawn from `generator`, for unseeded rows."""
    return torch.randint(0, 1 << 32, (num_rows,), dtype=torch.int64, device=device,
                         generator=generator)


def subtract_noise_(logits: Tensor, keys: Tensor) -> Tensor:
    """logits [rows, vocab] -= log Exp(1) noise from each row's key, in place."""
    if use_cpu_kernels(logits) and logits.dtype == torch.float32 and logits.is_contiguous():
        subtract_log_exponential_(logits, keys)
        return logits
    return logits.sub_(hashed_log_exponential(keys, logits.shape[1]))
