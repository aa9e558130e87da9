// Causal attention of prompt chunks over the paged KV cache, for CPUs with AVX2 and FMA
// (on AVX512, the same tiles twice as wide).
//
// A chunk's queries sit at positions seq_len - query_len .. seq_len - 1 of their request
// and see every key up to their own position: cached prefix and chunk alike, read in
// place from the blocks the request's block table names. A work item is up to 32 query
// tokens of one request times the query heads sharing one kv head. It walks the key
// blocks once, with an online softmax, and keeps its query rows along the vector lanes:
//   - the queries are transposed once per item (Qt [head_dim, rows]), so scores of 4
//     keys x 16 rows (32 on AVX512; one vector of rows for an item that fills no more, such
//     as a decode's query heads) are a register tile of FMAs, each key value broadcast;
//   - the softmax over a block's keys is then elementwise across rows;
//   - the output (Ot [head_dim, rows]) gathers values the same way, tiles of 4 dims x the
//     same rows, rescaled by the softmax's correction as the tile is loaded.
// Each row's sums run in one order whatever else its item holds, so a token attends alike
// as a decode, in a chunk of any size, or recomputed (the batch-invariant engine sends
// decodes here too).
// Keys past a row's position are masked only in the blocks that hold some (the diagonal);
// blocks past the item's last position are never read. With a sliding window of W keys, a
// row sees only positions pos - W + 1 .. pos: blocks before the item's first row's window
// are never read, and keys before a row's window are masked like keys past its position
// (a block that holds none of a row's keys leaves its sums at exactly 0, so a row's result
// still does not depend on the rows that share its item). Everything computes in float32;
// queries and output are float32 too (the wrapper widens other dtypes' queries and rounds the
// output back, the same bits as rounding here: compiled once per query dtype, this file took
// a third longer to build at a first start).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "float_vectors.h"
#include "prefill_attention.h"
#include "vectorizable.h"

