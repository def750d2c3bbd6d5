// Host tests of the element types (inferscale/dtype.hpp) and the KV geometry
// (inferscale/geometry.hpp). They run everywhere: no GPU is needed.
//
// Every expectation comes from code written here, never from the code under test:
//  - a decoder that reads sign, exponent and mantissa as each format's specification writes them
//    out (IEEE 754 binary16, bfloat16, OCP 8-bit floating point E4M3 "FN" and E5M2) and builds the
//    value with std::ldexp;
//  - two round-to-nearest-even references: a search for the nearest decoded value (a tie goes to
//    the even code, i.e. the even mantissa), and the formula |x| = n * 2^(max(e, emin) - M) with
//    the integer n rounded half to even, evaluated in double;
//  - CUDA's own host conversions (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h), an independent
//    implementation of the same rounding.
#include "float_bits.hpp"

#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using inferscale::bfloat16_t;
using inferscale::dtype;
using inferscale::float8_e4m3_t;
using inferscale::float8_e5m2_t;
using inferscale::half_t;

// ------------------------------------------------------------------------------------------------
// The formats as their specifications write them out.

enum class special_values { ieee, nan_only };  // nan_only: OCP E4M3 "FN", NaN = S.1111.111, no Inf
enum class overflow_rule { to_infinity, saturate };

template <class T>
struct format;

template <>
struct format<half_t> {  // IEEE 754 binary16
  static constexpr int total_bits                = 16;
  static constexpr int exponent_bits             = 5;
  static constexpr int mantissa_bits             = 10;
  static constexpr int bias                      = 15;
  static constexpr special_values specials       = special_values::ieee;
  static constexpr overflow_rule overflow        = overflow_rule::to_infinity;
  static constexpr double max_finite             = 65504.0;  // (2 - 2^-10) * 2^15
  static constexpr std::uint32_t max_finite_code = 0x7bffu;
};

template <>
struct format<bfloat16_t> {  // fp32's upper half
  static constexpr int total_bits                = 16;
  static constexpr int exponent_bits             = 8;
  static constexpr int mantissa_bits             = 7;
  static constexpr int bias                      = 127;
  static constexpr special_values specials       = special_values::ieee;
  static constexpr overflow_rule overflow        = overflow_rule::to_infinity;
  static constexpr double max_finite             = 0x1.fep127;  // (2 - 2^-7) * 2^127
  static constexpr std::uint32_t max_finite_code = 0x7f7fu;
};

template <>
struct format<float8_e4m3_t> {  // OCP E4M3 (saturating, as CUDA's __NV_SATFINITE)
  static constexpr int total_bits                = 8;
  static constexpr int exponent_bits             = 4;
  static constexpr int mantissa_bits             = 3;
  static constexpr int bias                      = 7;
  static constexpr special_values specials       = special_values::nan_only;
  static constexpr overflow_rule overflow        = overflow_rule::saturate;
  static constexpr double max_finite             = 448.0;  // 1.75 * 2^8
  static constexpr std::uint32_t max_finite_code = 0x7eu;
};

template <>
struct format<float8_e5m2_t> {  // OCP E5M2 (saturating, as CUDA's __NV_SATFINITE)
  static constexpr int total_bits                = 8;
  static constexpr int exponent_bits             = 5;
  static constexpr int mantissa_bits             = 2;
  static constexpr int bias                      = 15;
  static constexpr special_values specials       = special_values::ieee;
  static constexpr overflow_rule overflow        = overflow_rule::saturate;
  static constexpr double max_finite             = 57344.0;  // 1.75 * 2^15
  static constexpr std::uint32_t max_finite_code = 0x7bu;
};

template <class T>
constexpr std::uint32_t code_count = 1u << format<T>::total_bits;
template <class T>
constexpr std::uint32_t sign_bit = 1u << (format<T>::total_bits - 1);

template <class T>
T make(std::uint32_t code)
{
  return T{static_cast<decltype(T::bits)>(code)};
}

template <class T>
std::uint32_t code_of(T x)
{
  return static_cast<std::uint32_t>(x.bits);
}

using inferscale_test::bits_of;
using inferscale_test::float_from_bits;

