// Decode attention over the paged KV cache, for CPUs.
//
// One query token per request attends to the keys of its own request, read in
// place from the cache blocks its block table names: no gathered copy of K/V,
// and scores, softmax and the weighted sum of values in float32 whatever the
// query and cache dtypes (the cache may be narrower than the model's dtype).
// Work items are (request, kv head) pairs spread over the intra-op thread
// pool; each handles the query heads that share its kv head.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "vectorizable.h"

namespace {

using pagellm::exp_nonpositive;
using pagellm::load;
using pagellm::store;

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <typename T>
inline void widen(float* out, const T* row, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = load(row, i);
}

// Calls visit(position, cache slot) for the first seq_len tokens of a block table,
// block by block (no division per token). Blocks lie anywhere in the cache, out of
// reach of the hardware prefetcher: the next block's rows (`row_bytes` each, from
// `rows`) are requested while this one is visited.
template <typename T, typename Visit>
inline void for_each_token(const int64_t* table, int64_t seq_len, int64_t block_size,
                           const T* rows, int64_t row_size, Visit&& visit) {
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t block_bytes = block_size * row_size * static_cast<int64_t>(sizeof(T));
  for (int64_t b = 0, start = 0; b < num_blocks; ++b, start += block_size) {
    if (b + 1 < num_blocks) {
      const char* next = reinterpret_cast<const char*>(rows + table[b + 1] * block_size * row_size);
      for (int64_t offset = 0; offset < block_bytes; offset += 64) __builtin_prefetch(next + offset);
    }
    const int64_t base = table[b] * block_size, count = std::min(block_size, seq_len - start);
    for (int64_t i = 0; i < count; ++i) visit(start + i, base + i);
  }
}

inline void softmax_in_place(float* row, int64_t n) {
  const float peak = *std::max_element(row, row + n);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    row[t] = exp_nonpositive(row[t] - peak);
    total += row[t];
  }
  const float inverse = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) row[t] *= inverse;
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks;
};

constexpr int64_t kMaxHeadDim = 512;

constexpr int64_t kMaxDotGroup = 8;

// Scores of bf16 keys against bf16 queries with AVX512-BF16's dot-product instruction:
// products of bf16 pairs are exact in float32 and summed there, so the result matches
// widening both first, in half the instructions. Returns false where it does not apply
// (other dtypes or head sizes, more than kMaxDotGroup query heads per kv head, CPUs
// without the instruction), leaving the scores to the generic path.
template <typename T, typename C, int64_t kDim>
bool score_with_dot_instruction(float* scores, const T* query, const C* keys,
                                const int64_t* table, int64_t seq_len, int64_t group,
                                int64_t block_size, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
                kDim > 0 && kDim % 32 == 0) {
    if (group > kMaxDotGroup) return false;
    constexpr int64_t kChunks = kDim / 32;  // 32 bf16 values per 512-bit register
    __m512bh heads[kMaxDotGroup][kChunks];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < kChunks; ++c)
        heads[g][c] = (__m512bh)_mm512_loadu_si512(query + g * kDim + c * 32);
    for_each_token(table, seq_len, block_size, keys, kDim, [&](int64_t t, int64_t slot) {
      __m512bh key[kChunks];
      for (int64_t c = 0; c < kChunks; ++c)
        key[c] = (__m512bh)_mm512_loadu_si512(keys + slot * kDim + c * 32);
      for (int64_t g = 0; g < group; ++g) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < kChunks; ++c) sum = _mm512_dpbf16_ps(sum, heads[g][c], key[c]);
        scores[g * seq_len + t] = _mm512_reduce_add_ps(sum) * scale;
      }
    });
    return true;
  }
#endif
  return false;
}

