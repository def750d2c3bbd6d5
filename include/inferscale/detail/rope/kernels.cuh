/**
 * @file detail/rope/kernels.cuh
 * @brief The rope kernel: a thin shell around the per-pair math of rope.hpp.
 *
 * Each block takes one token at a time: its threads first compute the token's cos/sin for every
 * pair into shared memory (once per token, not once per head), then rotate all heads of the token.
 * When the head's elements are contiguous and 16-byte aligned, each thread moves 16 bytes per
 * load/store (for halves pairing: 16 bytes of the first half and the matching 16 bytes of the second).
 */
#pragma once

#include <inferscale/config.hpp>
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
  std::int64_t table_rows;  ///< positions must be below it (tables), else INT64_MAX
  Rotation rotation;
  rope_op op;
  bool round_each_operation;
};

/// @brief 16 bytes of T, moved as one 128-bit access.
template <class T, int N>
struct alignas(16) rope_vector {
  T values[N];
};

INFERSCALE_DEVICE INFERSCALE_FORCEINLINE bool rope_position_ok(std::int64_t position,
                                                               std::int64_t rows,
                                                               rope_op op)
{
  if (op == rope_op::shift) { return (position < 0 ? -position : position) < rows; }
  return position >= 0 && position < rows;
}

/**
 * @tparam Vectorized true: element stride 1 and every head 16-byte aligned, and the pair layout
 *         splits into 16-byte chunks (checked by the dispatcher).
 */
template <class Policy, class T, class Rotation, bool Vectorized>
INFERSCALE_KERNEL void __launch_bounds__(Policy::block_threads)
  rope_apply_kernel(__grid_constant__ rope_kernel_args<T, Rotation> const args)
{
  extern __shared__ rope_cos_sin shared_cos_sin[];
  std::int32_t const pairs      = args.rotation.num_pairs();
  std::int32_t const rotary_dim = args.rotation.rotary_dim;

  for (std::int64_t token = blockIdx.x; token < args.tokens; token += gridDim.x) {
    std::int64_t const position = args.positions[token];
    // Tokens with an invalid position are left untouched (the host cannot see device positions;
    // reading a table row beyond its end would be out of bounds).
    if (!rope_position_ok(position, args.table_rows, args.op)) { continue; }
    for (std::int32_t pair = threadIdx.x; pair < pairs; pair += blockDim.x) {
      shared_cos_sin[pair] = rope_angle_cos_sin(args.rotation, position, pair, args.op);
    }
    __syncthreads();

    T* const token_data = args.data + token * args.token_stride;
    if constexpr (Vectorized) {
      constexpr int n = Policy::vector_bytes / static_cast<int>(sizeof(T));
      using vector    = rope_vector<T, n>;
      if (args.rotation.pairing == rope_pairing::halves) {
        std::int32_t const chunks = pairs / n;  // chunks of n pairs: n elements in each half
        for (std::int64_t item = threadIdx.x; item < args.heads * chunks; item += blockDim.x) {
          std::int64_t const head = item / chunks;
          std::int32_t const base = static_cast<std::int32_t>(item % chunks) * n;
          T* const first_ptr      = token_data + head * args.head_stride + base;
          vector first            = *reinterpret_cast<vector const*>(first_ptr);
          vector second           = *reinterpret_cast<vector const*>(first_ptr + pairs);
#pragma unroll
          for (int j = 0; j < n; ++j) {
            rope_rotate_pair(first.values[j], second.values[j], shared_cos_sin[base + j],
                             args.round_each_operation);
          }
          *reinterpret_cast<vector*>(first_ptr)         = first;
          *reinterpret_cast<vector*>(first_ptr + pairs) = second;
        }
      } else {
        std::int32_t const chunks = rotary_dim / n;  // chunks of n elements = n/2 pairs
        for (std::int64_t item = threadIdx.x; item < args.heads * chunks; item += blockDim.x) {
          std::int64_t const head = item / chunks;
          std::int32_t const base = static_cast<std::int32_t>(item % chunks) * n;
          T* const ptr            = token_data + head * args.head_stride + base;
          vector v                = *reinterpret_cast<vector const*>(ptr);
#pragma unroll
          for (int j = 0; j < n; j += 2) {
            rope_rotate_pair(v.values[j], v.values[j + 1], shared_cos_sin[(base + j) / 2],
                             args.round_each_operation);
          }
          *reinterpret_cast<vector*>(ptr) = v;
        }
      }
    } else {
      for (std::int64_t item = threadIdx.x; item < args.heads * pairs; item += blockDim.x) {
        std::int64_t const head  = item / pairs;
        std::int32_t const pair  = static_cast<std::int32_t>(item % pairs);
        std::int32_t first, second;
        pair_elements(args.rotation.pairing, rotary_dim, pair, &first, &second);
        T* const head_ptr = token_data + head * args.head_stride;
        rope_rotate_pair(head_ptr[first * args.element_stride],
                         head_ptr[second * args.element_stride], shared_cos_sin[pair],
                         args.round_each_operation);
      }
    }
    __syncthreads();  // shared_cos_sin is rewritten for the next token
  }
}

}  // namespace inferscale::detail
