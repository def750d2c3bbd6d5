// Host tests of the rotary embedding. Every expectation is written out here independently of the
// library: the published inverse-frequency formulas, rotations as complex multiplications, and
// the relocation identity <R_a q, R_b k> = <q, R_{b-a} k>.
#include <inferscale/rope.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;
using Catch::Matchers::Contains;

namespace {

constexpr double pi = 3.14159265358979323846;

// theta^(-2i/d), written as 1 / theta^(2i/d) (HF's form).
std::vector<double> plain_inv(double theta, int d)
{
  std::vector<double> inv;
  for (int i = 0; i < d / 2; ++i) {
    inv.push_back(1.0 / std::pow(theta, (2.0 * i) / d));
  }
  return inv;
}

void check_inv(rope_spec const& spec, std::vector<double> const& expected, std::int64_t length = 0)
{
  auto const got = spec.inverse_frequencies(length);
  REQUIRE(got.size() == expected.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i, got[i], expected[i]);
    REQUIRE(got[i] == Approx(expected[i]).epsilon(1e-12));
  }
  // The kernel parameters keep them rounded to fp32, as engines keep inv_freq.
  auto const params = make_rope_params(spec, length);
  for (std::size_t i = 0; i < got.size(); ++i) {
    REQUIRE(params.inv_freq[i] == static_cast<float>(got[i]));
  }
}

// Rotation of one head written with complex numbers: pair (first, second) is the complex number
// first + i*second, multiplied by a * exp(i * p * inv).
std::vector<double> complex_rotation(std::vector<double> const& x,
                                     std::vector<double> const& inv,
                                     double position,
                                     double a,
                                     int rotary_dim,
                                     bool halves)
{
  std::vector<double> y = x;
  for (int i = 0; i < rotary_dim / 2; ++i) {
    int const f = halves ? i : 2 * i;
    int const s = halves ? i + rotary_dim / 2 : 2 * i + 1;
    std::complex<double> const z{x[f], x[s]};
    std::complex<double> const r = a * z * std::polar(1.0, position * inv[i]);
    y[f]                         = r.real();
    y[s]                         = r.imag();
  }
  return y;
}

std::vector<float> random_vector(std::mt19937_64& rng, std::size_t n)
{
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) {
    x = dist(rng);
  }
  return v;
}

// Rotates a single head vector with the library (host backend).
template <class Rotation>
std::vector<float> rotate(std::vector<float> v,
                          Rotation const& r,
                          std::int64_t position,
                          rope_op op)
{
  rope_apply_host(
    make_token_head_view(v.data(), 1, 1, static_cast<std::int64_t>(v.size())), &position, 1, r, op);
  return v;
}

double dot(std::vector<float> const& a, std::vector<float> const& b)
{
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    s += double(a[i]) * double(b[i]);
  }
  return s;
}

double ulp(float x) { return double(std::nextafter(std::fabs(x), INFINITY)) - std::fabs(x); }

// Round to bf16, nearest even, written out on the bits (independent of dtype.hpp).
float bf16_round(float x)
{
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  b += 0x7fffu + ((b >> 16) & 1u);
  b &= 0xffff0000u;
  float y;
  std::memcpy(&y, &b, 4);
  return y;
}

rope_spec yarn_spec()
{
  // Qwen2.5-7B-Instruct with the YaRN extension its model card gives (factor 4, L0 32768).
  rope_spec spec             = rope_presets::qwen2_5_7b();
  spec.scaling               = rope_scaling::yarn;
  spec.factor                = 4.0;
  spec.original_max_position = 32768;
  spec.max_position          = 131072;
  return spec;
}

rope_spec longrope_spec()
{
  // microsoft/Phi-3.5-mini-instruct (head dim 96, theta 1e4, L0 4096, Lmax 131072, 48 + 48
  // factors from its config.json).
  rope_spec spec = rope_presets::phi_3_5_mini();
  REQUIRE(spec.short_factor.size() == 48);
  REQUIRE(spec.long_factor.size() == 48);
  // Spot checks of the published lists: first and last of each.
  REQUIRE(spec.short_factor.front() == 1.0);
  REQUIRE(spec.short_factor.back() == Approx(2.84).epsilon(1e-6));
  REQUIRE(spec.long_factor.front() == Approx(1.08).epsilon(1e-6));
  REQUIRE(spec.long_factor.back() == Approx(64.84).epsilon(1e-6));
  return spec;
}

}  // namespace

