// Decode attention (one query token per request) over the paged KV cache whose results are
// bit-identical to paged_prefill_attention's for the same token: the batch-invariant engine
// sends a step's decodes here and its prompt chunks to the prefill kernel, and a token's
// logits must not depend on which of the two attended it. For CPUs with AVX2 and FMA (on
// AVX512, vectors twice as wide).
//
// The prefill kernel keeps query rows along the vector lanes; a decode has only its group's
// query heads as rows (3 of SmolLM2's 16 lanes), so most of its lanes idle. Here the lanes
// hold whatever is independent instead, while every row still runs the prefill kernel's
// operations in its order:
//   - scores: KEYS along the lanes. A block's keys are widened and transposed (Kt [head_dim,
//     keys]; bf16 ones in one pass, bf16_widening.h) so that each lane runs its key's chain
//     fma(key[i], qscaled[i], acc), i = 0..d-1 from 0, with the query dim broadcast; several
//     blocks' scores are computed at once for independent chains (scores do not depend on
//     the softmax's state);
//   - softmax: per row and block, the same masking, exact maximum, correction, exponentials
//     (exp_nonpositive, vectorized over keys instead of rows) and sequential sum over keys;
//   - output: DIMS along the lanes: ot = ot * correction, then fma(value[j][i], p[j], acc)
//     over the block's keys j ascending, p[j] broadcast (bf16 values widen with their dims
//     reordered, which the output undoes).
// Blocks are folded one at a time in ascending order, from the first that the window reaches,
// as the prefill kernel folds them. Everything computes in float32; queries and output are
// float32 too, as the prefill kernel's (the wrapper widens and rounds other dtypes).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "bf16_widening.h"
#include "decode_attention_invariant.h"
#include "decode_attention_reads.h"
#include "decode_attention_tiles.h"
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

// The largest of start and the `padded` scores (a whole number of vectors) of a row, as
// std::max(largest, score) over them. Exact, so its order does not matter (signed zeros
// aside, which exp sees alike); vmaxps(score, largest) keeps largest where the score is NaN,
// as std::max does. GCC compiled the omp simd reduction this replaces as a scalar chain.
inline float row_max(const float* row, int64_t padded, float start) {
  Vec largest = broadcast(&start);
  for (int64_t j = 0; j < padded; j += kWidth) largest = max_vec(load_vec(row + j), largest);
  float lanes[kWidth];
  store_vec(lanes, largest);
  float result = start;
  for (float lane : lanes) result = std::max(result, lane);
  return result;
}

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
    w.block_max[r] = row_max(row, padded, w.max[r]);
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

// Whether keys and values take bf16_widening's forms: bf16 ones, whole 16s of dims a row.
// Values then widen with their dims reordered within each 16 (PairedBf16ValueRows), which
// an item's output undoes: each dim's chain is the same wherever its lane.
template <typename C>
inline bool widens_paired(int64_t d) {
  return std::is_same_v<C, c10::BFloat16> && d % 16 == 0;
}

// kt [d, blocks * padded] = the keys of `blocks` blocks from b0, widened and transposed
// (zeros past each block's last key), one tick per vector of keys.
template <typename C>
void widen_transposed(Scratch& w, const BlockStream<C>& keys, int64_t b0, int64_t blocks,
                      int64_t padded, int64_t seq_len, int64_t d, int64_t bs) {
  const int64_t chunk = blocks * padded;
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (widens_paired<C>(d)) {
      for (int64_t j = 0; j < chunk; j += 8) {
        const int64_t b = b0 + j / padded, key = j % padded;
        const int64_t count = std::min(bs, seq_len - b * bs) - key;
        for (int64_t i = 0; i < d; i += 16) {
          bf16_widening::widen_transpose_8x16(w.kt.data() + i * chunk + j, chunk,
                                              keys.block(b) + key * d + i, d, count);
        }
        if ((j + 8) % kWidth == 0) w.requests.tick();
      }
      return;
    }
  }
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
}

// Scores every row of the group against the keys of `blocks` blocks from b0.
template <typename C>
void score_chunk(Scratch& w, const BlockStream<C>& keys, int64_t b0, int64_t blocks,
                 int64_t padded, int64_t seq_len, int64_t group, int64_t d, int64_t bs) {
  const int64_t chunk = blocks * padded;
  widen_transposed(w, keys, b0, blocks, padded, seq_len, d, bs);
  in_row_passes(group, [&](int64_t r, auto rows) {
    score_rows<decltype(rows)::value>(w.scores.data() + r * chunk, w.kt.data(),
                                      w.q.data() + r * d, d, chunk);
    w.requests.tick();
  });
}

// Ticks of a chunk's requests: one per vector of keys transposed and per pass of rows scored
// (score_chunk), two per block (attend_item).
inline int chunk_ticks(int64_t chunk, int64_t blocks, int64_t group) {
  return static_cast<int>(chunk / kWidth + row_passes(group) + 2 * blocks);
}

template <typename Values>
void accumulate_block(Scratch& w, const Values& values, int64_t group, int64_t count, int64_t d,
                      int64_t keys, int64_t offset) {
  in_row_passes(group, [&](int64_t r, auto rows) {
    accumulate_rows<decltype(rows)::value>(w.ot.data() + r * d, values,
                                           w.scores.data() + r * keys + offset,
                                           w.correction.data() + r, count, d, keys);
  });
}

// Accumulates a block's `count` value rows: bf16 ones as they lie in the cache where they
// widen paired, others widened into the scratch first.
template <typename C>
void accumulate_values(Scratch& w, const C* rows, int64_t group, int64_t count, int64_t d,
                       int64_t keys, int64_t offset) {
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (widens_paired<C>(d)) {
      return accumulate_block(w, PairedBf16ValueRows{rows, d}, group, count, d, keys, offset);
    }
  }
  widen(w.values.data(), rows, count * d);
  accumulate_block(w, FloatValueRows{w.values.data(), d}, group, count, d, keys, offset);
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
      fold_block(w, group, static_cast<int64_t>(w.max.size()), chunk, k * padded, count, padded,
                 static_cast<float>(b * bs), b * bs + count - 1 > position || b * bs < all_see,
                 static_cast<float>(position), window_keys);
      w.requests.tick();
      accumulate_values(w, values.block(b), group, count, d, chunk, k * padded);
      w.requests.tick();
    }
  }
  for (int64_t r = 0; r < group; ++r) {
    const float inverse = 1.f / w.sum[r];
    const bool paired = widens_paired<C>(d);
    for (int64_t i = 0; i < d; ++i) {
      const int64_t dim = paired ? i - i % 16 + bf16_widening::kPairedDim[i % 16] : i;
      out[r * d + dim] = w.ot[r * d + i] * inverse;
    }
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
