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
// The attention itself stays in Python (its step metadata chooses among the kernels), except
// in a decode-only step of the batch-invariant engine, where one kernel serves every layer:
//   decode_attention_output: write the keys and values of qkv to the cache; attention =
//                     invariant decode attention(queries of qkv); -> attention_output's work
#include <cstdint>

#include "layer_ops.h"
#include "stable_ops.h"

#ifdef __AVX2__

namespace pagellm::kernels::decoder_layer {
namespace {

// A new [rows, columns] tensor of `like`'s dtype and device, allocated by the shim directly:
// torch::stable::new_empty finds aten::new_empty by name at every call (1 us against
// 0.25, five times a layer).
Tensor new_rows(const Tensor& like, int64_t rows, int64_t columns) {
  const int64_t sizes[2] = {rows, columns}, strides[2] = {columns, 1};
  int32_t dtype, device_index;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(like.get(), &dtype));
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle handle;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      2, sizes, strides, dtype, aoti_torch_device_type_cpu(), device_index, &handle));
  return Tensor(handle);
}

// Columns [first, first + heads * head_dim) of qkv [tokens, features] as heads [tokens,
// heads, head_dim]: a view, made in one shim call rather than narrow and view by name.
Tensor heads_at(const Tensor& qkv, int64_t first, int64_t heads, int64_t head_dim) {
  const int64_t sizes[3] = {qkv.size(0), heads, head_dim};
  const int64_t strides[3] = {qkv.stride(0), head_dim, 1};
  AtenTensorHandle handle;
  STABLE_TORCH_ERROR_CODE_CHECK(
      aoti_torch__reinterpret_tensor(qkv.get(), 3, sizes, strides, first, &handle));
  return Tensor(handle);
}

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
  Tensor qkv = new_rows(x, tokens, features);
  int8_matmul(qkv, x, codes, scales, zeros);
  rotary_embedding::rotary_embedding(heads_at(qkv, 0, rotated_width / head_dim, head_dim),
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
  Tensor out = new_rows(attention, tokens, hidden);
  int8_matmul(out, attention, o_codes, o_scales, o_zeros);
  rms_norm::add_rms_norm(out, residual, norm_weight, eps);
  Tensor gate_up = new_rows(out, tokens, 2 * intermediate);
  int8_matmul(gate_up, out, gate_up_codes, gate_up_scales, gate_up_zeros);
  Tensor activation = new_rows(out, tokens, intermediate);
  activation::silu_and_mul(activation, gate_up);
  Tensor down = new_rows(out, tokens, hidden);
  int8_matmul(down, activation, down_codes, down_scales, down_zeros);
  return down;
}

// A decode-only step of the batch-invariant engine, from attention_input's qkv (float32) on:
// the step's keys and values into the layer's cache, the invariant decode attention of its
// queries, then attention_output. What the Python path calls for such a step, in its order.
Tensor decode_attention_output(const Tensor& qkv, Tensor residual, Tensor kv_cache,
                               const Tensor& slot_mapping, const Tensor& block_tables,
                               const Tensor& seq_lens, double scale, int64_t window,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               const Tensor& o_codes, const Tensor& o_scales,
                               const Tensor& o_zeros, const Tensor& norm_weight, double eps,
                               const Tensor& gate_up_codes, const Tensor& gate_up_scales,
                               const Tensor& gate_up_zeros, int64_t intermediate,
                               const Tensor& down_codes, const Tensor& down_scales,
                               const Tensor& down_zeros) {
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  write_kv::write_kv_cache(kv_cache, heads_at(qkv, q_width, num_kv_heads, head_dim),
                           heads_at(qkv, q_width + kv_width, num_kv_heads, head_dim),
                           slot_mapping);
  Tensor attention = new_rows(qkv, qkv.size(0), q_width);
  decode_attention_invariant::paged_decode_attention_invariant(
      attention, heads_at(qkv, 0, num_heads, head_dim), kv_cache, block_tables, seq_lens,
      scale, window);
  return attention_output(attention, residual, o_codes, o_scales, o_zeros, norm_weight, eps,
                          gate_up_codes, gate_up_scales, gate_up_zeros, intermediate,
                          down_codes, down_scales, down_zeros);
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
  m.def("decode_attention_output(Tensor qkv, Tensor(a!) residual, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, int window, "
        "int num_heads, int num_kv_heads, int head_dim, Tensor o_codes, Tensor o_scales, "
        "Tensor o_zeros, Tensor norm_weight, float eps, Tensor gate_up_codes, "
        "Tensor gate_up_scales, Tensor gate_up_zeros, int intermediate, Tensor down_codes, "
        "Tensor down_scales, Tensor down_zeros) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("attention_input", TORCH_BOX(&pagellm::kernels::decoder_layer::attention_input));
  m.impl("attention_output", TORCH_BOX(&pagellm::kernels::decoder_layer::attention_output));
  m.impl("decode_attention_output",
         TORCH_BOX(&pagellm::kernels::decoder_layer::decode_attention_output));
}

#endif  // __AVX2__
