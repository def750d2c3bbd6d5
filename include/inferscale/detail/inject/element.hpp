/**
 * @file detail/inject/element.hpp
 * @brief Per-element math of injection and extraction, shared by the host backend and the kernels:
 * rotate a key pair to its virtual position, scale and convert to the cache dtype; and the inverse.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/config.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/rope.hpp>

#include <type_traits>

namespace inferscale::detail {

/// @brief The stored value of real value `x` in a cache whose scale is `scale` (engines.md §9).
template <class CacheT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE CacheT quantize(float x,
                                                              float scale,
                                                              kv_scale_convention convention)
{
  // Exact division, not x * (1/scale): vLLM's and SGLang's writers divide.
  float const v = convention == kv_scale_convention::divide ? div_rn(x, scale) : mul_rn(x, scale);
  return from_float<CacheT>(v);
}

/// @brief The real value of stored value `q` (the inverse of quantize up to its rounding).
template <class CacheT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float dequantize(CacheT q,
                                                               float scale,
                                                               kv_scale_convention convention)
{
  float const v = to_float(q);
  return convention == kv_scale_convention::divide ? mul_rn(v, scale) : div_rn(v, scale);
}

/**
 * @brief A stored element as the cache holds it: unchanged bits when the dtypes match and the cache
 * has no scale; otherwise widened, scaled if `scaled`, and rounded to the cache dtype.
 */
template <class CacheT, class StoreT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE CacheT
convert_stored(StoreT s, bool scaled, float scale, kv_scale_convention convention)
{
  if constexpr (std::is_same_v<StoreT, CacheT>) {
    if (!scaled) { return s; }
  }
  return scaled ? quantize<CacheT>(to_float(s), scale, convention)
                : from_float<CacheT>(to_float(s));
}

/// @brief A rotated fp32 key element as the cache holds it: scaled if `scaled`, then rounded.
template <class CacheT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE CacheT
convert_rotated(float x, bool scaled, float scale, kv_scale_convention convention)
{
  return scaled ? quantize<CacheT>(x, scale, convention) : from_float<CacheT>(x);
}

/// @brief fp32 rotation of one pair: `(x c - y s, y c + x s)`, each product and sum rounded once.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rotate_fp32(
  float x, float y, rope_cos_sin cs, float* out_x, float* out_y)
{
  *out_x = add_rn(mul_rn(x, cs.cos), -mul_rn(y, cs.sin));
  *out_y = add_rn(mul_rn(y, cs.cos), mul_rn(x, cs.sin));
}

/// @brief fp32 rotation of one pair with two fused multiply-adds: `(fma(x, c, -(y s)),
/// fma(x, s, y c))` (rope_cos_sin_table::fused_multiply_add, llama.cpp's CPU rope).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rotate_fp32_fused(
  float x, float y, rope_cos_sin cs, float* out_x, float* out_y)
{
  *out_x = fma_rn(x, cs.cos, -mul_rn(y, cs.sin));
  *out_y = fma_rn(x, cs.sin, mul_rn(y, cs.cos));
}

/**
 * @brief Rotates one stored key pair `(x, y)` by `cs` (forward rotation to the virtual position)
 * and returns the rotated pair in fp32.
 *
 * In fp32 (each product and sum rounded once, no FMA, so host and device agree bit for bit), or,
 * when `round_each` (an engine table read by vLLM's 16-bit kernel), with cos, sin, products and
 * sums rounded to the store dtype, which is the model dtype the engine rotates in.
 */
template <class StoreT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rotate_stored_pair(
  StoreT x, StoreT y, rope_cos_sin cs, bool round_each, float* out_x, float* out_y)
{
  if constexpr (!std::is_same_v<StoreT, float>) {
    if (round_each) {
      rope_rotate_pair(x, y, cs, true);
      *out_x = to_float(x);
      *out_y = to_float(y);
      return;
    }
  }
  rotate_fp32(to_float(x), to_float(y), cs, out_x, out_y);
}

/// @brief As rotate_stored_pair, computed with fused multiply-adds when `fused`.
template <class StoreT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rotate_stored_pair(
  StoreT x, StoreT y, rope_cos_sin cs, bool round_each, bool fused, float* out_x, float* out_y)
{
  if (fused) {
    rotate_fp32_fused(to_float(x), to_float(y), cs, out_x, out_y);
  } else {
    rotate_stored_pair(x, y, cs, round_each, out_x, out_y);
  }
}

/// @brief Inverse rotation of a pair read from a cache (dequantized to fp32) by `cs` (from
/// rope_op::inverse), in fp32.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void unrotate_pair(
  float x, float y, rope_cos_sin cs, float* out_x, float* out_y)
{
  rotate_fp32(x, y, cs, out_x, out_y);
}

/// @brief Adds one to a device-side error counter (atomically; nothing when it is null).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void count_device_error(unsigned long long* counter)
{
  if (counter == nullptr) { return; }
#if INFERSCALE_IS_DEVICE_CODE
  atomicAdd(counter, 1ull);
#else
  __atomic_fetch_add(counter, 1ull, __ATOMIC_RELAXED);  // the host emulation of the kernels
#endif
}

/// @brief True for an fp8 scale the kernels may apply: positive and finite (NaN fails both).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool scale_usable(float scale)
{
  return scale > 0.0f && scale <= 3.40282346638528859812e+38f;
}

/// @brief True if a slot can be written: not skipped (negative) and inside the cache.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool slot_in_cache(std::int64_t slot,
                                                                 std::int64_t num_slots)
{
  return slot >= 0 && slot < num_slots;
}

}  // namespace inferscale::detail
