/**
 * @file detail/dtype/vector_conversion.hpp
 * @brief Host vector conversions between fp32 and the narrow element types (bf16, fp16, fp8
 * e4m3/e5m2), eight lanes at a time with AVX2 (F16C for fp16) or sixteen with AVX-512F, chosen at
 * run time.
 *
 * A portable x86-64 build (no -march flags) compiles these functions with GCC target attributes
 * and calls them only after `__builtin_cpu_supports` says the CPU has the instructions, so one
 * binary runs everywhere and is fast where it can be: sixteen lanes with AVX-512F (namespace
 * simd512), eight with AVX2 (namespace simd), the scalar routines elsewhere. Every function gives
 * exactly the bits of the scalar routines of detail/dtype/conversion.hpp (round to nearest even,
 * fp16/bf16 overflow to infinity, fp8 saturation, the same NaN codes), whatever flush-to-zero or
 * denormals-are-zero mode a framework has set: narrow subnormals go through integer arithmetic or
 * through additions whose operands and results are normal floats. tests/dtype checks every 16-bit
 * input and a large set of fp32 inputs against the scalar routines.
 *
 * Elsewhere (nvcc's device pass, non-x86 targets, other compilers, or with INFERSCALE_NO_HOST_SIMD
 * defined) INFERSCALE_HOST_X86_SIMD is 0 and the callers keep their scalar loops.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/dtype/conversion.hpp>
#include <inferscale/dtype.hpp>

#include <cstdint>
#include <type_traits>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__) && \
  !defined(INFERSCALE_NO_HOST_SIMD)
#define INFERSCALE_HOST_X86_SIMD 1
// GCC 12 warns, where an AVX-512 intrinsic is inlined, that its _mm512_undefined_*() operand is
// uninitialized (a false positive: the lanes are overwritten). The warning points into the
// intrinsics header, so it is silenced for that header's text only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <cpuid.h>  // __get_cpuid: F16C (clang 14's __builtin_cpu_supports does not know "f16c")
#else
#define INFERSCALE_HOST_X86_SIMD 0
#endif

namespace inferscale::detail {

/// @brief The host vector instruction sets the library can use, in increasing order.
enum class host_simd : std::uint8_t {
  scalar,  ///< portable C++ only
  avx2,  ///< AVX2 + F16C + FMA (8 fp32 lanes; every x86-64 CPU with AVX2 since 2013 has all three)
  avx512,      ///< AVX-512F as well (16 fp32 lanes, mask registers)
  avx512_bf16  ///< AVX-512BW and AVX-512 BF16 as well (native fp32 -> bf16 rounding, e.g. Intel
               ///< Sapphire Rapids, AMD Zen 4); everything else runs as at avx512
};

/// @brief True from the avx512 level on.
inline constexpr bool uses_avx512(host_simd level) noexcept
{
  return static_cast<std::uint8_t>(level) >= static_cast<std::uint8_t>(host_simd::avx512);
}

/// @brief The best level the running CPU supports (detected once).
inline host_simd detected_host_simd() noexcept
{
#if INFERSCALE_HOST_X86_SIMD
  static host_simd const level = [] {
    __builtin_cpu_init();
    // F16C from CPUID leaf 1 (ECX bit 29): GCC knows "f16c" as a feature name, clang 14 does not.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    bool const f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
    bool const avx2 = __builtin_cpu_supports("avx2") && f16c && __builtin_cpu_supports("fma");
    if (!avx2) { return host_simd::scalar; }
    if (!__builtin_cpu_supports("avx512f")) { return host_simd::avx2; }
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bf16")
             ? host_simd::avx512_bf16
             : host_simd::avx512;
  }();
  return level;
#else
  return host_simd::scalar;
#endif
}

/// @brief The cap set by set_host_simd_cap (the highest level by default).
inline host_simd& host_simd_cap_storage() noexcept
{
  static host_simd cap = host_simd::avx512_bf16;
  return cap;
}

/**
 * @brief Caps the vector level the host backend uses (tests compare every level with the scalar
 * one; benchmarks measure the scalar path of the same binary). Not thread-safe against running
 * host injections or rotations: set it before starting them.
 */
