// quantized_linear_int8's product on AMX tiles (Sapphire Rapids and later): the same int8
// panels, the same rows rounded to int8 per group of 32, the same float32 arithmetic per
// group, so the results are the AVX2 kernel's. One tile instruction multiplies 16 rows of a
// group's activations (16 x 32 int8) with a panel's codes for that group (8 x 64 bytes: 16
// features x 4 codes per row of the tile, the panel layout as stored) into 16 x 16 int32
// sums; AVX512 then adds them to float32 accumulators held in 16 registers, scaled by the
// panel's scales times each row's step, plus the panel's zeros times each row's sum. Two
// sum tiles alternate between groups. Measured on a 2-core Xeon with AMX, a group of one
// block and panel (16 x 16 x 32) takes about 10 ns of tile work (the product 5 ns, storing
// its 1 KiB of sums as much again: a group of 32 inputs fills half a tile's depth) and 12 ns
// of that scaling (4 vector operations per row), and the two do not overlap: neither deeper
// pipelining of the tiles (2-4 groups ahead) nor adding a chunk of groups at a time changed
// the speed.
//
// 4-bit codes (uint8 panels) take the signed x unsigned product, 8-bit ones (int8) the
// signed x signed one. The OS must grant the tiles' state once per process (arch_prctl);
// where it does not, the CPU has no AMX, or PAGELLM_AMX=0, the AVX2 kernel runs instead.
//
// The tiles load a code per byte, and the panels hold 4-bit codes two per byte (half the
// bytes for a decode step to read): each thread unpacks such a panel once per call into a
// buffer of its own, then multiplies every block of 16 rows with it. The scales and zeros
// may be float16 (exact, widened as they are loaded), as for the AVX2 kernel.
//
// A tile multiplies 16 rows whatever the number of live ones, and the scaling after it
// costs the same for a padding row as for a live one: below kTileMinRows rows the AVX2
// kernel, which computes only the live rows, is faster, and gives the same bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "quantized_linear.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#include <immintrin.h>

#include "int8_group_sums.h"
#include "int8_rows.h"
#include "vectorizable.h"

