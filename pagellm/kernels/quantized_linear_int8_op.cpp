// The op quantized_linear_int8: checks its tensors and calls the int8 matmul
// (quantized_linear_int8.cpp, which describes the panels' layout) with their pointers. Apart
// from the kernels so that their translation unit parses none of torch's tensor and
// registration headers (build.py). The default library's op multiplies its own forms and
// passes the others, by name, to quantized_linear_int8_other_forms, the same file built into
// a library of its own (quantized_linear.h's int8_form_compiled).
#include <array>
#include <cstdint>

#include "layer_ops.h"
#include "quantized_linear.h"
#include "stable_ops.h"

#ifdef __AVX2__

// The name each library registers its op under.
#ifdef PAGELLM_OTHER_INT8_FORMS
#define PAGELLM_INT8_OP "quantized_linear_int8_other_forms"
#else
#define PAGELLM_INT8_OP "quantized_linear_int8"
#endif

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

#ifdef PAGELLM_OTHER_INT8_FORMS
[[noreturn]] void multiply_elsewhere(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&) {
  fail("quantized_linear_int8_other_forms: the default library multiplies panels with float16 "
       "factors (pagellm::quantized_linear_int8)");
}
#else
// The other library's op, called through the dispatcher: 1 us more per matmul (5.5 against
// 4.4 us for a tiny one), on forms only K-quant models have. Its tensors are new references,
// which the call takes over.
void multiply_elsewhere(const Tensor& y, const Tensor& x, const Tensor& panels,
                        const Tensor& scales, const Tensor& zeros) {
  using torch::stable::detail::from;
  std::array<StableIValue, 5> stack{from(y), from(x), from(panels), from(scales), from(zeros)};
  PAGELLM_CHECK(torch_call_dispatcher("pagellm::quantized_linear_int8_other_forms", "",
                                      stack.data(), TORCH_ABI_VERSION) == AOTI_TORCH_SUCCESS,
                "quantized_linear_int8: panels with float32 factors are another library's "
                "(pagellm.kernels.require_int8_other_forms loads it)");
}
#endif

}  // namespace

inline namespace PAGELLM_INT8_LIBRARY {

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
  const bool half_factors = scales.scalar_type() == ScalarType::Half;
  PAGELLM_CHECK(!half_factors || group == kGroup,
                "quantized_linear_int8: float16 scales and zeros come in groups of 32 only "
                "(no library compiles them per 16)");
  if (!int8_form_compiled(half_factors, group)) {
    multiply_elsewhere(y, x, panels, scales, zeros);
    return;
  }
  int8_matmul({y.mutable_data_ptr(), x.const_data_ptr(), activations_of(x), x.size(0), k, n,
               panels.const_data_ptr(), !signed_codes, scales.const_data_ptr(),
               zeros.const_data_ptr(), half_factors, group});
}

}  // namespace PAGELLM_INT8_LIBRARY
}  // namespace pagellm::quantized::int8

// Registered only where it is compiled: Python checks for the op (int8_matmul_available).
STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def(PAGELLM_INT8_OP "(Tensor(a!) y, Tensor x, Tensor panels, Tensor scales, "
        "Tensor zeros) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl(PAGELLM_INT8_OP, TORCH_BOX(&pagellm::quantized::int8::quantized_linear_int8));
}

#endif  // __AVX2__
