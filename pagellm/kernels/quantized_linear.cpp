// y = x @ W^T with W kept as a GGUF file stores it: per group of G = 32 weights along the
// input (or 16: Q6_K's), w = (code - offset) * scale + zero. The codes are widened to float32 and
// multiplied there, so the only rounding is float32's. Two paths:
// - a few rows (a decode step of a few requests): bound by memory traffic, where 4-bit
//   codes are an eighth of float32's bytes and 8-bit codes a quarter. Each pass over the
//   weights widens them in registers for up to 4 rows.
// - more rows: bound by compute. Panels of 16 output features are widened once into a
//   buffer in cache and multiplied with the rows in register tiles, as a dense matmul is.
//   (quantized_linear_int8.cpp multiplies 4-bit codes with rows rounded to int8 instead:
//   twice the throughput, not the exact dequantized model.)
//
// 4-bit codes: [N, K / 2] bytes, byte j of group g holding element 32g + j in its low
// nibble and 32g + 16 + j in its high nibble (the GGUF order); offset 8.
// 8-bit codes: [N, K] int8; offset 0.
// scales, zeros: [N, K / G] float32 (zeros may be empty: all zero). The codes are
// widened 32 at a time whatever G; a group of 16 scales half of them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "float_transpose.h"
#include "quantized_linear.h"
#include "stable_ops.h"
#include "tensor_dispatch.h"
#include "vectorizable.h"

