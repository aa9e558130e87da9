// bf16 keys and values widened to float32 in fewer instructions, for the batch-invariant
// decode kernel (decode_attention_invariant.cpp). A bf16 value is the top half of its
// float32, so interleaving it with a zero half (vpunpck*wd) widens it exactly, one
// instruction per 8 values where vpmovzxwd and a shift take two, and lane-crossing ones too.
// The unpacks work within 128-bit lanes, which reorders what they widen; both forms below
// say where each value lands. 256-bit instructions, for AVX2 and AVX512 builds alike.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#if defined(__AVX2__)

namespace pagellm::bf16_widening {

// Values widened by widen_paired land in this order within each 16: position p holds the
// value of dim kPairedDim[p] (the low halves of the two 128-bit lanes, then the high ones).
constexpr int kPairedDim[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// The 16 values from `row` as float32 in kPairedDim's order: positions 0-7 in `low`, 8-15 in
// `high`.
inline void widen_paired(const c10::BFloat16* row, __m256& low, __m256& high) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits));
  high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits));
}

// out[i * out_stride + k] = keys[k * key_stride + i] as float32 for 8 keys k (zeros from key
// `count` on) and 16 dims i: the widening and the transpose at once, in the 16-bit halves.
// Three rounds of unpacks transpose each 128-bit lane's 8 x 8; the widening unpacks and a
// lane swap then give each dim its own vector.
inline void widen_transpose_8x16(float* out, int64_t out_stride, const c10::BFloat16* keys,
                                 int64_t key_stride, int64_t count) {
  __m256i r[8], a[8];
  for (int k = 0; k < 8; ++k) {
    r[k] = k < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + k * key_stride))
                     : _mm256_setzero_si256();
  }
  for (int k = 0; k < 8; k += 2) {  // a[k]: keys k, k+1 interleaved, dims 0-3; a[k+1]: 4-7
    a[k] = _mm256_unpacklo_epi16(r[k], r[k + 1]);
    a[k + 1] = _mm256_unpackhi_epi16(r[k], r[k + 1]);
  }
  for (int q = 0; q < 8; q += 4) {  // r[q + m]: keys q..q+3 of dims 2m, 2m+1 (in each lane)
    r[q] = _mm256_unpacklo_epi32(a[q], a[q + 2]);
    r[q + 1] = _mm256_unpackhi_epi32(a[q], a[q + 2]);
    r[q + 2] = _mm256_unpacklo_epi32(a[q + 1], a[q + 3]);
    r[q + 3] = _mm256_unpackhi_epi32(a[q + 1], a[q + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // a[2m + h]: keys 0-7 of dim 2m + h (lane L: dim 8L + 2m + h)
    a[2 * m] = _mm256_unpacklo_epi64(r[m], r[4 + m]);
    a[2 * m + 1] = _mm256_unpackhi_epi64(r[m], r[4 + m]);
  }
  const __m256i zero = _mm256_setzero_si256();
  for (int m = 0; m < 8; ++m) {
    const __m256 low = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, a[m]));  // keys 0-3
    const __m256 high = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, a[m]));  // keys 4-7
    _mm256_storeu_ps(out + m * out_stride, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(out + (8 + m) * out_stride, _mm256_permute2f128_ps(low, high, 0x31));
  }
}

}  // namespace pagellm::bf16_widening

#endif
