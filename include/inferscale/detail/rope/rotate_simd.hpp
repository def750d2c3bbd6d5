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
#include <inferscale/detail/rope/sincos.hpp>

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

/// @brief `x`, hidden from the optimiser (double lanes; see opaque).
INFERSCALE_TARGET_AVX2 inline __m256d opaque_pd(__m256d x)
{
  asm("" : "+x"(x));
  return x;
}

/// @brief `a * b`, rounded on its own (never contracted with the addition it feeds).
INFERSCALE_TARGET_AVX2 inline __m256d mul_pd(__m256d a, __m256d b)
{
  return opaque_pd(_mm256_mul_pd(a, b));
}

/**
 * @brief detail::rope_sincos of eight fp32 angles, four double lanes at a time: the same
 * operations in the same order, so the same bits. Returns false (nothing written) when a lane
 * needs the integer reduction or is not finite; the caller then takes the scalar function.
 */
INFERSCALE_TARGET_AVX2 inline bool sincos8(__m256 angle, float* s_out, float* c_out)
{
  namespace k            = detail::sincos;
  __m256 const magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), angle);
  // |angle| < 2^28, false for NaN (an ordered compare)
  __m256 const small = _mm256_cmp_ps(magnitude, _mm256_set1_ps(0x1p28f), _CMP_LT_OQ);
  if (_mm256_movemask_ps(small) != 0xff) { return false; }
  __m128 const halves[2] = {_mm256_castps256_ps128(angle), _mm256_extractf128_ps(angle, 1)};
  for (int h = 0; h < 2; ++h) {
    __m256d const signed_x = _mm256_cvtps_pd(halves[h]);
    __m256d const sign     = _mm256_and_pd(signed_x, _mm256_set1_pd(-0.0));
    __m256d const x        = _mm256_andnot_pd(_mm256_set1_pd(-0.0), signed_x);
    __m256d const q        = _mm256_round_pd(mul_pd(x, _mm256_set1_pd(k::two_over_pi)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r              = _mm256_fnmadd_pd(q, _mm256_set1_pd(k::pio2_1), x);
    r                      = _mm256_fnmadd_pd(q, _mm256_set1_pd(k::pio2_2), r);
    r                      = _mm256_fnmadd_pd(q, _mm256_set1_pd(k::pio2_3), r);
    r                      = _mm256_fnmadd_pd(q, _mm256_set1_pd(k::pio2_4), r);
    r                      = _mm256_fnmadd_pd(q, _mm256_set1_pd(k::pio2_5), r);
    __m256d const z        = mul_pd(r, r);
    __m256d ps             = _mm256_set1_pd(k::s7);
    ps                     = _mm256_fmadd_pd(z, ps, _mm256_set1_pd(k::s6));
    ps                     = _mm256_fmadd_pd(z, ps, _mm256_set1_pd(k::s5));
    ps                     = _mm256_fmadd_pd(z, ps, _mm256_set1_pd(k::s4));
    ps                     = _mm256_fmadd_pd(z, ps, _mm256_set1_pd(k::s3));
    ps                     = _mm256_fmadd_pd(z, ps, _mm256_set1_pd(k::s2));
    ps                     = _mm256_fmadd_pd(z, ps, _mm256_set1_pd(k::s1));
    __m256d const sr       = _mm256_fmadd_pd(mul_pd(r, z), ps, r);
    __m256d pc             = _mm256_set1_pd(k::c8);
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c7));
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c6));
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c5));
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c4));
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c3));
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c2));
    pc                     = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(k::c1));
    __m256d const cr       = _mm256_fmadd_pd(z, pc, _mm256_set1_pd(1.0));
    // quadrant bits as 64-bit lane masks: odd swaps sin and cos; sin negates in quadrants 2, 3
    // (and for a negative angle), cos in 1, 2
    __m256i const qi   = _mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(q));
    __m256i const one  = _mm256_set1_epi64x(1);
    __m256i const two  = _mm256_set1_epi64x(2);
    __m256d const swap = _mm256_castsi256_pd(_mm256_cmpeq_epi64(_mm256_and_si256(qi, one), one));
    __m256i const sneg = _mm256_slli_epi64(_mm256_and_si256(qi, two), 62);
    __m256i const cneg = _mm256_slli_epi64(_mm256_and_si256(_mm256_add_epi64(qi, one), two), 62);
    __m256d const sq   = _mm256_blendv_pd(sr, cr, swap);
    __m256d const cq   = _mm256_blendv_pd(cr, sr, swap);
    _mm_storeu_ps(
      s_out + 4 * h,
      _mm256_cvtpd_ps(_mm256_xor_pd(_mm256_xor_pd(sq, sign), _mm256_castsi256_pd(sneg))));
    _mm_storeu_ps(c_out + 4 * h, _mm256_cvtpd_ps(_mm256_xor_pd(cq, _mm256_castsi256_pd(cneg))));
  }
  return true;
}