inline void set_host_simd_cap(host_simd cap) noexcept { host_simd_cap_storage() = cap; }

/// @brief The level in use: what the CPU has, at most the cap.
inline host_simd active_host_simd() noexcept
{
  host_simd const detected = detected_host_simd();
  host_simd const cap      = host_simd_cap_storage();
  return static_cast<std::uint8_t>(detected) < static_cast<std::uint8_t>(cap) ? detected : cap;
}

}  // namespace inferscale::detail

#if INFERSCALE_HOST_X86_SIMD

/**
 * @brief Target attribute of the vector functions: AVX2, F16C and FMA. With FMA enabled GCC may
 * contract a multiplication and an addition into one fused operation (-ffp-contract=fast, the GNU
 * dialects' default); the code that must round each product keeps it out of reach with
 * simd::opaque.
 */
#define INFERSCALE_TARGET_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace inferscale::detail::simd {

/// @brief `x`, hidden from the optimiser, so that a product cannot be contracted with the
/// addition it feeds (each must be rounded on its own, as in the scalar code and on the device).
INFERSCALE_TARGET_AVX2 inline __m256 opaque(__m256 x)
{
  asm("" : "+x"(x));
  return x;
}

/// @brief Eight int32 constants.
INFERSCALE_TARGET_AVX2 inline __m256i splat(std::uint32_t v)
{
  return _mm256_set1_epi32(static_cast<int>(v));
}

/// @brief Lane-wise `a > b` of values below 2^31 (a signed compare is an unsigned one there).
INFERSCALE_TARGET_AVX2 inline __m256i greater(__m256i a, __m256i b)
{
  return _mm256_cmpgt_epi32(a, b);
}

/// @brief Picks `b` where `mask` is all ones, `a` elsewhere.
INFERSCALE_TARGET_AVX2 inline __m256i select(__m256i a, __m256i b, __m256i mask)
{
  return _mm256_blendv_epi8(a, b, mask);
}

/// @brief Narrows eight 16-bit values held in int32 lanes to eight uint16 (lane order kept).
INFERSCALE_TARGET_AVX2 inline __m128i pack_u16(__m256i v)
{
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

// ------------------------------------------------------------------------------------------------
// bf16

/// @brief Eight bf16 codes (uint16) to fp32 (exact: the bits move up by 16).
INFERSCALE_TARGET_AVX2 inline __m256 bf16_to_fp32(__m128i codes)
{
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(codes), 16));
}

/// @brief fp32 to eight bf16 codes: as float_to_bfloat16_bits (nearest even; NaN quiet, sign and
/// payload top kept).
INFERSCALE_TARGET_AVX2 inline __m128i fp32_to_bf16(__m256 x)
{
  __m256i const bits      = _mm256_castps_si256(x);
  __m256i const magnitude = _mm256_and_si256(bits, splat(0x7fffffffu));
  __m256i const high      = _mm256_srli_epi32(bits, 16);
  __m256i const lsb       = _mm256_and_si256(high, splat(1u));
  __m256i const rounded =
    _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, splat(0x7fffu)), lsb), 16);
  __m256i const quiet = _mm256_or_si256(high, splat(0x40u));
  return pack_u16(select(rounded, quiet, greater(magnitude, splat(0x7f800000u))));
}

// ------------------------------------------------------------------------------------------------
// fp16

/// @brief Eight fp16 codes to fp32, as half_bits_to_float: F16C for finite values (exact, and
/// not subject to denormals-are-zero), the scalar routine's payload rule for NaN (kept, not
/// quieted, as it shifts the code up).
INFERSCALE_TARGET_AVX2 inline __m256 fp16_to_fp32(__m128i codes)
{
  __m256 const converted = _mm256_cvtph_ps(codes);
  __m256i const wide     = _mm256_cvtepu16_epi32(codes);
  __m256i const nan =
    greater(_mm256_and_si256(wide, splat(0x7fffu)), splat(0x7c00u));  // exponent 31, mantissa != 0
  __m256i const sign     = _mm256_slli_epi32(_mm256_and_si256(wide, splat(0x8000u)), 16);
  __m256i const payload  = _mm256_slli_epi32(_mm256_and_si256(wide, splat(0x3ffu)), 13);
  __m256i const nan_bits = _mm256_or_si256(_mm256_or_si256(sign, splat(0x7f800000u)), payload);
  return _mm256_castsi256_ps(select(_mm256_castps_si256(converted), nan_bits, nan));
}

