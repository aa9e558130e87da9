// bfloat16 rows times 4-bit or 8-bit codes on AMX's bf16 tiles (Sapphire Rapids and later):
// the weights stay quantized in memory and are widened, a panel of 16 output features at a
// time, to the bf16 values the dense model multiplies (code * scale + zero, rounded to
// bf16), which the tiles then multiply with every row of the step. A decode step of tens of
// rows is bound by reading the weights: 4-bit codes are a quarter of bf16's bytes. Unlike
// the int8 kernels, the activations are not rounded, and the sums are float32 over the
// whole row, as oneDNN's bf16 matmul makes them: the results are the dense model's.
//
// panels: [P, K / 32, 16, 16] uint8 (4-bit codes) or [P, K / 32, 16, 32] int8 (8-bit), one
// bf16 tile's worth per group: row r holds inputs 32g + 2r and 32g + 2r + 1, element 2f + b
// the code of feature 16p + f for input 32g + 2r + b (0 past N); 4-bit codes two per byte,
// element i in the low nibble of byte i and element 16 + i in its high one. scales, zeros:
// [P, K / 32, 16] float32, a group's scale and zero - offset * scale, as the int8 panels'.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "quantized_linear.h"
#include "stable_ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace pagellm::quantized::bf16_tiles {
namespace {

constexpr int kTileRows = 16;  // rows of every tile
// Bytes of codes per tile row: 32 values, 4-bit ones two per byte.
template <typename Code>
constexpr int64_t kRowCodes = std::is_same_v<Code, uint8_t> ? 16 : 32;
constexpr int64_t kTileBlockRows = 256;  // rows multiplied with a widened pair of panels

// Tiles 0-3: float32 sums (16 rows x 16 features); 4, 5: activations (16 rows x 32 bf16);
// 6, 7: weights (16 rows x 16 features x 2 inputs), every tile 16 rows of 64 bytes.
void configure_bf16_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = kTileRows;
    config.bytes_per_row[tile] = 64;
  }
  load_tile_config(config);
}

// The 32 widened values of a tile row from its codes: 4-bit ones from 16 bytes, 8-bit ones
// from 32.
inline void widen_codes(const uint8_t* codes, __m512& low, __m512& high) {
  const __m512i bytes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
inline void widen_codes(const int8_t* codes, __m512& low, __m512& high) {
  const auto* half = reinterpret_cast<const __m128i*>(codes);
  low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(half)));
  high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(half + 1)));
}

// Group g of a panel's weights as a bf16 tile (16 rows x 32) into `out`, and a prefetch of the
// same group kAhead panels on: the next pair's, which the hardware prefetchers fetch too
// late (30 gate_up layers at one token, from memory: 5.6 ms without it, 2.8 with it).
template <typename Code>
inline void widen_group(const Code* codes, const float* scales, const float* zeros, int64_t g,
                        int64_t groups, __m512bh* out) {
  constexpr int64_t kAhead = 2;
  const char* next_codes = reinterpret_cast<const char*>(
      codes + (kAhead * groups + g) * kTileRows * kRowCodes<Code>);
  for (int64_t line = 0; line < kTileRows * kRowCodes<Code>; line += 64)
    _mm_prefetch(next_codes + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + (kAhead * groups + g) * kPanel), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(zeros + (kAhead * groups + g) * kPanel), _MM_HINT_T0);
  // each feature's scale for its two inputs side by side: features 0-7, then 8-15
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  const __m512 scale = _mm512_loadu_ps(scales + g * kPanel);
  const __m512 zero = _mm512_loadu_ps(zeros + g * kPanel);
  const __m512 scale_low = _mm512_permutexvar_ps(first, scale);
  const __m512 scale_high = _mm512_permutexvar_ps(second, scale);
  const __m512 zero_low = _mm512_permutexvar_ps(first, zero);
  const __m512 zero_high = _mm512_permutexvar_ps(second, zero);
  const Code* group_codes = codes + g * kTileRows * kRowCodes<Code>;
  for (int r = 0; r < kTileRows; ++r) {
    __m512 low, high;
    widen_codes(group_codes + r * kRowCodes<Code>, low, high);
    out[r] = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(high, scale_high, zero_high),
                                 _mm512_fmadd_ps(low, scale_low, zero_low));
  }
}

// One panel's codes, scales and zeros, and where its widened tiles go ([K / 32][16 rows]).
template <typename Code>
struct Panel {
  const Code* codes;
  const float* scales;
  const float* zeros;
  __m512bh* widened;
};

// Sums tiles 0-3 = (16 or 32 rows from `rows`, stride k) x (two panels): tile 2r + q holds
// row tile r times panel q. Per group: the panels' weights into tiles 6 and 7, each row
// tile's activations into 4 or 5. With kWiden, the panels are widened as the loop goes,
// group g + 1 while the tiles multiply group g (the vector units and the tiles run side by
// side); later passes over more rows reuse them.
template <typename Code, int kRowTiles, bool kWiden>
void multiply_pair(const uint16_t* rows, int64_t k, const Panel<Code> (&panels)[2], float* sums) {
  const int64_t groups = k / kGroup;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  auto widen = [&](int64_t g) {
    for (const Panel<Code>& p : panels)
      widen_group(p.codes, p.scales, p.zeros, g, groups, p.widened + g * kTileRows);
  };
  if constexpr (kWiden) widen(0);
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(6, panels[0].widened + g * kTileRows, 64);
    _tile_loadd(7, panels[1].widened + g * kTileRows, 64);
    _tile_loadd(4, rows + g * kGroup, k * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles > 1) {
      _tile_loadd(5, rows + kTileRows * k + g * kGroup, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if constexpr (kWiden) {
      if (g + 1 < groups) widen(g + 1);
    }
  }
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  if constexpr (kRowTiles > 1) {
    _tile_stored(2, sums + 512, 64);
    _tile_stored(3, sums + 768, 64);
  }
}

// `rows` rows of y from the sums of one row tile and panel ([16][16] float32).
void store_rows(const float* sums, int64_t rows, int64_t width, int64_t n, uint16_t* y) {
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh values = _mm512_cvtneps_pbh(_mm512_load_ps(sums + r * kPanel));
    _mm256_mask_storeu_epi16(y + r * n, mask, reinterpret_cast<const __m256i&>(values));
  }
}