/// @brief sincos8 of eight angles in memory (callable from code built without AVX2).
INFERSCALE_TARGET_AVX2 inline bool sincos8(float const* angle, float* s_out, float* c_out)
{
  return sincos8(_mm256_loadu_ps(angle), s_out, c_out);
}

/// @brief sincos8 of `float(position) * inv_freq[0..7]` (the fp32 angle of eight pairs).
INFERSCALE_TARGET_AVX2 inline bool sincos8_at(float position,
                                              float const* inv_freq,
                                              float* s_out,
                                              float* c_out)
{
  return sincos8(_mm256_mul_ps(_mm256_set1_ps(position), _mm256_loadu_ps(inv_freq)), s_out, c_out);
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

/// @brief `x`, hidden from the optimiser (double lanes).
INFERSCALE_TARGET_AVX512 inline __m512d opaque_pd(__m512d x)
{
  asm("" : "+v"(x));
  return x;
}

/// @brief `a * b`, rounded on its own.
INFERSCALE_TARGET_AVX512 inline __m512d mul_pd(__m512d a, __m512d b)
{
  return opaque_pd(_mm512_mul_pd(a, b));
}

/**
 * @brief simd::sincos8's operations on `8 V` fp32 angles (`angle[0 .. V/2)`, sixteen each), as
 * V vectors of eight double lanes advanced in lockstep: step by step over all V vectors, so that
 * the V independent dependency chains (the reduction's five multiply-adds, the two Horner chains
 * of seven and eight) overlap instead of waiting on each other. Same operations per lane, so the
 * same bits as detail::rope_sincos. Returns false (nothing written) when a lane needs the integer
 * reduction or is not finite.
 */
template <int V>
INFERSCALE_TARGET_AVX512 inline bool sincos_lockstep(__m512 const* angle,
                                                     float* s_out,
                                                     float* c_out)
{
  static_assert(V == 2 || V == 4 || V == 8, "V: 2, 4 or 8 vectors of eight double lanes");
  namespace k        = detail::sincos;
  __mmask16 in_range = 0xffff;
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V / 2; ++v) {  // |angle| < 2^28, false for NaN (an ordered compare)
    in_range &= _mm512_cmp_ps_mask(_mm512_abs_ps(angle[v]), _mm512_set1_ps(0x1p28f), _CMP_LT_OQ);
  }
  if (in_range != 0xffff) { return false; }
  __m512i const sign = _mm512_set1_epi64(static_cast<long long>(0x8000000000000000ull));
  __m512d x[V], q[V], r[V], z[V], ps[V], pc[V];
  __mmask8 minus[V];
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V; ++v) {
    __m256 const half =
      v % 2 == 0 ? _mm512_castps512_ps256(angle[v / 2])
                 : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(angle[v / 2]), 1));
    __m512i const signed_x = _mm512_castpd_si512(_mm512_cvtps_pd(half));
    minus[v]               = _mm512_test_epi64_mask(signed_x, sign);
    x[v]                   = _mm512_castsi512_pd(_mm512_andnot_si512(sign, signed_x));
    q[v]                   = _mm512_roundscale_pd(mul_pd(x[v], _mm512_set1_pd(k::two_over_pi)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  double const pio2[5] = {k::pio2_1, k::pio2_2, k::pio2_3, k::pio2_4, k::pio2_5};
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V; ++v) {
    r[v] = _mm512_fnmadd_pd(q[v], _mm512_set1_pd(pio2[0]), x[v]);
  }
  INFERSCALE_HOST_UNROLL
  for (int i = 1; i < 5; ++i) {
    INFERSCALE_HOST_UNROLL
    for (int v = 0; v < V; ++v) {
      r[v] = _mm512_fnmadd_pd(q[v], _mm512_set1_pd(pio2[i]), r[v]);
    }
  }
  // Horner: sin r = r + r z (s1 + z (s2 + ... z s7)), cos r = 1 + z (c1 + z (c2 + ... z c8))
  double const sc[7] = {k::s7, k::s6, k::s5, k::s4, k::s3, k::s2, k::s1};
  double const cc[8] = {k::c8, k::c7, k::c6, k::c5, k::c4, k::c3, k::c2, k::c1};
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V; ++v) {
    z[v]  = mul_pd(r[v], r[v]);
    ps[v] = _mm512_set1_pd(sc[0]);
    pc[v] = _mm512_set1_pd(cc[0]);
  }
  INFERSCALE_HOST_UNROLL
  for (int i = 1; i < 8; ++i) {
    INFERSCALE_HOST_UNROLL
    for (int v = 0; v < V; ++v) {
      if (i < 7) { ps[v] = _mm512_fmadd_pd(z[v], ps[v], _mm512_set1_pd(sc[i])); }
      pc[v] = _mm512_fmadd_pd(z[v], pc[v], _mm512_set1_pd(cc[i]));
    }
  }
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V; ++v) {
    __m512d const sr = _mm512_fmadd_pd(mul_pd(r[v], z[v]), ps[v], r[v]);
    __m512d const cr = _mm512_fmadd_pd(z[v], pc[v], _mm512_set1_pd(1.0));
    // quadrant bits as lane masks: odd swaps sin and cos; sin negates in quadrants 2 and 3 (and
    // for a negative angle), cos in 1 and 2 (a sign flip, as the scalar code's negation)
    __m512i const qi    = _mm512_cvtepi32_epi64(_mm512_cvtpd_epi32(q[v]));  // exact: |q| < 2^28
    __m512i const one   = _mm512_set1_epi64(1);
    __m512i const two   = _mm512_set1_epi64(2);
    __mmask8 const swap = _mm512_test_epi64_mask(qi, one);
    __mmask8 const sneg = static_cast<__mmask8>(_mm512_test_epi64_mask(qi, two) ^ minus[v]);
    __mmask8 const cneg = _mm512_test_epi64_mask(_mm512_add_epi64(qi, one), two);
    __m512i const sq    = _mm512_castpd_si512(_mm512_mask_blend_pd(swap, sr, cr));
    __m512i const cq    = _mm512_castpd_si512(_mm512_mask_blend_pd(swap, cr, sr));
    _mm256_storeu_ps(
      s_out + 8 * v,
      _mm512_cvtpd_ps(_mm512_castsi512_pd(_mm512_mask_xor_epi64(sq, sneg, sq, sign))));
    _mm256_storeu_ps(
      c_out + 8 * v,
      _mm512_cvtpd_ps(_mm512_castsi512_pd(_mm512_mask_xor_epi64(cq, cneg, cq, sign))));
  }
  return true;
}

