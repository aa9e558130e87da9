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

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "vectorizable.h"

namespace {

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

// Calls visit(first position, first cache slot, count, next block's first slot or -1) for
// each block of a block table holding the first seq_len tokens. Blocks lie anywhere in the
// cache, out of reach of the hardware prefetcher: a visit requests the next block's rows
// while it reads its own (widen_prefetching).
template <typename Visit>
inline void for_each_block(const int64_t* table, int64_t seq_len, int64_t block_size,
                           Visit&& visit) {
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  for (int64_t b = 0, start = 0; b < num_blocks; ++b, start += block_size) {
    const int64_t next = b + 1 < num_blocks ? table[b + 1] * block_size : -1;
    visit(start, table[b] * block_size, std::min(block_size, seq_len - start), next);
  }
}

// widen(out, rows, n) (unless out is null), requesting the same bytes of `next` (unless
// null) a cache line at a time along the way. Requested all at once, a block's 64 lines
// filled the core's queue of misses and stalled it, then left memory idle while the block
// was computed on.
template <typename C>
inline void widen_prefetching(float* out, const C* rows, const C* next, int64_t n) {
  constexpr int64_t kLine = 64 / sizeof(C);
  for (int64_t i = 0; i < n; i += kLine) {
    if (next != nullptr) __builtin_prefetch(next + i);
    if (out != nullptr) widen(out + i, rows + i, std::min(kLine, n - i));
  }
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks;
};

constexpr int64_t kMaxHeadDim = 512;

#if defined(__AVX512BF16__)
// Sum of each of 16 vectors, as one vector: sums[t] = sum of v[t]'s lanes. A reduction
// tree over the vectors together: 2.8 instructions per vector, against 8 for a horizontal
// sum of each.
inline __m512 sum_each(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i) {  // each 128-bit lane: v[2i] and v[2i+1] in alternate places
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: v[4i..4i+3], that lane's sums
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes: quads[2i] halves, then quads[2i+1] ones
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}
#endif

// Scores of `count` consecutive bf16 key rows against bf16 queries with AVX512-BF16's
// dot-product instruction: products of bf16 pairs are exact in float32 and summed there,
// so the result matches widening both first, in half the instructions. 16 keys at a time
// for one head, their sums reduced together (sum_each); the last count % 16 one by one.
// Returns false where it does not apply (other dtypes or head sizes, CPUs without the
// instruction), leaving the scores to the generic path.
template <typename T, typename C, int64_t kDim>
bool score_with_dot_instruction(float* scores, int64_t stride, const T* query, const C* keys,
                                int64_t count, int64_t group, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> &&
                kDim > 0 && kDim % 32 == 0) {
    constexpr int64_t kChunks = kDim / 32;  // 32 bf16 values per 512-bit register
    auto key_chunk = [&](int64_t t, int64_t c) {
      return (__m512bh)_mm512_loadu_si512(keys + t * kDim + c * 32);
    };
    for (int64_t g = 0; g < group; ++g) {
      __m512bh head[kChunks];
      for (int64_t c = 0; c < kChunks; ++c)
        head[c] = (__m512bh)_mm512_loadu_si512(query + g * kDim + c * 32);
      int64_t t0 = 0;
      for (; t0 + 16 <= count; t0 += 16) {
        __m512 sums[16];
        for (int t = 0; t < 16; ++t) {
          sums[t] = _mm512_setzero_ps();
          for (int64_t c = 0; c < kChunks; ++c)
            sums[t] = _mm512_dpbf16_ps(sums[t], head[c], key_chunk(t0 + t, c));
        }
        _mm512_storeu_ps(scores + g * stride + t0,
                         _mm512_mul_ps(sum_each(sums), _mm512_set1_ps(scale)));
      }
      for (; t0 < count; ++t0) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t c = 0; c < kChunks; ++c)
          sum = _mm512_dpbf16_ps(sum, head[c], key_chunk(t0, c));
        scores[g * stride + t0] = _mm512_reduce_add_ps(sum) * scale;
      }
    }
    return true;
  }
#endif
  return false;
}

