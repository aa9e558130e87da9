// The prefill attention's operands as plain values: its kernel (prefill_attention.cpp)
// compiles without torch's tensor headers, and its op (prefill_attention_op.cpp) checks the
// tensors and hands their pointers over.
#pragma once

#include <cstdint>

#include "attention_shape.h"
#include "cache_types.h"

namespace pagellm::kernels::prefill_attention {

using Shape = AttentionShape;

constexpr int64_t kTile = 4;  // keys (scores) or head dims (output) per register tile

// out: [sum(query_lens), H * D] float32, the chunks in request order; query: [T, H, D]
// float32, rows `query_row_stride` apart; kv_cache: [2, KVH, blocks_per_head, block_size, D]
// of `cache_type`; block_tables: [requests, max_blocks]; seq_lens, query_starts (the row of
// each chunk's first query), query_lens: [requests]; window > 0: each query sees only its
// last `window` keys.
struct Operands {
  float* out;
  const float* query;
  const void* kv_cache;
  CacheType cache_type;
  const int64_t* block_tables;
  const int64_t* seq_lens;
  const int64_t* query_starts;
  const int64_t* query_lens;
  int64_t requests, blocks_per_head;
  Shape shape;
  float scale;
  int64_t window;
};

inline namespace PAGELLM_CACHE_LIBRARY {
void attend(const Operands& operands);  // for this library's cache dtypes
}

}  // namespace pagellm::kernels::prefill_attention
