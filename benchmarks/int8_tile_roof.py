"""How close the AVX2 int8 kernel is to what its own inner loop allows on this CPU.

The int8 kernel (`pagellm/kernels/quantized_linear_int8.cpp`) spends its time in two kinds of
work: a tile's integer products (for each 4 inputs, unpack the 4-bit codes, then per row
two vpmaddubsw and two int16 adds; `group_sums` in `int8_group_sums.h`), and after each group
of 32 inputs the group's float32 scaling (widen, convert, scale, add the zero term). This
builds a probe that runs the kernel's very `group_sums` over codes and activations that
stay in L1, without the scaling, on torch's threads, and prints it beside the kernel called
on SmolLM2's gate/up projection: the products alone are the kernel's ceiling here, and
the gap between the two is the scaling and the data movement. AVX2 instructions, as the
int8 kernel's AVX2 build has them; a CPU with AVX512-VNNI runs other instructions.

    python benchmarks/int8_tile_roof.py
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from best_of import best_seconds

from pagellm.kernels import int8_matmul_available

_KERNELS = Path(__file__).resolve().parents[1] / "pagellm" / "kernels"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_quantized import random_weight  # noqa: E402

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "int8_group_sums.h"

using namespace pagellm::quantized::int8;

// `groups` groups of a 4-row tile's integer products on each of `threads` threads, from 16
// groups of codes and activations that each thread cycles through (L1-resident), and with
// `scaled` each group's scaling into the rows' float32 sums as the kernel does it (add_group,
// float16 factors as a GGUF's); returns a checksum, so that no sum can be left out.
int64_t tile_products(int64_t groups, int64_t threads, bool scaled) {
  constexpr int kGroups = 16, R = kNarrowTileRows;
  std::vector<int64_t> partial(threads * 8, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
      alignas(64) uint8_t codes[kGroups][8 * CodeNibbles::kBytes];
      alignas(64) int8_t inputs[kGroups][8 * R * 4];
      for (int g = 0; g < kGroups; ++g) {
        for (int i = 0; i < 8 * CodeNibbles::kBytes; ++i) codes[g][i] = (g * 31 + i * 7) & 0xFF;
        for (int i = 0; i < 8 * R * 4; ++i) inputs[g][i] = static_cast<int8_t>(g * 13 - i * 5);
      }
      c10::Half factors[kGroups][16];
      for (int g = 0; g < kGroups; ++g) {
        for (int f = 0; f < 16; ++f) factors[g][f] = c10::Half(0.01f * (g + f));
      }
      alignas(64) float out[R * 16] = {};
      __m256i total = _mm256_setzero_si256();
      for (int64_t g = 0; g < groups; ++g) {
        __m256i sums[R][2];
        group_sums<CodeNibbles, R, 0, 8>(codes[g % kGroups], inputs[g % kGroups], sums);
        const NarrowFactors group_factors =
            load_narrow_factors(factors[g % kGroups], factors[(g + 1) % kGroups]);
        for (int r = 0; r < R; ++r) {
          if (scaled) {
            add_group(sums[r], 0.5f + r, 1.5f - r, group_factors, out + r * 16);
          } else {
            total = _mm256_add_epi32(total, _mm256_add_epi32(sums[r][0], sums[r][1]));
          }
        }
      }
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
      for (int32_t lane : lanes) partial[thread * 8] += lane;
      for (float value : out) partial[thread * 8] += static_cast<int64_t>(value);
    }
  });
  int64_t checksum = 0;
  for (int64_t value : partial) checksum += value;
  return checksum;
}

TORCH_LIBRARY_FRAGMENT(pagellm_bench, m) { m.def("tile_products", &tile_products); }
"""

# SmolLM2's gate/up projection: 576 inputs, 3072 features, 4-bit codes
K, N = 576, 3072
_OPS_PER_GROUP = 2 * 4 * 16 * 32  # a tile's rows x a panel's features x a group's inputs


@functools.cache
def _build() -> None:
    load_inline(name="pagellm_int8_tile_roof", cpp_sources=_SOURCE,
                extra_include_paths=[str(_KERNELS)],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
                extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)


def products_gops(threads: int, scaled: bool, groups: int = 200_000) -> float:
    _build()
    seconds = best_seconds(
        lambda: torch.ops.pagellm_bench.tile_products(groups, threads, scaled), tries=20)
    return threads * groups * _OPS_PER_GROUP / seconds / 1e9


def kernel_gops(rows: int) -> float:
    """The kernel on Q4_1-style panels: float16 factors, as a GGUF's and the probe's."""
    weight = random_weight(4, N, K, True)
    weight.scales = weight.scales.half().float()
    weight.zeros = weight.zeros.half().float() + 8 * weight.scales  # folded: exact in float16
    panels = weight.int8_panels()
    assert panels.scales.dtype == torch.float16
    calls = max(1, 512 // rows)
    x, y = torch.randn(rows, K), torch.empty(rows, N)

    def call() -> None:
        for _ in range(calls):
            torch.ops.pagellm.quantized_linear_int8(y, x, panels.codes, panels.scales,
                                                    panels.zeros)
    return calls * 2 * rows * K * N / best_seconds(call, tries=20) / 1e9


def main() -> None:
    if not int8_matmul_available():
        sys.exit("the int8 matmul kernel is not built on this CPU (it needs AVX2)")
    for threads in sorted({torch.get_num_threads(), 1}):
        torch.set_num_threads(threads)
        roof, scaled = products_gops(threads, False), products_gops(threads, True)
        kernel = {rows: kernel_gops(rows) for rows in (64, 2048)}
        shares = ", ".join(f"{rows} rows {gops:.0f} ({gops / roof:.0%})"
                           for rows, gops in kernel.items())
        print(f"{threads} thread(s), GOP/s: a tile's products alone {roof:.0f}, with each "
              f"group's scaling {scaled:.0f} ({scaled / roof:.0%}); the kernel on {K} x {N}: "
              f"{shares}", flush=True)


if __name__ == "__main__":
    main()
