// float32 vectors of the widest width the build has (AVX512, else AVX2 with FMA), under one
// set of names, for the attention kernels' register tiles.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)

namespace pagellm::float_vectors {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kWidth = 16;
inline Vec load_vec(const float* p) { return _mm512_loadu_ps(p); }
inline void store_vec(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec zero_vec() { return _mm512_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec max_vec(Vec a, Vec b) { return _mm512_max_ps(a, b); }
#else
using Vec = __m256;
constexpr int64_t kWidth = 8;
inline Vec load_vec(const float* p) { return _mm256_loadu_ps(p); }
inline void store_vec(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec zero_vec() { return _mm256_setzero_ps(); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec max_vec(Vec a, Vec b) { return _mm256_max_ps(a, b); }
#endif

}  // namespace pagellm::float_vectors

#endif
