// Small RAII owners of device memory and streams for the GPU tests (setup code, not library API).
// Device memory is the library's own device_buffer; the stream is test-only.
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/device_buffer.hpp>

#include <cuda_runtime_api.h>

namespace inferscale_test {

/// @brief The library's owning buffer (device_buffer.hpp): `count` elements in device memory (room
/// for at least one, so empty launches have a pointer), copies from and to std::vector.
using inferscale::device_buffer;

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
