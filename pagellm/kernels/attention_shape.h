// A paged attention's head shapes and its queries' row stride, as plain values for the
// kernels compiled without torch's tensor headers (prefill_attention.h,
// decode_attention_invariant.h).
#pragma once

#include <cstdint>

namespace pagellm::kernels {

struct AttentionShape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, query_row_stride;
};

}  // namespace pagellm::kernels
