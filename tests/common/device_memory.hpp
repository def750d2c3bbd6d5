// Small RAII owners of device memory and streams for the GPU tests (setup code, not library API).
#pragma once

#include <inferscale/cuda_error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace inferscale_test {

/// @brief `count` elements of T in device memory (at least one, so empty launches have a pointer).
template <class T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t count) : size_{count}
  {
    INFERSCALE_CUDA_TRY(cudaMalloc(&data_, std::max<std::size_t>(count, 1) * sizeof(T)));
  }
  /// @brief Allocates and copies `host` (synchronously).
  explicit device_buffer(std::vector<T> const& host) : device_buffer(host.size())
  {
    INFERSCALE_CUDA_TRY(cudaMemcpy(data_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~device_buffer() { (void)cudaFree(data_); }
  device_buffer(device_buffer const&)            = delete;
  device_buffer& operator=(device_buffer const&) = delete;

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

  /// @brief Copies the contents back (synchronously).
  std::vector<T> to_host() const
  {
    std::vector<T> host(size_);
    INFERSCALE_CUDA_TRY(cudaMemcpy(host.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* data_{};
  std::size_t size_{};
};

/// @brief A non-blocking CUDA stream.
class cuda_stream {
 public:
  cuda_stream() { INFERSCALE_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~cuda_stream() { (void)cudaStreamDestroy(stream_); }
  cuda_stream(cuda_stream const&)            = delete;
  cuda_stream& operator=(cuda_stream const&) = delete;
  cudaStream_t get() const noexcept { return stream_; }

 private:
  cudaStream_t stream_{};
};

}  // namespace inferscale_test
