/**
 * @file dtype.hpp
 * @brief Element types (fp32, fp16, bf16, fp8 e4m3 and e5m2), their conversions on host and device,
 * and the runtime `dtype` tag with a dispatch helper.
 *
 * The narrow types are trivially copyable bit containers with the same size and bit layout as
 * CUDA's `__half`, `__nv_bfloat16`, `__nv_fp8_e4m3` and `__nv_fp8_e5m2`, so engine tensors can be
 * viewed as arrays of them. Conversions from fp32 round to nearest, ties to even; fp16 and bf16
 * overflow to infinity; the fp8 types saturate to their largest finite value as CUDA's fp8 types
 * do (`__NV_SATFINITE`), NaN stays NaN. Under nvcc, device code uses the hardware conversion
 * instructions, which give the same bits for every number; host code uses the bit-level routines
 * in detail/dtype/conversion.hpp, so a plain C++ compiler needs no CUDA header. A NaN converts to
 * a NaN on both, but not always the same one: the host keeps the sign and top payload bits (with
 * the quiet bit set), while the device's instructions may return a canonical NaN. (The store and
 * the index refuse NaN inputs, so no stored value or distance depends on it.)
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/dtype/conversion.hpp>
#include <inferscale/error.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace inferscale {

/// @brief IEEE binary16.
struct alignas(2) half_t {
  std::uint16_t bits;
};
/// @brief bfloat16 (fp32's exponent, 7 mantissa bits).
struct alignas(2) bfloat16_t {
  std::uint16_t bits;
};
/// @brief OCP fp8 E4M3 ("FN": no infinity, NaN = S.1111.111, max 448).
struct alignas(1) float8_e4m3_t {
  std::uint8_t bits;
};
/// @brief OCP fp8 E5M2 (IEEE-like specials, max finite 57344).
struct alignas(1) float8_e5m2_t {
  std::uint8_t bits;
};

/// @brief Runtime tag of an element type.
enum class dtype : std::uint8_t { float32, float16, bfloat16, float8_e4m3, float8_e5m2 };

/// @brief Size of one element of `t` in bytes.
INFERSCALE_HOST_DEVICE constexpr std::size_t size_of(dtype t) noexcept
{
  switch (t) {
    case dtype::float32: return 4;
    case dtype::float16:
    case dtype::bfloat16: return 2;
    case dtype::float8_e4m3:
    case dtype::float8_e5m2: return 1;
  }
  return 0;
}

/// @brief Human-readable name of `t` ("float32", "bfloat16", ...).
inline char const* to_string(dtype t) noexcept
{
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::float16: return "float16";
    case dtype::bfloat16: return "bfloat16";
    case dtype::float8_e4m3: return "float8_e4m3";
    case dtype::float8_e5m2: return "float8_e5m2";
  }
  return "unknown dtype";
}

/// @brief Maps an element type to its runtime tag (`dtype_of_v<bfloat16_t> == dtype::bfloat16`).
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<dtype, dtype::float32> {
};
template <>
struct dtype_of<half_t> : std::integral_constant<dtype, dtype::float16> {
};
template <>
struct dtype_of<bfloat16_t> : std::integral_constant<dtype, dtype::bfloat16> {
};
template <>
struct dtype_of<float8_e4m3_t> : std::integral_constant<dtype, dtype::float8_e4m3> {
};
template <>
struct dtype_of<float8_e5m2_t> : std::integral_constant<dtype, dtype::float8_e5m2> {
};
template <class T>
inline constexpr dtype dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

/// @brief True for the element types InferScale stores and converts.
template <class T>
inline constexpr bool is_element_type_v =
  std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, half_t> ||
  std::is_same_v<std::remove_cv_t<T>, bfloat16_t> ||
  std::is_same_v<std::remove_cv_t<T>, float8_e4m3_t> ||
  std::is_same_v<std::remove_cv_t<T>, float8_e5m2_t>;

/// @brief Widens any element to fp32 (exact).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float to_float(float x) noexcept { return x; }

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float to_float(half_t x) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __half2float(__ushort_as_half(x.bits));
#else
  return detail::half_bits_to_float(x.bits);
#endif
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float to_float(bfloat16_t x) noexcept
{
  return detail::bfloat16_bits_to_float(x.bits);
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float to_float(float8_e4m3_t x) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __half2float(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3));
#else
  return detail::narrow_to_float<detail::e4m3_format>(x.bits);
#endif
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float to_float(float8_e5m2_t x) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __half2float(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E5M2));
#else
  return detail::narrow_to_float<detail::e5m2_format>(x.bits);
#endif
}

/**
 * @brief Rounds an fp32 value to element type `T` (round to nearest even; see the file comment
 * for overflow and NaN).
 */
