// A paged attention's operands as plain values, for the kernels compiled without torch's
// headers (prefill_attention.cpp, decode_attention_invariant.cpp); their ops check the
// tensors and hand the pointers over (attention_op.h).
#pragma once

#include <cstdint>

#include "cache_types.h"

namespace pagellm::kernels {

struct AttentionShape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, query_row_stride;
};

// out: float32, a row of H * D per query; query: [T, H, D] float32, rows `query_row_stride`
// apart; kv_cache: [2, KVH, blocks_per_head, block_size, D] of `cache_type`; block_tables:
// [requests, max_blocks]; seq_lens: [requests]; a prefill's chunks: query_starts (the row of
// each chunk's first query) and query_lens [requests] (null for decodes, a query each);
// window > 0: each query sees only its last `window` keys.
struct AttentionOperands {
  float* out;
  const float* query;
  const void* kv_cache;
  CacheType cache_type;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const int64_t* query_starts;
  const int64_t* query_lens;
  int64_t requests, blocks_per_head;
  AttentionShape shape;
  float scale;
  int64_t window;
};

}  // namespace pagellm::kernels
