// The batch-invariant decode attention's operands as plain values: its kernel
// (decode_attention_invariant.cpp) compiles without torch's tensor headers, and its op
// (decode_attention_invariant_op.cpp) checks the tensors and hands their pointers over.
#pragma once

#include <cstdint>

#include "attention_shape.h"
#include "cache_types.h"

namespace pagellm::kernels::decode_attention_invariant {

using Shape = AttentionShape;

// out: [requests, H * D] float32; query: [requests, H, D] float32, rows `query_row_stride`
// apart; kv_cache: [2, KVH, blocks_per_head, block_size, D] of `cache_type`; block_tables:
// [requests, max_blocks]; seq_lens: [requests]; window > 0: each query sees only its last
// `window` keys.
struct Operands {
  float* out;
  const float* query;
  const void* kv_cache;
  CacheType cache_type;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  int64_t requests, blocks_per_head;
  Shape shape;
  float scale;
  int64_t window;
};

inline namespace PAGELLM_CACHE_LIBRARY {
void attend(const Operands& operands);  // for this library's cache dtypes
}

}  // namespace pagellm::kernels::decode_attention_invariant
