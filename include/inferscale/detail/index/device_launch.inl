/**
 * @file detail/index/device_launch.inl
 * @brief Launch support of the index's device backend (part of `index.cuh`, which includes it;
 * RAFT-based, so not a header of its own): the device policy, the search kernel's shared-memory
 * limit and occupancy, the vector dtype dispatch (its workspace and the check that an index lives
 * in device memory: `device_workspace.inl`).
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/index/device_workspace.inl>
#include <inferscale/detail/index/kernels.cuh>
#include <inferscale/detail/index/tuning.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resource/device_memory_resource.hpp>
#include <raft/core/resources.hpp>
#include <rmm/device_uvector.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace inferscale::detail::index {

using device_policy = index_policy_sm90;

/**
 * @brief The dynamic shared memory a search block may use on `device`: the policy's cap, or the
 * device's opt-in limit less the kernel's static state. It depends on the device only, never on a
 * call's batch.
 */
template <class Policy>
std::size_t search_shared_limit(int device)
{
  static std::mutex guard;
  static std::vector<std::size_t> limits;  // per device, 0 = not read yet
  std::lock_guard<std::mutex> lock(guard);
  auto const d = static_cast<std::size_t>(device);
  if (d < limits.size() && limits[d] != 0) { return limits[d]; }
  int optin = 0;
  INFERSCALE_CUDA_TRY(
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (limits.size() <= d) { limits.resize(d + 1, 0); }
  limits[d] = std::min<std::size_t>(Policy::max_search_shared_bytes,
                                    static_cast<std::size_t>(optin) - sizeof(search_block_state));
  return limits[d];
}

/**
 * @brief Raises `search_kernel<Policy, T>`'s dynamic shared memory attribute to
 * search_shared_limit on `device`, once per device and process. Every launch needs at most that
 * much. Setting it per call to the call's own size would let one search lower it under another's
 * launch on another thread (searches may run concurrently).
 */
template <class Policy, class T>
void prepare_search_kernel(int device)
{
  static std::mutex guard;
  static std::vector<bool> done;
  std::lock_guard<std::mutex> lock(guard);
  auto const d = static_cast<std::size_t>(device);
  if (d < done.size() && done[d]) { return; }
  INFERSCALE_CUDA_TRY(cudaFuncSetAttribute(search_kernel<Policy, T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(search_shared_limit<Policy>(device))));
  if (done.size() <= d) { done.resize(d + 1, false); }
  done[d] = true;
}

/**
 * @brief CTAs of `search_kernel<Policy, T>` with `shared` bytes of dynamic shared memory that
 * `device` holds at once (occupancy per SM x SMs, at least 1), after preparing the kernel's
 * attribute (prepare_search_kernel). The SM count is read once per device.
 */
template <class Policy, class T>
std::int64_t resident_search_ctas(int device, std::size_t shared)
{
  prepare_search_kernel<Policy, T>(device);
  static std::mutex guard;
  static std::vector<int> sms;
  int count = 0;
  {
    std::lock_guard<std::mutex> lock(guard);
    auto const d = static_cast<std::size_t>(device);
    if (sms.size() <= d) { sms.resize(d + 1, 0); }
    if (sms[d] == 0) {
      INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&sms[d], cudaDevAttrMultiProcessorCount, device));
    }
    count = sms[d];
  }
  static std::mutex occupancy_guard;
  static std::map<std::pair<int, std::size_t>, int> per_sm_of;  // (device, shared) -> CTAs per SM
  std::lock_guard<std::mutex> lock(occupancy_guard);
  auto const key = std::make_pair(device, shared);
  auto it        = per_sm_of.find(key);
  if (it == per_sm_of.end()) {
    int per_sm = 0;
    INFERSCALE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, search_kernel<Policy, T>, Policy::search_threads, shared));
    it = per_sm_of.emplace(key, per_sm).first;
  }
  return std::max<std::int64_t>(1, std::int64_t{it->second} * count);
}

/// @brief Calls `f(type_tag<T>{})` for the index's vector dtype (float or half_t).
template <class F>
decltype(auto) dispatch_vector_dtype(dtype t, F&& f)
{
  switch (t) {
    case dtype::float32: return f(type_tag<float>{});
    case dtype::float16: return f(type_tag<half_t>{});
    default: break;
  }
  INFERSCALE_FAIL(std::string{"index: vectors are float32 or float16, got "} + to_string(t));
}

/// @brief Blocks of an element-wise launch over `work` items (grid-stride loops cover the rest).
inline unsigned elementwise_blocks(std::int64_t work, int threads)
{
  std::int64_t const blocks = ceil_div(work, threads);
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, std::int64_t{1} << 20));
}

}  // namespace inferscale::detail::index
