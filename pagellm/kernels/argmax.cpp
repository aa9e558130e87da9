// Row-wise argmax of logits, as torch.argmax(dim=-1) answers it: the first index of the
// largest value, or of the first NaN. torch's CPU kernel compares one element at a time:
// 3.5 ms over a decode step's [64, 49152] float32 logits, where this takes about 0.2 ms.
// float32, bf16 or fp16 logits, compared as float32 (exact): a greedy step of a bf16 model
// needs no float32 copy of them.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::argmax {
namespace {

using pagellm::load;

constexpr int64_t kChunk = 64;  // values tested together before looking at them one by one

// Index of the first value of row[0:n] for which found(value) holds; n if none.
template <typename T, typename Found>
int64_t first_index(const T* row, int64_t n, Found&& found) {
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = std::min(n, start + kChunk);
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t v = start; v < end; ++v) any |= found(load(row, v)) ? 1 : 0;
    if (!any) continue;
    for (int64_t v = start; v < end; ++v) {
      if (found(load(row, v))) return v;
    }
  }
  return n;
}

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  float largest = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : largest) reduction(| : nan)
  for (int64_t v = 0; v < n; ++v) {
    const float value = load(row, v);
    largest = value > largest ? value : largest;
    nan |= value != value ? 1 : 0;
  }
  if (nan) return first_index(row, n, [](float value) { return value != value; });
  const int64_t index = first_index(row, n, [largest](float value) { return value == largest; });
  return index < n ? index : 0;  // every value -inf
}

// out: [R] int64; logits: [R, V] float32, bf16 or fp16, contiguous.
void argmax_rows(Tensor out, const Tensor& logits) {
  PAGELLM_CHECK(logits.dim() == 2 && logits.is_contiguous() && out.dim() == 1 &&
                    out.scalar_type() == ScalarType::Long && out.size(0) == logits.size(0) &&
                    out.is_contiguous(),
                "argmax_rows expects logits [R, V] and out int64 [R]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  int64_t* indices = out.mutable_data_ptr<int64_t>();
  pagellm::dispatch_dtype(logits, "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* values = logits.const_data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) indices[r] = argmax_row(values + r * vocab, vocab);
    });
  });
}

}  // namespace
}  // namespace pagellm::kernels::argmax

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("argmax_rows", TORCH_BOX(&pagellm::kernels::argmax::argmax_rows));
}
