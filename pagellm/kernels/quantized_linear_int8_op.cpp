// The op quantized_linear_int8: checks its tensors and calls the int8 matmul
// (quantized_linear_int8.cpp, which describes the panels' layout) with their pointers. Apart
// from the kernels so that their translation unit parses none of torch's tensor and
// registration headers (build.py).
#include <cstdint>

#include "layer_ops.h"
#include "quantized_linear.h"
#include "stable_ops.h"

#ifdef __AVX2__

namespace pagellm::quantized::int8 {
namespace {

Activations activations_of(const Tensor& x) {
  switch (x.scalar_type()) {
    case ScalarType::Float: return Activations::kFloat;
    case ScalarType::BFloat16: return Activations::kBFloat16;
    case ScalarType::Half: return Activations::kHalf;
    default: PAGELLM_CHECK(false, "quantized_linear_int8: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace

// y: [M, N] of x's dtype; x: [M, K] contiguous; panels, scales, zeros: see
// quantized_linear_int8.cpp.
void quantized_linear_int8(Tensor y, const Tensor& x, const Tensor& panels,
                           const Tensor& scales, const Tensor& zeros) {
  PAGELLM_CHECK(x.dim() == 2 && x.is_contiguous() && y.is_contiguous() &&
                    y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0),
                "quantized_linear_int8 expects contiguous x [M, K] and y [M, N] of one dtype");
  const int64_t k = x.size(1), n = y.size(1), count = (n + kPanel - 1) / kPanel;
  const bool signed_codes = panels.scalar_type() == ScalarType::Char;
  PAGELLM_CHECK(k % kGroup == 0 && panels.is_contiguous() &&
                    (signed_codes ? panels.numel() == count * kPanel * k
                                  : panels.scalar_type() == ScalarType::Byte &&
                                        2 * panels.numel() == count * kPanel * k),
                "quantized_linear_int8: panels must be int8 [ceil(N / 16), K / 32, 8, 16, 4] "
                "(8-bit codes) or uint8 [ceil(N / 16), K / 32, 8, 32] (4-bit codes two per "
                "byte)");
  const int64_t group = scales.numel() == count * (k / kGroup) * kPanel ? kGroup : kHalfGroup;
  for (const Tensor* t : {&scales, &zeros}) {
    const ScalarType type = t->scalar_type();
    PAGELLM_CHECK(t->is_contiguous() && type == scales.scalar_type() &&
                      (type == ScalarType::Float || type == ScalarType::Half) &&
                      t->numel() == count * (k / group) * kPanel,
                  "quantized_linear_int8: scales and zeros must be float32 or float16 (both "
                  "alike) [ceil(N / 16), K / 32 or K / 16, 16]");
  }
  int8_matmul({y.mutable_data_ptr(), x.const_data_ptr(), activations_of(x), x.size(0), k, n,
               panels.const_data_ptr(), !signed_codes, scales.const_data_ptr(),
               zeros.const_data_ptr(), scales.scalar_type() == ScalarType::Half, group});
}

}  // namespace pagellm::quantized::int8

// Registered only where it is compiled: Python checks for the op (int8_matmul_available).
STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("quantized_linear_int8(Tensor(a!) y, Tensor x, Tensor panels, Tensor scales, "
        "Tensor zeros) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("quantized_linear_int8", TORCH_BOX(&pagellm::quantized::int8::quantized_linear_int8));
}

#endif  // __AVX2__