/// @brief As simd::sincos8, sixteen angles, eight double lanes at a time (sincos_lockstep<2>).
INFERSCALE_TARGET_AVX512 inline bool sincos16(__m512 angle, float* s_out, float* c_out)
{
  return sincos_lockstep<2>(&angle, s_out, c_out);
}

/// @brief sincos_lockstep of `8 V` angles in memory.
template <int V>
INFERSCALE_TARGET_AVX512 inline bool sincos_lockstep(float const* angle, float* s_out, float* c_out)
{
  __m512 a[V / 2];
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V / 2; ++v) {
    a[v] = _mm512_loadu_ps(angle + 16 * v);
  }
  return sincos_lockstep<V>(a, s_out, c_out);
}

/// @brief sincos16 of sixteen angles in memory.
INFERSCALE_TARGET_AVX512 inline bool sincos16(float const* angle, float* s_out, float* c_out)
{
  return sincos_lockstep<2>(angle, s_out, c_out);
}

/// @brief sincos_lockstep<V> of `position * inv_freq[0 .. 8 V)` (fp32 products).
template <int V>
INFERSCALE_TARGET_AVX512 inline bool sincos_lockstep_at(__m512 position,
                                                        float const* inv_freq,
                                                        float* s_out,
                                                        float* c_out)
{
  __m512 angle[V / 2];
  INFERSCALE_HOST_UNROLL
  for (int v = 0; v < V / 2; ++v) {
    angle[v] = _mm512_mul_ps(position, _mm512_loadu_ps(inv_freq + 16 * v));
  }
  return sincos_lockstep<V>(angle, s_out, c_out);
}

