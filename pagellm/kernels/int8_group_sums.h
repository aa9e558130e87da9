// How the int8 kernel (quantized_linear_int8.cpp) forms a group's integer sums for a tile of
// rows: the forms its panels store codes in (8-bit codes a byte each, 4-bit ones two per
// byte), and two policies, the AVX2 instructions (NarrowSums) and AVX512-VNNI's (WideSums),
// equal to the bit. A build has one of them: WideSums where the compiler targets AVX512-VNNI,
// NarrowSums elsewhere; each instantiation is seconds of a first start's compile.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quantized_linear.h"

#ifdef __AVX2__

namespace pagellm::quantized::int8 {

// Rows per register tile with AVX2: 8 int16 accumulators of its 16 registers.
constexpr int kNarrowTileRows = 4;

// How a panel stores the codes of 4 consecutive inputs of its 16 features, and how they come
// into the two vectors vpmaddubsw multiplies (features 0-7, then 8-15): 8-bit codes a byte
// each ...
struct CodeBytes {
  using Byte = int8_t;
  static constexpr int64_t kBytes = 64;  // per 4 inputs of the 16 features
  static void load(const Byte* codes, __m256i& w0, __m256i& w1) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32));
  }
#ifdef __AVX512VNNI__
  static __m512i load16(const Byte* codes) { return _mm512_loadu_si512(codes); }
#endif
};

// ... or 4-bit codes two per byte, features 8-15 in the high nibbles: half the bytes to read,
// for a mask and a shift (of 16-bit lanes: AVX2 shifts no bytes) to unpack them.
struct CodeNibbles {
  using Byte = uint8_t;
  static constexpr int64_t kBytes = 32;
  static void load(const Byte* codes, __m256i& w0, __m256i& w1) {
    const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    const __m256i low = _mm256_set1_epi8(0x0F);
    w0 = _mm256_and_si256(both, low);
    w1 = _mm256_and_si256(_mm256_srli_epi16(both, 4), low);
  }
#ifdef __AVX512VNNI__
  // The 32 bytes in both halves of one vector (a broadcast load), the upper half's 64-bit
  // lanes shifted right by 4, then the mask: features 0-7 from the low nibbles, 8-15 from the
  // high ones. Three instructions where unpacking two halves and joining them took five.
  static __m512i load16(const Byte* codes) {
    const __m512i both = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
    const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi64(both, shifts), _mm512_set1_epi8(0x0F));
  }
#endif
};