namespace pagellm::kernels::quantized_linear {
namespace {

using namespace pagellm::quantized;
using pagellm::load;
using pagellm::store;

constexpr int kMaxRows = 4;  // activation rows sharing one pass over the weights

typedef float f32x8 __attribute__((vector_size(32)));

template <typename V>
inline V load_bytes(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x8 load_f32x8(const float* p) { return load_bytes<f32x8>(p); }

// *p in every lane, loaded straight into the vector (adding it to a zero vector instead
// costs an add and a shuffle on the FMA units' ports).
inline f32x8 broadcast_f32x8(const float* p) {
#ifdef __AVX2__
  return (f32x8)_mm256_broadcast_ss(p);
#else
  return f32x8{} + *p;
#endif
}

// The 32 weights of one group minus the offset, as four vectors of 8 in element order.
// AVX2 widens bytes with vpmovzx/vpmovsx; written as plain vector code, GCC turns the
// byte shifts and conversions into scalar instructions.
template <int kBits>
inline void widen_group(const uint8_t* codes, f32x8 w[4]) {
#ifdef __AVX2__
  if constexpr (kBits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m128i quarters[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int q = 0; q < 4; ++q) {
      const __m256 codes_q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(quarters[q]));
      w[q] = (f32x8)_mm256_sub_ps(codes_q, _mm256_set1_ps(8.f));
    }
  } else {
    for (int q = 0; q < 4; ++q) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * q));
      w[q] = (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
  }
#else
  float values[32];
  for (int j = 0; j < 32; ++j) {
    values[j] = kBits == 4 ? static_cast<float>(((codes[j % 16] >> (j / 16 * 4)) & 15) - 8)
                           : static_cast<float>(reinterpret_cast<const int8_t*>(codes)[j]);
  }
  std::memcpy(w, values, sizeof(values));
#endif
}

inline float horizontal_sum(f32x8 v) {
  float sum = 0.f;
  for (int l = 0; l < 8; ++l) sum += v[l];
  return sum;
}

// One output feature for kRows activation rows: the scaled codes' dot products, plus each
// group's zero times that group's activation sum.
template <int kBits, int kRows, int kGroupSize>
void output_feature(const uint8_t* codes, const float* scales, const float* zeros,
                    const float* x, const float* x_sums, int64_t k, float* out) {
  const int64_t blocks = k / kGroup, groups = k / kGroupSize, code_bytes = kGroup * kBits / 8;
  f32x8 acc[kRows] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    f32x8 w[4];
    widen_group<kBits>(codes + b * code_bytes, w);
    for (int r = 0; r < kRows; ++r) {
      const float* xb = x + r * k + b * kGroup;
      if constexpr (kGroupSize == kGroup) {
        const f32x8 dot = w[0] * load_f32x8(xb) + w[1] * load_f32x8(xb + 8) +
                          w[2] * load_f32x8(xb + 16) + w[3] * load_f32x8(xb + 24);
        acc[r] += broadcast_f32x8(scales + b) * dot;
      } else {
        const f32x8 front = w[0] * load_f32x8(xb) + w[1] * load_f32x8(xb + 8);
        const f32x8 back = w[2] * load_f32x8(xb + 16) + w[3] * load_f32x8(xb + 24);
        acc[r] += broadcast_f32x8(scales + 2 * b) * front +
                  broadcast_f32x8(scales + 2 * b + 1) * back;
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float zero_term = 0.f;
    if (zeros != nullptr) {
      for (int64_t g = 0; g < groups; ++g) zero_term += zeros[g] * x_sums[r * groups + g];
    }
    out[r] = horizontal_sum(acc[r]) + zero_term;
  }
}

template <int kBits, int kRows, int kGroupSize>
void output_features(const uint8_t* codes, const float* scales, const float* zeros,
                     const float* x, const float* x_sums, int64_t k, int64_t begin, int64_t end,
                     float* out) {
  const int64_t groups = k / kGroupSize, row_bytes = k * kBits / 8;
  float values[kRows];
  for (int64_t n = begin; n < end; ++n) {
    output_feature<kBits, kRows, kGroupSize>(codes + n * row_bytes, scales + n * groups,
                                 zeros ? zeros + n * groups : nullptr, x, x_sums, k, values);
    for (int r = 0; r < kRows; ++r) out[r * (end - begin) + (n - begin)] = values[r];
  }
}

template <int kBits, int kGroupSize>
void output_features_rows(int rows, const uint8_t* codes, const float* scales, const float* zeros,
                          const float* x, const float* x_sums, int64_t k, int64_t begin,
                          int64_t end, float* out) {
  auto run = [&](auto rows_tag) {
    output_features<kBits, decltype(rows_tag)::value, kGroupSize>(codes, scales, zeros, x, x_sums,
                                                                  k, begin, end, out);
  };
  switch (rows) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    default: run(std::integral_constant<int, 4>{});
  }
}

// Many rows: a panel of 16 output features is widened once, laid out input-major (the
// 16 features of one input side by side), and blocks of rows are multiplied with it in
// 6 x 16 register tiles: per input, two panel loads and six broadcasts feed twelve FMAs.
constexpr int kTileRows = 6;           // activation rows per register tile
constexpr int64_t kMinPanelRows = 12;  // below this, widening on every pass costs less

// Transpose 8 vectors in place: v[i][j] becomes v[j][i].
inline void transpose8(f32x8 v[8]) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = (__m256)v[i];
  pagellm::float_vectors::transpose_8x8(r);
  for (int i = 0; i < 8; ++i) v[i] = (f32x8)r[i];
#else
  for (int i = 0; i < 8; ++i) {
    for (int j = i + 1; j < 8; ++j) std::swap(v[i][j], v[j][i]);
  }
#endif
}

// panel[i * kPanel + f] = weight[n0 + f][i] for the panel's features (0 past the last).
// Eight features at a time are widened row by row into `rows` (sequential reads of each
// feature's codes), then transposed eight inputs at a time into the panel.
template <int kBits, int kGroupSize>
void widen_panel(const uint8_t* codes, const float* scales, const float* zeros, int64_t k,
                 int64_t n, int64_t n0, float* rows, float* panel) {
  const int64_t blocks = k / kGroup, groups = k / kGroupSize, row_bytes = k * kBits / 8,
                code_bytes = kGroup * kBits / 8;
  for (int half = 0; half < kPanel; half += 8) {
    for (int f = 0; f < 8; ++f) {
      const int64_t row = n0 + half + f;
      float* out = rows + f * k;
      if (row >= n) {
        std::fill(out, out + k, 0.f);
        continue;
      }
      for (int64_t b = 0; b < blocks; ++b) {
        f32x8 w[4];
        widen_group<kBits>(codes + row * row_bytes + b * code_bytes, w);
        for (int q = 0; q < 4; ++q) {
          const int64_t g = row * groups + (b * kGroup + 8 * q) / kGroupSize;
          const f32x8 zero = f32x8{} + (zeros ? zeros[g] : 0.f);
          const f32x8 weights = w[q] * (f32x8{} + scales[g]) + zero;
          std::memcpy(out + b * kGroup + 8 * q, &weights, sizeof(weights));
        }
      }
    }
    for (int64_t i = 0; i < k; i += 8) {
      f32x8 block[8];
      for (int f = 0; f < 8; ++f) block[f] = load_f32x8(rows + f * k + i);
      transpose8(block);
      for (int j = 0; j < 8; ++j) {
        std::memcpy(panel + (i + j) * kPanel + half, &block[j], sizeof(block[j]));
      }
    }
  }
}

