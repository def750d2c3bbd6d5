/**
 * @file memory_resource.hpp
 * @brief Memory resources: where the library's pools and workspaces get their device (or
 * page-locked host) memory, and the resources that give today's defaults.
 *
 * A `memory_resource` allocates and frees bytes in stream order, as `cuda::mr`'s resources do
 * (CCCL 3.x: `allocate(stream, bytes, alignment)` / `deallocate(stream, p, bytes, alignment)`).
 * The store's pool (`kv_store_config::resource`), the index's device arrays
 * (`index_config::resource`), the injection workspace and `device_buffer` take a non-owning
 * pointer to one; a null pointer means the default below, so code that passes nothing behaves as
 * before resources existed. The caller keeps a resource alive as long as anything allocated from
 * it.
 *
 * The resources defined here:
 *  - `cuda_memory_resource`: `cudaMalloc` / `cudaFree` (the stream is ignored; `cudaFree`
 *    waits for the device). The default for device memory (`default_device_resource()`).
 *  - `cuda_async_memory_resource`: `cudaMallocAsync` / `cudaFreeAsync` on the given stream
 *    (the device's default memory pool), for callers that want stream-ordered allocation.
 *  - `pinned_memory_resource`: `cudaMallocHost` / `cudaFreeHost` (page-locked host memory, the
 *    stream is ignored). The default for pinned memory (`pinned_host_resource()`).
 * RMM's resources are adapted by rmm_resource.hpp (only where RMM is installed); any other
 * allocator by deriving from `memory_resource`.
 *
 * Plain C++17: in a CPU-only build (detail/cuda_runtime.hpp) the CUDA resources refuse every
 * allocation with a cuda_error, as every device allocation is refused there.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/error.hpp>

#include <cstddef>
#include <string>

namespace inferscale {

/**
 * @brief Allocates and frees memory in stream order (the interface of `cuda::mr`'s resources,
 * as a virtual class so the library's owners can hold any resource through one pointer).
 *
 * Derived classes implement do_allocate / do_deallocate; the public functions check the
 * alignment once.
 */
class memory_resource {
 public:
  /// @brief The alignment the library asks for: cudaMalloc's (256 bytes).
  static constexpr std::size_t default_alignment = 256;

  memory_resource()                                  = default;
  memory_resource(memory_resource const&)            = default;
  memory_resource& operator=(memory_resource const&) = default;
  virtual ~memory_resource()                         = default;

  /**
   * @brief `bytes` bytes aligned to `alignment`, usable by work enqueued on `stream` after this
   * call (and, for resources that ignore the stream, by any work).
   * @throw logic_error if `alignment` is not a power of two; cuda_error (or the resource's own
   *        exception) if the allocation fails.
   */
  [[nodiscard]] void* allocate(cudaStream_t stream,
                               std::size_t bytes,
                               std::size_t alignment = default_alignment)
  {
    INFERSCALE_EXPECTS(alignment != 0 && (alignment & (alignment - 1)) == 0,
                       "memory_resource::allocate: alignment " + std::to_string(alignment) +
                         " is not a power of two");
    return do_allocate(stream, bytes, alignment);
  }

  /**
   * @brief Returns what allocate(stream, bytes, alignment) gave, after the work enqueued on
   * `stream` so far. Never throws.
   */
  void deallocate(cudaStream_t stream,
                  void* p,
                  std::size_t bytes,
                  std::size_t alignment = default_alignment) noexcept
  {
    if (p != nullptr) { do_deallocate(stream, p, bytes, alignment); }
  }

 private:
  virtual void* do_allocate(cudaStream_t stream, std::size_t bytes, std::size_t alignment) = 0;
  virtual void do_deallocate(cudaStream_t stream,
                             void* p,
                             std::size_t bytes,
                             std::size_t alignment) noexcept                               = 0;
};

namespace detail {
/// @brief Refuses an alignment above the 256 bytes the CUDA allocators guarantee.
inline void check_cuda_alignment(std::size_t alignment, char const* who)
{
  INFERSCALE_EXPECTS(alignment <= memory_resource::default_alignment,
                     std::string{who} + ": alignment " + std::to_string(alignment) +
                       " above the 256 bytes the CUDA allocators guarantee");
}
}  // namespace detail

/// @brief Device memory from `cudaMalloc`, freed with `cudaFree` (which waits for the device).
class cuda_memory_resource final : public memory_resource {
 private:
  void* do_allocate(cudaStream_t, std::size_t bytes, std::size_t alignment) override
  {
    detail::check_cuda_alignment(alignment, "cuda_memory_resource");
    void* p = nullptr;
    INFERSCALE_CUDA_TRY(cudaMalloc(&p, bytes));
    return p;
  }
  void do_deallocate(cudaStream_t, void* p, std::size_t, std::size_t) noexcept override
  {
    (void)cudaFree(p);
  }
};

/// @brief Device memory from `cudaMallocAsync` on the stream, freed with `cudaFreeAsync`.
class cuda_async_memory_resource final : public memory_resource {
 private:
  void* do_allocate(cudaStream_t stream, std::size_t bytes, std::size_t alignment) override
  {
    detail::check_cuda_alignment(alignment, "cuda_async_memory_resource");
    void* p = nullptr;
    INFERSCALE_CUDA_TRY(cudaMallocAsync(&p, bytes, stream));
    return p;
  }
  void do_deallocate(cudaStream_t stream, void* p, std::size_t, std::size_t) noexcept override
  {
    (void)cudaFreeAsync(p, stream);
  }
};

/// @brief Page-locked host memory from `cudaMallocHost`, freed with `cudaFreeHost`.
class pinned_memory_resource final : public memory_resource {
 private:
  void* do_allocate(cudaStream_t, std::size_t bytes, std::size_t alignment) override
  {
    detail::check_cuda_alignment(alignment, "pinned_memory_resource");
    void* p = nullptr;
    INFERSCALE_CUDA_TRY(cudaMallocHost(&p, bytes));
    return p;
  }
  void do_deallocate(cudaStream_t, void* p, std::size_t, std::size_t) noexcept override
  {
    (void)cudaFreeHost(p);
  }
};

/// @brief The resource used for device memory when none is given: a `cuda_memory_resource`.
inline memory_resource* default_device_resource() noexcept
{
  static cuda_memory_resource resource;
  return &resource;
}

/// @brief A process-wide `cuda_async_memory_resource` (stream-ordered device memory).
inline memory_resource* async_device_resource() noexcept
{
  static cuda_async_memory_resource resource;
  return &resource;
}

/// @brief The resource used for pinned host memory when none is given: `pinned_memory_resource`.
inline memory_resource* pinned_host_resource() noexcept
{
  static pinned_memory_resource resource;
  return &resource;
}

}  // namespace inferscale
