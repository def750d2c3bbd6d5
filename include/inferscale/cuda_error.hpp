/**
 * @file cuda_error.hpp
 * @brief INFERSCALE_CUDA_TRY and device queries. Needs the CUDA runtime headers (not nvcc); in a
 * CPU-only build (detail/cuda_runtime.hpp) every device call is refused with a cuda_error and
 * `visible_device_count()` is 0.
 */
#pragma once

#include <inferscale/detail/cuda_runtime.hpp>
#include <inferscale/error.hpp>

#include <string>

namespace inferscale {
namespace detail {
/// @brief cudaSuccess, named from any namespace (the CPU-only stand-in's lives in inferscale).
inline constexpr cudaError_t cuda_success = cudaSuccess;
/// @brief Clears the runtime's last error (INFERSCALE_CUDA_TRY, before it throws).
inline void clear_cuda_error() noexcept { (void)cudaGetLastError(); }
/// @brief The last launch's configuration error, if any (INFERSCALE_CHECK_LAUNCH).
inline cudaError_t peek_cuda_error() noexcept { return cudaPeekAtLastError(); }

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
    auto const inferscale_status_ = (call);                                                  \
    if (inferscale_status_ != ::inferscale::detail::cuda_success) {                          \
      ::inferscale::detail::clear_cuda_error();                                              \
      ::inferscale::detail::throw_cuda_error(inferscale_status_, #call, __FILE__, __LINE__); \
    }                                                                                        \
  } while (0)

/// @brief Checks the last kernel launch (configuration errors are reported at launch time).
#define INFERSCALE_CHECK_LAUNCH() INFERSCALE_CUDA_TRY(::inferscale::detail::peek_cuda_error())
