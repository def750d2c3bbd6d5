/**
 * @file memory_device_index.cuh
 * @brief The memory facade serving from a device-memory index: include this (nvcc, RAFT, C++20
 * like index.cuh) to make a device_context holding a `raft::resources` and call
 * memory::serve_step and memory::serve with it (`serve_step(embedder, requests, k, rotation,
 * device_context{res})`).
 * Their step is the facade's one serving path (memory.hpp) with its batched search run by the
 * device `search` of index.cuh: the queries are embedded on the host, copied to the device, the
 * ids and distances copied back on the resources' stream, and the composition and injection go on
 * as from a host index. A device store is injected with the same context holding a workspace and
 * a stream (`serve_step(embedder, requests, k, rotation, device_context{res, workspace, stream})`;
 * memory.cuh, included here).
 *
 * The facade itself, and every mutation of a device index (add, erase, update, compact, save,
 * load: the index keeps a host mirror and copies each changed namespace to the device), stay
 * C++17 in memory.hpp: only this search needs RAFT.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/index/device_workspace.inl>
#include <inferscale/error.hpp>
#include <inferscale/index.cuh>
#include <inferscale/memory.cuh>

#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resources.hpp>

#include <cuda/std/span>
#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace inferscale::detail {

/**
 * @brief The facade's search on a device-memory index (see memory_index_search in
 * device_context.hpp):
 * host queries and outputs, the device `search` between them. Allocates its device buffers from
 * the resources' workspace and waits for their stream before returning (the facade composes the
 * ids on the host).
 * @throw logic_error as `inferscale::search` (index.cuh); cuda_error on a CUDA failure.
 */
template <class Resources>
struct memory_index_search<Resources,
                           std::enable_if_t<std::is_base_of_v<raft::resources, Resources>>> {
  static constexpr memory_space index_space = memory_space::device;

  /// @brief The resources' stream (a device_context of resources alone runs on it).
  static cuda::stream_ref stream(raft::resources const& res)
  {
    return cuda::stream_ref{raft::resource::get_cuda_stream(res).get()};
  }

  static void run(raft::resources const& res,
                  graph_index const& index,
                  matrix_view<float const> queries,
                  cuda::std::span<std::uint64_t const> namespaces,
                  std::uint32_t k,
                  search_params const& params,
                  matrix_view<std::uint64_t> out_ids,
                  matrix_view<float> out_distances)
  {
    std::int64_t const rows = queries.extent(0);
    std::int64_t const dim  = queries.extent(1);
    // The facade's views are dense host rows (its own vectors): one copy each way.
    INFERSCALE_EXPECTS(queries.stride(0) == dim && queries.stride(1) == 1 &&
                         out_ids.stride(0) == k && out_ids.stride(1) == 1 &&
                         out_distances.stride(0) == k && out_distances.stride(1) == 1,
                       std::string{"memory: the device index search takes dense host rows"});
    if (rows == 0) { return; }
    cudaStream_t const stream = raft::resource::get_cuda_stream(res).get();
    auto device_queries       = inferscale::detail::index::workspace_vector<float>(res, rows * dim);
    auto device_ids = inferscale::detail::index::workspace_vector<std::uint64_t>(res, rows * k);
    auto device_distances = inferscale::detail::index::workspace_vector<float>(res, rows * k);
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(device_queries.data(),
                                        queries.data_handle(),
                                        static_cast<std::size_t>(rows * dim) * sizeof(float),
                                        cudaMemcpyHostToDevice,
                                        stream));
    inferscale::search(res,
                       index,
                       make_matrix_view<float const>(device_queries.data(), rows, dim),
                       namespaces,
                       k,
                       params,
                       make_matrix_view<std::uint64_t>(device_ids.data(), rows, k),
                       make_matrix_view<float>(device_distances.data(), rows, k));
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(out_ids.data_handle(),
                                        device_ids.data(),
                                        static_cast<std::size_t>(rows * k) * sizeof(std::uint64_t),
                                        cudaMemcpyDeviceToHost,
                                        stream));
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(out_distances.data_handle(),
                                        device_distances.data(),
                                        static_cast<std::size_t>(rows * k) * sizeof(float),
                                        cudaMemcpyDeviceToHost,
                                        stream));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
  }
};

}  // namespace inferscale::detail
