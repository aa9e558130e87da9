// The ops a decoder layer's two fused calls (decoder_layer.cpp) run in turn, called directly:
// the very functions registered as pagellm::add_rms_norm, quantized_linear_int8,
// rotary_embedding and silu_and_mul, without a trip through the dispatcher. Compiled in the
// same library.
#pragma once

#include "stable_ops.h"

namespace pagellm::kernels::rms_norm {
void add_rms_norm(Tensor x, Tensor residual, const Tensor& weight, double eps);
}  // namespace pagellm::kernels::rms_norm

namespace pagellm::kernels::rotary_embedding {
void rotary_embedding(Tensor x, const Tensor& table);
}  // namespace pagellm::kernels::rotary_embedding

namespace pagellm::kernels::activation {
void silu_and_mul(Tensor out, const Tensor& gate_up);
}  // namespace pagellm::kernels::activation

namespace pagellm::quantized::int8 {
void quantized_linear_int8(Tensor y, const Tensor& x, const Tensor& panels,
                           const Tensor& scales, const Tensor& zeros);
}  // namespace pagellm::quantized::int8