TEST_CASE("inverse frequencies equal the published formulas for real configurations", "[rope]")
{
  SECTION("Llama-3.1-8B-Instruct: llama3 bands (FlashInfer's smooth form)")
  {
    rope_spec const spec = rope_presets::llama_3_1_8b();
    // theta 5e5, d 128, f 8, lf 1, hf 4, L_old 8192:
    // smooth = clamp(freq * L_old / (2 pi (hf - lf)) - 1 / (hf/lf - 1), 0, 1),
    // inv = (1 - smooth) freq / f + smooth freq.
    double const f = 8, lf = 1, hf = 4, old = 8192;
    std::vector<double> expected;
    for (double freq : plain_inv(500000.0, 128)) {
      double const smooth =
        std::clamp(freq * old / (2 * pi * (hf - lf)) - 1.0 / (hf / lf - 1.0), 0.0, 1.0);
      expected.push_back((1 - smooth) * freq / f + smooth * freq);
    }
    check_inv(spec, expected);
    // Sanity of the bands: the fastest pair keeps its frequency, the slowest is divided by 8.
    REQUIRE(expected.front() == 1.0);
    REQUIRE(expected.back() == Approx(std::pow(500000.0, -126.0 / 128) / 8).epsilon(1e-12));
  }
  SECTION("Qwen2.5-7B-Instruct and Mistral-7B-Instruct-v0.3: default, theta 1e6")
  {
    check_inv(rope_presets::qwen2_5_7b(), plain_inv(1e6, 128));
    check_inv(rope_presets::mistral_7b_v0_3(), plain_inv(1e6, 128));
    REQUIRE(make_rope_params(rope_presets::qwen2_5_7b()).attention_factor == 1.0f);
  }
  SECTION("SmolLM2-135M: default, theta 1e5, head dim 64")
  {
    check_inv(rope_presets::smollm2_135m(), plain_inv(1e5, 64));
  }
  SECTION("linear: frequencies divided by the factor")
  {
    rope_spec spec = rope_presets::mistral_7b_v0_3();
    spec.scaling   = rope_scaling::linear;
    spec.factor    = 4;
    auto expected  = plain_inv(1e6, 128);
    for (auto& v : expected) {
      v /= 4;
    }
    check_inv(spec, expected);
  }
  SECTION("YaRN (Qwen2.5-7B with factor 4, L0 32768)")
  {
    rope_spec const spec = yarn_spec();
    double const d = 128, theta = 1e6, f = 4, l0 = 32768;
    auto corr   = [&](double r) { return d * std::log(l0 / (2 * pi * r)) / (2 * std::log(theta)); };
    double low  = std::max(std::floor(corr(32)), 0.0);
    double high = std::min(std::ceil(corr(1)), d - 1);
    if (low == high) { high += 0.001; }
    std::vector<double> expected;
    auto const base = plain_inv(theta, 128);
    for (int i = 0; i < 64; ++i) {
      double const ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      double const e    = 1 - ramp;  // extrapolation weight
      expected.push_back(base[i] / f * (1 - e) + base[i] * e);
    }
    check_inv(spec, expected);
    // a = 0.1 ln f + 1
    REQUIRE(spec.attention_scaling() == Approx(0.1 * std::log(4.0) + 1).epsilon(1e-15));
    // DeepSeek style: mscale / mscale_all_dim cancel when equal.
    rope_spec ds      = spec;
    ds.mscale         = 0.707;
    ds.mscale_all_dim = 0.707;
    REQUIRE(ds.attention_scaling() == Approx(1.0).epsilon(1e-15));
    ds.attention_factor = 1.25;
    REQUIRE(ds.attention_scaling() == 1.25);
    // Without truncation the correction range is not rounded.
    rope_spec nt = spec;
    nt.truncate  = false;
    auto const g = nt.inverse_frequencies();
    double lo2 = std::max(corr(32), 0.0), hi2 = std::min(corr(1), d - 1);
    for (int i = 0; i < 64; ++i) {
      double const e = 1 - std::clamp((i - lo2) / (hi2 - lo2), 0.0, 1.0);
      REQUIRE(g[i] == Approx(base[i] / f * (1 - e) + base[i] * e).epsilon(1e-12));
    }
  }
  SECTION(
    "LongRoPE (Phi-3.5-mini): short factors up to L0, long beyond; a = sqrt(1 + ln f / ln L0)")
  {
    rope_spec const spec = longrope_spec();
    auto const base      = plain_inv(1e4, 96);
    std::vector<double> short_expected, long_expected;
    for (int i = 0; i < 48; ++i) {
      short_expected.push_back(1.0 / (spec.short_factor[i] * std::pow(1e4, 2.0 * i / 96)));
      long_expected.push_back(1.0 / (spec.long_factor[i] * std::pow(1e4, 2.0 * i / 96)));
    }
    check_inv(spec, short_expected, 4096);
    check_inv(spec, long_expected, 4097);
    REQUIRE(spec.attention_scaling() ==
            Approx(std::sqrt(1 + std::log(32.0) / std::log(4096.0))).epsilon(1e-15));
  }
  SECTION("dynamic NTK: plain up to Lmax, rescaled base beyond")
  {
    rope_spec spec = rope_presets::smollm2_135m();  // Lmax 8192
    spec.scaling   = rope_scaling::dynamic_ntk;
    spec.factor    = 2.0;
    check_inv(spec, plain_inv(1e5, 64), 100);
    check_inv(spec, plain_inv(1e5, 64), 8192);
    // L = 16384: base' = 1e5 * (2 * 16384 / 8192 - 1)^(64/62) = 1e5 * 3^(64/62)
    check_inv(spec, plain_inv(1e5 * std::pow(3.0, 64.0 / 62.0), 64), 16384);
    // vLLM's static form, L = Lmax * f: base' = theta (f^2 - f + 1)^(d/(d-2))
    check_inv(spec, plain_inv(1e5 * std::pow(2.0 * 2 - 2 + 1, 64.0 / 62.0), 64), 8192 * 2);
    REQUIRE(spec.is_length_dependent());
  }
  SECTION("partial rotary uses rotary_dim in the exponent")
  {
    rope_spec spec  = rope_presets::qwen2_5_7b();
    spec.rotary_dim = 32;
    check_inv(spec, plain_inv(1e6, 32));
  }
}

