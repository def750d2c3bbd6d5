/**
 * @file detail/index/distance_simd.hpp
 * @brief The host's fast distances: a stored row (fp32 or fp16) against an fp32 query, in the
 * host's own summation order, with fused multiply-adds, eight lanes at a time with AVX2 + FMA
 * (F16C for fp16 rows) or sixteen with AVX-512F, chosen at run time.
 *
 * These are *not* the device's distances: `math.hpp`'s `team_distance` reproduces the device's
 * lane order bit for bit (the reference mode, `host_search_mode::reference`), which costs a
 * transposition per chunk and forbids fusing. The fast mode only promises the distance to within
 * rounding (every variant here sums the same products, in different orders, some fused), so
 * two CPUs may order near-ties differently; the tests bound the difference from a double
 * precision recomputation.
 *
 * Like `detail/dtype/vector_conversion.hpp`, a portable x86-64 build compiles the vector versions
 * with GCC target attributes and calls them only after `__builtin_cpu_supports`; everywhere else
 * (other compilers, other architectures, INFERSCALE_NO_HOST_SIMD) the portable loop runs, which
 * the compiler may vectorise for its own target (NEON on aarch64).
 */
#pragma once

#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/detail/index/math.hpp>
#include <inferscale/dtype.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace inferscale::detail::index {

/// @brief A fast distance: `(row, query, elements)`, elements a multiple of the row's chunk.
template <class T>
using fast_distance_fn = float (*)(T const*, float const*, std::int64_t) noexcept;

/// @brief The portable fast distance: sixteen partial sums (independent chains the compiler can
/// keep in vector registers), then a pairwise reduction. `L2` picks squared L2 over the dot.
template <class T, bool L2>
inline float fast_partial_sum(T const* x, float const* q, std::int64_t n) noexcept
{
  float acc[16]  = {};
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) {
      float const v = to_float(x[i + l]);
      if constexpr (L2) {
        float const d = v - q[i + l];
        acc[l] += d * d;
      } else {
        acc[l] += v * q[i + l];
      }
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    float const v = to_float(x[i]);
    if constexpr (L2) {
      float const d = v - q[i];
      acc[l] += d * d;
    } else {
      acc[l] += v * q[i];
    }
  }
  for (int w = 8; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) {
      acc[l] += acc[l + w];
    }
  }
  return acc[0];
}

/// @brief The metric's distance from the sum `fast_partial_sum` computes.
template <distance_metric M>
INFERSCALE_FORCEINLINE float fast_finish(float sum) noexcept
{
  if constexpr (M == distance_metric::inner_product) {
    return -sum;
  } else if constexpr (M == distance_metric::cosine) {
    return 1.0f - sum;
  } else {
    return sum;
  }
}

template <class T, distance_metric M>
inline float fast_distance_portable(T const* x, float const* q, std::int64_t n) noexcept
{
  return fast_finish<M>(fast_partial_sum<T, M == distance_metric::squared_l2>(x, q, n));
}

/**
 * @brief A fast scan: the distances of `count` consecutive rows (`row_elements` apart) to one
 * query, into `out[count]`. The vector versions take four rows at a time, so each query element
 * loaded from cache serves four rows (the loads, not the multiply-adds, bound a one-row loop).
 */
template <class T>
using fast_scan_fn = void (*)(T const*, std::int64_t, std::uint32_t, float const*, float*) noexcept;

template <class T, distance_metric M>
inline void fast_scan_portable(T const* rows,
                               std::int64_t row_elements,
                               std::uint32_t count,
                               float const* q,
                               float* out) noexcept
{
  for (std::uint32_t r = 0; r < count; ++r) {
    out[r] = fast_distance_portable<T, M>(rows + std::int64_t{r} * row_elements, q, row_elements);
  }
}

