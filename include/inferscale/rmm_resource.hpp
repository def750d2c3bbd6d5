/**
 * @file rmm_resource.hpp
 * @brief `rmm_resource`: an RMM memory resource as an InferScale memory_resource, so the store's
 * pool, the index's device arrays and the injection workspace allocate from an application's RMM
 * pool (or any `cuda::mr` device resource).
 *
 * Only for programs that use RMM: this header includes RMM's (`<rmm/resource_ref.hpp>`, RMM
 * 26.10: `rmm::device_async_resource_ref` is `cuda::mr::resource_ref<device_accessible>` with
 * `allocate(stream, bytes, alignment)`), and no other InferScale header includes it. It is left
 * out of the C++17 header check (tests/headers) and compiled by the RAFT tests, which have RMM.
 *
 * ```
 * rmm::mr::pool_memory_resource pool{rmm::mr::cuda_memory_resource{}, 1 << 30};
 * inferscale::rmm_resource resource{pool};
 * kv_store_config config{...};
 * config.resource = &resource;  // the pool comes from RMM's pool
 * ```
 */
#pragma once

#if defined(__has_include)
#if !__has_include(<rmm/resource_ref.hpp>)
#error "inferscale/rmm_resource.hpp needs RMM's headers (rmm/resource_ref.hpp) on the include path"
#endif
#endif

#include <inferscale/memory_resource.hpp>

#include <rmm/mr/per_device_resource.hpp>
#include <rmm/resource_ref.hpp>

#include <cuda/stream_ref>

#include <cstddef>

namespace inferscale {

/**
 * @brief A memory_resource that allocates from an RMM resource (not owned: the RMM resource must
 * outlive this adapter and everything allocated through it). Stream-ordered as the RMM resource
 * is; exceptions are RMM's (`rmm::bad_alloc`, `rmm::out_of_memory`).
 */
class rmm_resource final : public memory_resource {
 public:
  /// @brief Adapts the current device's RMM resource (`rmm::mr::get_current_device_resource_ref`).
  rmm_resource() : resource_{rmm::mr::get_current_device_resource_ref()} {}

  /// @brief Adapts `resource` (an RMM resource or any `cuda::mr` device resource, by reference).
  explicit rmm_resource(rmm::device_async_resource_ref resource) noexcept : resource_{resource} {}

  /// @brief The adapted RMM resource.
  [[nodiscard]] rmm::device_async_resource_ref get() const noexcept { return resource_; }

 private:
  void* do_allocate(cudaStream_t stream, std::size_t bytes, std::size_t alignment) override
  {
    return resource_.allocate(cuda::stream_ref{stream}, bytes, alignment);
  }
  void do_deallocate(cudaStream_t stream,
                     void* p,
                     std::size_t bytes,
                     std::size_t alignment) noexcept override
  {
    resource_.deallocate(cuda::stream_ref{stream}, p, bytes, alignment);
  }

  rmm::device_async_resource_ref resource_;
};

}  // namespace inferscale
