/**
 * @file detail/inject/kernels.cuh
 * @brief The fused injection kernel (store pages -> rotate K -> scale/convert -> engine slots, all
 * layers of the shard in one launch) and the extraction kernel: __global__ shells around the
 * per-block code of detail/inject/block.hpp (shared memory, block and thread indices).
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/inject/block.hpp>

#include <cstdint>

namespace inferscale::detail {

template <class Policy, class StoreT, class CacheT, class Rotation, bool Vectorized>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::block_threads)
  inject_kernel(__grid_constant__ inject_kernel_args<Rotation> const args)
{
  extern __shared__ rope_cos_sin shared_cos_sin[];
  __shared__ std::int64_t tile_slot[Policy::tile_tokens];
  __shared__ std::int64_t tile_block[Policy::tile_tokens];
  __shared__ std::int32_t tile_in_block[Policy::tile_tokens];
  __shared__ std::int64_t tile_source[Policy::tile_tokens];
  inject_tile_state const tile{shared_cos_sin, tile_slot, tile_block, tile_in_block, tile_source};
  using block = inject_block<Policy, StoreT, CacheT, Rotation, Vectorized>;
  block::prepare(args,
                 blockIdx.x,
                 static_cast<std::int32_t>(blockIdx.y),
                 static_cast<std::int32_t>(threadIdx.x),
                 static_cast<std::int32_t>(blockDim.x),
                 tile);
  __syncthreads();
  block::work(args,
              blockIdx.x,
              static_cast<std::int32_t>(blockIdx.y),
              static_cast<std::int32_t>(threadIdx.x),
              static_cast<std::int32_t>(blockDim.x),
              tile);
}
/**
 * @brief Extraction: one thread per unit of a token (extract_unit); blockIdx.x covers a token's
 * units, blockIdx.y strides over the tokens. Not on a latency path: kept scalar.
 */
template <class Policy, class StoreT, class CacheT, class Rotation>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::extract_threads)
  extract_kernel(__grid_constant__ extract_kernel_args<Rotation> const args)
{
  auto const per_token = static_cast<std::int32_t>(extract_units_per_token(args));
  auto const w         = static_cast<std::int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (w >= per_token) { return; }
  for (std::int64_t i = blockIdx.y; i < args.tokens.num_tokens; i += gridDim.y) {
    extract_unit<StoreT, CacheT>(args, i, w);
  }
}

}  // namespace inferscale::detail