TEST_CASE("both pairings equal a rotation written with complex numbers", "[rope]")
{
  auto const pairing = GENERATE(rope_pairing::halves, rope_pairing::interleaved);
  auto const rotary  = GENERATE(128, 64);  // 64: partial rotary, trailing 64 dims untouched
  auto const scaling = GENERATE(rope_scaling::none, rope_scaling::yarn);
  CAPTURE(static_cast<int>(pairing), rotary, static_cast<int>(scaling));

  rope_spec spec  = scaling == rope_scaling::yarn ? yarn_spec() : rope_presets::qwen2_5_7b();
  spec.pairing    = pairing;
  spec.rotary_dim = rotary;
  spec.angle_mode = rope_angle_mode::exact;
  auto params     = make_rope_params(spec);
  // positions up to 131071 with Qwen's 32768: the rotation's arithmetic, not the model's range
  params.allow_beyond_max_position = true;
  std::vector<double> inv_f32;  // the fp32 frequencies the rotation uses
  for (int i = 0; i < rotary / 2; ++i) {
    inv_f32.push_back(params.inv_freq[i]);
  }
  double const a = spec.attention_scaling();

  std::mt19937_64 rng(42);
  for (std::int64_t position : {0LL, 1LL, 17LL, 4095LL, 131071LL}) {
    CAPTURE(position);
    auto const x   = random_vector(rng, 128);
    auto const got = rotate(x, params, position, rope_op::forward);
    std::vector<double> xd(x.begin(), x.end());
    auto const expected =
      complex_rotation(xd, inv_f32, double(position), a, rotary, pairing == rope_pairing::halves);
    for (int j = 0; j < 128; ++j) {
      CAPTURE(j);
      REQUIRE(got[j] == Approx(expected[j]).margin(4e-6 * a * 4));
      if (j >= rotary) { REQUIRE(got[j] == x[j]); }  // pass-through, not scaled by a
    }
  }
}

TEST_CASE("relocation: <R_a q, R_b k> = <q, R_(b-a) k>", "[rope]")
{
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::int64_t> pos(0, 131072);

  auto const run = [&](rope_spec spec, bool exact_angles) {
    spec.angle_mode = exact_angles ? rope_angle_mode::exact : rope_angle_mode::fp32;
    auto params     = make_rope_params(spec, 131072);
    // positions 0 .. 131072 whatever the preset's range: the identity, not the model's range
    params.allow_beyond_max_position = true;
    double const a2                  = double(params.attention_factor) * params.attention_factor;
    for (int trial = 0; trial < 200; ++trial) {
      std::int64_t const pa = pos(rng), pb = pos(rng);
      auto const q = random_vector(rng, 128);
      auto const k = random_vector(rng, 128);
      double const lhs =
        dot(rotate(q, params, pa, rope_op::forward), rotate(k, params, pb, rope_op::forward));
      double const rhs = a2 * dot(q, rotate(k, params, pb - pa, rope_op::shift));
      // fp32 rounding of the rotation and of a 128-term dot product of O(1) terms.
      double bound = 1e-4 * (1 + std::sqrt(dot(q, q) * dot(k, k))) * a2;
      if (!exact_angles) {
        // Angles rounded to fp32 (as HF does) move each pair by at most half an ulp of
        // p*inv for p = a, b and b-a; the score moves by at most |q_i||k_i| times that.
        for (int i = 0; i < params.num_pairs(); ++i) {
          float const inv = params.inv_freq[i];
          double const dphi =
            0.5 * (ulp(float(pa) * inv) + ulp(float(pb) * inv) + ulp(float(pb - pa) * inv));
          int const f = spec.pairing == rope_pairing::halves ? i : 2 * i;
          int const s = spec.pairing == rope_pairing::halves ? i + 64 : 2 * i + 1;
          bound += a2 * dphi * std::hypot(q[f], q[s]) * std::hypot(k[f], k[s]);
        }
      }
      CAPTURE(trial, pa, pb, lhs, rhs, bound);
      REQUIRE(std::fabs(lhs - rhs) <= bound);
    }
  };

  SECTION("exact angles: to fp32 rounding, every fixed-frequency type")
  {
    for (auto spec : {rope_presets::llama_3_1_8b(), rope_presets::qwen2_5_7b(), yarn_spec()}) {
      run(spec, true);
      spec.pairing = rope_pairing::interleaved;
      run(spec, true);
    }
    rope_spec linear = rope_presets::mistral_7b_v0_3();
    linear.scaling   = rope_scaling::linear;
    linear.factor    = 4;
    run(linear, true);
  }
  SECTION("fp32 angles (engine-exact): within the angle-rounding bound")
  {
    run(rope_presets::llama_3_1_8b(), false);
    run(yarn_spec(), false);
  }
  SECTION("dynamic NTK is documented as length-dependent: frequencies move with the length")
  {
    rope_spec spec = rope_presets::smollm2_135m();
    spec.scaling   = rope_scaling::dynamic_ntk;
    spec.factor    = 2.0;
    // Resolved for one total length it is a fixed rotation, so relocation holds...
    rope_spec h = spec;
    h.head_dim  = 128;  // the shared harness uses 128-dim heads
    run(h, true);
    // ...but keys rotated for one total length do not match those for another (HF recomputes
    // the base as the sequence grows), so stored keys must be rotated for the final length.
    auto const short_params = make_rope_params(spec, 4096);
    auto const long_params  = make_rope_params(spec, 4 * 8192);
    REQUIRE(short_params.inv_freq[10] != long_params.inv_freq[10]);
  }
}

