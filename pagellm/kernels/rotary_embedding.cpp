// Rotary position embedding, in place, for CPUs: the "rotate half" layout, where pair
// (i, i + d/2) of each head turns by its position's angle. Math in float32, one
// rounding per element, as the unfused torch path does. Queries and keys are
// rotated in one call when they sit side by side in the fused QKV output.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "layer_ops.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::rotary_embedding {
namespace {

using pagellm::load;
using pagellm::store;

template <typename T>
void rotate(T* x, const float* table, int64_t tokens, int64_t heads, int64_t dim,
            int64_t token_stride, int64_t head_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + t * dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* first = x + t * token_stride + h * head_stride;
        T* second = first + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = load(first, i), b = load(second, i);
          store(first, i, a * cos[i] - b * sin[i]);
          store(second, i, b * cos[i] + a * sin[i]);
        }
      }
    }
  });
}

}  // namespace

// x: [T, heads, dim] with contiguous heads rows; table: [T, dim] float32, cos of each
// pair in its first half and sin in its second.
void rotary_embedding(Tensor x, const Tensor& table) {
  PAGELLM_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
                "rotary_embedding expects [T, heads, dim] with contiguous head rows");
  PAGELLM_CHECK(table.is_contiguous() && table.scalar_type() == ScalarType::Float &&
                    table.size(0) == x.size(0) && table.size(1) == x.size(2),
                "rotary_embedding: the table must be float32 [T, dim]");
  const float* angles = table.const_data_ptr<float>();
  pagellm::dispatch_dtype(x, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    rotate(x.mutable_data_ptr<T>(), angles, x.size(0), x.size(1), x.size(2), x.stride(0),
           x.stride(1));
  });
}

}  // namespace pagellm::kernels::rotary_embedding

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("rotary_embedding(Tensor(a!) x, Tensor table) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("rotary_embedding", TORCH_BOX(&pagellm::kernels::rotary_embedding::rotary_embedding));
}
