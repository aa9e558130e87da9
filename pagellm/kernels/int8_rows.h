// Activation rows rounded to int8 per group of 32 inputs, for the int8 kernels
// (quantized_linear_int8.cpp on AVX2, quantized_linear_amx.cpp on AMX tiles), each in its
// own layout: a group's step d = max |x| / 127, and d times the sum of its rounded values
// (and of each half's, for weights scaled per 16 inputs).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>

#include "quantized_linear.h"
#include "vectorizable.h"

namespace pagellm::quantized {

struct Int8Rows {
  std::vector<int8_t> values;  // the layout's
  std::vector<float> scales;   // d of each group, at the layout's index
  std::vector<float> sums;     // d times each group's sum of q, likewise
  std::vector<float> half_sums;  // d times the sums of its first and last 16, at 2 * index + h
};

// Where a layout puts group g of row r: its 32 values, 4 at a time `stride` bytes apart from
// `values`, and its scale and sum at index `at`.
struct GroupPlace {
  int64_t values, stride, at;
};

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// One group of 32 activations to int8 steps of d = max |x| / 127, rounded to nearest (even);
// stores the 32 steps, 4 at a time `stride` bytes apart, and returns their sum (and that of
// the first 16 in `front_sum`).
inline int32_t quantize_group(const float* x, float& d, int8_t* out, int64_t stride,
                              int32_t& front_sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], largest = _mm256_setzero_ps();
  for (int q = 0; q < 4; ++q) {
    v[q] = _mm256_loadu_ps(x + 8 * q);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[q]));
  }
  const float amax = horizontal_max(largest);
  d = amax / 127.f;
  const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i steps[4];
  for (int q = 0; q < 4; ++q) steps[q] = _mm256_cvtps_epi32(_mm256_mul_ps(v[q], inverse));
  const __m256i front = _mm256_add_epi32(steps[0], steps[1]);
  const __m256i sum = _mm256_add_epi32(front, _mm256_add_epi32(steps[2], steps[3]));
  front_sum = horizontal_sum(front);
  // packs work within 128-bit lanes: the bytes come out as 0-3 8-11 4-7 12-15 (in 4s)
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(steps[0], steps[1]),
                                           _mm256_packs_epi32(steps[2], steps[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  alignas(32) int32_t words[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(words), _mm256_permutevar8x32_epi32(bytes, order));
  for (int j = 0; j < 8; ++j) std::memcpy(out + j * stride, &words[j], sizeof(int32_t));
  return horizontal_sum(sum);
}

// Rows [m, k] of x, padded with zero rows to `padded`, placed by place(row, group).
template <typename T, typename Place>
Int8Rows quantize_rows(const T* x, int64_t m, int64_t padded, int64_t k, Place&& place) {
  const int64_t groups = k / kGroup;
  Int8Rows rows{std::vector<int8_t>(padded * k, 0), std::vector<float>(padded * groups, 0.f),
                std::vector<float>(padded * groups, 0.f),
                std::vector<float>(2 * padded * groups, 0.f)};
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    float values[kGroup];
    for (int64_t g = begin; g < end; ++g) {
      const float* group = nullptr;
      if constexpr (std::is_same_v<T, float>) {
        group = x + g * kGroup;
      } else {
        for (int i = 0; i < kGroup; ++i) values[i] = load(x, g * kGroup + i);
        group = values;
      }
      const GroupPlace p = place(g / groups, g % groups);
      int32_t front = 0;
      const int32_t sum = quantize_group(group, rows.scales[p.at], rows.values.data() + p.values,
                                         p.stride, front);
      const float d = rows.scales[p.at];
      rows.sums[p.at] = d * static_cast<float>(sum);
      rows.half_sums[2 * p.at] = d * static_cast<float>(front);
      rows.half_sums[2 * p.at + 1] = d * static_cast<float>(sum - front);
    }
  });
  return rows;
}

// Calls multiply(y, x, m, k, n, codes, scales, zeros) with pointers of x's dtype, of the
// panels' code type (uint8_t: 4-bit codes, int8_t: 8-bit ones) and of the scales' and zeros'
// type (float, or c10::Half where every factor is exact in float16): one kernel's `run`, for
// the forms of groups of kGroupSize inputs this library compiles (int8_form_compiled).
template <int64_t kGroupSize, typename Multiply>
void dispatch_int8_operands(const Int8Operands& op, Multiply&& multiply) {
  auto with_activations = [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(op.y);
    const T* in = static_cast<const T*>(op.x);
    auto with_factors = [&](auto factor_tag) {
      using S = decltype(factor_tag);
      const S* s = static_cast<const S*>(op.scales);
      const S* z = static_cast<const S*>(op.zeros);
      if (op.nibbles) {
        multiply(out, in, op.m, op.k, op.n, static_cast<const uint8_t*>(op.codes), s, z);
      } else {
        multiply(out, in, op.m, op.k, op.n, static_cast<const int8_t*>(op.codes), s, z);
      }
    };
    if (op.half_factors) {
      if constexpr (int8_form_compiled(true, kGroupSize)) with_factors(c10::Half{});
    } else {
      if constexpr (int8_form_compiled(false, kGroupSize)) with_factors(float{});
    }  // other forms are the other library's: its op never passes them here
  };
  switch (op.dtype) {
    case Activations::kFloat: with_activations(float{}); break;
    case Activations::kBFloat16: with_activations(c10::BFloat16{}); break;
    case Activations::kHalf: with_activations(c10::Half{}); break;
  }
}

}  // namespace pagellm::quantized

#endif  // __AVX2__
