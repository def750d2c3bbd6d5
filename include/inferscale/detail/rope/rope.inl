/**
 * @file detail/rope/rope.inl
 * @brief Definitions for rope.hpp: spec validation, inverse frequencies of each rope type,
 * presets, and the host backend's batch operation.
 */
#pragma once

#include <inferscale/detail/rope/rotate_simd.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace inferscale {

namespace detail {
inline std::string rope_field(char const* name, double value)
{
  std::string text = std::to_string(value);
  return std::string{"rope_spec."} + name + " = " + text;
}

/// @brief The default inverse frequencies theta^(-2i/d).
inline std::vector<double> default_inverse_frequencies(double theta, std::int32_t rotary_dim)
{
  std::vector<double> inv(static_cast<std::size_t>(rotary_dim / 2));
  for (std::size_t i = 0; i < inv.size(); ++i) {
    inv[i] = std::pow(theta, -2.0 * static_cast<double>(i) / rotary_dim);
  }
  return inv;
}

/// @brief YaRN's mscale m(f, k) = 0.1 k ln f + 1 (1 for f <= 1).
inline double yarn_mscale(double factor, double k)
{
  return factor <= 1.0 ? 1.0 : 0.1 * k * std::log(factor) + 1.0;
}
}  // namespace detail

inline void rope_spec::validate() const
{
  using detail::rope_field;
  INFERSCALE_EXPECTS(head_dim > 0 && head_dim % 2 == 0,
                     rope_field("head_dim", head_dim) + ": must be positive and even");
  std::int32_t const d = effective_rotary_dim();
  INFERSCALE_EXPECTS(
    d > 0, rope_field("rotary_dim", rotary_dim) + ": must be positive (or 0 for head_dim)");
  INFERSCALE_EXPECTS(d % 2 == 0,
                     rope_field("rotary_dim", d) + ": must be even (dims rotate in pairs)");
  INFERSCALE_EXPECTS(
    d <= head_dim,
    rope_field("rotary_dim", d) + ": must not exceed head_dim " + std::to_string(head_dim));
  INFERSCALE_EXPECTS(std::isfinite(theta) && theta > 1.0,
                     rope_field("theta", theta) + ": must be finite and greater than 1");
  INFERSCALE_EXPECTS(
    !attention_factor || (std::isfinite(*attention_factor) && *attention_factor > 0),
    rope_field("attention_factor", attention_factor.value_or(0)) + ": must be positive");
  bool const needs_factor = scaling == rope_scaling::linear ||
                            scaling == rope_scaling::dynamic_ntk ||
                            scaling == rope_scaling::llama3 || scaling == rope_scaling::yarn;
  if (scaling == rope_scaling::yarn && factor == 0.0) {
    // HF (transformers v5): a YaRN config without `factor` takes Lmax / L0.
    INFERSCALE_EXPECTS(
      max_position > 0 && original_max_position > 0,
      rope_field("factor", factor) +
        ": yarn without a factor (0) derives it as max_position / original_max_position, which "
        "needs both > 0 (got " +
        std::to_string(max_position) + " and " + std::to_string(original_max_position) + ")");
  }
  if (needs_factor) {
    double const f = effective_factor();
    INFERSCALE_EXPECTS(std::isfinite(f) && f >= 1.0,
                       rope_field("factor", f) + ": must be >= 1 for this rope type");
  }
  switch (scaling) {
    case rope_scaling::none:
    case rope_scaling::linear: break;
    case rope_scaling::dynamic_ntk:
      INFERSCALE_EXPECTS(max_position > 0,
                         rope_field("max_position", static_cast<double>(max_position)) +
                           ": dynamic NTK needs max_position_embeddings > 0");
      INFERSCALE_EXPECTS(d > 2, rope_field("rotary_dim", d) + ": dynamic NTK needs rotary_dim > 2");
      break;
    case rope_scaling::llama3:
      INFERSCALE_EXPECTS(
        original_max_position > 0,
        rope_field("original_max_position", static_cast<double>(original_max_position)) +
          ": llama3 needs original_max_position_embeddings > 0");
      INFERSCALE_EXPECTS(low_freq_factor > 0 && high_freq_factor > low_freq_factor,
                         rope_field("high_freq_factor", high_freq_factor) +
                           ": llama3 needs 0 < low_freq_factor < high_freq_factor (low = " +
                           std::to_string(low_freq_factor) + ")");
      break;
    case rope_scaling::yarn:
      INFERSCALE_EXPECTS(
        original_max_position > 0,
        rope_field("original_max_position", static_cast<double>(original_max_position)) +
          ": yarn needs original_max_position_embeddings > 0");
      INFERSCALE_EXPECTS(beta_fast > 0 && beta_slow > 0 && beta_fast >= beta_slow,
                         rope_field("beta_fast", beta_fast) +
                           ": yarn needs beta_fast >= beta_slow > 0 (beta_slow = " +
                           std::to_string(beta_slow) + ")");
      // HF reads `if mscale and mscale_all_dim`: 0 is "absent", as a missing key.
      INFERSCALE_EXPECTS(
        (!mscale || (std::isfinite(*mscale) && *mscale >= 0)) &&
          (!mscale_all_dim || (std::isfinite(*mscale_all_dim) && *mscale_all_dim >= 0)),
        rope_field("mscale", mscale.value_or(0)) +
          ", mscale_all_dim = " + std::to_string(mscale_all_dim.value_or(0)) +
          ": must be finite and non-negative (0 means absent)");
      break;
    case rope_scaling::longrope: {
      INFERSCALE_EXPECTS(
        original_max_position > 0 && max_position > 0,
        rope_field("original_max_position", static_cast<double>(original_max_position)) +
          ": longrope needs original_max_position_embeddings and "
          "max_position_embeddings > 0");
      auto const pairs = static_cast<std::size_t>(d / 2);
      INFERSCALE_EXPECTS(short_factor.size() == pairs && long_factor.size() == pairs,
                         "rope_spec.short_factor/long_factor: longrope needs rotary_dim/2 = " +
                           detail::count_of(static_cast<std::int64_t>(pairs), "entry", "entries") +
                           " each, got " + std::to_string(short_factor.size()) + " and " +
                           std::to_string(long_factor.size()));
      auto const positive = [](double v) { return std::isfinite(v) && v > 0; };
      INFERSCALE_EXPECTS(
        std::all_of(short_factor.begin(), short_factor.end(), positive) &&
          std::all_of(long_factor.begin(), long_factor.end(), positive),
        std::string{"rope_spec.short_factor/long_factor: entries must be positive"});
      break;
    }
    default: INFERSCALE_FAIL("rope_spec.scaling: unknown rope type");
  }
}

