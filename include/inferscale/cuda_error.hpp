/**
 * @file cuda_error.hpp
 * @brief INFERSCALE_CUDA_TRY and device queries. Needs the CUDA runtime headers (not nvcc).
 */
#pragma once

#include <inferscale/error.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace inferscale {
namespace detail {
[[noreturn]] inline void throw_cuda_error(cudaError_t status,
                                          char const* call,
                                          char const* file,
                                          int line)
{
  throw inferscale::cuda_error(std::string{"CUDA error at "} + file + ":" + std::to_string(line) +
                               ": " + call + " returned " + cudaGetErrorName(status) + " (" +
                               cudaGetErrorString(status) + ")");
}
}  // namespace detail

/**
 * @brief Number of CUDA devices visible to this process; 0 when there is no driver or no device.
 * @note Never throws. Clears the runtime's last error where it can be cleared; without a driver
 *       the runtime keeps reporting cudaErrorInsufficientDriver to every later call.
 */
inline int visible_device_count() noexcept
{
  int count           = 0;
  cudaError_t const s = cudaGetDeviceCount(&count);
  if (s != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace inferscale

/**
 * @brief Evaluates a CUDA runtime call and throws inferscale::cuda_error, naming the call, the
 * file, the line and the CUDA error, when it does not return cudaSuccess.
 */
#define INFERSCALE_CUDA_TRY(call)                                                            \
  do {                                                                                       \
    cudaError_t const inferscale_status_ = (call);                                           \
    if (inferscale_status_ != cudaSuccess) {                                                 \
      (void)cudaGetLastError();                                                              \
      ::inferscale::detail::throw_cuda_error(inferscale_status_, #call, __FILE__, __LINE__); \
    }                                                                                        \
  } while (0)

/// @brief Checks the last kernel launch (configuration errors are reported at launch time).
#define INFERSCALE_CHECK_LAUNCH() INFERSCALE_CUDA_TRY(cudaPeekAtLastError())
