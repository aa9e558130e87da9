"""GGUF-quantized weights, multiplied as the file stores them.

A step of a few tokens reads every weight once for a handful of rows, so it is
bound by memory traffic: 4-bit codes are an eighth of float32's bytes, 8-bit
codes a quarter. A larger step is bound by compute; there the kernel widens the
codes in panels and multiplies them as a dense matmul does, which against the
CPU's tuned dense matmul wins or loses depending on the CPU and the shape. A
layer therefore keeps both forms and picks one per step from its number of
tokens, up to a size measured at start-up (`measure_max_tokens`). The quantized
form holds the file's exact codes and scales: both compute with the same weights.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import cpu_kernels_available, quantized_linear

GROUP_SIZE = 32  # weights sharing one scale and zero along the input dimension
CANDIDATE_MAX_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
# A shape whose quantized path still wins at the largest candidate keeps it at every size:
# from there on both paths run at their compute peak.
ANY_TOKENS = sys.maxsize
# Layers of a shape timed together, times tokens: all of SmolLM2's 30 layers up to 64
# tokens, fewer beyond, where the weights' place in memory no longer matters.
MEASURED_LAYER_TOKENS = 2048


@dataclass
class GroupQuantWeight:
    """weight[o, i] = (codes[o, i] - offset) * scales[o, i // 32] + zeros[o, i // 32],
    with offset 8 for 4-bit codes (uint8 0..15) and 0 for 8-bit ones (int8)."""

    codes: torch.Tensor  # [out, in]
    scales: torch.Tensor  # [out, in // GROUP_SIZE] float32
    zeros: torch.Tensor | None  # like scales; None where every zero is 0 (Q4_0, Q8_0)
    bits: int

    @property
    def offset(self) -> int:
        return 8 if self.bits == 4 else 0

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupQuantWeight:
        """Apply the same reordering of output rows to codes, scales and zeros."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return GroupQuantWeight(fn(self.codes), fn(self.scales), zeros, self.bits)

    @staticmethod
    def cat(parts: Sequence[GroupQuantWeight]) -> GroupQuantWeight:
        """Stack along the output rows, as fused projections do."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError("cannot fuse matrices quantized with different bit widths")
        zeros = None
        if any(p.zeros is not None for p in parts):
            zeros = torch.cat([torch.zeros_like(p.scales) if p.zeros is None else p.zeros
                               for p in parts])
        return GroupQuantWeight(torch.cat([p.codes for p in parts]),
                                torch.cat([p.scales for p in parts]), zeros, parts[0].bits)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes stand for."""
        expand = lambda t: t.repeat_interleave(GROUP_SIZE, dim=1)  # noqa: E731
        weight = (self.codes.float() - self.offset) * expand(self.scales)
        return weight if self.zeros is None else weight + expand(self.zeros)

    def kernel_codes(self) -> torch.Tensor:
        """The codes in the kernel's layout: 8-bit as is; 4-bit two per byte, element j of a
        group in the low nibble of byte j and element 16 + j in its high nibble."""
        if self.bits == 8:
            return self.codes.contiguous()
        rows, cols = self.codes.shape
        halves = self.codes.reshape(rows, cols // GROUP_SIZE, 2, GROUP_SIZE // 2)
        return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def quantized_supported(device: torch.device) -> bool:
    """The kernel is a CPU one; CUDA would need its own."""
    return device.type == "cpu" and cpu_kernels_available()


class Linear(nn.Linear):
    """An nn.Linear that may also hold its weight quantized, used for steps of few tokens."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.quantized: GroupQuantWeight | None = None  # codes in the kernel's layout
        self.quantized_max_tokens = 0
        self.int8_activations = False  # 4-bit codes times int8-rounded activations (see kernel)

    def attach_quantized(self, weight: GroupQuantWeight, max_tokens: int,
                         int8_activations: bool = False) -> None:
        if weight.codes.shape != self.weight.shape:
            raise ValueError(f"quantized weight of shape {tuple(weight.codes.shape)} for a layer "
                             f"of shape {tuple(self.weight.shape)}.")
        zeros = None if weight.zeros is None else weight.zeros.contiguous()
        self.quantized = GroupQuantWeight(weight.kernel_codes(), weight.scales.contiguous(), zeros,
                                          weight.bits)
        self.quantized_max_tokens = max_tokens
        self.int8_activations = int8_activations

    def quantized_bytes(self) -> int:
        q = self.quantized
        if q is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (q.codes, q.scales, q.zeros)
                   if t is not None)

    def quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        assert q is not None
        out = quantized_linear(x, q.codes, q.scales, q.zeros, q.bits, self.out_features,
                               self.int8_activations)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized_max_tokens:
            return self.quantized_forward(x)
        return F.linear(x, self.weight, self.bias)


def measure_max_tokens(layers: Sequence[Linear], dtype: torch.dtype) -> dict[str, int]:
    """Set each layer's `quantized_max_tokens` to the largest step size (of
    CANDIDATE_MAX_TOKENS) at which the quantized weights beat the dense ones on this CPU, or
    0, or ANY_TOKENS past the largest. Layers of one shape are timed together, in one pass over all of them, so that the
    weights come from memory as they do in a model step. Every candidate is timed: near
    parity a noisy loss at one size must not decide the larger ones. Returns the sizes by
    shape."""
    shapes: dict[tuple[int, int, int], list[Linear]] = defaultdict(list)
    for layer in layers:
        assert layer.quantized is not None
        shapes[(layer.in_features, layer.out_features, layer.quantized.bits)].append(layer)
    chosen = {}
    for (in_features, out_features, bits), group in shapes.items():
        best = 0
        for tokens in CANDIDATE_MAX_TOKENS:
            x = torch.randn(tokens, in_features).to(dtype)
            timed = group[:max(1, MEASURED_LAYER_TOKENS // tokens)]
            quantized = _best_seconds(lambda: [layer.quantized_forward(x) for layer in timed])
            dense = _best_seconds(lambda: [F.linear(x, layer.weight) for layer in timed])
            if quantized < dense:
                best = tokens
        if best == CANDIDATE_MAX_TOKENS[-1]:
            best = ANY_TOKENS
        for layer in group:
            layer.quantized_max_tokens = best
        chosen[f"{in_features}x{out_features} Q{bits}"] = best
    return chosen


def _best_seconds(fn: Callable[[], object], tries: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