/// @brief fp32 to eight fp16 codes, as float_to_half_bits: F16C's round to nearest even for
/// numbers (overflow to infinity), the canonical quiet NaN 0x7e00 with the input's sign for NaN.
INFERSCALE_TARGET_AVX2 inline __m128i fp32_to_fp16(__m256 x)
{
  __m128i const converted = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256i const bits      = _mm256_castps_si256(x);
  __m256i const nan       = greater(_mm256_and_si256(bits, splat(0x7fffffffu)), splat(0x7f800000u));
  __m256i const nan_code =
    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 16), splat(0x8000u)), splat(0x7e00u));
  __m256i const numbers = _mm256_cvtepu16_epi32(converted);
  return pack_u16(select(numbers, nan_code, nan));
}

// ------------------------------------------------------------------------------------------------
// fp8 (e4m3, e5m2): saturating formats of detail/dtype/conversion.hpp

/// @brief The fp32 bit patterns fp32_to_narrow_codes works with, for a saturating 8-bit `Format`.
template <class Format>
struct narrow_rounding_constants {
  static constexpr int drop = 23 - Format::mantissa_bits;  ///< fp32 mantissa bits rounded off
  /// fp32 bits of 2^emin, the format's smallest normal value
  static constexpr std::uint32_t smallest_normal =
    static_cast<std::uint32_t>(Format::min_exponent + 127) << 23;
  /// fp32 bits of the value a code stands for (a normal one, or past the largest finite)
  static constexpr std::uint32_t value_bits(std::uint32_t code)
  {
    return (((code >> Format::mantissa_bits) + 127u - static_cast<std::uint32_t>(Format::bias))
            << 23) |
           ((code & Format::mantissa_mask) << drop);
  }
  static constexpr std::uint32_t max_finite_bits = value_bits(Format::max_finite_code);
  /// the value whose code is the format's NaN code (NaN inputs are clamped to it)
  static constexpr std::uint32_t nan_value_bits = value_bits(Format::nan_code);
  /// added to `e + (e >> drop)` (e: an exponent's bits, at least smallest_normal): the bits of
  /// 2^(E + drop) (whose ulp is the format's step at E) plus, in the mantissa, the code offset
  /// (E - emin) 2^M
  static constexpr std::uint32_t magic_offset =
    (static_cast<std::uint32_t>(drop) << 23) - (smallest_normal >> drop);
};

/**
 * @brief fp32 to eight codes (int32 lanes) of a saturating narrow `Format`, as float_to_narrow.
 *
 * The magnitude is clamped to the largest finite value (what saturation gives for anything above
 * it, infinity included; a NaN passes the float minimum, then the integer minimum makes it the
 * value whose code is the NaN code). The rounding is then one float addition: with `E` the
 * magnitude's exponent, at least the format's smallest normal one emin, `s = |x| + m` with
 * `m = 2^(E + 23 - M) (1 + j 2^-23)`, `j = (E - emin) 2^M` (M mantissa bits): the format's step
 * at E is the ulp of `m`, so the addition rounds |x| to it, to nearest even, and the low bits of
 * `s` are `j + round(|x| / step)`, which is the code (normal results: `2^M + mantissa` steps,
 * `2^(M+1)` after a carry into the next binade; subnormal ones: the code itself, j = 0). Both
 * operands' and the sum's exponents are normal, so FTZ/DAZ cannot change it (a subnormal fp32
 * |x|, zero under DAZ, gives code 0 either way). The low byte is the code; the sign goes to bit 7.
 */
