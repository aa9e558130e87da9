"""Building blocks of the decoder: RMSNorm, rotary embedding and the SwiGLU MLP."""

from __future__ import annotations

import math
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import (add_rms_norm_, rms_norm_, rotary_embedding_, silu_and_mul,
                             use_cpu_kernels)
from pagellm.model.quantized import Linear


class RMSNorm(nn.Module):
    """Normalizes in float32 and scales in the input dtype, as the reference models do.

    With a `residual`, first adds it (the decoder's running sum) and returns both the
    normalized sum and the sum: one fused pass on CPU, where both are updated in place.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = x.dim() == 2 and use_cpu_kernels(x)
        if residual is None:
            if not fused:
                return self._normalize(x)
            out = x.clone()
            rms_norm_(out, self.weight, self.eps)
            return out
        if not fused:
            residual = x + residual
            return self._normalize(residual), residual
        add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: dict[str, Any] | None) -> torch.Tensor:
    """Per-pair rotation speeds `theta^(-2i/d)`, adjusted by the checkpoint's RoPE scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_frequencies(inv_freq, theta, scaling)
    return inv_freq


def _yarn_frequencies(inv_freq: torch.Tensor, theta: float,
                      scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: pairs that turn more than `beta_fast` times over the original context keep their
    speed, pairs that turn fewer than `beta_slow` times are slowed by `factor`, and a linear
    ramp over the pair index blends the band between (transformers' `yarn`)."""
    dim = 2 * inv_freq.numel()
    original_len = scaling["original_max_position_embeddings"]

    def pair_turning(rotations: float) -> float:  # the pair index that turns `rotations` times
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = pair_turning(scaling.get("beta_fast") or 32)
    high = pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling["factor"] * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN's scale of cos and sin (so of q.k by its square): `attention_factor`, else from
    `factor` and the `mscale` pair as transformers derives it; 1 for other RoPE types."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(weight: float) -> float:
        factor = scaling["factor"]
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale(1.0)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Slow long wavelengths by `factor`, keep short ones, blend the band between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position, computed once per device in float32.

    The table is a plain attribute rather than a buffer so that casting the model to
    bf16 keeps it exact, and so that building the model on the meta device is free.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self._table: torch.Tensor | None = None  # [max_positions, head_dim]: cos half, sin half

    def _compute_table(self, device: torch.device) -> torch.Tensor:
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]
        return torch.cat([angles.cos(), angles.sin()], dim=-1) * rope_attention_factor(
            self.scaling)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's row `[T, head_dim]`: cos of every pair, then sin of every pair."""
        if self._table is None or self._table.device != positions.device:
            self._table = self._compute_table(positions.device)
        return self._table[positions]


def rotate_(x: torch.Tensor, angles: torch.Tensor) -> None:
    """Rotate pairs (i, i + d/2) of `x` `[T, heads, head_dim]` in place ("rotate half" layout),
    in float32 math, by the `[T, head_dim]` rows of `RotaryEmbedding`."""
    if use_cpu_kernels(x):
        rotary_embedding_(x, angles)
        return
    cos, sin = angles.unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


class GatedMLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))` with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.shard_sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if use_cpu_kernels(gate_up):
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
