// What the attention ops (prefill_attention_op.cpp, decode_attention_invariant_op.cpp) check
// of their tensors before their kernels read them through plain pointers.
#pragma once

#include <cstdint>

#include "attention_operands.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"

namespace pagellm::kernels {

// out: contiguous, a row of H * D per query; query: [T, H, D] with unit strides in its last
// two dims, D a multiple of `head_dim_multiple`; kv_cache: [2, KVH, num_blocks, block_size,
// D] of one of this library's cache dtypes; block_tables: [N, max_blocks]; seq_lens: [N],
// int64; out and query float32. The prefill's query_starts and query_lens are the caller's.
inline AttentionOperands attention_operands(const char* op, const Tensor& out,
                                            const Tensor& query, const Tensor& kv_cache,
                                            const Tensor& block_tables, const Tensor& seq_lens,
                                            double scale, int64_t window,
                                            int64_t head_dim_multiple) {
  PAGELLM_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2, op,
                ": unexpected ranks");
  PAGELLM_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() &&
                    kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                    seq_lens.is_contiguous(),
                op, ": unexpected strides");
  PAGELLM_CHECK(
      query.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float, op,
      ": query and output must be float32");
  const AttentionShape s{query.size(1),    kv_cache.size(1),     query.size(2),
                         kv_cache.size(3), block_tables.size(1), query.stride(0)};
  PAGELLM_CHECK(s.num_heads % s.num_kv_heads == 0 && kv_cache.size(4) == s.head_dim &&
                    s.head_dim % head_dim_multiple == 0,
                op, ": head shapes do not match");
  AttentionOperands operands{out.mutable_data_ptr<float>(),
                             query.const_data_ptr<float>(),
                             kv_cache.const_data_ptr(),
                             CacheType::kFloat,
                             block_tables.const_data_ptr<int64_t>(),
                             seq_lens.const_data_ptr<int64_t>(),
                             nullptr,
                             nullptr,
                             seq_lens.size(0),
                             kv_cache.size(2),
                             s,
                             static_cast<float>(scale),
                             window};
  pagellm::dispatch_cache_dtype(kv_cache, op, [&](auto cache_tag) {
    operands.cache_type = cache_type_of<decltype(cache_tag)>();
  });
  return operands;
}

}  // namespace pagellm::kernels
