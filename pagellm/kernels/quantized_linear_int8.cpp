// Many rows times 4-bit or 8-bit codes in integer arithmetic, as llama.cpp multiplies its
// quantized matrices. Each row's activations are rounded to int8 per group of 32 inputs
// (scale d = max |x| / 127); vpmaddubsw multiplies the codes with those int8 values and adds
// pairs of products in int16; each group's integer sum is then scaled in float32:
//   sum_i w_i x_i ~ sum_i w_i (d q_i)
//                 = scale * d * sum_i code_i q_i + (zero - offset * scale) * d * sum_i q_i.
// The second sum is of the rounded activations too: with the exact ones, the rounding
// errors of the first would no longer meet the centered weights (code - 8) and cancel, and
// the error of a SmolLM2 projection grows 2-4 times. On AVX2 this does twice the
// multiply-adds per cycle of float32 FMAs; the price is the activations' rounding to 8 bits.
//
// 4-bit codes (0..15, unsigned): a lane adds 16 products of at most 15 * 127 in int16 for
// a whole group, which stays below 2^15. 8-bit codes (-128..127, signed: Q8_0) cannot be
// vpmaddubsw's unsigned operand, so it gets |code| and the activations take the codes'
// signs (vpsignb); a pair of products can reach 2 * 128 * 127, so each is widened to int32
// at once (vpmaddwd). That is twice the instructions of 4-bit codes, still fewer cycles
// than float32 FMAs.
//
// The codes come in panels of 16 output features, laid out at load time as vpmaddubsw wants
// them (GroupQuantWeight.int8_panels): for each 4 consecutive inputs, the 16 features' 4
// codes side by side (two vectors, features 0-7 then 8-15). Register tiles of 4 rows x 16
// features (with AVX512-VNNI, 4 rows x 32 features of two panels for 4-bit codes, 8 x 16 for
// 8-bit ones) keep their sums in registers for a whole group. The rounded
// activations are stored interleaved by tile (4 inputs of each of the tile's rows in turn),
// so a tile reads one stream rather than one per row.
//
// With AVX512-VNNI, 4-bit codes take one vpdpbusd per 4 inputs of a row and all 16 features
// (the panel's 64 bytes are one vector): it adds the products of 4 unsigned codes with 4
// signed activations to an int32 lane, the very sums vpmaddubsw and vpmaddwd give here (4-bit
// products never saturate int16), so the results are equal to the bit. 8-bit codes take it
// too, with the activations as its unsigned operand (see WideSums). A build for AVX512-VNNI
// holds only those instructions; the AVX2 build (ATEN_CPU_CAPABILITY=avx2 builds it on any
// CPU) is the one to compare them with.
//
// 4-bit codes are stored two per byte: a decode step reads every weight once for a row or a
// few, so its time is the weights' bytes, and a byte per code read twice llama.cpp's. The
// second vector (features 8-15) sits in the high nibbles of the first's bytes; a mask and a
// shift restore both vectors exactly. (The AMX kernel unpacks a panel to a byte per code
// before its tiles load it.)
//
// panels: 8-bit codes [P, K / 32, 8, 16, 4] int8, panels[p, g, j, f, b] = code of feature
// 16p + f for input 32g + 4j + b (0 past N); 4-bit codes two per byte, [P, K / 32, 8, 32]
// uint8, byte i of (p, g, j) = codes[p, g, j, i / 4, i % 4] | codes[p, g, j, 8 + i / 4, i % 4]
// << 4 in that layout. scales, zeros: [P, K / G, 16] float32, a group's
// scale and zero - offset * scale (0 past N), per group of G = 32 inputs, or 16 (Q6_K): each
// half of the 32 then sums and scales on its own, with its half of the activations' sum.
// Both may be float16 instead, where every value is exact there.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "int8_group_sums.h"
#include "int8_rows.h"
#include "quantized_linear.h"
#include "vectorizable.h"

#ifdef __AVX2__

