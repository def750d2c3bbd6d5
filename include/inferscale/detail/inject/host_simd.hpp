/**
 * @file detail/inject/host_simd.hpp
 * @brief The host backend's vector injection (AVX2 and AVX-512F, chosen at run time) for
 * contiguous dims and either pairing (halves; interleaved pairs taken apart into the same two
 * operands): the same bits as the scalar loop.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/detail/inject/host_loop.hpp>
#include <inferscale/detail/rope/rotate_simd.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale::detail {

#if INFERSCALE_HOST_X86_SIMD
namespace simd {

/**
 * @brief One scaling of quantize, prepared for a row: `x / scale` or `x * scale` as the
 * convention says. A division by a power of two whose reciprocal is a normal float is the
 * multiplication by that reciprocal: both are the correctly rounded value of the same real
 * product `x 2^-k` (flush-to-zero and denormals-are-zero modes treat both alike), and a vector
 * multiplication costs a fraction of a division (vLLM's uncalibrated scale is 1).
 */
struct scale_step {
  float factor{1.0f};
  bool divide{false};

  scale_step() = default;
  scale_step(float scale, kv_scale_convention convention)
  {
    std::uint32_t const bits     = float_bits(scale);
    std::uint32_t const exponent = (bits >> 23) & 0xffu;
    bool const power_of_two      = (bits & 0x807fffffu) == 0 && exponent >= 1 && exponent <= 253;
    if (convention == kv_scale_convention::multiply) {
      factor = scale;
    } else if (power_of_two) {
      factor = bits_to_float((254u - exponent) << 23);  // 2^-k
    } else {
      factor = scale;
      divide = true;
    }
  }
};

/// @brief Scales (when `Scaled`) fp32 lanes as quantize does, before the rounding to the cache
/// dtype.
template <bool Scaled>
INFERSCALE_TARGET_AVX2 inline __m256 apply_scale(__m256 x, scale_step const& step)
{
  if constexpr (!Scaled) {
    return x;
  } else {
    __m256 const f = _mm256_set1_ps(step.factor);
    return step.divide ? _mm256_div_ps(x, f) : _mm256_mul_ps(x, f);
  }
}

/// @brief `n` stored elements as the cache holds them (convert_stored, eight at a time): bytes
/// copied when the dtypes match and there is no scale.
template <bool Scaled, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX2 inline void convert_row(StoreT const* __restrict src,
                                               CacheT* __restrict dst,
                                               std::int32_t n,
                                               scale_step const& step)
{
  if constexpr (!Scaled && std::is_same_v<StoreT, CacheT>) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(StoreT));
  } else {
    for (std::int32_t d = 0; d < n; d += 8) {
      std::int32_t const count = n - d < 8 ? n - d : 8;
      store_n(dst + d, apply_scale<Scaled>(load_n(src + d, count), step), count);
    }
  }
}

/**
 * @brief The vector form of inject_host_head for contiguous dims (either pairing): every
 * head of one token in one layer (keys rotated by `cos`/`sin`, one entry per pair, scaled and
 * converted; values converted). With `Scaled`, `key_steps` / `value_steps` hold the layer's
 * scaling of each head (prepared once per call; unused otherwise).
 */
/// @brief Sixteen consecutive elements (`a`: 0-7, `b`: 8-15) as their even and odd ones (the two
/// halves of eight interleaved pairs).
INFERSCALE_TARGET_AVX2 inline void deinterleave8(__m256 a, __m256 b, __m256* even, __m256* odd)
{
  // [a0 a2 b0 b2 | a4 a6 b4 b6], then the 64-bit quarters in the order 0, 2, 1, 3
  __m256 const e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  __m256 const o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  *even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
  *odd  = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
}

/// @brief The inverse of deinterleave8: pairs (x_i, y_i) in order, the first eight in `lo`.
INFERSCALE_TARGET_AVX2 inline void interleave8(__m256 x, __m256 y, __m256* lo, __m256* hi)
{
  __m256 const l = _mm256_unpacklo_ps(x, y);  // x0 y0 x1 y1 | x4 y4 x5 y5
  __m256 const h = _mm256_unpackhi_ps(x, y);  // x2 y2 x3 y3 | x6 y6 x7 y7
  *lo            = _mm256_permute2f128_ps(l, h, 0x20);
  *hi            = _mm256_permute2f128_ps(l, h, 0x31);
}

