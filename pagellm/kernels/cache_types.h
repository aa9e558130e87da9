// KV cache dtypes as plain values, for kernels compiled without torch's tensor headers, and
// the ones this library instantiates: the same set as tensor_dispatch.h's
// dispatch_cache_dtype, whose op-side check comes first.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

namespace pagellm {

enum class CacheType { kFloat, kBFloat16, kHalf, kFloat8E4M3, kFloat8E5M2 };

// An inline namespace for the functions each library defines for its own cache dtypes: both
// libraries load into one process, so their copies need names of their own.
#ifdef PAGELLM_OTHER_CACHE_DTYPES
#define PAGELLM_CACHE_LIBRARY other_caches
#else
#define PAGELLM_CACHE_LIBRARY default_caches
#endif

template <typename C>
constexpr CacheType cache_type_of();
template <>
constexpr CacheType cache_type_of<float>() { return CacheType::kFloat; }
template <>
constexpr CacheType cache_type_of<c10::BFloat16>() { return CacheType::kBFloat16; }
template <>
constexpr CacheType cache_type_of<c10::Half>() { return CacheType::kHalf; }
template <>
constexpr CacheType cache_type_of<c10::Float8_e4m3fn>() { return CacheType::kFloat8E4M3; }
template <>
constexpr CacheType cache_type_of<c10::Float8_e5m2>() { return CacheType::kFloat8E5M2; }

// Calls fn(C{}) with C the C++ type of `type`, one of this library's cache dtypes.
template <typename Fn>
void dispatch_cache_type(CacheType type, Fn&& fn) {
  switch (type) {
#ifdef PAGELLM_OTHER_CACHE_DTYPES
    case CacheType::kHalf: fn(c10::Half{}); break;
    case CacheType::kFloat8E4M3: fn(c10::Float8_e4m3fn{}); break;
    case CacheType::kFloat8E5M2: fn(c10::Float8_e5m2{}); break;
#else
    case CacheType::kFloat: fn(float{}); break;
    case CacheType::kBFloat16: fn(c10::BFloat16{}); break;
#endif
    default: break;  // another library's: its op refused it
  }
}

}  // namespace pagellm