namespace pagellm::quantized::int8 {
namespace {

// Activation rows are stored interleaved by tile of R rows: value i of row Rt + r is at
// ((t * K + i - i % 4) * R + 4r + i % 4); their scales and sums at (t * K / 32 + g) * R + r.
template <int R>
inline GroupPlace tile_interleaved(int64_t k, int64_t row, int64_t group) {
  const int64_t tile = row / R, r = row % R;
  return {(tile * k + group * kGroup) * R + 4 * r, 4 * R, (tile * (k / kGroup) + group) * R + r};
}

// One panel of the prepacked tensors; its scales and zeros float32 or float16 (S).
template <typename Codes, typename S>
struct Int8Panel {
  const typename Codes::Byte* codes;  // [K / 32, 8, Codes::kBytes]
  const S* scales;                    // [K / 32, 16]
  const S* zeros;                     // [K / 32, 16]
};

// How far ahead of the group being multiplied the first tile of a pass requests the panels'
// codes and factors. A thread reads its panels in one sequence (codes, scales and zeros
// each), yet left to the hardware prefetchers, which start afresh at each call and each
// 4 KiB page, SmolLM2's 121 projections of a one-row step read their 98 MB at 21-25 GB/s,
// where 2 threads can read 31 (benchmarks/memory_roof.py). Requested 4 KiB ahead: 3.7
// against 4.4 ms for the 121 (medians of 300 passes, alternated in one process; an AVX2
// EPYC; 1, 2 and 8 KiB ahead did less). That is with one panel per tile; a tile of several
// reads them side by side, so each requests its own group in the next tile's panels.
constexpr int64_t kCodesAhead = 4096, kFactorsAhead = 512;

struct Ahead {
  int64_t codes, factors;  // bytes
};

template <typename Policy, typename S>
Ahead ahead_of(int64_t groups, int64_t scale_groups) {
  constexpr int P = Policy::kPanels;
  if (P == 1) return {kCodesAhead, kFactorsAhead};
  return {P * groups * 8 * Policy::Codes::kBytes,
          static_cast<int64_t>(P * scale_groups * kPanel * sizeof(S))};
}

// Requests the lines `ahead` past group g's codes and factors.
template <typename Codes, int kGroupSize, typename S>
__attribute__((always_inline)) inline void request_ahead(const Int8Panel<Codes, S>& panel,
                                                         int64_t g, const Ahead& ahead) {
  const char* codes = reinterpret_cast<const char*>(panel.codes + g * 8 * Codes::kBytes);
#pragma GCC unroll 8
  for (int64_t line = 0; line < 8 * Codes::kBytes; line += 64) {
    __builtin_prefetch(codes + ahead.codes + line);
  }
  constexpr int64_t kFactors = kGroup / kGroupSize * kPanel;  // per group of 32 inputs
  __builtin_prefetch(reinterpret_cast<const char*>(panel.scales + g * kFactors) + ahead.factors);
  __builtin_prefetch(reinterpret_cast<const char*>(panel.zeros + g * kFactors) + ahead.factors);
}

// The policy's panels of a tile (Policy::kPanels of them), and where each one's sums go:
// panel i's row r at out + i * stride + r * 16.
template <typename Policy, typename S>
struct TilePanels {
  Int8Panel<typename Policy::Codes, S> panel[Policy::kPanels];
  float* out;
  int64_t stride;
  Ahead ahead;
};

// out[r * 16 + f] += sum over groups of 32 [g0, g1) for the rows of tile `tile` and each
// panel's 16 features, added group by group into the policy's accumulators; the first tile
// of a pass over the panels (`first`) requests them ahead. Inlined: a call per tile and
// chunk cost about 5%.
template <typename Policy, int kGroupSize, int kRows, typename S>
__attribute__((always_inline)) inline void int8_tile(const Int8Rows& rows, int64_t tile,
                                                     int64_t k, const TilePanels<Policy, S>& t,
                                                     int64_t g0, int64_t g1, bool first) {
  using Codes = typename Policy::Codes;
  constexpr int R = Policy::kTileRows, P = Policy::kPanels;
  const int64_t groups = k / kGroup;
  const int8_t* x = rows.values.data() + tile * k * R;
  const float* scales_of_rows = rows.scales.data() + tile * groups * R;
  const float* sums_of_rows = rows.sums.data() + tile * groups * R;
  const float* half_sums_of_rows = rows.half_sums.data() + 2 * tile * groups * R;
  // The first pass over the inputs starts its sums at zero; later ones go on from `out`.
  typename Policy::Acc acc[P][kRows];
  for (int p = 0; p < P; ++p) {
    for (int r = 0; r < kRows; ++r) {
      float* sums = t.out + p * t.stride + r * kPanel;
      acc[p][r] = g0 == 0 ? Policy::zero(sums) : Policy::load(sums);
    }
  }
  // Adds the sums of group g's inputs scaled per `factor_group` (g itself, or one of its
  // halves with that half's activation sums).
  auto add = [&](const typename Policy::Sums (&sums)[P], int64_t g, int64_t factor_group,
                 const float* row_sums) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const auto factors = Policy::factors(t.panel[p].scales + factor_group * kPanel,
                                           t.panel[p].zeros + factor_group * kPanel);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        Policy::add(sums[p][r], scales_of_rows[g * R + r], row_sums[r], factors, acc[p][r]);
      }
    }
  };
  for (int64_t g = g0; g < g1; ++g) {
    const typename Codes::Byte* codes[P];
    for (int p = 0; p < P; ++p) {
      if (first) request_ahead<Codes, kGroupSize>(t.panel[p], g, t.ahead);
      codes[p] = t.panel[p].codes + g * 8 * Codes::kBytes;
    }
    typename Policy::Sums sums[P];
    const int8_t* inputs = x + g * kGroup * R;
    if constexpr (kGroupSize == kGroup) {
      Policy::template group<kRows, 0, 8>(codes, inputs, sums);
      add(sums, g, g, sums_of_rows + g * R);
    } else {
      float half_sums[2][kRows];
      for (int r = 0; r < kRows; ++r) {
        for (int h = 0; h < 2; ++h) half_sums[h][r] = half_sums_of_rows[2 * (g * R + r) + h];
      }
      Policy::template group<kRows, 0, 4>(codes, inputs, sums);
      add(sums, g, 2 * g, half_sums[0]);
      Policy::template group<kRows, 4, 8>(codes, inputs, sums);
      add(sums, g, 2 * g + 1, half_sums[1]);
    }
  }
  for (int p = 0; p < P; ++p) {
    for (int r = 0; r < kRows; ++r) Policy::store(acc[p][r], t.out + p * t.stride + r * kPanel);
  }
}