// out[r * 16 + f] (+)= sum_i x[r * ldx + i] * panel[i * 16 + f] over `length` inputs,
// for 6 rows and the panel's 16 features. The twelve accumulators are named: held in an
// array, GCC stores them to memory on every iteration.
void tile_product(const float* x, int64_t ldx, const float* panel, int64_t length,
                  bool accumulate, float* out) {
  f32x8 a00{}, a01{}, a10{}, a11{}, a20{}, a21{}, a30{}, a31{}, a40{}, a41{}, a50{}, a51{};
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx,
              *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  for (int64_t i = 0; i < length; ++i) {
    const f32x8 w0 = load_f32x8(panel + i * kPanel), w1 = load_f32x8(panel + i * kPanel + 8);
    f32x8 b = broadcast_f32x8(x0 + i);
    a00 += b * w0, a01 += b * w1;
    b = broadcast_f32x8(x1 + i);
    a10 += b * w0, a11 += b * w1;
    b = broadcast_f32x8(x2 + i);
    a20 += b * w0, a21 += b * w1;
    b = broadcast_f32x8(x3 + i);
    a30 += b * w0, a31 += b * w1;
    b = broadcast_f32x8(x4 + i);
    a40 += b * w0, a41 += b * w1;
    b = broadcast_f32x8(x5 + i);
    a50 += b * w0, a51 += b * w1;
  }
  const f32x8 sums[kTileRows][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                                    {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < kTileRows; ++r) {
    for (int h = 0; h < 2; ++h) {
      float* part = out + r * kPanel + 8 * h;
      const f32x8 total = accumulate ? sums[r][h] + load_f32x8(part) : sums[r][h];
      std::memcpy(part, &total, sizeof(total));
    }
  }
}

template <typename T, int kBits, int kGroupSize>
void run_panels(T* y, const T* x, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
                const float* scales, const float* zeros) {
  const int64_t panels = (n + kPanel - 1) / kPanel, chunk = input_chunk(k);
  const int64_t block_rows = std::min(kBlockRows, (m + kTileRows - 1) / kTileRows * kTileRows);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanel * k), widened(8 * k), rows(block_rows * k);
    std::vector<float> out(block_rows * kPanel);
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      // The block's rows in float32, zero-padded to whole tiles.
      const int64_t block = std::min(block_rows, m - m0);
      const int64_t tiles = (block + kTileRows - 1) / kTileRows;
      for (int64_t i = 0; i < block * k; ++i) rows[i] = load(x, m0 * k + i);
      std::fill(rows.begin() + block * k, rows.begin() + tiles * kTileRows * k, 0.f);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, n - n0);
        widen_panel<kBits, kGroupSize>(codes, scales, zeros, k, n, n0, widened.data(),
                                       panel.data());
        for (int64_t i0 = 0; i0 < k; i0 += chunk) {
          for (int64_t t = 0; t < tiles; ++t) {
            tile_product(rows.data() + t * kTileRows * k + i0, k, panel.data() + i0 * kPanel,
                         std::min(chunk, k - i0), i0 > 0, out.data() + t * kTileRows * kPanel);
          }
        }
        for (int64_t r = 0; r < block; ++r) {
          for (int64_t f = 0; f < width; ++f) store(y + (m0 + r) * n, n0 + f, out[r * kPanel + f]);
        }
      }
    }
  });
}

