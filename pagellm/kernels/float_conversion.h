// Reading and writing activations of any dtype as float32, in forms the compiler
// vectorizes: bfloat16 is converted through its raw bits (the c10 struct's
// operators are opaque scalar calls to the vectorizer); float16 goes through c10.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

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

inline void store(float* p, int64_t i, float value) { p[i] = value; }
inline void store(c10::Half* p, int64_t i, float value) { p[i] = static_cast<c10::Half>(value); }
inline void store(c10::BFloat16* p, int64_t i, float value) {
  reinterpret_cast<uint16_t*>(p)[i] = bfloat16_bits(value);
}

// `value` rounded to T's precision, still as float.
template <typename T>
inline float round_to(float value) {
  T rounded;
  store(&rounded, 0, value);
  return load(&rounded, 0);
}

}  // namespace pagellm