// Attend the query heads [group, head_dim] of one (request, kv head) pair. kDim > 0 fixes
// the head size at compile time (fully unrolled row loops); 0 reads it from the shape.
// Scores: each key row is widened to float32 once for every query head. Values: one
// head at a time, so that its weighted sum stays in registers across the tokens.
template <typename T, typename C, int64_t kDim>
void attend_one(T* out, const T* query, const C* keys, const C* values, const int64_t* table,
                int64_t seq_len, const Shape& s, float scale, std::vector<float>& scratch) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = kDim > 0 ? kDim : s.head_dim;
  scratch.resize(group * d + group * seq_len);
  float* q = scratch.data();
  float* scores = q + group * d;
  if (!score_with_dot_instruction<T, C, kDim>(scores, query, keys, table, seq_len, group,
                                           s.block_size, scale)) {
    alignas(64) float row[kMaxHeadDim];
    for (int64_t i = 0; i < group * d; ++i) q[i] = load(query, i) * scale;
    for_each_token(table, seq_len, s.block_size, keys, d, [&](int64_t t, int64_t slot) {
      widen(row, keys + slot * d, d);
      for (int64_t g = 0; g < group; ++g) scores[g * seq_len + t] = dot(q + g * d, row, d);
    });
  }
  for (int64_t g = 0; g < group; ++g) softmax_in_place(scores + g * seq_len, seq_len);
  for (int64_t g = 0; g < group; ++g) {
    alignas(64) float sum[kMaxHeadDim];
    std::fill(sum, sum + d, 0.f);
    const float* weights = scores + g * seq_len;
    for_each_token(table, seq_len, s.block_size, values, d, [&](int64_t t, int64_t slot) {
      const C* value = values + slot * d;
      const float weight = weights[t];
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) sum[i] += weight * load(value, i);
    });
    for (int64_t i = 0; i < d; ++i) store(out, g * d + i, sum[i]);
  }
}

template <typename T, typename C, int64_t kDim>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, const Shape& s,
         float scale) {
  const int64_t num_requests = query.size(0), group = s.num_heads / s.num_kv_heads;
  const int64_t layer_stride = s.num_kv_heads * s.num_blocks * s.block_size * s.head_dim;
  const int64_t head_stride = s.num_blocks * s.block_size * s.head_dim;
  const C* cache = kv_cache.const_data_ptr<C>();
  const T* q = query.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();
  at::parallel_for(0, num_requests * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / s.num_kv_heads, h = item % s.num_kv_heads;
      const int64_t offset = (n * s.num_heads + h * group) * s.head_dim;
      attend_one<T, C, kDim>(o + offset, q + offset, cache + h * head_stride,
                             cache + layer_stride + h * head_stride, tables + n * s.max_blocks,
                             lens[n], s, scale, scratch);
    }
  });
}

template <typename T, typename C>
void dispatch_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const Shape& s,
                  float scale) {
  switch (s.head_dim) {
    case 64: run<T, C, 64>(out, query, kv_cache, block_tables, seq_lens, s, scale); break;
    case 128: run<T, C, 128>(out, query, kv_cache, block_tables, seq_lens, s, scale); break;
    default: run<T, C, 0>(out, query, kv_cache, block_tables, seq_lens, s, scale);
  }
}

// out, query: [N, H, D] of one dtype; kv_cache: [2, KVH, num_blocks, block_size, D] of any;
// block_tables: [N, max_blocks] int64; seq_lens: [N] int64 (keys visible to each query).
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale) {
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous() &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention expects contiguous tensors");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2,
              "paged_decode_attention: unexpected ranks");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: query and output dtypes differ");
  const Shape s{query.size(1),   kv_cache.size(1), query.size(2),
                kv_cache.size(2), kv_cache.size(3), block_tables.size(1)};
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && kv_cache.size(4) == s.head_dim,
              "paged_decode_attention: head shapes do not match");
  TORCH_CHECK(s.head_dim <= kMaxHeadDim, "paged_decode_attention: head_dim above ", kMaxHeadDim);
  const float f = static_cast<float>(scale);
  pagellm::dispatch_dtype(query, "paged_decode_attention", [&](auto query_tag) {
    pagellm::dispatch_dtype(kv_cache, "paged_decode_attention", [&](auto cache_tag) {
      dispatch_dim<decltype(query_tag), decltype(cache_tag)>(out, query, kv_cache, block_tables,
                                                             seq_lens, s, f);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
