/**
 * @file detail/rope/sincos.hpp
 * @brief sin and cos of an fp32 rotary angle, the same bits on the host and on the device, and
 * unaffected by the consumer's `--use_fast_math`.
 *
 * The angle (an fp32 value, e.g. `float(p) * inv_freq`) is taken exactly into double precision and
 * reduced to `r` in about [-pi/4, pi/4] with a quadrant `q`; sin and cos of `r` are evaluated by
 * their Taylor series in double (Horner's scheme of fused multiply-adds), and the quadrant's pair
 * is rounded once to fp32. Only IEEE double multiplications, additions and fused multiply-adds
 * (each rounded once, none contracted or split by the compiler) and integer operations are used,
 * so every backend that rounds them correctly gets the same result: the host's scalar loop,
 * its AVX2 and AVX-512 forms (rotate_simd.hpp), and the device kernels. nvcc's fast-math options
 * change only single-precision operations, so they do not reach this code.
 *
 * Accuracy: the double result is within about 2^-52 (relative) of the true value, so the fp32
 * result is the correctly rounded one except where the true value lies within that distance of a
 * rounding midpoint (tests/rope/sincos_host.cpp checks it against `sinl`/`cosl`).
 *
 * Reduction: `|angle| < 2^28` subtracts `k * pi/2`, `k = rint(angle * 2/pi)`, in five 24-bit parts
 * by fused multiply-adds (the first exact); larger angles take an exact integer reduction against
 * 256 bits of 2/pi (Payne and Hanek's method). Constants: the Taylor coefficients are `±1/n!` and
 * pi/2 and 2/pi are their binary expansions, all rounded to the nearest double (the hex digits
 * of 2/pi and pi/2 are those printed in many references, e.g. fdlibm's `__ieee754_rem_pio2`
 * tables, and were recomputed here from Machin's formula).
 */
#pragma once

#include <inferscale/config.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace inferscale::detail::sincos {

/// @brief 2/pi rounded to double (the reduction's quotient estimate).
inline constexpr double two_over_pi = 0x1.45f306dc9c883p-1;
/// @brief pi/2 in five parts of 24 significant bits: their sum is pi/2 within 2^-120.
inline constexpr double pio2_1 = 0x1.921fb4p+0;
inline constexpr double pio2_2 = 0x1.4442d0p-24;
inline constexpr double pio2_3 = 0x1.846988p-48;
inline constexpr double pio2_4 = 0x1.8cc516p-72;
inline constexpr double pio2_5 = 0x1.01b838p-96;
/// @brief Angles at or above this magnitude take the integer reduction.
inline constexpr double cody_waite_limit = 0x1p28;
/// @brief pi/2 * 2^-62: one unit of the integer reduction's fraction, in radians.
inline constexpr double pio2_scaled = 0x1.921fb54442d18p-62;

/// @brief sin r = r + r z (s1 + z (s2 + ... z s7)), z = r^2: the Taylor coefficients -1/3!, 1/5!,
/// ..., -1/15! (the first term left out, 1/17!, is below 2^-48, so |error| < 2^-55 at pi/4).
inline constexpr double s1 = -0x1.5555555555555p-3;
inline constexpr double s2 = 0x1.1111111111111p-7;
inline constexpr double s3 = -0x1.a01a01a01a01ap-13;
inline constexpr double s4 = 0x1.71de3a556c734p-19;
inline constexpr double s5 = -0x1.ae64567f544e4p-26;
inline constexpr double s6 = 0x1.6124613a86d09p-33;
inline constexpr double s7 = -0x1.ae7f3e733b81fp-41;
/// @brief cos r = 1 + z (c1 + z (c2 + ... z c8)): -1/2!, 1/4!, ..., 1/16!.
inline constexpr double c1 = -0x1.0000000000000p-1;
inline constexpr double c2 = 0x1.5555555555555p-5;
inline constexpr double c3 = -0x1.6c16c16c16c17p-10;
inline constexpr double c4 = 0x1.a01a01a01a01ap-16;
inline constexpr double c5 = -0x1.27e4fb7789f5cp-22;
inline constexpr double c6 = 0x1.1eed8eff8d898p-29;
inline constexpr double c7 = -0x1.93974a8c07c9dp-37;
inline constexpr double c8 = 0x1.ae7f3e733b81fp-45;

/// @brief The first 256 bits of 2/pi (0.a2f9836e... in hexadecimal), most significant first.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::uint32_t two_over_pi_word(int i)
{
  switch (i) {
    case 0: return 0xa2f9836eu;
    case 1: return 0x4e441529u;
    case 2: return 0xfc2757d1u;
    case 3: return 0xf534ddc0u;
    case 4: return 0xdb629599u;
    case 5: return 0x3c439041u;
    case 6: return 0xfe5163abu;
    default: return 0xdebbc561u;
  }
}

/// @brief `a * b` rounded once, never fused with the addition it feeds.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE double mul(double a, double b)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __dmul_rn(a, b);
#else
  return unfused(a * b);
#endif
}
/// @brief `a * b + c` rounded once (a fused multiply-add on every backend).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE double fma(double a, double b, double c)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
/// @brief `a + b` rounded once.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE double add(double a, double b)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

