/**
 * @file compression.hpp
 * @brief Compressed fact KV: a store's pages may hold fp8 (e4m3) or int4 codes with scales instead
 * of 16- or 32-bit elements, and are dequantized inside injection (host and device).
 *
 * Scales follow KIVI's finding for KV quantization (Liu et al., 2024, "KIVI: A Tuning-Free
 * Asymmetric 2bit Quantization for KV Cache", §3): keys have outlier *channels*, so a key is scaled
 * per channel; values are scaled per token. Here a key scale covers one (page, layer, head,
 * channel): the `page_size` tokens of a page share it, so every page stays self-contained (tiers,
 * snapshots and remote stores move whole pages); a value scale covers one (token, layer, head).
 * Quantization is symmetric (no zero point): the scale of a group is `amax / q_max` rounded *up*,
 * so `|x / scale| <= q_max` for every element of the group (q_max = 448 for e4m3, 7 for int4):
 *  - int4: to bfloat16 (2 bytes per scale); the code of `x` is `x / scale` (fp32 division)
 *    rounded to nearest, ties to even, in [-7, 7] (the code -8 never occurs);
 *  - fp8 e4m3: to a power of two, stored as its biased exponent (OCP MX's E8M0: byte `e` is
 *    `2^(e - 127)`, 1 byte per scale). e4m3 carries its own exponent, so a power-of-two scale
 *    loses no relative precision against an exact one; it halves the scales' bytes. The code of
 *    `x` is `x / scale` (exact: a power of two) rounded to nearest e4m3, ties to even.
 * A group whose elements are all zero has codes 0 (int4: scale 0; e4m3: the smallest scale).
 *
 * A compressed store still has a `store_dtype` (float32, float16 or bfloat16): the dtype its
 * elements are dequantized to. Dequantization is `to_store_dtype(float(code) * float(scale))`, one
 * fp32 product rounded once more to the store dtype, so **injecting a compressed fact is injecting
 * the uncompressed fact whose elements are its dequantized values**, on every path and backend,
 * bit for bit (the tests state it so).
 *
 * Page layout (bytes; `P` = page_size, `H` = the shard's heads, `D` = head_dim, `b` = code bits,
 * 8 or 4): a page is `[layer][K block, V block]`; a K block is the codes `[P][H][D]` (int4: two per
 * byte, the even dim in the low nibble), padded to 16 bytes, then the key scales `[H][D]`, padded
 * to 16 bytes; a V block is the codes, padded to 16 bytes, then the value scales `[P][H]`, padded
 * to 16 bytes (scales: E8M0 bytes for e4m3, bfloat16 for int4). Rows past a fact's end hold code
 * 0 and do not enter its key scales.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/dtype/conversion.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/rope.hpp>  // mul_rn, div_rn: one rounding on both backends

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace inferscale {

/// @brief How a store holds its facts' K/V.
enum class kv_compression : std::uint8_t {
  none,      ///< elements of the store dtype
  fp8_e4m3,  ///< OCP fp8 e4m3 codes, scaled per key channel (per page) and per value token
  int4,      ///< symmetric int4 codes in [-7, 7], two per byte, scaled as fp8_e4m3
};

/// @brief Human-readable name of `c` ("none", "fp8_e4m3", "int4").
inline char const* to_string(kv_compression c) noexcept
{
  switch (c) {
    case kv_compression::none: return "none";
    case kv_compression::fp8_e4m3: return "fp8_e4m3";
    case kv_compression::int4: return "int4";
  }
  return "unknown compression";
}

/// @brief Largest head_dim a compressed store takes (its host injection's per-head scratch).
inline constexpr std::int32_t compressed_max_head_dim = 512;

/// @brief Bits of one code (0 for none: the store dtype's elements are not codes).
INFERSCALE_HOST_DEVICE constexpr int code_bits(kv_compression c) noexcept
{
  return c == kv_compression::fp8_e4m3 ? 8 : c == kv_compression::int4 ? 4 : 0;
}

/// @brief Bytes of one scale: 1 (E8M0) for e4m3, 2 (bfloat16) for int4.
INFERSCALE_HOST_DEVICE constexpr int scale_bytes(kv_compression c) noexcept
{
  return c == kv_compression::fp8_e4m3 ? 1 : 2;
}

/// @brief Largest code magnitude: 448 for e4m3, 7 for int4.
INFERSCALE_HOST_DEVICE constexpr float code_max(kv_compression c) noexcept
{
  return c == kv_compression::fp8_e4m3 ? 448.0f : 7.0f;
}

/**
 * @brief Byte layout of one (layer, K or V) block of a compressed page (see the file comment).
 * Trivially copyable; the same on host and device.
 */