/// Decodes `code` from its fields, as the format's specification defines the value.
template <class T>
double reference_decode(std::uint32_t code)
{
  using F                          = format<T>;
  std::uint32_t const all_exponent = (1u << F::exponent_bits) - 1u;
  std::uint32_t const all_mantissa = (1u << F::mantissa_bits) - 1u;
  bool const negative              = ((code >> (F::total_bits - 1)) & 1u) != 0;
  std::uint32_t const exponent     = (code >> F::mantissa_bits) & all_exponent;
  std::uint32_t const mantissa     = code & all_mantissa;

  double magnitude = 0.0;
  if (F::specials == special_values::ieee && exponent == all_exponent) {
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity()
                              : std::numeric_limits<double>::quiet_NaN();
  } else if (F::specials == special_values::nan_only && exponent == all_exponent &&
             mantissa == all_mantissa) {
    magnitude = std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {  // subnormal: 0.mantissa * 2^(1 - bias)
    magnitude = std::ldexp(static_cast<double>(mantissa), 1 - F::bias - F::mantissa_bits);
  } else {  // normal: 1.mantissa * 2^(exponent - bias)
    magnitude = std::ldexp(static_cast<double>((1u << F::mantissa_bits) + mantissa),
                           static_cast<int>(exponent) - F::bias - F::mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

struct table_entry {
  double value;
  std::uint32_t code;
};

/**
 * Every finite non-negative value of `T` with its code, sorted by value. Formats that overflow to
 * infinity get one more entry: the infinity code at max + ulp(max), where IEEE rounding (unbounded
 * exponent, then overflow) puts it, so that the nearest search rounds max + half ulp up to it.
 */
template <class T>
std::vector<table_entry> const& magnitude_table()
{
  static std::vector<table_entry> const table = [] {
    std::vector<table_entry> entries;
    std::uint32_t infinity_code = 0;
    for (std::uint32_t code = 0; code < sign_bit<T>; ++code) {
      double const value = reference_decode<T>(code);
      if (std::isinf(value)) { infinity_code = code; }
      if (std::isfinite(value)) { entries.push_back({value, code}); }
    }
    std::sort(entries.begin(), entries.end(), [](table_entry const& a, table_entry const& b) {
      return a.value < b.value;
    });
    if (format<T>::overflow == overflow_rule::to_infinity) {
      double const max  = entries[entries.size() - 1].value;
      double const prev = entries[entries.size() - 2].value;
      entries.push_back({max + (max - prev), infinity_code});
    }
    return entries;
  }();
  return table;
}

/// Nearest code to `x` (not NaN) by search over the decoded values, ties to the even code.
template <class T>
std::uint32_t reference_nearest_code(float x)
{
  auto const& table        = magnitude_table<T>();
  std::uint32_t const sign = std::signbit(x) ? sign_bit<T> : 0u;
  double magnitude         = std::fabs(static_cast<double>(x));
  if (format<T>::overflow == overflow_rule::saturate) {
    magnitude = std::min(magnitude, table.back().value);
  }
  if (magnitude >= table.back().value) { return sign | table.back().code; }
  auto const above =
    std::upper_bound(table.begin(), table.end(), magnitude, [](double v, table_entry const& e) {
      return v < e.value;
    });
  auto const below         = std::prev(above);
  double const down        = magnitude - below->value;
  double const up          = above->value - magnitude;
  std::uint32_t const code = down < up                  ? below->code
                             : up < down                ? above->code
                             : (below->code % 2u == 0u) ? below->code
                                                        : above->code;
  return sign | code;
}

/**
 * Round-to-nearest-even written out as a formula on the double value of `x` (not NaN): with
 * 2^e <= |x| < 2^(e+1) and the quantum 2^(max(e, emin) - M), |x| / quantum is rounded to an
 * integer, half to even; beyond the largest finite value the result is infinity or, for the
 * saturating formats, that largest value.
 */
template <class T>
double reference_round(double x)
{
  using F               = format<T>;
  bool const saturating = F::overflow == overflow_rule::saturate;
  double const infinity = std::numeric_limits<double>::infinity();
  if (std::isinf(x)) { return std::copysign(saturating ? F::max_finite : infinity, x); }
  double const magnitude = std::fabs(x);
  if (magnitude == 0.0) { return x; }
  int exponent = 0;
  (void)std::frexp(magnitude, &exponent);  // magnitude = f * 2^exponent, f in [0.5, 1)
  int const min_exponent     = 1 - F::bias;
  int const quantum_exponent = std::max(exponent - 1, min_exponent) - F::mantissa_bits;
  double const scaled        = std::ldexp(magnitude, -quantum_exponent);  // exact
  double integer             = std::floor(scaled);
  double const fraction      = scaled - integer;
  if (fraction > 0.5 || (fraction == 0.5 && std::fmod(integer, 2.0) != 0.0)) { integer += 1.0; }
  double rounded = std::ldexp(integer, quantum_exponent);
  if (rounded > F::max_finite) { rounded = saturating ? F::max_finite : infinity; }
  return std::copysign(rounded, x);
}

// ------------------------------------------------------------------------------------------------
// CUDA's host implementation of the same conversions.

template <class T>
std::uint32_t cuda_from_float(float x);
template <class T>
float cuda_to_float(std::uint32_t code);

template <>
std::uint32_t cuda_from_float<half_t>(float x)
{
  __half const h = __float2half_rn(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}
template <>
std::uint32_t cuda_from_float<bfloat16_t>(float x)
{
  __nv_bfloat16 const b = __float2bfloat16_rn(x);
  std::uint16_t bits;
  std::memcpy(&bits, &b, sizeof(bits));
  return bits;
}
template <>
std::uint32_t cuda_from_float<float8_e4m3_t>(float x)
{
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}
template <>
std::uint32_t cuda_from_float<float8_e5m2_t>(float x)
{
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
}

template <>
float cuda_to_float<half_t>(std::uint32_t code)
{
  __half_raw raw;
  raw.x = static_cast<unsigned short>(code);
  return __half2float(__half(raw));
}
template <>
float cuda_to_float<bfloat16_t>(std::uint32_t code)
{
  __nv_bfloat16_raw raw;
  raw.x = static_cast<unsigned short>(code);
  return __bfloat162float(__nv_bfloat16(raw));
}
template <>
float cuda_to_float<float8_e4m3_t>(std::uint32_t code)
{
  return __half2float(
    __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
}
template <>
float cuda_to_float<float8_e5m2_t>(std::uint32_t code)
{
  return __half2float(
    __half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E5M2)));
}

// ------------------------------------------------------------------------------------------------
// Reporting: loops over millions of values count their mismatches and show the first few, rather
// than making one Catch assertion per value.

std::string describe(float x)
{
  char text[64];
  std::snprintf(text, sizeof(text), "%a (0x%08x)", static_cast<double>(x), bits_of(x));
  return text;
}

std::string hex(std::uint32_t code)
{
  char text[16];
  std::snprintf(text, sizeof(text), "0x%x", code);
  return text;
}

class mismatch_log {
 public:
  void add(std::string what)
  {
    if (count_ < max_shown_) { shown_ += what + "\n"; }
    ++count_;
  }
  std::size_t count() const noexcept { return count_; }
  std::string const& first_mismatches() const noexcept { return shown_; }

 private:
  static constexpr std::size_t max_shown_ = 8;
  std::size_t count_{};
  std::string shown_;
};

/// True when `a` and `b` are the same float bit for bit, or both NaN (payloads may differ).
bool same_float(float a, float b)
{
  if (std::isnan(a) || std::isnan(b)) { return std::isnan(a) && std::isnan(b); }
  return bits_of(a) == bits_of(b);
}

/// Checks from_float<T>(x) against the nearest-value search (and for NaN, that it stays NaN).
template <class T>
void check_nearest(float x, mismatch_log& log)
{
  std::uint32_t const got = code_of(inferscale::from_float<T>(x));
  if (std::isnan(x)) {
    if (!std::isnan(reference_decode<T>(got))) { log.add(describe(x) + " -> " + hex(got)); }
    return;
  }
  std::uint32_t const expected = reference_nearest_code<T>(x);
  if (got != expected) {
    log.add(describe(x) + " -> " + hex(got) + ", nearest (ties to even) is " + hex(expected));
  }
}

/// Checks from_float<T>(x) against the rounding formula.
template <class T>
void check_formula(float x, mismatch_log& log)
{
  std::uint32_t const got = code_of(inferscale::from_float<T>(x));
  double const decoded    = reference_decode<T>(got);
  if (std::isnan(x)) {
    if (!std::isnan(decoded)) { log.add(describe(x) + " -> " + hex(got)); }
    return;
  }
  double const expected = reference_round<T>(static_cast<double>(x));
  if (!(decoded == expected && std::signbit(decoded) == std::signbit(expected))) {
    char text[64];
    std::snprintf(text, sizeof(text), "%a", expected);
    log.add(describe(x) + " -> " + hex(got) + ", formula gives " + text);
  }
}

/// Checks from_float<T>(x) against CUDA's host conversion, bit for bit (NaN: both NaN).
template <class T>
void check_cuda(float x, mismatch_log& log)
{
  std::uint32_t const got      = code_of(inferscale::from_float<T>(x));
  std::uint32_t const expected = cuda_from_float<T>(x);
  if (std::isnan(x)) {
    if (!std::isnan(reference_decode<T>(got)) || !std::isnan(reference_decode<T>(expected))) {
      log.add(describe(x) + " -> " + hex(got) + ", CUDA gives " + hex(expected));
    }
    return;
  }
  if (got != expected) {
    log.add(describe(x) + " -> " + hex(got) + ", CUDA gives " + hex(expected));
  }
}

/// A random float whose exponent lies in [min_exponent, max_exponent] (unbiased), any mantissa.
float random_float_in_binades(std::mt19937& rng, int min_exponent, int max_exponent)
{
  std::uniform_int_distribution<int> exponent(min_exponent, max_exponent);
  std::uniform_int_distribution<std::uint32_t> mantissa(0u, 0x7fffffu);
  std::uniform_int_distribution<std::uint32_t> sign(0u, 1u);
  auto const biased = static_cast<std::uint32_t>(exponent(rng) + 127);
  return float_from_bits((sign(rng) << 31) | (biased << 23) | mantissa(rng));
}

template <class T>
constexpr char const* type_name()
{
  return inferscale::to_string(inferscale::dtype_of_v<T>);
}

}  // namespace

// ================================================================================================
// Decoding

TEMPLATE_TEST_CASE(
  "to_float widens every code exactly", "[dtype]", half_t, bfloat16_t, float8_e4m3_t, float8_e5m2_t)
{
  CAPTURE(type_name<TestType>());
  mismatch_log log;

  SECTION("against the decoder written out from the fields")
  {
    for (std::uint32_t code = 0; code < code_count<TestType>; ++code) {
      float const got       = inferscale::to_float(make<TestType>(code));
      double const expected = reference_decode<TestType>(code);
      if (std::isnan(expected)) {
        if (!std::isnan(got)) { log.add(hex(code) + " -> " + describe(got) + ", expected NaN"); }
        continue;
      }
      // Every narrow value is an fp32 value: the cast is exact, and the bits carry the sign of 0.
      REQUIRE(static_cast<double>(static_cast<float>(expected)) == expected);
      if (bits_of(got) != bits_of(static_cast<float>(expected))) {
        log.add(hex(code) + " -> " + describe(got) + ", expected " +
                describe(static_cast<float>(expected)));
      }
    }
  }

  SECTION("against CUDA's host conversions")
  {
    for (std::uint32_t code = 0; code < code_count<TestType>; ++code) {
      float const got      = inferscale::to_float(make<TestType>(code));
      float const expected = cuda_to_float<TestType>(code);
      if (!same_float(got, expected)) {
        log.add(hex(code) + " -> " + describe(got) + ", CUDA gives " + describe(expected));
      }
      // The test's own decoder must agree with CUDA too, or the other tests prove nothing.
      if (!same_float(static_cast<float>(reference_decode<TestType>(code)), expected)) {
        log.add("test decoder disagrees with CUDA on " + hex(code));
      }
    }
  }

  INFO(log.first_mismatches());
  CHECK(log.count() == 0);
}

// ================================================================================================
// Rounding from fp32

TEMPLATE_TEST_CASE("from_float rounds to nearest, ties to even",
                   "[dtype]",
                   half_t,
                   bfloat16_t,
                   float8_e4m3_t,
                   float8_e5m2_t)
{
  using F = format<TestType>;
  CAPTURE(type_name<TestType>());
  mismatch_log log;

  SECTION("every code converts back to itself")
  {
    for (std::uint32_t code = 0; code < code_count<TestType>; ++code) {
      double const value = reference_decode<TestType>(code);
      // NaN has no value to keep; E5M2's infinities saturate (checked in "overflow rules").
      bool const saturated_infinity = F::overflow == overflow_rule::saturate && std::isinf(value);
      if (std::isnan(value) || saturated_infinity) { continue; }
      float const widened = inferscale::to_float(make<TestType>(code));
      TestType const back = inferscale::from_float<TestType>(widened);
      if (code_of(back) != code) { log.add(hex(code) + " -> " + hex(code_of(back))); }
      if (!same_float(inferscale::to_float(back), widened)) {
        log.add(hex(code) + ": to_float(from_float(to_float)) changed the value");
      }
    }
  }

  SECTION("midpoints between neighbouring values and the floats next to them")
  {
    auto const& table = magnitude_table<TestType>();
    for (std::size_t i = 0; i + 1 < table.size(); ++i) {
      double const midpoint = (table[i].value + table[i + 1].value) / 2;
      auto const x          = static_cast<float>(midpoint);
      REQUIRE(static_cast<double>(x) == midpoint);  // one more bit than the format: exact in fp32
      float const infinity = std::numeric_limits<float>::infinity();
      for (float const y : {x, std::nextafter(x, 0.0f), std::nextafter(x, infinity)}) {
        check_nearest<TestType>(y, log);
        check_nearest<TestType>(-y, log);
        check_formula<TestType>(y, log);
        check_formula<TestType>(-y, log);
      }
    }
  }

  SECTION("signed zeros, underflow and fp32 subnormals")
  {
    CHECK(code_of(inferscale::from_float<TestType>(0.0f)) == 0u);
    CHECK(code_of(inferscale::from_float<TestType>(-0.0f)) == sign_bit<TestType>);
    // Half the smallest subnormal is a tie between zero (even) and the smallest subnormal (odd).
    float const smallest = static_cast<float>(std::ldexp(1.0, 1 - F::bias - F::mantissa_bits));
    CHECK(code_of(inferscale::from_float<TestType>(smallest / 2)) == 0u);
    CHECK(code_of(inferscale::from_float<TestType>(-smallest / 2)) == sign_bit<TestType>);
    CHECK(code_of(inferscale::from_float<TestType>(std::nextafter(smallest / 2, 1.0f))) == 1u);
    CHECK(code_of(inferscale::from_float<TestType>(smallest)) == 1u);
    CHECK(code_of(inferscale::from_float<TestType>(-smallest)) == (sign_bit<TestType> | 1u));

    // fp32 subnormals lie below 2^-126: below half the smallest subnormal of fp16 and fp8, so
    // they round to a signed zero there; bf16 has fp32's exponent range and its own subnormals.
    bool const fp32_subnormals_underflow = 1 - F::bias - F::mantissa_bits - 1 >= -126;
    std::mt19937 rng{20240601u};
    std::uniform_int_distribution<std::uint32_t> subnormal_mantissa(1u, 0x7fffffu);
    for (int i = 0; i < 20000; ++i) {
      std::uint32_t const bits = subnormal_mantissa(rng);
      for (std::uint32_t const sign : {0u, 0x80000000u}) {
        float const x                = float_from_bits(sign | bits);
        std::uint32_t const expected = sign != 0u ? sign_bit<TestType> : 0u;
        if (fp32_subnormals_underflow && code_of(inferscale::from_float<TestType>(x)) != expected) {
          log.add(describe(x) + " did not round to a signed zero");
        }
        check_nearest<TestType>(x, log);
        check_formula<TestType>(x, log);
      }
    }
  }

  SECTION("random floats across the format's range")
  {
    std::mt19937 rng{12345u};
    int const min_exponent = std::max(-126, 1 - F::bias - F::mantissa_bits - 3);
    int const max_exponent = std::min(127, (1 << F::exponent_bits) - 1 - F::bias + 2);
    for (int i = 0; i < 200000; ++i) {
      float const x = random_float_in_binades(rng, min_exponent, max_exponent);
      check_nearest<TestType>(x, log);
      check_formula<TestType>(x, log);
    }
  }

  SECTION("random fp32 bit patterns")
  {
    std::mt19937 rng{777u};
    std::uniform_int_distribution<std::uint32_t> any_bits;
    for (int i = 0; i < 200000; ++i) {
      float const x = float_from_bits(any_bits(rng));
      check_nearest<TestType>(x, log);
      check_formula<TestType>(x, log);
    }
  }

  INFO(log.first_mismatches());
  CHECK(log.count() == 0);
}

TEMPLATE_TEST_CASE(
  "from_float keeps NaN a NaN", "[dtype]", half_t, bfloat16_t, float8_e4m3_t, float8_e5m2_t)
{
  CAPTURE(type_name<TestType>());
  auto const bits = GENERATE(as<std::uint32_t>{},
                             0x7fc00000u,
                             0xffc00000u,
                             0x7f800001u,
                             0xff800001u,
                             0x7fffffffu,
                             0xffffffffu,
                             0x7f802000u,
                             0x7fa00000u);
  float const nan = float_from_bits(bits);
  CAPTURE(describe(nan));
  REQUIRE(std::isnan(nan));
  TestType const converted = inferscale::from_float<TestType>(nan);
  CAPTURE(hex(code_of(converted)));
  CHECK(std::isnan(inferscale::to_float(converted)));
  CHECK(std::isnan(reference_decode<TestType>(code_of(converted))));
}

TEST_CASE("from_float overflow rules", "[dtype]")
{
  float const infinity = std::numeric_limits<float>::infinity();
  float const fp32_max = std::numeric_limits<float>::max();

  SECTION("float16 overflows to infinity beyond max + half ulp (65520)")
  {
    auto const round = [](float x) { return code_of(inferscale::from_float<half_t>(x)); };
    CHECK(round(65504.0f) == 0x7bffu);
    CHECK(round(std::nextafter(65520.0f, 0.0f)) == 0x7bffu);
    CHECK(round(65520.0f) == 0x7c00u);  // tie: 65536 has the even mantissa, and overflows
    CHECK(round(-65520.0f) == 0xfc00u);
    CHECK(round(1.0e5f) == 0x7c00u);
    CHECK(round(fp32_max) == 0x7c00u);
    CHECK(round(-fp32_max) == 0xfc00u);
    CHECK(round(infinity) == 0x7c00u);
    CHECK(round(-infinity) == 0xfc00u);
    CHECK(inferscale::to_float(half_t{0x7c00u}) == infinity);
  }

  SECTION("bfloat16 overflows to infinity beyond max + half ulp (0x1.ffp127)")
  {
    auto const round = [](float x) { return code_of(inferscale::from_float<bfloat16_t>(x)); };
    CHECK(round(0x1.fep127f) == 0x7f7fu);
    CHECK(round(std::nextafter(0x1.ffp127f, 0.0f)) == 0x7f7fu);
    CHECK(round(0x1.ffp127f) == 0x7f80u);
    CHECK(round(-0x1.ffp127f) == 0xff80u);
    CHECK(round(fp32_max) == 0x7f80u);
    CHECK(round(-fp32_max) == 0xff80u);
    CHECK(round(infinity) == 0x7f80u);
    CHECK(round(-infinity) == 0xff80u);
  }

  SECTION("float8_e4m3 saturates to 448")
  {
    auto const round = [](float x) { return code_of(inferscale::from_float<float8_e4m3_t>(x)); };
    for (float const x :
         {448.0f, 449.0f, 463.0f, 464.0f, 465.0f, 480.0f, 1.0e4f, fp32_max, infinity}) {
      CAPTURE(x);
      CHECK(round(x) == 0x7eu);
      CHECK(round(-x) == 0xfeu);
    }
    CHECK(inferscale::to_float(float8_e4m3_t{0x7eu}) == 448.0f);
    CHECK(inferscale::to_float(float8_e4m3_t{0xfeu}) == -448.0f);
  }

  SECTION("float8_e5m2 saturates to 57344")
  {
    auto const round = [](float x) { return code_of(inferscale::from_float<float8_e5m2_t>(x)); };
    for (float const x : {57344.0f, 60000.0f, 61440.0f, 65536.0f, 1.0e9f, fp32_max, infinity}) {
      CAPTURE(x);
      CHECK(round(x) == 0x7bu);
      CHECK(round(-x) == 0xfbu);
    }
    CHECK(inferscale::to_float(float8_e5m2_t{0x7bu}) == 57344.0f);
    CHECK(inferscale::to_float(float8_e5m2_t{0xfbu}) == -57344.0f);
  }
}

// ================================================================================================
// Agreement with CUDA's host implementation

TEMPLATE_TEST_CASE("from_float matches CUDA's host conversions bit for bit",
                   "[dtype]",
                   half_t,
                   bfloat16_t,
                   float8_e4m3_t,
                   float8_e5m2_t)
{
  CAPTURE(type_name<TestType>());
  mismatch_log log;

  SECTION("random fp32 bit patterns")
  {
    std::mt19937 rng{424242u};
    std::uniform_int_distribution<std::uint32_t> any_bits;
    for (int i = 0; i < (1 << 21); ++i) {
      check_cuda<TestType>(float_from_bits(any_bits(rng)), log);
    }
  }

  SECTION("random floats across the format's range")
  {
    using F = format<TestType>;
    std::mt19937 rng{31337u};
    int const min_exponent = std::max(-126, 1 - F::bias - F::mantissa_bits - 3);
    int const max_exponent = std::min(127, (1 << F::exponent_bits) - 1 - F::bias + 2);
    for (int i = 0; i < (1 << 20); ++i) {
      check_cuda<TestType>(random_float_in_binades(rng, min_exponent, max_exponent), log);
    }
  }

  SECTION("a sweep over every binade of fp32")
  {
    // 2^32 / 4099 patterns, evenly spread over all exponents, both signs, NaNs and infinities.
    for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099u) {
      check_cuda<TestType>(float_from_bits(static_cast<std::uint32_t>(bits)), log);
    }
    for (std::uint32_t const bits : {0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu}) {
      check_cuda<TestType>(float_from_bits(bits), log);
    }
  }

  SECTION("every code's value, the midpoints and their neighbours")
  {
    auto const& table    = magnitude_table<TestType>();
    float const infinity = std::numeric_limits<float>::infinity();
    for (std::size_t i = 0; i < table.size(); ++i) {
      auto const x = static_cast<float>(table[i].value);
      float const midpoint =
        i + 1 < table.size() ? static_cast<float>((table[i].value + table[i + 1].value) / 2) : x;
      for (float const y :
           {x, midpoint, std::nextafter(midpoint, 0.0f), std::nextafter(midpoint, infinity)}) {
        check_cuda<TestType>(y, log);
        check_cuda<TestType>(-y, log);
      }
    }
  }

  INFO(log.first_mismatches());
  CHECK(log.count() == 0);
}

// ================================================================================================
// Type traits, names and dispatch

TEMPLATE_TEST_CASE("element types describe themselves consistently",
                   "[dtype]",
                   half_t,
                   bfloat16_t,
                   float8_e4m3_t,
                   float8_e5m2_t)
{
  using F = format<TestType>;
  CAPTURE(type_name<TestType>());

  SECTION("size and layout")
  {
    STATIC_REQUIRE(std::is_trivially_copyable_v<TestType>);
    STATIC_REQUIRE(std::is_standard_layout_v<TestType>);
    STATIC_REQUIRE(sizeof(TestType) * 8 == static_cast<std::size_t>(F::total_bits));
    STATIC_REQUIRE(alignof(TestType) == sizeof(TestType));
    STATIC_REQUIRE(inferscale::is_element_type_v<TestType>);
    STATIC_REQUIRE(inferscale::is_element_type_v<TestType const>);
    CHECK(inferscale::size_of(inferscale::dtype_of_v<TestType>) == sizeof(TestType));
    CHECK(inferscale::dtype_of_v<TestType const> == inferscale::dtype_of_v<TestType>);
  }

  SECTION("max_finite is the largest finite decoded value")
  {
    double largest          = 0.0;
    std::uint32_t best_code = 0;
    for (std::uint32_t code = 0; code < code_count<TestType>; ++code) {
      double const value = reference_decode<TestType>(code);
      if (std::isfinite(value) && value > largest) {
        largest   = value;
        best_code = code;
      }
    }
    CHECK(largest == F::max_finite);
    CHECK(best_code == F::max_finite_code);
    CHECK(static_cast<double>(inferscale::max_finite<TestType>()) == largest);
    CHECK(code_of(inferscale::from_float<TestType>(inferscale::max_finite<TestType>())) ==
          best_code);
  }

  SECTION("mantissa_bits gives the spacing of values just above 1")
  {
    double above_one = std::numeric_limits<double>::infinity();
    for (std::uint32_t code = 0; code < code_count<TestType>; ++code) {
      double const value = reference_decode<TestType>(code);
      if (value > 1.0 && value < above_one) { above_one = value; }
    }
    CHECK(inferscale::mantissa_bits<TestType>() == F::mantissa_bits);
    CHECK(above_one - 1.0 == std::ldexp(1.0, -inferscale::mantissa_bits<TestType>()));
  }
}

TEST_CASE("float32 is an element type like the others", "[dtype]")
{
  STATIC_REQUIRE(inferscale::dtype_of_v<float> == dtype::float32);
  STATIC_REQUIRE(inferscale::is_element_type_v<float>);
  STATIC_REQUIRE(!inferscale::is_element_type_v<double>);
  STATIC_REQUIRE(!inferscale::is_element_type_v<std::uint16_t>);
  CHECK(inferscale::max_finite<float>() == std::numeric_limits<float>::max());
  CHECK(inferscale::mantissa_bits<float>() == std::numeric_limits<float>::digits - 1);
  for (float const x : {0.0f,
                        -0.0f,
                        1.0f / 3.0f,
                        -1.0e-40f,
                        std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::infinity()}) {
    CAPTURE(describe(x));
    CHECK(bits_of(inferscale::from_float<float>(x)) == bits_of(x));
    CHECK(bits_of(inferscale::to_float(x)) == bits_of(x));
  }
}

TEST_CASE("the narrow types have the size and alignment of CUDA's", "[dtype]")
{
  STATIC_REQUIRE(sizeof(half_t) == sizeof(__half));
  STATIC_REQUIRE(alignof(half_t) == alignof(__half));
  STATIC_REQUIRE(sizeof(bfloat16_t) == sizeof(__nv_bfloat16));
  STATIC_REQUIRE(alignof(bfloat16_t) == alignof(__nv_bfloat16));
  STATIC_REQUIRE(sizeof(float8_e4m3_t) == sizeof(__nv_fp8_e4m3));
  STATIC_REQUIRE(alignof(float8_e4m3_t) == alignof(__nv_fp8_e4m3));
  STATIC_REQUIRE(sizeof(float8_e5m2_t) == sizeof(__nv_fp8_e5m2));
  STATIC_REQUIRE(alignof(float8_e5m2_t) == alignof(__nv_fp8_e5m2));
}

TEST_CASE("dtype sizes, names and type mapping", "[dtype]")
{
  STATIC_REQUIRE(inferscale::size_of(dtype::float32) == 4);
  STATIC_REQUIRE(inferscale::size_of(dtype::float16) == 2);
  STATIC_REQUIRE(inferscale::size_of(dtype::bfloat16) == 2);
  STATIC_REQUIRE(inferscale::size_of(dtype::float8_e4m3) == 1);
  STATIC_REQUIRE(inferscale::size_of(dtype::float8_e5m2) == 1);

  STATIC_REQUIRE(inferscale::dtype_of_v<half_t> == dtype::float16);
  STATIC_REQUIRE(inferscale::dtype_of_v<bfloat16_t> == dtype::bfloat16);
  STATIC_REQUIRE(inferscale::dtype_of_v<float8_e4m3_t> == dtype::float8_e4m3);
  STATIC_REQUIRE(inferscale::dtype_of_v<float8_e5m2_t> == dtype::float8_e5m2);

  CHECK(std::string{inferscale::to_string(dtype::float32)} == "float32");
  CHECK(std::string{inferscale::to_string(dtype::float16)} == "float16");
  CHECK(std::string{inferscale::to_string(dtype::bfloat16)} == "bfloat16");
  CHECK(std::string{inferscale::to_string(dtype::float8_e4m3)} == "float8_e4m3");
  CHECK(std::string{inferscale::to_string(dtype::float8_e5m2)} == "float8_e5m2");
  CHECK(std::string{inferscale::to_string(static_cast<dtype>(200))} == "unknown dtype");
  CHECK(inferscale::size_of(static_cast<dtype>(200)) == 0);
}

TEST_CASE("dispatch_dtype calls the functor with the named type", "[dtype]")
{
  auto const describe_type = [](auto tag) {
    using type = typename decltype(tag)::type;
    return std::pair<dtype, std::size_t>{inferscale::dtype_of_v<type>, sizeof(type)};
  };

  SECTION("every valid dtype")
  {
    auto const t = GENERATE(
      dtype::float32, dtype::float16, dtype::bfloat16, dtype::float8_e4m3, dtype::float8_e5m2);
    CAPTURE(inferscale::to_string(t));
    auto const [tag, size] = inferscale::dispatch_dtype(t, describe_type);
    CHECK(tag == t);
    CHECK(size == inferscale::size_of(t));
  }

  SECTION("the functor's result comes back by reference when it returns one")
  {
    int counter = 0;
    int& result =
      inferscale::dispatch_dtype(dtype::bfloat16, [&](auto) -> int& { return counter; });
    result = 7;
    CHECK(counter == 7);
  }

  SECTION("an invalid enum value throws logic_error naming the value")
  {
    auto const value = GENERATE(5, 77, 255);
    CAPTURE(value);
    auto const t = static_cast<dtype>(value);
    CHECK_THROWS_AS(inferscale::dispatch_dtype(t, describe_type), inferscale::logic_error);
    CHECK_THROWS_WITH(inferscale::dispatch_dtype(t, describe_type),
                      Catch::Matchers::Contains("dispatch_dtype") &&
                        Catch::Matchers::Contains(std::to_string(value)));
  }
}

// ================================================================================================
// KV geometry

TEST_CASE("kv_geometry counts 2 * layers * heads * head_dim elements per token", "[geometry]")
{
  using inferscale::kv_geometry;

  SECTION("published models, bfloat16")
  {
    // Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128 -> 2*32*8*128*2 = 131072 B = 128 KiB.
    STATIC_REQUIRE(kv_geometry{32, 8, 128}.bytes_per_token(dtype::bfloat16) == 131072);
    // Qwen2.5-7B: 28 layers, 4 KV heads, head dim 128 -> 2*28*4*128*2 = 57344 B = 56 KiB.
    STATIC_REQUIRE(kv_geometry{28, 4, 128}.bytes_per_token(dtype::bfloat16) == 57344);
    // SmolLM2-135M: 30 layers, 3 KV heads, head dim 64 -> 2*30*3*64*2 = 23040 B.
    STATIC_REQUIRE(kv_geometry{30, 3, 64}.bytes_per_token(dtype::bfloat16) == 23040);
  }

  SECTION("every dtype and a spread of shapes")
  {
    auto const layers   = GENERATE(1, 2, 28, 32, 80, 126);
    auto const heads    = GENERATE(1, 3, 8, 128);
    auto const head_dim = GENERATE(2, 64, 128, 256);
    kv_geometry const geometry{layers, heads, head_dim};
    CAPTURE(layers, heads, head_dim);
    std::int64_t const elements = 2LL * layers * heads * head_dim;
    CHECK(geometry.elements_per_token_layer() == static_cast<std::int64_t>(heads) * head_dim);
    CHECK(geometry.elements_per_token() == elements);
    CHECK(geometry.bytes_per_token(dtype::float32) == elements * 4);
    CHECK(geometry.bytes_per_token(dtype::float16) == elements * 2);
    CHECK(geometry.bytes_per_token(dtype::bfloat16) == elements * 2);
    CHECK(geometry.bytes_per_token(dtype::float8_e4m3) == elements);
    CHECK(geometry.bytes_per_token(dtype::float8_e5m2) == elements);
    CHECK_NOTHROW(geometry.validate());
  }

  SECTION("equality compares all three fields")
  {
    STATIC_REQUIRE(kv_geometry{32, 8, 128} == kv_geometry{32, 8, 128});
    STATIC_REQUIRE(kv_geometry{32, 8, 128} != kv_geometry{31, 8, 128});
    STATIC_REQUIRE(kv_geometry{32, 8, 128} != kv_geometry{32, 4, 128});
    STATIC_REQUIRE(kv_geometry{32, 8, 128} != kv_geometry{32, 8, 64});
  }
}

TEST_CASE("kv_geometry::bytes multiplies by the token count and refuses overflow", "[geometry]")
{
  using inferscale::kv_geometry;
  constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
  kv_geometry const llama{32, 8, 128};
  std::int64_t const per_token = 131072;  // 2*32*8*128*2, bfloat16

  SECTION("token counts")
  {
    auto const tokens = GENERATE(as<std::int64_t>{}, 0, 1, 7, 4096, 131072, 1000003);
    CAPTURE(tokens);
    CHECK(llama.bytes(tokens, dtype::bfloat16) == tokens * per_token);
    CHECK(llama.bytes(tokens, dtype::float8_e4m3) == tokens * per_token / 2);
  }

  SECTION("128 Ki tokens of Llama-3.1-8B in bfloat16 are 16 GiB")
  {
    CHECK(llama.bytes(131072, dtype::bfloat16) == 17179869184LL);
  }

  SECTION("the largest count that fits, and one more")
  {
    std::int64_t const largest = int64_max / per_token;
    CHECK(llama.bytes(largest, dtype::bfloat16) == largest * per_token);
    CHECK_THROWS_AS(llama.bytes(largest + 1, dtype::bfloat16), inferscale::logic_error);
    CHECK_THROWS_WITH(llama.bytes(largest + 1, dtype::bfloat16),
                      Catch::Matchers::Contains("overflow"));
    CHECK_THROWS_AS(llama.bytes(int64_max, dtype::float8_e5m2), inferscale::logic_error);
  }

  SECTION("negative token counts")
  {
    auto const tokens =
      GENERATE(as<std::int64_t>{}, -1, -131072, std::numeric_limits<std::int64_t>::min());
    CAPTURE(tokens);
    CHECK_THROWS_AS(llama.bytes(tokens, dtype::bfloat16), inferscale::logic_error);
    CHECK_THROWS_WITH(llama.bytes(tokens, dtype::bfloat16),
                      Catch::Matchers::Contains("non-negative") &&
                        Catch::Matchers::Contains(std::to_string(tokens)));
  }

  SECTION("an invalid geometry is refused, not costed")
  {
    CHECK_THROWS_WITH((kv_geometry{0, 8, 128}.bytes(1, dtype::float32)),
                      Catch::Matchers::Contains("num_layers must be positive"));
    // Per-token products beyond 64 bits are refused by validate(), before any multiplication.
    CHECK_THROWS_WITH((kv_geometry{1 << 30, 1 << 30, 1 << 30}.bytes(1, dtype::float32)),
                      Catch::Matchers::Contains("overflows a 64-bit byte count per token"));
  }
}

TEST_CASE("kv_geometry::validate names the offending field", "[geometry]")
{
  using inferscale::kv_geometry;

  SECTION("valid geometries")
  {
    CHECK_NOTHROW(kv_geometry{32, 8, 128}.validate());
    CHECK_NOTHROW(kv_geometry{1, 1, 2}.validate());
  }

  SECTION("num_layers")
  {
    auto const layers = GENERATE(0, -1, std::numeric_limits<std::int32_t>::min());
    kv_geometry const geometry{layers, 8, 128};
    CAPTURE(layers);
    CHECK_THROWS_AS(geometry.validate(), inferscale::logic_error);
    CHECK_THROWS_WITH(
      geometry.validate(),
      Catch::Matchers::Contains("num_layers") && Catch::Matchers::Contains(std::to_string(layers)));
  }

  SECTION("num_kv_heads")
  {
    auto const heads = GENERATE(0, -8);
    kv_geometry const geometry{32, heads, 128};
    CAPTURE(heads);
    CHECK_THROWS_AS(geometry.validate(), inferscale::logic_error);
    CHECK_THROWS_WITH(geometry.validate(),
                      Catch::Matchers::Contains("num_kv_heads") &&
                        Catch::Matchers::Contains(std::to_string(heads)));
  }

  SECTION("head_dim: zero, negative or odd")
  {
    auto const head_dim = GENERATE(0, -128, -2, 1, 127, 129);
    kv_geometry const geometry{32, 8, head_dim};
    CAPTURE(head_dim);
    CHECK_THROWS_AS(geometry.validate(), inferscale::logic_error);
    CHECK_THROWS_WITH(
      geometry.validate(),
      Catch::Matchers::Contains("head_dim") && Catch::Matchers::Contains(std::to_string(head_dim)));
  }

  SECTION("the first bad field is the one named")
  {
    CHECK_THROWS_WITH((kv_geometry{0, 0, 3}.validate()), Catch::Matchers::Contains("num_layers"));
    CHECK_THROWS_WITH((kv_geometry{1, 0, 3}.validate()), Catch::Matchers::Contains("num_kv_heads"));
  }
}
