// The transpose of a square tile of floats in registers: 16 x 16 with AVX512, 8 x 8 with AVX2
// (one vector a row either way). The batch-invariant decode kernel turns blocks of keys into
// columns with it, so that its scores keep the prefill kernel's order of sums; the float
// quantized kernel lays its widened panels out input-major with the 8 x 8 one.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)

namespace pagellm::float_vectors {

// r[c] = column c of the 8 x 8 floats whose rows are r[0..8), in registers.
inline void transpose_8x8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
  }
  // u[4q + m], 128-bit lane L: rows 4q..4q+3 of column 4L + m
  __m256 u[8];
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
    u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
    u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
    r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
  }
}

#if defined(__AVX512F__)
// out[c][0..16) = in[0..16)[c] for the 16 x 16 floats at `in` (rows `in_stride` apart).
inline void transpose_tile(float* out, int64_t out_stride, const float* in, int64_t in_stride) {
  __m512 r[16], t[16];
  for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(in + k * in_stride);
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
  }
  // r[4q + m], 128-bit lane L: rows 4q..4q+3 of column 4L + m
  for (int k = 0; k < 16; k += 4) {
    r[k] = _mm512_shuffle_ps(t[k], t[k + 2], 0x44);
    r[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], 0xEE);
    r[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0x44);
    r[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 a = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88);
    const __m512 b = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88);
    const __m512 e = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xDD);
    _mm512_storeu_ps(out + m * out_stride, _mm512_shuffle_f32x4(a, c, 0x88));
    _mm512_storeu_ps(out + (4 + m) * out_stride, _mm512_shuffle_f32x4(b, e, 0x88));
    _mm512_storeu_ps(out + (8 + m) * out_stride, _mm512_shuffle_f32x4(a, c, 0xDD));
    _mm512_storeu_ps(out + (12 + m) * out_stride, _mm512_shuffle_f32x4(b, e, 0xDD));
  }
}
#else
// out[c][0..8) = in[0..8)[c] for the 8 x 8 floats at `in` (rows `in_stride` apart).
inline void transpose_tile(float* out, int64_t out_stride, const float* in, int64_t in_stride) {
  __m256 r[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(in + k * in_stride);
  transpose_8x8(r);
  for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + c * out_stride, r[c]);
}
#endif

}  // namespace pagellm::float_vectors

#endif