template <class Format>
INFERSCALE_TARGET_AVX2 inline __m256i fp32_to_narrow_codes(__m256 x)
{
  static_assert(Format::saturate && Format::total_bits == 8,
                "fp32_to_narrow_codes: the saturating 8-bit formats");
  using k                = narrow_rounding_constants<Format>;
  __m256i const bits     = _mm256_castps_si256(x);
  __m256 const magnitude = _mm256_castsi256_ps(_mm256_and_si256(bits, splat(0x7fffffffu)));
  __m256i const clamped  = _mm256_min_epu32(
    _mm256_castps_si256(_mm256_min_ps(_mm256_castsi256_ps(splat(k::max_finite_bits)), magnitude)),
    splat(k::nan_value_bits));
  __m256i const exponent =
    _mm256_max_epu32(_mm256_and_si256(clamped, splat(0x7f800000u)), splat(k::smallest_normal));
  __m256i const magic = _mm256_add_epi32(
    _mm256_add_epi32(exponent, _mm256_srli_epi32(exponent, k::drop)), splat(k::magic_offset));
  __m256i const sum =
    _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(clamped), _mm256_castsi256_ps(magic)));
  __m256i const sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), splat(Format::sign_bit));
  return _mm256_or_si256(sign, _mm256_and_si256(sum, splat(0x7fu)));
}

/// @brief fp32 to eight fp8 codes (the low 8 bytes of the result).
template <class Format>
INFERSCALE_TARGET_AVX2 inline __m128i fp32_to_narrow8(__m256 x)
{
  __m128i const words = pack_u16(fp32_to_narrow_codes<Format>(x));
  return _mm_packus_epi16(words, words);
}

/**
 * @brief Eight codes (int32 lanes) of an 8-bit `Format` to fp32, as narrow_to_float: normals by
 * moving the fields into place and rebiasing the exponent with an integer add; subnormals as
 * `mantissa * 2^(emin - M)` (an int-to-float conversion and a multiplication of normal floats);
 * infinity and NaN as the scalar routine spells them.
 */
template <class Format>
INFERSCALE_TARGET_AVX2 inline __m256 narrow_codes_to_fp32(__m256i codes)
{
  constexpr int shift            = 23 - Format::mantissa_bits;
  constexpr std::uint32_t rebias = static_cast<std::uint32_t>(127 - Format::bias) << 23;
  constexpr std::uint32_t quantum =
    static_cast<std::uint32_t>(Format::min_exponent - Format::mantissa_bits + 127) << 23;
  constexpr std::uint32_t magnitude_mask = Format::exponent_mask | Format::mantissa_mask;

  __m256i const sign      = _mm256_slli_epi32(_mm256_and_si256(codes, splat(Format::sign_bit)),
                                         31 - (Format::total_bits - 1));
  __m256i const magnitude = _mm256_and_si256(codes, splat(magnitude_mask));
  __m256i const mantissa  = _mm256_and_si256(codes, splat(Format::mantissa_mask));
  __m256i const normal    = _mm256_add_epi32(_mm256_slli_epi32(magnitude, shift), splat(rebias));
  __m256i const subnormal = _mm256_castps_si256(
    _mm256_mul_ps(_mm256_cvtepi32_ps(mantissa), _mm256_castsi256_ps(splat(quantum))));
  __m256i value = select(normal, subnormal, greater(splat(Format::mantissa_mask + 1u), magnitude));
  if constexpr (Format::ieee_specials) {
    __m256i const special = greater(magnitude, splat(Format::exponent_mask - 1u));
    __m256i const nan     = greater(magnitude, splat(Format::exponent_mask));
    __m256i const special_bits =
      _mm256_or_si256(splat(0x7f800000u), _mm256_and_si256(nan, splat(0x400000u)));
    value = select(value, special_bits, special);
  } else {
    value = select(value, splat(0x7fc00000u), _mm256_cmpeq_epi32(magnitude, splat(magnitude_mask)));
  }
  return _mm256_castsi256_ps(_mm256_or_si256(sign, value));
}

// ------------------------------------------------------------------------------------------------
// Element-type level: eight elements of T from/to fp32 lanes