template <class T>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE T from_float(float x) noexcept
{
  static_assert(is_element_type_v<T>, "from_float: T must be an InferScale element type");
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, half_t>) {
#if INFERSCALE_IS_DEVICE_CODE
    return half_t{__half_as_ushort(__float2half_rn(x))};
#else
    return half_t{detail::float_to_half_bits(x)};
#endif
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
#if INFERSCALE_IS_DEVICE_CODE
    return bfloat16_t{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
#else
    return bfloat16_t{detail::float_to_bfloat16_bits(x)};
#endif
  } else if constexpr (std::is_same_v<T, float8_e4m3_t>) {
#if INFERSCALE_IS_DEVICE_CODE
    return float8_e4m3_t{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)};
#else
    return float8_e4m3_t{
      static_cast<std::uint8_t>(detail::float_to_narrow<detail::e4m3_format>(x))};
#endif
  } else {
#if INFERSCALE_IS_DEVICE_CODE
    return float8_e5m2_t{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)};
#else
    return float8_e5m2_t{
      static_cast<std::uint8_t>(detail::float_to_narrow<detail::e5m2_format>(x))};
#endif
  }
}

/// @brief Largest finite value of element type `T`.
template <class T>
constexpr float max_finite() noexcept
{
  if constexpr (std::is_same_v<T, float>) {
    return 3.40282346638528859812e+38f;
  } else if constexpr (std::is_same_v<T, half_t>) {
    return 65504.0f;
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return 3.38953138925153547590e+38f;
  } else if constexpr (std::is_same_v<T, float8_e4m3_t>) {
    return 448.0f;
  } else {
    return 57344.0f;
  }
}

/// @brief Number of explicit mantissa bits of `T` (the unit roundoff is 2^-(bits+1)).
template <class T>
constexpr int mantissa_bits() noexcept
{
  if constexpr (std::is_same_v<T, float>) {
    return 23;
  } else if constexpr (std::is_same_v<T, half_t>) {
    return 10;
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return 7;
  } else if constexpr (std::is_same_v<T, float8_e4m3_t>) {
    return 3;
  } else {
    return 2;
  }
}

/// @brief An empty tag carrying a type, handed to the functor of dispatch_dtype.
template <class T>
struct type_tag {
  using type = T;
};

/**
 * @brief Calls `f(type_tag<T>{})` with the element type named by `t` and returns its result.
 * @throw logic_error if `t` is not a valid dtype.
 */
template <class F>
decltype(auto) dispatch_dtype(dtype t, F&& f)
{
  switch (t) {
    case dtype::float32: return f(type_tag<float>{});
    case dtype::float16: return f(type_tag<half_t>{});
    case dtype::bfloat16: return f(type_tag<bfloat16_t>{});
    case dtype::float8_e4m3: return f(type_tag<float8_e4m3_t>{});
    case dtype::float8_e5m2: return f(type_tag<float8_e5m2_t>{});
  }
  INFERSCALE_FAIL("dispatch_dtype: unknown dtype value " + std::to_string(static_cast<int>(t)));
}

}  // namespace inferscale