namespace pagellm::kernels::prefill_attention {
namespace {

using pagellm::exp_nonpositive;
using pagellm::widen;

// The register tiles' vectors (float_vectors.h): two per key or dim of a tile, 8
// independent sums of FMAs.
using namespace pagellm::float_vectors;

constexpr int64_t kItemTokens = 32;  // query tokens per work item

// s[j][r0..r0+kVecs*kWidth) = sum_i keys[j][i] * qt[i][r0..) for the 4 keys of `keys`. Each
// lane sums its own row in the same order whatever kVecs is: a row's scores do not depend on
// how many rows share its tile.
template <int kVecs>
inline void score_tile(float* s, const float* keys, const float* qt, int64_t d, int64_t rows,
                       int64_t r0) {
  Vec acc[kTile][kVecs];
  for (auto& lanes : acc) {
    for (auto& v : lanes) v = zero_vec();
  }
  for (int64_t i = 0; i < d; ++i) {
    Vec q[kVecs];
    for (int v = 0; v < kVecs; ++v) q[v] = load_vec(qt + i * rows + r0 + v * kWidth);
    for (int64_t j = 0; j < kTile; ++j) {
      const Vec key = broadcast(keys + j * d + i);
      for (int v = 0; v < kVecs; ++v) acc[j][v] = fmadd(key, q[v], acc[j][v]);
    }
  }
  for (int64_t j = 0; j < kTile; ++j) {
    for (int v = 0; v < kVecs; ++v) store_vec(s + j * rows + r0 + v * kWidth, acc[j][v]);
  }
}

// ot[i0 + i][r0..) = ot[..] * correction[r0..] + sum_j values[j][i0 + i] * p[j][r0..] for
// the 4 dims from i0, over `count` keys.
template <int kVecs>
inline void accumulate_tile(float* ot, const float* values, const float* p, const float* correction,
                            int64_t count, int64_t d, int64_t rows, int64_t i0, int64_t r0) {
  Vec c[kVecs], acc[kTile][kVecs];
  for (int v = 0; v < kVecs; ++v) c[v] = load_vec(correction + r0 + v * kWidth);
  for (int64_t i = 0; i < kTile; ++i) {
    for (int v = 0; v < kVecs; ++v) {
      acc[i][v] = mul(load_vec(ot + (i0 + i) * rows + r0 + v * kWidth), c[v]);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    Vec pj[kVecs];
    for (int v = 0; v < kVecs; ++v) pj[v] = load_vec(p + j * rows + r0 + v * kWidth);
    for (int64_t i = 0; i < kTile; ++i) {
      const Vec value = broadcast(values + j * d + i0 + i);
      for (int v = 0; v < kVecs; ++v) acc[i][v] = fmadd(value, pj[v], acc[i][v]);
    }
  }
  for (int64_t i = 0; i < kTile; ++i) {
    for (int v = 0; v < kVecs; ++v) store_vec(ot + (i0 + i) * rows + r0 + v * kWidth, acc[i][v]);
  }
}

// Per-item scratch, all float32; rows are (token, query head) pairs, token-major.
struct Scratch {
  std::vector<float> qt, ot, scores, keys, values, position, max, sum, correction, block_max;

  void resize(int64_t rows, int64_t d, int64_t padded_block) {
    qt.assign(d * rows, 0.f);
    ot.assign(d * rows, 0.f);
    scores.assign(padded_block * rows, 0.f);
    keys.assign(padded_block * d, 0.f);
    values.assign(padded_block * d, 0.f);
    position.assign(rows, 0.f);
    max.assign(rows, -INFINITY);
    sum.assign(rows, 0.f);
    correction.assign(rows, 0.f);
    block_max.assign(rows, 0.f);
  }
};

// Folds one block's scores (`count` keys from position `first_key`) into the running
// softmax: masks keys past each row's position, or `window` or more before it, when
// `masked`, turns scores into weights relative to the new maximum, and leaves each row's
// rescaling of its past in `correction` (1 while a row has seen no key of its window).
void fold_block(Scratch& w, int64_t rows, int64_t count, float first_key, bool masked,
                float window) {
  float* s = w.scores.data();
  float *mx = w.block_max.data(), *m = w.max.data(), *l = w.sum.data();
  const float* pos = w.position.data();
#pragma omp simd
  for (int64_t r = 0; r < rows; ++r) mx[r] = m[r];
  for (int64_t j = 0; j < count; ++j) {
    float* row = s + j * rows;
    const float key = first_key + static_cast<float>(j);
#pragma omp simd
    for (int64_t r = 0; r < rows; ++r) {
      const float score = masked && (key > pos[r] || key <= pos[r] - window) ? -INFINITY : row[r];
      row[r] = score;
      mx[r] = score > mx[r] ? score : mx[r];
    }
  }
#pragma omp simd
  for (int64_t r = 0; r < rows; ++r) {
    w.correction[r] = mx[r] == -INFINITY ? 1.f : exp_nonpositive(m[r] - mx[r]);
    l[r] *= w.correction[r];
    m[r] = mx[r];
  }
  for (int64_t j = 0; j < count; ++j) {
    float* row = s + j * rows;
#pragma omp simd
    for (int64_t r = 0; r < rows; ++r) {
      // exactly 0 for a masked key (exp_nonpositive(-inf) is about 1.6e-38): a row's sums then do
      // not depend on how many keys past its position its work item reads
      row[r] = row[r] == -INFINITY ? 0.f : exp_nonpositive(row[r] - mx[r]);
      l[r] += row[r];
    }
  }
}

// Requests a block's keys and values (`n` values each from `offset`) into L2, where its
// item reads them next: blocks lie anywhere in the cache, out of the hardware prefetchers'
// reach, and an item of a decode's few rows computes too little per block to hide their
// reading. Into L1, the chunk's scratch would push them out again. On the AVX2 EPYC, 64
// decodes (a mixed step's) over 30 layers took 50 against 60 ms at 160 tokens of context and
// 252 against 336 at 1,000 (alternated in one process); a 2,000-token prefill, 1.64 against
// 1.70 s.
template <typename C>
inline void request_block(const C* keys, const C* values, int64_t offset, int64_t n) {
  const char* k = reinterpret_cast<const char*>(keys + offset);
  const char* v = reinterpret_cast<const char*>(values + offset);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(C)); i += 64) {
    __builtin_prefetch(k + i, 0, 2);
    __builtin_prefetch(v + i, 0, 2);
  }
}

// An item of up to kWidth rows (a decode's query heads, a short chunk) takes tiles one
// vector wide, larger ones two.
template <typename C, int kVecs>
void attend_item(float* out, const float* query, const C* keys, const C* values, const int64_t* table,
                 int64_t seq_len, int64_t query_len, int64_t first, const Shape& s, float scale,
                 int64_t window, Scratch& w) {
  constexpr int64_t kLanes = kVecs * kWidth;
  const int64_t group = s.num_heads / s.num_kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t tokens = std::min(kItemTokens, query_len - first);
  const int64_t rows = (tokens * group + kLanes - 1) / kLanes * kLanes;
  const int64_t padded = (bs + kTile - 1) / kTile * kTile;
  const int64_t first_position = seq_len - query_len + first;
  w.resize(rows, d, padded);
  for (int64_t r = 0; r < rows; ++r) {  // padding rows repeat the last token, then are dropped
    const int64_t t = std::min(r / group, tokens - 1), g = r % group;
    const float* q = query + (first + t) * s.query_row_stride + g * d;
    for (int64_t i = 0; i < d; ++i) w.qt[i * rows + r] = q[i] * scale;
    w.position[r] = static_cast<float>(first_position + t);
  }
  const int64_t visible = first_position + tokens;  // keys the item's last token sees
  // the first key its first token sees, and the first that every token sees
  const int64_t lowest = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  const int64_t all_see = window > 0 ? visible - window : 0;
  const float window_keys = window > 0 ? static_cast<float>(window) : INFINITY;
  for (int64_t b = lowest / bs; b * bs < visible; ++b) {
    const int64_t count = std::min(bs, visible - b * bs), slot = table[b] * bs;
    if ((b + 1) * bs < visible) request_block(keys, values, table[b + 1] * bs * d, bs * d);
    widen(w.keys.data(), keys + slot * d, count * d);
    widen(w.values.data(), values + slot * d, count * d);
    std::fill(w.keys.begin() + count * d, w.keys.end(), 0.f);
    for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
      for (int64_t j0 = 0; j0 < count; j0 += kTile) {
        score_tile<kVecs>(w.scores.data() + j0 * rows, w.keys.data() + j0 * d, w.qt.data(), d, rows, r0);
      }
    }
    fold_block(w, rows, count, static_cast<float>(b * bs),
               b * bs + count - 1 > first_position || b * bs < all_see, window_keys);
    for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
      for (int64_t i0 = 0; i0 < d; i0 += kTile) {
        accumulate_tile<kVecs>(w.ot.data(), w.values.data(), w.scores.data(), w.correction.data(),
                        count, d, rows, i0, r0);
      }
    }
  }
  for (int64_t r = 0; r < tokens * group; ++r) {
    const float inverse = 1.f / w.sum[r];
    float* o = out + (first + r / group) * s.num_heads * d + (r % group) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = w.ot[i * rows + r] * inverse;
  }
}

