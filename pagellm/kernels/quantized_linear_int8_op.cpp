// The op quantized_linear_int8: checks its tensors and calls the int8 matmul
// (quantized_linear_int8.cpp, which describes the panels' layout) with their pointers. Apart
// from the kernels so that their translation unit parses none of torch's tensor and
// registration headers (build.py).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "quantized_linear.h"

#ifdef __AVX2__

namespace pagellm::quantized::int8 {
namespace {

Activations activations_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return Activations::kFloat;
    case at::kBFloat16: return Activations::kBFloat16;
    case at::kHalf: return Activations::kHalf;
    default: TORCH_CHECK(false, "quantized_linear_int8: unsupported dtype ", x.scalar_type());
  }
}

// y: [M, N] of x's dtype; x: [M, K] contiguous; panels, scales, zeros: see
// quantized_linear_int8.cpp.
void quantized_linear_int8(at::Tensor y, const at::Tensor& x, const at::Tensor& panels,
                           const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.is_contiguous() &&
                  y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0),
              "quantized_linear_int8 expects contiguous x [M, K] and y [M, N] of one dtype");
  const int64_t k = x.size(1), n = y.size(1), count = (n + kPanel - 1) / kPanel;
  const bool signed_codes = panels.scalar_type() == at::kChar;
  TORCH_CHECK(k % kGroup == 0 && panels.is_contiguous() &&
                  (signed_codes ? panels.numel() == count * kPanel * k
                                : panels.scalar_type() == at::kByte &&
                                      2 * panels.numel() == count * kPanel * k),
              "quantized_linear_int8: panels must be int8 [ceil(N / 16), K / 32, 8, 16, 4] "
              "(8-bit codes) or uint8 [ceil(N / 16), K / 32, 8, 32] (4-bit codes two per "
              "byte)");
  const int64_t group = scales.numel() == count * (k / kGroup) * kPanel ? kGroup : kHalfGroup;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == scales.scalar_type() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) &&
                    t->numel() == count * (k / group) * kPanel,
                "quantized_linear_int8: scales and zeros must be float32 or float16 (both "
                "alike) [ceil(N / 16), K / 32 or K / 16, 16]");
  }
  int8_matmul({y.mutable_data_ptr(), x.const_data_ptr(), activations_of(x), x.size(0), k, n,
               panels.const_data_ptr(), !signed_codes, scales.const_data_ptr(),
               zeros.const_data_ptr(), scales.scalar_type() == at::kHalf, group});
}

}  // namespace
}  // namespace pagellm::quantized::int8

// Registered only where it is compiled: Python checks for the op (int8_matmul_available).
TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("quantized_linear_int8(Tensor(a!) y, Tensor x, Tensor panels, Tensor scales, "
        "Tensor zeros) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("quantized_linear_int8", &pagellm::quantized::int8::quantized_linear_int8);
}

#endif  // __AVX2__
