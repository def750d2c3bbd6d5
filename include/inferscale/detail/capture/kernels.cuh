/**
 * @file detail/capture/kernels.cuh
 * @brief The device capture's kernels: __global__ shells (thread and block indices, grid-stride
 * loops) around the per-element code of detail/capture/block.hpp. Not on a latency path: scalar.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/capture/block.hpp>

#include <cstdint>

namespace inferscale::detail {

/// @brief Threads per block of the capture kernels.
inline constexpr int capture_threads = 256;

/// @brief A hook's write: a grid-stride loop over the write's elements.
template <class T>
INFERSCALE_KERNEL
void __launch_bounds__(capture_threads) capture_write_kernel(capture_write_args<T> const args)
{
  std::int64_t const n      = capture_write_elements(args);
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    capture_write_element(args, i);
  }
}

/// @brief A finiteness check: blockIdx.y strides over the listed ranges, x over each range's
/// elements.
template <class StoreT>
INFERSCALE_KERNEL
void __launch_bounds__(capture_threads) capture_check_kernel(capture_check_args const args)
{
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = blockIdx.y; r < args.num_ranges; r += gridDim.y) {
    std::int64_t const n = capture_check_elements(args, r);
    for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
         e += stride) {
      capture_check_element<StoreT>(args, r, e);
    }
  }
}

/// @brief A scatter: blockIdx.y strides over the listed pages, x over each page's elements.
template <class StoreT>
INFERSCALE_KERNEL
void __launch_bounds__(capture_threads) capture_scatter_kernel(capture_scatter_args const args)
{
  std::int64_t const n      = capture_page_elements(args.store);
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t p = blockIdx.y; p < args.num_pages; p += gridDim.y) {
    for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
         e += stride) {
      capture_scatter_element<StoreT>(args, p, e);
    }
  }
}

}  // namespace inferscale::detail
