"""GGUF-quantized weights, multiplied as the file stores them.

A step of a few tokens reads every weight once for a handful of rows, so it is
bound by memory traffic: 4-bit codes are an eighth of float32's bytes, 8-bit
codes a quarter. A larger step is bound by compute; there the kernel widens the
codes in panels and multiplies them as a dense matmul does, which against the
CPU's tuned dense matmul wins or loses depending on the CPU and the shape. A
layer therefore keeps both forms and picks one per step from its number of
tokens, up to a size measured at start-up (`measure_max_tokens`). The quantized
form holds the file's exact codes and scales: both compute with the same weights.

With int8 activations (the engine's default for GGUF files), a large step multiplies
the codes with its activations rounded to int8 per 32 inputs, as llama.cpp does: on
AVX2, twice float32's multiply-adds per cycle for 4-bit codes, about 1.2x for 8-bit
ones; no longer exactly the dequantized model. Those layers also keep their codes
rearranged into the int8 kernel's panels (4-bit ones two per byte, as the file holds them).
Whether they also need float weights is measured
before any are loaded (`int8_beats_dense`): on an AVX2 CPU the int8 path wins at every
step size, so the layers keep nothing else (the float weights would be 4-8x their
bytes); on a CPU whose bf16 matmul runs on AMX tiles (2.9 TFLOP/s on two cores, 7x the
AVX2 int8 kernel), the dense one wins from a few tokens on, and the layers keep both
forms like the others.

On a CPU with AMX's bf16 tiles and a bf16 model, the steps torch's int4 kernel does not
serve instead widen the codes to bf16 a panel at a time and multiply them on the tiles
(`Bf16Tiles`): the dense model's products from a quarter of its weight bytes, and no int8
rounding.

Batch invariance (the engine's default) rules all of that choosing out: each form rounds
differently, so a row's result would depend on how many rows share its step, and the timed
choices on how busy the machine was at start-up. A batch-invariant layer multiplies one
form at every step size, in one order of sums whatever the number of rows: its int8 panels
(int8 activations), or else its codes widened to float32 (the exact dequantized model).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import (cpu_kernels_available, int8_matmul_available, quantized_linear,
                             quantized_linear_bf16_tiles, quantized_linear_int8,
                             require_int8_other_forms)
from pagellm.model.torch_matmul import TORCH_INT4_MAX_TOKENS, TorchInt4, pack_weight, packed_linear

CODE_BLOCK = 32  # inputs the kernels widen and lay out together: one scale or two
PANEL_SIZE = 16  # output rows per panel of the int8 kernel
INT8_MIN_TOKENS = 12  # from here the kernels work in panels, where int8 pays
# Up to here torch's int4 kernel beats the bf16 tiles on 4-bit codes (SmolLM2's shapes, from
# memory: `python benchmarks/quantized_forms.py`); the tiles beat pagellm's float kernel at
# every size.
TORCH_INT4_BEFORE_TILES_MAX_TOKENS = 4
# A layer whose quantized path wins at every step size (see quantized_timing.py).
ANY_TOKENS = sys.maxsize


@dataclasses.dataclass
class GroupQuantWeight:
    """weight[o, i] = (codes[o, i] - offset) * scales[o, i // G] + zeros[o, i // G],
    with offset 8 for 4-bit codes (uint8 0..15) and 0 for 8-bit ones (int8), and the group
    size G 32, or 16 for 8-bit codes (Q6_K's scales are per 16 weights)."""

    codes: torch.Tensor  # [out, in]
    scales: torch.Tensor  # [out, in // G] float32
    zeros: torch.Tensor | None  # like scales; None where every zero is 0 (Q4_0, Q8_0, Q6_K)
    bits: int

    @property
    def offset(self) -> int:
        return 8 if self.bits == 4 else 0

    @property
    def group_size(self) -> int:
        """4-bit codes (which kernel_codes packs two per byte) are always in groups of 32."""
        return CODE_BLOCK if self.bits == 4 else self.codes.shape[1] // self.scales.shape[1]

    def in_groups_of(self, size: int) -> GroupQuantWeight:
        """The same weights with each scale and zero repeated over groups of `size`."""
        if size == self.group_size:
            return self
        weight = self.as_8_bit()
        repeat = lambda t: t.repeat_interleave(self.group_size // size, dim=1)  # noqa: E731
        zeros = None if weight.zeros is None else repeat(weight.zeros)
        return GroupQuantWeight(weight.codes, repeat(weight.scales), zeros, 8)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupQuantWeight:
        """Apply the same reordering of output rows to codes, scales and zeros."""
        zeros = None if self.zeros is None else fn(self.zeros)
        return GroupQuantWeight(fn(self.codes), fn(self.scales), zeros, self.bits)

    def folded_zeros(self) -> torch.Tensor:
        """Each group's zero with the offset folded in: w = code * scale + folded zero."""
        zeros = -self.offset * self.scales
        return zeros if self.zeros is None else self.zeros + zeros

    def as_8_bit(self) -> GroupQuantWeight:
        """The same weights as 8-bit codes (4-bit codes 0..15, offset folded into the
        zeros)."""
        if self.bits == 8:
            return self
        return GroupQuantWeight(self.codes.to(torch.int8), self.scales, self.folded_zeros(), 8)

    @staticmethod
    def cat(parts: Sequence[GroupQuantWeight]) -> GroupQuantWeight:
        """Stack along the output rows, as fused projections do; parts of mixed widths (a
        K-quant file's Q4_K and Q5_K shards of one projection) as 8-bit codes, and of mixed
        group sizes (Q4_K's q and k with Q6_K's v) in the smallest groups."""
        smallest = min(p.group_size for p in parts)
        parts = [p.in_groups_of(smallest) for p in parts]
        if len({p.bits for p in parts}) != 1:
            parts = [p.as_8_bit() for p in parts]
        zeros = None
        if any(p.zeros is not None for p in parts):
            zeros = torch.cat([torch.zeros_like(p.scales) if p.zeros is None else p.zeros
                               for p in parts])
        return GroupQuantWeight(torch.cat([p.codes for p in parts]),
                                torch.cat([p.scales for p in parts]), zeros, parts[0].bits)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these codes stand for."""
        expand = lambda t: t.repeat_interleave(self.group_size, dim=1)  # noqa: E731
        weight = (self.codes.float() - self.offset) * expand(self.scales)
        return weight if self.zeros is None else weight + expand(self.zeros)

    def in_kernel_layout(self) -> GroupQuantWeight:
        """These weights as quantized_linear reads them (see kernel_codes)."""
        zeros = None if self.zeros is None else self.zeros.contiguous()
        return GroupQuantWeight(self.kernel_codes(), self.scales.contiguous(), zeros, self.bits)

    def kernel_codes(self) -> torch.Tensor:
        """The codes in the kernel's layout: 8-bit as is; 4-bit two per byte, element j of a
        group in the low nibble of byte j and element 16 + j in its high nibble."""
        if self.bits == 8:
            return self.codes.contiguous()
        rows, cols = self.codes.shape
        halves = self.codes.reshape(rows, cols // CODE_BLOCK, 2, CODE_BLOCK // 2)
        return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()

    def int8_panels(self) -> Int8Panels:
        """The codes as the int8 kernel reads them (see Int8Panels), the scales and zeros of
        groups of 32 in float16 where that is exact."""
        codes = _by_panel(self.codes)  # [P, 16, in]
        codes = codes.reshape(*codes.shape[:2], -1, CODE_BLOCK // 4, 4)
        codes = codes.permute(0, 2, 3, 1, 4)  # [P, in // 32, 8, 16, 4]
        if self.bits == 4:
            halves = codes.reshape(*codes.shape[:3], 2, -1)  # features 0-7, then 8-15
            codes = halves[..., 0, :] | (halves[..., 1, :] << 4)
        factors = self._panel_factors()
        if self.group_size == CODE_BLOCK:  # the kernels take float16 factors per 32 only
            factors = _float16_if_exact(factors)
        return Int8Panels(codes.contiguous(), *factors)

    def bf16_tiles(self) -> Bf16Tiles:
        """The codes as the bf16 tile kernel reads them (see Bf16Tiles)."""
        codes = _by_panel(self.codes)  # [P, 16, in]
        codes = codes.reshape(*codes.shape[:2], -1, CODE_BLOCK // 2, 2).permute(0, 2, 3, 1, 4)
        codes = codes.reshape(*codes.shape[:3], 2 * PANEL_SIZE)
        if self.bits == 4:
            codes = codes[..., :PANEL_SIZE] | (codes[..., PANEL_SIZE:] << 4)
        return Bf16Tiles(codes.contiguous(), *self._panel_factors())

    def _panel_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and folded zeros by panel: [P, in // G, 16] each."""
        return (_by_panel(self.scales).transpose(1, 2).contiguous(),
                _by_panel(self.folded_zeros()).transpose(1, 2).contiguous())


def _float16_if_exact(factors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The panels' scales and zeros in float16 if every value survives the trip. Q4_0, Q4_1
    and Q8_0 store theirs in float16 (Q4_0's zero, -8 times its scale, is exact too): a decode
    step then reads 2 bytes for each instead of 4, with the same results. A K-quant's are
    products of two scales, which float16 seldom holds."""
    halves = tuple(t.to(torch.float16) for t in factors)
    exact = all(torch.equal(half.float(), t) for half, t in zip(halves, factors))
    return halves if exact else factors


def form_tensors(form: QuantizedForm) -> list[torch.Tensor]:
    fields = (getattr(form, field.name) for field in dataclasses.fields(form))
    return [t for t in fields if isinstance(t, torch.Tensor)]


def _nbytes(form: QuantizedForm) -> int:
    """The bytes of a quantized form's tensors."""
    return sum(t.numel() * t.element_size() for t in form_tensors(form))


def _by_panel(t: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> [ceil(rows / 16), 16, cols], the last panel padded with zero rows."""
    panels = -(-t.shape[0] // PANEL_SIZE)
    return F.pad(t, (0, 0, 0, panels * PANEL_SIZE - t.shape[0])).reshape(panels, PANEL_SIZE, -1)


@dataclasses.dataclass
class Int8Panels:
    """A matrix for quantized_linear_int8, in panels of 16 output rows (zero-padded):
    codes[p, g, j, f, b] = code of row 16p + f for input 32g + 4j + b; per group, each
    row's scale and zero - offset * scale, so that w = code * scale + (zero - offset *
    scale), per group of G = 32 or 16 inputs (the weight's group size).

    4-bit codes are two per byte: codes[p, g, j, i] = code[p, g, j, i // 4, i % 4] |
    code[p, g, j, 8 + i // 4, i % 4] << 4, features 8-15 in the high nibbles of features
    0-7's bytes (half the bytes for a decode step to read)."""

    # [P, in // 32, 8, 16, 4] int8 (8-bit codes), or [P, in // 32, 8, 32] uint8 (4-bit codes
    # two per byte)
    codes: torch.Tensor
    scales: torch.Tensor  # [P, in // G, 16] float32, or float16 where exact
    zeros: torch.Tensor  # [P, in // G, 16] as the scales

    def __post_init__(self) -> None:
        """Panels with float32 factors, which the default kernel library leaves out (see
        quantized_linear.h), load the library whose op the default one hands them to, now
        rather than in the first step that multiplies them."""
        if self.scales.dtype != torch.float16 and int8_matmul_available():
            require_int8_other_forms()


@dataclasses.dataclass
class Bf16Tiles:
    """A matrix for quantized_linear_bf16_tiles, in panels of 16 output rows (zero-padded),
    each group of 32 inputs one bf16 tile: codes[p, g, r, 2f + b] = code of row 16p + f for
    input 32g + 2r + b, 4-bit codes two per byte (element i low, 16 + i high); scales and
    zeros as Int8Panels'."""

    codes: torch.Tensor  # [P, in // 32, 16, 16] uint8 (4-bit codes) or [..., 32] int8 (8-bit)
    scales: torch.Tensor  # [P, in // 32, 16] float32
    zeros: torch.Tensor  # [P, in // 32, 16] float32


QuantizedForm = GroupQuantWeight | Int8Panels | Bf16Tiles | TorchInt4


def quantized_supported(device: torch.device) -> bool:
    """The kernel is a CPU one; CUDA would need its own."""
    return device.type == "cpu" and cpu_kernels_available()


class Linear(nn.Linear):
    """An nn.Linear that may also hold its weight quantized, used for steps of up to
    `quantized_max_tokens` tokens."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.quantized: GroupQuantWeight | None = None  # codes in the kernel's layout
        self.quantized_max_tokens = 0
        # the codes for steps of INT8_MIN_TOKENS or more, times int8-rounded activations
        self.int8_panels: Int8Panels | None = None
        self.bf16_tiles: Bf16Tiles | None = None  # the codes on AMX's bf16 tiles
        self.dense_released = False
        self.packed: torch.Tensor | None = None  # the float weight in oneDNN's layout
        self.torch_int4: TorchInt4 | None = None  # 4-bit codes for torch's small-step kernel
        self.torch_int4_max_tokens = 0  # the steps it serves (measured: choose_torch_int4)
        self.int8_min_tokens = INT8_MIN_TOKENS  # the smallest step the int8 panels multiply
        self.batch_invariant = False  # one form and one order of sums at every step size

    def attach_quantized(self, weight: GroupQuantWeight, max_tokens: int,
                         int8_activations: bool = False, bf16_tiles: bool = False) -> None:
        """`int8_activations` applies where the CPU has the int8 kernel; `bf16_tiles` (a bf16
        layer on a CPU with AMX-BF16, see bf16_tiles_available) replaces it. See
        attach_batch_invariant for the engine's default."""
        self._check_shape(weight)
        self.quantized = weight.in_kernel_layout()
        self.quantized_max_tokens = max_tokens
        # the tile kernel scales whole groups of 32 (groups of 16 take the other forms)
        use_tiles = (bf16_tiles and self.weight.dtype == torch.bfloat16
                     and weight.group_size == CODE_BLOCK)
        self.bf16_tiles = weight.bf16_tiles() if use_tiles else None
        use_int8 = int8_activations and int8_matmul_available() and not use_tiles
        self.int8_panels = weight.int8_panels() if use_int8 else None
        if (weight.bits == 4 and self.weight.dtype == torch.bfloat16
                and self.out_features % TorchInt4.ROWS == 0):
            self.torch_int4 = TorchInt4.of(weight)
            self.torch_int4_max_tokens = (TORCH_INT4_BEFORE_TILES_MAX_TOKENS if use_tiles
                                          else TORCH_INT4_MAX_TOKENS)

    def attach_batch_invariant(self, weight: GroupQuantWeight, int8_activations: bool) -> None:
        """Multiply one quantized form at every step size: the int8 panels where
        `int8_activations` applies (and then no other form is kept), else the codes in
        float32, in panels at every size."""
        self._check_shape(weight)
        self.quantized_max_tokens = ANY_TOKENS
        if int8_activations and int8_matmul_available():
            self.int8_panels = weight.int8_panels()
        else:
            self.quantized = weight.in_kernel_layout()
        self.int8_min_tokens = 0  # even an empty step (a last layer with no row to sample)
        self.batch_invariant = True

    def _check_shape(self, weight: GroupQuantWeight) -> None:
        if weight.codes.shape != self.weight.shape:
            raise ValueError(f"quantized weight of shape {tuple(weight.codes.shape)} for a layer "
                             f"of shape {tuple(self.weight.shape)}.")

    def release_dense(self) -> None:
        """Multiply the quantized form at every step size and free the float weight (4x the
        bytes of 8-bit codes, 8x those of 4-bit ones), which is then never loaded."""
        assert self.quantized is not None or self.int8_panels is not None
        self.quantized_max_tokens = ANY_TOKENS
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.dense_released = True

    def drop_unused_forms(self) -> None:
        """Free the forms no step size up to the measured one multiplies (the int8 panels
        below INT8_MIN_TOKENS, for one), and all quantized codes at 0. From INT8_MIN_TOKENS
        on, every step multiplies the same form."""
        sizes = range(1, min(self.quantized_max_tokens, INT8_MIN_TOKENS) + 1)
        used = [self.quantized_form(tokens) for tokens in sizes]
        for name in ("int8_panels", "bf16_tiles", "torch_int4"):
            if not any(getattr(self, name) is form for form in used):
                setattr(self, name, None)
        if self.quantized_max_tokens == 0:
            self.quantized = None

    def pack_dense(self, shared: bool) -> None:
        """Keep the float weight in oneDNN's blocked layout (`packed_weights_supported`). A
        plain one is repacked at every call, which at decode sizes costs about as much as
        the multiply: SmolLM2's 121 projections at 64 tokens, 27.4 -> 17.1 ms. The plain
        weight is freed unless it is `shared` (a tied output projection's embeddings)."""
        self.packed = pack_weight(self.weight)
        if not shared:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def quantized_forms(self) -> list[QuantizedForm]:
        """The forms of the quantized codes this layer keeps."""
        forms = (self.quantized, self.int8_panels, self.bf16_tiles, self.torch_int4)
        return [form for form in forms if form is not None]

    def may_use_float_kernel(self) -> bool:
        """Whether some step size multiplies the codes with float activations
        (quantized_linear, one of the kernels built on demand)."""
        return (self.quantized is not None and self.bf16_tiles is None
                and (self.int8_panels is None or self.int8_min_tokens > 1))

    def quantized_bytes(self) -> int:
        return sum(_nbytes(form) for form in self.quantized_forms())

    def packed_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def bytes_read(self, tokens: int) -> int:
        """Bytes of the form that a step of `tokens` tokens multiplies: all of it is read."""
        quantized = 0 < self.quantized_max_tokens and tokens <= self.quantized_max_tokens
        return sum(t.numel() * t.element_size() for t in self.tensors_read(tokens, quantized))

    def tensors_read(self, tokens: int, quantized: bool) -> list[torch.Tensor]:
        """The tensors a step of `tokens` tokens reads on the quantized or the dense path."""
        if quantized:
            return form_tensors(self.quantized_form(tokens))
        return [self.weight if self.packed is None else self.packed]

    def quantized_form(self, tokens: int) -> QuantizedForm:
        """The quantized form a step of `tokens` tokens multiplies."""
        if self.torch_int4 is not None and tokens <= self.torch_int4_max_tokens:
            return self.torch_int4
        if self.bf16_tiles is not None:
            return self.bf16_tiles
        if self.int8_panels is not None and tokens >= self.int8_min_tokens:
            return self.int8_panels
        assert self.quantized is not None
        return self.quantized

    def dense_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def quantized_forward(self, x: torch.Tensor, form: QuantizedForm | None = None
                          ) -> torch.Tensor:
        """x times the form a step of its size multiplies, or `form`."""
        form = self.quantized_form(x.shape[0]) if form is None else form
        if isinstance(form, Int8Panels):
            out = quantized_linear_int8(x, form.codes, form.scales, form.zeros, self.out_features)
        elif isinstance(form, Bf16Tiles):
            out = quantized_linear_bf16_tiles(x, form.codes, form.scales, form.zeros,
                                              self.out_features)
        elif isinstance(form, TorchInt4):
            out = form.matmul(x)
        else:
            out = self.float_kernel_forward(x)
        return out if self.bias is None else out + self.bias

    def float_kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """pagellm's kernel on the codes, widened to float32 (no bias)."""
        q = self.quantized
        assert q is not None
        return quantized_linear(x, q.codes, q.scales, q.zeros, q.bits, self.out_features,
                                panels_only=self.batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized_max_tokens and x.shape[0] <= self.quantized_max_tokens:
            return self.quantized_forward(x)
        return self.dense_forward(x)