/**
 * @brief sin and cos of `float(position) * inv_freq[i]` for the leading pairs of a row of `n`:
 * 64, 32 or 16 angles at a time in lockstep (sincos_lockstep), stopping at the first group with a
 * lane sincos_lockstep refuses. Returns how many leading pairs it wrote (a multiple of 16); the
 * caller computes the rest.
 */
INFERSCALE_TARGET_AVX512 inline std::int32_t sincos_row_at(
  float position, float const* inv_freq, std::int32_t n, float* s_out, float* c_out)
{
  __m512 const p    = _mm512_set1_ps(position);
  std::int32_t done = 0;
  while (done + 64 <= n && sincos_lockstep_at<8>(p, inv_freq + done, s_out + done, c_out + done)) {
    done += 64;
  }
  if (done + 32 <= n && sincos_lockstep_at<4>(p, inv_freq + done, s_out + done, c_out + done)) {
    done += 32;
  }
  while (done + 16 <= n && sincos_lockstep_at<2>(p, inv_freq + done, s_out + done, c_out + done)) {
    done += 16;
  }
  return done;
}

}  // namespace inferscale::detail::simd512

namespace inferscale::detail::simd512bf16 {

using simd::rotate_mode;

/// @brief The values sixteen fp32 lanes take in bf16 (native rounding; see fp32_to_bf16).
INFERSCALE_TARGET_AVX512_BF16 inline __m512 round_to_bf16(__m512 v)
{
  return bf16_codes_to_fp32(fp32_to_bf16(v));
}

/**
 * @brief vLLM's per-operation rounding of sixteen bf16 pairs, each rounding native
 * (fp32_to_bf16): the scalar code's `round(round(x c) - round(y s))` and
 * `round(round(y c) + round(x s))`, with `c` and `s` already bf16 values. The rotated pair is
 * returned as bf16 codes, ready to store.
 */
INFERSCALE_TARGET_AVX512_BF16 inline void rotate16_round_each(
  __m512 x, __m512 y, __m512 c, __m512 s, __m256i* out_x, __m256i* out_y)
{
  *out_x = fp32_to_bf16(
    _mm512_sub_ps(round_to_bf16(_mm512_mul_ps(x, c)), round_to_bf16(_mm512_mul_ps(y, s))));
  *out_y = fp32_to_bf16(
    _mm512_add_ps(round_to_bf16(_mm512_mul_ps(y, c)), round_to_bf16(_mm512_mul_ps(x, s))));
}

/// @brief Pairs of one token the native per-operation path takes (its bf16 cos/sin on the stack).
inline constexpr std::int32_t round_each_max_pairs = 256;

/// @brief The integer rounding (simd512::fp32_to_bf16) of two vectors as 32 codes `[low, high]`.
INFERSCALE_TARGET_AVX512_BF16 inline __m512i bf16_codes_low_high(__m512 low, __m512 high)
{
  return _mm512_inserti64x4(
    _mm512_castsi256_si512(simd512::fp32_to_bf16(low)), simd512::fp32_to_bf16(high), 1);
}

/**
 * @brief Two vectors rounded to bf16 as 32 codes `[low, high]`: one VCVTNE2PS2BF16, or the
 * integer rounding of both where a code is zero (which the conversion gives a subnormal).
 */
INFERSCALE_TARGET_AVX512_BF16 inline __m512i bf16x32_codes(__m512 low, __m512 high)
{
  __m512i const c = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
  return _mm512_testn_epi16_mask(c, _mm512_set1_epi16(0x7fff)) != 0 ? bf16_codes_low_high(low, high)
                                                                    : c;
}

/// @brief Sixteen of 32 bf16 codes widened to fp32: word 2 i + 1 <- code `back[2 i + 1]`, the
/// even words zeroed by `odd`.
INFERSCALE_TARGET_AVX512_BF16 inline __m512 bf16x32_widen(__mmask32 odd,
                                                          __m512i back,
                                                          __m512i codes)
{
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(odd, back, codes));
}

