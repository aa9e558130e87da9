// RMSNorm, alone or fused with the residual add that precedes it, for CPUs.
//
// Rounds where the reference (Hugging Face) layers round, so results are the same as
// the unfused torch ops up to float32 summation order: the residual sum is rounded to the activation dtype,
// normalization runs in float32, its result is rounded before the weight multiply,
// and the product is rounded again. One pass per token row instead of eight ops.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#include "layer_ops.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::rms_norm {
namespace {

using pagellm::load;
using pagellm::round_to;
using pagellm::store;

// The sum of value(i)^2 over a row, in one order on every CPU: 16 partial sums, element i
// fused-multiply-added into partial i % 16 up to the last whole 16, the rest into partial 0
// in turn, then the partials added from the first to the last. It is the order an AVX512
// build's `omp simd` reduction took; left to the compiler, an AVX2 build kept 8 partials,
// so a model's answers differed between the two CPUs (13 against 16 of the fidelity
// benchmark's 40 on SmolLM2). Each partial is its own chain, which any width vectorizes.
template <typename Value>
inline float sum_of_squares(int64_t size, Value&& value) {
  constexpr int64_t kLanes = 16;
  float partial[kLanes] = {};
  const int64_t whole = size / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = value(i + j);
      partial[j] = std::fma(v, v, partial[j]);
    }
  }
  for (int64_t i = whole; i < size; ++i) {
    const float v = value(i);
    partial[0] = std::fma(v, v, partial[0]);
  }
  float squares = 0.f;
  for (const float p : partial) squares += p;
  return squares;
}

// With residual: residual = x + residual (rounded), then x = norm(residual).
template <typename T>
void norm_rows(T* x, T* residual, const T* weight, int64_t rows, int64_t size, int64_t x_stride,
               int64_t residual_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      T* rr = residual != nullptr ? residual + r * residual_stride : nullptr;
      const float squares =
          rr != nullptr ? sum_of_squares(size, [&](int64_t i) {
            const float value = round_to<T>(load(xr, i) + load(rr, i));
            store(rr, i, value);
            return value;
          })
                        : sum_of_squares(size, [&](int64_t i) { return load(xr, i); });
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(size) + eps);
      const T* source = rr != nullptr ? rr : xr;
#pragma omp simd
      for (int64_t i = 0; i < size; ++i)
        store(xr, i, round_to<T>(load(source, i) * inverse) * load(weight, i));
    }
  });
}

void check(const Tensor& x, const Tensor& weight) {
  PAGELLM_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() &&
                    weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
                "rms_norm expects rows [T, size] with contiguous rows and a weight [size] of the "
                "same dtype");
}

}  // namespace

// x = norm(x) * weight, in place.
void rms_norm(Tensor x, const Tensor& weight, double eps) {
  check(x, weight);
  pagellm::dispatch_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.mutable_data_ptr<T>(), nullptr, weight.const_data_ptr<T>(), x.size(0),
                 x.size(1), x.stride(0), 0, static_cast<float>(eps));
  });
}

// residual += x; x = norm(residual) * weight, both in place.
void add_rms_norm(Tensor x, Tensor residual, const Tensor& weight, double eps) {
  check(x, weight);
  check(residual, weight);
  PAGELLM_CHECK(residual.size(0) == x.size(0), "add_rms_norm: row counts differ");
  pagellm::dispatch_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.mutable_data_ptr<T>(), residual.mutable_data_ptr<T>(),
                 weight.const_data_ptr<T>(), x.size(0), x.size(1), x.stride(0),
                 residual.stride(0), static_cast<float>(eps));
  });
}

}  // namespace pagellm::kernels::rms_norm

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("rms_norm", TORCH_BOX(&pagellm::kernels::rms_norm::rms_norm));
  m.impl("add_rms_norm", TORCH_BOX(&pagellm::kernels::rms_norm::add_rms_norm));
}
