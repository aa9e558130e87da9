// The op paged_decode_attention_invariant: checks its tensors and calls the kernel
// (decode_attention_invariant.cpp, which describes it) with their pointers. Apart from the
// kernel so that its translation unit parses none of torch's tensor and registration
// headers (build.py).
#include <cstdint>

#include "attention_op.h"
#include "decode_attention_invariant.h"
#include "layer_ops.h"

#if defined(__AVX2__) && defined(__FMA__)

namespace pagellm::kernels::decode_attention_invariant {
inline namespace PAGELLM_CACHE_LIBRARY {

// out: [N, H * D]; query: [N, H, D] (one token per request, at position seq_lens[n] - 1) with
// unit strides in its last two dims; kv_cache: [2, KVH, num_blocks, block_size, D];
// block_tables: [N, max_blocks]; seq_lens: [N], int64; window > 0: each query sees only its
// last `window` keys. D: a multiple of 16.
void paged_decode_attention_invariant(Tensor out, const Tensor& query,
                                      const Tensor& kv_cache, const Tensor& block_tables,
                                      const Tensor& seq_lens, double scale, int64_t window) {
  const char* op = "paged_decode_attention_invariant";
  const Operands operands =
      attention_operands(op, out, query, kv_cache, block_tables, seq_lens, scale, window, 16);
  PAGELLM_CHECK(seq_lens.size(0) == query.size(0), op, ": a query per request");
  attend(operands);
}

}  // namespace PAGELLM_CACHE_LIBRARY
}  // namespace pagellm::kernels::decode_attention_invariant

// Registered only where it is compiled: Python checks for the op.
STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def(PAGELLM_CACHE_OP("paged_decode_attention_invariant")
        "(Tensor(a!) out, Tensor query, Tensor kv_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  using pagellm::kernels::decode_attention_invariant::paged_decode_attention_invariant;
  m.impl(PAGELLM_CACHE_OP("paged_decode_attention_invariant"),
         TORCH_BOX(&paged_decode_attention_invariant));
}

#endif
