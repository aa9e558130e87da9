// Decode attention over the paged KV cache, for CPUs.
//
// One query token per request attends to the keys of its own request, read in
// place from the cache blocks its block table names: no gathered copy of K/V,
// and scores, softmax and the weighted sum of values in float32 whatever the
// query and cache dtypes (the cache may be narrower than the model's dtype).
// Work items are (request, kv head) pairs spread over the intra-op thread
// pool; each handles the query heads that share its kv head.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_scores.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::paged_attention {
namespace {

using pagellm::attention_scores::score_eight_at_a_time;
using pagellm::attention_scores::score_fp8_with_dot_instruction;
using pagellm::attention_scores::score_with_dot_instruction;
using pagellm::exp_nonpositive;
using pagellm::load;
using pagellm::store;
using pagellm::widen;

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Calls visit(block index counted from the first visited, first cache slot, count) for each
// block of a block table holding keys first_key .. seq_len - 1 (first_key 0: every block
// from the first; past 0, a sliding window, which starts inside its first block).
template <typename Visit>
inline void for_each_block(const int64_t* table, int64_t first_key, int64_t seq_len,
                           int64_t block_size, Visit&& visit) {
  const int64_t first_block = first_key / block_size;
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const int64_t start = std::max(b * block_size, first_key);
    const int64_t end = std::min((b + 1) * block_size, seq_len);
    visit(b - first_block, table[b] * block_size + start - b * block_size, end - start);
  }
}

// The first key a query at position seq_len - 1 sees: 0, or the start of its window.
inline int64_t first_visible_key(int64_t seq_len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
}

// widen(out, rows, n) (unless out is null), requesting the same bytes of `next` (unless
// null) a cache line at a time along the way, into L2. Requested all at once, a block's 64
// lines filled the core's queue of misses and stalled it, then left memory idle while the
// block was computed on. Into L1, the scratch of the blocks between pushed them out again:
// batch 64 at 1,000 tokens of context, 30 layers, 334-384 against 444-489 ms a step (bf16
// cache, processes alternated, an AVX2 EPYC).
template <typename C>
inline void widen_prefetching(float* out, const C* rows, const C* next, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(C);
  for (int64_t i = 0; i < n; i += kLine) {
    if (next != nullptr) __builtin_prefetch(next + i, 0, 2);  // into L2
    if (out != nullptr) widen(out + i, rows + i, std::min(kLine, n - i));
  }
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks;
};

constexpr int64_t kMaxHeadDim = 512;
// Blocks lie anywhere in the cache, out of reach of the hardware prefetchers, so each block
// requests the values of the next block in its thread's sequence of blocks and the keys
// of the one kKeysAhead on: a row of each per value row it sums (add_weighted_cached_rows),
// or the keys while widening them where it widens them first (fp8, no AVX512-BF16).
// Requested in one burst after scoring, as they were, the next block's keys filled the
// core's 16 line-fill buffers and stalled it: over blocks in random order (batch 256, 132
// tokens, 30 layers) 76 ms a step against 64 with one block ahead and 59 with two (three:
// 61); over blocks in order, which the hardware prefetchers follow, all take 38-40 ms.
constexpr int64_t kKeysAhead = 2;

// Running state of one query head's online softmax: the largest score so far, the sum of
// exp(score - largest), and the values weighted by those exponentials.
struct Running {
  float largest, total;
  float* weighted;  // [head_dim]
};

// Folds one block's scores (turned into exp(score - largest) in place) into a head's state.
inline void fold_block_scores(Running& head, float* scores, int64_t count, int64_t d) {
  float block_largest = -INFINITY;
#pragma omp simd reduction(max : block_largest)
  for (int64_t t = 0; t < count; ++t) block_largest = std::max(block_largest, scores[t]);
  if (block_largest > head.largest) {
    const float shrink = exp_nonpositive(head.largest - block_largest);  // 0 for the first
    head.total *= shrink;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) head.weighted[i] *= shrink;
    head.largest = block_largest;
  }
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < count; ++t) {
    scores[t] = exp_nonpositive(scores[t] - head.largest);
    total += scores[t];
  }
  head.total += total;
}