namespace pagellm::quantized {
namespace int8_tiles {
namespace {

constexpr int kRows = 16;  // activation rows per tile: the accumulator registers
// Fewer rows go to the AVX2 kernel. SmolLM2's shapes, each call on its own (`python
// benchmarks/quantized_matmul.py`, a 2-core Xeon with AMX): at 8 rows the AVX2 kernel is up
// to 1.5x faster, at 10 and 12 the two trade places by shape and run, at 16 the tiles lead.
constexpr int64_t kTileMinRows = 12;

// Tiles 0 and 1: sums (16 rows x 16 int32); 2 and 4: activations (16 rows x 32 int8); 3 and
// 5: codes (8 rows x 64 bytes). Even groups use 0, 2, 3, odd ones 1, 4, 5.
void configure_tiles() {
  TileConfig config;
  for (int sums : {0, 1}) config.rows[sums] = kRows, config.bytes_per_row[sums] = 64;
  for (int inputs : {2, 4}) config.rows[inputs] = kRows, config.bytes_per_row[inputs] = kGroup;
  for (int codes : {3, 5}) config.rows[codes] = kGroup / 4, config.bytes_per_row[codes] = 64;
  load_tile_config(config);
}

// A group's int32 sums into `sums`. GCC's tile intrinsics paste their tile numbers into the
// instruction, so they must be literals: one function per set of tiles.
#define PAGELLM_GROUP_PRODUCT(name, sums_tile, inputs_tile, codes_tile)                     \
  template <bool kSignedCodes>                                                             \
  inline void name(const int8_t* inputs, int64_t stride, const void* codes, int32_t* sums) { \
    _tile_zero(sums_tile);                                                                 \
    _tile_loadd(inputs_tile, inputs, stride);                                              \
    _tile_loadd(codes_tile, codes, 64);                                                    \
    if constexpr (kSignedCodes) {                                                          \
      _tile_dpbssd(sums_tile, inputs_tile, codes_tile);                                    \
    } else {                                                                               \
      _tile_dpbsud(sums_tile, inputs_tile, codes_tile);                                    \
    }                                                                                      \
    _tile_stored(sums_tile, sums, 64);                                                     \
  }
PAGELLM_GROUP_PRODUCT(even_group_product, 0, 2, 3)
PAGELLM_GROUP_PRODUCT(odd_group_product, 1, 4, 5)
#undef PAGELLM_GROUP_PRODUCT

// acc[r] += scale * d[r] * sums[r] + zero * sum[r], as add_group does on AVX2.
template <typename S>
inline void add_group(const int32_t* sums, const S* scales, const S* zeros, const float* steps,
                      const float* step_sums, int64_t groups, __m512 (&acc)[kRows]) {
  const __m512 scale = int8::load16_factors(scales), zero = int8::load16_factors(zeros);
  for (int r = 0; r < kRows; ++r) {
    const __m512 row_scale = _mm512_mul_ps(scale, _mm512_set1_ps(steps[r * groups]));
    const __m512 products = _mm512_cvtepi32_ps(_mm512_load_si512(sums + r * 16));
    acc[r] = _mm512_fmadd_ps(row_scale, products, acc[r]);
    acc[r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(step_sums[r * groups]), acc[r]);
  }
}

// A panel's 4-bit codes two per byte -> a byte per code, as the tiles load them: row j of a
// group holds features 0-7's codes in the low nibbles of its 32 bytes and features 8-15's in
// the high ones (quantized_linear_int8.cpp), which unpack to its first and last 32 bytes.
inline void unpack_nibbles(const uint8_t* packed, int64_t groups, uint8_t* bytes) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t i = 0; i < groups * 4; ++i) {  // two rows of a group at a time
    const __m512i v = _mm512_loadu_si512(packed + 64 * i);
    const __m512i lo = _mm512_and_si512(v, low);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    _mm512_storeu_si512(bytes + 128 * i, _mm512_shuffle_i64x2(lo, hi, 0x44));
    _mm512_storeu_si512(bytes + 128 * i + 64, _mm512_shuffle_i64x2(lo, hi, 0xEE));
  }
}

// The first `rows` accumulators to rows of y (`width` features each, `n` apart), in y's
// dtype. A whole panel of float32 goes as one vector store: a block's 16 rows stored
// feature by feature took about 5% of a 64-client run on the Xeon with AMX.
template <typename T>
inline void store_rows(const __m512 (&acc)[kRows], int64_t rows, int64_t width, T* y,
                       int64_t n) {
  alignas(64) float out[kPanel];
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<T, float>) {
      if (width == kPanel) {
        _mm512_storeu_ps(y + r * n, acc[r]);
        continue;
      }
    }
    _mm512_store_ps(out, acc[r]);
    for (int64_t f = 0; f < width; ++f) store(y + r * n, f, out[f]);
  }
}

// Rows [m0, m0 + 16) of the rounded activations times one panel's codes (a byte each), into
// the first `live` of those rows of y, the panel's features from n0.
template <bool kSigned, typename T, typename Code, typename S>
__attribute__((always_inline)) inline void block_times_panel(const Int8Rows& rows, int64_t m0,
                                                    int64_t live, int64_t k,
                                                    const Code* codes, const S* scales,
                                                    const S* zeros, T* y, int64_t n, int64_t n0,
                                                    int32_t (&sums)[2][kRows * 16]) {
  const int64_t groups = k / kGroup;
  const int8_t* inputs = rows.values.data() + m0 * k;
  const float* steps = rows.scales.data() + m0 * groups;
  const float* step_sums = rows.sums.data() + m0 * groups;
  __m512 acc[kRows];
  for (auto& a : acc) a = _mm512_setzero_ps();
  auto add = [&](int64_t g, const int32_t* group_sums) {
    add_group(group_sums, scales + g * kPanel, zeros + g * kPanel, steps + g, step_sums + g,
              groups, acc);
  };
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    even_group_product<kSigned>(inputs + g * kGroup, k, codes + g * kGroup * kPanel, sums[0]);
    odd_group_product<kSigned>(inputs + (g + 1) * kGroup, k, codes + (g + 1) * kGroup * kPanel,
                               sums[1]);
    add(g, sums[0]);
    add(g + 1, sums[1]);
  }
  if (g < groups) {
    even_group_product<kSigned>(inputs + g * kGroup, k, codes + g * kGroup * kPanel, sums[0]);
    add(g, sums[0]);
  }
  store_rows(acc, live, std::min<int64_t>(kPanel, n - n0), y + m0 * n + n0, n);
}