struct compressed_block_layout {
  std::int32_t page_size{};
  std::int32_t num_heads{};
  std::int32_t head_dim{};
  kv_compression compression{kv_compression::none};

  static constexpr std::int64_t align = 16;

  INFERSCALE_HOST_DEVICE static constexpr std::int64_t round_up(std::int64_t n) noexcept
  {
    return (n + align - 1) / align * align;
  }
  /// @brief Bytes of one token's codes of one head (`D * b / 8`).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t head_code_bytes() const noexcept
  {
    return static_cast<std::int64_t>(head_dim) * code_bits(compression) / 8;
  }
  /// @brief Bytes of one token's codes (all heads).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t row_code_bytes() const noexcept
  {
    return static_cast<std::int64_t>(num_heads) * head_code_bytes();
  }
  /// @brief Offset of the scales in a block (the codes, padded).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t scales_offset() const noexcept
  {
    return round_up(static_cast<std::int64_t>(page_size) * row_code_bytes());
  }
  /// @brief Bytes of a K block (`kv == 0`: scales `[H][D]`) or a V block (`kv == 1`: `[P][H]`).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t block_bytes(std::int32_t kv) const noexcept
  {
    std::int64_t const scales = kv == 0 ? static_cast<std::int64_t>(num_heads) * head_dim
                                        : static_cast<std::int64_t>(page_size) * num_heads;
    return scales_offset() + round_up(scales * scale_bytes(compression));
  }
  /// @brief Bytes of one layer of a page (K block and V block).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t layer_bytes() const noexcept
  {
    return block_bytes(0) + block_bytes(1);
  }
};

namespace detail {

/// @brief bfloat16 of a positive finite `x`, rounded toward +infinity (a scale never too small).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint16_t bfloat16_bits_up(float x) noexcept
{
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  std::uint32_t const low = u & 0xFFFFu;
  u >>= 16;
  if (low != 0) { ++u; }  // positive: the next representable value up (max float rounds to inf)
  return static_cast<std::uint16_t>(u);
}

/// @brief fp32 value of an E8M0 scale byte: `2^(e - 127)` (e = 0: 2^-127, a float subnormal).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float e8m0_value(std::uint8_t e) noexcept
{
  std::uint32_t const u = e == 0 ? 0x00400000u : static_cast<std::uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// @brief The E8M0 byte of the smallest power of two >= `x` (x >= 0 and finite; 0 for x <= 2^-127).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint8_t e8m0_up(float x) noexcept
{
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  std::uint32_t e = u >> 23;                       // x >= 0: the biased exponent
  if (e == 0) { return u > 0x00400000u ? 1 : 0; }  // subnormal: 2^-127 or 2^-126
  if ((u & 0x007FFFFFu) != 0) { ++e; }             // not a power of two: the next one up
  return static_cast<std::uint8_t>(e > 254 ? 254 : e);
}

/// @brief The scale of a group whose largest magnitude is `amax`, as stored: the bits of a
/// bfloat16 (int4; 0 for an all-zero group) or an E8M0 byte (e4m3).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint16_t group_scale(float amax,
                                                                        kv_compression c) noexcept
{
  if (c == kv_compression::fp8_e4m3) { return e8m0_up(div_rn(amax, 448.0f)); }
  if (!(amax > 0.0f)) { return 0; }
  return bfloat16_bits_up(div_rn(amax, 7.0f));
}

/// @brief fp32 value of scale `i` of a block's scales (`scales`: the block's scale bytes).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float scale_at(unsigned char const* scales,
                                                             std::int64_t i,
                                                             kv_compression c) noexcept
{
  if (c == kv_compression::fp8_e4m3) { return e8m0_value(scales[i]); }
  std::uint16_t bits;
  std::memcpy(&bits, scales + 2 * i, sizeof bits);
  return to_float(bfloat16_t{bits});
}

