// How the batch-invariant decode kernel (decode_attention_invariant.cpp) reads ahead: the
// blocks an item and the next one read, and the cache lines of the next chunk requested
// between the steps of this one's arithmetic.
#pragma once

#include <cstdint>

// Internal to the one kernel file that includes this (as its own definitions were), so that
// none of it is exported from the library.
namespace pagellm::kernels::decode_attention_invariant {
namespace {

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

}  // namespace
}  // namespace pagellm::kernels::decode_attention_invariant
