/**
 * @file detail/cuda_runtime.hpp
 * @brief The CUDA runtime as the host headers see it: the real `<cuda_runtime_api.h>` where the
 * toolkit is installed, or, in a CPU-only build, a stand-in that lets the host headers compile
 * and link without it (device and pinned memory are then refused at run time).
 *
 * A CPU-only consumer (a llama.cpp or vLLM-CPU integration on a machine without the CUDA toolkit)
 * compiles the host headers with a plain C++17 compiler and CCCL's headers only (header-only: the
 * toolkit's `include/cccl`, the `nvidia-cuda-cccl` wheel or CCCL's sources) and links no
 * `libcudart`. The choice is made once per translation unit:
 *  - `INFERSCALE_HOST_ONLY` defined (to anything): the stand-in, whatever is installed;
 *  - otherwise the real runtime when `<cuda_runtime_api.h>` is on the include path, else the
 *    stand-in.
 * Every translation unit of one program must make the same choice (the inline functions of the
 * headers differ between the two).
 *
 * The stand-in declares the few runtime names the host headers use, in
 * `inferscale::detail::host_only_runtime` (pulled into `inferscale` by a using-directive, never
 * into the global namespace, so it cannot collide with a real CUDA header elsewhere). Its
 * allocators and copies return `cudaErrorNoDevice`, so `memory_space::device` and
 * `memory_space::pinned` objects are refused by `INFERSCALE_CUDA_TRY` with a `cuda_error` that says
 * the build has no CUDA runtime; `visible_device_count()` is 0. Error values are CUDA's own
 * (CUDA Runtime API, `cudaError` enum: cudaSuccess = 0, cudaErrorNoDevice = 100).
 */
#pragma once

#include <cstddef>

#if !defined(INFERSCALE_HOST_ONLY) && defined(__has_include)
#if __has_include(<cuda_runtime_api.h>)
#define INFERSCALE_HAS_CUDA_RUNTIME 1
#endif
#endif
#if !defined(INFERSCALE_HAS_CUDA_RUNTIME)
#define INFERSCALE_HAS_CUDA_RUNTIME 0
#endif

#if INFERSCALE_HAS_CUDA_RUNTIME

#include <cuda_runtime_api.h>

#else

namespace inferscale::detail::host_only_runtime {

enum cudaError_t : int { cudaSuccess = 0, cudaErrorNoDevice = 100 };
using cudaError = cudaError_t;
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost     = 0,
  cudaMemcpyHostToDevice   = 1,
  cudaMemcpyDeviceToHost   = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault        = 4
};
struct host_only_stream;
struct host_only_event;
using cudaStream_t = host_only_stream*;
using cudaEvent_t  = host_only_event*;
// A macro of the real runtime (driver_types.h) where <cuda_runtime_api.h> came first: CCCL's
// headers include it wherever the compiler finds it (a toolkit linked into /usr/local/include),
// even in a build that chose the stand-in. The macro's value is the same, so the stand-in uses it.
#ifndef cudaEventDisableTiming
inline constexpr unsigned cudaEventDisableTiming = 0x02;
#endif

inline char const* cudaGetErrorName(cudaError_t e) noexcept
{
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorNoDevice";
}
inline char const* cudaGetErrorString(cudaError_t e) noexcept
{
  return e == cudaSuccess ? "no error"
                          : "InferScale was compiled without the CUDA runtime (CPU-only build): "
                            "device and pinned memory are not available";
}
inline cudaError_t cudaGetDeviceCount(int* count) noexcept
{
  if (count != nullptr) { *count = 0; }
  return cudaErrorNoDevice;
}
inline cudaError_t cudaGetLastError() noexcept { return cudaSuccess; }
inline cudaError_t cudaPeekAtLastError() noexcept { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() noexcept { return cudaErrorNoDevice; }
inline cudaError_t cudaMalloc(void** p, std::size_t) noexcept
{
  if (p != nullptr) { *p = nullptr; }
  return cudaErrorNoDevice;
}
inline cudaError_t cudaMallocHost(void** p, std::size_t) noexcept
{
  if (p != nullptr) { *p = nullptr; }
  return cudaErrorNoDevice;
}
inline cudaError_t cudaMallocAsync(void** p, std::size_t, cudaStream_t) noexcept
{
  if (p != nullptr) { *p = nullptr; }
  return cudaErrorNoDevice;
}
/// @brief Nothing was ever allocated: freeing is a no-op, as cudaFree(nullptr) is.
inline cudaError_t cudaFree(void*) noexcept { return cudaSuccess; }
inline cudaError_t cudaFreeHost(void*) noexcept { return cudaSuccess; }
inline cudaError_t cudaFreeAsync(void*, cudaStream_t) noexcept { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) noexcept { return cudaErrorNoDevice; }
inline cudaError_t cudaMemset(void*, int, std::size_t) noexcept { return cudaErrorNoDevice; }
inline cudaError_t cudaMemsetAsync(void*, int, std::size_t, cudaStream_t = nullptr) noexcept
{
  return cudaErrorNoDevice;
}
inline cudaError_t cudaMemcpy(void*, void const*, std::size_t, cudaMemcpyKind) noexcept
{
  return cudaErrorNoDevice;
}
inline cudaError_t cudaMemcpyAsync(
  void*, void const*, std::size_t, cudaMemcpyKind, cudaStream_t = nullptr) noexcept
{
  return cudaErrorNoDevice;
}
inline cudaError_t cudaMemcpy2D(
  void*, std::size_t, void const*, std::size_t, std::size_t, std::size_t, cudaMemcpyKind) noexcept
{
  return cudaErrorNoDevice;
}
inline cudaError_t cudaMemcpy2DAsync(void*,
                                     std::size_t,
                                     void const*,
                                     std::size_t,
                                     std::size_t,
                                     std::size_t,
                                     cudaMemcpyKind,
                                     cudaStream_t = nullptr) noexcept
{
  return cudaErrorNoDevice;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) noexcept
{
  if (e != nullptr) { *e = nullptr; }
  return cudaErrorNoDevice;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t) noexcept { return cudaSuccess; }
inline cudaError_t cudaEventSynchronize(cudaEvent_t) noexcept { return cudaErrorNoDevice; }
inline cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = nullptr) noexcept
{
  return cudaErrorNoDevice;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0) noexcept
{
  return cudaErrorNoDevice;
}

}  // namespace inferscale::detail::host_only_runtime

namespace inferscale {
using namespace detail::host_only_runtime;  // NOLINT(google-build-using-namespace): see @file
}  // namespace inferscale

#endif