TEST_CASE("inverse and shift round-trip", "[rope]")
{
  std::mt19937_64 rng(3);
  for (auto spec : {rope_presets::llama_3_1_8b(), yarn_spec(), longrope_spec()}) {
    for (auto mode : {rope_angle_mode::fp32, rope_angle_mode::exact}) {
      spec.angle_mode   = mode;
      auto const params = make_rope_params(spec, 1000);
      auto const d      = static_cast<std::size_t>(spec.head_dim);
      for (std::int64_t p : {0LL, 5LL, 1000LL, 70000LL}) {
        CAPTURE(p, static_cast<int>(mode));
        auto const x = random_vector(rng, d);
        auto const back =
          rotate(rotate(x, params, p, rope_op::forward), params, p, rope_op::inverse);
        for (std::size_t j = 0; j < d; ++j) {
          REQUIRE(back[j] == Approx(x[j]).margin(2e-6));
        }
        // forward(p) then shift(+delta) equals forward(p + delta); shift(-delta) undoes it.
        std::int64_t const delta = 333;
        auto const at_p          = rotate(x, params, p, rope_op::forward);
        auto const moved         = rotate(at_p, params, delta, rope_op::shift);
        auto const direct        = rotate(x, params, p + delta, rope_op::forward);
        auto const undone        = rotate(moved, params, -delta, rope_op::shift);
        // fp32 angles: p*inv, delta*inv and (p+delta)*inv are each rounded to fp32 (at most
        // half an ulp of p, delta, p+delta since inv <= 1); a pair of Gaussian entries has
        // magnitude well below 6.
        double const angle_error =
          mode == rope_angle_mode::exact
            ? 0.0
            : 0.5 * (ulp(float(p)) + ulp(float(delta)) + ulp(float(p + delta)));
        double const tol = 3.2e-5 + 6 * angle_error;
        for (std::size_t j = 0; j < d; ++j) {
          REQUIRE(moved[j] == Approx(direct[j]).margin(tol));
          REQUIRE(undone[j] == Approx(at_p[j]).margin(4e-6 * 8));
        }
      }
    }
  }
  SECTION("bf16 keys round-trip within bf16 rounding")
  {
    auto const params = make_rope_params(rope_presets::llama_3_1_8b());
    auto const x      = random_vector(rng, 8 * 128);
    std::vector<bfloat16_t> k(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      k[i] = from_float<bfloat16_t>(x[i]);
    }
    auto const original = k;
    std::vector<std::int64_t> positions(8);
    for (int t = 0; t < 8; ++t) {
      positions[t] = 1000 * t + 1;
    }
    auto const view = make_token_head_view(k.data(), 8, 1, 128);
    rope_apply_host(view, positions.data(), 8, params, rope_op::forward);
    rope_apply_host(view, positions.data(), 8, params, rope_op::inverse);
    for (std::size_t i = 0; i < k.size(); ++i) {
      float const o = to_float(original[i]);
      // two roundings of a rotated pair: a few bf16 ulps of the pair's magnitude
      REQUIRE(to_float(k[i]) == Approx(o).margin(4 * std::ldexp(1.0f, -8) * 4));
    }
  }
}