// fp8 keys scored as bf16 ones (score_with_dot_instruction): a block's rows are widened to
// bf16 first, exactly (every e4m3 and e5m2 value is a bf16 value), into `widened`,
// requesting `next` (unless null) a line per 64 keys' values along the way. Widened to
// float32 and scored with AVX2 instead, an fp8 cache was bound by that arithmetic: slower
// than a bf16 one of twice its bytes. False where it does not apply.
template <typename T, typename C, int64_t kDim>
bool score_fp8_with_dot_instruction(float* scores, int64_t stride, const T* query, const C* keys,
                                    const C* next, int64_t count, int64_t group, float scale,
                                    c10::BFloat16* widened) {
#if defined(__AVX512BF16__)
  constexpr bool kE4M3 = std::is_same_v<C, c10::Float8_e4m3fn>;
  constexpr bool kFp8 = kE4M3 || std::is_same_v<C, c10::Float8_e5m2>;
  if constexpr (kFp8 && std::is_same_v<T, c10::BFloat16> && kDim > 0 && kDim % 32 == 0) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(keys);
    for (int64_t i = 0; i < count * kDim; i += 16) {
      if (next != nullptr && i % 64 == 0) __builtin_prefetch(next + i);
      const __m512 wide = pagellm::widen16_fp8<kE4M3>(bytes + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(widened + i),
                          (__m256i)_mm512_cvtneps_pbh(wide));
    }
    return score_with_dot_instruction<T, c10::BFloat16, kDim>(scores, stride, query, widened,
                                                              count, group, scale);
  }
#endif
  return false;
}

#if defined(__AVX2__)
// Sum of each of 8 vectors, as one vector: sums[t] = sum of v[t]'s lanes.
inline __m256 sum_each(const __m256 (&v)[8]) {
  const __m256 pairs0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 pairs1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(pairs0, pairs1, 0x20),
                       _mm256_permute2f128_ps(pairs0, pairs1, 0x31));
}
#endif

// scores[g * stride + t] = q[g] . keys[t] for float32 rows of kDim values. On AVX2, 8 keys
// at a time for one head, in 8 independent sums reduced together: a dot product per key
// would wait on its own chain of adds and on a horizontal sum. Rows past `count` (up to
// the next multiple of 8) are read but their scores dropped. False where it does not apply.
template <int64_t kDim>
bool score_eight_at_a_time(float* scores, int64_t stride, const float* q, const float* keys,
                           int64_t count, int64_t group) {
#if defined(__AVX2__)
  if constexpr (kDim > 0 && kDim % 8 == 0) {
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t0 = 0; t0 < count; t0 += 8) {
        __m256 sums[8];
        for (int t = 0; t < 8; ++t) sums[t] = _mm256_setzero_ps();
        for (int64_t c = 0; c < kDim; c += 8) {
          const __m256 query = _mm256_loadu_ps(q + g * kDim + c);
          for (int t = 0; t < 8; ++t) {
            sums[t] = _mm256_fmadd_ps(query, _mm256_loadu_ps(keys + (t0 + t) * kDim + c), sums[t]);
          }
        }
        alignas(32) float eight[8];
        _mm256_store_ps(eight, sum_each(sums));
        std::copy(eight, eight + std::min<int64_t>(8, count - t0), scores + g * stride + t0);
      }
    }
    return true;
  }
#endif
  return false;
}

// Running state of one query head's online softmax: the largest score so far, the sum of
// exp(score - largest), and the values weighted by those exponentials.
struct Running {
  float largest, total;
  float* weighted;  // [head_dim]
};

