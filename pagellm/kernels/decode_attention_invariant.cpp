// Decode attention (one query token per request) over the paged KV cache whose results are
// bit-identical to paged_prefill_attention's for the same token: the batch-invariant engine
// sends its decode-only steps here and its other steps to the prefill kernel, and a token's
// logits must not depend on which of the two attended it. For CPUs with AVX2 and FMA (on
// AVX512, vectors twice as wide).
//
// The prefill kernel keeps query rows along the vector lanes; a decode has only its group's
// query heads as rows (3 of SmolLM2's 16 lanes), so most of its lanes idle. Here the lanes
// hold whatever is independent instead, while every row still runs the prefill kernel's
// operations in its order:
//   - scores: KEYS along the lanes. A block's keys are widened, then transposed (Kt [head_dim,
//     keys]) so that each lane runs its key's chain fma(key[i], qscaled[i], acc), i = 0..d-1
//     from 0, with the query dim broadcast; several blocks' scores are computed at once for
//     independent chains (scores do not depend on the softmax's state);
//   - softmax: per row and block, the same masking, exact maximum, correction, exponentials
//     (exp_nonpositive, vectorized over keys instead of rows) and sequential sum over keys;
//   - output: DIMS along the lanes: ot = ot * correction, then fma(value[j][i], p[j], acc)
//     over the block's keys j ascending, p[j] broadcast.
// Blocks are folded one at a time in ascending order, from the first that the window reaches,
// as the prefill kernel folds them. Everything computes in float32; queries and output are
// float32 too, as the prefill kernel's (the wrapper widens and rounds other dtypes).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "decode_attention_invariant.h"
#include "float_transpose.h"
#include "float_vectors.h"
#include "vectorizable.h"

