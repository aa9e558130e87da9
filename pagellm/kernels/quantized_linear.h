// Pieces shared by the quantized matmul's float32 panels (quantized_linear.cpp) and its
// int8 ones (quantized_linear_int8.cpp, quantized_linear_amx.cpp).
#pragma once

#include <cstdint>

namespace pagellm::quantized {

constexpr int64_t kGroup = 32;        // weights sharing one scale and zero along the input
constexpr int64_t kHalfGroup = 16;    // or half as many (Q6_K's scales)
constexpr int kPanel = 16;            // output features per panel: two vectors
constexpr int64_t kBlockRows = 192;   // rows multiplied with a panel per pass over it

// Inputs per pass of the tiles (a whole number of groups, at most 256), so that a tile's
// slice of the panel and of its activation rows stay in L1 together.
inline int64_t input_chunk(int64_t k) {
  const int64_t chunks = (k + 255) / 256;
  return (k / kGroup + chunks - 1) / chunks * kGroup;
}

// The activations' dtype of an int8 matmul: float, c10::BFloat16 or c10::Half.
enum class Activations { kFloat, kBFloat16, kHalf };

// One int8 matmul y = x W^T, as quantized_linear_int8's op (quantized_linear_int8_op.cpp)
// checked it: y [m, n] and x [m, k] contiguous, of one dtype; the panels' codes, 8-bit ones
// (int8) or 4-bit ones two per byte (uint8); their scales and zeros per group of `group`
// inputs (32, or 16), float32 or float16 (both alike). Plain pointers: the kernels' files
// compile without torch's tensor headers (build.py).
struct Int8Operands {
  void* y;
  const void* x;
  Activations dtype;
  int64_t m, k, n;
  const void* codes;
  bool nibbles;  // 4-bit codes (uint8), else 8-bit ones (int8)
  const void* scales;
  const void* zeros;
  bool half_factors;  // scales and zeros in float16, else float32
  int64_t group;
};

// The int8 forms a library compiles: each is a copy of the kernel's tiles, seconds of the
// compile a first start waits for. The default library has float16 factors in groups of 32,
// the forms of Q4_0, Q4_1 and Q8_0 (every projection of the embedded SmolLM2); the library
// of the other forms, built with PAGELLM_OTHER_INT8_FORMS (build.py), float32 factors in
// groups of 32 or 16 (the K-quants', Q6_K's). Panels in groups of 16 keep float32 factors.
// The default library's op hands the others to that library's (quantized_linear_int8_op.cpp),
// which Python loads where panels of such a form are made (pagellm.model.quantized.Int8Panels).
constexpr bool int8_form_compiled(bool half_factors, int64_t group) {
#ifdef PAGELLM_OTHER_INT8_FORMS
  return !half_factors;
#else
  return half_factors && group == kGroup;
#endif
}

// Both libraries load into one process: the functions each defines for its own forms take
// names of their own.
#ifdef PAGELLM_OTHER_INT8_FORMS
#define PAGELLM_INT8_LIBRARY other_int8_forms
#else
#define PAGELLM_INT8_LIBRARY default_int8_forms
#endif

inline namespace PAGELLM_INT8_LIBRARY {

// The int8 matmul (quantized_linear_int8.cpp) of a form this library compiles: on AMX tiles
// where those are permitted and pay, else on AVX512-VNNI's or AVX2's instructions.
void int8_matmul(const Int8Operands& operands);

// The matmul on AMX tiles (quantized_linear_amx.cpp), for groups of 32: writes y and returns
// true, or returns false where the tiles are not permitted (amx_tiles.h) or x has too few
// rows for them to pay (kTileMinRows there).
bool int8_matmul_amx(const Int8Operands& operands);

}  // namespace PAGELLM_INT8_LIBRARY

}  // namespace pagellm::quantized
