// The decode attention kernel's key scoring (paged_attention.cpp): scores of a block's keys
// against the query heads that share their kv head, with the widest instructions the CPU
// has for the query and cache dtypes. Each returns false where it does not apply.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vectorizable.h"

namespace pagellm::attention_scores {

#if defined(__AVX512BF16__)
// Sum of each of 16 vectors, as one vector: sums[t] = sum of v[t]'s lanes. A reduction
// tree over the vectors together: 2.8 instructions per vector, against 8 for a horizontal
// sum of each.
inline __m512 sum_each(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // each 128-bit lane: v[2i] and v[2i+1] in alternate places
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: v[4i..4i+3], that lane's sums
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: quads[2i] halves, then quads[2i+1] ones
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
#endif

// Scores of `count` consecutive bf16 key rows against bf16 queries with AVX512-BF16's
// dot-product instruction: products of bf16 pairs are exact in float32 and summed there,
// so the result matches widening both first, in half the instructions. 16 keys at a time
// for one head, their sums reduced together (sum_each); the last count % 16 one by one.
// Returns false where it does not apply (other dtypes or head sizes, CPUs without the
// instruction), leaving the scores to the generic path.
template <typename T, typename C, int64_t kDim>
bool score_with_dot_instruction(float* scores, int64_t stride, const T* query, const C* keys,
                                int64_t count, int64_t group, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
                kDim > 0 && kDim % 32 == 0) {
    constexpr int64_t kChunks = kDim / 32;  // 32 bf16 values per 512-bit register
    auto key_chunk = [&](int64_t t, int64_t c) {
      return (__m512bh)_mm512_loadu_si512(keys + t * kDim + c * 32);
    };
    for (int64_t g = 0; g < group; ++g) {
      __m512bh head[kChunks];
      for (int64_t c = 0; c < kChunks; ++c)
        head[c] = (__m512bh)_mm512_loadu_si512(query + g * kDim + c * 32);
      int64_t t0 = 0;
      for (; t0 + 16 <= count; t0 += 16) {
        __m512 sums[16];
        for (int t = 0; t < 16; ++t) {
          sums[t] = _mm512_setzero_ps();
          for (int64_t c = 0; c < kChunks; ++c)
            sums[t] = _mm512_dpbf16_ps(sums[t], head[c], key_chunk(t0 + t, c));
        }
        _mm512_storeu_ps(scores + g * stride + t0,
                         _mm512_mul_ps(sum_each(sums), _mm512_set1_ps(scale)));
      }
      for (; t0 < count; ++t0) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < kChunks; ++c)
          sum = _mm512_dpbf16_ps(sum, head[c], key_chunk(t0, c));
        scores[g * stride + t0] = _mm512_reduce_add_ps(sum) * scale;
      }
    }
    return true;
  }
#endif
  return false;
}

#if defined(__AVX512BF16__)
// The bf16 bits of every fp8 magnitude (codes 0-127, sign apart), 32 per register: fp8 to
// bf16 is then two table lookups per 32 values, where widening through float16 and float32
// took ten instructions per 16.
template <bool kE4M3>
struct Fp8Bf16Table {
  __m512i parts[4];

  Fp8Bf16Table() {
    alignas(64) uint16_t bits[128];
    for (int code = 0; code < 128; ++code) {  // exact: the float32 value has 7 bits or fewer
      const float value = kE4M3 ? fp8_to_float(static_cast<uint8_t>(code), 3, 0x1p120f)
                                : fp8_to_float(static_cast<uint8_t>(code), 2, 0x1p112f);
      bits[code] = static_cast<uint16_t>(float_to_bits(value) >> 16);
    }
    for (int i = 0; i < 4; ++i) parts[i] = _mm512_load_si512(bits + 32 * i);
  }

