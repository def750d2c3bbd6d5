/**
 * @file detail/dtype/conversion.hpp
 * @brief Bit-level float <-> narrow-float conversions shared by the host and device backends.
 *
 * One generic routine rounds an fp32 value to a binary format with `ExponentBits` exponent bits
 * and `MantissaBits` stored mantissa bits, round-to-nearest-even, with the format's overflow rule:
 *  - IEEE-like formats (fp16) overflow to infinity;
 *  - the fp8 formats saturate to the largest finite value, as the CUDA fp8 types do with
 *    __NV_SATFINITE (inputs of infinite magnitude included); NaN stays NaN.
 * bf16 shares fp32's exponent range and is rounded directly on the fp32 bits.
 */
#pragma once

#include <inferscale/config.hpp>

#include <cstdint>
#include <cstring>

namespace inferscale::detail {

/// @brief Reinterprets the bits of a float (memcpy is the portable, host and device, bit cast).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint32_t float_bits(float x) noexcept
{
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

/// @brief Builds a float from its bits.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float bits_to_float(std::uint32_t bits) noexcept
{
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

/**
 * @brief Description of a narrow binary floating-point format.
 * @tparam ExponentBits  width of the exponent field
 * @tparam MantissaBits  width of the stored mantissa field
 * @tparam IeeeSpecials  true: all-ones exponent encodes Inf/NaN (fp16, e5m2);
 *                       false: only S.1111.111 is NaN, no infinity (e4m3, "FN" format)
 * @tparam Saturate      true: overflow and infinite inputs give the largest finite value
 */
template <int ExponentBits, int MantissaBits, bool IeeeSpecials, bool Saturate>
struct narrow_format {
  static constexpr int exponent_bits      = ExponentBits;
  static constexpr int mantissa_bits      = MantissaBits;
  static constexpr int bias               = (1 << (ExponentBits - 1)) - 1;
  static constexpr int min_exponent       = 1 - bias;  ///< exponent of the smallest normal number
  static constexpr int total_bits         = 1 + ExponentBits + MantissaBits;
  static constexpr std::uint32_t sign_bit = 1u << (ExponentBits + MantissaBits);
  static constexpr std::uint32_t exponent_mask = ((1u << ExponentBits) - 1u) << MantissaBits;
  static constexpr std::uint32_t mantissa_mask = (1u << MantissaBits) - 1u;
  /// Largest finite magnitude code.
  static constexpr std::uint32_t max_finite_code =
    IeeeSpecials ? (exponent_mask - (1u << MantissaBits)) | mantissa_mask
                 : (exponent_mask | mantissa_mask) - 1u;
  static constexpr std::uint32_t infinity_code = exponent_mask;  // only meaningful if IeeeSpecials
  /// The canonical quiet NaN code (magnitude).
  static constexpr std::uint32_t nan_code =
    IeeeSpecials ? exponent_mask | (1u << (MantissaBits - 1)) : exponent_mask | mantissa_mask;
  static constexpr bool ieee_specials = IeeeSpecials;
  static constexpr bool saturate      = Saturate;
};

using fp16_format = narrow_format<5, 10, true, false>;
using e4m3_format = narrow_format<4, 3, false, true>;
using e5m2_format = narrow_format<5, 2, true, true>;

/// @brief Rounds an fp32 value to `Format`, round-to-nearest-even, returning the code.
template <class Format>
INFERSCALE_HOST_DEVICE inline std::uint32_t float_to_narrow(float x) noexcept
{
  std::uint32_t const bits           = float_bits(x);
  std::uint32_t const sign           = (bits >> 31) ? Format::sign_bit : 0u;
  std::uint32_t const magnitude_bits = bits & 0x7fffffffu;

  if (magnitude_bits > 0x7f800000u) { return sign | Format::nan_code; }  // NaN
  if (magnitude_bits == 0x7f800000u) {                                   // +-Inf
    return sign | (Format::saturate ? Format::max_finite_code : Format::infinity_code);
  }
  int const float_exponent = static_cast<int>(magnitude_bits >> 23) - 127;
  // fp32 subnormals are far below half the smallest subnormal of every narrow format here.
  if ((magnitude_bits >> 23) == 0) { return sign; }
  std::uint32_t const significand = (magnitude_bits & 0x7fffffu) | 0x800000u;  // 24 bits

  // Quantum (weight of the last kept bit) is 2^(max(e, emin) - M); drop that many fp32 bits.
  int const kept_exponent =
    float_exponent > Format::min_exponent ? float_exponent : Format::min_exponent;
  int const shift = 23 - Format::mantissa_bits + (kept_exponent - float_exponent);
  if (shift > 25) { return sign; }  // below half the smallest subnormal: rounds to (signed) zero

  std::uint32_t rounded    = significand >> shift;
  std::uint32_t const rest = significand & ((1u << shift) - 1u);
  std::uint32_t const half = 1u << (shift - 1);
  if (rest > half || (rest == half && (rounded & 1u))) { ++rounded; }

  // For normal results `rounded` carries the implicit bit, which adds one to the exponent field;
  // a carry out of the mantissa moves to the next binade by the same addition.
  std::uint32_t const code =
    (static_cast<std::uint32_t>(kept_exponent - Format::min_exponent) << Format::mantissa_bits) +
    rounded;
  if (code > Format::max_finite_code) {
    return sign | (Format::saturate ? Format::max_finite_code : Format::infinity_code);
  }
  return sign | code;
}

/// @brief Widens a `Format` code to fp32 (exact: every narrow value is an fp32 value).
template <class Format>
INFERSCALE_HOST_DEVICE inline float narrow_to_float(std::uint32_t code) noexcept
{
  std::uint32_t const sign      = (code & Format::sign_bit) ? 0x80000000u : 0u;
  std::uint32_t const exponent  = (code & Format::exponent_mask) >> Format::mantissa_bits;
  std::uint32_t const mantissa  = code & Format::mantissa_mask;
  std::uint32_t const magnitude = code & (Format::exponent_mask | Format::mantissa_mask);

  if constexpr (Format::ieee_specials) {
    if (exponent == (Format::exponent_mask >> Format::mantissa_bits)) {
      return bits_to_float(sign | 0x7f800000u | (mantissa ? 0x400000u : 0u));
    }
  } else {
    if (magnitude == (Format::exponent_mask | Format::mantissa_mask)) {
      return bits_to_float(sign | 0x7fc00000u);
    }
  }
  if (exponent == 0) {
    // Subnormal: mantissa * 2^(emin - M), an exact product of small powers of two.
    float const quantum = bits_to_float(
      static_cast<std::uint32_t>(Format::min_exponent - Format::mantissa_bits + 127) << 23);
    float const value = static_cast<float>(mantissa) * quantum;
    return bits_to_float(sign | float_bits(value));
  }
  std::uint32_t const float_exponent =
    static_cast<std::uint32_t>(static_cast<int>(exponent) - Format::bias + 127);
  return bits_to_float(sign | (float_exponent << 23) | (mantissa << (23 - Format::mantissa_bits)));
}

/**
 * @brief Rounds fp32 to IEEE fp16 bits, round-to-nearest-even, overflow to infinity, NaN quiet.
 *
 * Same result as float_to_narrow<fp16_format>, with fewer branches, so that host loops vectorise:
 * normal results round by an integer add on the fp32 bits (the carry moves into the exponent);
 * subnormal results let the FPU round, by adding 0.5f, whose ulp (2^-24) is fp16's subnormal step.
 */
INFERSCALE_HOST_DEVICE inline std::uint16_t float_to_half_bits(float x) noexcept
{
  std::uint32_t const bits      = float_bits(x);
  std::uint32_t const sign      = (bits >> 16) & 0x8000u;
  std::uint32_t const magnitude = bits & 0x7fffffffu;
  std::uint32_t code;
  if (magnitude >= 0x477ff000u) {  // >= 65520 (rounds past 65504), infinity or NaN
    code = magnitude > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (magnitude < 0x38800000u) {  // below 2^-14: subnormal or zero
    code = float_bits(bits_to_float(magnitude) + 0.5f) - 0x3f000000u;
  } else {
    std::uint32_t const odd = (magnitude >> 13) & 1u;
    // rebias the exponent (127 -> 15) and add half an fp16 ulp minus one, plus the tie breaker
    code = (magnitude - (112u << 23) + 0xfffu + odd) >> 13;
  }
  return static_cast<std::uint16_t>(sign | code);
}

/**
 * @brief Widens fp16 bits to fp32 (exact). Normals rebias the exponent with an integer add;
 * subnormals are `mantissa * 2^-24`, a product of normal floats, so flush-to-zero or
 * denormals-are-zero modes (set by some frameworks) cannot change the result.
 */
INFERSCALE_HOST_DEVICE inline float half_bits_to_float(std::uint16_t h) noexcept
{
  std::uint32_t const sign      = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const magnitude = static_cast<std::uint32_t>(h & 0x7fffu) << 13;
  std::uint32_t result;
  if (magnitude >= (0x7c00u << 13)) {  // infinity or NaN: all-ones exponent, payload kept
    result = 0x7f800000u | (magnitude & 0x7fe000u);
  } else if (magnitude >= (0x0400u << 13)) {  // normal: exponent 15 -> 127
    result = magnitude + (112u << 23);
  } else {  // zero or subnormal
    result = float_bits(static_cast<float>(h & 0x3ffu) * bits_to_float(0x33800000u));  // x 2^-24
  }
  return bits_to_float(sign | result);
}

/// @brief Rounds fp32 to bf16 bits, round-to-nearest-even; overflow gives infinity, NaN stays NaN.
INFERSCALE_HOST_DEVICE inline std::uint16_t float_to_bfloat16_bits(float x) noexcept
{
  std::uint32_t const bits = float_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<std::uint16_t>((bits >> 16) | 0x40u);  // keep sign and payload top, quiet
  }
  std::uint32_t const lsb = (bits >> 16) & 1u;
  return static_cast<std::uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

/// @brief Widens bf16 bits to fp32 (exact).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float bfloat16_bits_to_float(
  std::uint16_t bits) noexcept
{
  return bits_to_float(static_cast<std::uint32_t>(bits) << 16);
}

}  // namespace inferscale::detail
