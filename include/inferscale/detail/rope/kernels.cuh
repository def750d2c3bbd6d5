/**
 * @file detail/rope/kernels.cuh
 * @brief The rope kernel: a thin shell around the per-pair math of rope.hpp.
 *
 * Each block takes a tile of tokens at a time: its threads first compute the tile's cos/sin for
 * every pair into shared memory (once per token, not once per head), then rotate all its heads.
 * When the head's elements are contiguous and 16-byte aligned, each thread moves 16 bytes per
 * load/store (for halves pairing: 16 bytes of the first half and the matching 16 bytes of the
 * second).
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/rope/position.hpp>
#include <inferscale/rope.hpp>

#include <cstdint>

namespace inferscale::detail {

/// @brief Everything rope_apply_kernel reads; trivially copyable, passed as __grid_constant__.
template <class T, class Rotation>
struct rope_kernel_args {
  T* data;
  std::int64_t tokens;
  std::int64_t heads;
  std::int64_t token_stride;
  std::int64_t head_stride;
  std::int64_t element_stride;
  std::int64_t const* positions;
  std::int64_t table_rows;   ///< positions must be below it (detail::rope_table_rows)
  std::int64_t tile_tokens;  ///< tokens a block takes per iteration
  Rotation rotation;
  rope_op op;
  bool round_each_operation;
  bool fused;  ///< fused multiply-add rotation (forward with a fused table)
  /// Tokens left unchanged for a bad position are counted here (device memory); may be null.
  unsigned long long* bad_positions;
};

/// @brief 16 bytes of T, moved as one 128-bit access.
template <class T, int N>
struct alignas(16) rope_vector {
  T values[N];
};

/**
 * @tparam Vectorized true: element stride 1 and every head 16-byte aligned, and the pair layout
 *         splits into 16-byte chunks (checked by the dispatcher).
 *
 * A block takes `tile_tokens` tokens at a time, so that a token with few heads still gives every
 * thread work: first the tile's cos/sin (one per token and pair) into shared memory, then every
 * (token, head, chunk) of the tile.
 */
template <class Policy, class T, class Rotation, bool Vectorized>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::block_threads)
  rope_apply_kernel(__grid_constant__ rope_kernel_args<T, Rotation> const args)
{
  extern __shared__ rope_cos_sin shared_cos_sin[];
  std::int32_t const pairs      = args.rotation.num_pairs();
  std::int32_t const rotary_dim = args.rotation.rotary_dim;
  constexpr int n = Vectorized ? Policy::vector_bytes / static_cast<int>(sizeof(T)) : 1;
  // Work items per token: chunks of n pairs per head (halves), chunks of n elements
  // (interleaved), or single pairs (scalar path). A tile's indices are 32-bit (the dispatcher
  // checks tile_tokens * heads * chunks < 2^31), so the divisions below are 32-bit ones.
  std::int32_t const chunks =
    !Vectorized ? pairs
                : (args.rotation.pairing == rope_pairing::halves ? pairs / n : rotary_dim / n);
  std::int32_t const items_per_token = static_cast<std::int32_t>(args.heads) * chunks;
  std::int64_t const tile            = args.tile_tokens;
  // The tile's cos/sin, swizzled against bank conflicts (cos_sin_swizzle).
  auto const cos_sin_at = [&](std::int32_t entry) -> rope_cos_sin const& {
    return shared_cos_sin[cos_sin_swizzle(entry)];
  };

  for (std::int64_t first_token = blockIdx.x * tile; first_token < args.tokens;
       first_token += static_cast<std::int64_t>(gridDim.x) * tile) {
    auto const count = static_cast<std::int32_t>(
      args.tokens - first_token < tile ? args.tokens - first_token : tile);
    for (std::int32_t index = static_cast<std::int32_t>(threadIdx.x); index < count * pairs;
         index += static_cast<std::int32_t>(blockDim.x)) {
      std::int32_t const local    = index / pairs;
      std::int32_t const pair     = index - local * pairs;
      std::int64_t const position = args.positions[first_token + local];
      if (rope_position_ok(position, args.table_rows, args.op)) {
        shared_cos_sin[cos_sin_swizzle(index)] =
          rope_angle_cos_sin(args.rotation, position, pair, args.op);
      } else if (pair == 0 && args.bad_positions != nullptr) {
        atomicAdd(args.bad_positions, 1ull);  // once per token
      }
    }
    __syncthreads();

    for (std::int32_t item = static_cast<std::int32_t>(threadIdx.x); item < count * items_per_token;
         item += static_cast<std::int32_t>(blockDim.x)) {
      std::int32_t const local = item / items_per_token;
      std::int64_t const token = first_token + local;
      // Tokens with an invalid position are left untouched (the host cannot see device
      // positions; a table row beyond its end would be read out of bounds).
      if (!rope_position_ok(args.positions[token], args.table_rows, args.op)) { continue; }
      std::int32_t const within = item - local * items_per_token;
      std::int32_t const head   = within / chunks;
      std::int32_t const chunk  = within - head * chunks;
      std::int32_t const row    = local * pairs;  // the token's first cos/sin entry
      T* const head_ptr         = args.data + token * args.token_stride + head * args.head_stride;

      if constexpr (Vectorized) {
        using vector            = rope_vector<T, n>;
        std::int32_t const base = chunk * n;
        if (args.rotation.pairing == rope_pairing::halves) {
          T* const first_ptr = head_ptr + base;
          vector first       = *reinterpret_cast<vector const*>(first_ptr);
          vector second      = *reinterpret_cast<vector const*>(first_ptr + pairs);
#pragma unroll
          for (int j = 0; j < n; ++j) {
            if (args.fused) {
              rope_rotate_pair_fused(first.values[j], second.values[j], cos_sin_at(row + base + j));
            } else {
              rope_rotate_pair(first.values[j],
                               second.values[j],
                               cos_sin_at(row + base + j),
                               args.round_each_operation);
            }
          }
          *reinterpret_cast<vector*>(first_ptr)         = first;
          *reinterpret_cast<vector*>(first_ptr + pairs) = second;
        } else {
          T* const ptr = head_ptr + base;
          vector v     = *reinterpret_cast<vector const*>(ptr);
#pragma unroll
          for (int j = 0; j < n; j += 2) {
            if (args.fused) {
              rope_rotate_pair_fused(
                v.values[j], v.values[j + 1], cos_sin_at(row + (base + j) / 2));
            } else {
              rope_rotate_pair(v.values[j],
                               v.values[j + 1],
                               cos_sin_at(row + (base + j) / 2),
                               args.round_each_operation);
            }
          }
          *reinterpret_cast<vector*>(ptr) = v;
        }
      } else {
        std::int32_t first, second;
        pair_elements(args.rotation.pairing, rotary_dim, chunk, &first, &second);
        if (args.fused) {
          rope_rotate_pair_fused(head_ptr[first * args.element_stride],
                                 head_ptr[second * args.element_stride],
                                 cos_sin_at(row + chunk));
        } else {
          rope_rotate_pair(head_ptr[first * args.element_stride],
                           head_ptr[second * args.element_stride],
                           cos_sin_at(row + chunk),
                           args.round_each_operation);
        }
      }
    }
    __syncthreads();  // shared_cos_sin is rewritten for the next tile
  }
}

}  // namespace inferscale::detail
