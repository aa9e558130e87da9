// The sampler's exponential race (pagellm/sample/noise.py) in one pass over the logits:
//   logits[r, v] -= log(-log(u)),
//   u = ((fmix32(key_r + v * 0x9E3779B9 mod 2^32) >> 8) + 0.5) / 2^24.
// The torch version takes a dozen int64 ops over [rows, vocab] and a noise tensor; for a
// decode step of 64 requests over SmolLM2's 49k vocabulary, 65 ms (torch.rand's noise,
// 24 ms) against about 5 ms here.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "stable_ops.h"
#include "vectorizable.h"

namespace pagellm::kernels::sampling_noise {
namespace {

using pagellm::log_positive;

// MurmurHash3's 32-bit finalizer.
inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// logits: [R, V] float32, contiguous; keys: [R] int64 holding 32-bit keys.
void subtract_log_exponential(Tensor logits, const Tensor& keys) {
  PAGELLM_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                    logits.scalar_type() == ScalarType::Float && keys.dim() == 1 &&
                    keys.scalar_type() == ScalarType::Long && keys.size(0) == logits.size(0),
                "subtract_log_exponential expects logits float32 [R, V] and keys int64 [R]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const Tensor contiguous_keys = torch::stable::contiguous(keys);
  const int64_t* key = contiguous_keys.const_data_ptr<int64_t>();
  float* values = logits.mutable_data_ptr<float>();
  at::parallel_for(0, rows * vocab, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin / vocab; r <= (end - 1) / vocab; ++r) {
      const uint32_t row_key = static_cast<uint32_t>(key[r]);
      const int64_t first = std::max(begin, r * vocab) - r * vocab;
      const int64_t last = std::min(end, (r + 1) * vocab) - r * vocab;
      float* row = values + r * vocab;
#pragma omp simd
      for (int64_t v = first; v < last; ++v) {
        const uint32_t bits = fmix32(row_key + static_cast<uint32_t>(v) * 0x9E3779B9u);
        const float u = (static_cast<float>(bits >> 8) + 0.5f) * 5.9604645e-8f;  // 2^-24
        row[v] -= log_positive(-log_positive(u));
      }
    }
  });
}

}  // namespace
}  // namespace pagellm::kernels::sampling_noise

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("subtract_log_exponential(Tensor(a!) logits, Tensor keys) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("subtract_log_exponential",
         TORCH_BOX(&pagellm::kernels::sampling_noise::subtract_log_exponential));
}
