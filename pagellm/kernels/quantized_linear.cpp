// y = x @ W^T for steps of a few tokens, W kept as a GGUF file stores it: per group of 32
// weights along the input, w = (code - offset) * scale + zero. Such a step reads every
// weight once for a handful of rows, so it is bound by memory traffic: 4-bit codes are an
// eighth of float32's bytes, 8-bit codes a quarter. The codes are widened to float32 in
// registers and multiplied there, so the only rounding is float32's.
//
// 4-bit codes: [N, K / 2] bytes, byte j of group g holding element 32g + j in its low
// nibble and 32g + 16 + j in its high nibble (the GGUF order); offset 8.
// 8-bit codes: [N, K] int8; offset 0.
// scales, zeros: [N, K / 32] float32 (zeros may be empty: all zero).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vectorizable.h"

namespace {

using pagellm::load;
using pagellm::store;

constexpr int64_t kGroup = 32;
constexpr int kMaxRows = 4;  // activation rows sharing one pass over the weights

typedef float f32x8 __attribute__((vector_size(32)));

template <typename V>
inline V load_bytes(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32x8 load_f32x8(const float* p) { return load_bytes<f32x8>(p); }

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
template <int kBits, int kRows>
void output_feature(const uint8_t* codes, const float* scales, const float* zeros,
                    const float* x, const float* x_sums, int64_t k, float* out) {
  const int64_t groups = k / kGroup, code_bytes = kGroup * kBits / 8;
  f32x8 acc[kRows] = {};
  for (int64_t g = 0; g < groups; ++g) {
    f32x8 w[4];
    widen_group<kBits>(codes + g * code_bytes, w);
    const f32x8 scale = f32x8{} + scales[g];
    for (int r = 0; r < kRows; ++r) {
      const float* xg = x + r * k + g * kGroup;
      const f32x8 dot = w[0] * load_f32x8(xg) + w[1] * load_f32x8(xg + 8) +
                        w[2] * load_f32x8(xg + 16) + w[3] * load_f32x8(xg + 24);
      acc[r] += scale * dot;
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

template <int kBits, int kRows>
void output_features(const uint8_t* codes, const float* scales, const float* zeros,
                     const float* x, const float* x_sums, int64_t k, int64_t begin, int64_t end,
                     float* out) {
  const int64_t groups = k / kGroup, row_bytes = k * kBits / 8;
  float values[kRows];
  for (int64_t n = begin; n < end; ++n) {
    output_feature<kBits, kRows>(codes + n * row_bytes, scales + n * groups,
                                 zeros ? zeros + n * groups : nullptr, x, x_sums, k, values);
    for (int r = 0; r < kRows; ++r) out[r * (end - begin) + (n - begin)] = values[r];
  }
}

template <int kBits>
void output_features_rows(int rows, const uint8_t* codes, const float* scales, const float* zeros,
                          const float* x, const float* x_sums, int64_t k, int64_t begin,
                          int64_t end, float* out) {
  switch (rows) {
    case 1: output_features<kBits, 1>(codes, scales, zeros, x, x_sums, k, begin, end, out); break;
    case 2: output_features<kBits, 2>(codes, scales, zeros, x, x_sums, k, begin, end, out); break;
    case 3: output_features<kBits, 3>(codes, scales, zeros, x, x_sums, k, begin, end, out); break;
    default: output_features<kBits, 4>(codes, scales, zeros, x, x_sums, k, begin, end, out);
  }
}

template <typename T, int kBits>
void run(T* y, const T* x_in, int64_t m, int64_t k, int64_t n, const uint8_t* codes,
         const float* scales, const float* zeros) {
  const int64_t groups = k / kGroup;
  std::vector<float> x(m * k), x_sums(m * groups, 0.f);
  for (int64_t i = 0; i < m * k; ++i) {
    x[i] = load(x_in, i);
    x_sums[i / kGroup] += x[i];
  }
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> part(kMaxRows * (end - begin));
    for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
      output_features_rows<kBits>(rows, codes, scales, zeros, x.data() + r0 * k,
                                  x_sums.data() + r0 * groups, k, begin, end, part.data());
      for (int r = 0; r < rows; ++r) {
        const float* values = part.data() + r * (end - begin);
        for (int64_t j = begin; j < end; ++j) store(y + (r0 + r) * n, j, values[j - begin]);
      }
    }
  });
}

// y: [M, N] of x's dtype; x: [M, K] contiguous; bits: 4 or 8.
void quantized_linear(at::Tensor y, const at::Tensor& x, const at::Tensor& codes,
                      const at::Tensor& scales, const at::Tensor& zeros, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quantized_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.is_contiguous() &&
                  y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0),
              "quantized_linear expects contiguous x [M, K] and y [M, N] of one dtype");
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  TORCH_CHECK(k % kGroup == 0 && codes.is_contiguous() && codes.size(0) == n &&
                  codes.size(1) * 8 == k * bits && codes.element_size() == 1,
              "quantized_linear: codes must be [N, K * bits / 8] bytes with K a multiple of 32");
  const bool zeros_fit = zeros.numel() == 0 || (zeros.scalar_type() == at::kFloat &&
                                                 zeros.is_contiguous() &&
                                                 zeros.numel() == scales.numel());
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == n * (k / kGroup) && zeros_fit,
              "quantized_linear: scales (and zeros) must be float32 [N, K / 32]");
  const auto* code_ptr = static_cast<const uint8_t*>(codes.const_data_ptr());
  const float* zero_ptr = zeros.numel() ? zeros.const_data_ptr<float>() : nullptr;
  pagellm::dispatch_dtype(x, "quantized_linear", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = bits == 4 ? run<T, 4> : run<T, 8>;
    kernel(y.mutable_data_ptr<T>(), x.const_data_ptr<T>(), m, k, n, code_ptr,
           scales.const_data_ptr<float>(), zero_ptr);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagellm, m) {
  m.def("quantized_linear(Tensor(a!) y, Tensor x, Tensor codes, Tensor scales, Tensor zeros, "
        "int bits) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm, CPU, m) { m.impl("quantized_linear", &quantized_linear); }
