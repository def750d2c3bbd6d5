/**
 * @file detail/rope/rotate_simd.hpp
 * @brief Host vector rotation of key pairs (AVX2 eight pairs at a time, AVX-512F sixteen) for the
 * host backend's
 * rope and injection loops: the same operations in the same order as the scalar code
 * (rope_rotate_pair, rope_rotate_pair_fused, detail::rotate_fp32), so the bits are the same.
 *
 * Only the halves pairing with contiguous dims is vectorised (pair i = elements i and i + half:
 * two plain loads); the callers keep their scalar loops for other layouts. cos and sin come as two
 * arrays (one entry per pair), computed once per token by the caller.
 */
#pragma once

#include <inferscale/detail/dtype/vector_conversion.hpp>

#include <cstdint>
#include <cstring>

namespace inferscale::detail::simd {

/// @brief How a pair is rotated (the scalar code's three variants).
enum class rotate_mode : std::uint8_t {
  fp32,        ///< `(x c - y s, y c + x s)`, each product and sum rounded once (rotate_fp32)
  round_each,  ///< cos, sin, every product and sum rounded to the key dtype (vLLM's 16-bit kernel)
  fused        ///< `(fma(x, c, -(y s)), fma(x, s, y c))` (llama.cpp's CPU rope)
};

}  // namespace inferscale::detail::simd

#if INFERSCALE_HOST_X86_SIMD

namespace inferscale::detail::simd {

/// @brief Loads `n` (1..8) elements of `T` as fp32; the missing lanes read as zero.
template <class T>
INFERSCALE_TARGET_AVX2 inline __m256 load_n(T const* p, std::int32_t n)
{
  if (n == 8) { return load8(p); }
  T tmp[8]{};
  std::memcpy(tmp, p, static_cast<std::size_t>(n) * sizeof(T));
  return load8(tmp);
}

/// @brief Rounds fp32 lanes to `T` and stores the first `n` (1..8).
template <class T>
INFERSCALE_TARGET_AVX2 inline void store_n(T* p, __m256 x, std::int32_t n)
{
  if (n == 8) {
    store8(p, x);
    return;
  }
  T tmp[8];
  store8(tmp, x);
  std::memcpy(p, tmp, static_cast<std::size_t>(n) * sizeof(T));
}

/**
 * @brief Rotates eight pairs `(x, y)` by `(c, s)` as `Mode` says; with round_each the results are
 * values of `T` (the scalar code's `to_float(from_float<T>(...))`).
 */
template <rotate_mode Mode, class T>
INFERSCALE_TARGET_AVX2 inline void rotate8(
  __m256 x, __m256 y, __m256 c, __m256 s, __m256* out_x, __m256* out_y)
{
  if constexpr (Mode == rotate_mode::fused) {
    *out_x = _mm256_fmsub_ps(x, c, _mm256_mul_ps(y, s));  // fma(x, c, -(y s))
    *out_y = _mm256_fmadd_ps(x, s, _mm256_mul_ps(y, c));  // fma(x, s, y c)
  } else if constexpr (Mode == rotate_mode::round_each) {
    __m256 const cr = round_to<T>(c);
    __m256 const sr = round_to<T>(s);
    *out_x          = round_to<T>(
      _mm256_sub_ps(round_to<T>(_mm256_mul_ps(x, cr)), round_to<T>(_mm256_mul_ps(y, sr))));
    *out_y = round_to<T>(
      _mm256_add_ps(round_to<T>(_mm256_mul_ps(y, cr)), round_to<T>(_mm256_mul_ps(x, sr))));
  } else {
    // opaque: each product is rounded on its own (no contraction into an FMA).
    *out_x = _mm256_sub_ps(opaque(_mm256_mul_ps(x, c)), opaque(_mm256_mul_ps(y, s)));
    *out_y = _mm256_add_ps(opaque(_mm256_mul_ps(y, c)), opaque(_mm256_mul_ps(x, s)));
  }
}

/**
 * @brief Rotates in place every head of one token (`heads` heads `head_stride` elements apart,
 * dims contiguous), halves pairing over the first `2 * half` dims: the vector form of
 * rope_apply_host's per-head loop.
 */
template <rotate_mode Mode, class T>
INFERSCALE_TARGET_AVX2 void rotate_token_halves(T* token,
                                                std::int64_t heads,
                                                std::int64_t head_stride,
                                                std::int32_t half,
                                                float const* cos,
                                                float const* sin)
{
  for (std::int64_t h = 0; h < heads; ++h) {
    T* const first  = token + h * head_stride;
    T* const second = first + half;
    for (std::int32_t p = 0; p < half; p += 8) {
      std::int32_t const n = half - p < 8 ? half - p : 8;
      __m256 x, y;
      rotate8<Mode, T>(load_n(first + p, n),
                       load_n(second + p, n),
                       load_n(cos + p, n),
                       load_n(sin + p, n),
                       &x,
                       &y);
      store_n(first + p, x, n);
      store_n(second + p, y, n);
    }
  }
}

}  // namespace inferscale::detail::simd