// A panel's scales or zeros as float32, 8 (or 16) at a time: stored in float32, or in
// float16 where every one of them is exact there (Q4_0, Q4_1 and Q8_0, whose factors GGUF
// stores in float16), which leaves a decode step fewer bytes to read and the same results.
inline __m256 load8_factors(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_factors(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#ifdef __AVX512F__
inline __m512 load16_factors(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_factors(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// A group's 16 scales and zeros of a panel as float32, features 0-7 then 8-15: read and
// widened once for all the rows of a tile. Read per row, they were four float16 loads and
// conversions a row that the compiler could not share across rows: the rows' float32 sums
// are stored between them, and an intrinsic's load may alias any store.
struct NarrowFactors {
  __m256 scale[2], zero[2];
};

template <typename S>
inline NarrowFactors load_narrow_factors(const S* scales, const S* zeros) {
  return {{load8_factors(scales), load8_factors(scales + 8)},
          {load8_factors(zeros), load8_factors(zeros + 8)}};
}

// out[16] += a group's integer sums (int32, 8 features each) scaled by the panel's scale
// times d, plus the panel's zero times the group's activation sum.
inline void add_group(const __m256i (&sums)[2], float d, float sum, const NarrowFactors& factors,
                      float* out) {
  const __m256 row_scale = _mm256_set1_ps(d), row_sum = _mm256_set1_ps(sum);
  for (int h = 0; h < 2; ++h) {
    __m256 acc = _mm256_loadu_ps(out + 8 * h);
    const __m256 scale = _mm256_mul_ps(factors.scale[h], row_scale);
    acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sums[h]), acc);
    acc = _mm256_fmadd_ps(factors.zero[h], row_sum, acc);
    _mm256_storeu_ps(out + 8 * h, acc);
  }
}

inline __m256i broadcast4(const int8_t* p) {
  int32_t bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return _mm256_set1_epi32(bytes);
}

// Keeps v in a register here: without this, GCC regroups a tile's integer adds into a tree
// over products it spills to memory. Not after a group's last step, whose sums go on to their
// widening and scaling: there it made GCC store each sum and load it back at once, a stall at
// every group (the 4-bit kernel, one thread of the AVX2 EPYC: 160-164 GOP/s without it there,
// 145-150 with it; the 8-bit one unchanged, so it keeps it).
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// One group of a tile: sums[r][h] = the int32 sums of row r's products with features
// 8h..8h+7, over inputs 4 * kFirst .. 4 * kLast of the 32 in `codes` and `inputs`.
template <typename Codes, int kRows, int kFirst, int kLast>
__attribute__((always_inline)) inline void group_sums(const typename Codes::Byte* codes,
                                                      const int8_t* inputs,
                                                      __m256i (&sums)[kNarrowTileRows][2]) {
  constexpr int R = kNarrowTileRows;  // the layout's rows per tile; the first kRows are computed
  constexpr bool kUnsigned = std::is_same_v<typename Codes::Byte, uint8_t>;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = kFirst; j < kLast; ++j) {
    __m256i w0, w1;
    Codes::load(codes + j * Codes::kBytes, w0, w1);
    if constexpr (kUnsigned) {  // int16 sums, widened once per group
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m256i b = broadcast4(inputs + (j * R + r) * 4);
        sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_maddubs_epi16(w0, b));
        sums[r][1] = _mm256_add_epi16(sums[r][1], _mm256_maddubs_epi16(w1, b));
        if (j + 1 < kLast) {
          keep_in_register(sums[r][0]);
          keep_in_register(sums[r][1]);
        }
      }
    } else {  // signed codes: |code| times the activations with the codes' signs, to int32
      const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        const __m256i b = broadcast4(inputs + (j * R + r) * 4);
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(b, w0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(b, w1));
        sums[r][0] = _mm256_add_epi32(sums[r][0], _mm256_madd_epi16(p0, ones));
        sums[r][1] = _mm256_add_epi32(sums[r][1], _mm256_madd_epi16(p1, ones));
        keep_in_register(sums[r][0]);
        keep_in_register(sums[r][1]);
      }
    }
  }
  if constexpr (kUnsigned) {
    for (int r = 0; r < kRows; ++r) {
      sums[r][0] = _mm256_madd_epi16(sums[r][0], ones);
      sums[r][1] = _mm256_madd_epi16(sums[r][1], ones);
    }
  }
}

// The AVX2 instructions: a tile's sums in int16, then int32, features 0-7 and 8-15 apart.
template <typename C>
struct NarrowSums {
  using Codes = C;
  static constexpr int kTileRows = kNarrowTileRows;
  static constexpr int kPanels = 1;  // panels per tile
  using Sums = __m256i[kTileRows][2];
  using Acc = float*;  // a row's 16 sums stay in memory: AVX2 has 16 vector registers
  static Acc load(float* out) { return out; }
  static Acc zero(float* out) {
    std::fill_n(out, kPanel, 0.f);
    return out;
  }
  static void store(Acc, float*) {}
  template <int kRows, int kFirst, int kLast>
  __attribute__((always_inline)) static void group(
      const typename Codes::Byte* const (&codes)[kPanels], const int8_t* inputs,
      Sums (&sums)[kPanels]) {
    group_sums<Codes, kRows, kFirst, kLast>(codes[0], inputs, sums[0]);
  }
  using Factors = NarrowFactors;
  template <typename S>
  __attribute__((always_inline)) static Factors factors(const S* scales, const S* zeros) {
    return load_narrow_factors(scales, zeros);
  }
  __attribute__((always_inline)) static void add(const __m256i (&sums)[2], float d, float sum,
                                                 const Factors& factors, Acc& out) {
    add_group(sums, d, sum, factors, out);
  }
};

