// A Llama-family decoder layer's work around its attention, in two calls instead of a dozen.
//
// At one decoding request, a layer's kernels take about 70 us and the Python that calls them
// (module calls, wrappers, views: about a dozen operator calls) about 95 us more: 3 ms of a
// 14 ms step on SmolLM2's 30 layers. These two ops run the same registered ops, in the same
// order on the same tensors, from C++ (pagellm/model/fused_layer.py calls them), so the
// results are the very bits of the modules' path:
//   attention_input:  residual += x; x = rms_norm(residual) * w; qkv = int8 matmul(x);
//                     rotate the queries' and keys' heads of qkv by `angles`; -> qkv
//   attention_output: o = int8 matmul(attention); residual += o; o = rms_norm(residual) * w;
//                     -> down(silu(gate) * up) of o, gate and up one int8 matmul
// The attention itself stays in Python (its step metadata chooses among the kernels).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#ifdef __AVX2__

namespace pagellm::kernels::decoder_layer {
namespace {

// A registered pagellm op (looked up once by each caller's static).
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

void call(const c10::OperatorHandle& handle, std::vector<c10::IValue> args) {
  handle.callBoxed(&args);
}

void int8_matmul(const at::Tensor& y, const at::Tensor& x, const at::Tensor& codes,
                 const at::Tensor& scales, const at::Tensor& zeros) {
  static const c10::OperatorHandle matmul = op("pagellm::quantized_linear_int8");
  call(matmul, {y, x.contiguous(), codes, scales, zeros});
}

void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                  double eps) {
  static const c10::OperatorHandle norm = op("pagellm::add_rms_norm");
  call(norm, {x, residual, weight, eps});
}

at::Tensor attention_input(const at::Tensor& x, const at::Tensor& residual,
                           const at::Tensor& norm_weight, double eps, const at::Tensor& codes,
                           const at::Tensor& scales, const at::Tensor& zeros, int64_t features,
                           const at::Tensor& angles, int64_t rotated_width, int64_t head_dim) {
  static const c10::OperatorHandle rotary = op("pagellm::rotary_embedding");
  add_rms_norm(x, residual, norm_weight, eps);
  const int64_t tokens = x.size(0);
  at::Tensor qkv = at::empty({tokens, features}, x.options());
  int8_matmul(qkv, x, codes, scales, zeros);
  call(rotary, {qkv.narrow(1, 0, rotated_width).view({tokens, -1, head_dim}), angles});
  return qkv;
}

at::Tensor attention_output(const at::Tensor& attention, const at::Tensor& residual,
                            const at::Tensor& o_codes, const at::Tensor& o_scales,
                            const at::Tensor& o_zeros, const at::Tensor& norm_weight, double eps,
                            const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales,
                            const at::Tensor& gate_up_zeros, int64_t intermediate,
                            const at::Tensor& down_codes, const at::Tensor& down_scales,
                            const at::Tensor& down_zeros) {
  static const c10::OperatorHandle silu_and_mul = op("pagellm::silu_and_mul");
  const int64_t tokens = attention.size(0), hidden = residual.size(1);
  at::Tensor out = at::empty({tokens, hidden}, attention.options());
  int8_matmul(out, attention, o_codes, o_scales, o_zeros);
  add_rms_norm(out, residual, norm_weight, eps);
  at::Tensor gate_up = at::empty({tokens, 2 * intermediate}, out.options());
  int8_matmul(gate_up, out, gate_up_codes, gate_up_scales, gate_up_zeros);
  at::Tensor activation = at::empty({tokens, intermediate}, out.options());
  call(silu_and_mul, {activation, gate_up});
  at::Tensor down = at::empty({tokens, hidden}, out.options());
  int8_matmul(down, activation, down_codes, down_scales, down_zeros);
  return down;
}

}  // namespace
}  // namespace pagellm::kernels::decoder_layer

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("attention_input(Tensor(a!) x, Tensor(b!) residual, Tensor norm_weight, float eps, "
        "Tensor codes, Tensor scales, Tensor zeros, int features, Tensor angles, "
        "int rotated_width, int head_dim) -> Tensor");
  m.def("attention_output(Tensor attention, Tensor(a!) residual, Tensor o_codes, "
        "Tensor o_scales, Tensor o_zeros, Tensor norm_weight, float eps, Tensor gate_up_codes, "
        "Tensor gate_up_scales, Tensor gate_up_zeros, int intermediate, Tensor down_codes, "
        "Tensor down_scales, Tensor down_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("attention_input", &pagellm::kernels::decoder_layer::attention_input);
  m.impl("attention_output", &pagellm::kernels::decoder_layer::attention_output);
}

#endif  // __AVX2__