namespace inferscale::detail::simd512 {

using simd::rotate_mode;

/// @brief Loads `n` (1..16) elements of `T` as fp32; the missing lanes read as zero.
template <class T>
INFERSCALE_TARGET_AVX512 inline __m512 load_n(T const* p, std::int32_t n)
{
  if (n == 16) { return load16(p); }
  T tmp[16]{};
  std::memcpy(tmp, p, static_cast<std::size_t>(n) * sizeof(T));
  return load16(tmp);
}

/// @brief Rounds fp32 lanes to `T` and stores the first `n` (1..16).
template <class T>
INFERSCALE_TARGET_AVX512 inline void store_n(T* p, __m512 x, std::int32_t n)
{
  if (n == 16) {
    store16(p, x);
    return;
  }
  T tmp[16];
  store16(tmp, x);
  std::memcpy(p, tmp, static_cast<std::size_t>(n) * sizeof(T));
}

/// @brief As simd::rotate8, sixteen pairs.
template <rotate_mode Mode, class T>
INFERSCALE_TARGET_AVX512 inline void rotate16(
  __m512 x, __m512 y, __m512 c, __m512 s, __m512* out_x, __m512* out_y)
{
  if constexpr (Mode == rotate_mode::fused) {
    *out_x = _mm512_fmsub_ps(x, c, _mm512_mul_ps(y, s));
    *out_y = _mm512_fmadd_ps(x, s, _mm512_mul_ps(y, c));
  } else if constexpr (Mode == rotate_mode::round_each) {
    __m512 const cr = round_to<T>(c);
    __m512 const sr = round_to<T>(s);
    *out_x          = round_to<T>(
      _mm512_sub_ps(round_to<T>(_mm512_mul_ps(x, cr)), round_to<T>(_mm512_mul_ps(y, sr))));
    *out_y = round_to<T>(
      _mm512_add_ps(round_to<T>(_mm512_mul_ps(y, cr)), round_to<T>(_mm512_mul_ps(x, sr))));
  } else {
    *out_x = _mm512_sub_ps(opaque(_mm512_mul_ps(x, c)), opaque(_mm512_mul_ps(y, s)));
    *out_y = _mm512_add_ps(opaque(_mm512_mul_ps(y, c)), opaque(_mm512_mul_ps(x, s)));
  }
}

/// @brief As simd::rotate_token_halves, sixteen pairs at a time.
template <rotate_mode Mode, class T>
INFERSCALE_TARGET_AVX512 void rotate_token_halves(T* token,
                                                  std::int64_t heads,
                                                  std::int64_t head_stride,
                                                  std::int32_t half,
                                                  float const* cos,
                                                  float const* sin)
{
  for (std::int64_t h = 0; h < heads; ++h) {
    T* const first  = token + h * head_stride;
    T* const second = first + half;
    for (std::int32_t p = 0; p < half; p += 16) {
      std::int32_t const n = half - p < 16 ? half - p : 16;
      __m512 x, y;
      rotate16<Mode, T>(load_n(first + p, n),
                        load_n(second + p, n),
                        load_n(cos + p, n),
                        load_n(sin + p, n),
                        &x,
                        &y);
      store_n(first + p, x, n);
      store_n(second + p, y, n);
    }
  }
}

}  // namespace inferscale::detail::simd512

#endif  // INFERSCALE_HOST_X86_SIMD