  // 32 fp8 codes as bf16 bits.
  __m512i lookup(const uint8_t* codes) const {
    const __m512i words =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i low = _mm512_permutex2var_epi16(parts[0], words, parts[1]);  // codes 0-63
    const __m512i high = _mm512_permutex2var_epi16(parts[2], words, parts[3]);
    const __mmask32 upper = _mm512_test_epi16_mask(words, _mm512_set1_epi16(0x40));
    const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(words, _mm512_set1_epi16(0x80)), 8);
    return _mm512_or_si512(_mm512_mask_blend_epi16(upper, low, high), sign);
  }
};
#endif

// fp8 keys scored as bf16 ones (score_with_dot_instruction): a block's rows are widened to
// bf16 first, exactly (every e4m3 and e5m2 value is a bf16 value), into `widened`,
// requesting `next` (unless null) a line per 64 keys' values along the way. Widened to
// float32 and scored with AVX2 instead, an fp8 cache was bound by that arithmetic: slower
// than a bf16 one of twice its bytes. False where it does not apply.
template <typename T, typename C, int64_t kDim>
bool score_fp8_with_dot_instruction(float* scores, int64_t stride, const T* query, const C* keys,
                                    const C* next, int64_t count, int64_t group, float scale,
                                    c10::BFloat16* widened) {
#if defined(__AVX512BF16__)
  constexpr bool kE4M3 = std::is_same_v<C, c10::Float8_e4m3fn>;
  constexpr bool kFp8 = kE4M3 || std::is_same_v<C, c10::Float8_e5m2>;
  if constexpr (kFp8 && std::is_same_v<T, c10::BFloat16> && kDim > 0 && kDim % 32 == 0) {
    static const Fp8Bf16Table<kE4M3> table;
    const auto* bytes = reinterpret_cast<const uint8_t*>(keys);
    for (int64_t i = 0; i < count * kDim; i += 32) {
      if (next != nullptr && i % 64 == 0) __builtin_prefetch(next + i);
      _mm512_storeu_si512(widened + i, table.lookup(bytes + i));
    }
    return score_with_dot_instruction<T, c10::BFloat16, kDim>(scores, stride, query, widened,
                                                              count, group, scale);
  }
#endif
  return false;
}

#if defined(__AVX2__)
// Sum of each of 8 vectors, as one vector: sums[t] = sum of v[t]'s lanes.
inline __m256 sum_each(const __m256 (&v)[8]) {
  const __m256 pairs0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 pairs1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(pairs0, pairs1, 0x20),
                       _mm256_permute2f128_ps(pairs0, pairs1, 0x31));
}
#endif

// scores[g * stride + t] = q[g] . keys[t] for float32 rows of kDim values. On AVX2, 8 keys
// at a time for one head, in 8 independent sums reduced together: a dot product per key
// would wait on its own chain of adds and on a horizontal sum. Rows past `count` (up to
// the next multiple of 8) are read but their scores dropped. False where it does not apply.
template <int64_t kDim>
bool score_eight_at_a_time(float* scores, int64_t stride, const float* q, const float* keys,
                           int64_t count, int64_t group) {
#if defined(__AVX2__)
  if constexpr (kDim > 0 && kDim % 8 == 0) {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t0 = 0; t0 < count; t0 += 8) {
        __m256 sums[8];
        for (int t = 0; t < 8; ++t) sums[t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < kDim; c += 8) {
          const __m256 query = _mm256_loadu_ps(q + g * kDim + c);
          for (int t = 0; t < 8; ++t) {
            sums[t] = _mm256_fmadd_ps(query, _mm256_loadu_ps(keys + (t0 + t) * kDim + c), sums[t]);
          }
        }
        alignas(32) float eight[8];
        _mm256_store_ps(eight, sum_each(sums));
        std::copy(eight, eight + std::min<int64_t>(8, count - t0), scores + g * stride + t0);
      }
    }
    return true;
  }
#endif
  return false;
}

}  // namespace pagellm::attention_scores