/// @brief Loads eight elements of `T` (unaligned) as fp32 (exact).
template <class T>
INFERSCALE_TARGET_AVX2 inline __m256 load8(T const* p)
{
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return bf16_to_fp32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  } else if constexpr (std::is_same_v<T, half_t>) {
    return fp16_to_fp32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  } else {
    using format = std::conditional_t<std::is_same_v<T, float8_e4m3_t>, e4m3_format, e5m2_format>;
    __m128i const bytes = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(p));
    return narrow_codes_to_fp32<format>(_mm256_cvtepu8_epi32(bytes));
  }
}

/// @brief Rounds eight fp32 lanes to `T` and stores them (unaligned), as from_float<T>.
template <class T>
INFERSCALE_TARGET_AVX2 inline void store8(T* p, __m256 x)
{
  if constexpr (std::is_same_v<T, float>) {
    _mm256_storeu_ps(p, x);
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp32_to_bf16(x));
  } else if constexpr (std::is_same_v<T, half_t>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp32_to_fp16(x));
  } else {
    using format = std::conditional_t<std::is_same_v<T, float8_e4m3_t>, e4m3_format, e5m2_format>;
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), fp32_to_narrow8<format>(x));
  }
}

/// @brief `to_float(from_float<T>(x))` on eight lanes (the value x takes in T).
template <class T>
INFERSCALE_TARGET_AVX2 inline __m256 round_to(__m256 x)
{
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return bf16_to_fp32(fp32_to_bf16(x));
  } else if constexpr (std::is_same_v<T, half_t>) {
    return fp16_to_fp32(fp32_to_fp16(x));
  } else {
    using format = std::conditional_t<std::is_same_v<T, float8_e4m3_t>, e4m3_format, e5m2_format>;
    return narrow_codes_to_fp32<format>(fp32_to_narrow_codes<format>(x));
  }
}

}  // namespace inferscale::detail::simd

/**
 * @brief Target attribute of the AVX-512 functions (AVX-512F includes fused multiply-adds, so the
 * same contraction rule as INFERSCALE_TARGET_AVX2 applies: see simd512::opaque).
 */
#define INFERSCALE_TARGET_AVX512 __attribute__((target("avx512f,avx2,f16c,fma")))

/// @brief The AVX-512F forms of the simd namespace's functions (sixteen lanes; same bits).
namespace inferscale::detail::simd512 {

/// @brief `x`, hidden from the optimiser (no contraction of a product with its addition).
INFERSCALE_TARGET_AVX512 inline __m512 opaque(__m512 x)
{
  asm("" : "+v"(x));
  return x;
}

INFERSCALE_TARGET_AVX512 inline __m512i splat(std::uint32_t v)
{
  return _mm512_set1_epi32(static_cast<int>(v));
}

/// @brief Lanes where `a > b`, for values below 2^31.
INFERSCALE_TARGET_AVX512 inline __mmask16 greater(__m512i a, __m512i b)
{
  return _mm512_cmpgt_epi32_mask(a, b);
}

INFERSCALE_TARGET_AVX512 inline __m512 bf16_to_fp32(__m256i codes)
{
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(codes), 16));
}

INFERSCALE_TARGET_AVX512 inline __m256i fp32_to_bf16(__m512 x)
{
  __m512i const bits      = _mm512_castps_si512(x);
  __m512i const magnitude = _mm512_and_si512(bits, splat(0x7fffffffu));
  __m512i const high      = _mm512_srli_epi32(bits, 16);
  __m512i const lsb       = _mm512_and_si512(high, splat(1u));
  __m512i const rounded =
    _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, splat(0x7fffu)), lsb), 16);
  __m512i const quiet = _mm512_or_si512(high, splat(0x40u));
  return _mm512_cvtepi32_epi16(
    _mm512_mask_blend_epi32(greater(magnitude, splat(0x7f800000u)), rounded, quiet));
}

INFERSCALE_TARGET_AVX512 inline __m512 fp16_to_fp32(__m256i codes)
{
  __m512 const converted = _mm512_cvtph_ps(codes);
  __m512i const wide     = _mm512_cvtepu16_epi32(codes);
  __mmask16 const nan    = greater(_mm512_and_si512(wide, splat(0x7fffu)), splat(0x7c00u));
  __m512i const sign     = _mm512_slli_epi32(_mm512_and_si512(wide, splat(0x8000u)), 16);
  __m512i const payload  = _mm512_slli_epi32(_mm512_and_si512(wide, splat(0x3ffu)), 13);
  __m512i const nan_bits = _mm512_or_si512(_mm512_or_si512(sign, splat(0x7f800000u)), payload);
  return _mm512_castsi512_ps(
    _mm512_mask_blend_epi32(nan, _mm512_castps_si512(converted), nan_bits));
}