TEST_CASE("the cos/sin-table path equals the computed-frequency path", "[rope]")
{
  auto const pairing = GENERATE(rope_pairing::halves, rope_pairing::interleaved);
  rope_spec spec     = yarn_spec();  // a != 1, so the table carries the attention factor
  spec.pairing       = pairing;
  spec.rotary_dim    = 96;  // partial
  auto const params  = make_rope_params(spec);
  float const a      = params.attention_factor;

  // vLLM's cos_sin_cache, fp32, built here: row p = [a cos(p inv_i) | a sin(p inv_i)], with the
  // fp32 angle float(p) * inv_i and cos/sin rounded once to fp32 (from the long double ones).
  std::int64_t const rows = 5000;
  std::vector<float> table(static_cast<std::size_t>(rows * 96));
  for (std::int64_t p = 0; p < rows; ++p) {
    for (int i = 0; i < 48; ++i) {
      float const angle      = float(p) * params.inv_freq[i];
      table[p * 96 + i]      = static_cast<float>(cosl(angle)) * a;
      table[p * 96 + 48 + i] = static_cast<float>(sinl(angle)) * a;
    }
  }
  rope_cos_sin_table<float> tab{table.data(), rows, 96, 128, 96, pairing, false};
  // The library's own table builder gives the same values, and a view with the same fields.
  REQUIRE(make_rope_cos_sin_values<float>(params, rows) == table);
  auto const made = make_rope_cos_sin_table(params, table.data(), rows, false);
  REQUIRE((made.row_stride == 96 && made.rotary_dim == 96 && made.head_dim == 128 &&
           made.pairing == pairing && made.max_position == rows && !made.round_each_operation));

  std::mt19937_64 rng(11);
  std::vector<std::int64_t> positions{0, 1, 2, 999, 4999, 3};
  auto const x = random_vector(rng, positions.size() * 4 * 128);
  for (auto op : {rope_op::forward, rope_op::inverse}) {
    auto by_params = x, by_table = x;
    auto const n = static_cast<std::int64_t>(positions.size());
    rope_apply_host(
      make_token_head_view(by_params.data(), n, 4, 128), positions.data(), n, params, op);
    rope_apply_host(make_token_head_view(by_table.data(), n, 4, 128), positions.data(), n, tab, op);
    for (std::size_t i = 0; i < x.size(); ++i) {
      CAPTURE(i, static_cast<int>(op));
      if (op == rope_op::forward) {
        REQUIRE(by_table[i] == by_params[i]);  // same cos/sin, same arithmetic: identical bits
      } else {
        REQUIRE(by_table[i] == Approx(by_params[i]).margin(1e-6));
      }
    }
  }
  SECTION("shift by a table row equals the unscaled computed rotation")
  {
    auto by_params = x, by_table = x;
    std::vector<std::int64_t> deltas{0, -1, 2, -999, 4999, 3};
    auto const n = static_cast<std::int64_t>(deltas.size());
    rope_apply_host(
      make_token_head_view(by_params.data(), n, 4, 128), deltas.data(), n, params, rope_op::shift);
    rope_apply_host(
      make_token_head_view(by_table.data(), n, 4, 128), deltas.data(), n, tab, rope_op::shift);
    for (std::size_t i = 0; i < x.size(); ++i) {
      REQUIRE(by_table[i] == Approx(by_params[i]).margin(2e-6));
    }
  }
}

TEST_CASE("a bf16 table with per-operation rounding matches vLLM's kernel arithmetic", "[rope]")
{
  // vLLM: cache.to(bf16); x' = x*cos - y*sin in c10::BFloat16, i.e. every product and the
  // difference rounded to bf16.
  auto const params       = make_rope_params(rope_presets::llama_3_1_8b());
  std::int64_t const rows = 64;
  std::vector<bfloat16_t> table(rows * 128);
  std::vector<float> table_f(rows * 128);
  for (std::int64_t p = 0; p < rows; ++p) {
    for (int i = 0; i < 64; ++i) {
      float const angle         = float(p) * params.inv_freq[i];
      table_f[p * 128 + i]      = bf16_round(std::cos(angle));
      table_f[p * 128 + 64 + i] = bf16_round(std::sin(angle));
      table[p * 128 + i]        = from_float<bfloat16_t>(table_f[p * 128 + i]);
      table[p * 128 + 64 + i]   = from_float<bfloat16_t>(table_f[p * 128 + 64 + i]);
    }
  }
  rope_cos_sin_table<bfloat16_t> tab{table.data(), rows, 128, 128, 128, rope_pairing::halves, true};
  std::mt19937_64 rng(5);
  auto const xf = random_vector(rng, rows * 128);
  std::vector<bfloat16_t> k(xf.size());
  std::vector<float> kr(xf.size());
  for (std::size_t i = 0; i < xf.size(); ++i) {
    kr[i] = bf16_round(xf[i]);
    k[i]  = from_float<bfloat16_t>(kr[i]);
  }
  std::vector<std::int64_t> positions(rows);
  for (std::int64_t p = 0; p < rows; ++p) {
    positions[p] = p;
  }
  rope_apply_host(
    make_token_head_view(k.data(), rows, 1, 128), positions.data(), rows, tab, rope_op::forward);
  for (std::int64_t p = 0; p < rows; ++p) {
    for (int i = 0; i < 64; ++i) {
      float const c = table_f[p * 128 + i], s = table_f[p * 128 + 64 + i];
      float const x = kr[p * 128 + i], y = kr[p * 128 + 64 + i];
      float const ex = bf16_round(bf16_round(x * c) - bf16_round(y * s));
      float const ey = bf16_round(bf16_round(y * c) + bf16_round(x * s));
      CAPTURE(p, i);
      REQUIRE(to_float(k[p * 128 + i]) == ex);
      REQUIRE(to_float(k[p * 128 + 64 + i]) == ey);
    }
  }
}