// sum[0:d] += sum over t of weights[t] * rows[t], where add_weighted_block does not apply.
// On AVX2 with a compiled head size, 64 sums at a time are held in eight registers across
// the rows: left to GCC, they went through the stack, and each row waited on the previous
// row's stores.
template <int64_t kDim>
inline void add_weighted_rows(float* sum, const float* weights, const float* rows, int64_t count,
                              int64_t d) {
#if defined(__AVX2__)
  if constexpr (kDim > 0 && kDim % 64 == 0) {
    for (int64_t c = 0; c < kDim; c += 64) {
      __m256 local[8];
      for (int i = 0; i < 8; ++i) local[i] = _mm256_loadu_ps(sum + c + 8 * i);
      for (int64_t t = 0; t < count; ++t) {
        const __m256 weight = _mm256_broadcast_ss(weights + t);
        for (int i = 0; i < 8; ++i) {
          local[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(rows + t * kDim + c + 8 * i), local[i]);
        }
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(sum + c + 8 * i, local[i]);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < count; ++t) {
    const float weight = weights[t];
    const float* row = rows + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) sum[i] += weight * row[i];
  }
}

#if defined(__AVX512F__)
// add_weighted_rows for kHeads heads at once, over dims [first, first + 64) of `count` rows
// read from the cache as they are: each value row is widened once, in registers, for all
// of them. The rows of `ahead` and `ahead_keys` (unless null) are requested one of each per
// row along the way.
template <int kHeads, typename C, int64_t kDim>
void add_weighted_cached_rows(Running* heads, const float* weights, int64_t stride,
                              const C* rows, const C* ahead, const C* ahead_keys, int64_t count,
                              int64_t first) {
  __m512 acc[kHeads][4];
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < 4; ++i)
      acc[h][i] = _mm512_loadu_ps(heads[h].weighted + first + 16 * i);
  for (int64_t t = 0; t < count; ++t) {
    if (ahead != nullptr) widen_prefetching<C>(nullptr, nullptr, ahead + t * kDim, kDim);
    if (ahead_keys != nullptr)
      widen_prefetching<C>(nullptr, nullptr, ahead_keys + t * kDim, kDim);
    __m512 row[4];
    for (int i = 0; i < 4; ++i) row[i] = pagellm::widen16(rows + t * kDim + first + 16 * i);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 weight = _mm512_set1_ps(weights[h * stride + t]);
      for (int i = 0; i < 4; ++i) acc[h][i] = _mm512_fmadd_ps(weight, row[i], acc[h][i]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(heads[h].weighted + first + 16 * i, acc[h][i]);
}
#endif

// Every head's weighted sum of one block's values, read in place: 64 dims of up to four
// heads per pass, so that a head group of 3 (SmolLM2's) reads each row once, where widening
// the block to float32 first, then summing head by head, read it four times (14% faster
// over cached blocks, SmolLM2's shape). False where it does not apply (no AVX512, head
// sizes not a multiple of 64), leaving it to the caller.
template <typename C, int64_t kDim>
bool add_weighted_block(Running* heads, const float* weights, int64_t stride, const C* rows,
                        const C* ahead, const C* ahead_keys, int64_t count, int64_t group) {
#if defined(__AVX512F__)
  if constexpr (kDim > 0 && kDim % 64 == 0) {
    for (int64_t first = 0; first < kDim; first += 64) {
      for (int64_t g = 0; g < group; g += 4) {
        const bool requests = first == 0 && g == 0;  // the first pass requests
        auto add = [&](auto heads_per_pass) {
          add_weighted_cached_rows<decltype(heads_per_pass)::value, C, kDim>(
              heads + g, weights + g * stride, stride, rows, requests ? ahead : nullptr,
              requests ? ahead_keys : nullptr, count, first);
        };
        switch (std::min<int64_t>(4, group - g)) {
          case 1: add(std::integral_constant<int, 1>{}); break;
          case 2: add(std::integral_constant<int, 2>{}); break;
          case 3: add(std::integral_constant<int, 3>{}); break;
          default: add(std::integral_constant<int, 4>{});
        }
      }
    }
    return true;
  }
#endif
  return false;
}

// Attend the query heads [group, head_dim] of one (request, kv head) pair in one pass over
// its blocks, with an online softmax: each block's keys and values are read once, while
// they are in cache. kDim > 0 fixes the head size at compile time (fully unrolled row
// loops); 0 reads it from the shape.
template <typename T, typename C, int64_t kDim>
void attend_one(T* out, const T* query, const C* keys, const C* values, const int64_t* table,
                int64_t first_key, int64_t seq_len, const Shape& s, float scale,
                std::vector<float>& scratch,
                std::vector<Running>& heads, const C* const* sequence, int64_t layer_stride) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = kDim > 0 ? kDim : s.head_dim;
  const int64_t bs = s.block_size, padded = (bs + 7) / 8 * 8;
  scratch.resize(2 * group * d + group * bs + 2 * padded * d);  // kept from item to item
  float* q = scratch.data();
  float* weighted = q + group * d;
  float* scores = weighted + group * d;          // [group, block_size]
  float* block_keys = scores + group * bs;  // [padded block_size, d] widened (fp8 to bf16)
  float* block_values = block_keys + padded * d;  // [padded block_size, d]
  std::fill(weighted, weighted + group * d, 0.f);
  heads.resize(group);
  for (int64_t g = 0; g < group; ++g) heads[g] = {-INFINITY, 0.f, weighted + g * d};
  for (int64_t i = 0; i < group * d; ++i) q[i] = load(query, i) * scale;
  // sequence: the keys of this item's blocks, then of the thread's next kKeysAhead (or null)
  for_each_block(table, first_key, seq_len, bs, [&](int64_t b, int64_t slot, int64_t count) {
    const C* unrequested_keys = sequence[b + kKeysAhead];
    const C* next_values = sequence[b + 1] == nullptr ? nullptr : sequence[b + 1] + layer_stride;
    if (!score_with_dot_instruction<T, C, kDim>(scores, bs, query, keys + slot * d, count, group,
                                                scale)) {
      if (!score_fp8_with_dot_instruction<T, C, kDim>(
              scores, bs, query, keys + slot * d, unrequested_keys, count, group, scale,
              reinterpret_cast<c10::BFloat16*>(block_keys))) {
        widen_prefetching(block_keys, keys + slot * d, unrequested_keys, count * d);
        if (!score_eight_at_a_time<kDim>(scores, bs, q, block_keys, count, group)) {
          for (int64_t t = 0; t < count; ++t)
            for (int64_t g = 0; g < group; ++g)
              scores[g * bs + t] = dot(q + g * d, block_keys + t * d, d);
        }
      }
      unrequested_keys = nullptr;  // requested while widening the keys
    }
    for (int64_t g = 0; g < group; ++g) fold_block_scores(heads[g], scores + g * bs, count, d);
    if (add_weighted_block<C, kDim>(heads.data(), scores, bs, values + slot * d, next_values,
                                    unrequested_keys, count, group)) {
      return;
    }
    widen_prefetching(block_values, values + slot * d, next_values, count * d);
    for (int64_t g = 0; g < group; ++g) {
      add_weighted_rows<kDim>(heads[g].weighted, scores + g * bs, block_values, count, d);
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = 1.f / heads[g].total;
    for (int64_t i = 0; i < d; ++i) store(out, g * d + i, heads[g].weighted[i] * inverse);
  }
}

template <typename T, typename C, int64_t kDim>
void run(Tensor& out, const Tensor& query, const Tensor& kv_cache,
         const Tensor& block_tables, const Tensor& seq_lens, const Shape& s,
         float scale, int64_t window) {
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
    std::vector<Running> heads;
    std::vector<const C*> sequence;
    auto first_block_of = [&](int64_t item) {
      return first_visible_key(lens[item / s.num_kv_heads], window) / s.block_size;
    };
    auto blocks_of = [&](int64_t item) {  // the blocks it reads
      return (lens[item / s.num_kv_heads] + s.block_size - 1) / s.block_size -
             first_block_of(item);
    };
    auto keys_of = [&](int64_t item, int64_t b) {  // (its values follow one layer_stride on)
      const int64_t n = item / s.num_kv_heads, h = item % s.num_kv_heads;
      const int64_t block = tables[n * s.max_blocks + first_block_of(item) + b];
      return cache + h * head_stride + block * s.block_size * s.head_dim;
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / s.num_kv_heads, h = item % s.num_kv_heads;
      const int64_t offset = (n * s.num_heads + h * group) * s.head_dim;
      const int64_t wanted = blocks_of(item) + kKeysAhead;
      sequence.clear();
      for (int64_t later = item, b = 0; later < end && int64_t(sequence.size()) < wanted;) {
        if (b < blocks_of(later)) {
          sequence.push_back(keys_of(later, b++));
        } else {
          ++later, b = 0;
        }
      }
      sequence.resize(wanted, nullptr);
      attend_one<T, C, kDim>(o + offset, q + offset, cache + h * head_stride,
                             cache + layer_stride + h * head_stride, tables + n * s.max_blocks,
                             first_visible_key(lens[n], window), lens[n], s, scale, scratch,
                             heads, sequence.data(), layer_stride);
    }
  });
}

template <typename T, typename C>
void dispatch_dim(Tensor& out, const Tensor& query, const Tensor& kv_cache,
                  const Tensor& block_tables, const Tensor& seq_lens, const Shape& s,
                  float scale, int64_t window) {
  switch (s.head_dim) {
    case 64: run<T, C, 64>(out, query, kv_cache, block_tables, seq_lens, s, scale, window); break;
    case 128: run<T, C, 128>(out, query, kv_cache, block_tables, seq_lens, s, scale, window); break;
    default: run<T, C, 0>(out, query, kv_cache, block_tables, seq_lens, s, scale, window);
  }
}

// out, query: [N, H, D] of one dtype; kv_cache: [2, KVH, num_blocks, block_size, D] of any;
// block_tables: [N, max_blocks] int64; seq_lens: [N] int64 (keys known to each query);
// window > 0: each query sees only its last `window` keys (sliding-window attention).
void paged_decode_attention(Tensor out, const Tensor& query, const Tensor& kv_cache,
                            const Tensor& block_tables, const Tensor& seq_lens,
                            double scale, int64_t window) {
  PAGELLM_CHECK(query.is_contiguous() && out.is_contiguous() && kv_cache.is_contiguous() &&
                    block_tables.is_contiguous() && seq_lens.is_contiguous(),
                "paged_decode_attention expects contiguous tensors");
  PAGELLM_CHECK(query.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2,
                "paged_decode_attention: unexpected ranks");
  PAGELLM_CHECK(out.scalar_type() == query.scalar_type(),
                "paged_decode_attention: query and output dtypes differ");
  const Shape s{query.size(1),   kv_cache.size(1), query.size(2),
                kv_cache.size(2), kv_cache.size(3), block_tables.size(1)};
  PAGELLM_CHECK(s.num_heads % s.num_kv_heads == 0 && kv_cache.size(4) == s.head_dim,
                "paged_decode_attention: head shapes do not match");
  PAGELLM_CHECK(s.head_dim <= kMaxHeadDim, "paged_decode_attention: head_dim above ", kMaxHeadDim);
  // float16 queries take the float32 code: it widens each query value before use and rounds
  // each result once, as their own instantiation did, so the kernel compiles for two query
  // dtypes instead of three (its 45 forms were the kernels' longest compile).
  if (query.scalar_type() == ScalarType::Half) {
    Tensor wide = torch::stable::new_empty(out, out.sizes(), ScalarType::Float);
    paged_decode_attention(wide, torch::stable::to(query, ScalarType::Float), kv_cache,
                           block_tables, seq_lens, scale, window);
    torch::stable::copy_(out, wide);
    return;
  }
  PAGELLM_CHECK(
      query.scalar_type() == ScalarType::Float || query.scalar_type() == ScalarType::BFloat16,
      "paged_decode_attention: unsupported dtype ", query.scalar_type());
  const float f = static_cast<float>(scale);
  auto with_query = [&](auto query_tag) {
    pagellm::dispatch_any_cache_dtype(kv_cache, "paged_decode_attention", [&](auto cache_tag) {
      dispatch_dim<decltype(query_tag), decltype(cache_tag)>(out, query, kv_cache, block_tables,
                                                             seq_lens, s, f, window);
    });
  };
  if (query.scalar_type() == ScalarType::BFloat16) {
    with_query(c10::BFloat16{});
  } else {
    with_query(float{});
  }
}

}  // namespace
}  // namespace pagellm::kernels::paged_attention

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("paged_decode_attention",
         TORCH_BOX(&pagellm::kernels::paged_attention::paged_decode_attention));
}