/// @brief One token's key and value rows of one layer into the cache (eight pairs at a time).
/// `Halves`: pair p is (p, p + rotary / 2); else (2 p, 2 p + 1), taken apart into the two
/// operands of the same rotation and put back together (the same arithmetic per pair).
template <bool Scaled, rotate_mode Mode, bool Halves, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX2 void inject_token(kv_store_ref const& store,
                                         std::int64_t store_token,
                                         paged_kv_cache const& cache,
                                         std::int32_t layer,
                                         std::int64_t block,
                                         std::int32_t in_block,
                                         std::int32_t rotary,
                                         float const* cos,
                                         float const* sin,
                                         scale_step const* key_steps,
                                         scale_step const* value_steps)
{
  std::int32_t const dim  = store.head_dim;
  std::int32_t const half = rotary / 2;
  auto const* const pool  = static_cast<StoreT const*>(store.pool);
  {
    std::int32_t const l     = layer;
    StoreT const* const krow = pool + store.row_offset(store_token, l, 0);
    StoreT const* const vrow = pool + store.row_offset(store_token, l, 1);
    auto* const kbase        = static_cast<CacheT*>(cache.key_base[l]);
    auto* const vbase        = static_cast<CacheT*>(cache.value_base[l]);
    for (std::int32_t h = 0; h < store.num_heads; ++h) {
      StoreT const* const k      = krow + static_cast<std::int64_t>(h) * dim;
      CacheT* const kdst         = kbase + cache.key_layout.offset(block, in_block, h, 0);
      scale_step const key_scale = Scaled ? key_steps[h] : scale_step{};
      for (std::int32_t p = 0; p < half; p += 8) {
        std::int32_t const n = half - p < 8 ? half - p : 8;
        __m256 x, y;
        if constexpr (Halves) {
          rotate8<Mode, StoreT>(load_n(k + p, n),
                                load_n(k + half + p, n),
                                load_n(cos + p, n),
                                load_n(sin + p, n),
                                &x,
                                &y);
          store_n(kdst + p, apply_scale<Scaled>(x, key_scale), n);
          store_n(kdst + half + p, apply_scale<Scaled>(y, key_scale), n);
        } else {
          std::int32_t const first = 2 * n < 8 ? 2 * n : 8;  // elements of the first vector
          __m256 even, odd, lo, hi;
          deinterleave8(load_n(k + 2 * p, first),
                        2 * n > 8 ? load_n(k + 2 * p + 8, 2 * n - 8) : _mm256_setzero_ps(),
                        &even,
                        &odd);
          rotate8<Mode, StoreT>(even, odd, load_n(cos + p, n), load_n(sin + p, n), &x, &y);
          interleave8(
            apply_scale<Scaled>(x, key_scale), apply_scale<Scaled>(y, key_scale), &lo, &hi);
          store_n(kdst + 2 * p, lo, first);
          if (2 * n > 8) { store_n(kdst + 2 * p + 8, hi, 2 * n - 8); }
        }
      }
      if (rotary < dim) { convert_row<Scaled>(k + rotary, kdst + rotary, dim - rotary, key_scale); }
      convert_row<Scaled>(vrow + static_cast<std::int64_t>(h) * dim,
                          vbase + cache.value_layout.offset(block, in_block, h, 0),
                          dim,
                          Scaled ? value_steps[h] : scale_step{});
    }
  }
}

}  // namespace simd

namespace simd512 {

using simd::scale_step;

/// @brief As simd::apply_scale, sixteen lanes.
template <bool Scaled>
INFERSCALE_TARGET_AVX512 inline __m512 apply_scale(__m512 x, scale_step const& step)
{
  if constexpr (!Scaled) {
    return x;
  } else {
    __m512 const f = _mm512_set1_ps(step.factor);
    return step.divide ? _mm512_div_ps(x, f) : _mm512_mul_ps(x, f);
  }
}

/// @brief `n` stored elements as the cache holds them (convert_stored, sixteen at a time): bytes
/// copied when the dtypes match and there is no scale.
template <bool Scaled, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX512 inline void convert_row(StoreT const* __restrict src,
                                                 CacheT* __restrict dst,
                                                 std::int32_t n,
                                                 scale_step const& step)
{
  if constexpr (!Scaled && std::is_same_v<StoreT, CacheT>) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(StoreT));
  } else {
    for (std::int32_t d = 0; d < n; d += 16) {
      std::int32_t const count = n - d < 16 ? n - d : 16;
      store_n(dst + d, simd512::apply_scale<Scaled>(load_n(src + d, count), step), count);
    }
  }
}

