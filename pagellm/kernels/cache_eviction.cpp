// Tensors flushed from every level of the CPU caches (clflushopt), so that the start-up
// timings of a projection's forms read the weights from memory, as a decode step over the
// whole model does. On a CPU whose last-level cache holds all 30 layers of a shape (480 MiB
// on the AMX Xeon), repeated timings would read them from cache and favour the form with
// more bytes. Built only where the compiler targets clflushopt; Python checks for the op.
#include <cstdint>
#include <vector>

#include "stable_ops.h"

#ifdef __CLFLUSHOPT__
#include <immintrin.h>

namespace pagellm::kernels::cache_eviction {
namespace {

constexpr int64_t kLine = 64;

// Byte ranges rather than tensors: oneDNN's packed weights have no storage to take.
void evict_from_cache(const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes) {
  PAGELLM_CHECK(starts.size() == sizes.size(), "evict_from_cache: one size per start");
  for (size_t i = 0; i < starts.size(); ++i) {
    auto* bytes = reinterpret_cast<char*>(static_cast<uintptr_t>(starts[i]));
    for (int64_t at = 0; at < sizes[i]; at += kLine) _mm_clflushopt(bytes + at);
  }
  _mm_sfence();
}

}  // namespace
}  // namespace pagellm::kernels::cache_eviction

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("evict_from_cache(int[] starts, int[] sizes) -> ()");
}

// No tensor arguments to dispatch on: one kernel for every backend.
STABLE_TORCH_LIBRARY_IMPL(pagellm, CompositeExplicitAutograd, m) {
  m.impl("evict_from_cache", TORCH_BOX(&pagellm::kernels::cache_eviction::evict_from_cache));
}

#endif