// Folds one block's scores (turned into exp(score - largest) in place) into a head's state.
inline void fold_block_scores(Running& head, float* scores, int64_t count, int64_t d) {
  const float block_largest = *std::max_element(scores, scores + count);
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

// sum[0:d] += sum over t of weights[t] * rows[t]. On AVX2 or AVX512 with a compiled head
// size, 64 sums at a time are held in registers across the rows: left to GCC, they went
// through the stack, and each row waited on the previous row's stores.
template <int64_t kDim>
inline void add_weighted_rows(float* sum, const float* weights, const float* rows, int64_t count,
                              int64_t d) {
#if defined(__AVX512F__)
  if constexpr (kDim > 0 && kDim % 64 == 0) {  // the same with 16 lanes: 4 registers
    for (int64_t c = 0; c < kDim; c += 64) {
      __m512 local[4];
      for (int i = 0; i < 4; ++i) local[i] = _mm512_loadu_ps(sum + c + 16 * i);
      for (int64_t t = 0; t < count; ++t) {
        const __m512 weight = _mm512_set1_ps(weights[t]);
        for (int i = 0; i < 4; ++i) {
          local[i] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(rows + t * kDim + c + 16 * i),
                                     local[i]);
        }
      }
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(sum + c + 16 * i, local[i]);
    }
    return;
  }
#endif
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

// Attend the query heads [group, head_dim] of one (request, kv head) pair in one pass over
// its blocks, with an online softmax: each block's keys and values are read once, while
// they are in cache. kDim > 0 fixes the head size at compile time (fully unrolled row
// loops); 0 reads it from the shape.
template <typename T, typename C, int64_t kDim>
void attend_one(T* out, const T* query, const C* keys, const C* values, const int64_t* table,
                int64_t seq_len, const Shape& s, float scale, std::vector<float>& scratch,
                const C* after_keys, const C* after_values) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = kDim > 0 ? kDim : s.head_dim;
  const int64_t bs = s.block_size, padded = (bs + 7) / 8 * 8;
  scratch.assign(2 * group * d + group * bs + 2 * padded * d, 0.f);
  float* q = scratch.data();
  float* weighted = q + group * d;
  float* scores = weighted + group * d;          // [group, block_size]
  float* block_keys = scores + group * bs;  // [padded block_size, d] widened (fp8 to bf16)
  float* block_values = block_keys + padded * d;  // [padded block_size, d]
  std::vector<Running> heads(group);
  for (int64_t g = 0; g < group; ++g) heads[g] = {-INFINITY, 0.f, weighted + g * d};
  for (int64_t i = 0; i < group * d; ++i) q[i] = load(query, i) * scale;
  // the last block requests the first rows of the thread's next item (`after_*`, or null)
  auto next_rows = [&](const C* rows, const C* after, int64_t next) {
    return next < 0 ? after : rows + next * d;
  };
  for_each_block(table, seq_len, bs, [&](int64_t, int64_t slot, int64_t count, int64_t next) {
    const C* next_keys = next_rows(keys, after_keys, next);
    if (score_with_dot_instruction<T, C, kDim>(scores, bs, query, keys + slot * d, count, group,
                                               scale)) {
      widen_prefetching<C>(nullptr, nullptr, next_keys, count * d);  // requests only
    } else if (!score_fp8_with_dot_instruction<T, C, kDim>(
                   scores, bs, query, keys + slot * d, next_keys, count, group, scale,
                   reinterpret_cast<c10::BFloat16*>(block_keys))) {
      widen_prefetching(block_keys, keys + slot * d, next_keys, count * d);
      if (!score_eight_at_a_time<kDim>(scores, bs, q, block_keys, count, group)) {
        for (int64_t t = 0; t < count; ++t)
          for (int64_t g = 0; g < group; ++g)
            scores[g * bs + t] = dot(q + g * d, block_keys + t * d, d);
      }
    }
    for (int64_t g = 0; g < group; ++g) fold_block_scores(heads[g], scores + g * bs, count, d);
    widen_prefetching(block_values, values + slot * d, next_rows(values, after_values, next),
                      count * d);
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
    // an item's first keys (its values follow one layer_stride further)
    auto first_keys = [&](int64_t item) {
      const int64_t n = item / s.num_kv_heads, h = item % s.num_kv_heads;
      return cache + h * head_stride + tables[n * s.max_blocks] * s.block_size * s.head_dim;
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / s.num_kv_heads, h = item % s.num_kv_heads;
      const int64_t offset = (n * s.num_heads + h * group) * s.head_dim;
      const C* after = item + 1 < end && lens[(item + 1) / s.num_kv_heads] > 0
                           ? first_keys(item + 1) : nullptr;
      attend_one<T, C, kDim>(o + offset, q + offset, cache + h * head_stride,
                             cache + layer_stride + h * head_stride, tables + n * s.max_blocks,
                             lens[n], s, scale, scratch, after,
                             after == nullptr ? nullptr : after + layer_stride);
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
    pagellm::dispatch_cache_dtype(kv_cache, "paged_decode_attention", [&](auto cache_tag) {
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