/**
 * @brief The rotation of every head of one token, 32 pairs a step, for bf16 keys whose half is a
 * multiple of 32 (at most round_each_max_pairs): the fp32 rotation (rotate16's products and sums)
 * or, with `RoundEach`, vLLM's per-operation rounding (rotate16_round_each's), so the same bits,
 * with fewer instructions around them.
 *  - 32 keys are widened by interleaving them with zero words (VPUNPCKLWD / VPUNPCKHWD): one
 *    instruction per 16 lanes instead of a widening and a shift. Lane i of the low vector holds
 *    key 8 (i / 4) + i % 4, of the high one key 8 (i / 4) + 4 + i % 4; the token's cos and sin
 *    are permuted into that order once per token.
 *  - The two result vectors are rounded by one VCVTNE2PS2BF16 and put back in order by one
 *    VPERMW. The conversion reads a subnormal as zero and gives a zero for nothing else but
 *    zeros (a normal fp32 value stays normal in bf16), so a step with a zero result takes the
 *    integer rounding for both vectors: one test of 32 codes instead of a subnormal test per
 *    16 lanes, and independent of the thread's denormals-are-zero mode (bf16x32_codes).
 *  - RoundEach: cos and sin rounded to bf16 once per token; each product (exact in fp32) rounded
 *    in pairs of vectors by bf16x32_codes and widened back by one masked VPERMW per vector.
 */
