// The host vector conversions (detail/dtype/vector_conversion.hpp: AVX2 with F16C, and AVX-512F
// where the CPU has it, chosen at run time) against the scalar routines of
// detail/dtype/conversion.hpp, bit for bit. The scalar routines are checked against independent
// references in dtype_host.cpp; here the vector lanes must give exactly their bits:
//  - widening: every code of bf16 and fp16 (65,536 each) and of e4m3 and e5m2 (256 each);
//  - rounding (fp32 -> bf16, fp16, e4m3, e5m2, and the round trip `round_to`): every bf16
//    pattern as the top half of an fp32 with the low halves that decide bf16 rounding (0, 1,
//    ties 0x8000 and their neighbours, 0xffff), every fp16, e4m3 and e5m2 value, the midpoints
//    between neighbouring values and the fp32 numbers next to them (the rounding boundaries,
//    ties included), subnormal and overflow ranges, NaNs with payloads, infinities, 2 M random
//    fp32 bit patterns and 256 K small numbers;
//  - all of it once more with flush-to-zero and denormals-are-zero set in MXCSR, as some
//    frameworks leave them.
// A hidden case ([.exhaustive], run by hand: INFERSCALE_EXHAUSTIVE=1 test_dtype "[.exhaustive]")
// sweeps all 2^32 fp32 inputs for every format at every vector level.
#include "float_bits.hpp"

#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/dtype.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if INFERSCALE_HOST_X86_SIMD
#include <xmmintrin.h>
#endif

using inferscale::bfloat16_t;
using inferscale::float8_e4m3_t;
using inferscale::float8_e5m2_t;
using inferscale::half_t;
namespace detail = inferscale::detail;

#if INFERSCALE_HOST_X86_SIMD

