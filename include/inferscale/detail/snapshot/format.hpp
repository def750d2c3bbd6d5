/**
 * @file detail/snapshot/format.hpp
 * @brief The store snapshot format of snapshot.hpp's file comment: its constants (magic, version,
 * field sizes) and the element helpers reading and writing the pool use (byte order, finiteness,
 * dtype conversion).
 */
#pragma once

#include <inferscale/compression.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace inferscale::detail {

namespace store_format {
inline constexpr unsigned char magic[8]       = {0x89, 'I', 'S', 'K', 'V', 'S', 0x0D, 0x0A};
inline constexpr std::uint32_t version        = 2;  ///< written; 1 and 2 are read
inline constexpr std::uint32_t oldest_version = 1;  ///< version 1: no fact checksums
inline constexpr std::uint32_t byte_order     = 0x01020304u;
inline constexpr std::size_t header_fields    = 96;   ///< bytes covered by the header checksum
inline constexpr std::size_t header_bytes     = 104;  ///< fields + header checksum
inline constexpr std::size_t namespace_bytes  = 16;   ///< namespace id, fact count
inline constexpr std::size_t fact_bytes       = 16;   ///< fact id, tokens, page count
inline constexpr std::size_t checksum_bytes   = 8;
/// Version 2: the catalogue ends with one CRC-64 per fact of its pages' bytes (the fact table).
inline constexpr std::size_t fact_checksum_bytes = 8;
inline constexpr std::size_t minimum_bytes       = header_bytes + 2 * checksum_bytes;
/// Pool bytes read or written per piece: small enough that the checksum and the finiteness check
/// find them still in the cache after the copy, large enough to keep system calls rare.
inline constexpr std::size_t pool_chunk_bytes = std::size_t{8} << 20;

inline std::uint8_t dtype_code(dtype t) noexcept
{
  return t == dtype::float32 ? 0 : t == dtype::float16 ? 1 : 2;
}
}  // namespace store_format

/// @brief Reverses the bytes of each of `count` elements of `width` bytes (big-endian hosts).
inline void to_host_order(unsigned char* p, std::size_t count, std::size_t width) noexcept
{
  for (std::size_t e = 0; e < count; ++e) {
    std::reverse(p + e * width, p + (e + 1) * width);
  }
}

/// @brief True when one of `count` elements of `Bits` at `p` has all of `mask`'s exponent bits.
template <class Bits>
bool any_exponent_all_ones(unsigned char const* p, std::size_t count, Bits mask) noexcept
{
  // No early exit and a narrow accumulator: the loop vectorises (about 8 GB/s on one core of the
  // 2-core Xeon CI machine, against 2.5 GB/s with a bool accumulator). Blocks of a constant 64
  // elements: g++ 12 at -O2 (the vLLM extension's level, "very cheap" vectorisation) vectorises
  // only a loop that needs no epilogue; the plain loop stayed scalar there.
  constexpr std::size_t lanes = 64;
  Bits acc                    = 0;
  std::size_t e               = 0;
  for (; e + lanes <= count; e += lanes) {
    for (std::size_t l = 0; l < lanes; ++l) {
      Bits b;
      std::memcpy(&b, p + sizeof(Bits) * (e + l), sizeof(Bits));
      acc |= static_cast<Bits>(((b & mask) ^ mask) == 0 ? 1 : 0);
    }
  }
  for (; e < count; ++e) {
    Bits b;
    std::memcpy(&b, p + sizeof(Bits) * e, sizeof(Bits));
    acc |= static_cast<Bits>(((b & mask) ^ mask) == 0 ? 1 : 0);
  }
  return acc != 0;
}

/// @brief Index of the first non-finite element of `count` elements of `t` at `p`, or `count`.
inline std::size_t first_non_finite(unsigned char const* p, std::size_t count, dtype t) noexcept
{
  constexpr std::size_t block = 4096;  // searched element by element only when flagged
  std::size_t const width     = size_of(t);
  std::uint32_t const mask    = t == dtype::float32   ? 0x7F800000u
                                : t == dtype::float16 ? 0x7C00u
                                                      : 0x7F80u;
  for (std::size_t begin = 0; begin < count; begin += block) {
    std::size_t const n          = std::min(block, count - begin);
    unsigned char const* const q = p + width * begin;
    bool const bad =
      width == 4 ? any_exponent_all_ones<std::uint32_t>(q, n, mask)
                 : any_exponent_all_ones<std::uint16_t>(q, n, static_cast<std::uint16_t>(mask));
    if (!bad) { continue; }
    for (std::size_t e = 0; e < n; ++e) {
      std::uint32_t b = 0;
      std::memcpy(&b, q + width * e, width);
      if ((b & mask) == mask) { return begin + e; }
    }
  }
  return count;
}