TEST_CASE("batch rotation touches only the view's elements, any strides", "[rope]")
{
  // vLLM's fused qkv buffer [T, (Hq + 2 Hk) * D]: the key view has token stride (Hq+2Hk)*D.
  std::int64_t const tokens = 5, hq = 4, hk = 2, d = 64;
  std::int64_t const row = (hq + 2 * hk) * d;
  std::mt19937_64 rng(9);
  auto const qkv    = random_vector(rng, static_cast<std::size_t>(tokens * row));
  auto work         = qkv;
  auto const params = make_rope_params(rope_presets::smollm2_135m());
  std::vector<std::int64_t> positions{4, 0, 7, 100, 8191};
  auto const keys = make_token_head_view(work.data() + hq * d, tokens, hk, d, row, d, 1);
  rope_apply_host(keys, positions.data(), tokens, params, rope_op::forward);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t j = 0; j < row; ++j) {
      bool const is_key = j >= hq * d && j < (hq + hk) * d;
      if (!is_key) { REQUIRE(work[t * row + j] == qkv[t * row + j]); }
    }
    for (std::int64_t h = 0; h < hk; ++h) {
      std::vector<float> head(qkv.begin() + t * row + (hq + h) * d,
                              qkv.begin() + t * row + (hq + h + 1) * d);
      auto const expected = rotate(head, params, positions[t], rope_op::forward);
      for (std::int64_t j = 0; j < d; ++j) {
        REQUIRE(work[t * row + (hq + h) * d + j] == expected[j]);
      }
    }
  }
  SECTION("element stride > 1 (a head_dim-major view)")
  {
    std::vector<float> x = random_vector(rng, 3 * 64);  // stored [head_dim, tokens]
    auto y               = x;
    std::vector<std::int64_t> pos{1, 2, 3};
    rope_apply_host(
      make_token_head_view(y.data(), 3, 1, 64, 1, 0, 3), pos.data(), 3, params, rope_op::forward);
    for (int t = 0; t < 3; ++t) {
      std::vector<float> head(64);
      for (int j = 0; j < 64; ++j) {
        head[j] = x[j * 3 + t];
      }
      auto const e = rotate(head, params, pos[t], rope_op::forward);
      for (int j = 0; j < 64; ++j) {
        REQUIRE(y[j * 3 + t] == e[j]);
      }
    }
  }
}

TEST_CASE("bad specs and bad batches are refused with a clear message", "[rope]")
{
  rope_spec good = rope_presets::llama_3_1_8b();
  SECTION("odd rotary_dim")
  {
    rope_spec s  = good;
    s.rotary_dim = 63;
    REQUIRE_THROWS_WITH(s.validate(), Contains("rotary_dim") && Contains("even"));
  }
  SECTION("rotary_dim > head_dim")
  {
    rope_spec s  = good;
    s.rotary_dim = 256;
    REQUIRE_THROWS_WITH(make_rope_params(s), Contains("must not exceed head_dim"));
  }
  SECTION("rotary_dim beyond the 512 the kernels support, from a spec or from a table")
  {
    rope_spec s  = good;
    s.head_dim   = 1024;
    s.rotary_dim = 1024;
    REQUIRE_THROWS_WITH(make_rope_params(s), Contains("exceeds the supported 512"));
    std::vector<float> table(1024), x(1024, 1.0f);
    rope_cos_sin_table<float> tab{table.data(), 1, 1024, 1024, 1024, rope_pairing::halves, false};
    std::int64_t const position = 0;
    REQUIRE_THROWS_WITH(
      rope_apply_host(
        make_token_head_view(x.data(), 1, 1, 1024), &position, 1, tab, rope_op::forward),
      Contains("exceeds the supported 512"));
  }
  SECTION("non-positive theta")
  {
    rope_spec s = good;
    s.theta     = 0;
    REQUIRE_THROWS_AS(s.validate(), inferscale::logic_error);
    REQUIRE_THROWS_WITH(s.validate(), Contains("theta"));
    s.theta = -5e5;
    REQUIRE_THROWS_WITH(s.inverse_frequencies(), Contains("theta"));
  }
  SECTION("factor < 1 where the type forbids it")
  {
    for (auto type : {rope_scaling::linear,
                      rope_scaling::dynamic_ntk,
                      rope_scaling::llama3,
                      rope_scaling::yarn}) {
      rope_spec s = type == rope_scaling::yarn ? yarn_spec() : good;
      s.scaling   = type;
      s.factor    = 0.5;
      REQUIRE_THROWS_WITH(s.validate(), Contains("factor") && Contains(">= 1"));
    }
  }
  SECTION("llama3 with inverted bands, yarn without L0, longrope with short lists")
  {
    rope_spec s        = good;
    s.high_freq_factor = 0.5;
    REQUIRE_THROWS_WITH(s.validate(), Contains("high_freq_factor"));
    rope_spec y             = yarn_spec();
    y.original_max_position = 0;
    REQUIRE_THROWS_WITH(y.validate(), Contains("original_max_position"));
    rope_spec l = longrope_spec();
    l.long_factor.pop_back();
    REQUIRE_THROWS_WITH(l.validate(), Contains("48 entries"));
  }
  SECTION("batches: position count, negative position, beyond the table; nothing is written")
  {
    auto const params = make_rope_params(good);
    std::vector<float> x(2 * 128, 1.0f);
    auto const before = x;
    auto const view   = make_token_head_view(x.data(), 2, 1, 128);
    std::vector<std::int64_t> one{3};
    REQUIRE_THROWS_WITH(rope_apply_host(view, one.data(), 1, params, rope_op::forward),
                        Contains("1 position given for 2 tokens"));
    std::vector<std::int64_t> negative{3, -1};
    REQUIRE_THROWS_WITH(rope_apply_host(view, negative.data(), 2, params, rope_op::forward),
                        Contains("position -1"));
    std::vector<float> table(10 * 128);
    rope_cos_sin_table<float> tab{table.data(), 10, 128, 128, 128, rope_pairing::halves, false};
    std::vector<std::int64_t> far{3, 10};
    REQUIRE_THROWS_WITH(rope_apply_host(view, far.data(), 2, tab, rope_op::forward),
                        Contains("position 10"));
    auto const wrong_dim = make_token_head_view(x.data(), 4, 1, 64);
    std::vector<std::int64_t> four{0, 1, 2, 3};
    REQUIRE_THROWS_WITH(rope_apply_host(wrong_dim, four.data(), 4, params, rope_op::forward),
                        Contains("head_dim 64"));
    REQUIRE(x == before);
  }
}

