"""torch's own CPU matmul paths that pagellm's projections use beside its kernels: oneDNN's
bf16 matmul on weights packed once, and the weight-only int4 kernel for small steps."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from pagellm.model.quantized import GroupQuantWeight

# The step size oneDNN is told to expect when it packs a weight: a decode step's, where the
# dense path is bound by reading the weights.
PACKED_BATCH_HINT = 64
# Steps of up to this many tokens may multiply 4-bit codes with torch's weight-only int4
# kernel instead (bf16 activations): it beats ours 2x at 1-8 tokens on an AVX512 CPU, and
# slows down past that (1.35 ms over 30 gate_up layers at 1 token, 4.8 at 8).
TORCH_INT4_MAX_TOKENS = 8


def packed_weights_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN multiplies bf16 on this CPU (AVX512-BF16 or AMX) from packed weights."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] bf16 weight in oneDNN's blocked layout, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclasses.dataclass
class TorchInt4:
    """4-bit codes for torch's weight-only int4 CPU kernel, which computes w = (code - 8) *
    scale + zero per group of 32, as GroupQuantWeight does: the file's codes, their scales
    and zeros rounded to bf16."""

    ROWS: ClassVar[int] = 16  # the kernel wants whole multiples of this many output rows

    codes: torch.Tensor  # torch's packed layout
    scales_and_zeros: torch.Tensor  # [in // 32, out, 2] bf16

    @staticmethod
    def of(weight: GroupQuantWeight) -> TorchInt4:
        zeros = torch.zeros_like(weight.scales) if weight.zeros is None else weight.zeros
        pairs = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(torch.bfloat16)
        codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        return TorchInt4(codes, pairs.contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        group_size = x.shape[1] // self.scales_and_zeros.shape[0]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.codes, group_size,
                                                          self.scales_and_zeros)
