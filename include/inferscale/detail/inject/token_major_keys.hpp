/**
 * @file detail/inject/token_major_keys.hpp
 * @brief Host vector injection into caches whose keys are token-major within a block (vLLM's CPU
 * layout: per block and head the keys are `[head_dim, block_size]`, so dim d of consecutive
 * tokens sits side by side), with vLLM's AVX2 rotary rounding (fp32 rotation truncated to bf16).
 *
 * Eight consecutive slots of one block are done at once: the eight tokens' stored keys are
 * transposed in registers (8 x 8 tiles, 16 or 32-bit), every pair is rotated eight tokens wide
 * with the same operations in the same order as the scalar loop (detail::rotate_fp32: each
 * product and the sum rounded once, no contraction), truncated, and each dim's eight results are
 * one 16-byte store. Values are contiguous rows in that layout and are copied (or converted) per
 * token. The caller (inject.hpp) handles tokens that are not part of such a run with its scalar
 * loop; the bytes written are the scalar loop's (tests/inject/inject_simd_host.cpp).
 */
#pragma once

#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/detail/rope/rotate_simd.hpp>
#include <inferscale/dtype.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if INFERSCALE_HOST_X86_SIMD

namespace inferscale::detail::simd {

/// @brief Largest head_dim the token-major path takes (its transposed tile lives on the stack).
inline constexpr std::int32_t token_major_max_dim = 512;

/// @brief Dims d0..d0+7 of eight rows of 16-bit codes, transposed: out[c] holds dim d0 + c of
/// rows 0..7 (lane j = row j).
INFERSCALE_TARGET_AVX2 inline void transpose8x8_u16(std::uint16_t const* const* rows,
                                                    std::int32_t d0,
                                                    __m128i* out)
{
  __m128i r[8];
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm_loadu_si128(reinterpret_cast<__m128i const*>(rows[j] + d0));
  }
  // Rows pairwise interleaved by 16, 32 and 64 bits: three rounds of unpacks.
  __m128i const a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
  __m128i const a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
  __m128i const a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
  __m128i const a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
  __m128i const b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  __m128i const b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  __m128i const b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  __m128i const b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  out[0] = _mm_unpacklo_epi64(b0, b4);
  out[1] = _mm_unpackhi_epi64(b0, b4);
  out[2] = _mm_unpacklo_epi64(b1, b5);
  out[3] = _mm_unpackhi_epi64(b1, b5);
  out[4] = _mm_unpacklo_epi64(b2, b6);
  out[5] = _mm_unpackhi_epi64(b2, b6);
  out[6] = _mm_unpacklo_epi64(b3, b7);
  out[7] = _mm_unpackhi_epi64(b3, b7);
}

/// @brief As transpose8x8_u16 for fp32 rows: out[c] holds dim d0 + c of rows 0..7.
INFERSCALE_TARGET_AVX2 inline void transpose8x8_ps(float const* const* rows,
                                                   std::int32_t d0,
                                                   __m256* out)
{
  __m256 r[8];
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm256_loadu_ps(rows[j] + d0);
  }
  __m256 t[8], s[8];
  for (int q = 0; q < 4; ++q) {  // within each 128-bit lane: rows 2q, 2q + 1 interleaved
    t[2 * q]     = _mm256_unpacklo_ps(r[2 * q], r[2 * q + 1]);
    t[2 * q + 1] = _mm256_unpackhi_ps(r[2 * q], r[2 * q + 1]);
  }
  for (int q = 0; q < 2; ++q) {  // four rows of one dim per 128-bit lane
    s[4 * q + 0] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * q + 1] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[4 * q + 2] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[4 * q + 3] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // rows 0-3 and 4-7 joined: dims c (low lanes) and c + 4 (high)
    out[c]     = _mm256_permute2f128_ps(s[c], s[c + 4], 0x20);
    out[c + 4] = _mm256_permute2f128_ps(s[c], s[c + 4], 0x31);
  }
}

/// @brief fp32 lanes truncated to bf16 codes (the upper 16 bits), NaN made quiet as
/// float_to_bfloat16_bits does: inject.hpp's bfloat16_toward_zero, eight at a time.
INFERSCALE_TARGET_AVX2 inline __m128i fp32_to_bf16_toward_zero(__m256 x)
{
  __m256i const bits = _mm256_castps_si256(x);
  __m256i const high = _mm256_srli_epi32(bits, 16);
  __m256i const nan  = greater(_mm256_and_si256(bits, splat(0x7fffffffu)), splat(0x7f800000u));
  return pack_u16(select(high, _mm256_or_si256(high, splat(0x40u)), nan));
}

/// @brief The transposed keys of eight tokens: column d holds dim d (fp32, or 16-bit codes).
struct wide_columns {
  __m256 column[token_major_max_dim];
};
struct code_columns {
  __m128i column[token_major_max_dim];
};