/**
 * @brief Index of the first of `pages` compressed pages at `p` holding a code or a scale the
 * store never writes (an e4m3 NaN code, the int4 code -8, an E8M0 scale 255, a non-finite
 * bfloat16 scale), or `pages`.
 */
inline std::size_t first_bad_compressed_page(unsigned char const* p,
                                             std::size_t pages,
                                             kv_store_config const& c) noexcept
{
  compressed_block_layout const b{c.page_size, c.num_heads, c.model.head_dim, c.compression};
  std::size_t const layer = static_cast<std::size_t>(b.layer_bytes());
  for (std::size_t page = 0; page < pages; ++page) {
    for (std::int32_t l = 0; l < c.num_layers; ++l) {
      for (std::int32_t kv = 0; kv < 2; ++kv) {
        unsigned char const* const block =
          p +
          (page * static_cast<std::size_t>(c.num_layers) + static_cast<std::size_t>(l)) * layer +
          (kv == 0 ? 0 : static_cast<std::size_t>(b.block_bytes(0)));
        std::size_t const codes = static_cast<std::size_t>(b.page_size * b.row_code_bytes());
        std::size_t const scales =
          static_cast<std::size_t>(kv == 0 ? b.num_heads * b.head_dim : b.page_size * b.num_heads);
        bool bad = false;
        if (c.compression == kv_compression::int4) {
          for (std::size_t i = 0; i < codes; ++i) {
            bad |= (block[i] & 0xF) == 8 || (block[i] >> 4) == 8;
          }
          for (std::size_t i = 0; i < scales; ++i) {
            unsigned char const* s = block + b.scales_offset() + 2 * i;
            // negative, or the exponent all ones (infinity, NaN)
            bad |= (s[1] & 0x80) != 0 || ((s[1] & 0x7F) == 0x7F && (s[0] & 0x80) != 0);
          }
        } else {
          for (std::size_t i = 0; i < codes; ++i) {
            bad |= (block[i] & 0x7F) == 0x7F;
          }
          for (std::size_t i = 0; i < scales; ++i) {
            bad |= block[b.scales_offset() + i] == 0xFF;
          }
        }
        if (bad) { return page; }
      }
    }
  }
  return pages;
}

/// @brief True for the element types a store holds (float, half_t, bfloat16_t).
template <class T>
inline constexpr bool is_store_element_v =
  std::is_same_v<T, float> || std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>;

/**
 * @brief Converts `count` elements of `from` at `src` (host order) to `to` at `dst`; returns the
 * index of the first finite element that overflows `to`, or `count`.
 */
inline std::size_t convert_elements(
  unsigned char const* src, dtype from, unsigned char* dst, dtype to, std::size_t count)
{
  return dispatch_dtype(from, [&](auto source_tag) {
    using S = typename decltype(source_tag)::type;
    return dispatch_dtype(to, [&](auto target_tag) {
      using D              = typename decltype(target_tag)::type;
      std::size_t overflow = count;
      if constexpr (is_store_element_v<S> && is_store_element_v<D>) {
        // only float16 targets, and bfloat16 from float32, can overflow
        constexpr bool may_overflow =
          std::is_same_v<D, half_t> || (std::is_same_v<D, bfloat16_t> && std::is_same_v<S, float>);
        for (std::size_t e = 0; e < count; ++e) {
          S s;
          std::memcpy(&s, src + sizeof(S) * e, sizeof(S));
          float const x = to_float(s);
          D const d     = from_float<D>(x);
          std::memcpy(dst + sizeof(D) * e, &d, sizeof(D));
          if constexpr (may_overflow) {
            if (overflow == count && std::isfinite(x) && !std::isfinite(to_float(d))) {
              overflow = e;
            }
          }
        }
      }
      return overflow;
    });
  });
}

}  // namespace inferscale::detail