namespace {

bool have_avx2()
{
  if (detail::detected_host_simd() != detail::host_simd::scalar) { return true; }
  WARN("this CPU has no AVX2/F16C/FMA: the vector conversions are never used here");
  return false;
}

/// Sets MXCSR's FTZ and DAZ bits for its lifetime (when `on`).
struct flush_denormals {
  unsigned saved;
  explicit flush_denormals(bool on) : saved{_mm_getcsr()}
  {
    if (on) { _mm_setcsr(saved | 0x8040u); }
  }
  ~flush_denormals() { _mm_setcsr(saved); }
};

template <class T>
std::uint32_t code_of(T x)
{
  if constexpr (std::is_same_v<T, float>) {
    return detail::float_bits(x);
  } else {
    return x.bits;
  }
}

/// Mismatches of store8<T> and round_to<T> against from_float<T> over `inputs` (a multiple of 8).
template <class T>
INFERSCALE_TARGET_AVX2 std::size_t rounding_mismatches(std::vector<float> const& inputs,
                                                       std::string* first)
{
  std::size_t bad = 0;
  for (std::size_t i = 0; i < inputs.size(); i += 8) {
    __m256 const x = _mm256_loadu_ps(&inputs[i]);
    T codes[8];
    float round_trip[8];
    detail::simd::store8(codes, x);
    _mm256_storeu_ps(round_trip, detail::simd::round_to<T>(x));
    for (int j = 0; j < 8; ++j) {
      T const expected = inferscale::from_float<T>(inputs[i + j]);
      bool const ok =
        code_of(codes[j]) == code_of(expected) &&
        detail::float_bits(round_trip[j]) == detail::float_bits(inferscale::to_float(expected));
      if (!ok && bad++ == 0) {
        *first = "input bits " + std::to_string(detail::float_bits(inputs[i + j])) + ": vector " +
                 std::to_string(code_of(codes[j])) + ", scalar " +
                 std::to_string(code_of(expected));
      }
    }
  }
  return bad;
}

/// Mismatches of load8<T> against to_float over every code of T.
template <class T>
INFERSCALE_TARGET_AVX2 std::size_t widening_mismatches(std::string* first)
{
  constexpr std::uint32_t count = sizeof(T) == 1 ? 256u : 65536u;
  std::vector<T> codes(count);
  for (std::uint32_t c = 0; c < count; ++c) {
    codes[c].bits = static_cast<decltype(codes[c].bits)>(c);
  }
  std::size_t bad = 0;
  for (std::uint32_t c = 0; c < count; c += 8) {
    float out[8];
    _mm256_storeu_ps(out, detail::simd::load8(&codes[c]));
    for (std::uint32_t j = 0; j < 8; ++j) {
      std::uint32_t const expected = detail::float_bits(inferscale::to_float(codes[c + j]));
      if (detail::float_bits(out[j]) != expected && bad++ == 0) {
        *first = "code " + std::to_string(c + j) + ": vector " +
                 std::to_string(detail::float_bits(out[j])) + ", scalar " +
                 std::to_string(expected);
      }
    }
  }
  return bad;
}

/// Mismatches of store16<T> and round_to<T> against from_float<T> over `inputs` (a multiple of 16).
template <class T>
INFERSCALE_TARGET_AVX512 std::size_t rounding_mismatches_512(std::vector<float> const& inputs,
                                                             std::string* first)
{
  std::size_t bad = 0;
  for (std::size_t i = 0; i < inputs.size(); i += 16) {
    __m512 const x = _mm512_loadu_ps(&inputs[i]);
    T codes[16];
    float round_trip[16];
    detail::simd512::store16(codes, x);
    _mm512_storeu_ps(round_trip, detail::simd512::round_to<T>(x));
    for (int j = 0; j < 16; ++j) {
      T const expected = inferscale::from_float<T>(inputs[i + j]);
      bool const ok =
        code_of(codes[j]) == code_of(expected) &&
        detail::float_bits(round_trip[j]) == detail::float_bits(inferscale::to_float(expected));
      if (!ok && bad++ == 0) {
        *first = "input bits " + std::to_string(detail::float_bits(inputs[i + j])) + ": vector " +
                 std::to_string(code_of(codes[j])) + ", scalar " +
                 std::to_string(code_of(expected));
      }
    }
  }
  return bad;
}

/// Mismatches of load16<T> against to_float over every code of T.
template <class T>
INFERSCALE_TARGET_AVX512 std::size_t widening_mismatches_512(std::string* first)
{
  constexpr std::uint32_t count = sizeof(T) == 1 ? 256u : 65536u;
  std::vector<T> codes(count);
  for (std::uint32_t c = 0; c < count; ++c) {
    codes[c].bits = static_cast<decltype(codes[c].bits)>(c);
  }
  std::size_t bad = 0;
  for (std::uint32_t c = 0; c < count; c += 16) {
    float out[16];
    _mm512_storeu_ps(out, detail::simd512::load16(&codes[c]));
    for (std::uint32_t j = 0; j < 16; ++j) {
      std::uint32_t const expected = detail::float_bits(inferscale::to_float(codes[c + j]));
      if (detail::float_bits(out[j]) != expected && bad++ == 0) {
        *first = "code " + std::to_string(c + j) + ": vector " +
                 std::to_string(detail::float_bits(out[j])) + ", scalar " +
                 std::to_string(expected);
      }
    }
  }
  return bad;
}

/// fp32 inputs at and around every rounding boundary of the narrow formats, plus random bits.
std::vector<float> boundary_and_random_inputs()
{
  std::vector<float> in;
  auto const push_bits = [&](std::uint32_t b) { in.push_back(detail::bits_to_float(b)); };
  for (std::uint32_t top = 0; top < 65536; ++top) {  // bf16: ties and their neighbours
    for (std::uint32_t low : {0x0u, 0x1u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      push_bits((top << 16) | low);
    }
  }
  // Every value of the 16- and 8-bit formats, the midpoints to the next code (exact in fp32) and
  // the fp32 numbers one and two steps either side of both.
  auto const around = [&](float v) {
    std::uint32_t const b = detail::float_bits(v);
    for (int k = -2; k <= 2; ++k) {
      push_bits(b + static_cast<std::uint32_t>(k));
    }
  };
  auto const values_and_midpoints = [&](auto type_tag, std::uint32_t count) {
    using T = typename decltype(type_tag)::type;
    for (std::uint32_t c = 0; c + 1 < count; ++c) {
      T a, b;
      a.bits         = static_cast<decltype(a.bits)>(c);
      b.bits         = static_cast<decltype(b.bits)>(c + 1);
      double const x = inferscale::to_float(a);
      double const y = inferscale::to_float(b);
      if (!std::isfinite(x)) { continue; }
      around(static_cast<float>(x));
      if (std::isfinite(y) && ((c + 1) & (count / 2 - 1)) != 0) {
        around(static_cast<float>((x + y) / 2));  // same sign: a midpoint between neighbours
      }
    }
  };
  values_and_midpoints(inferscale::type_tag<half_t>{}, 65536);
  values_and_midpoints(inferscale::type_tag<float8_e4m3_t>{}, 256);
  values_and_midpoints(inferscale::type_tag<float8_e5m2_t>{}, 256);
  // Beyond the largest finite values (saturation and overflow), up to infinity.
  for (float m : {448.0f, 464.0f, 480.0f, 57344.0f, 61440.0f, 65504.0f, 65520.0f, 3.0e38f}) {
    around(m);
    around(-m);
  }
  for (std::uint32_t b : {0x7f800000u,
                          0xff800000u,
                          0x7fc00000u,
                          0xffc00000u,
                          0x7f800001u,
                          0x7fbfffffu,
                          0xffc12345u,
                          0x7fe00000u,
                          0x00000001u,
                          0x807fffffu}) {
    push_bits(b);
  }
  std::mt19937 rng(20261201);
  for (int i = 0; i < (1 << 21); ++i) {
    push_bits(rng());
  }
  std::uniform_int_distribution<int> exponent(-40, 0);
  for (int i = 0; i < (1 << 18); ++i) {  // the narrow formats' subnormal and small normal range
    float const x = std::ldexp(static_cast<float>(rng() & 0xffffffu), exponent(rng) - 24);
    in.push_back((rng() & 1u) ? x : -x);
  }
  while (in.size() % 16 != 0) {
    in.push_back(0.0f);
  }
  return in;
}

bool have_avx512() { return detail::uses_avx512(detail::detected_host_simd()); }

template <class T>
void check_rounding(std::vector<float> const& inputs)
{
  std::string first;
  std::size_t const bad = rounding_mismatches<T>(inputs, &first);
  INFO("AVX2: " << first);
  CHECK(bad == 0);
  if (have_avx512()) {
    std::string first512;
    std::size_t const bad512 = rounding_mismatches_512<T>(inputs, &first512);
    INFO("AVX-512: " << first512);
    CHECK(bad512 == 0);
  }
}

template <class T>
void check_widening()
{
  std::string first;
  std::size_t const bad = widening_mismatches<T>(&first);
  INFO("AVX2: " << first);
  CHECK(bad == 0);
  if (have_avx512()) {
    std::string first512;
    std::size_t const bad512 = widening_mismatches_512<T>(&first512);
    INFO("AVX-512: " << first512);
    CHECK(bad512 == 0);
  }
}

}  // namespace

TEST_CASE("vector conversions give the scalar routines' bits", "[dtype][simd]")
{
  if (!have_avx2()) { return; }
  static std::vector<float> const inputs = boundary_and_random_inputs();
  REQUIRE(inputs.size() > (std::size_t{3} << 20));
  bool const flush = GENERATE(false, true);
  CAPTURE(flush);
  flush_denormals const mode{flush};
  check_widening<bfloat16_t>();
  check_widening<half_t>();
  check_widening<float8_e4m3_t>();
  check_widening<float8_e5m2_t>();
  check_rounding<float>(inputs);
  check_rounding<bfloat16_t>(inputs);
  check_rounding<half_t>(inputs);
  check_rounding<float8_e4m3_t>(inputs);
  check_rounding<float8_e5m2_t>(inputs);
}

TEST_CASE("vector rounding of every fp32 input gives the scalar routines' bits",
          "[.exhaustive][dtype][simd]")
{
  if (!have_avx2()) { return; }
  // Catch2 runs hidden cases under exclusion-only filters too (ctest's "~[gpu]"): the sweep (about
  // 100 s on the 2-core CI machine) runs only when asked for.
  char const* const asked = std::getenv("INFERSCALE_EXHAUSTIVE");
  if (asked == nullptr || std::string{asked} != "1") {
    WARN("the 2^32 sweep runs with INFERSCALE_EXHAUSTIVE=1 in the environment");
    return;
  }
  std::vector<float> chunk(std::size_t{1} << 24);
  for (std::uint64_t start = 0; start < (std::uint64_t{1} << 32); start += chunk.size()) {
    for (std::size_t i = 0; i < chunk.size(); ++i) {
      chunk[i] = detail::bits_to_float(static_cast<std::uint32_t>(start + i));
    }
    check_rounding<bfloat16_t>(chunk);
    check_rounding<half_t>(chunk);
    check_rounding<float8_e4m3_t>(chunk);
    check_rounding<float8_e5m2_t>(chunk);
  }
}

#else

TEST_CASE("vector conversions give the scalar routines' bits", "[dtype][simd]")
{
  REQUIRE(detail::active_host_simd() == detail::host_simd::scalar);
  WARN("no x86 vector conversions in this build: the scalar routines are the only path");
}

#endif
