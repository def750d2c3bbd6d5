/**
 * @file config.hpp
 * @brief Compiler annotations and version macros shared by every InferScale header.
 *
 * Everything here compiles with a plain C++17 compiler; under nvcc the annotations expand to the
 * CUDA execution-space specifiers, so one definition of the per-element math serves both backends.
 */
#pragma once

#include <cstdint>

#define INFERSCALE_VERSION_MAJOR 0
#define INFERSCALE_VERSION_MINOR 1
#define INFERSCALE_VERSION_PATCH 0

#if defined(__CUDACC__) || defined(__CUDA_ARCH__)
#define INFERSCALE_HOST_DEVICE       __host__ __device__
#define INFERSCALE_DEVICE            __device__
#define INFERSCALE_HAS_CUDA_COMPILER 1
#else
#define INFERSCALE_HOST_DEVICE
#define INFERSCALE_DEVICE
#define INFERSCALE_HAS_CUDA_COMPILER 0
#endif

#if defined(__CUDA_ARCH__)
#define INFERSCALE_IS_DEVICE_CODE 1
#else
#define INFERSCALE_IS_DEVICE_CODE 0
#endif

namespace inferscale::detail {
/**
 * @brief `v` unchanged, but opaque to the host compiler's optimiser: an operation that produced
 * it cannot be fused with one that uses it. The host's "rounded once" helpers (mul_rn) pass their
 * product through it, so a consumer's `-march=native -ffp-contract=fast` (or aarch64's default
 * contraction) cannot turn `x*c - y*s` into an FMA and change the bits that the host reference and
 * the device agree on. No instruction is emitted; the value stays in its register. Device code
 * uses the __fmul_rn family instead, which nvcc never fuses.
 */
INFERSCALE_HOST_DEVICE inline float unfused(float v) noexcept
{
#if !INFERSCALE_IS_DEVICE_CODE && defined(__GNUC__) && \
  (defined(__x86_64__) || (defined(__i386__) && defined(__SSE__)))
  __asm__("" : "+x"(v));
#elif !INFERSCALE_IS_DEVICE_CODE && defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}
/// @brief The double form of unfused (the rotary angles' sin/cos reduction and series).
INFERSCALE_HOST_DEVICE inline double unfused(double v) noexcept
{
#if !INFERSCALE_IS_DEVICE_CODE && defined(__GNUC__) && \
  (defined(__x86_64__) || (defined(__i386__) && defined(__SSE2__)))
  __asm__("" : "+x"(v));
#elif !INFERSCALE_IS_DEVICE_CODE && defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}

}  // namespace inferscale::detail

/// @brief `#pragma unroll` in device code; nothing in host code (host compilers would warn).
#if defined(__CUDA_ARCH__)
#define INFERSCALE_UNROLL _Pragma("unroll")
#else
#define INFERSCALE_UNROLL
#endif

/**
 * @brief Full unrolling of a short host loop of constant trip count (at most 8), for GCC and
 * Clang even below -O3; nothing under nvcc, whose front end rejects the GCC form in host code (the
 * host compiler then unrolls at its own discretion: the results are the same, only the speed).
 */
#if defined(__CUDACC__) || !defined(__GNUC__)
#define INFERSCALE_HOST_UNROLL
#elif defined(__clang__)
#define INFERSCALE_HOST_UNROLL _Pragma("unroll")
#else
#define INFERSCALE_HOST_UNROLL _Pragma("GCC unroll 8")
#endif

#if defined(__CUDACC__)
#define INFERSCALE_FORCEINLINE __forceinline__
#elif defined(__GNUC__)
#define INFERSCALE_FORCEINLINE inline __attribute__((always_inline))
#else
#define INFERSCALE_FORCEINLINE inline
#endif

/**
 * CUDA 12.1 or newer for the device code: the injection and extraction kernels take their batch
 * descriptors by value (4.4-5.4 KB of parameters), above the 4 KB kernel-parameter limit that
 * CUDA 12.1 raised to 32 KB. (Clang's CUDA mode defines no __CUDACC_VER_MAJOR__ and is not
 * checked here.)
 */
#if defined(__CUDACC__) && defined(__CUDACC_VER_MAJOR__) && \
  (__CUDACC_VER_MAJOR__ < 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ < 1))
#error "InferScale's device code needs CUDA 12.1 or newer (kernel parameters above 4 KB)"
#endif

/**
 * @brief Declares a kernel with hidden visibility, so that a header-only library can be included
 * in several shared objects without their kernels colliding (the rule cuco's CUCO_KERNEL follows).
 */
#if defined(__CUDACC__)
#if defined(__GNUC__)
#define INFERSCALE_KERNEL __attribute__((visibility("hidden"))) __global__
#else
#define INFERSCALE_KERNEL __global__
#endif
#endif
