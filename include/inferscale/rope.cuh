/**
 * @file rope.cuh
 * @brief Device backend of the rotary embedding: batch rotation of `[tokens, heads, head_dim]`
 * views on a CUDA stream, sharing the per-pair math of rope.hpp with the host backend.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/detail/rope/kernels.cuh>
#include <inferscale/detail/rope/tuning.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/views.hpp>

#include <cuda/stream_ref>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace inferscale {

/**
 * @brief Device backend: applies `op` in place to every head of every token of `x`
 * (`[tokens, heads, head_dim]` in device memory, any strides), token t using `positions[t]`.
 *
 * @param[in,out] x         device view of the keys (or queries)
 * @param[in]     positions device array, one position (delta for rope_op::shift) per token
 * @param[in]     rotation  rope_params (passed by value to the kernel) or rope_cos_sin_table with
 *                          device data
 * @param[in]     op        forward, inverse or shift
 * @param[in]     stream    the stream the kernel is enqueued on
 * @throw logic_error if shapes disagree (nothing is launched); cuda_error if the launch fails.
 * @param[out]    bad_positions device counter of the tokens left unchanged for a bad position,
 *                              or null (zeroed by the caller, read back after the kernel)
 * @note Never waits and allocates nothing (CUDA-graph capturable). Positions live on the device
 *       and are not read by the host: a token whose position is negative or beyond the table
 *       (|delta| for shift, and a shift of INT64_MIN) is left unchanged and counted.
 */
template <class T, class Rotation>
void rope_apply_async(token_head_view<T> x,
                      std::int64_t const* positions,
                      std::int64_t num_positions,
                      Rotation const& rotation,
                      rope_op op,
                      unsigned long long* bad_positions,
                      cuda::stream_ref stream)
{
  rope_check_batch(x, num_positions, rotation, op);
  INFERSCALE_EXPECTS(num_positions == 0 || positions != nullptr,
                     std::string{"rope: null positions"});
  if (x.extent(0) == 0 || x.extent(1) == 0) { return; }

  using policy = detail::rope_policy_sm90;
  detail::rope_kernel_args<T, Rotation> args{};
  args.data                 = x.data_handle();
  args.tokens               = x.extent(0);
  args.heads                = x.extent(1);
  args.token_stride         = x.stride(0);
  args.head_stride          = x.stride(1);
  args.element_stride       = x.stride(2);
  args.positions            = positions;
  args.table_rows           = detail::rope_table_rows(rotation);
  args.rotation             = rotation;
  args.op                   = op;
  args.round_each_operation = rope_rounds_each_operation<T>(rotation, op);
  args.fused                = rope_fuses_multiply_add(rotation, op);
  args.bad_positions        = bad_positions;

  // 16-byte accesses need contiguous elements, aligned heads, and whole chunks of pairs.
  constexpr int vector_elements = policy::vector_bytes / static_cast<int>(sizeof(T));
  auto const aligned            = [](std::int64_t elements) {
    return (elements * static_cast<std::int64_t>(sizeof(T))) % policy::vector_bytes == 0;
  };
  bool const chunks_fit = rotation.pairing == rope_pairing::halves
                            ? (rotation.num_pairs() % vector_elements == 0)
                            : (rotation.rotary_dim % vector_elements == 0);
  bool const vectorized =
    x.stride(2) == 1 && chunks_fit && aligned(x.stride(0)) && aligned(x.stride(1)) &&
    reinterpret_cast<std::uintptr_t>(x.data_handle()) % policy::vector_bytes == 0;

  std::int64_t const chunks          = !vectorized ? rotation.num_pairs()
                                                   : (rotation.pairing == rope_pairing::halves
                                                        ? rotation.num_pairs() / vector_elements
                                                        : rotation.rotary_dim / vector_elements);
  std::int64_t const items_per_token = x.extent(1) * chunks;
  args.tile_tokens                   = std::clamp<std::int64_t>(
    detail::ceil_div(policy::items_per_tile, items_per_token), 1, policy::max_tile_tokens);
  // The kernel indexes a tile's items and cos/sin entries in 32 bits.
  INFERSCALE_EXPECTS(
    args.tile_tokens * std::max<std::int64_t>(items_per_token, rotation.num_pairs()) <=
      std::int64_t{0x7fffffff},
    "rope_apply_async: " + std::to_string(x.extent(1)) + " heads of " + std::to_string(chunks) +
      " chunks per token exceed the kernel's 32-bit tile");

  int device = 0, sm_count = 0;
  INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
  INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  std::int64_t const tiles      = detail::ceil_div(x.extent(0), args.tile_tokens);
  std::int64_t const max_blocks = static_cast<std::int64_t>(sm_count) * policy::blocks_per_sm;
  auto const grid               = static_cast<unsigned>(std::min(tiles, max_blocks));
  auto const shared_bytes       = static_cast<std::size_t>(detail::cos_sin_tile_entries(
                              args.tile_tokens * rotation.num_pairs())) *
                            sizeof(rope_cos_sin);

  if (vectorized) {
    detail::rope_apply_kernel<policy, T, Rotation, true>
      <<<grid, policy::block_threads, shared_bytes, stream.get()>>>(args);
  } else {
    detail::rope_apply_kernel<policy, T, Rotation, false>
      <<<grid, policy::block_threads, shared_bytes, stream.get()>>>(args);
  }
  INFERSCALE_CHECK_LAUNCH();
}

/// @brief As rope_apply_async with a counter, without one: tokens with a bad position are left
/// unchanged, uncounted.
template <class T, class Rotation>
void rope_apply_async(token_head_view<T> x,
                      std::int64_t const* positions,
                      std::int64_t num_positions,
                      Rotation const& rotation,
                      rope_op op,
                      cuda::stream_ref stream)
{
  rope_apply_async(x, positions, num_positions, rotation, op, nullptr, stream);
}

}  // namespace inferscale
