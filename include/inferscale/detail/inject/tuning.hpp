/**
 * @file detail/inject/tuning.hpp
 * @brief Launch shapes of the injection and extraction kernels (CUB-style policy: data, not code).
 */
#pragma once

#include <cstdint>

namespace inferscale::detail {

/// @brief Launch policy of inject_kernel.
struct inject_policy_sm80 {
  static constexpr int block_threads   = 256;  ///< threads per block
  static constexpr int vector_bytes    = 16;   ///< one 128-bit store-side access per unit
  static constexpr int tile_tokens     = 4;  ///< tokens per block (their cos/sin in shared memory)
  static constexpr int max_tile_layers = 8;  ///< layers per block share those cos/sin
  static constexpr int min_blocks_per_sm = 4;  ///< fewer layers per block until the grid fills this
  static constexpr int extract_threads   = 256;  ///< threads per block of extract_kernel
};

/// @brief Hopper (H100/H200): same shape until measured otherwise.
struct inject_policy_sm90 : inject_policy_sm80 {};

}  // namespace inferscale::detail
