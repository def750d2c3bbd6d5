/**
 * @file device_context.hpp
 * @brief The device half of a run: what a run on the device takes besides its plan and its caches
 * — the stream it is enqueued on, the workspace its arrays are staged in, and, for the memory
 * facade's device-memory index, the RAFT resources its search runs with. One convention for every
 * twin (FlashInfer's plan/run split): the host run is `run(plan..., caches..., rotation)`, the
 * device run the same call with a `device_context` last (injection_batch::run, memory::serve,
 * serve_step and inject).
 *
 * CUDA-free: the runtime API's types and libcu++'s `cuda::stream_ref` only, so the facade's
 * header (memory.hpp) stays plain C++17. RAFT is named, not included: a context with resources is
 * made where <inferscale/memory_device_index.cuh> (nvcc, RAFT) is included, and refused at compile
 * time elsewhere.
 */
#pragma once

#include <inferscale/detail/cuda_runtime.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index_params.hpp>

#include <cuda/std/span>
#if INFERSCALE_HAS_CUDA_RUNTIME
#include <cuda/stream_ref>
#endif

#include <cstdint>
#include <type_traits>

namespace raft {
class resources;  // raft/core/resources.hpp: declared only, so this header needs no RAFT
}  // namespace raft

namespace inferscale {

#if INFERSCALE_HAS_CUDA_RUNTIME
/// The stream of a device run: libcu++'s `cuda::stream_ref`.
using stream_ref = cuda::stream_ref;
#else
/**
 * @brief A CPU-only build's stand-in for `cuda::stream_ref` (no CUDA runtime headers, so libcu++
 * declares none): it carries the host-only `cudaStream_t` and nothing runs on it (such a build has
 * no device run); the facade's signatures stay the same.
 */
class stream_ref {
 public:
  constexpr stream_ref(cudaStream_t stream) noexcept : stream_{stream} {}  // NOLINT: as cuda's
  constexpr cudaStream_t get() const noexcept { return stream_; }

 private:
  cudaStream_t stream_;
};
#endif

class injection_workspace;  // inject.cuh: the device run's staging
class graph_index;          // index.hpp

namespace detail {
/**
 * @brief The facade's search of an index with `Resources` (a raft::resources or a type derived
 * from it): `run(res, index, queries, namespaces, k, params, ids, distances)` on host views,
 * `stream(res)`, its stream, and `index_space`, the memory of the index it searches. Declared here
 * only: memory_device_index.cuh defines it for raft::resources (a device index).
 */
template <class Resources, class = void>
struct memory_index_search;

/// @brief A search through memory_index_search<R>, its resources type-erased.
using index_search_fn = void (*)(void const* resources,
                                 graph_index const&,
                                 matrix_view<float const>,
                                 cuda::std::span<std::uint64_t const>,
                                 std::uint32_t,
                                 search_params const&,
                                 matrix_view<std::uint64_t>,
                                 matrix_view<float>);

/// @brief `T`, as a type that depends on `U` (a check deferred to a template's instantiation).
template <class T, class U>
using dependent_t = std::conditional_t<sizeof(U*) != 0, T, T>;

/// @brief Whether `T` is a complete type here (a header that defines it is included).
template <class T, class = void>
struct is_complete : std::false_type {
};
template <class T>
struct is_complete<T, std::void_t<decltype(sizeof(T))>> : std::true_type {
};
}  // namespace detail

/**
 * @brief What a device run takes besides its plan and caches (see the file comment). Trivially
 * copyable; it refers to the workspace and the resources, which must outlive the runs given it.
 *
 *  - `device_context{workspace, stream}`: a store in device memory injected into a cache in device
 *    memory, the step's arrays staged through `workspace`, everything enqueued on `stream`.
 *  - `device_context{res}` (memory facade only): an index in device memory searched with `res`
 *    (on its stream, waited for), the store and the cache in host memory, injected on the host.
 *  - `device_context{res, workspace, stream}`: both (a GPU engine's serving step).
 *  - `with_copy_stream(s)`: a tiered step's host-tier pages are copied on `s` (default: `stream`).
 */
class device_context {
 public:
  /// @brief A device run on `stream`, staging through `workspace`.
  device_context(injection_workspace& workspace, stream_ref stream) noexcept
    : workspace_{&workspace}, stream_{stream}, copy_stream_{stream}
  {
  }

