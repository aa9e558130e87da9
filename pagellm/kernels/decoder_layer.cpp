// A Llama-family decoder layer's work around its attention, in two calls instead of a dozen.
//
// At one decoding request, a layer's kernels take about 70 us and the Python that calls them
// (module calls, wrappers, views: about a dozen operator calls) about 95 us more: 3 ms of a
// 14 ms step on SmolLM2's 30 layers. These two ops call the functions of the same registered
// ops (layer_ops.h), in the same order on the same tensors, from C++ (pagellm/model/
// fused_layer.py calls them), so the results are the very bits of the modules' path:
//   attention_input:  residual += x; x = rms_norm(residual) * w; qkv = int8 matmul(x);
//                     rotate the queries' and keys' heads of qkv by `angles`; -> qkv
//   attention_output: o = int8 matmul(attention); residual += o; o = rms_norm(residual) * w;
//                     -> down(silu(gate) * up) of o, gate and up one int8 matmul
// The attention itself stays in Python (its step metadata chooses among the kernels).
#include "layer_ops.h"
#include "stable_ops.h"

#include <cstdint>

#ifdef __AVX2__

namespace pagellm::kernels::decoder_layer {
namespace {

using torch::stable::new_empty;

void int8_matmul(const Tensor& y, const Tensor& x, const Tensor& codes, const Tensor& scales,
                 const Tensor& zeros) {
  pagellm::quantized::int8::quantized_linear_int8(
      y, x.is_contiguous() ? x : torch::stable::contiguous(x), codes, scales, zeros);
}

Tensor attention_input(Tensor x, Tensor residual, const Tensor& norm_weight, double eps,
                       const Tensor& codes, const Tensor& scales, const Tensor& zeros,
                       int64_t features, const Tensor& angles, int64_t rotated_width,
                       int64_t head_dim) {
  rms_norm::add_rms_norm(x, residual, norm_weight, eps);
  const int64_t tokens = x.size(0);
  Tensor qkv = new_empty(x, {tokens, features});
  int8_matmul(qkv, x, codes, scales, zeros);
  const Tensor rotated = torch::stable::narrow(qkv, 1, 0, rotated_width);
  rotary_embedding::rotary_embedding(torch::stable::view(rotated, {tokens, -1, head_dim}),
                                     angles);
  return qkv;
}

Tensor attention_output(const Tensor& attention, Tensor residual, const Tensor& o_codes,
                        const Tensor& o_scales, const Tensor& o_zeros,
                        const Tensor& norm_weight, double eps, const Tensor& gate_up_codes,
                        const Tensor& gate_up_scales, const Tensor& gate_up_zeros,
                        int64_t intermediate, const Tensor& down_codes,
                        const Tensor& down_scales, const Tensor& down_zeros) {
  const int64_t tokens = attention.size(0), hidden = residual.size(1);
  Tensor out = new_empty(attention, {tokens, hidden});
  int8_matmul(out, attention, o_codes, o_scales, o_zeros);
  rms_norm::add_rms_norm(out, residual, norm_weight, eps);
  Tensor gate_up = new_empty(out, {tokens, 2 * intermediate});
  int8_matmul(gate_up, out, gate_up_codes, gate_up_scales, gate_up_zeros);
  Tensor activation = new_empty(out, {tokens, intermediate});
  activation::silu_and_mul(activation, gate_up);
  Tensor down = new_empty(out, {tokens, hidden});
  int8_matmul(down, activation, down_codes, down_scales, down_zeros);
  return down;
}

}  // namespace
}  // namespace pagellm::kernels::decoder_layer

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("attention_input(Tensor(a!) x, Tensor(b!) residual, Tensor norm_weight, float eps, "
        "Tensor codes, Tensor scales, Tensor zeros, int features, Tensor angles, "
        "int rotated_width, int head_dim) -> Tensor");
  m.def("attention_output(Tensor attention, Tensor(a!) residual, Tensor o_codes, "
        "Tensor o_scales, Tensor o_zeros, Tensor norm_weight, float eps, Tensor gate_up_codes, "
        "Tensor gate_up_scales, Tensor gate_up_zeros, int intermediate, Tensor down_codes, "
        "Tensor down_scales, Tensor down_zeros) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("attention_input", TORCH_BOX(&pagellm::kernels::decoder_layer::attention_input));
  m.impl("attention_output", TORCH_BOX(&pagellm::kernels::decoder_layer::attention_output));
}

#endif  // __AVX2__