template <bool RoundEach>
INFERSCALE_TARGET_AVX512_BF16 inline void rotate_token_halves_bf16x32(bfloat16_t* token,
                                                                      std::int64_t heads,
                                                                      std::int64_t head_stride,
                                                                      std::int32_t half,
                                                                      float const* cos,
                                                                      float const* sin)
{
  // lane i of the low / high vector <- key 8 (i / 4) + i % 4 (+ 4), of a pair of 16-lane vectors
  __m512i const low_keys =
    _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  __m512i const high_keys = _mm512_add_epi32(low_keys, _mm512_set1_epi32(4));
  // key e <- code 4 (e / 8) + e % 8 of [low codes, high codes] (e % 8 < 4), 16 + 4 (e / 8) + e % 8
  // - 4 (else); and (RoundEach) the codes widened back to fp32 in their vector's own lane order:
  // word 2 i + 1 <- code i (low) or 16 + i (high), the even words zeroed by the mask
  alignas(64) std::int16_t order_codes[32], low_back[32], high_back[32];
  for (int e = 0; e < 32; ++e) {
    order_codes[e] =
      static_cast<std::int16_t>(e % 8 < 4 ? 4 * (e / 8) + e % 8 : 16 + 4 * (e / 8) + e % 8 - 4);
    low_back[e]  = static_cast<std::int16_t>(e / 2);
    high_back[e] = static_cast<std::int16_t>(16 + e / 2);
  }
  __m512i const order   = _mm512_load_si512(order_codes);
  __m512i const to_low  = _mm512_load_si512(low_back);
  __m512i const to_high = _mm512_load_si512(high_back);
  __mmask32 const odd   = 0xaaaaaaaau;
  __m512i const zero    = _mm512_setzero_si512();
  alignas(64) float table[4][round_each_max_pairs / 2];  // cos low, cos high, sin low, sin high
  for (std::int32_t p = 0; p < half; p += 32) {
    __m512 c0 = _mm512_loadu_ps(cos + p), c1 = _mm512_loadu_ps(cos + p + 16);
    __m512 s0 = _mm512_loadu_ps(sin + p), s1 = _mm512_loadu_ps(sin + p + 16);
    if constexpr (RoundEach) {  // vLLM rounds cos and sin to the key type: once per token here
      c0 = round_to_bf16(c0), c1 = round_to_bf16(c1);
      s0 = round_to_bf16(s0), s1 = round_to_bf16(s1);
    }
    _mm512_store_ps(table[0] + p / 2, _mm512_permutex2var_ps(c0, low_keys, c1));
    _mm512_store_ps(table[1] + p / 2, _mm512_permutex2var_ps(c0, high_keys, c1));
    _mm512_store_ps(table[2] + p / 2, _mm512_permutex2var_ps(s0, low_keys, s1));
    _mm512_store_ps(table[3] + p / 2, _mm512_permutex2var_ps(s0, high_keys, s1));
  }
  for (std::int64_t h = 0; h < heads; ++h) {
    bfloat16_t* const first  = token + h * head_stride;
    bfloat16_t* const second = first + half;
    for (std::int32_t p = 0; p < half; p += 32) {
      __m512i const xc  = _mm512_loadu_si512(first + p);
      __m512i const yc  = _mm512_loadu_si512(second + p);
      __m512 const x[2] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, xc)),
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, xc))};
      __m512 const y[2] = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, yc)),
                           _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, yc))};
      __m512 const c[2] = {_mm512_load_ps(table[0] + p / 2), _mm512_load_ps(table[1] + p / 2)};
      __m512 const s[2] = {_mm512_load_ps(table[2] + p / 2), _mm512_load_ps(table[3] + p / 2)};
      __m512 xo[2], yo[2];
      if constexpr (RoundEach) {
        // round(round(x c) - round(y s)), round(round(y c) + round(x s)); the products of two
        // bf16 values are exact in fp32, each rounded to bf16 once and widened back
        __m512i const xc_r    = bf16x32_codes(_mm512_mul_ps(x[0], c[0]), _mm512_mul_ps(x[1], c[1]));
        __m512i const ys_r    = bf16x32_codes(_mm512_mul_ps(y[0], s[0]), _mm512_mul_ps(y[1], s[1]));
        __m512i const yc_r    = bf16x32_codes(_mm512_mul_ps(y[0], c[0]), _mm512_mul_ps(y[1], c[1]));
        __m512i const xs_r    = bf16x32_codes(_mm512_mul_ps(x[0], s[0]), _mm512_mul_ps(x[1], s[1]));
        __m512i const back[2] = {to_low, to_high};
        for (int v = 0; v < 2; ++v) {
          xo[v] =
            _mm512_sub_ps(bf16x32_widen(odd, back[v], xc_r), bf16x32_widen(odd, back[v], ys_r));
          yo[v] =
            _mm512_add_ps(bf16x32_widen(odd, back[v], yc_r), bf16x32_widen(odd, back[v], xs_r));
        }
      } else {
        for (int v = 0; v < 2; ++v) {
          simd512::rotate16<rotate_mode::fp32, bfloat16_t>(x[v], y[v], c[v], s[v], &xo[v], &yo[v]);
        }
      }
      _mm512_storeu_si512(first + p, _mm512_permutexvar_epi16(order, bf16x32_codes(xo[0], xo[1])));
      _mm512_storeu_si512(second + p, _mm512_permutexvar_epi16(order, bf16x32_codes(yo[0], yo[1])));
    }
  }
}