// From this many rows, each thread takes its panels kChunkPanels at a time and every block of
// rows through all of a chunk's panels before the next block: y then receives a block's
// results as runs of 1 KiB along each row, instead of one panel's 64-byte pieces a whole row
// apart (with N = 49,152, 196 KiB: a page, and a TLB entry, per piece). SmolLM2's shapes
// alone on a 2-core Xeon with AMX (`python benchmarks/quantized_matmul.py`): at 2,048 rows
// gate/up 1.3x, down 1.2x and qkv 1.15x faster, o the same; the head 1.3x at 128 rows and
// 1.45x at 256. Fewer rows keep one panel at a time, its unpacked codes in L1 (at 16 and 64
// rows, chunks were no faster, and up to 1.2x slower at 16).
constexpr int64_t kChunkMinRows = 128;
constexpr int64_t kChunkPanels = 16;

// 8-bit codes (int8 panels) as stored; 4-bit ones (uint8) two per byte, unpacked once per
// call and thread.
template <typename T, typename Code, typename S>
void run(T* y, const T* x, int64_t m, int64_t k, int64_t n, const Code* panel_codes,
         const S* panel_scales, const S* panel_zeros) {
  constexpr bool kSigned = std::is_same_v<Code, int8_t>;
  const int64_t groups = k / kGroup, panels = (n + kPanel - 1) / kPanel;
  const int64_t padded = (m + kRows - 1) / kRows * kRows;
  const int64_t panel_bytes = kSigned ? kPanel * k : kPanel * k / 2;
  const int64_t chunk_panels = padded >= kChunkMinRows ? kChunkPanels : 1;
  const Int8Rows rows = quantize_rows(x, m, padded, k, [k](int64_t row, int64_t group) {
    return GroupPlace{row * k + group * kGroup, 4, row * (k / kGroup) + group};
  });
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) int32_t sums[2][kRows * 16];
    std::vector<Code> unpacked(kSigned ? 0 : chunk_panels * kPanel * k);
    for (int64_t p0 = begin; p0 < end; p0 += chunk_panels) {
      const int64_t chunk = std::min(chunk_panels, end - p0);
      const Code* chunk_codes = panel_codes + p0 * panel_bytes;
      if constexpr (!kSigned) {
        for (int64_t c = 0; c < chunk; ++c) {
          unpack_nibbles(chunk_codes + c * panel_bytes, groups, unpacked.data() + c * kPanel * k);
        }
        chunk_codes = unpacked.data();
      }
      for (int64_t m0 = 0; m0 < padded; m0 += kRows) {
        for (int64_t c = 0; c < chunk; ++c) {
          const int64_t p = p0 + c;
          block_times_panel<kSigned>(rows, m0, std::min<int64_t>(kRows, m - m0), k,
                                     chunk_codes + c * kPanel * k,
                                     panel_scales + p * groups * kPanel,
                                     panel_zeros + p * groups * kPanel, y, n, p * kPanel, sums);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace
}  // namespace int8_tiles

inline namespace PAGELLM_INT8_LIBRARY {

bool int8_matmul_amx(const Int8Operands& operands) {
  if (operands.m < int8_tiles::kTileMinRows || !tiles_permitted()) return false;
  dispatch_int8_operands<kGroup>(operands, [](auto... args) { int8_tiles::run(args...); });
  return true;
}

}  // namespace PAGELLM_INT8_LIBRARY
}  // namespace pagellm::quantized

#else

namespace pagellm::quantized {
inline namespace PAGELLM_INT8_LIBRARY {

bool int8_matmul_amx(const Int8Operands&) { return false; }

}  // namespace PAGELLM_INT8_LIBRARY
}  // namespace pagellm::quantized

#endif