/**
 * @brief The vector form of inject_host_head (sixteen lanes) for contiguous dims and the halves
 * pairing: every head of one token in one layer (keys rotated by `cos`/`sin`, one entry per
 * pair, scaled and converted; values converted; `key_steps` / `value_steps` as simd::inject_token).
 */
/// @brief As simd::deinterleave8, thirty-two elements (`a`: 0-15, `b`: 16-31).
INFERSCALE_TARGET_AVX512 inline void deinterleave16(__m512 a, __m512 b, __m512* even, __m512* odd)
{
  __m512i const evens =
    _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  __m512i const odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  *even              = _mm512_permutex2var_ps(a, evens, b);
  *odd               = _mm512_permutex2var_ps(a, odds, b);
}

/// @brief As simd::interleave8, sixteen pairs.
INFERSCALE_TARGET_AVX512 inline void interleave16(__m512 x, __m512 y, __m512* lo, __m512* hi)
{
  __m512i const low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  __m512i const high =
    _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  *lo = _mm512_permutex2var_ps(x, low, y);
  *hi = _mm512_permutex2var_ps(x, high, y);
}

/// @brief As simd::inject_token, sixteen pairs at a time.
template <bool Scaled, rotate_mode Mode, bool Halves, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX512 void inject_token(kv_store_ref const& store,
                                           std::int64_t store_token,
                                           paged_kv_cache const& cache,
                                           std::int32_t layer,
                                           std::int64_t block,
                                           std::int32_t in_block,
                                           std::int32_t rotary,
                                           float const* cos,
                                           float const* sin,
                                           scale_step const* key_steps,
                                           scale_step const* value_steps)
{
  std::int32_t const dim  = store.head_dim;
  std::int32_t const half = rotary / 2;
  auto const* const pool  = static_cast<StoreT const*>(store.pool);
  {
    std::int32_t const l     = layer;
    StoreT const* const krow = pool + store.row_offset(store_token, l, 0);
    StoreT const* const vrow = pool + store.row_offset(store_token, l, 1);
    auto* const kbase        = static_cast<CacheT*>(cache.key_base[l]);
    auto* const vbase        = static_cast<CacheT*>(cache.value_base[l]);
    for (std::int32_t h = 0; h < store.num_heads; ++h) {
      StoreT const* const k      = krow + static_cast<std::int64_t>(h) * dim;
      CacheT* const kdst         = kbase + cache.key_layout.offset(block, in_block, h, 0);
      scale_step const key_scale = Scaled ? key_steps[h] : scale_step{};
      for (std::int32_t p = 0; p < half; p += 16) {
        std::int32_t const n = half - p < 16 ? half - p : 16;
        __m512 x, y;
        if constexpr (Halves) {
          rotate16<Mode, StoreT>(load_n(k + p, n),
                                 load_n(k + half + p, n),
                                 load_n(cos + p, n),
                                 load_n(sin + p, n),
                                 &x,
                                 &y);
          store_n(kdst + p, simd512::apply_scale<Scaled>(x, key_scale), n);
          store_n(kdst + half + p, simd512::apply_scale<Scaled>(y, key_scale), n);
        } else {
          std::int32_t const first = 2 * n < 16 ? 2 * n : 16;  // elements of the first vector
          __m512 even, odd, lo, hi;
          deinterleave16(load_n(k + 2 * p, first),
                         2 * n > 16 ? load_n(k + 2 * p + 16, 2 * n - 16) : _mm512_setzero_ps(),
                         &even,
                         &odd);
          rotate16<Mode, StoreT>(even, odd, load_n(cos + p, n), load_n(sin + p, n), &x, &y);
          interleave16(simd512::apply_scale<Scaled>(x, key_scale),
                       simd512::apply_scale<Scaled>(y, key_scale),
                       &lo,
                       &hi);
          store_n(kdst + 2 * p, lo, first);
          if (2 * n > 16) { store_n(kdst + 2 * p + 16, hi, 2 * n - 16); }
        }
      }
      if (rotary < dim) {
        simd512::convert_row<Scaled>(k + rotary, kdst + rotary, dim - rotary, key_scale);
      }
      simd512::convert_row<Scaled>(vrow + static_cast<std::int64_t>(h) * dim,
                                   vbase + cache.value_layout.offset(block, in_block, h, 0),
                                   dim,
                                   Scaled ? value_steps[h] : scale_step{});
    }
  }
}

}  // namespace simd512

