// The batch-invariant decode kernel's register tiles (decode_attention_invariant.cpp): its
// scores with keys along the vector lanes and its weighted sums of values with dims along
// them, each (row, key) and (row, dim) chain in the prefill kernel's order, and the passes
// over a group's query rows that run them.
#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>

#include "bf16_widening.h"
#include "float_vectors.h"

// Internal to the one kernel file that includes this (as its own definitions were), so that
// none of it is exported from the library.
namespace pagellm::kernels::decode_attention_invariant {
namespace {

using namespace pagellm::float_vectors;

// The tiles' loops over rows and vectors are unrolled by pragma: left to itself, GCC kept
// each accumulator in a register and also stored it to the stack after every FMA (one
// store per FMA, for the loop after the last to read).

// s[r][t * kWidth + lane] = the chain fma(kt[i][..], q[r][i], acc) over i = 0..d-1 from 0, for
// kRows rows and kTiles vectors of keys: the prefill kernel's chain for that (row, key). One
// key vector at a time, so that 3 rows x 4 tiles of sums, the 3 rows' query values and the
// key fit AVX2's 16 registers.
template <int kRows, int kTiles>
inline void score_tile(float* s, const float* kt, const float* q, int64_t d, int64_t keys) {
  Vec acc[kRows][kTiles];
#pragma GCC unroll 4
  for (auto& row : acc) {
#pragma GCC unroll 4
    for (auto& v : row) v = zero_vec();
  }
  for (int64_t i = 0; i < d; ++i) {
    Vec qi[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) qi[r] = broadcast(q + r * d + i);
#pragma GCC unroll 4
    for (int t = 0; t < kTiles; ++t) {
      const Vec key = load_vec(kt + i * keys + t * kWidth);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) acc[r][t] = fmadd(key, qi[r], acc[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < kTiles; ++t) store_vec(s + r * keys + t * kWidth, acc[r][t]);
  }
}

template <int kRows>
inline void score_rows(float* s, const float* kt, const float* q, int64_t d, int64_t keys) {
  int64_t k = 0;
  for (; k + 4 * kWidth <= keys; k += 4 * kWidth) score_tile<kRows, 4>(s + k, kt + k, q, d, keys);
  for (; k + 2 * kWidth <= keys; k += 2 * kWidth) score_tile<kRows, 2>(s + k, kt + k, q, d, keys);
  for (; k < keys; k += kWidth) score_tile<kRows, 1>(s + k, kt + k, q, d, keys);
}

// A block's value rows as the accumulation reads them, a vector at a time: float32 rows
// (widened into the item's scratch first) ...
struct FloatValueRows {
  const float* rows;
  int64_t d;
  static constexpr int64_t kDimStep = kWidth;  // a tile's dims start at a multiple of this
  // Vector v of row j's dims from `first`.
  Vec load(int64_t j, int64_t first, int v) const {
    return load_vec(rows + j * d + first + v * kWidth);
  }
};

// ... or bf16 rows read from the cache, widened in the registers, each 16 dims in
// bf16_widening::kPairedDim's order. Widened into scratch first, the values cost a store
// and a load again per vector on top of the widening (the AVX2 EPYC, batch 64, 160 tokens of
// context, one thread: 38 ms for 30 layers, 34 ms without the widening pass at all).
struct PairedBf16ValueRows {
  const c10::BFloat16* rows;
  int64_t d;
  static constexpr int64_t kDimStep = 16;
  Vec load(int64_t j, int64_t first, int v) const {
    constexpr int kPerSixteen = 16 / kWidth;  // vectors per 16 dims
    __m256 low, high;
    bf16_widening::widen_paired(rows + j * d + first + v / kPerSixteen * 16, low, high);
#if defined(__AVX512F__)
    const __m512d halves = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)),
                                              _mm256_castps_pd(high), 1);
    return _mm512_castpd_ps(halves);
#else
    return v % 2 == 0 ? low : high;
#endif
  }
};

// ot[r][first..) = ot[r][first..) * correction[r], then fma(values[j][first..], p[r][j], acc)
// for the block's keys j ascending: the prefill kernel's accumulate_tile with dims along the
// lanes. Registers as in score_tile: the rows' weights for key j, then one value vector at a
// time.
template <int kRows, int kVecs, typename Values>
inline void accumulate_tile(float* ot, const Values& values, int64_t first, const float* p,
                            const float* correction, int64_t count, int64_t d, int64_t keys) {
  Vec acc[kRows][kVecs];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    const Vec c = broadcast(correction + r);
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) acc[r][v] = mul(load_vec(ot + r * d + first + v * kWidth), c);
  }
  for (int64_t j = 0; j < count; ++j) {
    Vec pj[kRows];
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) pj[r] = broadcast(p + r * keys + j);
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      const Vec value = values.load(j, first, v);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) acc[r][v] = fmadd(value, pj[r], acc[r][v]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) store_vec(ot + r * d + first + v * kWidth, acc[r][v]);
  }
}

// Tiles of 4 vectors of dims, then of as few as start at multiples of Values::kDimStep.
template <int kRows, typename Values>
inline void accumulate_rows(float* ot, const Values& values, const float* p,
                            const float* correction, int64_t count, int64_t d, int64_t keys) {
  constexpr int kRest = Values::kDimStep / kWidth;
  int64_t i = 0;
  for (; i + 4 * kWidth <= d; i += 4 * kWidth) {
    accumulate_tile<kRows, 4>(ot, values, i, p, correction, count, d, keys);
  }
  for (; i < d; i += kRest * kWidth) {
    accumulate_tile<kRows, kRest>(ot, values, i, p, correction, count, d, keys);
  }
}

// Calls f(r, rows) for the group's query rows in passes of 3 rows where it can, else 2, else
// 1 (rows an integral_constant). A pass's FMA chains run side by side: 3 rows of 4 vectors
// are 12, enough to cover the FMA's latency, where 2 rows and then 1 left the last pass
// waiting on it. Each (row, key) chain is the same whichever pass computes it.
template <typename F>
inline void in_row_passes(int64_t group, F&& f) {
  for (int64_t r = 0; r < group;) {
    const int64_t left = group - r;
    if (left == 3 || left >= 5) {
      f(r, std::integral_constant<int, 3>{});
      r += 3;
    } else if (left >= 2) {
      f(r, std::integral_constant<int, 2>{});
      r += 2;
    } else {
      f(r, std::integral_constant<int, 1>{});
      r += 1;
    }
  }
}

inline int row_passes(int64_t group) {
  int passes = 0;
  in_row_passes(group, [&](int64_t, auto) { ++passes; });
  return passes;
}

}  // namespace
}  // namespace pagellm::kernels::decode_attention_invariant

#endif
