// The op paged_prefill_attention: checks its tensors and calls the kernel
// (prefill_attention.cpp, which describes it) with their pointers. Apart from the kernel so
// that the kernel's translation unit parses none of torch's headers and the two units of a
// first start's compile take about as long (build.py).
#include <cstdint>

#include "prefill_attention.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"

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
  PAGELLM_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2, op,
                ": unexpected ranks");
  PAGELLM_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() &&
                    kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                    seq_lens.is_contiguous() && query_starts.is_contiguous() &&
                    query_lens.is_contiguous(),
                op, ": unexpected strides");
  PAGELLM_CHECK(
      query.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float, op,
      ": query and output must be float32");
  const Shape s{query.size(1),    kv_cache.size(1),     query.size(2),
                kv_cache.size(3), block_tables.size(1), query.stride(0)};
  PAGELLM_CHECK(s.num_heads % s.num_kv_heads == 0 && kv_cache.size(4) == s.head_dim &&
                    s.head_dim % kTile == 0,
                op, ": head shapes do not match");
  Operands operands{out.mutable_data_ptr<float>(),
                    query.const_data_ptr<float>(),
                    kv_cache.const_data_ptr(),
                    CacheType::kFloat,
                    block_tables.const_data_ptr<int64_t>(),
                    seq_lens.const_data_ptr<int64_t>(),
                    query_starts.const_data_ptr<int64_t>(),
                    query_lens.const_data_ptr<int64_t>(),
                    seq_lens.size(0),
                    kv_cache.size(2),
                    s,
                    static_cast<float>(scale),
                    window};
  pagellm::dispatch_cache_dtype(kv_cache, op, [&](auto cache_tag) {
    operands.cache_type = cache_type_of<decltype(cache_tag)>();
  });
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