/**
 * @brief Asks the CPU to fetch the first `bytes` of a row (or of any span) into the caches, one
 * hint per 64-byte line; a hint never faults. The scans use it as their read-ahead: a scan reads
 * its rows as four interleaved streams of one row each (1.5 KiB at 384-d fp32), too short for
 * the hardware's stream prefetcher to run ahead of, so each step of a group of four rows asks for
 * its share of the next group (contiguous after it, past the scanned rows included).
 */
inline void prefetch_row(void const* row, std::size_t bytes) noexcept
{
#if defined(__GNUC__)
  auto const* p = static_cast<char const*>(row);
  for (std::size_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(p + b, 0, 3);
  }
#else
  (void)row;
  (void)bytes;
#endif
}

#if INFERSCALE_HOST_X86_SIMD

/// @brief Eight elements of a row as fp32 (fp16 through F16C).
template <class T>
INFERSCALE_TARGET_AVX2 INFERSCALE_FORCEINLINE __m256 fast_load8(T const* x) noexcept
{
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(x)));
  }
}

/// @brief The sum of a register's eight lanes.
INFERSCALE_TARGET_AVX2 INFERSCALE_FORCEINLINE float fast_hsum8(__m256 s) noexcept
{
  __m128 const h  = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  __m128 const h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

template <bool L2>
INFERSCALE_TARGET_AVX2 INFERSCALE_FORCEINLINE __m256 fast_step8(__m256 acc,
                                                                __m256 x,
                                                                __m256 q) noexcept
{
  if constexpr (L2) {
    __m256 const d = _mm256_sub_ps(x, q);
    return _mm256_fmadd_ps(d, d, acc);
  } else {
    return _mm256_fmadd_ps(x, q, acc);
  }
}

/// @brief AVX2 + FMA: four accumulators of eight lanes (32 elements per step), eights, then the
/// rest one by one (a padded row has a multiple of 4 fp32 or 8 fp16 elements).
template <class T, distance_metric M>
INFERSCALE_TARGET_AVX2 inline float fast_distance_avx2(T const* x,
                                                       float const* q,
                                                       std::int64_t n) noexcept
{
  constexpr bool l2 = M == distance_metric::squared_l2;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = fast_step8<l2>(a0, fast_load8(x + i), _mm256_loadu_ps(q + i));
    a1 = fast_step8<l2>(a1, fast_load8(x + i + 8), _mm256_loadu_ps(q + i + 8));
    a2 = fast_step8<l2>(a2, fast_load8(x + i + 16), _mm256_loadu_ps(q + i + 16));
    a3 = fast_step8<l2>(a3, fast_load8(x + i + 24), _mm256_loadu_ps(q + i + 24));
  }
  for (; i + 8 <= n; i += 8) {
    a0 = fast_step8<l2>(a0, fast_load8(x + i), _mm256_loadu_ps(q + i));
  }
  float sum = fast_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) {
    float const v = to_float(x[i]);
    if constexpr (l2) {
      float const d = v - q[i];
      sum += d * d;
    } else {
      sum += v * q[i];
    }
  }
  return fast_finish<M>(sum);
}

