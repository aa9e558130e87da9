"""4-bit weights for small steps: GGUF Q4 matrices through PyTorch's int4 CPU matmul.

A step of a few tokens reads every weight once for a handful of rows, so it is
bound by memory bandwidth: reading 4-bit codes instead of bf16 values cuts that
traffic about 3.5x. A large step is bound by compute, where the int4 kernel (which
unpacks as it multiplies) is slower than the bf16 matmul. A layer therefore keeps
both forms and picks one per step from its number of tokens. The 4-bit form holds
the file's exact codes and scales, so both compute with the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32  # weights sharing one scale and zero along the input dimension


@dataclass
class Int4Weight:
    """weight[o, i] = (codes[o, i] - 8) * scales[o, i // 32] + zeros[o, i // 32]."""

    codes: torch.Tensor  # [out, in] uint8, 0..15
    scales: torch.Tensor  # [out, in // GROUP_SIZE] float32
    zeros: torch.Tensor  # [out, in // GROUP_SIZE] float32

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Int4Weight:
        """Apply the same reordering of output rows to codes, scales and zeros."""
        return Int4Weight(fn(self.codes), fn(self.scales), fn(self.zeros))

    @staticmethod
    def cat(parts: Sequence[Int4Weight]) -> Int4Weight:
        """Stack along the output rows, as fused projections do."""
        return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.zeros for p in parts]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes stand for."""
        expand = lambda t: t.repeat_interleave(GROUP_SIZE, dim=1)  # noqa: E731
        return (self.codes.float() - 8) * expand(self.scales) + expand(self.zeros)


def int4_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """PyTorch's int4 CPU kernel takes bf16, fp16 or fp32 activations; CUDA's needs another
    packing, not done here."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16, torch.float32)


class Linear(nn.Linear):
    """An nn.Linear that may also hold its weight in 4 bits, used for steps of few tokens."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.int4_packed: torch.Tensor | None = None
        self.int4_scales_zeros: torch.Tensor | None = None
        self.int4_max_tokens = 0

    def attach_int4(self, weight: Int4Weight, max_tokens: int) -> None:
        if weight.codes.shape != self.weight.shape:
            raise ValueError(f"4-bit weight of shape {tuple(weight.codes.shape)} for a layer of "
                             f"shape {tuple(self.weight.shape)}.")
        self.int4_packed = torch._convert_weight_to_int4pack_for_cpu(
            weight.codes.to(torch.int32), 1)
        self.int4_scales_zeros = torch.stack([weight.scales.T, weight.zeros.T], dim=-1).to(
            self.weight.dtype).contiguous()  # [in // GROUP_SIZE, out, 2], the kernel's layout
        self.int4_max_tokens = max_tokens

    def int4_bytes(self) -> int:
        if self.int4_packed is None or self.int4_scales_zeros is None:
            return 0
        return (self.int4_packed.numel() * self.int4_packed.element_size()
                + self.int4_scales_zeros.numel() * self.int4_scales_zeros.element_size())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4_packed is not None and x.shape[0] <= self.int4_max_tokens:
            out = torch._weight_int4pack_mm_for_cpu(x, self.int4_packed, GROUP_SIZE,
                                                    self.int4_scales_zeros)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)
