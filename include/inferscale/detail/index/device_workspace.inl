/**
 * @file detail/index/device_workspace.inl
 * @brief Temporary device memory of the index's device backend, taken from a `raft::resources`'
 * workspace on its stream, and the check that an index lives in device memory. Light (no
 * kernels, no RAFT algorithms): the facade's device search (`memory_device_index.cuh`) needs only
 * this beside `index.cuh`'s declarations. RAFT-based, so not a header of its own.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resource/device_memory_resource.hpp>
#include <raft/core/resources.hpp>
#include <rmm/device_uvector.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

namespace inferscale::detail::index {

/// @brief Temporary device memory from the resources' workspace, on their stream.
template <class T>
rmm::device_uvector<T> workspace_vector(raft::resources const& res, std::int64_t count)
{
  return rmm::device_uvector<T>(static_cast<std::size_t>(std::max<std::int64_t>(count, 1)),
                                raft::resource::get_cuda_stream(res),
                                raft::resource::get_workspace_resource_ref(res));
}

/// @brief Workspace a call may not need: nothing is allocated for `count` 0 (`data_or_null` is then
/// null), so a search that needs none enqueues nothing but its kernel (capturable in a CUDA graph;
/// an allocation during a capture fails with cudaErrorStreamCaptureUnsupported).
template <class T>
std::optional<rmm::device_uvector<T>> optional_workspace(raft::resources const& res,
                                                         std::int64_t count)
{
  if (count <= 0) { return std::nullopt; }
  return workspace_vector<T>(res, count);
}

template <class T>
T* data_or_null(std::optional<rmm::device_uvector<T>>& v) noexcept
{
  return v ? v->data() : nullptr;
}

inline void require_device_index(graph_index const& index, char const* what)
{
  INFERSCALE_EXPECTS(
    index.space() == memory_space::device,
    std::string{what} +
      ": the index lives in host memory; search it with search(index, ...) of index.hpp "
      "(or build it with index_config::memory = memory_space::device)");
}

}  // namespace inferscale::detail::index