/// @brief A transposed column (eight tokens' values of one dim) as fp32 lanes (exact).
template <class StoreT>
INFERSCALE_TARGET_AVX2 inline __m256 widen(__m256 column)
{
  return column;
}
template <class StoreT>
INFERSCALE_TARGET_AVX2 inline __m256 widen(__m128i column)
{
  if constexpr (std::is_same_v<StoreT, bfloat16_t>) {
    return bf16_to_fp32(column);
  } else {
    return fp16_to_fp32(column);
  }
}

/// @brief Eight tokens' bf16 codes of dim `d` into a token-major key block.
INFERSCALE_TARGET_AVX2 inline void store_dim(bfloat16_t* kdst,
                                             std::int64_t key_dim_stride,
                                             std::int32_t d,
                                             __m128i codes)
{
  _mm_storeu_si128(reinterpret_cast<__m128i*>(kdst + d * key_dim_stride), codes);
}

/**
 * @brief One layer and head of eight consecutive slots of one block: keys rotated by `cos8` /
 * `sin8` (`[pair][token]`, eight tokens per pair) and truncated to bf16, values converted.
 *
 * @param krow,vrow  each token's key / value row of this layer and head in the store (head_dim
 *                   contiguous elements)
 * @param kdst       the cache's key of token 0, dim 0; token j at kdst + j, dim d at
 *                   kdst + d * key_dim_stride
 * @param vdst       the cache's value row of token 0 (dims contiguous); token j at
 *                   vdst + j * value_token_stride
 * @param halves     the pairing: pair p is dims (p, p + rotary / 2) if true, (2p, 2p + 1) if not
 */
template <class StoreT>
INFERSCALE_TARGET_AVX2 void inject8_token_major_truncate(StoreT const* const* krow,
                                                         StoreT const* const* vrow,
                                                         bfloat16_t* kdst,
                                                         std::int64_t key_dim_stride,
                                                         bfloat16_t* vdst,
                                                         std::int64_t value_token_stride,
                                                         std::int32_t dim,
                                                         std::int32_t rotary,
                                                         bool halves,
                                                         float const* cos8,
                                                         float const* sin8)
{
  static_assert(std::is_same_v<StoreT, float> || std::is_same_v<StoreT, bfloat16_t> ||
                std::is_same_v<StoreT, half_t>);
  constexpr bool wide = std::is_same_v<StoreT, float>;
  // The keys transposed: column d holds dim d of the eight tokens (16-bit codes or fp32).
  std::conditional_t<wide, wide_columns, code_columns> tile;
  auto* const column = tile.column;
  for (std::int32_t d0 = 0; d0 < dim; d0 += 8) {
    if constexpr (wide) {
      transpose8x8_ps(krow, d0, column + d0);
    } else {
      transpose8x8_u16(reinterpret_cast<std::uint16_t const* const*>(krow), d0, column + d0);
    }
  }
  std::int32_t const pairs = rotary / 2;
  for (std::int32_t p = 0; p < pairs; ++p) {
    std::int32_t const first  = halves ? p : 2 * p;
    std::int32_t const second = halves ? p + pairs : 2 * p + 1;
    __m256 x, y;
    rotate8<rotate_mode::fp32, StoreT>(widen<StoreT>(column[first]),
                                       widen<StoreT>(column[second]),
                                       _mm256_loadu_ps(cos8 + 8 * p),
                                       _mm256_loadu_ps(sin8 + 8 * p),
                                       &x,
                                       &y);
    store_dim(kdst, key_dim_stride, first, fp32_to_bf16_toward_zero(x));
    store_dim(kdst, key_dim_stride, second, fp32_to_bf16_toward_zero(y));
  }
  for (std::int32_t d = rotary; d < dim; ++d) {  // convert_stored: bf16 codes are copied
    if constexpr (std::is_same_v<StoreT, bfloat16_t>) {
      store_dim(kdst, key_dim_stride, d, column[d]);
    } else {
      store_dim(kdst, key_dim_stride, d, fp32_to_bf16(widen<StoreT>(column[d])));
    }
  }
  for (int j = 0; j < 8; ++j) {
    bfloat16_t* const out = vdst + j * value_token_stride;
    if constexpr (std::is_same_v<StoreT, bfloat16_t>) {
      std::memcpy(out, vrow[j], static_cast<std::size_t>(dim) * sizeof(bfloat16_t));
    } else {
      for (std::int32_t d = 0; d < dim; d += 8) {
        store8(out + d, load8(vrow[j] + d));
      }
    }
  }
}

}  // namespace inferscale::detail::simd

#endif  // INFERSCALE_HOST_X86_SIMD