/// @brief AVX2 + FMA scan: four rows at a time, two accumulators each (eight independent
/// chains), each query load shared by the four rows; the rest of the rows one by one.
template <class T, distance_metric M>
INFERSCALE_TARGET_AVX2 inline void fast_scan_avx2(T const* rows,
                                                  std::int64_t row_elements,
                                                  std::uint32_t count,
                                                  float const* q,
                                                  float* out) noexcept
{
  constexpr bool l2 = M == distance_metric::squared_l2;
  std::uint32_t r   = 0;
  for (; r + 4 <= count; r += 4) {
    T const* x0 = rows + std::int64_t{r} * row_elements;
    T const* x1 = x0 + row_elements;
    T const* x2 = x1 + row_elements;
    T const* x3 = x2 + row_elements;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    __m256 b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
    T const* const next = x3 + row_elements;  // the next group of four rows
    std::int64_t i      = 0;
    for (; i + 16 <= row_elements; i += 16) {
      prefetch_row(next + 4 * i, 64 * sizeof(T));  // this step's share of the next group
      __m256 const qa = _mm256_loadu_ps(q + i);
      __m256 const qb = _mm256_loadu_ps(q + i + 8);
      a0              = fast_step8<l2>(a0, fast_load8(x0 + i), qa);
      a1              = fast_step8<l2>(a1, fast_load8(x1 + i), qa);
      a2              = fast_step8<l2>(a2, fast_load8(x2 + i), qa);
      a3              = fast_step8<l2>(a3, fast_load8(x3 + i), qa);
      b0              = fast_step8<l2>(b0, fast_load8(x0 + i + 8), qb);
      b1              = fast_step8<l2>(b1, fast_load8(x1 + i + 8), qb);
      b2              = fast_step8<l2>(b2, fast_load8(x2 + i + 8), qb);
      b3              = fast_step8<l2>(b3, fast_load8(x3 + i + 8), qb);
    }
    for (; i + 8 <= row_elements; i += 8) {
      __m256 const qa = _mm256_loadu_ps(q + i);
      a0              = fast_step8<l2>(a0, fast_load8(x0 + i), qa);
      a1              = fast_step8<l2>(a1, fast_load8(x1 + i), qa);
      a2              = fast_step8<l2>(a2, fast_load8(x2 + i), qa);
      a3              = fast_step8<l2>(a3, fast_load8(x3 + i), qa);
    }
    float sum[4]   = {fast_hsum8(_mm256_add_ps(a0, b0)),
                      fast_hsum8(_mm256_add_ps(a1, b1)),
                      fast_hsum8(_mm256_add_ps(a2, b2)),
                      fast_hsum8(_mm256_add_ps(a3, b3))};
    T const* xs[4] = {x0, x1, x2, x3};
    for (int j = 0; j < 4; ++j) {
      for (std::int64_t e = i; e < row_elements; ++e) {
        float const v = to_float(xs[j][e]);
        if constexpr (l2) {
          float const d = v - q[e];
          sum[j] += d * d;
        } else {
          sum[j] += v * q[e];
        }
      }
      out[r + j] = fast_finish<M>(sum[j]);
    }
  }
  for (; r < count; ++r) {
    out[r] = fast_distance_avx2<T, M>(rows + std::int64_t{r} * row_elements, q, row_elements);
  }
}

/// @brief Sixteen elements of a row as fp32, the lanes past `mask` zero.
template <class T>
INFERSCALE_TARGET_AVX512 INFERSCALE_FORCEINLINE __m512 fast_load16(T const* x,
                                                                   __mmask16 mask) noexcept
{
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else {
    // a masked 16-bit load needs AVX-512BW: copy the tail into zeros instead (once per row)
    alignas(32) std::uint16_t tail[16] = {};
    for (int l = 0; l < 16; ++l) {
      if ((mask >> l) & 1u) { std::memcpy(&tail[l], x + l, 2); }
    }
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<__m256i const*>(tail)));
  }
}

template <class T>
INFERSCALE_TARGET_AVX512 INFERSCALE_FORCEINLINE __m512 fast_load16(T const* x) noexcept
{
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(x)));
  }
}

template <bool L2>
INFERSCALE_TARGET_AVX512 INFERSCALE_FORCEINLINE __m512 fast_step16(__m512 acc,
                                                                   __m512 x,
                                                                   __m512 q) noexcept
{
  if constexpr (L2) {
    __m512 const d = _mm512_sub_ps(x, q);
    return _mm512_fmadd_ps(d, d, acc);
  } else {
    return _mm512_fmadd_ps(x, q, acc);
  }
}