inline std::vector<double> rope_spec::inverse_frequencies(std::int64_t total_length) const
{
  validate();
  INFERSCALE_EXPECTS(total_length >= 0,
                     "rope_spec::inverse_frequencies: total_length must be "
                     "non-negative, got " +
                       std::to_string(total_length));
  std::int32_t const d    = effective_rotary_dim();
  double const dd         = static_cast<double>(d);
  constexpr double pi     = 3.14159265358979323846;
  std::vector<double> inv = detail::default_inverse_frequencies(theta, d);

  switch (scaling) {
    case rope_scaling::none: break;
    case rope_scaling::linear:
      for (auto& v : inv) {
        v /= factor;
      }
      break;
    case rope_scaling::dynamic_ntk: {
      // HF: L = max(seq_len, Lmax); base' = base * (f L / Lmax - (f - 1))^(d / (d - 2)).
      double const length = static_cast<double>(std::max<std::int64_t>(total_length, max_position));
      double const base =
        theta * std::pow(factor * length / static_cast<double>(max_position) - (factor - 1.0),
                         dd / (dd - 2.0));
      inv = detail::default_inverse_frequencies(base, d);
      break;
    }
    case rope_scaling::llama3: {
      double const old_context     = static_cast<double>(original_max_position);
      double const low_wavelength  = old_context / low_freq_factor;
      double const high_wavelength = old_context / high_freq_factor;
      for (auto& v : inv) {
        double const wavelength = 2.0 * pi / v;
        if (wavelength < high_wavelength) { continue; }
        if (wavelength > low_wavelength) {
          v /= factor;
          continue;
        }
        double const smooth =
          (old_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
        v = (1.0 - smooth) * v / factor + smooth * v;
      }
      break;
    }
    case rope_scaling::yarn: {
      double const l0 = static_cast<double>(original_max_position);
      auto const corr = [&](double rotations) {
        return dd * std::log(l0 / (rotations * 2.0 * pi)) / (2.0 * std::log(theta));
      };
      double low  = corr(beta_fast);
      double high = corr(beta_slow);
      if (truncate) {
        low  = std::floor(low);
        high = std::ceil(high);
      }
      low  = std::max(low, 0.0);
      high = std::min(high, dd - 1.0);
      if (low == high) { high += 0.001; }
      double const f = effective_factor();
      for (std::size_t i = 0; i < inv.size(); ++i) {
        double const ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        double const extrapolation = 1.0 - ramp;
        inv[i]                     = inv[i] / f * (1.0 - extrapolation) + inv[i] * extrapolation;
      }
      break;
    }
    case rope_scaling::longrope: {
      auto const& ext = total_length > original_max_position ? long_factor : short_factor;
      for (std::size_t i = 0; i < inv.size(); ++i) {
        inv[i] /= ext[i];
      }
      break;
    }
  }
  return inv;
}

inline double rope_spec::attention_scaling(std::int64_t /*total_length*/) const
{
  validate();
  if (attention_factor) { return *attention_factor; }
  if (scaling == rope_scaling::yarn) {
    double const f = effective_factor();
    if (mscale.value_or(0) != 0 && mscale_all_dim.value_or(0) != 0) {
      return detail::yarn_mscale(f, *mscale) / detail::yarn_mscale(f, *mscale_all_dim);
    }
    return detail::yarn_mscale(f, 1.0);
  }
  if (scaling == rope_scaling::longrope) {
    double const f = static_cast<double>(max_position) / static_cast<double>(original_max_position);
    if (f <= 1.0) { return 1.0; }
    return std::sqrt(1.0 + std::log(f) / std::log(static_cast<double>(original_max_position)));
  }
  return 1.0;
}

inline rope_params make_rope_params(rope_spec const& spec, std::int64_t total_length)
{
  spec.validate();
  std::int32_t const d = spec.effective_rotary_dim();
  INFERSCALE_EXPECTS(d / 2 <= rope_params::max_pairs,
                     "make_rope_params: rotary_dim " + std::to_string(d) +
                       " exceeds the supported " + std::to_string(2 * rope_params::max_pairs));
  rope_params params{};
  params.head_dim         = spec.head_dim;
  params.rotary_dim       = d;
  params.pairing          = spec.pairing;
  params.angle_mode       = spec.angle_mode;
  params.attention_factor = static_cast<float>(spec.attention_scaling(total_length));
  // The model's range; dynamic NTK is resolved for a length beyond it on purpose (its base
  // rescaled for total_length), so its range is the length it was resolved for.
  params.max_position = std::max<std::int64_t>(spec.max_position, 0);
  if (spec.scaling == rope_scaling::dynamic_ntk) {
    params.max_position = std::max(params.max_position, total_length);
  }
  std::vector<double> const inv = spec.inverse_frequencies(total_length);
  for (std::size_t i = 0; i < inv.size(); ++i) {
    params.inv_freq[i] = static_cast<float>(inv[i]);
  }
  return params;
}

namespace detail {
/**
 * @brief cos and sin of every pair of one token for `op`, exactly as rope_angle_cos_sin gives
 * them (host). For resolved parameters with fp32 angles the sin/cos of sincos.hpp run 64, 32 or 16
 * angles at a time in lockstep where the CPU has AVX-512F (simd512::sincos_row_at), eight where it
 * has AVX2: the same operations, the same bits.
 */
template <class Rotation>
void rope_cos_sin_row(
  Rotation const& rotation, std::int64_t position, rope_op op, float* cos, float* sin)
{
  for (std::int32_t p = 0; p < rotation.num_pairs(); ++p) {
    rope_cos_sin const cs = rope_angle_cos_sin(rotation, position, p, op);
    cos[p]                = cs.cos;
    sin[p]                = cs.sin;
  }
}
#if INFERSCALE_HOST_X86_SIMD
namespace simd {
/**
 * @brief detail::rope_scale_cos_sin over `n` (a multiple of 8) cos/sin pairs in place, eight
 * lanes at a time: forward multiplies both by `a`, inverse divides `c` and `-s` by it, shift
 * leaves them (one correctly rounded multiplication or division each, as mul_rn / div_rn).
 */
INFERSCALE_TARGET_AVX2 inline void scale_cos_sin(
  float* cos, float* sin, std::int32_t n, float a, rope_op op)
{
  if (op == rope_op::shift) { return; }
  __m256 const factor = _mm256_set1_ps(a);
  __m256 const minus  = _mm256_set1_ps(-0.0f);
  for (std::int32_t i = 0; i < n; i += 8) {
    __m256 const c = _mm256_loadu_ps(cos + i);
    __m256 const s = _mm256_loadu_ps(sin + i);
    if (op == rope_op::forward) {
      _mm256_storeu_ps(cos + i, _mm256_mul_ps(c, factor));
      _mm256_storeu_ps(sin + i, _mm256_mul_ps(s, factor));
    } else {
      _mm256_storeu_ps(cos + i, _mm256_div_ps(c, factor));
      _mm256_storeu_ps(sin + i, _mm256_div_ps(_mm256_xor_ps(s, minus), factor));
    }
  }
}

}  // namespace simd
#endif

inline void rope_cos_sin_row(
  rope_params const& params, std::int64_t position, rope_op op, float* cos, float* sin)
{
  std::int32_t const pairs = params.num_pairs();
  std::int32_t done        = 0;
#if INFERSCALE_HOST_X86_SIMD
  host_simd const level = active_host_simd();
  if (params.angle_mode == rope_angle_mode::fp32 && level != host_simd::scalar) {
    float const p = static_cast<float>(position);
    if (uses_avx512(level)) { done = simd512::sincos_row_at(p, params.inv_freq, pairs, sin, cos); }
    for (; done + 8 <= pairs; done += 8) {
      if (!simd::sincos8_at(p, params.inv_freq + done, sin + done, cos + done)) { break; }
    }
    // the attention factor and the operation, as rope_angle_cos_sin applies them (done is a
    // multiple of 8)
    simd::scale_cos_sin(cos, sin, done, params.attention_factor, op);
  }
#endif
  for (std::int32_t i = done; i < pairs; ++i) {
    rope_cos_sin const cs = rope_angle_cos_sin(params, position, i, op);
    cos[i]                = cs.cos;
    sin[i]                = cs.sin;
  }
}
/// @brief rope_cos_sin_row into (cos, sin) pairs.
template <class Rotation>
void rope_cos_sin_row(Rotation const& rotation,
                      std::int64_t position,
                      rope_op op,
                      rope_cos_sin* out)
{
  float cos[rope_params::max_pairs];
  float sin[rope_params::max_pairs];
  rope_cos_sin_row(rotation, position, op, cos, sin);
  for (std::int32_t p = 0; p < rotation.num_pairs(); ++p) {
    out[p] = {cos[p], sin[p]};
  }
}
}  // namespace detail

template <class T>
std::vector<T> make_rope_cos_sin_values(rope_params const& params, std::int64_t rows)
{
  INFERSCALE_EXPECTS(
    rows >= 0, "make_rope_cos_sin_values: rows must be non-negative, got " + std::to_string(rows));
  std::int32_t const pairs = params.num_pairs();
  std::vector<T> values(static_cast<std::size_t>(rows) *
                        static_cast<std::size_t>(params.rotary_dim));
  // fp32 angles whatever params.angle_mode says (the table is vLLM's); a forward rotation's
  // cos/sin are `cos(angle) * a`, `sin(angle) * a` (detail::rope_sincos, rounded once each)
  rope_params fp32_angles = params;
  fp32_angles.angle_mode  = rope_angle_mode::fp32;
  float cos[rope_params::max_pairs];
  float sin[rope_params::max_pairs];
  for (std::int64_t p = 0; p < rows; ++p) {
    detail::rope_cos_sin_row(fp32_angles, p, rope_op::forward, cos, sin);
    std::size_t const base = static_cast<std::size_t>(p) * params.rotary_dim;
    for (std::int32_t i = 0; i < pairs; ++i) {
      values[base + i]         = from_float<T>(cos[i]);
      values[base + pairs + i] = from_float<T>(sin[i]);
    }
  }
  return values;
}

namespace rope_presets {
inline rope_spec llama_3_1_8b()
{
  rope_spec spec{};
  spec.head_dim              = 128;
  spec.theta                 = 500000.0;
  spec.scaling               = rope_scaling::llama3;
  spec.factor                = 8.0;
  spec.low_freq_factor       = 1.0;
  spec.high_freq_factor      = 4.0;
  spec.original_max_position = 8192;
  spec.max_position          = 131072;
  return spec;
}
inline rope_spec qwen2_5_7b()
{
  rope_spec spec{};
  spec.head_dim     = 128;
  spec.theta        = 1000000.0;
  spec.max_position = 32768;
  return spec;
}
inline rope_spec mistral_7b_v0_3()
{
  rope_spec spec{};
  spec.head_dim     = 128;
  spec.theta        = 1000000.0;
  spec.max_position = 32768;
  return spec;
}
inline rope_spec smollm2_135m()
{
  rope_spec spec{};
  spec.head_dim     = 64;
  spec.theta        = 100000.0;
  spec.max_position = 8192;
  return spec;
}
inline rope_spec phi_3_5_mini()
{
  // The rope_scaling lists of microsoft/Phi-3.5-mini-instruct's config.json (fp32 values as
  // printed there).
  rope_spec spec{};
  spec.head_dim              = 96;
  spec.theta                 = 10000.0;
  spec.scaling               = rope_scaling::longrope;
  spec.original_max_position = 4096;
  spec.max_position          = 131072;
  spec.short_factor          = {1.0,
                                1.0199999809265137,
                                1.0299999713897705,
                                1.0299999713897705,
                                1.0499999523162842,
                                1.0499999523162842,
                                1.0499999523162842,
                                1.0499999523162842,
                                1.0499999523162842,
                                1.0699999332427979,
                                1.0999999046325684,
                                1.1099998950958252,
                                1.1599998474121094,
                                1.1599998474121094,
                                1.1699998378753662,
                                1.2899998426437378,
                                1.339999794960022,
                                1.679999828338623,
                                1.7899998426437378,
                                1.8199998140335083,
                                1.8499997854232788,
                                1.8799997568130493,
                                1.9099997282028198,
                                1.9399996995925903,
                                1.9899996519088745,
                                2.0199997425079346,
                                2.0199997425079346,
                                2.0199997425079346,
                                2.0199997425079346,
                                2.0199997425079346,
                                2.0199997425079346,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0299997329711914,
                                2.0799996852874756,
                                2.0899996757507324,
                                2.189999580383301,
                                2.2199995517730713,
                                2.5899994373321533,
                                2.729999542236328,
                                2.749999523162842,
                                2.8399994373321533};
  spec.long_factor           = {
              1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
              1.5899999141693115, 1.600000023841858,  1.6200000047683716, 2.620000123977661,
              3.2300000190734863, 3.2300000190734863, 4.789999961853027,  7.400000095367432,
              7.700000286102295,  9.09000015258789,   12.199999809265137, 17.670000076293945,
              24.46000099182129,  28.57000160217285,  30.420001983642578, 30.840002059936523,
              32.590003967285156, 32.93000411987305,  42.320003509521484, 44.96000289916992,
              50.340003967285156, 50.45000457763672,  57.55000305175781,  57.93000411987305,
              58.21000289916992,  60.1400032043457,   62.61000442504883,  62.62000274658203,
              62.71000289916992,  63.1400032043457,   63.1400032043457,   63.77000427246094,
              63.93000411987305,  63.96000289916992,  63.970001220703125, 64.02999877929688,
              64.06999969482422,  64.08000183105469,  64.12000274658203,  64.41000366210938,
              64.4800033569336,   64.51000213623047,  64.52999877929688,  64.83999633789062};
  return spec;
}
}  // namespace rope_presets

namespace detail {
/// @brief Positions a rotation accepts are below this (shift deltas in magnitude): a table's rows,
/// rope_params::position_bound() (the model's max_position or rope_position_limit).
inline std::int64_t rope_table_rows(rope_params const& params) noexcept
{
  return params.position_bound();
}
template <class U>
std::int64_t rope_table_rows(rope_cos_sin_table<U> const& table) noexcept
{
  return std::min(table.max_position, rope_position_limit);
}
template <class Rotation>
void rope_check_rotation(Rotation const&)
{
}

/// @brief "rope_position_limit (2^53 = 9007199254740992" (the messages close the parenthesis).
inline std::string rope_position_limit_text()
{
  return "rope_position_limit (2^53 = " + std::to_string(rope_position_limit);
}

/// @brief What bounds a rotation's positions, for messages ("beyond <this>").
inline std::string rope_range_text(rope_params const& params)
{
  if (params.position_bound() < rope_position_limit) {
    return "the model's range (max_position " + std::to_string(params.max_position) +
           "; set rope_params::allow_beyond_max_position to opt in)";
  }
  return rope_position_limit_text() + (params.max_position > 0
                                         ? "; max_position " + std::to_string(params.max_position) +
                                             " opted out of by allow_beyond_max_position)"
                                         : ")");
}
template <class U>
std::string rope_range_text(rope_cos_sin_table<U> const& table)
{
  return table.max_position < rope_position_limit
           ? "the cos/sin table (" + detail::count_of(table.max_position, "row") + ")"
           : rope_position_limit_text() + ")";
}
template <class U>
void rope_check_rotation(rope_cos_sin_table<U> const& table)
{
  INFERSCALE_EXPECTS(table.data != nullptr || table.max_position == 0,
                     std::string{"rope_cos_sin_table: data is null"});
  INFERSCALE_EXPECTS(table.row_stride >= table.rotary_dim,
                     "rope_cos_sin_table: row_stride " + std::to_string(table.row_stride) +
                       " is shorter than rotary_dim " + std::to_string(table.rotary_dim));
}
}  // namespace detail

template <class T, class Rotation>
void rope_check_batch(token_head_view<T> x,
                      std::int64_t num_positions,
                      Rotation const& rotation,
                      rope_op op)
{
  detail::rope_check_rotation(rotation);
  INFERSCALE_EXPECTS(rotation.rotary_dim > 0 && rotation.rotary_dim % 2 == 0 &&
                       rotation.rotary_dim <= rotation.head_dim,
                     "rope: rotary_dim " + std::to_string(rotation.rotary_dim) +
                       " must be even, positive and at most head_dim " +
                       std::to_string(rotation.head_dim));
  INFERSCALE_EXPECTS(rotation.rotary_dim / 2 <= rope_params::max_pairs,
                     "rope: rotary_dim " + std::to_string(rotation.rotary_dim) +
                       " exceeds the supported " + std::to_string(2 * rope_params::max_pairs));
  INFERSCALE_EXPECTS(x.extent(2) == rotation.head_dim,
                     "rope: the view's head_dim " + std::to_string(x.extent(2)) +
                       " differs from the rotation's head_dim " +
                       std::to_string(rotation.head_dim));
  INFERSCALE_EXPECTS(num_positions == x.extent(0),
                     "rope: " + detail::count_of(num_positions, "position") + " given for " +
                       detail::count_of(x.extent(0), "token"));
  INFERSCALE_EXPECTS(x.size() == 0 || x.data_handle() != nullptr, std::string{"rope: null data"});
  (void)op;
}

template <class Rotation>
void rope_check_positions(Rotation const& rotation,
                          std::int64_t first,
                          std::int64_t count,
                          char const* who)
{
  INFERSCALE_EXPECTS(count >= 0,
                     std::string{who} + ": a negative position count " + std::to_string(count));
  if (count == 0) { return; }
  INFERSCALE_EXPECTS(first >= 0,
                     std::string{who} + ": position " + std::to_string(first) + " is negative");
  std::int64_t const bound = detail::rope_table_rows(rotation);
  // first < bound <= 2^53 is checked before first + count - 1 is formed: no overflow.
  INFERSCALE_EXPECTS(first < bound,
                     std::string{who} + ": position " + std::to_string(first) + " is beyond " +
                       detail::rope_range_text(rotation) + ": positions must be in [0, " +
                       std::to_string(bound) + ")");
  INFERSCALE_EXPECTS(
    count <= bound - first,
    std::string{who} + ": position " + std::to_string(first) + " + " + std::to_string(count - 1) +
      (count - 1 < rope_position_limit ? " = " + std::to_string(first + (count - 1))
                                       : std::string{}) +
      " is beyond " + detail::rope_range_text(rotation) + ": positions must be in [0, " +
      std::to_string(bound) + ")");
}

namespace detail {
/// @brief Validates positions held in host memory for `op` against the rotation's range (a
/// table's rows, a model's max_position, rope_position_limit).
template <class Rotation>
void rope_check_host_positions(std::int64_t const* positions,
                               std::int64_t count,
                               Rotation const& rotation,
                               rope_op op)
{
  std::int64_t const rows = rope_table_rows(rotation);
  for (std::int64_t t = 0; t < count; ++t) {
    std::int64_t const p = positions[t];
    if (op == rope_op::shift) {
      INFERSCALE_EXPECTS(p > std::numeric_limits<std::int64_t>::min() && (p < 0 ? -p : p) < rows,
                         "rope: shift " + std::to_string(p) + " of token " + std::to_string(t) +
                           " is beyond " + rope_range_text(rotation) + " in magnitude");
    } else {
      INFERSCALE_EXPECTS(p >= 0 && p < rows,
                         "rope: position " + std::to_string(p) + " of token " + std::to_string(t) +
                           " must be in [0, " + std::to_string(rows) + "), bounded by " +
                           rope_range_text(rotation));
    }
  }
}
}  // namespace detail

namespace detail {
/// @brief The common host case (contiguous head, halves) as a branch-free loop over restrict
/// pointers that the compiler can vectorise; the same arithmetic as rope_rotate_pair (with
/// RoundEach, cos and sin must already be rounded to T).
template <bool RoundEach, class T>
void rope_rotate_halves_contiguous(T* head, std::int32_t rotary_dim, rope_cos_sin const* cos_sin)
{
  std::int32_t const half                 = rotary_dim / 2;
  T* __restrict const first               = head;
  T* __restrict const second              = head + half;
  rope_cos_sin const* __restrict const cs = cos_sin;
  auto const r = [](float v) { return RoundEach ? to_float(from_float<T>(v)) : v; };
  for (std::int32_t i = 0; i < half; ++i) {
    float const x = to_float(first[i]);
    float const y = to_float(second[i]);
    first[i]      = from_float<T>(add_rn(r(mul_rn(x, cs[i].cos)), -r(mul_rn(y, cs[i].sin))));
    second[i]     = from_float<T>(add_rn(r(mul_rn(y, cs[i].cos)), r(mul_rn(x, cs[i].sin))));
  }
}
}  // namespace detail

namespace detail {
/// @brief cos/sin rows for the host's vector rotation straight from a source that holds them:
/// none for resolved parameters (computed per pair).
inline bool rope_table_row(
  rope_params const&, std::int64_t, rope_op, float*, float*, float const**, float const**) noexcept
{
  return false;
}
/// @brief For a forward rotation from an engine table: an fp32 table's own row (`[cos | sin]`),
/// a 16-bit table's row widened into `cos`/`sin`; the same values rope_angle_cos_sin reads.
/// Inverse and shift rotations normalise per pair (false).
template <class U>
bool rope_table_row(rope_cos_sin_table<U> const& table,
                    std::int64_t position,
                    rope_op op,
                    float* cos,
                    float* sin,
                    float const** cos_row,
                    float const** sin_row) noexcept
{
  if (op != rope_op::forward) { return false; }
  U const* const row       = table.data + position * table.row_stride;
  std::int32_t const pairs = table.num_pairs();
  if constexpr (std::is_same_v<U, float>) {
    *cos_row = row;
    *sin_row = row + pairs;
  } else {
    for (std::int32_t p = 0; p < pairs; ++p) {
      cos[p] = to_float(row[p]);
      sin[p] = to_float(row[pairs + p]);
    }
    *cos_row = cos;
    *sin_row = sin;
  }
  return true;
}
}  // namespace detail

template <class T, class Rotation>
void rope_apply_host(token_head_view<T> x,
                     std::int64_t const* positions,
                     std::int64_t num_positions,
                     Rotation const& rotation,
                     rope_op op)
{
  rope_check_batch(x, num_positions, rotation, op);
  INFERSCALE_EXPECTS(num_positions == 0 || positions != nullptr,
                     std::string{"rope: null positions"});
  detail::rope_check_host_positions(positions, num_positions, rotation, op);

  // cos/sin depend on the token only: compute them once per token, then rotate every head.
  std::int32_t const pairs = rotation.num_pairs();
  std::vector<rope_cos_sin> cos_sin(static_cast<std::size_t>(pairs));
  bool const round_each             = rope_rounds_each_operation<T>(rotation, op);
  bool const fused                  = rope_fuses_multiply_add(rotation, op);
  std::int64_t const element_stride = x.stride(2);
#if INFERSCALE_HOST_X86_SIMD
  // The common layout (contiguous dims, halves pairing) rotates 16 or 8 pairs at a time where the
  // CPU has AVX-512F or AVX2 (chosen at run time; bf16 keys rounded natively where it has
  // AVX-512 BF16); same operations, same bits.
  detail::host_simd const level = detail::active_host_simd();
  bool const vector             = element_stride == 1 && rotation.pairing == rope_pairing::halves &&
                      level != detail::host_simd::scalar;
  std::vector<float> cos_values(vector ? static_cast<std::size_t>(pairs) : 0);
  std::vector<float> sin_values(vector ? static_cast<std::size_t>(pairs) : 0);
#endif
  for (std::int64_t t = 0; t < x.extent(0); ++t) {
#if INFERSCALE_HOST_X86_SIMD
    if (vector) {
      // A forward rotation from an engine table reads the row itself (an fp32 table in place):
      // cos/sin were computed once per position when the table was made. Otherwise, per pair.
      float const* cos_row = cos_values.data();
      float const* sin_row = sin_values.data();
      if (!detail::rope_table_row(
            rotation, positions[t], op, cos_values.data(), sin_values.data(), &cos_row, &sin_row)) {
        detail::rope_cos_sin_row(rotation, positions[t], op, cos_values.data(), sin_values.data());
      }
      // (with round_each, the vector rotation rounds cos and sin to T itself, as the scalar
      // loop below does once per token)
      T* const token = x.data_handle() + t * x.stride(0);
      using detail::simd::rotate_mode;
      auto const run = [&](auto mode) {
        if (level == detail::host_simd::avx512_bf16) {
          detail::simd512bf16::rotate_token_halves<decltype(mode)::value, T>(
            token, x.extent(1), x.stride(1), pairs, cos_row, sin_row);
        } else if (level == detail::host_simd::avx512) {
          detail::simd512::rotate_token_halves<decltype(mode)::value, T>(
            token, x.extent(1), x.stride(1), pairs, cos_row, sin_row);
        } else {
          detail::simd::rotate_token_halves<decltype(mode)::value, T>(
            token, x.extent(1), x.stride(1), pairs, cos_row, sin_row);
        }
      };
      if (fused) {
        run(std::integral_constant<rotate_mode, rotate_mode::fused>{});
      } else if (round_each) {
        run(std::integral_constant<rotate_mode, rotate_mode::round_each>{});
      } else {
        run(std::integral_constant<rotate_mode, rotate_mode::fp32>{});
      }
      continue;
    }
#endif
    detail::rope_cos_sin_row(rotation, positions[t], op, cos_sin.data());
    if (round_each) {  // vLLM rounds the table to the key dtype once: do it once per token too
      for (rope_cos_sin& cs : cos_sin) {
        cs.cos = to_float(from_float<T>(cs.cos));
        cs.sin = to_float(from_float<T>(cs.sin));
      }
    }
    for (std::int64_t h = 0; h < x.extent(1); ++h) {
      T* const head = x.data_handle() + t * x.stride(0) + h * x.stride(1);
      if (fused) {
        for (std::int32_t pair = 0; pair < pairs; ++pair) {
          std::int32_t first, second;
          detail::pair_elements(rotation.pairing, rotation.rotary_dim, pair, &first, &second);
          rope_rotate_pair_fused(head[first * element_stride],
                                 head[second * element_stride],
                                 cos_sin[static_cast<std::size_t>(pair)]);
        }
      } else if (element_stride == 1 && rotation.pairing == rope_pairing::halves) {
        if (round_each) {
          detail::rope_rotate_halves_contiguous<true>(head, rotation.rotary_dim, cos_sin.data());
        } else {
          detail::rope_rotate_halves_contiguous<false>(head, rotation.rotary_dim, cos_sin.data());
        }
      } else {
        rope_rotate_head(
          head, element_stride, rotation.pairing, rotation.rotary_dim, cos_sin.data(), round_each);
      }
    }
  }
}

}  // namespace inferscale