  /**
   * @brief The facade's device index searched with `resources` (its stream); no device
   * injection (a host store). @note Needs <inferscale/memory_device_index.cuh> (nvcc, RAFT).
   */
  template <class Resources>
  explicit device_context(Resources const& resources)
    : device_context{resources, nullptr, stream_of(resources)}
  {
  }

  /// @brief Both: the device index searched with `resources`, the device store injected on
  /// `stream` through `workspace`. @note Needs <inferscale/memory_device_index.cuh>.
  template <class Resources>
  device_context(Resources const& resources, injection_workspace& workspace, stream_ref stream)
    : device_context{resources, &workspace, stream}
  {
  }

  /// @brief The same context with a tiered step's copies on `copy_stream`.
  device_context with_copy_stream(stream_ref copy_stream) const noexcept
  {
    device_context c = *this;
    c.copy_stream_   = copy_stream;
    return c;
  }

  /// @brief The staging workspace; null for a context of resources alone (no device injection).
  injection_workspace* workspace() const noexcept { return workspace_; }
  /// @brief The stream the run is enqueued on.
  stream_ref stream() const noexcept { return stream_; }
  /// @brief The stream a tiered step's host-tier pages are copied on (stream() unless set).
  stream_ref copy_stream() const noexcept { return copy_stream_; }
  /// @brief Whether the context searches the facade's index (it was made with resources).
  bool searches_index() const noexcept { return index_search_ != nullptr; }
  /// @brief The memory of the index its resources search (device for a raft::resources).
  memory_space index_space() const noexcept { return index_space_; }

  /**
   * @brief Searches `index` with the context's resources (memory_index_search::run: the queries'
   * top `k` in their namespaces, host views in and out).
   * @pre searches_index()
   */
  void search_index(graph_index const& index,
                    matrix_view<float const> queries,
                    cuda::std::span<std::uint64_t const> namespaces,
                    std::uint32_t k,
                    search_params const& params,
                    matrix_view<std::uint64_t> ids,
                    matrix_view<float> distances) const
  {
    index_search_(resources_, index, queries, namespaces, k, params, ids, distances);
  }

 private:
  template <class Resources>
  static void check_resources()
  {
    static_assert(detail::is_complete<detail::memory_index_search<Resources>>::value,
                  "device_context with RAFT resources: include "
                  "<inferscale/memory_device_index.cuh> (nvcc, RAFT) and pass a raft::resources "
                  "(or a type derived from it)");
  }

  template <class Resources>
  static stream_ref stream_of(Resources const& resources)
  {
    check_resources<Resources>();
    return detail::memory_index_search<Resources>::stream(resources);
  }

  template <class Resources>
  static void search_with(void const* resources,
                          graph_index const& index,
                          matrix_view<float const> queries,
                          cuda::std::span<std::uint64_t const> namespaces,
                          std::uint32_t k,
                          search_params const& params,
                          matrix_view<std::uint64_t> ids,
                          matrix_view<float> distances)
  {
    detail::memory_index_search<Resources>::run(*static_cast<Resources const*>(resources),
                                                index,
                                                queries,
                                                namespaces,
                                                k,
                                                params,
                                                ids,
                                                distances);
  }

  template <class Resources>
  device_context(Resources const& resources, injection_workspace* workspace, stream_ref stream)
    : workspace_{workspace},
      stream_{stream},
      copy_stream_{stream},
      resources_{&resources},
      index_search_{&search_with<Resources>},
      index_space_{detail::memory_index_search<Resources>::index_space}
  {
    check_resources<Resources>();
  }

  injection_workspace* workspace_{};
  stream_ref stream_;
  stream_ref copy_stream_;
  void const* resources_{};
  detail::index_search_fn index_search_{};
  memory_space index_space_{memory_space::host};
};

}  // namespace inferscale
