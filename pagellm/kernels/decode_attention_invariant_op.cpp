// The op paged_decode_attention_invariant: checks its tensors and calls the kernel
// (decode_attention_invariant.cpp, which describes it) with their pointers. Apart from the
// kernel so that its translation unit parses none of torch's tensor and registration
// headers (build.py).
#include <cstdint>

#include "decode_attention_invariant.h"
#include "layer_ops.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"

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
  PAGELLM_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2, op,
                ": unexpected ranks");
  PAGELLM_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.is_contiguous() &&
                    kv_cache.is_contiguous() && block_tables.is_contiguous() &&
                    seq_lens.is_contiguous(),
                op, ": unexpected strides");
  PAGELLM_CHECK(
      query.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float, op,
      ": query and output must be float32");
  const Shape s{query.size(1),    kv_cache.size(1),     query.size(2),
                kv_cache.size(3), block_tables.size(1), query.stride(0)};
  PAGELLM_CHECK(s.num_heads % s.num_kv_heads == 0 && kv_cache.size(4) == s.head_dim &&
                    s.head_dim % 16 == 0 && seq_lens.size(0) == query.size(0),
                op, ": head shapes do not match");
  Operands operands{out.mutable_data_ptr<float>(),
                    query.const_data_ptr<float>(),
                    kv_cache.const_data_ptr(),
                    CacheType::kFloat,
                    block_tables.const_data_ptr<int64_t>(),
                    seq_lens.const_data_ptr<int64_t>(),
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