/// @brief AVX-512F: four accumulators of sixteen lanes (64 elements per step), sixteens, then
/// one masked step for the rest.
template <class T, distance_metric M>
INFERSCALE_TARGET_AVX512 inline float fast_distance_avx512(T const* x,
                                                           float const* q,
                                                           std::int64_t n) noexcept
{
  constexpr bool l2 = M == distance_metric::squared_l2;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  std::int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = fast_step16<l2>(a0, fast_load16(x + i), _mm512_loadu_ps(q + i));
    a1 = fast_step16<l2>(a1, fast_load16(x + i + 16), _mm512_loadu_ps(q + i + 16));
    a2 = fast_step16<l2>(a2, fast_load16(x + i + 32), _mm512_loadu_ps(q + i + 32));
    a3 = fast_step16<l2>(a3, fast_load16(x + i + 48), _mm512_loadu_ps(q + i + 48));
  }
  for (; i + 16 <= n; i += 16) {
    a0 = fast_step16<l2>(a0, fast_load16(x + i), _mm512_loadu_ps(q + i));
  }
  if (i < n) {
    auto const mask = static_cast<__mmask16>((1u << (n - i)) - 1u);
    a1 = fast_step16<l2>(a1, fast_load16(x + i, mask), _mm512_maskz_loadu_ps(mask, q + i));
  }
  return fast_finish<M>(
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))));
}

/// @brief AVX-512F scan: four rows at a time, two accumulators each, each query load shared by
/// the four rows, one masked step for the tail; the rest of the rows one by one.
template <class T, distance_metric M>
INFERSCALE_TARGET_AVX512 inline void fast_scan_avx512(T const* rows,
                                                      std::int64_t row_elements,
                                                      std::uint32_t count,
                                                      float const* q,
                                                      float* out) noexcept
{
  constexpr bool l2 = M == distance_metric::squared_l2;
  std::uint32_t r   = 0;
  for (; r + 4 <= count; r += 4) {
    T const* x0 = rows + std::int64_t{r} * row_elements;
    T const* x1 = x0 + row_elements;
    T const* x2 = x1 + row_elements;
    T const* x3 = x2 + row_elements;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
    __m512 a3 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    __m512 b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
    T const* const next = x3 + row_elements;  // the next group of four rows
    std::int64_t i      = 0;
    for (; i + 32 <= row_elements; i += 32) {
      prefetch_row(next + 4 * i, 128 * sizeof(T));  // this step's share of the next group
      __m512 const qa = _mm512_loadu_ps(q + i);
      __m512 const qb = _mm512_loadu_ps(q + i + 16);
      a0              = fast_step16<l2>(a0, fast_load16(x0 + i), qa);
      a1              = fast_step16<l2>(a1, fast_load16(x1 + i), qa);
      a2              = fast_step16<l2>(a2, fast_load16(x2 + i), qa);
      a3              = fast_step16<l2>(a3, fast_load16(x3 + i), qa);
      b0              = fast_step16<l2>(b0, fast_load16(x0 + i + 16), qb);
      b1              = fast_step16<l2>(b1, fast_load16(x1 + i + 16), qb);
      b2              = fast_step16<l2>(b2, fast_load16(x2 + i + 16), qb);
      b3              = fast_step16<l2>(b3, fast_load16(x3 + i + 16), qb);
    }
    for (; i < row_elements; i += 16) {
      std::int64_t const left = row_elements - i;
      auto const mask =
        left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
      __m512 const qa = _mm512_maskz_loadu_ps(mask, q + i);
      a0              = fast_step16<l2>(a0, fast_load16(x0 + i, mask), qa);
      a1              = fast_step16<l2>(a1, fast_load16(x1 + i, mask), qa);
      a2              = fast_step16<l2>(a2, fast_load16(x2 + i, mask), qa);
      a3              = fast_step16<l2>(a3, fast_load16(x3 + i, mask), qa);
    }
    out[r]     = fast_finish<M>(_mm512_reduce_add_ps(_mm512_add_ps(a0, b0)));
    out[r + 1] = fast_finish<M>(_mm512_reduce_add_ps(_mm512_add_ps(a1, b1)));
    out[r + 2] = fast_finish<M>(_mm512_reduce_add_ps(_mm512_add_ps(a2, b2)));
    out[r + 3] = fast_finish<M>(_mm512_reduce_add_ps(_mm512_add_ps(a3, b3)));
  }
  for (; r < count; ++r) {
    out[r] = fast_distance_avx512<T, M>(rows + std::int64_t{r} * row_elements, q, row_elements);
  }
}

