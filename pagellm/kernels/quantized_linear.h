// Pieces shared by the two panel paths of the quantized matmul (quantized_linear.cpp):
// float32 panels, and 4-bit codes multiplied in int8 (quantized_linear_int8.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace pagellm::quantized {

constexpr int64_t kGroup = 32;        // weights sharing one scale and zero along the input
constexpr int kPanel = 16;            // output features per panel: two vectors
constexpr int64_t kBlockRows = 192;   // rows multiplied with a panel per widening of it

typedef float f32x8 __attribute__((vector_size(32)));

template <typename V>
inline V load_bytes(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x8 load_f32x8(const float* p) { return load_bytes<f32x8>(p); }

// Transpose 8 vectors of 8 32-bit lanes in place: v[i][j] becomes v[j][i].
inline void transpose8(f32x8 v[8]) {
#ifdef __AVX2__
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps((__m256)v[i], (__m256)v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps((__m256)v[i], (__m256)v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = (f32x8)_mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    v[i + 4] = (f32x8)_mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
#else
  for (int i = 0; i < 8; ++i) {
    for (int j = i + 1; j < 8; ++j) std::swap(v[i][j], v[j][i]);
  }
#endif
}

// Inputs per pass of the tiles (a whole number of groups, at most 256), so that a tile's
// slice of the panel and of its activation rows stay in L1 together.
inline int64_t input_chunk(int64_t k) {
  const int64_t chunks = (k + 255) / 256;
  return (k / kGroup + chunks - 1) / chunks * kGroup;
}

#ifdef __AVX2__
constexpr bool kInt8Panels = true;
#else
constexpr bool kInt8Panels = false;  // vpmaddubsw is AVX2's; elsewhere the float32 panels run
#endif

// y [M, N] = x [M, K] @ W^T for 4-bit codes (see quantized_linear.cpp), with x rounded to
// int8 per group of 32 inputs; T: float, c10::Half or c10::BFloat16. AVX2 only.
template <typename T>
void run_int8_panels(T* y, const T* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                     const float* scales, const float* zeros);

}  // namespace pagellm::quantized
