// A step's keys and values into their KV cache slots, for CPUs (vLLM's reshape_and_cache).
// One op per layer instead of the torch path's two casts and two index copies with their
// views: about 15 dispatches a layer, 3-4% of a decode step of SmolLM2 at batch 64. Each
// value is rounded once to the cache's dtype as torch's casts round it (fp8 saturating at
// its largest finite value, as attention._rounded does).
#include <ATen/Parallel.h>

#include <cstdint>

#include "layer_ops.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::write_kv {
namespace {

using pagellm::load;
using pagellm::store;

// Rows (token, kv head) per task: a decode step's few hundred rows stay on one thread.
constexpr int64_t kRowsPerTask = 512;

struct Rows {
  const void* data;
  int64_t token_stride, head_stride;
};

template <typename T, typename C>
void write(C* cache, const Rows& keys, const Rows& values, const int64_t* slots,
           int64_t tokens, int64_t heads, int64_t dim, int64_t head_plane) {
  const int64_t half = heads * head_plane;  // keys, then values
  const Rows* sources[2] = {&keys, &values};
  at::parallel_for(0, tokens * heads, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      C* key_slot = cache + h * head_plane + slots[t] * dim;
      for (int kind = 0; kind < 2; ++kind) {
        const T* source = static_cast<const T*>(sources[kind]->data) +
                          t * sources[kind]->token_stride + h * sources[kind]->head_stride;
        C* slot = key_slot + kind * half;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) store(slot, i, load(source, i));
      }
    }
  });
}

}  // namespace

inline namespace PAGELLM_CACHE_LIBRARY {

// kv_cache: [2, KVH, num_blocks, block_size, D] contiguous, of float32, bfloat16, float16
// or fp8; key, value: [T, KVH, D] of the model's dtype with contiguous head rows (views of
// the fused QKV output are fine); slot_mapping: [T] int64, block * block_size + offset.
void write_kv_cache(Tensor kv_cache, const Tensor& key, const Tensor& value,
                    const Tensor& slot_mapping) {
  PAGELLM_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2,
                "write_kv_cache: the cache must be contiguous [2, KVH, blocks, block_size, D]");
  PAGELLM_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 &&
                    value.stride(2) == 1 && key.scalar_type() == value.scalar_type(),
                "write_kv_cache: key and value must be [T, KVH, D] of one dtype, rows contiguous");
  PAGELLM_CHECK(key.size(1) == kv_cache.size(1) && key.size(2) == kv_cache.size(4),
                "write_kv_cache: heads do not match the cache's");
  PAGELLM_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == ScalarType::Long &&
                    slot_mapping.numel() == key.size(0),
                "write_kv_cache: slot_mapping must be [T] int64");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t num_slots = kv_cache.size(2) * kv_cache.size(3);
  const Rows keys{key.const_data_ptr(), key.stride(0), key.stride(1)};
  const Rows values{value.const_data_ptr(), value.stride(0), value.stride(1)};
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    PAGELLM_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache: slot ", slots[t],
                  " is outside the cache's ", num_slots);
  }
  pagellm::dispatch_dtype(key, "write_kv_cache", [&](auto source_tag) {
    pagellm::dispatch_cache_dtype(kv_cache, "write_kv_cache", [&](auto cache_tag) {
      using C = decltype(cache_tag);
      write<decltype(source_tag), C>(kv_cache.mutable_data_ptr<C>(), keys, values, slots,
                                     tokens, heads, dim, num_slots * dim);
    });
  });
}

}  // namespace PAGELLM_CACHE_LIBRARY
}  // namespace pagellm::kernels::write_kv

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def(PAGELLM_CACHE_OP("write_kv_cache")
        "(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) "
        "-> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl(PAGELLM_CACHE_OP("write_kv_cache"),
         TORCH_BOX(&pagellm::kernels::write_kv::write_kv_cache));
}