TEST_CASE("rope_params carries the model's position range; beyond it is refused unless opted in",
          "[rope][positions]")
{
  constexpr std::int64_t two_53 = std::int64_t{1} << 53;  // written out: 2^53
  REQUIRE(rope_position_limit == 9007199254740992);
  REQUIRE(rope_position_limit == two_53);

  SECTION("make_rope_params copies the spec's max_position; dynamic NTK the length it resolves")
  {
    REQUIRE(make_rope_params(rope_presets::llama_3_1_8b()).max_position == 131072);
    REQUIRE(make_rope_params(rope_presets::qwen2_5_7b()).max_position == 32768);
    REQUIRE_FALSE(make_rope_params(rope_presets::qwen2_5_7b()).allow_beyond_max_position);
    REQUIRE(make_rope_params(rope_presets::qwen2_5_7b()).position_bound() == 32768);
    rope_spec dyn = rope_presets::smollm2_135m();  // Lmax 8192
    dyn.scaling   = rope_scaling::dynamic_ntk;
    dyn.factor    = 2.0;
    REQUIRE(make_rope_params(dyn).max_position == 8192);
    REQUIRE(make_rope_params(dyn, 20000).max_position == 20000);
    rope_params hand{};  // hand-built: range unknown, only the hard limit
    REQUIRE(hand.max_position == 0);
    REQUIRE(hand.position_bound() == two_53);
  }

  rope_spec spec                  = rope_presets::smollm2_135m();  // head_dim 64, Lmax 8192
  spec.max_position               = 100;                           // a small range to test its edge
  rope_params const params        = make_rope_params(spec);
  rope_params opted               = params;
  opted.allow_beyond_max_position = true;
  rope_params unknown             = params;
  unknown.max_position            = 0;
  REQUIRE(params.position_bound() == 100);
  REQUIRE(opted.position_bound() == two_53);

  std::vector<float> x(2 * 64);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = 0.25f + 0.01f * static_cast<float>(i);
  }
  auto const start = x;
  auto const view  = make_token_head_view(x.data(), 2, 1, 64);

  SECTION("host batch: the last position accepted, the next refused naming it; nothing written")
  {
    std::vector<std::int64_t> last{0, 99};
    rope_apply_host(view, last.data(), 2, params, rope_op::forward);
    REQUIRE(x != start);
    x = start;
    std::vector<std::int64_t> next{0, 100};
    REQUIRE_THROWS_WITH(rope_apply_host(view, next.data(), 2, params, rope_op::forward),
                        Contains("position 100 of token 1 must be in [0, 100)") &&
                          Contains("max_position 100") && Contains("allow_beyond_max_position"));
    REQUIRE(x == start);
    std::vector<std::int64_t> shift{99, -100};
    REQUIRE_THROWS_WITH(rope_apply_host(view, shift.data(), 2, params, rope_op::shift),
                        Contains("shift -100 of token 1") && Contains("max_position 100"));
    REQUIRE(x == start);
    std::vector<std::int64_t> shift_ok{99, -99};
    REQUIRE_NOTHROW(rope_apply_host(view, shift_ok.data(), 2, params, rope_op::shift));
  }

  SECTION("the opt-in accepts beyond the range, rotating exactly as an unranged rotation")
  {
    std::vector<std::int64_t> far{100, 1000000};
    rope_apply_host(view, far.data(), 2, opted, rope_op::forward);
    REQUIRE(x != start);
    auto y           = start;
    auto const yview = make_token_head_view(y.data(), 2, 1, 64);
    rope_apply_host(yview, far.data(), 2, unknown, rope_op::forward);
    REQUIRE(x == y);
    // and the rotation is the one written with complex numbers (fp32 angles, as formed here)
    std::vector<double> const inv = spec.inverse_frequencies();
    std::vector<double> head(start.begin() + 64, start.end());
    std::vector<double> inv32;
    for (int i = 0; i < 32; ++i) {
      inv32.push_back(static_cast<double>(static_cast<float>(
        static_cast<float>(1000000) * static_cast<float>(inv[static_cast<std::size_t>(i)]))));
    }
    std::vector<double> const want = complex_rotation(head, inv32, 1.0, 1.0, 64, true);
    for (int i = 0; i < 64; ++i) {
      REQUIRE(x[static_cast<std::size_t>(64 + i)] ==
              Approx(want[static_cast<std::size_t>(i)]).margin(1e-5));
    }
  }

  SECTION("rope_position_limit (2^53) is refused always, opt-in or not; no overflow near INT64_MAX")
  {
    std::int64_t const int64_max = std::numeric_limits<std::int64_t>::max();
    std::vector<std::int64_t> edge{0, two_53 - 1};
    REQUIRE_NOTHROW(rope_apply_host(view, edge.data(), 2, unknown, rope_op::forward));
    x = start;
    for (std::int64_t p : {two_53, int64_max - 1, int64_max}) {
      std::vector<std::int64_t> beyond{0, p};
      for (rope_params const* r : {&opted, &unknown}) {
        REQUIRE_THROWS_WITH(
          rope_apply_host(view, beyond.data(), 2, *r, rope_op::forward),
          Contains("position " + std::to_string(p)) && Contains("rope_position_limit"));
        REQUIRE(x == start);
      }
    }
    // rope_check_positions: p0 + n - 1 is never formed beyond the limit
    REQUIRE_NOTHROW(rope_check_positions(opted, two_53 - 10, 10));
    REQUIRE_THROWS_WITH(rope_check_positions(opted, two_53 - 10, 11, "t"),
                        Contains("t: position 9007199254740982 + 10 = 9007199254740992") &&
                          Contains("rope_position_limit"));
    REQUIRE_THROWS_WITH(rope_check_positions(opted, int64_max - 1, 5, "t"),
                        Contains("t: position 9223372036854775806 is beyond rope_position_limit"));
    REQUIRE_THROWS_WITH(rope_check_positions(opted, 5, int64_max, "t"),
                        Contains("t: position 5 + 9223372036854775806 is beyond"));
    REQUIRE_THROWS_WITH(rope_check_positions(opted, -1, 1, "t"), Contains("position -1"));
    REQUIRE_NOTHROW(rope_check_positions(params, int64_max, 0));  // nothing asked for
  }

  SECTION("rope_check_positions: the model's range, its boundary, and a table's rows")
  {
    REQUIRE_NOTHROW(rope_check_positions(params, 90, 10));
    REQUIRE_THROWS_WITH(
      rope_check_positions(params, 90, 11, "compose"),
      Contains("compose: position 90 + 10 = 100 is beyond the model's range (max_position 100") &&
        Contains("positions must be in [0, 100)"));
    REQUIRE_THROWS_WITH(rope_check_positions(params, 1000000000, 1, "t"),
                        Contains("t: position 1000000000 is beyond the model's range"));
    REQUIRE_NOTHROW(rope_check_positions(opted, 1000000000, 1));
    std::vector<float> table(10 * 64);
    rope_cos_sin_table<float> tab{table.data(), 10, 64, 64, 64, rope_pairing::halves, false};
    REQUIRE_NOTHROW(rope_check_positions(tab, 9, 1));
    REQUIRE_THROWS_WITH(rope_check_positions(tab, 9, 2, "t"),
                        Contains("t: position 9 + 1 = 10 is beyond the cos/sin table (10 rows)"));
  }
}

