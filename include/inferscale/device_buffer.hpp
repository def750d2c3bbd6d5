/**
 * @file device_buffer.hpp
 * @brief `device_buffer<T>`: a move-only owner of an array of `T` allocated from a
 * memory_resource (device memory by default; page-locked host memory from
 * `pinned_host_resource()`), on a stream, and freed on that stream by the same resource.
 *
 * The one owning buffer of the library, its tests, benchmarks and examples (RMM's
 * `rmm::device_uvector` without the element operations). Freeing is stream-ordered: a buffer
 * from a stream-ordered resource (`cuda_async_memory_resource`, RMM's) is returned after the work
 * enqueued on its stream, so work on another stream that reads it must be ordered before that
 * stream's end (an event), as with any stream-ordered allocation. The default resource
 * (`cudaMalloc` / `cudaFree`) waits for the whole device.
 *
 * Plain C++17 (the CUDA runtime API only); in a CPU-only build every allocation is refused with a
 * cuda_error (detail/cuda_runtime.hpp).
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_resource.hpp>

#include <cstddef>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief `size()` elements of `T` (uninitialised) from a memory_resource, owned and freed on
 * destruction. A buffer of 0 elements still holds one element's room, so an empty launch has a
 * valid pointer; only a default-constructed (or moved-from) buffer holds none (`data()` null).
 * @tparam T a trivially copyable element type (the memory is copied byte-wise)
 */
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>, "device_buffer<T>: T is trivially copyable");

 public:
  device_buffer() noexcept = default;

  /**
   * @brief Allocates `count` elements (room for at least one) from `resource` on `stream`.
   * @param resource null: default_device_resource() (cudaMalloc)
   * @throw logic_error if `count * sizeof(T)` overflows; cuda_error if the allocation fails.
   */
  explicit device_buffer(std::size_t count,
                         cudaStream_t stream       = nullptr,
                         memory_resource* resource = nullptr)
    : size_{count},
      stream_{stream},
      resource_{resource != nullptr ? resource : default_device_resource()}
  {
    INFERSCALE_EXPECTS(count <= std::numeric_limits<std::size_t>::max() / sizeof(T),
                       "device_buffer: " + std::to_string(count) + " elements of " +
                         std::to_string(sizeof(T)) + " bytes overflow the address space");
    data_ = static_cast<T*>(resource_->allocate(stream_, allocated_bytes()));
  }

  /**
   * @brief Allocates `host.size()` elements as above and copies `host` into them.
   * @note Waits for `stream` (the copy is complete on return).
   */
  explicit device_buffer(std::vector<T> const& host,
                         cudaStream_t stream       = nullptr,
                         memory_resource* resource = nullptr)
    : device_buffer(host.size(), stream, resource)
  {
    copy_from_host(host.data(), host.size());
  }

  device_buffer(device_buffer const&)            = delete;
  device_buffer& operator=(device_buffer const&) = delete;
  device_buffer(device_buffer&& other) noexcept { swap(other); }
  device_buffer& operator=(device_buffer&& other) noexcept
  {
    device_buffer moved{std::move(other)};
    swap(moved);
    return *this;
  }
  ~device_buffer() { release(); }

  void swap(device_buffer& other) noexcept
  {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(stream_, other.stream_);
    std::swap(resource_, other.resource_);
  }

  [[nodiscard]] T* data() const noexcept { return data_; }
  /// @brief Elements (as asked for; the room is at least one element).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// @brief `size() * sizeof(T)`.
  [[nodiscard]] std::size_t bytes() const noexcept { return size_ * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// @brief The stream the buffer was allocated on and is freed on.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  /// @brief The resource it came from (null only when the buffer holds nothing).
  [[nodiscard]] memory_resource* resource() const noexcept { return resource_; }

  /**
   * @brief Copies `count` elements from host memory to the start of the buffer.
   * @throw logic_error if `count > size()` (nothing copied). @note Waits for the buffer's stream.
   */
  void copy_from_host(T const* host, std::size_t count)
  {
    INFERSCALE_EXPECTS(count <= size_,
                       "device_buffer: copying " + std::to_string(count) + " elements into " +
                         std::to_string(size_));
    if (count == 0) { return; }
    INFERSCALE_CUDA_TRY(
      cudaMemcpyAsync(data_, host, count * sizeof(T), cudaMemcpyDefault, stream_));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream_));
  }

  /// @brief A host copy of the contents. @note Waits for the buffer's stream.
  [[nodiscard]] std::vector<T> to_host() const
  {
    std::vector<T> host(size_);
    if (size_ > 0) {
      INFERSCALE_CUDA_TRY(cudaMemcpyAsync(host.data(), data_, bytes(), cudaMemcpyDefault, stream_));
      INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream_));
    }
    return host;
  }

  /// @brief Frees the memory now (on the buffer's stream); the buffer then holds nothing.
  void release() noexcept
  {
    if (data_ != nullptr) { resource_->deallocate(stream_, data_, allocated_bytes()); }
    data_ = nullptr;
    size_ = 0;
  }

 private:
  std::size_t allocated_bytes() const noexcept { return (size_ > 0 ? size_ : 1) * sizeof(T); }

  T* data_{};
  std::size_t size_{};
  cudaStream_t stream_{};
  memory_resource* resource_{};
};

}  // namespace inferscale