/// @brief Stores scale bits `s` (group_scale) as scale `i` of a block's scales.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void set_scale(unsigned char* scales,
                                                             std::int64_t i,
                                                             std::uint16_t s,
                                                             kv_compression c) noexcept
{
  if (c == kv_compression::fp8_e4m3) {
    scales[i] = static_cast<unsigned char>(s);
  } else {
    std::memcpy(scales + 2 * i, &s, sizeof s);
  }
}

/// @brief The int4 code of `x` for `scale` (> 0), in [-7, 7], stored in the low nibble.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint8_t int4_code(float x, float scale) noexcept
{
  float q = div_rn(x, scale);
  q       = q > 7.0f ? 7.0f : q < -7.0f ? -7.0f : q;
  // Round to nearest, ties to even, without <cmath> on the device: |q| <= 7, so adding and
  // subtracting 2^23 rounds in the FPU's mode (nearest even).
  float const magic = 8388608.0f;
  float const r     = q >= 0.0f ? (q + magic) - magic : -((-q + magic) - magic);
  auto const i      = static_cast<std::int32_t>(r);
  return static_cast<std::uint8_t>(i & 0xF);
}

/// @brief The value of int4 code `nibble` (low 4 bits, two's complement).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float int4_value(std::uint8_t nibble) noexcept
{
  auto const n = static_cast<std::int32_t>(nibble & 0xF);
  return static_cast<float>(n >= 8 ? n - 16 : n);
}

/// @brief The code of `x` for `scale` (0: the code of 0), as a byte (int4: a low nibble).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint8_t encode(float x,
                                                                  float scale,
                                                                  kv_compression c) noexcept
{
  if (c == kv_compression::int4) { return scale > 0.0f ? int4_code(x, scale) : 0; }
  return from_float<float8_e4m3_t>(div_rn(x, scale)).bits;
}

/// @brief fp32 value of code `code` (int4: its low nibble) times `scale`, rounded once.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float decode(std::uint8_t code,
                                                           float scale,
                                                           kv_compression c) noexcept
{
  float const v = c == kv_compression::int4 ? int4_value(code) : to_float(float8_e4m3_t{code});
  return mul_rn(v, scale);
}

/// @brief Code `e` of a row of codes (int4: nibble `e % 2` of byte `e / 2`).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint8_t code_at(unsigned char const* codes,
                                                                   std::int64_t e,
                                                                   kv_compression c) noexcept
{
  if (c == kv_compression::int4) {
    unsigned char const b = codes[e / 2];
    return static_cast<std::uint8_t>((e % 2) == 0 ? (b & 0xF) : (b >> 4));
  }
  return codes[e];
}

/**
 * @brief Dequantizes `count` elements, dims `first .. first+count-1` of head `head`, of token row
 * `t` (0 <= t < page_size) of a block, into `out` as `OutT` (the store dtype).
 */
template <class OutT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void dequantize_run(compressed_block_layout const& b,
                                                                  unsigned char const* block,
                                                                  std::int32_t kv,
                                                                  std::int32_t t,
                                                                  std::int32_t head,
                                                                  std::int32_t first,
                                                                  std::int32_t count,
                                                                  OutT* out) noexcept
{
  unsigned char const* const codes =
    block + static_cast<std::int64_t>(t) * b.row_code_bytes() + head * b.head_code_bytes();
  unsigned char const* const scales = block + b.scales_offset();
  kv_compression const c            = b.compression;
  if (kv == 0) {
    std::int64_t const ks = static_cast<std::int64_t>(head) * b.head_dim;
    for (std::int32_t e = 0; e < count; ++e) {
      std::int32_t const d = first + e;
      out[e] = from_float<OutT>(decode(code_at(codes, d, c), scale_at(scales, ks + d, c), c));
    }
  } else {
    float const vs = scale_at(scales, static_cast<std::int64_t>(t) * b.num_heads + head, c);
    for (std::int32_t e = 0; e < count; ++e) {
      out[e] = from_float<OutT>(decode(code_at(codes, first + e, c), vs, c));
    }
  }
}

}  // namespace detail
}  // namespace inferscale
