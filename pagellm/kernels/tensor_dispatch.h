// Calling a kernel template with the C++ type of a tensor's dtype, and which KV cache
// dtypes this library instantiates. Apart from vectorizable.h, whose helpers the int8
// kernels use without torch's tensor headers.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "stable_ops.h"

namespace pagellm {

// Calls fn(T{}) with T the C++ type of x's dtype: float, c10::BFloat16 or c10::Half.
template <typename Fn>
void dispatch_dtype(const Tensor& x, const char* op, Fn&& fn) {
  switch (x.scalar_type()) {
    case ScalarType::Float: fn(float{}); break;
    case ScalarType::BFloat16: fn(c10::BFloat16{}); break;
    case ScalarType::Half: fn(c10::Half{}); break;
    default: fail(op, ": unsupported dtype ", x.scalar_type());
  }
}

// dispatch_dtype, plus the fp8 formats a KV cache may be stored in (c10::Float8_e4m3fn,
// c10::Float8_e5m2).
template <typename Fn>
void dispatch_any_cache_dtype(const Tensor& x, const char* op, Fn&& fn) {
  switch (x.scalar_type()) {
    case ScalarType::Float8_e4m3fn: fn(c10::Float8_e4m3fn{}); break;
    case ScalarType::Float8_e5m2: fn(c10::Float8_e5m2{}); break;
    default: dispatch_dtype(x, op, fn);
  }
}

// The KV cache dtypes this library's batch-invariant attention and cache writes instantiate,
// each a full copy of those kernels (about 1 s of a first start's compile per dtype).
// The default library: float and bf16, the caches of every default configuration. Built
// with PAGELLM_OTHER_CACHE_DTYPES (the on-demand library): fp16 and the fp8 formats, the
// ops registered under PAGELLM_CACHE_OP's names, ending in "_other_caches".
#ifdef PAGELLM_OTHER_CACHE_DTYPES
#define PAGELLM_CACHE_OP(name) name "_other_caches"
template <typename Fn>
void dispatch_cache_dtype(const Tensor& x, const char* op, Fn&& fn) {
  switch (x.scalar_type()) {
    case ScalarType::Half: fn(c10::Half{}); break;
    case ScalarType::Float8_e4m3fn: fn(c10::Float8_e4m3fn{}); break;
    case ScalarType::Float8_e5m2: fn(c10::Float8_e5m2{}); break;
    default:
      fail(op, ": a cache of ", x.scalar_type(), " belongs to the default library");
  }
}
#else
#define PAGELLM_CACHE_OP(name) name
template <typename Fn>
void dispatch_cache_dtype(const Tensor& x, const char* op, Fn&& fn) {
  switch (x.scalar_type()) {
    case ScalarType::Float: fn(float{}); break;
    case ScalarType::BFloat16: fn(c10::BFloat16{}); break;
    default:
      fail(op, ": a cache of ", x.scalar_type(), " needs the on-demand library");
  }
}
#endif

}  // namespace pagellm