/**
 * @brief inject_host_typed for contiguous dims, either pairing (halves, or interleaved pairs:
 * llama.cpp's rotation of Llama-family models), on a CPU with AVX-512F or AVX2 (`level`, chosen
 * at run time): cos/sin once per token (shared by every layer and head, as
 * in the scalar loop), then layer by layer over a chunk of tokens, 16 or 8 pairs at a time. Same
 * bits as the scalar loop.
 */
template <bool Scaled,
          bool RoundEach,
          bool Fused,
          bool Halves,
          class StoreT,
          class CacheT,
          class Rotation>
void inject_host_typed_simd(kv_store_ref const& store,
                            injection_batch_view const& batch,
                            paged_kv_cache const& cache,
                            Rotation const& rotation,
                            host_simd level)
{
  using simd::rotate_mode;
  constexpr rotate_mode mode = Fused       ? rotate_mode::fused
                               : RoundEach ? rotate_mode::round_each
                                           : rotate_mode::fp32;
  // Tokens in chunks whose cos/sin (8 bytes per pair) stay in the L2; within a chunk, layer by
  // layer: a fact's tokens sit next to each other in a store page and, in order, in a cache
  // block, so each layer of a chunk reads and writes long runs instead of 2 KiB rows strided by
  // the layer pitch. cos/sin are still computed once per token and pair.
  constexpr std::int64_t chunk = 256;
  std::int32_t const pairs     = rotation.num_pairs();
  std::int64_t const n_slots   = cache.num_slots();
  std::int32_t const bs        = cache.key_layout.block_size;
  // Each rotation of a per-layer one has its rows, `rows` apart (layer l reads its own).
  std::int64_t const rows = chunk * pairs;
  std::vector<float> cos(static_cast<std::size_t>(rotation.num_rotations * rows));
  std::vector<float> sin(static_cast<std::size_t>(rotation.num_rotations * rows));
  // The scalings of every layer and head, prepared once (keys of layer l at 2 l H, values after).
  std::int32_t const heads = store.num_heads;
  std::vector<simd::scale_step> steps(
    Scaled ? static_cast<std::size_t>(2 * cache.num_layers * heads) : 0);
  for (std::int32_t l = 0; Scaled && l < cache.num_layers; ++l) {
    for (std::int32_t h = 0; h < heads; ++h) {
      steps[static_cast<std::size_t>(2 * l * heads + h)] =
        simd::scale_step{cache.scale(l, h, false), cache.scale_convention};
      steps[static_cast<std::size_t>((2 * l + 1) * heads + h)] =
        simd::scale_step{cache.scale(l, h, true), cache.scale_convention};
    }
  }
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk) {
    std::int64_t const last = std::min(batch.num_tokens, first + chunk);
    for (std::int64_t i = first; i < last; ++i) {
      if (!slot_in_cache(batch.slot[i], n_slots)) { continue; }
      for (std::int32_t r = 0; r < rotation.num_rotations; ++r) {
        std::size_t const row = static_cast<std::size_t>(r * rows + (i - first) * pairs);
        detail::rope_cos_sin_row(
          rotation, r, batch.position[i], rope_op::forward, cos.data() + row, sin.data() + row);
      }
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      float const* const layer_cos = cos.data() + rotation.of_layer(l) * rows;
      float const* const layer_sin = sin.data() + rotation.of_layer(l) * rows;
      for (std::int64_t i = first; i < last; ++i) {
        std::int64_t const slot = batch.slot[i];
        if (!slot_in_cache(slot, n_slots)) { continue; }
        std::size_t const row       = static_cast<std::size_t>((i - first) * pairs);
        std::int64_t const block    = slot / bs;
        std::int32_t const in_block = static_cast<std::int32_t>(slot % bs);
        auto const inject           = [&](auto token_at_level) {
          token_at_level(store,
                         batch.store_token[i],
                         cache,
                         l,
                         block,
                         in_block,
                         rotation.rotary_dim,
                         layer_cos + row,
                         layer_sin + row,
                         steps.data() + 2 * l * heads,
                         steps.data() + (2 * l + 1) * heads);
        };
        if (uses_avx512(level)) {
          inject(simd512::inject_token<Scaled, mode, Halves, StoreT, CacheT>);
        } else {
          inject(simd::inject_token<Scaled, mode, Halves, StoreT, CacheT>);
        }
      }
    }
  }
}
#endif  // INFERSCALE_HOST_X86_SIMD

}  // namespace inferscale::detail