namespace pagellm::kernels::decode_attention_invariant {
namespace {

using pagellm::exp_nonpositive;
using pagellm::widen;

using namespace pagellm::float_vectors;

// Keys scored per pass: enough key vectors for independent FMA chains (a block of 16 keys is
// one vector on AVX512, and a chain's FMAs wait on each other).
constexpr int64_t kChunkKeys = 64;

// s[r][t * kWidth + lane] = the chain fma(kt[i][..], q[r][i], acc) over i = 0..d-1 from 0, for
// kRows rows and kTiles vectors of keys: the prefill kernel's chain for that (row, key).
template <int kRows, int kTiles>
inline void score_tile(float* s, const float* kt, const float* q, int64_t d, int64_t keys) {
  Vec acc[kRows][kTiles];
  for (auto& row : acc) {
    for (auto& v : row) v = zero_vec();
  }
  for (int64_t i = 0; i < d; ++i) {
    Vec key[kTiles];
    for (int t = 0; t < kTiles; ++t) key[t] = load_vec(kt + i * keys + t * kWidth);
    for (int r = 0; r < kRows; ++r) {
      const Vec qi = broadcast(q + r * d + i);
      for (int t = 0; t < kTiles; ++t) acc[r][t] = fmadd(key[t], qi, acc[r][t]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTiles; ++t) store_vec(s + r * keys + t * kWidth, acc[r][t]);
  }
}

template <int kRows>
inline void score_rows(float* s, const float* kt, const float* q, int64_t d, int64_t keys) {
  int64_t k = 0;
  for (; k + 4 * kWidth <= keys; k += 4 * kWidth) score_tile<kRows, 4>(s + k, kt + k, q, d, keys);
  for (; k + 2 * kWidth <= keys; k += 2 * kWidth) score_tile<kRows, 2>(s + k, kt + k, q, d, keys);
  for (; k < keys; k += kWidth) score_tile<kRows, 1>(s + k, kt + k, q, d, keys);
}

// ot[r][i0..) = ot[r][i0..) * correction[r], then fma(values[j][i0..], p[r][j], acc) for the
// block's keys j ascending: the prefill kernel's accumulate_tile with dims along the lanes.
template <int kRows, int kVecs>
inline void accumulate_tile(float* ot, const float* values, const float* p, const float* correction,
                            int64_t count, int64_t d, int64_t keys) {
  Vec acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    const Vec c = broadcast(correction + r);
    for (int v = 0; v < kVecs; ++v) acc[r][v] = mul(load_vec(ot + r * d + v * kWidth), c);
  }
  for (int64_t j = 0; j < count; ++j) {
    Vec value[kVecs];
    for (int v = 0; v < kVecs; ++v) value[v] = load_vec(values + j * d + v * kWidth);
    for (int r = 0; r < kRows; ++r) {
      const Vec pj = broadcast(p + r * keys + j);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = fmadd(value[v], pj, acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) store_vec(ot + r * d + v * kWidth, acc[r][v]);
  }
}

template <int kRows>
inline void accumulate_rows(float* ot, const float* values, const float* p, const float* correction,
                            int64_t count, int64_t d, int64_t keys) {
  int64_t i = 0;
  for (; i + 4 * kWidth <= d; i += 4 * kWidth) {
    accumulate_tile<kRows, 4>(ot + i, values + i, p, correction, count, d, keys);
  }
  for (; i < d; i += kWidth) {
    accumulate_tile<kRows, 1>(ot + i, values + i, p, correction, count, d, keys);
  }
}

// The cache lines of the next chunk's blocks (keys and values), requested a few at a time
// between the steps of this chunk's arithmetic and into L2, not L1. This kernel's first form
// requested each block's lines into L1 in one burst as it widened the block before: a
// batch-64 step at 160 tokens of context then spent about as long waiting for the cache as
// computing (30 ms; 15 without the widening). The chunk's scratch (64 keys as float32, their
// transpose, the values) fills L1 by itself. Alternated in one process (AVX2 EPYC, batch 64,
// 30 layers, ms a step at 160 and 1,000 tokens): no requests 44 and 324, spread into L1 30
// and 202, spread into L2 25 and 181; the first form, in processes alternated with the last,
// 34-39 against 24-31 and 210-262 against 165-202.
struct LineRequests {
  static constexpr int kMaxSpans = 16;  // keys and values of up to 8 blocks
  const char* spans[kMaxSpans];
  int64_t lines[kMaxSpans];
  int count = 0, span = 0, ticks_left = 0;
  int64_t line = 0, lines_left = 0;

  // Starts a chunk of `ticks` calls to tick().
  void start(int ticks) {
    count = span = 0;
    line = lines_left = 0;
    ticks_left = ticks;
  }
  void add(const void* p, int64_t bytes) {
    if (p == nullptr || count == kMaxSpans) return;
    spans[count] = static_cast<const char*>(p);
    lines[count] = (bytes + 63) / 64;
    lines_left += lines[count++];
  }
  // Requests the share of the lines left that falls to one of the ticks left.
  void tick() {
    int64_t n = ticks_left > 1 ? (lines_left + ticks_left - 1) / ticks_left : lines_left;
    ticks_left -= ticks_left > 0;
    lines_left -= n;
    for (; n > 0 && span < count; --n) {
      __builtin_prefetch(spans[span] + 64 * line, 0, 2);  // into L2
      if (++line == lines[span]) {
        ++span;
        line = 0;
      }
    }
  }
};

// Per-item scratch, all float32. Per-row state is padded to whole vectors, so that its loops
// run vector code only, as the prefill kernel's do over its padded rows. Buffers that every
// item overwrites before reading are sized once per thread, not cleared per item.
struct Scratch {
  std::vector<float> q, ot, keys, kt, values, scores, max, sum, correction, block_max;
  LineRequests requests;

  void reset(int64_t group, int64_t rows, int64_t d, int64_t chunk_keys, int64_t block_size) {
    grow(q, group * d);
    grow(keys, chunk_keys * d);
    grow(kt, chunk_keys * d);
    grow(values, block_size * d);
    grow(scores, group * chunk_keys);
    ot.assign(group * d, 0.f);
    max.assign(rows, -INFINITY);
    sum.assign(rows, 0.f);
    correction.assign(rows, 1.f);
    block_max.assign(rows, -INFINITY);
  }

  static void grow(std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
};

// One block's softmax step for each row, on its scores at `offset` of the rows' score lines
// (`count` keys from position `first_key`, then padding up to `padded`): the prefill kernel's
// fold_block, with keys instead of rows along the lanes. Leaves the weights in place of the
// scores and each row's rescaling of its past in `correction`.
void fold_block(Scratch& w, int64_t group, int64_t rows, int64_t keys, int64_t offset,
                int64_t count, int64_t padded, float first_key, bool masked, float position,
                float window) {
  for (int64_t r = 0; r < group; ++r) {
    float* row = w.scores.data() + r * keys + offset;
    for (int64_t j = count; j < padded; ++j) row[j] = -INFINITY;  // keys past the block
#pragma omp simd
    for (int64_t j = 0; j < padded; ++j) {
      const float key = first_key + static_cast<float>(j);
      row[j] = masked && (key > position || key <= position - window) ? -INFINITY : row[j];
    }
    // exact, so its order does not matter (signed zeros aside, which exp sees alike)
    float mx = w.max[r];
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < padded; ++j) mx = std::max(mx, row[j]);
    w.block_max[r] = mx;
  }
  float *mx = w.block_max.data(), *m = w.max.data(), *l = w.sum.data();
#pragma omp simd
  for (int64_t r = 0; r < rows; ++r) {
    w.correction[r] = mx[r] == -INFINITY ? 1.f : exp_nonpositive(m[r] - mx[r]);
    l[r] *= w.correction[r];
    m[r] = mx[r];
  }
  for (int64_t r = 0; r < group; ++r) {
    float* row = w.scores.data() + r * keys + offset;
    const float largest = mx[r];
#pragma omp simd
    for (int64_t j = 0; j < padded; ++j) {
      row[j] = row[j] == -INFINITY ? 0.f : exp_nonpositive(row[j] - largest);
    }
    float total = l[r];
    for (int64_t j = 0; j < count; ++j) total += row[j];  // in order, as the prefill kernel
    l[r] = total;
  }
}

// An item's keys or values as the requests ahead see them: its blocks, then those of the
// next item its thread attends, from the first it reads. Without the second part, each
// item's first chunk of blocks was never requested ahead (at SmolLM2's 160 tokens of
// context, a third of its blocks). Blocks lie anywhere in the cache, out of the hardware
// prefetchers' reach.
template <typename C>
struct BlockStream {
  const C* cache;  // the item's kv head: its keys or its values
  const int64_t* table;
  int64_t end;  // past the item's last block
  const C* next_cache;  // the next item's, or null
  const int64_t* next_table;
  int64_t next_first, next_end;
  int64_t block_elements;

  const C* block(int64_t b) const { return cache + table[b] * block_elements; }

  // The cache rows of block b, counting on past this item into the next; null past both.
  const C* ahead(int64_t b) const {
    if (b < end) return block(b);
    b += next_first - end;
    return next_cache != nullptr && b < next_end ? next_cache + next_table[b] * block_elements
                                                 : nullptr;
  }
};

// Widens the keys of `blocks` blocks from b0 into rows of `padded` keys, transposes them into
// kt [d, blocks * padded], and scores every row of the group against them.
template <typename C>
void score_chunk(Scratch& w, const BlockStream<C>& keys, int64_t b0, int64_t blocks,
                 int64_t padded, int64_t seq_len, int64_t group, int64_t d, int64_t bs) {
  const int64_t chunk = blocks * padded;
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t b = b0 + k, count = std::min(bs, seq_len - b * bs);
    float* rows = w.keys.data() + k * padded * d;
    widen(rows, keys.block(b), count * d);
    std::fill(rows + count * d, rows + padded * d, 0.f);
  }
  for (int64_t j = 0; j < chunk; j += kWidth) {
    for (int64_t i = 0; i < d; i += kWidth) {
      transpose_tile(w.kt.data() + i * chunk + j, chunk, w.keys.data() + j * d + i, d);
    }
    w.requests.tick();
  }
  int64_t r = 0;
  for (; r + 2 <= group; r += 2) {
    score_rows<2>(w.scores.data() + r * chunk, w.kt.data(), w.q.data() + r * d, d, chunk);
    w.requests.tick();
  }
  if (r < group) score_rows<1>(w.scores.data() + r * chunk, w.kt.data(), w.q.data() + r * d, d, chunk);
}

// Ticks of a chunk's requests: one per vector of keys transposed and per two rows scored
// (score_chunk), two per block (attend_item).
inline int chunk_ticks(int64_t chunk, int64_t blocks, int64_t group) {
  return static_cast<int>(chunk / kWidth + group / 2 + 2 * blocks);
}

void accumulate_block(Scratch& w, int64_t group, int64_t count, int64_t d, int64_t keys,
                      int64_t offset) {
  int64_t r = 0;
  for (; r + 2 <= group; r += 2) {
    accumulate_rows<2>(w.ot.data() + r * d, w.values.data(), w.scores.data() + r * keys + offset,
                       w.correction.data() + r, count, d, keys);
  }
  if (r < group) {
    accumulate_rows<1>(w.ot.data() + r * d, w.values.data(), w.scores.data() + r * keys + offset,
                       w.correction.data() + r, count, d, keys);
  }
}

// One (request, kv head): its query heads' attention at position seq_len - 1.
template <typename C>
void attend_item(float* out, const float* query, const BlockStream<C>& keys,
                 const BlockStream<C>& values, int64_t seq_len, const Shape& s, float scale,
                 int64_t window, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t padded = (bs + kWidth - 1) / kWidth * kWidth;
  const int64_t per_chunk = std::max<int64_t>(1, kChunkKeys / padded);
  w.reset(group, (group + kWidth - 1) / kWidth * kWidth, d, per_chunk * padded, bs);
  for (int64_t r = 0; r < group; ++r) {
    for (int64_t i = 0; i < d; ++i) w.q[r * d + i] = query[r * d + i] * scale;
  }
  const int64_t position = seq_len - 1, num_blocks = (seq_len + bs - 1) / bs;
  // as the prefill kernel: the first key the query sees, and the first unmasked for all
  const int64_t lowest = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  const int64_t all_see = window > 0 ? seq_len - window : 0;
  const float window_keys = window > 0 ? static_cast<float>(window) : INFINITY;
  for (int64_t b0 = lowest / bs; b0 < num_blocks; b0 += per_chunk) {
    const int64_t blocks = std::min(per_chunk, num_blocks - b0), chunk = blocks * padded;
    w.requests.start(chunk_ticks(chunk, blocks, group));
    for (int64_t k = 0; k < per_chunk; ++k) {  // the next chunk, maybe the next item's
      w.requests.add(keys.ahead(b0 + per_chunk + k), bs * d * sizeof(C));
      w.requests.add(values.ahead(b0 + per_chunk + k), bs * d * sizeof(C));
    }
    score_chunk(w, keys, b0, blocks, padded, seq_len, group, d, bs);
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t b = b0 + k, count = std::min(bs, seq_len - b * bs);
      widen(w.values.data(), values.block(b), count * d);
      fold_block(w, group, static_cast<int64_t>(w.max.size()), chunk, k * padded, count, padded,
                 static_cast<float>(b * bs), b * bs + count - 1 > position || b * bs < all_see,
                 static_cast<float>(position), window_keys);
      w.requests.tick();
      accumulate_block(w, group, count, d, chunk, k * padded);
      w.requests.tick();
    }
  }
  for (int64_t r = 0; r < group; ++r) {
    const float inverse = 1.f / w.sum[r];
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = w.ot[r * d + i] * inverse;
  }
}

template <typename C>
void run(const Operands& a) {
  const Shape& s = a.shape;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t head_stride = a.blocks_per_head * s.block_size * s.head_dim;
  const int64_t layer_stride = s.num_kv_heads * head_stride;
  const int64_t* lens = a.seq_lens;
  const int64_t* tables = a.block_tables;
  const C* cache = static_cast<const C*>(a.kv_cache);
  const float* q = a.query;
  float* o = a.out;
  const int64_t window = a.window;
  // an item's first block (the window's) and past its last
  auto first_block = [&](int64_t n) {
    return window > 0 ? std::max<int64_t>(0, lens[n] - window) / s.block_size : 0;
  };
  auto end_block = [&](int64_t n) { return (lens[n] + s.block_size - 1) / s.block_size; };
  // items: (request, kv head), each computed alike however the pool splits them
  at::parallel_for(0, a.requests * s.num_kv_heads, 1, [&](int64_t first, int64_t last) {
    Scratch scratch;
    for (int64_t item = first; item < last; ++item) {
      const int64_t n = item / s.num_kv_heads, h = item % s.num_kv_heads;
      const bool has_next = item + 1 < last;
      const int64_t next_n = (item + 1) / s.num_kv_heads, next_h = (item + 1) % s.num_kv_heads;
      auto stream = [&](const C* kv) {
        return BlockStream<C>{kv + h * head_stride,
                              tables + n * s.max_blocks,
                              end_block(n),
                              has_next ? kv + next_h * head_stride : nullptr,
                              has_next ? tables + next_n * s.max_blocks : nullptr,
                              has_next ? first_block(next_n) : 0,
                              has_next ? end_block(next_n) : 0,
                              s.block_size * s.head_dim};
      };
      attend_item(o + n * s.num_heads * s.head_dim + h * group * s.head_dim,
                  q + n * s.query_row_stride + h * group * s.head_dim, stream(cache),
                  stream(cache + layer_stride), lens[n], s, a.scale, window, scratch);
    }
  });
}

}  // namespace

inline namespace PAGELLM_CACHE_LIBRARY {
void attend(const Operands& operands) {
  dispatch_cache_type(operands.cache_type, [&](auto tag) { run<decltype(tag)>(operands); });
}
}

}  // namespace pagellm::kernels::decode_attention_invariant

#endif