/**
 * @brief As simd512::rotate_token_halves, with bf16 keys rounded by the native conversion
 * (simd512bf16::fp32_to_bf16; same bits): the fp32 rotation, and vLLM's per-operation rounding
 * (cos and sin rounded to bf16 once per token, then every product and sum). Other key types, the
 * fused rotation and more than round_each_max_pairs pairs run the avx512 form.
 */
template <rotate_mode Mode, class T>
INFERSCALE_TARGET_AVX512_BF16 void rotate_token_halves(T* token,
                                                       std::int64_t heads,
                                                       std::int64_t head_stride,
                                                       std::int32_t half,
                                                       float const* cos,
                                                       float const* sin)
{
  std::int32_t const whole = half - half % 16;
  if constexpr (!std::is_same_v<T, bfloat16_t> || Mode == rotate_mode::fused) {
    simd512::rotate_token_halves<Mode, T>(token, heads, head_stride, half, cos, sin);
  } else if constexpr (Mode == rotate_mode::round_each) {
    if (half % 32 == 0 && half <= round_each_max_pairs) {
      rotate_token_halves_bf16x32<true>(token, heads, head_stride, half, cos, sin);
      return;
    }
    if (whole != half || half > round_each_max_pairs) {
      simd512::rotate_token_halves<Mode, T>(token, heads, head_stride, half, cos, sin);
      return;
    }
    alignas(64) float cr[round_each_max_pairs];
    alignas(64) float sr[round_each_max_pairs];
    for (std::int32_t p = 0; p < half; p += 16) {
      _mm512_store_ps(cr + p, round_to_bf16(_mm512_loadu_ps(cos + p)));
      _mm512_store_ps(sr + p, round_to_bf16(_mm512_loadu_ps(sin + p)));
    }
    for (std::int64_t h = 0; h < heads; ++h) {
      T* const first  = token + h * head_stride;
      T* const second = first + half;
      for (std::int32_t p = 0; p < half; p += 16) {
        __m256i x, y;
        rotate16_round_each(simd512::load16(first + p),
                            simd512::load16(second + p),
                            _mm512_load_ps(cr + p),
                            _mm512_load_ps(sr + p),
                            &x,
                            &y);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(first + p), x);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(second + p), y);
      }
    }
  } else {
    if (half % 32 == 0 && half <= round_each_max_pairs) {
      rotate_token_halves_bf16x32<false>(token, heads, head_stride, half, cos, sin);
      return;
    }
    for (std::int64_t h = 0; h < heads; ++h) {
      T* const first  = token + h * head_stride;
      T* const second = first + half;
      for (std::int32_t p = 0; p < whole; p += 16) {
        __m512 x, y;
        simd512::rotate16<Mode, T>(simd512::load16(first + p),
                                   simd512::load16(second + p),
                                   _mm512_loadu_ps(cos + p),
                                   _mm512_loadu_ps(sin + p),
                                   &x,
                                   &y);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(first + p), fp32_to_bf16(x));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(second + p), fp32_to_bf16(y));
      }
      if (whole < half) {
        std::int32_t const n = half - whole;
        __m512 x, y;
        simd512::rotate16<Mode, T>(simd512::load_n(first + whole, n),
                                   simd512::load_n(second + whole, n),
                                   simd512::load_n(cos + whole, n),
                                   simd512::load_n(sin + whole, n),
                                   &x,
                                   &y);
        simd512::store_n(first + whole, x, n);
        simd512::store_n(second + whole, y, n);
      }
    }
  }
}

}  // namespace inferscale::detail::simd512bf16

#endif  // INFERSCALE_HOST_X86_SIMD
