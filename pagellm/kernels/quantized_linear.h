// Pieces shared by the quantized matmul's float32 panels (quantized_linear.cpp) and its
// int8 ones (quantized_linear_int8.cpp, quantized_linear_amx.cpp).
#pragma once

#include <ATen/core/Tensor.h>

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

// quantized_linear_int8 on AMX tiles (quantized_linear_amx.cpp), for groups of 32: writes y
// and returns true, or returns false where the tiles are not permitted (amx_tiles.h) or x
// has too few rows for them to pay (kTileMinRows there).
bool quantized_linear_int8_amx(at::Tensor& y, const at::Tensor& x, const at::Tensor& panels,
                               const at::Tensor& scales, const at::Tensor& zeros);

}  // namespace pagellm::quantized