#endif  // INFERSCALE_HOST_X86_SIMD

/// @brief The fast scan for this metric and the widest instruction set in use.
template <class T, distance_metric M>
inline fast_scan_fn<T> fast_scan_for_metric() noexcept
{
#if INFERSCALE_HOST_X86_SIMD
  switch (active_host_simd()) {
    case host_simd::avx512:
    case host_simd::avx512_bf16: return &fast_scan_avx512<T, M>;
    case host_simd::avx2: return &fast_scan_avx2<T, M>;
    case host_simd::scalar: break;
  }
#endif
  return &fast_scan_portable<T, M>;
}

/// @brief `fast_scan_for_metric` for a metric known at run time.
template <class T>
inline fast_scan_fn<T> fast_scan_for(distance_metric m) noexcept
{
  switch (m) {
    case distance_metric::inner_product:
      return fast_scan_for_metric<T, distance_metric::inner_product>();
    case distance_metric::squared_l2: return fast_scan_for_metric<T, distance_metric::squared_l2>();
    case distance_metric::cosine: break;
  }
  return fast_scan_for_metric<T, distance_metric::cosine>();
}

/// @brief The fast distance for this metric and the widest instruction set in use
/// (`active_host_simd()`, capped by `set_host_simd_cap`).
template <class T, distance_metric M>
inline fast_distance_fn<T> fast_distance_for_metric() noexcept
{
#if INFERSCALE_HOST_X86_SIMD
  switch (active_host_simd()) {
    case host_simd::avx512:
    case host_simd::avx512_bf16: return &fast_distance_avx512<T, M>;
    case host_simd::avx2: return &fast_distance_avx2<T, M>;
    case host_simd::scalar: break;
  }
#endif
  return &fast_distance_portable<T, M>;
}

/// @brief `fast_distance_for_metric` for a metric known at run time.
template <class T>
inline fast_distance_fn<T> fast_distance_for(distance_metric m) noexcept
{
  switch (m) {
    case distance_metric::inner_product:
      return fast_distance_for_metric<T, distance_metric::inner_product>();
    case distance_metric::squared_l2:
      return fast_distance_for_metric<T, distance_metric::squared_l2>();
    case distance_metric::cosine: break;
  }
  return fast_distance_for_metric<T, distance_metric::cosine>();
}

/// @brief The fast kernels of one row type and metric (chosen once per search call).
template <class T>
struct fast_kernels {
  fast_distance_fn<T> distance;
  fast_scan_fn<T> scan;
};

template <class T>
inline fast_kernels<T> fast_kernels_for(distance_metric m) noexcept
{
  return {fast_distance_for<T>(m), fast_scan_for<T>(m)};
}

// ------------------------------------------------------------------------------------------------
// Block dot products (NN-descent's local join)

/**
 * @brief Dot products of `na` fp32 rows against `nb` (row pointers), `out[i * ld + j] = a[i] .
 * b[j]`, `n` elements each.
 *
 * Every pair is one chain of fused multiply-adds over the lanes, then a fixed halving reduction,
 * so a pair's value is the same bits whichever block computes it and in either order (`a . b`
 * and `b . a`): NN-descent's duplicate test relies on it. The blocks only share the loads: a
 * 4 x 4 block (AVX-512) loads each chunk of its eight rows once for sixteen products, where one
 * product at a time loads two chunks per multiply-add and, on rows in the L2, waits for them.
 */
using dot_block_fn = void (*)(float const* const*,
                              std::uint32_t,
                              float const* const*,
                              std::uint32_t,
                              std::int64_t,
                              float*,
                              std::size_t) noexcept;