#ifdef __AVX512VNNI__
// AVX512-VNNI: a row's sums for all 16 features in one int32 vector, then the float32
// operations of add_group, lane for lane. vpdpbusd multiplies unsigned bytes with signed
// ones: 4-bit codes are the unsigned operand; with 8-bit codes (signed) the activations
// take that place, moved up by 128 (their sign bit flipped), and 128 times the codes' sum,
// from a vpdpbusd of ones with the codes, comes off again. Exact integer sums either way
// (at most 32 * 255 * 128 in a lane), equal to the bit to the AVX2 instructions'.
template <typename C>
struct WideSums {
  using Codes = C;
  // 4-bit codes: a tile is 4 rows times 2 panels (32 features), so that each activation
  // broadcast feeds two vpdpbusd, one per panel. With 8 rows of one panel, as before, the
  // projections ran about 7% slower (one thread of a Zen 5 core, SmolLM2's shapes at 64 rows,
  // processes alternated). 8-bit codes keep 8 rows of one panel: their codes' sums, one
  // vpdpbusd per panel and 4 inputs, are shared by the tile's rows, and with 4 rows they made
  // the head about 10% slower. A tile's int32 sums and float32 accumulators take 16 of the 32
  // registers.
  static constexpr bool kSigned = std::is_same_v<typename Codes::Byte, int8_t>;
  static constexpr int kPanels = kSigned ? 1 : 2;
  static constexpr int kTileRows = 8 / kPanels;
  using Sums = __m512i[kTileRows];
  using Acc = __m512;  // a row's 16 sums of a panel, in a register over the tile's groups
  static Acc load(const float* out) { return _mm512_loadu_ps(out); }
  static Acc zero(const float*) { return _mm512_setzero_ps(); }
  static void store(Acc acc, float* out) { _mm512_storeu_ps(out, acc); }
  template <int kRows, int kFirst, int kLast>
  __attribute__((always_inline)) static void group(
      const typename Codes::Byte* const (&codes)[kPanels], const int8_t* inputs,
      Sums (&sums)[kPanels]) {
    constexpr int R = kTileRows;  // the layout's rows per tile; the first kRows are computed
    // A tile of one or two sums has too few to hide vpdpbusd's latency: each chain is split in
    // two (even and odd steps), added at the end. Integer sums: equal to the bit.
    constexpr int kChains = kRows * kPanels <= 2 ? 2 : 1;
    __m512i chains[kChains][kPanels][kRows], code_sums[kPanels];
    // Indexed loops, unrolled: GCC kept range-for's arrays on the stack.
#pragma GCC unroll 2
    for (int p = 0; p < kPanels; ++p) {
      code_sums[p] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c) {
#pragma GCC unroll 8
        for (int r = 0; r < kRows; ++r) chains[c][p][r] = _mm512_setzero_si512();
      }
    }
#pragma GCC unroll 8
    for (int j = kFirst; j < kLast; ++j) {
      __m512i w[kPanels];
#pragma GCC unroll 2
      for (int p = 0; p < kPanels; ++p) {
        w[p] = Codes::load16(codes[p] + j * Codes::kBytes);
        if constexpr (kSigned) {
          code_sums[p] = _mm512_dpbusd_epi32(code_sums[p], _mm512_set1_epi8(1), w[p]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        int32_t bytes;
        std::memcpy(&bytes, inputs + (j * R + r) * 4, sizeof(bytes));
        __m512i x = _mm512_set1_epi32(bytes);
        if constexpr (kSigned) x = _mm512_xor_si512(x, _mm512_set1_epi8(-128));
#pragma GCC unroll 2
        for (int p = 0; p < kPanels; ++p) {
          __m512i& sum = chains[(j - kFirst) % kChains][p][r];
          sum = kSigned ? _mm512_dpbusd_epi32(sum, x, w[p]) : _mm512_dpbusd_epi32(sum, w[p], x);
        }
      }
    }
#pragma GCC unroll 2
    for (int p = 0; p < kPanels; ++p) {
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        sums[p][r] = kChains == 1 ? chains[0][p][r]
                                  : _mm512_add_epi32(chains[0][p][r], chains[kChains - 1][p][r]);
        if constexpr (kSigned) {
          sums[p][r] = _mm512_sub_epi32(sums[p][r], _mm512_slli_epi32(code_sums[p], 7));
        }
      }
    }
  }
  struct Factors {
    __m512 scale, zero;
  };
  template <typename S>
  __attribute__((always_inline)) static Factors factors(const S* scales, const S* zeros) {
    return {load16_factors(scales), load16_factors(zeros)};
  }
  __attribute__((always_inline)) static void add(const __m512i& sums, float d, float sum,
                                                 const Factors& factors, Acc& acc) {
    const __m512 scale = _mm512_mul_ps(factors.scale, _mm512_set1_ps(d));
    acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums), acc);
    acc = _mm512_fmadd_ps(factors.zero, _mm512_set1_ps(sum), acc);
  }
};
#endif

}  // namespace pagellm::quantized::int8

#endif  // __AVX2__