TEST_CASE("cos_sin_swizzle: a permutation within rows of 16 entries, and conflict-free reads",
          "[rope][swizzle]")
{
  // the tile sizes the kernels allocate: whole rows of 16 entries
  REQUIRE(detail::cos_sin_tile_entries(0) == 0);
  REQUIRE(detail::cos_sin_tile_entries(1) == 16);
  REQUIRE(detail::cos_sin_tile_entries(256) == 256);
  REQUIRE(detail::cos_sin_tile_entries(4 * 36) == 144);
  REQUIRE(detail::cos_sin_tile_entries(4 * 10) == 48);
  // every index of a tile maps into the same row of 16, and no two indices to one place
  std::int32_t const n = 16 * 16 * 4;
  std::vector<int> hits(static_cast<std::size_t>(n), 0);
  for (std::int32_t i = 0; i < n; ++i) {
    std::int32_t const j = detail::cos_sin_swizzle(i);
    REQUIRE(j / 16 == i / 16);
    ++hits[static_cast<std::size_t>(j)];
  }
  for (int h : hits) {
    REQUIRE(h == 1);
  }
  // Entry j of sixteen neighbouring runs of m pairs (threads c .. c + 15 each reading entry j of
  // run c), from any row: sixteen different 8-byte bank pairs (index % 16 after the swizzle).
  // Unswizzled, sixteen runs of 8 fall on two bank pairs.
  for (std::int32_t m : {1, 2, 4, 8}) {
    for (std::int32_t row = 0; row < 64; ++row) {
      for (std::int32_t first_run = 0; first_run < 64; first_run += 16) {
        for (std::int32_t j = 0; j < m; ++j) {
          std::vector<bool> bank(16, false);
          int distinct = 0, distinct_in_order = 0;
          std::vector<bool> bank_in_order(16, false);
          for (std::int32_t c = first_run; c < first_run + 16; ++c) {
            std::int32_t const entry = 16 * row + c * m + j;
            auto const b = static_cast<std::size_t>(detail::cos_sin_swizzle(entry) % 16);
            distinct += !bank[b];
            bank[b] = true;
            distinct_in_order += !bank_in_order[static_cast<std::size_t>(entry % 16)];
            bank_in_order[static_cast<std::size_t>(entry % 16)] = true;
          }
          CAPTURE(m, row, first_run, j);
          REQUIRE(distinct == 16);
          if (m == 8) { REQUIRE(distinct_in_order == 2); }
        }
      }
    }
  }
}
