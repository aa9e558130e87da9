// What the AMX kernels (quantized_linear_amx.cpp, quantized_linear_bf16_amx.cpp) share: the
// OS's permission to use the tiles and their configuration.
#pragma once

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace pagellm::quantized {

constexpr long kRequestTileState = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileData = 18;              // XFEATURE_XTILEDATA

// The OS must grant the tiles' state once per process (arch_prctl). PAGELLM_AMX=0 keeps the
// AVX kernels (to compare, or to rule the tiles out).
inline bool tiles_permitted() {
  static const bool permitted = [] {
    const char* setting = std::getenv("PAGELLM_AMX");
    if (setting != nullptr && std::string_view(setting) == "0") return false;
    return syscall(SYS_arch_prctl, kRequestTileState, kTileData) == 0;
  }();
  return permitted;
}

// ldtilecfg faults on a configuration that is not 64-byte aligned.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

inline void load_tile_config(const TileConfig& config) {
  // GCC 12 does not see that ldtilecfg reads the configuration and drops the stores to it
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

}  // namespace pagellm::quantized

#endif