// A tile's rows that are not padding, rounded up to 1, 2, 4 or the whole tile: a decode of
// one request computes one row, not a tile's. Each row's sums are its own, so they do not
// depend on how many are computed (padding rows are zeros, never stored).
template <typename Policy, int kGroupSize, typename S>
__attribute__((always_inline)) inline void int8_live_tile(int64_t live, const Int8Rows& rows,
                                                          int64_t tile, int64_t k,
                                                          const TilePanels<Policy, S>& t,
                                                          int64_t g0, int64_t g1, bool first) {
  constexpr int R = Policy::kTileRows;
  if (live == 1) return int8_tile<Policy, kGroupSize, 1>(rows, tile, k, t, g0, g1, first);
  if (live == 2) return int8_tile<Policy, kGroupSize, 2>(rows, tile, k, t, g0, g1, first);
  if (live <= 4 && R > 4) {
    return int8_tile<Policy, kGroupSize, 4>(rows, tile, k, t, g0, g1, first);
  }
  int8_tile<Policy, kGroupSize, R>(rows, tile, k, t, g0, g1, first);
}

// Rows [m0, m0 + rows) of one panel's float32 sums, `width` features from n0, into y of the
// activations' dtype.
template <typename T>
void store_panel(void* y, int64_t n, int64_t m0, int64_t rows, int64_t n0, int64_t width,
                 const float* out) {
  T* dst = static_cast<T*>(y);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t f = 0; f < width; ++f) store(dst + (m0 + r) * n, n0 + f, out[r * kPanel + f]);
  }
}
using StorePanel = void (*)(void*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*);