INFERSCALE_TARGET_AVX512 inline __m256i fp32_to_fp16(__m512 x)
{
  __m256i const converted = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512i const bits      = _mm512_castps_si512(x);
  __mmask16 const nan     = greater(_mm512_and_si512(bits, splat(0x7fffffffu)), splat(0x7f800000u));
  __m512i const nan_code =
    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(bits, 16), splat(0x8000u)), splat(0x7e00u));
  return _mm512_cvtepi32_epi16(
    _mm512_mask_blend_epi32(nan, _mm512_cvtepu16_epi32(converted), nan_code));
}

/// @brief As simd::fp32_to_narrow_codes, sixteen lanes (the sign merged by a ternary logic op;
/// the bits above the low byte are not cleared: callers keep the low byte).
template <class Format>
INFERSCALE_TARGET_AVX512 inline __m512i fp32_to_narrow_codes(__m512 x)
{
  static_assert(Format::saturate && Format::total_bits == 8,
                "fp32_to_narrow_codes: the saturating 8-bit formats");
  using k                = simd::narrow_rounding_constants<Format>;
  __m512i const bits     = _mm512_castps_si512(x);
  __m512 const magnitude = _mm512_castsi512_ps(_mm512_and_si512(bits, splat(0x7fffffffu)));
  __m512i const clamped  = _mm512_min_epu32(
    _mm512_castps_si512(_mm512_min_ps(_mm512_castsi512_ps(splat(k::max_finite_bits)), magnitude)),
    splat(k::nan_value_bits));
  __m512i const exponent =
    _mm512_max_epu32(_mm512_and_si512(clamped, splat(0x7f800000u)), splat(k::smallest_normal));
  __m512i const magic = _mm512_add_epi32(
    _mm512_add_epi32(exponent, _mm512_srli_epi32(exponent, k::drop)), splat(k::magic_offset));
  __m512i const sum =
    _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(clamped), _mm512_castsi512_ps(magic)));
  // bit 7 from the sign (moved down), bits 0-6 from the sum: (c ? a : b) with c = 0x80
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(bits, 24), sum, splat(0x80u), 0xe4);
}

/// @brief As simd::narrow_codes_to_fp32, sixteen lanes.
template <class Format>
INFERSCALE_TARGET_AVX512 inline __m512 narrow_codes_to_fp32(__m512i codes)
{
  constexpr int shift            = 23 - Format::mantissa_bits;
  constexpr std::uint32_t rebias = static_cast<std::uint32_t>(127 - Format::bias) << 23;
  constexpr std::uint32_t quantum =
    static_cast<std::uint32_t>(Format::min_exponent - Format::mantissa_bits + 127) << 23;
  constexpr std::uint32_t magnitude_mask = Format::exponent_mask | Format::mantissa_mask;

  __m512i const sign      = _mm512_slli_epi32(_mm512_and_si512(codes, splat(Format::sign_bit)),
                                         31 - (Format::total_bits - 1));
  __m512i const magnitude = _mm512_and_si512(codes, splat(magnitude_mask));
  __m512i const mantissa  = _mm512_and_si512(codes, splat(Format::mantissa_mask));
  __m512i const normal    = _mm512_add_epi32(_mm512_slli_epi32(magnitude, shift), splat(rebias));
  __m512i const subnormal = _mm512_castps_si512(
    _mm512_mul_ps(_mm512_cvtepi32_ps(mantissa), _mm512_castsi512_ps(splat(quantum))));
  __m512i value = _mm512_mask_blend_epi32(
    greater(splat(Format::mantissa_mask + 1u), magnitude), normal, subnormal);
  if constexpr (Format::ieee_specials) {
    __mmask16 const special = greater(magnitude, splat(Format::exponent_mask - 1u));
    __mmask16 const nan     = greater(magnitude, splat(Format::exponent_mask));
    __m512i const special_bits =
      _mm512_mask_blend_epi32(nan, splat(0x7f800000u), splat(0x7fc00000u));
    value = _mm512_mask_blend_epi32(special, value, special_bits);
  } else {
    value = _mm512_mask_blend_epi32(
      _mm512_cmpeq_epi32_mask(magnitude, splat(magnitude_mask)), value, splat(0x7fc00000u));
  }
  return _mm512_castsi512_ps(_mm512_or_si512(sign, value));
}

