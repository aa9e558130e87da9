// Helpers written so that loops over them vectorize. Reading and writing activations of
// any dtype as float32: bfloat16 is converted through its raw bits (the c10 struct's
// operators are opaque scalar calls to the vectorizer); float16 goes through c10. And
// exp in plain float arithmetic (std::exp is a scalar library call). Without torch's
// tensor headers, so that the int8 kernels' translation unit parses none (build.py);
// the dtype dispatch of tensors is in tensor_dispatch.h.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagellm {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// Round to nearest even at bfloat16's 8 mantissa bits, as torch does (NaN payloads aside).
inline uint16_t bfloat16_bits(float value) {
  const uint32_t bits = float_to_bits(value);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::BFloat16* p, int64_t i) {
  return bits_to_float(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
}

// fp8 KV caches. Reading: the code's exponent and mantissa bits are placed in a
// float32's and the result rescaled by 2^(127 - bias): exact for every finite code,
// subnormals included.
inline float fp8_to_float(uint8_t code, int mantissa_bits, float rebias) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  return bits_to_float(sign | (static_cast<uint32_t>(code & 0x7Fu) << (23 - mantissa_bits))) *
         rebias;
}
inline float load(const c10::Float8_e4m3fn* p, int64_t i) {
  return fp8_to_float(reinterpret_cast<const uint8_t*>(p)[i], 3, 0x1p120f);
}
inline float load(const c10::Float8_e5m2* p, int64_t i) {
  return fp8_to_float(reinterpret_cast<const uint8_t*>(p)[i], 2, 0x1p112f);
}

inline void store(float* p, int64_t i, float value) { p[i] = value; }
inline void store(c10::Half* p, int64_t i, float value) { p[i] = static_cast<c10::Half>(value); }
inline void store(c10::BFloat16* p, int64_t i, float value) {
  reinterpret_cast<uint16_t*>(p)[i] = bfloat16_bits(value);
}
// Writing: c10's rounding (torch's casts), past the largest finite value saturated to it
// (a cast would give NaN in e4m3fn and infinity in e5m2); NaN stays NaN.
template <typename F8>
inline F8 saturated_fp8(float value, float largest) {
  return static_cast<F8>(value > largest ? largest : (value < -largest ? -largest : value));
}
inline void store(c10::Float8_e4m3fn* p, int64_t i, float value) {
  p[i] = saturated_fp8<c10::Float8_e4m3fn>(value, 448.f);
}
inline void store(c10::Float8_e5m2* p, int64_t i, float value) {
  p[i] = saturated_fp8<c10::Float8_e5m2>(value, 57344.f);
}

// A row of keys or values as float32.
template <typename T>
inline void widen(float* out, const T* row, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = load(row, i);
}

#if defined(__F16C__) && defined(__AVX2__)
// fp8 through float16, which F16C widens in hardware, subnormals included (float32 math on
// subnormal inputs would take a microcode assist): e5m2 is float16's top byte; e4m3's
// exponent and mantissa shifted into float16's place read 2^8 too small, which one
// multiply fixes.
#if defined(__AVX512F__)
// 16 fp8 values as float32, the same way on 512-bit registers.
template <bool kE4M3>
inline __m512 widen16_fp8(const uint8_t* bytes) {
  const __m256i words =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  if constexpr (kE4M3) {
    const __m256i magnitude =
        _mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16(0x3F80));
    const __m256i sign =
        _mm256_and_si256(_mm256_slli_epi16(words, 8), _mm256_set1_epi16(-0x8000));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)),
                         _mm512_set1_ps(256.f));
  } else {
    return _mm512_cvtph_ps(_mm256_slli_epi16(words, 8));
  }
}
#endif

template <bool kE4M3, typename T>
inline void widen_fp8(float* out, const T* row, int64_t n) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(row);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, widen16_fp8<kE4M3>(bytes + i));
#endif
  for (; i + 8 <= n; i += 8) {
    const __m128i words =
        _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + i)));
    if constexpr (kE4M3) {
      const __m128i magnitude = _mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16(0x3F80));
      const __m128i sign = _mm_and_si128(_mm_slli_epi16(words, 8), _mm_set1_epi16(-0x8000));
      const __m256 wide = _mm256_cvtph_ps(_mm_or_si128(magnitude, sign));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(wide, _mm256_set1_ps(256.f)));
    } else {
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_slli_epi16(words, 8)));
    }
  }
  for (; i < n; ++i) out[i] = load(row, i);
}

inline void widen(float* out, const c10::Float8_e4m3fn* row, int64_t n) {
  widen_fp8<true>(out, row, n);
}
inline void widen(float* out, const c10::Float8_e5m2* row, int64_t n) {
  widen_fp8<false>(out, row, n);
}
#endif

#if defined(__AVX512F__)
// 16 consecutive values of any cache dtype as float32, in a register.
inline __m512 widen16(const float* values) { return _mm512_loadu_ps(values); }
inline __m512 widen16(const c10::BFloat16* values) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 widen16(const c10::Half* values) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values)));
}
inline __m512 widen16(const c10::Float8_e4m3fn* values) {
  return widen16_fp8<true>(reinterpret_cast<const uint8_t*>(values));
}
inline __m512 widen16(const c10::Float8_e5m2* values) {
  return widen16_fp8<false>(reinterpret_cast<const uint8_t*>(values));
}
#endif

// `value` rounded to T's precision, still as float.
inline float rounded(float value, const float*) { return value; }
inline float rounded(float value, const c10::Half*) {
  return static_cast<float>(static_cast<c10::Half>(value));
}
inline float rounded(float value, const c10::BFloat16*) {
  return bits_to_float(static_cast<uint32_t>(bfloat16_bits(value)) << 16);
}
template <typename T>
inline float round_to(float value) {
  return rounded(value, static_cast<const T*>(nullptr));
}

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series
// to degree 7 (relative error below 1e-7), 2^n built in the exponent bits.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // not std::max: its reference arguments keep `omp simd` scalar
  // x / ln2 rounded to the nearest integer by adding and removing 1.5 * 2^23 (std::floor
  // would keep the loop scalar)
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// log(x) for finite x > 0 (relative error below 1e-7): x = 2^e m with m in [sqrt(1/2),
// sqrt(2)), log m = 2 atanh(t) with t = (m - 1) / (m + 1), |t| < 0.172, by its series.
inline float log_positive(float x) {
  const uint32_t bits = float_to_bits(x);
  float m = bits_to_float((bits & 0x007FFFFFu) | 0x3F800000u);
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127);
  const bool high = m > 1.41421356f;
  m = high ? m * 0.5f : m;
  e = high ? e + 1.f : e;
  const float t = (m - 1.f) / (m + 1.f), t2 = t * t;
  float series = t2 * (1.f / 9.f) + 1.f / 7.f;
  series = (series * t2 + 1.f / 5.f) * t2 + 1.f / 3.f;
  series = series * t2 + 1.f;
  return e * 0.693147181f + 2.f * t * series;
}

}  // namespace pagellm