template <typename C>
void run(const Operands& op) {
  const Shape& s = op.shape;
  const int64_t requests = op.requests, group = s.num_heads / s.num_kv_heads;
  const int64_t head_stride = op.blocks_per_head * s.block_size * s.head_dim;
  const int64_t layer_stride = s.num_kv_heads * head_stride;
  const int64_t *lens = op.seq_lens, *starts = op.query_starts, *q_lens = op.query_lens;
  // items: (request, kv head, first token); out rows: the requests' chunks one after another.
  // A request's later tokens see more keys: its items alternate first and last, so that the
  // pool's contiguous slices of items get equal work.
  std::vector<int64_t> item_request, item_first, out_row(requests, 0);
  for (int64_t n = 0; n < requests; ++n) {
    if (n > 0) out_row[n] = out_row[n - 1] + q_lens[n - 1];
    const int64_t count = (q_lens[n] + kItemTokens - 1) / kItemTokens;
    for (int64_t i = 0; i < count; ++i) {
      item_request.push_back(n);
      item_first.push_back((i % 2 == 0 ? i / 2 : count - 1 - i / 2) * kItemTokens);
    }
  }
  const int64_t chunks = static_cast<int64_t>(item_request.size());
  const C* cache = static_cast<const C*>(op.kv_cache);
  at::parallel_for(0, chunks * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / s.num_kv_heads, h = item % s.num_kv_heads;
      const int64_t n = item_request[chunk];
      const int64_t rows = std::min(kItemTokens, q_lens[n] - item_first[chunk]) * group;
      auto attend = rows <= kWidth ? attend_item<C, 1> : attend_item<C, 2>;
      attend(op.out + out_row[n] * s.num_heads * s.head_dim + h * group * s.head_dim,
             op.query + starts[n] * s.query_row_stride + h * group * s.head_dim,
             cache + h * head_stride, cache + layer_stride + h * head_stride,
             op.block_tables + n * s.max_blocks, lens[n], q_lens[n], item_first[chunk], s,
             op.scale, op.window, scratch);
    }
  });
}

}  // namespace

inline namespace PAGELLM_CACHE_LIBRARY {
void attend(const Operands& operands) {
  dispatch_cache_type(operands.cache_type, [&](auto tag) { run<decltype(tag)>(operands); });
}
}  // namespace PAGELLM_CACHE_LIBRARY

}  // namespace pagellm::kernels::prefill_attention

#endif
