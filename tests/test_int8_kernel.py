"""The int8 kernel: a row's bits do not depend on the rows beside it, and the build for this
CPU's AVX512 (VNNI's instructions, AMX's tiles where it has them) gives the AVX2 build's
results: the same integer sums (vpdpbusd adds exactly what vpmaddubsw and vpmaddwd add; for
8-bit codes, with the activations moved up by 128 and 128 times the codes' sum taken off),
then the same float32 operations per group, so equal to the bit. ATEN_CPU_CAPABILITY=avx2
makes another process build and run the library an AVX2-only CPU builds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_quantized import needs_int8, random_weight

from pagellm.kernels import quantized_linear_int8
from pagellm.model.quantized import Int8Panels

HAS_AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"

AVX2_PRODUCTS = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_int8_kernel import products
torch.save(products(), sys.argv[2])
"""

# A fresh process, where no other test has loaded the library of the other forms yet.
FORMS_BY_LIBRARY = """
import torch
from pagellm.kernels import cpu_kernels_available, quantized_linear_int8
from pagellm.model.quantized import GroupQuantWeight, Int8Panels
assert cpu_kernels_available()
other = lambda: hasattr(torch.ops.pagellm, "quantized_linear_int8_other_forms")
torch.manual_seed(0)
scales = (torch.rand(70, 6) * 0.02 + 0.001).half().float()
zeros = (torch.randn(70, 6) * 0.05).half().float() + 8 * scales  # folded: exact in float16
weight = GroupQuantWeight(torch.randint(0, 16, (70, 192), dtype=torch.uint8), scales, zeros, 4)
panels = weight.int8_panels()
x = torch.randn(9, 192)
default = quantized_linear_int8(x, panels.codes, panels.scales, panels.zeros, 70)
assert panels.scales.dtype == torch.float16 and not other()
wide = (panels.scales.float(), panels.zeros.float())
try:
    quantized_linear_int8(x, panels.codes, *wide, 70)
    raise AssertionError("the default library multiplied float32 factors")
except RuntimeError as error:
    assert "another library's" in str(error), error
wide = Int8Panels(panels.codes, *wide)
assert other()
assert torch.equal(quantized_linear_int8(x, wide.codes, wide.scales, wide.zeros, 70), default)
"""


def products() -> list[torch.Tensor]:
    """4-bit codes (two per byte) and 8-bit codes (their extremes -128 and 127 among them); groups of 32, of 32 over 2,048 inputs (chunks), and of 16 (Q6_K's halves);
    float32 and bf16; from 1 row to 385 (tiles whole and partial, blocks of rows) and a
    partial panel of features."""
    outputs = []
    for rows, cols, group_size, with_zeros in ((203, 288, 32, True), (37, 2048, 32, False),
                                               (250, 96, 16, True)):
        four_bit = random_weight(4, rows, cols, with_zeros, group_size)
        eight_bit = random_weight(8, rows, cols, with_zeros, group_size)
        eight_bit.codes[:, :2], eight_bit.codes[:, 2:4] = -128, 127
        for panels in (four_bit.int8_panels(), eight_bit.int8_panels()):
            for dtype in (torch.float32, torch.bfloat16):
                for tokens in (1, 5, 12, 13, 70, 385):
                    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
                    outputs.append(quantized_linear_int8(x.to(dtype), panels.codes, panels.scales,
                                                         panels.zeros, rows))
    return outputs


@needs_int8
@pytest.mark.skipif(not HAS_AVX512, reason="no AVX512 on this CPU: its build is the AVX2 one")
def test_the_avx512_build_gives_the_avx2_builds_results_exactly(tmp_path: Path) -> None:
    saved = tmp_path / "avx2.pt"
    subprocess.run([sys.executable, "-c", AVX2_PRODUCTS, str(Path(__file__).parent),
                    str(saved)], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}, check=True)
    avx2 = torch.load(saved)
    avx512 = products()
    assert len(avx512) == len(avx2) == 72
    for index, (got, expected) in enumerate(zip(avx512, avx2, strict=True)):
        assert torch.equal(got, expected), index


@needs_int8
@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 16), (8, 32)],
                         ids=["Q4_1", "halves", "Q8_0"])
def test_a_row_of_the_int8_kernel_does_not_depend_on_the_rows_beside_it(
        bits: int, group_size: int) -> None:
    """Tiles compute only their rows that are not padding (a decode of one request: one row
    of four), and a tile's one or two rows split each sum into two integer chains: every row
    must still be the bits it is in any other batch, from 1 row (one partial tile) to 9."""
    weight = random_weight(bits, 70, 192, True, group_size)
    panels = weight.int8_panels()
    x = torch.randn(9, 192, generator=torch.Generator().manual_seed(9))
    alone = [quantized_linear_int8(x[i:i + 1], panels.codes, panels.scales, panels.zeros, 70)
             for i in range(9)]
    for tokens in range(1, 10):
        together = quantized_linear_int8(x[:tokens], panels.codes, panels.scales, panels.zeros,
                                         70)
        for i in range(tokens):
            assert torch.equal(together[i:i + 1], alone[i]), (tokens, i)


@needs_int8
def test_each_library_multiplies_its_own_int8_forms_and_the_default_one_hands_over_the_rest(
) -> None:
    """The default library has the float16 factors of Q4_0, Q4_1 and Q8_0 (a first start
    compiles nothing more); panels with float32 factors load a library of their own when they
    are made, and the default op passes them to its op: the very bits of the float16
    panels'."""
    subprocess.run([sys.executable, "-c", FORMS_BY_LIBRARY], check=True)
    panels = random_weight(4, 70, 192, True).int8_panels()
    half = Int8Panels(panels.codes, panels.scales.half(), panels.zeros.half())
    with pytest.raises(RuntimeError, match="the default library multiplies"):
        torch.ops.pagellm.quantized_linear_int8_other_forms(
            torch.empty(1, 70), torch.randn(1, 192), half.codes, half.scales, half.zeros)