template <typename T, int kBits, int kGroupSize>
void run_passes(T* y, const float* x, const float* x_sums, int64_t m, int64_t k, int64_t n,
                const uint8_t* codes, const float* scales, const float* zeros) {
  const int64_t groups = k / kGroupSize;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> part(kMaxRows * (end - begin));
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      output_features_rows<kBits, kGroupSize>(rows, codes, scales, zeros, x + r0 * k,
                                  x_sums + r0 * groups, k, begin, end, part.data());
      for (int r = 0; r < rows; ++r) {
        const float* values = part.data() + r * (end - begin);
        for (int64_t j = begin; j < end; ++j) store(y + (r0 + r) * n, j, values[j - begin]);
      }
    }
  });
}

// `panels_only`: every step size multiplies in panels, whose sums per output do not depend
// on the number of rows (the few-row passes sum in another order): a row's result is then
// the same whatever else is in its step.
template <typename T, int kBits, int kGroupSize>
void run(T* y, const T* x_in, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
         const float* scales, const float* zeros, bool panels_only) {
  if (m >= kMinPanelRows || panels_only) {
    run_panels<T, kBits, kGroupSize>(y, x_in, m, k, n, codes, scales, zeros);
    return;
  }
  std::vector<float> x(m * k);
  for (int64_t i = 0; i < m * k; ++i) x[i] = load(x_in, i);
  std::vector<float> x_sums(m * (k / kGroupSize), 0.f);
  for (int64_t i = 0; i < m * k; ++i) x_sums[i / kGroupSize] += x[i];
  run_passes<T, kBits, kGroupSize>(y, x.data(), x_sums.data(), m, k, n, codes, scales, zeros);
}

// y: [M, N] of x's dtype; x: [M, K] contiguous; bits: 4 or 8.
void quantized_linear(Tensor y, const Tensor& x, const Tensor& codes,
                      const Tensor& scales, const Tensor& zeros, int64_t bits,
                      bool panels_only) {
  PAGELLM_CHECK(bits == 4 || bits == 8, "quantized_linear: bits must be 4 or 8");
  PAGELLM_CHECK(x.dim() == 2 && x.is_contiguous() && y.is_contiguous() &&
                    y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0),
                "quantized_linear expects contiguous x [M, K] and y [M, N] of one dtype");
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  PAGELLM_CHECK(k % kGroup == 0 && codes.is_contiguous() && codes.size(0) == n &&
                    codes.size(1) * 8 == k * bits && codes.element_size() == 1,
                "quantized_linear: codes must be [N, K * bits / 8] bytes with K a multiple of 32");
  const bool zeros_fit = zeros.numel() == 0 || (zeros.scalar_type() == ScalarType::Float &&
                                                 zeros.is_contiguous() &&
                                                 zeros.numel() == scales.numel());
  const int64_t group = scales.numel() == n * (k / kGroup) ? kGroup : kHalfGroup;
  PAGELLM_CHECK(scales.scalar_type() == ScalarType::Float && scales.is_contiguous() &&
                    scales.numel() == n * (k / group) && zeros_fit,
                "quantized_linear: scales (and zeros) must be float32 [N, K / 32] or [N, K / 16]");
  const auto* code_ptr = static_cast<const uint8_t*>(codes.const_data_ptr());
  const float* zero_ptr = zeros.numel() ? zeros.const_data_ptr<float>() : nullptr;
  pagellm::dispatch_dtype(x, "quantized_linear", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = group == kGroup ? (bits == 4 ? run<T, 4, kGroup> : run<T, 8, kGroup>)
                                  : (bits == 4 ? run<T, 4, kHalfGroup> : run<T, 8, kHalfGroup>);
    kernel(y.mutable_data_ptr<T>(), x.const_data_ptr<T>(), m, k, n, code_ptr,
           scales.const_data_ptr<float>(), zero_ptr, panels_only);
  });
}

}  // namespace
}  // namespace pagellm::kernels::quantized_linear

STABLE_TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("quantized_linear(Tensor(a!) y, Tensor x, Tensor codes, Tensor scales, Tensor zeros, "
        "int bits, bool panels_only) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(pagellm, CPU, m) {
  m.impl("quantized_linear", TORCH_BOX(&pagellm::kernels::quantized_linear::quantized_linear));
}
