// The op paged_prefill_attention: checks its tensors and calls the kernel
// (prefill_attention.cpp, which describes it) with their pointers. Apart from the kernel so
// that the kernel's translation unit parses none of torch's headers and the two units of a
// first start's compile take about as long (build.py).
#include <cstdint>

#include "attention_op.h"
#include "prefill_attention.h"

#if defined(__AVX2__) && defined(__FMA__)

namespace pagellm::kernels::prefill_attention {
inline namespace PAGELLM_CACHE_LIBRARY {

// out: [sum(query_lens), H * D], the chunks in request order; query: [T, H, D] with unit
// strides in its last two dims; kv_cache: [2, KVH, num_blocks, block_size, D];
// block_tables: [N, max_blocks]; seq_lens, query_starts (row of each chunk's first query),
// query_lens: [N], all int64; window > 0: each query sees only its last `window` keys.
void paged_prefill_attention(Tensor out, const Tensor& query, const Tensor& kv_cache,
                             const Tensor& block_tables, const Tensor& seq_lens,
                             const Tensor& query_starts, const Tensor& query_lens,
                             double scale, int64_t window) {
  const char* op = "paged_prefill_attention";
  Operands operands = attention_operands(op, out, query, kv_cache, block_tables, seq_lens,
                                         scale, window, kTile);
  PAGELLM_CHECK(query_starts.is_contiguous() && query_lens.is_contiguous(), op,
                ": unexpected strides");
  operands.query_starts = query_starts.const_data_ptr<int64_t>();
  operands.query_lens = query_lens.const_data_ptr<int64_t>();
  attend(operands);
}

}  // namespace PAGELLM_CACHE_LIBRARY
}  // namespace pagellm::kernels::prefill_attention

// Registered only where it is compiled: Python checks for the op.
STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def(PAGELLM_CACHE_OP("paged_prefill_attention")
        "(Tensor(a!) out, Tensor query, Tensor kv_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, "
        "float scale, int window=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl(PAGELLM_CACHE_OP("paged_prefill_attention"),
         TORCH_BOX(&pagellm::kernels::prefill_attention::paged_prefill_attention));
}

#endif
