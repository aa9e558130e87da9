// The ops a decoder layer's fused calls (decoder_layer.cpp) run in turn, called directly:
// the very functions registered as pagellm::add_rms_norm, quantized_linear_int8,
// rotary_embedding, silu_and_mul, write_kv_cache and paged_decode_attention_invariant,
// without a trip through the dispatcher. Compiled in the same library; the last two also in
// the on-demand one, for other caches, under another inline namespace (cache_types.h); and
// quantized_linear_int8 in a library of the other int8 forms (quantized_linear.h).
#pragma once

#include <cstdint>

#include "cache_types.h"
#include "quantized_linear.h"
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
inline namespace PAGELLM_INT8_LIBRARY {
void quantized_linear_int8(Tensor y, const Tensor& x, const Tensor& panels,
                           const Tensor& scales, const Tensor& zeros);
}  // namespace PAGELLM_INT8_LIBRARY
}  // namespace pagellm::quantized::int8

namespace pagellm::kernels::write_kv {
inline namespace PAGELLM_CACHE_LIBRARY {
void write_kv_cache(Tensor kv_cache, const Tensor& key, const Tensor& value,
                    const Tensor& slot_mapping);
}  // namespace PAGELLM_CACHE_LIBRARY
}  // namespace pagellm::kernels::write_kv

namespace pagellm::kernels::decode_attention_invariant {
inline namespace PAGELLM_CACHE_LIBRARY {
void paged_decode_attention_invariant(Tensor out, const Tensor& query, const Tensor& kv_cache,
                                      const Tensor& block_tables, const Tensor& seq_lens,
                                      double scale, int64_t window);
}  // namespace PAGELLM_CACHE_LIBRARY
}  // namespace pagellm::kernels::decode_attention_invariant
