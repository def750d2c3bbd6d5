/**
 * @file detail/rope/tuning.hpp
 * @brief Launch shapes of the rope kernels (CUB-style policy: data, not code).
 */
#pragma once

#include <cstdint>

namespace inferscale::detail {

/// @brief Launch policy of rope_apply_kernel.
struct rope_policy_sm80 {
  static constexpr int block_threads   = 128;  ///< threads per block
  static constexpr int blocks_per_sm   = 16;   ///< grid = min(tiles, SMs * blocks_per_sm)
  static constexpr int vector_bytes    = 16;   ///< one 128-bit load/store per thread where aligned
  static constexpr int items_per_tile  = 256;  ///< (token, head, chunk) items a tile aims for
  static constexpr int max_tile_tokens = 16;   ///< bounds shared memory: 16 x 256 pairs x 8 B
};

/// @brief Hopper (H100/H200) uses the same shape; kept separate so it can be tuned on its own.
struct rope_policy_sm90 : rope_policy_sm80 {};

}  // namespace inferscale::detail