/// @brief Loads sixteen elements of `T` (unaligned) as fp32 (exact).
template <class T>
INFERSCALE_TARGET_AVX512 inline __m512 load16(T const* p)
{
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return bf16_to_fp32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  } else if constexpr (std::is_same_v<T, half_t>) {
    return fp16_to_fp32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  } else {
    using format = std::conditional_t<std::is_same_v<T, float8_e4m3_t>, e4m3_format, e5m2_format>;
    __m128i const bytes = _mm_loadu_si128(reinterpret_cast<__m128i const*>(p));
    return narrow_codes_to_fp32<format>(_mm512_cvtepu8_epi32(bytes));
  }
}

/// @brief Rounds sixteen fp32 lanes to `T` and stores them (unaligned), as from_float<T>.
template <class T>
INFERSCALE_TARGET_AVX512 inline void store16(T* p, __m512 x)
{
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), fp32_to_bf16(x));
  } else if constexpr (std::is_same_v<T, half_t>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), fp32_to_fp16(x));
  } else {
    using format = std::conditional_t<std::is_same_v<T, float8_e4m3_t>, e4m3_format, e5m2_format>;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm512_cvtepi32_epi8(fp32_to_narrow_codes<format>(x)));
  }
}

/// @brief `to_float(from_float<T>(x))` on sixteen lanes.
template <class T>
INFERSCALE_TARGET_AVX512 inline __m512 round_to(__m512 x)
{
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bfloat16_t>) {
    return bf16_to_fp32(fp32_to_bf16(x));
  } else if constexpr (std::is_same_v<T, half_t>) {
    return fp16_to_fp32(fp32_to_fp16(x));
  } else {
    using format = std::conditional_t<std::is_same_v<T, float8_e4m3_t>, e4m3_format, e5m2_format>;
    return narrow_codes_to_fp32<format>(fp32_to_narrow_codes<format>(x));
  }
}

}  // namespace inferscale::detail::simd512

/**
 * @brief Target attribute of the avx512_bf16 level: AVX-512F, BW, VL and BF16 (the BF16
 * extension's conversions need the BW mask width; the 256-bit code test is VL's).
 */
#define INFERSCALE_TARGET_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,f16c,fma")))

/// @brief The avx512_bf16 level's forms of the simd512 functions it speeds up (same bits).
namespace inferscale::detail::simd512bf16 {

/**
 * @brief fp32 to sixteen bf16 codes, as simd512::fp32_to_bf16 (float_to_bfloat16_bits): one
 * VCVTNEPS2BF16, which rounds to nearest even and quiets a NaN the same way (its top 16 bits with
 * bit 6 set), for every input but subnormals, which it reads as zero. It gives a zero code for
 * nothing else but zeros (a normal fp32 value stays normal in bf16), so a vector with a zero code
 * takes the integer rounding instead: one test of the codes, whatever the thread's
 * denormals-are-zero mode. (Checked against the integer rounding for all 2^32 inputs.)
 */
INFERSCALE_TARGET_AVX512_BF16 inline __m256i fp32_to_bf16(__m512 x)
{
  __m256i const c = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return _mm256_testn_epi16_mask(c, _mm256_set1_epi16(0x7fff)) != 0 ? simd512::fp32_to_bf16(x) : c;
}

/// @brief Sixteen bf16 codes widened to fp32 (exact).
INFERSCALE_TARGET_AVX512_BF16 inline __m512 bf16_codes_to_fp32(__m256i codes)
{
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(codes), 16));
}

}  // namespace inferscale::detail::simd512bf16

#endif  // INFERSCALE_HOST_X86_SIMD
