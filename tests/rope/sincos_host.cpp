// sin/cos of the fp32 rotary angle (detail/rope/sincos.hpp), checked against an independent
// reference: the platform's long double sinl/cosl (x87 extended precision on x86-64, quad on
// aarch64), which reduce any argument exactly. The library's value must be that reference rounded
// to fp32, except where the reference lies within 2^-44 (relative) of a rounding midpoint, where
// either neighbour is accepted (and such cases are counted: they must stay rare). Then: the AVX2
// and AVX-512 forms equal the scalar function bit for bit, the fallback for large or non-finite
// lanes is taken, and a token's row of cos/sin equals rope_angle_cos_sin pair by pair at every
// vector level.
#include "simd_paths.hpp"

#include <inferscale/detail/rope/rotate_simd.hpp>
#include <inferscale/detail/rope/sincos.hpp>
#include <inferscale/rope.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace inferscale;
using namespace inferscale_test;

namespace {

static_assert(std::numeric_limits<long double>::digits >= 64,
              "the reference needs a long double with at least 64 significand bits");

float from_bits(std::uint32_t b)
{
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
std::uint32_t bits_of(float f)
{
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

struct rounding_check {
  long checked = 0, near_midpoint = 0, wrong = 0;

  /// `got` must be `reference` rounded to fp32 (or its neighbour when the reference is within
  /// 2^-44 of the midpoint between them).
  void expect(float got, long double reference, float angle)
  {
    ++checked;
    auto const nearest = static_cast<float>(reference);
    if (bits_of(got) == bits_of(nearest)) { return; }
    long double const midpoint = (static_cast<long double>(got) + nearest) / 2;
    long double const slack    = std::ldexp(std::fabs(reference), -44);
    if (std::nextafter(got, nearest) == nearest && std::fabs(reference - midpoint) <= slack) {
      ++near_midpoint;
      return;
    }
    if (++wrong <= 5) {
      UNSCOPED_INFO("angle " << std::hexfloat << angle << ": got " << got << ", expected "
                             << nearest);
    }
  }
};

void check_angle(rounding_check& check, float angle)
{
  float s, c;
  detail::rope_sincos(angle, &s, &c);
  check.expect(s, sinl(static_cast<long double>(angle)), angle);
  check.expect(c, cosl(static_cast<long double>(angle)), angle);
  // odd and even: the reduction is symmetric
  float ns, nc;
  detail::rope_sincos(-angle, &ns, &nc);
  REQUIRE(bits_of(ns) == (bits_of(s) ^ 0x80000000u));
  REQUIRE(bits_of(nc) == bits_of(c));
}

}  // namespace

TEST_CASE("rope sincos: the correctly rounded fp32 sin and cos of the angle", "[rope][sincos]")
{
  rounding_check check;
  {  // every 211th fp32 value from 2^-30 to 2^28 (the reduction by parts of pi/2)
    for (std::uint32_t b = bits_of(0x1p-30f); b < bits_of(0x1p28f); b += 211) {
      check_angle(check, from_bits(b));
    }
  }
  {  // the angles of real positions: float(p) * inv_freq for Llama-3.1-8B, p < 131,072
    auto const params = make_rope_params(rope_presets::llama_3_1_8b());
    for (std::int64_t p = 0; p < 131072; p += 7) {
      for (int i = 0; i < params.num_pairs(); ++i) {
        check_angle(check, static_cast<float>(p) * params.inv_freq[i]);
      }
    }
  }
  {  // the fp32 values nearest to multiples of pi/2 (where the reduced argument is smallest)
    // k pi/2 for k up to 2^24, and the 5 fp32 values on either side of it
    for (std::int64_t k = 1; k < (std::int64_t{1} << 24); k = k * 3 / 2 + 1) {
      auto const centre = static_cast<float>(static_cast<long double>(k) * 1.5707963267948966192L);
      for (int d = -5; d <= 5; ++d) {
        check_angle(
          check,
          from_bits(static_cast<std::uint32_t>(static_cast<std::int64_t>(bits_of(centre)) + d)));
      }
    }
  }
  {  // every 4099th fp32 value from 2^28 to the largest finite (the integer reduction)
    for (std::uint32_t b = bits_of(0x1p28f); b < 0x7f800000u; b += 4099) {
      check_angle(check, from_bits(b));
    }
    check_angle(check, std::numeric_limits<float>::max());
  }
  CAPTURE(check.checked, check.near_midpoint);
  REQUIRE(check.checked > 100000);
  REQUIRE(check.wrong == 0);
  REQUIRE(check.near_midpoint * 100000 <= check.checked);  // at most 1 in 100,000 near a midpoint
}

TEST_CASE("rope sincos: zero, subnormal, infinite and NaN angles", "[rope][sincos]")
{
  float s, c;
  detail::rope_sincos(0.0f, &s, &c);
  REQUIRE((bits_of(s) == 0u && c == 1.0f));
  detail::rope_sincos(-0.0f, &s, &c);
  REQUIRE((bits_of(s) == 0x80000000u && c == 1.0f));
  detail::rope_sincos(0x1p-140f, &s, &c);  // sin x = x for tiny x (exactly, in fp32)
  REQUIRE((s == 0x1p-140f && c == 1.0f));
  for (float bad : {std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    detail::rope_sincos(bad, &s, &c);
    REQUIRE((std::isnan(s) && std::isnan(c)));
  }
}

#if INFERSCALE_HOST_X86_SIMD
TEST_CASE("rope sincos: the AVX2 and AVX-512 forms equal the scalar function bit for bit",
          "[rope][sincos][simd]")
{
  if (!vector_path_available()) { return; }
  std::mt19937_64 rng(3);
  std::vector<float> angles;
  std::uniform_real_distribution<float> small(-4.0f, 4.0f);
  std::uniform_real_distribution<float> large(-2.0e8f, 2.0e8f);
  std::uniform_int_distribution<std::uint32_t> any_bits(0u, 0x4d7fffffu);  // |a| < 2^28
  for (int i = 0; i < 40000; ++i) {
    angles.push_back(i % 3 == 0 ? small(rng) : i % 3 == 1 ? large(rng) : from_bits(any_bits(rng)));
  }
  bool const avx512 = detail::uses_avx512(detail::detected_host_simd());
  long compared     = 0;
  for (std::size_t i = 0; i + 16 <= angles.size(); i += 16) {
    float s8[16], c8[16], s16[16], c16[16];
    REQUIRE(detail::simd::sincos8(angles.data() + i, s8, c8));
    REQUIRE(detail::simd::sincos8(angles.data() + i + 8, s8 + 8, c8 + 8));
    if (avx512) { REQUIRE(detail::simd512::sincos16(angles.data() + i, s16, c16)); }
    for (int j = 0; j < 16; ++j) {
      float s, c;
      detail::rope_sincos(angles[i + j], &s, &c);
      CAPTURE(angles[i + j]);
      REQUIRE(bits_of(s8[j]) == bits_of(s));
      REQUIRE(bits_of(c8[j]) == bits_of(c));
      if (avx512) {
        REQUIRE(bits_of(s16[j]) == bits_of(s));
        REQUIRE(bits_of(c16[j]) == bits_of(c));
      }
      ++compared;
    }
  }
  REQUIRE(compared == 40000);
  if (avx512) {  // 32 and 64 angles in lockstep (the row's groups): the same bits again
    long lockstep = 0;
    for (std::size_t i = 0; i + 64 <= angles.size(); i += 64) {
      float s64[64], c64[64], s32[64], c32[64];
      REQUIRE(detail::simd512::sincos_lockstep<8>(angles.data() + i, s64, c64));
      REQUIRE(detail::simd512::sincos_lockstep<4>(angles.data() + i, s32, c32));
      REQUIRE(detail::simd512::sincos_lockstep<4>(angles.data() + i + 32, s32 + 32, c32 + 32));
      for (int j = 0; j < 64; ++j) {
        float s, c;
        detail::rope_sincos(angles[i + j], &s, &c);
        CAPTURE(angles[i + j]);
        REQUIRE(bits_of(s64[j]) == bits_of(s));
        REQUIRE(bits_of(c64[j]) == bits_of(c));
        REQUIRE(bits_of(s32[j]) == bits_of(s));
        REQUIRE(bits_of(c32[j]) == bits_of(c));
        ++lockstep;
      }
    }
    REQUIRE(lockstep == 40000 / 64 * 64);
  }
  SECTION("a lane at or above 2^28, infinite or NaN sends the group to the scalar function")
  {
    for (float odd : {0x1p28f,
                      -3.0e9f,
                      std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      float group[16];
      for (int j = 0; j < 16; ++j) {
        group[j] = 0.25f * static_cast<float>(j);
      }
      group[5] = odd;
      float s[16], c[16];
      REQUIRE_FALSE(detail::simd::sincos8(group, s, c));
      if (avx512) {
        REQUIRE_FALSE(detail::simd512::sincos16(group, s, c));
        float wide[64], s64[64], c64[64];  // one bad lane refuses the whole lockstep group
        for (int j = 0; j < 64; ++j) {
          wide[j] = 0.25f * static_cast<float>(j);
        }
        wide[45] = odd;
        REQUIRE_FALSE(detail::simd512::sincos_lockstep<8>(wide, s64, c64));
        REQUIRE_FALSE(detail::simd512::sincos_lockstep<4>(wide + 32, s64, c64));
        REQUIRE(detail::simd512::sincos_lockstep<4>(wide, s64, c64));
      }
    }
  }
}

TEST_CASE("rope sincos: a token's cos/sin row equals rope_angle_cos_sin at every vector level",
          "[rope][sincos][simd]")
{
  auto spec       = rope_presets::llama_3_1_8b();
  spec.rotary_dim = GENERATE(128, 96, 72);  // 64, 48, 36 pairs: 16-, 8- and scalar tails
  auto params     = make_rope_params(spec);
  // the preset's 1, YaRN's 0.1 ln(s) + 1 at s = 40 (DeepSeek-V3), and one below 1: the vector
  // scaling multiplies (forward) or divides (inverse) by it
  params.attention_factor = GENERATE(1.0f, 1.3688879f, 0.7f);
  CAPTURE(params.attention_factor);
  std::vector<std::int64_t> const positions{0, 1, 37, 4095, 131071, 300000000, -5};
  for (rope_op op : {rope_op::forward, rope_op::inverse, rope_op::shift}) {
    all_paths([&](detail::host_simd level) {
      for (std::int64_t p : positions) {
        if (p < 0 && op != rope_op::shift) { continue; }
        std::vector<float> cos(static_cast<std::size_t>(params.num_pairs()));
        std::vector<float> sin(cos.size());
        detail::rope_cos_sin_row(params, p, op, cos.data(), sin.data());
        for (int i = 0; i < params.num_pairs(); ++i) {
          rope_cos_sin const cs = rope_angle_cos_sin(params, p, i, op);
          CAPTURE(static_cast<int>(level), static_cast<int>(op), p, i);
          REQUIRE(bits_of(cos[static_cast<std::size_t>(i)]) == bits_of(cs.cos));
          REQUIRE(bits_of(sin[static_cast<std::size_t>(i)]) == bits_of(cs.sin));
        }
      }
    });
  }
}
#endif