// Rows [m0, m0 + rows) of y times one pair of panels (the panels widened on the first pass).
template <typename Code>
void multiply_block(const uint16_t* x, int64_t m0, int64_t rows, int64_t m, int64_t k,
                    int64_t n, const Panel<Code> (&pair)[2], const int64_t (&index)[2],
                    uint16_t* y) {
  alignas(64) float sums[4 * kTileRows * kPanel];
  for (int64_t r0 = m0; r0 < m0 + rows; r0 += 2 * kTileRows) {
    const bool two = m0 + rows - r0 > kTileRows, first = r0 == m0;
    const uint16_t* block = x + r0 * k;
    if (two && first) multiply_pair<Code, 2, true>(block, k, pair, sums);
    else if (two) multiply_pair<Code, 2, false>(block, k, pair, sums);
    else if (first) multiply_pair<Code, 1, true>(block, k, pair, sums);
    else multiply_pair<Code, 1, false>(block, k, pair, sums);
    for (int t = 0; t < (two ? 2 : 1); ++t) {
      const int64_t count = std::min<int64_t>(kTileRows, m - r0 - t * kTileRows);
      for (int q = 0; q < (index[1] == index[0] ? 1 : 2); ++q) {
        const int64_t n0 = index[q] * kPanel;
        store_rows(sums + (2 * t + q) * kTileRows * kPanel, count,
                   std::min<int64_t>(kPanel, n - n0), n, y + (r0 + t * kTileRows) * n + n0);
      }
    }
  }
}

// Work items are (block of kTileBlockRows rows, pair of panels), pairs fastest: a thread
// widens each of its pairs once per block, and at decode sizes (one block) once.
template <typename Code>
void run(uint16_t* y, const uint16_t* x, int64_t m, int64_t k, int64_t n, const Code* codes,
         const float* scales, const float* zeros) {
  const int64_t groups = k / kGroup, panels = (n + kPanel - 1) / kPanel, pairs = (panels + 1) / 2;
  const int64_t padded = (m + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t blocks = (padded + kTileBlockRows - 1) / kTileBlockRows;
  std::vector<uint16_t> padded_rows;  // the tiles read whole 16-row blocks
  if (padded != m) {
    padded_rows.assign(padded * k, 0);
    std::memcpy(padded_rows.data(), x, m * k * sizeof(uint16_t));
    x = padded_rows.data();
  }
  at::parallel_for(0, blocks * pairs, 1, [&](int64_t begin, int64_t end) {
    configure_bf16_tiles();
    std::vector<__m512bh> widened(2 * groups * kTileRows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pair = item % pairs, m0 = item / pairs * kTileBlockRows;
      // an odd last panel is multiplied twice and stored once
      const int64_t index[2] = {2 * pair, std::min(2 * pair + 1, panels - 1)};
      Panel<Code> pair_panels[2];
      for (int q = 0; q < 2; ++q) {
        pair_panels[q] = {codes + index[q] * groups * kTileRows * kRowCodes<Code>,
                          scales + index[q] * groups * kPanel, zeros + index[q] * groups * kPanel,
                          widened.data() + q * groups * kTileRows};
      }
      multiply_block(x, m0, std::min(kTileBlockRows, padded - m0), m, k, n, pair_panels, index,
                     y);
    }
    _tile_release();
  });
}

void quantized_linear_bf16_tiles(Tensor& y, const Tensor& x, const Tensor& panels,
                                 const Tensor& scales, const Tensor& zeros) {
  PAGELLM_CHECK(tiles_permitted(), "quantized_linear_bf16_tiles: the OS grants no AMX tiles");
  PAGELLM_CHECK(x.scalar_type() == ScalarType::BFloat16 && y.scalar_type() == ScalarType::BFloat16,
                "quantized_linear_bf16_tiles: bfloat16 rows only");
  const auto* in = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  auto* out = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  const float* s = scales.const_data_ptr<float>();
  const float* z = zeros.const_data_ptr<float>();
  if (panels.scalar_type() == ScalarType::Char) {
    run(out, in, m, k, n, panels.const_data_ptr<int8_t>(), s, z);
  } else {
    run(out, in, m, k, n, panels.const_data_ptr<uint8_t>(), s, z);
  }
}

}  // namespace
}  // namespace pagellm::quantized::bf16_tiles

// Registered only where it is compiled: Python checks for the ops, then for the OS's grant.
STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("quantized_linear_bf16_tiles(Tensor(a!) y, Tensor x, Tensor panels, Tensor scales, "
        "Tensor zeros) -> ()");
  m.def("bf16_tiles_permitted() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("quantized_linear_bf16_tiles",
         TORCH_BOX(&pagellm::quantized::bf16_tiles::quantized_linear_bf16_tiles));
}

// No tensor arguments to dispatch on: one kernel for every backend.
STABLE_TORCH_LIBRARY_IMPL(pagellm, CompositeExplicitAutograd, m) {
  m.impl("bf16_tiles_permitted", TORCH_BOX(&pagellm::quantized::tiles_permitted));
}

#endif