/**
 * @brief Integer reduction of a finite fp32 angle `a >= 2^28`: returns the quadrant `q` (0..3)
 * and `*r` in [-pi/4, pi/4] with `a = (4m + q) pi/2 + r` for an integer m.
 *
 * `a = M 2^E` (M the 24-bit significand, E >= 5); `a 2/pi mod 4` needs the bits of 2/pi from
 * 2^-(E-1) on (the higher ones give multiples of 4). A 128-bit window W of them times M, modulo
 * 2^128, is `a 2/pi mod 4` in units of 2^-126; the bits past the window change it by under 2^-102.
 */
INFERSCALE_HOST_DEVICE inline int reduce_large(float a, double* r)
{
  std::uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  int const e           = static_cast<int>((bits >> 23) & 0xffu) - 150;  // a = m 2^e
  std::uint64_t const m = (bits & 0x7fffffu) | 0x800000u;
  int const offset      = e - 2;  // 0-based index of the window's first bit (2^-(e-1))
  int const word        = offset / 32;
  int const shift       = offset % 32;
  std::uint32_t window[4];
  for (int n = 0; n < 4; ++n) {
    std::uint32_t const hi = two_over_pi_word(word + n);
    std::uint32_t const lo = two_over_pi_word(word + n + 1);
    window[n]              = shift == 0 ? hi : (hi << shift) | (lo >> (32 - shift));
  }
  // m * window mod 2^128, word by word from the least significant (each partial product < 2^57).
  std::uint32_t product[4];
  std::uint64_t carry = 0;
  for (int n = 3; n >= 0; --n) {
    std::uint64_t const p = m * window[n] + carry;
    product[n]            = static_cast<std::uint32_t>(p);
    carry                 = p >> 32;
  }
  std::uint64_t const hi = (static_cast<std::uint64_t>(product[0]) << 32) | product[1];
  std::uint64_t const lo = (static_cast<std::uint64_t>(product[2]) << 32) | product[3];
  // Nearest quadrant (the top two bits after rounding), and the signed rest in units of 2^-62.
  std::uint64_t const quadrant = (hi + (std::uint64_t{1} << 61)) >> 62;
  auto const rest              = static_cast<std::int64_t>(hi - (quadrant << 62));
  double const units = add(static_cast<double>(rest), mul(static_cast<double>(lo >> 11), 0x1p-53));
  *r                 = mul(units, pio2_scaled);
  return static_cast<int>(quadrant & 3u);
}

/// @brief sin and cos of the reduced argument `r`, `|r| <= pi/4` (plus rounding), in double.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void kernel(double r, double* s, double* c)
{
  double const z = mul(r, r);
  double ps      = s7;
  ps             = fma(z, ps, s6);
  ps             = fma(z, ps, s5);
  ps             = fma(z, ps, s4);
  ps             = fma(z, ps, s3);
  ps             = fma(z, ps, s2);
  ps             = fma(z, ps, s1);
  *s             = fma(mul(r, z), ps, r);
  double pc      = c8;
  pc             = fma(z, pc, c7);
  pc             = fma(z, pc, c6);
  pc             = fma(z, pc, c5);
  pc             = fma(z, pc, c4);
  pc             = fma(z, pc, c3);
  pc             = fma(z, pc, c2);
  pc             = fma(z, pc, c1);
  *c             = fma(z, pc, 1.0);
}

/// @brief Rounds a double to fp32 (to nearest even).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float to_fp32(double v)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __double2float_rn(v);
#else
  return static_cast<float>(v);
#endif
}

/**
 * @brief The fp32 results from the quadrant and the kernel's values: sin and cos of
 * `q pi/2 + r`, with sin negated for a negative angle (`negative`).
 */
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void by_quadrant(
  int q, bool negative, double sr, double cr, float* s, float* c)
{
  double const sq = (q & 1) ? cr : sr;
  double const cq = (q & 1) ? sr : cr;
  *s              = to_fp32(((q & 2) != 0) != negative ? -sq : sq);
  *c              = to_fp32(((q + 1) & 2) ? -cq : cq);
}

/**
 * @brief Quadrant and reduced argument of a finite angle's magnitude `|angle|` (see the file
 * comment; sin is odd, cos even); an infinite or NaN angle gives a NaN `r`.
 */
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE int reduce(float angle, double* r)
{
  double const x = std::fabs(static_cast<double>(angle));
  if (x < cody_waite_limit) {
    double const k = std::rint(mul(x, two_over_pi));
    double v       = fma(-k, pio2_1, x);  // exact: k pio2_1 is exact and within a factor 2 of x
    v              = fma(-k, pio2_2, v);
    v              = fma(-k, pio2_3, v);
    v              = fma(-k, pio2_4, v);
    v              = fma(-k, pio2_5, v);
    *r             = v;
    return static_cast<int>(static_cast<std::int64_t>(k) & 3);
  }
  if (!(x <= 0x1.fffffep127)) {  // infinite or NaN
    *r = add(x, -x);
    return 0;
  }
  return reduce_large(static_cast<float>(x), r);
}

}  // namespace inferscale::detail::sincos

namespace inferscale::detail {

/// @brief sin and cos of an fp32 angle, each rounded once to fp32 (see sincos.hpp).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rope_sincos(float angle, float* s, float* c)
{
  double r;
  int const q = sincos::reduce(angle, &r);
  double sr, cr;
  sincos::kernel(r, &sr, &cr);
  sincos::by_quadrant(q, std::signbit(angle), sr, cr, s, c);
}

}  // namespace inferscale::detail