/// @brief The portable block: one chain per pair, in element order.
inline void dot_block_portable(float const* const* a,
                               std::uint32_t na,
                               float const* const* b,
                               std::uint32_t nb,
                               std::int64_t n,
                               float* out,
                               std::size_t ld) noexcept
{
  for (std::uint32_t i = 0; i < na; ++i) {
    for (std::uint32_t j = 0; j < nb; ++j) {
      out[i * ld + j] = fast_partial_sum<float, false>(a[i], b[j], n);
    }
  }
}

#if INFERSCALE_HOST_X86_SIMD

/// @brief The AVX2 block: `A` x `B` chains of eight lanes, then fast_hsum8 each.
template <int A, int B>
INFERSCALE_TARGET_AVX2 INFERSCALE_FORCEINLINE void dot_tile8(
  float const* const* a, float const* const* b, std::int64_t n, float* out, std::size_t ld) noexcept
{
  __m256 acc[A][B];
  for (int r = 0; r < A; ++r) {
    for (int c = 0; c < B; ++c) {
      acc[r][c] = _mm256_setzero_ps();
    }
  }
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 va[A];
    for (int r = 0; r < A; ++r) {
      va[r] = _mm256_loadu_ps(a[r] + i);
    }
    for (int c = 0; c < B; ++c) {
      __m256 const vb = _mm256_loadu_ps(b[c] + i);
      for (int r = 0; r < A; ++r) {
        acc[r][c] = _mm256_fmadd_ps(va[r], vb, acc[r][c]);
      }
    }
  }
  if (i < n) {  // the tail as one more step on zero-filled lanes
    alignas(32) std::int32_t lanes[8];
    for (int l = 0; l < 8; ++l) {
      lanes[l] = i + l < n ? -1 : 0;
    }
    __m256i const mask = _mm256_load_si256(reinterpret_cast<__m256i const*>(lanes));
    __m256 va[A];
    for (int r = 0; r < A; ++r) {
      va[r] = _mm256_maskload_ps(a[r] + i, mask);
    }
    for (int c = 0; c < B; ++c) {
      __m256 const vb = _mm256_maskload_ps(b[c] + i, mask);
      for (int r = 0; r < A; ++r) {
        acc[r][c] = _mm256_fmadd_ps(va[r], vb, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < A; ++r) {
    for (int c = 0; c < B; ++c) {
      out[static_cast<std::size_t>(r) * ld + static_cast<std::size_t>(c)] = fast_hsum8(acc[r][c]);
    }
  }
}

/// @brief dot_block_fn for AVX2 + FMA: 2 x 4 blocks (eight accumulators of the sixteen
/// registers), the edges in smaller ones.
INFERSCALE_TARGET_AVX2 inline void dot_block_avx2(float const* const* a,
                                                  std::uint32_t na,
                                                  float const* const* b,
                                                  std::uint32_t nb,
                                                  std::int64_t n,
                                                  float* out,
                                                  std::size_t ld) noexcept
{
  std::uint32_t i = 0;
  for (; i + 2 <= na; i += 2) {
    std::uint32_t j = 0;
    for (; j + 4 <= nb; j += 4) {
      dot_tile8<2, 4>(a + i, b + j, n, out + i * ld + j, ld);
    }
    for (; j < nb; ++j) {
      dot_tile8<2, 1>(a + i, b + j, n, out + i * ld + j, ld);
    }
  }
  for (; i < na; ++i) {
    std::uint32_t j = 0;
    for (; j + 4 <= nb; j += 4) {
      dot_tile8<1, 4>(a + i, b + j, n, out + i * ld + j, ld);
    }
    for (; j < nb; ++j) {
      dot_tile8<1, 1>(a + i, b + j, n, out + i * ld + j, ld);
    }
  }
}

/// @brief The sum of sixteen lanes by halving: eight pairs (l, l + 8), then as fast_hsum8.
INFERSCALE_TARGET_AVX512 INFERSCALE_FORCEINLINE float halving_sum16(__m512 v) noexcept
{
  __m256 const lo = _mm512_castps512_ps256(v);
  __m256 const hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return fast_hsum8(_mm256_add_ps(lo, hi));
}

/// @brief The AVX-512 block: `A` x `B` chains of sixteen lanes, then halving_sum16 each.
template <int A, int B>
INFERSCALE_TARGET_AVX512 INFERSCALE_FORCEINLINE void dot_tile16(
  float const* const* a, float const* const* b, std::int64_t n, float* out, std::size_t ld) noexcept
{
  __m512 acc[A][B];
  for (int r = 0; r < A; ++r) {
    for (int c = 0; c < B; ++c) {
      acc[r][c] = _mm512_setzero_ps();
    }
  }
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 va[A];
    for (int r = 0; r < A; ++r) {
      va[r] = _mm512_loadu_ps(a[r] + i);
    }
    for (int c = 0; c < B; ++c) {
      __m512 const vb = _mm512_loadu_ps(b[c] + i);
      for (int r = 0; r < A; ++r) {
        acc[r][c] = _mm512_fmadd_ps(va[r], vb, acc[r][c]);
      }
    }
  }
  if (i < n) {  // the tail as one more step on zero-filled lanes
    auto const mask = static_cast<__mmask16>((1u << (n - i)) - 1u);
    __m512 va[A];
    for (int r = 0; r < A; ++r) {
      va[r] = _mm512_maskz_loadu_ps(mask, a[r] + i);
    }
    for (int c = 0; c < B; ++c) {
      __m512 const vb = _mm512_maskz_loadu_ps(mask, b[c] + i);
      for (int r = 0; r < A; ++r) {
        acc[r][c] = _mm512_fmadd_ps(va[r], vb, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < A; ++r) {
    for (int c = 0; c < B; ++c) {
      out[static_cast<std::size_t>(r) * ld + static_cast<std::size_t>(c)] =
        halving_sum16(acc[r][c]);
    }
  }
}

/// @brief dot_block_fn for AVX-512F: 4 x 4 blocks (sixteen accumulators of the 32 registers),
/// the edges in smaller ones.
INFERSCALE_TARGET_AVX512 inline void dot_block_avx512(float const* const* a,
                                                      std::uint32_t na,
                                                      float const* const* b,
                                                      std::uint32_t nb,
                                                      std::int64_t n,
                                                      float* out,
                                                      std::size_t ld) noexcept
{
  std::uint32_t i = 0;
  for (; i + 4 <= na; i += 4) {
    std::uint32_t j = 0;
    for (; j + 4 <= nb; j += 4) {
      dot_tile16<4, 4>(a + i, b + j, n, out + i * ld + j, ld);
    }
    for (; j < nb; ++j) {
      dot_tile16<4, 1>(a + i, b + j, n, out + i * ld + j, ld);
    }
  }
  for (; i < na; ++i) {
    std::uint32_t j = 0;
    for (; j + 4 <= nb; j += 4) {
      dot_tile16<1, 4>(a + i, b + j, n, out + i * ld + j, ld);
    }
    for (; j < nb; ++j) {
      dot_tile16<1, 1>(a + i, b + j, n, out + i * ld + j, ld);
    }
  }
}

#endif  // INFERSCALE_HOST_X86_SIMD

/// @brief The block dot product for the widest instruction set in use.
inline dot_block_fn dot_block_for() noexcept
{
#if INFERSCALE_HOST_X86_SIMD
  switch (active_host_simd()) {
    case host_simd::avx512:
    case host_simd::avx512_bf16: return &dot_block_avx512;
    case host_simd::avx2: return &dot_block_avx2;
    case host_simd::scalar: break;
  }
#endif
  return &dot_block_portable;
}

}  // namespace inferscale::detail::index