// The rounded rows times every panel, Policy::kPanels at a time: where the panels do not
// divide among them, the last tile's missing ones repeat its first, whose sums are not stored.
// Compiled once per policy, group size and factor type, whatever the activations' dtype (only
// `store` depends on it): its inlined tiles are most of this file's compile time, which a
// first start on a new machine waits for.
template <int kGroupSize, typename Policy, typename S>
__attribute__((noinline)) void multiply_rows(
    const Int8Rows& rows, int64_t m, int64_t padded, int64_t k, int64_t n,
    const typename Policy::Codes::Byte* panel_codes, const S* panel_scales,
    const S* panel_zeros, void* y, StorePanel store_rows) {
  using Codes = typename Policy::Codes;
  const int64_t groups = k / kGroup, chunk = input_chunk(k) / kGroup;
  const int64_t scale_groups = k / kGroupSize;
  constexpr int R = Policy::kTileRows, P = Policy::kPanels;
  const int64_t block_rows = std::min(kBlockRows, padded), panels = (n + kPanel - 1) / kPanel;
  auto panel_at = [&](int64_t p) {
    return Int8Panel<Codes, S>{panel_codes + p * (k / kGroup) * 8 * Codes::kBytes,
                               panel_scales + p * scale_groups * kPanel,
                               panel_zeros + p * scale_groups * kPanel};
  };
  const Ahead ahead = ahead_of<Policy, S>(groups, scale_groups);
  at::parallel_for(0, (panels + P - 1) / P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(P * block_rows * kPanel);
    for (int64_t m0 = 0; m0 < padded; m0 += block_rows) {
      const int64_t block = std::min(block_rows, padded - m0);
      for (int64_t q = begin; q < end; ++q) {
        TilePanels<Policy, S> t{{}, out.data(), block_rows * kPanel, ahead};
        for (int i = 0; i < P; ++i) t.panel[i] = panel_at(q * P + i < panels ? q * P + i : q * P);
        for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
          for (int64_t row = 0; row < block; row += R) {
            t.out = out.data() + row * kPanel;
            int8_live_tile<Policy, kGroupSize>(m - m0 - row, rows, (m0 + row) / R, k, t, g0,
                                               std::min(groups, g0 + chunk), row == 0);
          }
        }
        for (int64_t p = q * P; p < std::min(panels, q * P + P); ++p) {
          const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, n - n0);
          store_rows(y, n, m0, std::min(block, m - m0), n0, width,
                     out.data() + (p - q * P) * block_rows * kPanel);
        }
      }
    }
  });
}

template <int kGroupSize, typename Policy, typename T, typename S>
void run(T* y, const T* x, int64_t m, int64_t k, int64_t n,
         const typename Policy::Codes::Byte* panel_codes, const S* panel_scales,
         const S* panel_zeros) {
  constexpr int R = Policy::kTileRows;
  const int64_t padded = (m + R - 1) / R * R;
  const Int8Rows rows = quantize_rows(x, m, padded, k, [k](int64_t row, int64_t group) {
    return tile_interleaved<R>(k, row, group);
  });
  multiply_rows<kGroupSize, Policy, S>(rows, m, padded, k, n, panel_codes, panel_scales,
                                       panel_zeros, y, &store_panel<T>);
}

// The build's instructions: AVX512-VNNI's where it targets them, else AVX2's.
#ifdef __AVX512VNNI__
template <typename Codes>
using SumsOf = WideSums<Codes>;
#else
template <typename Codes>
using SumsOf = NarrowSums<Codes>;
#endif

// Calls run<kGroupSize> with the panels' codes: 8-bit ones (int8), or 4-bit ones two per
// byte (uint8).
template <int kGroupSize>
void multiply(const Int8Operands& operands) {
  auto run_on = [](auto* out, const auto* in, int64_t m, int64_t k, int64_t n,
                   const auto* codes, const auto* s, const auto* z) {
    using Code = std::remove_const_t<std::remove_pointer_t<decltype(codes)>>;
    using Codes = std::conditional_t<std::is_same_v<Code, uint8_t>, CodeNibbles, CodeBytes>;
    run<kGroupSize, SumsOf<Codes>>(out, in, m, k, n, codes, s, z);
  };
  dispatch_int8_operands<kGroupSize>(operands, run_on);
}

}  // namespace
}  // namespace pagellm::quantized::int8

namespace pagellm::quantized {
inline namespace PAGELLM_INT8_LIBRARY {

void int8_matmul(const Int8Operands& operands) {
  if (operands.group == kHalfGroup) {  // the AMX kernel scales whole groups of 32
    int8::multiply<kHalfGroup>(operands);
    return;
  }
  if (int8_matmul_amx(operands)) return;
  int8::multiply<kGroup>(operands);
}

}  // namespace PAGELLM_INT8_LIBRARY
}  // namespace pagellm::quantized

#endif  // __AVX2__
