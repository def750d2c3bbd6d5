/**
 * @file rope.hpp
 * @brief Rotary position embeddings: specification of every HF rope type, resolution to fp32
 * inverse frequencies, and the per-pair rotation shared by the host and device backends; the host
 * backend's batch operations over `[tokens, heads, head_dim]` views.
 *
 * InferScale stores keys before RoPE and rotates them to their final positions when it composes
 * facts; the rotation must be the serving engine's own. Two sources of rotation exist:
 *  - rope_params: computed from a rope_spec (fp32 inverse frequencies as HF/vLLM keep them,
 *    angles `fp32(position * inv_freq)` as HF computes them, or exactly in double precision);
 *  - rope_cos_sin_table: the engine's own table in vLLM's `cos_sin_cache` layout, which makes the
 *    rotation match the engine's bit for bit.
 * Device batch operations are in rope.cuh.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/rope/sincos.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/views.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale {

/// @brief Which elements of a head form a rotation pair.
enum class rope_pairing : std::uint8_t {
  halves,      ///< pair i = (i, i + rotary_dim/2): HF rotate_half, vLLM is_neox_style = true
  interleaved  ///< pair i = (2i, 2i + 1): GPT-J rotate_every_two, vLLM is_neox_style = false
};

/// @brief The HF `rope_type` families (transformers' ROPE_INIT_FUNCTIONS).
enum class rope_scaling : std::uint8_t {
  none,         ///< "default": inv_i = theta^(-2i/d)
  linear,       ///< positions interpolated by `factor`
  dynamic_ntk,  ///< "dynamic": base rescaled for a total length above max_position
  llama3,       ///< Llama 3.1+ frequency bands
  yarn,         ///< YaRN ramp between interpolation and extrapolation, attention factor
  longrope      ///< Phi-3 LongRoPE per-pair factors, short and long
};

/// @brief How the rotation angle `position * inv_freq` is formed.
enum class rope_angle_mode : std::uint8_t {
  fp32,  ///< `float(position) * inv_freq` rounded to fp32, as HF and vLLM's tables do
         ///< (engine-exact)
  exact  ///< in double precision: relocation `R_a^T R_b = R_{b-a}` holds to fp32 rounding
};

/// @brief What a batch rotation does with each token's position argument.
enum class rope_op : std::uint8_t {
  forward,  ///< x -> a * R(p) x          (pre-RoPE to post-RoPE at position p)
  inverse,  ///< x -> R(-p) x / a         (post-RoPE at position p back to pre-RoPE)
  shift     ///< x -> R(delta) x, no a   (post-RoPE at p to post-RoPE at p + delta)
};

/**
 * @brief Everything that defines a model's rotary embedding (the `rope_*` fields of an HF config).
 *
 * Only the fields of the chosen `scaling` are read. Length-dependent types (dynamic_ntk,
 * longrope) are resolved for a total sequence length by make_rope_params; all other types give
 * position-independent frequencies, for which relocation by a delta is exact.
 */
struct rope_spec {
  std::int32_t head_dim{};    ///< elements per head
  std::int32_t rotary_dim{};  ///< leading dims that rotate (partial rotary); 0 means head_dim
  double theta{10000.0};      ///< rope_theta
  rope_pairing pairing{rope_pairing::halves};
  rope_scaling scaling{rope_scaling::none};
  double factor{1.0};  ///< scaling factor f (linear, dynamic, llama3, yarn); yarn: 0 = absent,
                       ///< derived as max_position / original_max_position (as HF does)
  double low_freq_factor{1.0};               ///< llama3
  double high_freq_factor{4.0};              ///< llama3
  std::int64_t original_max_position{};      ///< L0 (llama3, yarn, longrope)
  std::int64_t max_position{};               ///< Lmax (dynamic_ntk, longrope)
  double beta_fast{32.0};                    ///< yarn
  double beta_slow{1.0};                     ///< yarn
  bool truncate{true};                       ///< yarn: floor/ceil the correction range
  std::optional<double> attention_factor{};  ///< yarn, longrope: overrides the derived factor
  std::optional<double> mscale{};            ///< yarn (DeepSeek style); 0 = absent (as HF)
  std::optional<double> mscale_all_dim{};    ///< yarn (DeepSeek style); 0 = absent (as HF)
  std::vector<double> short_factor{};        ///< longrope, rotary_dim/2 entries
  std::vector<double> long_factor{};         ///< longrope, rotary_dim/2 entries
  rope_angle_mode angle_mode{rope_angle_mode::fp32};

  /// @brief The rotary dim in effect (`rotary_dim`, or `head_dim` when it is 0).
  std::int32_t effective_rotary_dim() const noexcept
  {
    return rotary_dim == 0 ? head_dim : rotary_dim;
  }

  /**
   * @brief The scaling factor in effect: `factor`, except a YaRN spec whose factor is 0 (HF's
   * absent `factor`), which takes `max_position / original_max_position`.
   */
  double effective_factor() const noexcept
  {
    if (scaling == rope_scaling::yarn && factor == 0.0 && original_max_position > 0) {
      return static_cast<double>(max_position) / static_cast<double>(original_max_position);
    }
    return factor;
  }

  /// @brief True when the frequencies depend on the total sequence length.
  bool is_length_dependent() const noexcept
  {
    return scaling == rope_scaling::dynamic_ntk || scaling == rope_scaling::longrope;
  }

  /**
   * @brief Checks the spec; every refusal names the field, its value and the rule.
   * @throw logic_error for an odd or out-of-range rotary_dim, a non-positive or non-finite theta,
   * a factor below 1 where the type forbids it, missing or non-positive context lengths, bad
   * LongRoPE factor lists, or a non-positive attention factor.
   */
  inline void validate() const;

  /**
   * @brief Inverse frequencies `inv_i`, i = 0 .. rotary_dim/2 - 1, in double precision.
   * @param total_length total sequence length (prompt plus generated), read by dynamic_ntk and
   *        longrope only.
   */
  inline std::vector<double> inverse_frequencies(std::int64_t total_length = 0) const;

  /**
   * @brief The attention factor `a` multiplying cos and sin (1 except yarn and longrope): yarn
   * `m(f, mscale) / m(f, mscale_all_dim)` when both are given and non-zero, else `m(f, 1)`, with
   * `m(f, k) = 0.1 k ln f + 1`; longrope `sqrt(1 + ln(Lmax / L0) / ln L0)`
   * (rope_spec_from_hf_config sets `attention_factor` from an explicit LongRoPE `factor`, as HF
   * derives it from that).
   */
  inline double attention_scaling(std::int64_t total_length = 0) const;
};

/// @brief Real model configurations (their `config.json`), see docs in the README.
namespace rope_presets {
/// meta-llama/Llama-3.1-8B-Instruct: theta 5e5, llama3 (f 8, lf 1, hf 4, L0 8192), Lmax 131072.
inline rope_spec llama_3_1_8b();
/// Qwen/Qwen2.5-7B-Instruct: theta 1e6, no scaling, Lmax 32768.
inline rope_spec qwen2_5_7b();
/// mistralai/Mistral-7B-Instruct-v0.3: theta 1e6, no scaling, Lmax 32768.
inline rope_spec mistral_7b_v0_3();
/// HuggingFaceTB/SmolLM2-135M-Instruct: theta 1e5, head dim 64, Lmax 8192.
inline rope_spec smollm2_135m();
/// microsoft/Phi-3.5-mini-instruct: LongRoPE, theta 1e4, head dim 96, L0 4096, Lmax 131072,
/// its 48 short and 48 long factors.
inline rope_spec phi_3_5_mini();
}  // namespace rope_presets

/**
 * @brief The hard bound on rotary positions, 2^53: every position (and delta) below it converts to
 * double exactly, so the exact angle `position * inv_freq` is that position's own, and `p0 + n`
 * stays far from int64 overflow. A position at or beyond it (e.g. near INT64_MAX) is refused by
 * compose, injection_batch::add, injection and the rope batch operations, whatever the opt-in.
 * (fp32 angles, as HF and vLLM form them, are exact only below 2^24; beyond that neighbouring
 * positions share an angle, in the engine as here.)
 */
inline constexpr std::int64_t rope_position_limit = std::int64_t{1} << 53;

/**
 * @brief A rotation resolved for kernels: fp32 inverse frequencies by value, trivially copyable
 * (a kernel takes it as a __grid_constant__ parameter; no device allocation is needed).
 *
 * It carries the model's position range: `max_position` (HF `max_position_embeddings`, GGUF
 * `<arch>.context_length`; make_rope_params copies rope_spec::max_position). Injection and the
 * host rope operations refuse a position at or beyond it (a shift delta whose magnitude reaches
 * it) unless `allow_beyond_max_position` is set; 0 means the range is unknown and only
 * rope_position_limit applies (the default, for hand-built parameters).
 */
struct rope_params {
  static constexpr std::int32_t max_pairs = 256;  ///< rotary_dim up to 512

  std::int32_t head_dim{};
  std::int32_t rotary_dim{};
  rope_pairing pairing{rope_pairing::halves};
  rope_angle_mode angle_mode{rope_angle_mode::fp32};
  float attention_factor{1.0f};
  float inv_freq[max_pairs]{};  ///< rounded to fp32, as engines keep inv_freq
  /// The model's position range: positions `0 .. max_position - 1` (0: unknown, unchecked).
  std::int64_t max_position{0};
  /// Explicit opt-in: accept positions at or beyond `max_position` (extrapolation the model was not
  /// trained for); positions at or beyond rope_position_limit are refused all the same.
  bool allow_beyond_max_position{false};

  /**
   * @brief Positions this rotation accepts: `[0, max_position)` when the range is known and not
   * opted out of, else `[0, rope_position_limit)`.
   */
  INFERSCALE_HOST_DEVICE constexpr std::int64_t position_bound() const noexcept
  {
    return (max_position > 0 && !allow_beyond_max_position && max_position < rope_position_limit)
             ? max_position
             : rope_position_limit;
  }

  INFERSCALE_HOST_DEVICE constexpr std::int32_t num_pairs() const noexcept
  {
    return rotary_dim / 2;
  }
};

/**
 * @brief Resolves a spec for a total sequence length (read by dynamic_ntk and longrope only).
 * The result's max_position is the spec's (its model range), allow_beyond_max_position false.
 * @throw logic_error if the spec is invalid or rotary_dim exceeds 2 * rope_params::max_pairs.
 */
inline rope_params make_rope_params(rope_spec const& spec, std::int64_t total_length = 0);

/**
 * @brief The engine's cos/sin table in vLLM's `rotary_emb.cos_sin_cache` layout: row p is
 * `[cos(p*inv_0) .. cos(p*inv_{d/2-1}) | sin(p*inv_0) .. sin(p*inv_{d/2-1})]`, any attention factor
 * already multiplied in (SGLang and FlashInfer use the same layout).
 *
 * @tparam T element type of the table (vLLM casts it to the model dtype; FlashInfer wants fp32).
 */
template <class T>
struct rope_cos_sin_table {
  T const* data{};              ///< row-major `[max_position, row_stride]`
  std::int64_t max_position{};  ///< rows in the table; positions must be below it
  std::int64_t row_stride{};    ///< elements between rows (rotary_dim when contiguous)
  std::int32_t head_dim{};
  std::int32_t rotary_dim{};
  rope_pairing pairing{rope_pairing::halves};
  /// Round each product and the sum to the element type, as vLLM's `rotary_embedding` kernel does
  /// when keys are 16-bit (`x*cos - y*sin` in c10::Half/BFloat16). With fp32 keys it is a no-op.
  bool round_each_operation{true};
  /// Compute the forward rotation with two fused multiply-adds, `x' = fma(x, c, -(y s))` and
  /// `y' = fma(x, s, y c)`, as llama.cpp's CPU rope does when its compiler contracts
  /// `x0*cos - x1*sin` (GCC with FMA enabled, ggml's default x86-64 build). Takes precedence over
  /// round_each_operation; inverse and shift rotations are not fused.
  bool fused_multiply_add{false};
  /// Compute the forward rotation in fp32 (rounded once per product and sum) and convert the
  /// result to a bfloat16 cache by truncation (round toward zero), as vLLM's CPU `rotary_embedding`
  /// kernel does where it is built without AVX-512 BF16 (its AVX2 build: `x*cos - y*sin` in fp32
  /// vectors, then the upper 16 bits). Injection only (host backend, bfloat16 caches, unscaled);
  /// takes precedence over round_each_operation and fused_multiply_add.
  bool truncate_to_bfloat16{false};

  INFERSCALE_HOST_DEVICE constexpr std::int32_t num_pairs() const noexcept
  {
    return rotary_dim / 2;
  }
};

/**
 * @brief Builds the values of a vLLM-layout cos/sin table from resolved parameters, as vLLM's
 * `_compute_cos_sin_cache` does: fp32 angles `float(p) * inv_freq`, cos and sin in fp32 times the
 * attention factor, then rounded to T (`cache.to(dtype)`). Row p, p < rows, holds
 * `[cos .. | sin ..]` of `rotary_dim` entries.
 * @throw logic_error if `rows` is negative.
 */
template <class T>
std::vector<T> make_rope_cos_sin_values(rope_params const& params, std::int64_t rows);

/// @brief A table view over values made by make_rope_cos_sin_values (host or device copy).
template <class T>
rope_cos_sin_table<T> make_rope_cos_sin_table(rope_params const& params,
                                              T const* data,
                                              std::int64_t rows,
                                              bool round_each_operation = true)
{
  return rope_cos_sin_table<T>{data,
                               rows,
                               params.rotary_dim,
                               params.head_dim,
                               params.rotary_dim,
                               params.pairing,
                               round_each_operation};
}

/// @brief A (cos, sin) pair, already including the attention factor where the operation needs it.
struct rope_cos_sin {
  float cos;
  float sin;
};

namespace detail {

/**
 * @brief Where the kernels keep entry `index` of a tile's cos/sin in shared memory: rows of 16
 * entries (128 bytes, the 32 banks), the position within a row XORed with the row's number.
 *
 * The rope and injection kernels' neighbouring threads each take a run of m consecutive pairs
 * (m = 8 for 16-bit keys in halves pairing, 4 for fp32 or interleaved 16-bit, 2, or 1) and read
 * entry j of their run together. In order, those 8-byte entries lie m * 8 bytes apart, so for
 * m = 8 four threads hit each bank pair (a 4-way conflict); swizzled, 16 consecutive runs of any
 * of those m hit 16 different bank pairs (`[rope][swizzle]` checks it). A permutation within
 * each row: a tile of n entries takes cos_sin_tile_entries(n).
 */
INFERSCALE_HOST_DEVICE constexpr std::int32_t cos_sin_swizzle(std::int32_t index) noexcept
{
  return (index & ~15) | ((index ^ (index >> 4)) & 15);
}

/// @brief Entries to allocate for a swizzled tile of `n` cos/sin entries (whole rows of 16).
INFERSCALE_HOST_DEVICE constexpr std::int64_t cos_sin_tile_entries(std::int64_t n) noexcept
{
  return (n + 15) / 16 * 16;
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void sincos_fp64(double angle, double* s, double* c)
{
#if INFERSCALE_IS_DEVICE_CODE
  ::sincos(angle, s, c);
#else
  *s = std::sin(angle);
  *c = std::cos(angle);
#endif
}

/// @brief Element indices (within the head) of rotation pair `pair`.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void pair_elements(rope_pairing pairing,
                                                                 std::int32_t rotary_dim,
                                                                 std::int32_t pair,
                                                                 std::int32_t* first,
                                                                 std::int32_t* second)
{
  if (pairing == rope_pairing::halves) {
    *first  = pair;
    *second = pair + rotary_dim / 2;
  } else {
    *first  = 2 * pair;
    *second = 2 * pair + 1;
  }
}

/// @brief fp32 multiply and add, each rounded once: nvcc would otherwise contract `x*c - y*s`
/// into an FMA on the device and the two backends would round differently.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float mul_rn(float a, float b)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return unfused(a * b);  // never fused with the addition it feeds, whatever the host flags
#endif
}
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float add_rn(float a, float b)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
/// @brief `a / b` correctly rounded on both backends (the device's `__fdiv_rn`, which a consumer's
/// `--use_fast_math` / `-prec-div=false` does not turn into an approximate division).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float div_rn(float a, float b)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
/// @brief The correctly rounded square root on both backends (`__fsqrt_rn` on the device, immune
/// to `-prec-sqrt=false`).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float sqrt_rn(float a)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
/// @brief `a * b + c` with one rounding (a true fused multiply-add on both backends).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float fma_rn(float a, float b, float c)
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
}  // namespace detail

namespace detail {
/// @brief What operation `op` rotates by, from an angle's cos and sin and the attention factor
/// `a`: `(a c, a s)` forward, `(c / a, -s / a)` inverse, `(c, s)` shift.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE rope_cos_sin rope_scale_cos_sin(float c,
                                                                              float s,
                                                                              float a,
                                                                              rope_op op)
{
  switch (op) {
    case rope_op::forward: return {mul_rn(c, a), mul_rn(s, a)};
    case rope_op::inverse: return {div_rn(c, a), div_rn(-s, a)};
    default: return {c, s};
  }
}
}  // namespace detail

/**
 * @brief cos and sin that rotate pair `pair` for operation `op` with argument `position`
 * (a position for forward/inverse, a delta for shift).
 *
 * forward gives `(a cos φ, a sin φ)`, inverse `(cos φ / a, -sin φ / a)`, shift `(cos φ, sin φ)`,
 * with `φ = position * inv_freq[pair]` formed as `params.angle_mode` says.
 */
INFERSCALE_HOST_DEVICE inline rope_cos_sin rope_angle_cos_sin(rope_params const& params,
                                                              std::int64_t position,
                                                              std::int32_t pair,
                                                              rope_op op)
{
  float c, s;
  float const inv_freq = params.inv_freq[pair];
  if (params.angle_mode == rope_angle_mode::fp32) {
    detail::rope_sincos(detail::mul_rn(static_cast<float>(position), inv_freq), &s, &c);
  } else {
    double cd, sd;
    detail::sincos_fp64(static_cast<double>(position) * static_cast<double>(inv_freq), &sd, &cd);
    c = static_cast<float>(cd);
    s = static_cast<float>(sd);
  }
  return detail::rope_scale_cos_sin(c, s, params.attention_factor, op);
}

/**
 * @brief cos and sin of pair `pair` read from an engine table. inverse divides by `cos²+sin²`
 * (undoing a baked-in attention factor); shift uses row `|delta|`, normalised to a pure rotation.
 */
template <class T>
INFERSCALE_HOST_DEVICE inline rope_cos_sin rope_angle_cos_sin(rope_cos_sin_table<T> const& table,
                                                              std::int64_t position,
                                                              std::int32_t pair,
                                                              rope_op op)
{
  std::int64_t const row = (op == rope_op::shift && position < 0) ? -position : position;
  T const* const row_ptr = table.data + row * table.row_stride;
  float const c          = to_float(row_ptr[pair]);
  float s                = to_float(row_ptr[table.num_pairs() + pair]);
  switch (op) {
    case rope_op::forward: return {c, s};
    case rope_op::inverse: {
      float const norm2 = detail::add_rn(detail::mul_rn(c, c), detail::mul_rn(s, s));
      return {detail::div_rn(c, norm2), detail::div_rn(-s, norm2)};
    }
    default: {
      float const norm =
        detail::sqrt_rn(detail::add_rn(detail::mul_rn(c, c), detail::mul_rn(s, s)));
      if (position < 0) { s = -s; }
      return {detail::div_rn(c, norm), detail::div_rn(s, norm)};
    }
  }
}

namespace detail {

/// @brief True when a rotation source asks for vLLM's per-operation rounding for element type T.
template <class T, class Rotation>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE constexpr bool rounds_each_operation(
  Rotation const&) noexcept
{
  return false;
}
template <class T, class U>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE constexpr bool rounds_each_operation(
  rope_cos_sin_table<U> const& table) noexcept
{
  return table.round_each_operation && !table.fused_multiply_add && !std::is_same_v<T, float>;
}
template <class Rotation>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE constexpr bool fuses_multiply_add(
  Rotation const&) noexcept
{
  return false;
}
template <class U>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE constexpr bool fuses_multiply_add(
  rope_cos_sin_table<U> const& table) noexcept
{
  return table.fused_multiply_add;
}

}  // namespace detail

/**
 * @brief Rotates one pair of values in place: `x' = x c - y s`, `y' = y c + x s`, in fp32 (each
 * product and sum rounded once, no FMA, so host and device agree bit for bit) with one rounding
 * to T at the end, or, when `round_each_operation`, with cos, sin, each product and the sum
 * rounded to T (vLLM's native kernel on 16-bit keys: c10::BFloat16 arithmetic).
 */
template <class T>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rope_rotate_pair(T& x,
                                                                    T& y,
                                                                    rope_cos_sin cs,
                                                                    bool round_each_operation)
{
  using detail::add_rn;
  using detail::mul_rn;
  float const xf = to_float(x);
  float const yf = to_float(y);
  if (round_each_operation) {
    auto const r  = [](float v) { return to_float(from_float<T>(v)); };
    float const c = r(cs.cos);
    float const s = r(cs.sin);
    x             = from_float<T>(add_rn(r(mul_rn(xf, c)), -r(mul_rn(yf, s))));
    y             = from_float<T>(add_rn(r(mul_rn(yf, c)), r(mul_rn(xf, s))));
  } else {
    x = from_float<T>(add_rn(mul_rn(xf, cs.cos), -mul_rn(yf, cs.sin)));
    y = from_float<T>(add_rn(mul_rn(yf, cs.cos), mul_rn(xf, cs.sin)));
  }
}

/**
 * @brief Rotates one pair in place with two fused multiply-adds in fp32, `x' = fma(x, c, -(y s))`,
 * `y' = fma(x, s, y c)`, then one rounding to T (rope_cos_sin_table::fused_multiply_add).
 */
template <class T>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void rope_rotate_pair_fused(T& x,
                                                                          T& y,
                                                                          rope_cos_sin cs)
{
  float const xf = to_float(x);
  float const yf = to_float(y);
  x              = from_float<T>(detail::fma_rn(xf, cs.cos, -detail::mul_rn(yf, cs.sin)));
  y              = from_float<T>(detail::fma_rn(xf, cs.sin, detail::mul_rn(yf, cs.cos)));
}

/// @brief Whether `op` with `rotation` is computed with fused multiply-adds (forward only).
template <class Rotation>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool rope_fuses_multiply_add(Rotation const& rotation,
                                                                           rope_op op)
{
  return op == rope_op::forward && detail::fuses_multiply_add(rotation);
}

/**
 * @brief Rotates the pairs of one head vector (`element_stride` apart) with precomputed cos/sin,
 * one entry per pair; the trailing `head_dim - rotary_dim` dims are left untouched.
 */
template <class T>
INFERSCALE_HOST_DEVICE inline void rope_rotate_head(T* head,
                                                    std::int64_t element_stride,
                                                    rope_pairing pairing,
                                                    std::int32_t rotary_dim,
                                                    rope_cos_sin const* cos_sin,
                                                    bool round_each_operation)
{
  for (std::int32_t pair = 0; pair < rotary_dim / 2; ++pair) {
    std::int32_t first, second;
    detail::pair_elements(pairing, rotary_dim, pair, &first, &second);
    rope_rotate_pair(head[first * element_stride],
                     head[second * element_stride],
                     cos_sin[pair],
                     round_each_operation);
  }
}

/// @brief Whether `op` with `rotation` rounds each operation for element type T (vLLM's kernel).
template <class T, class Rotation>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool rope_rounds_each_operation(
  Rotation const& rotation, rope_op op)
{
  return op == rope_op::forward && detail::rounds_each_operation<T>(rotation);
}

/**
 * @brief Applies `op` to one head vector (`head_dim` elements spaced `element_stride` apart):
 * the rotary dims rotate, the trailing `head_dim - rotary_dim` dims are left untouched.
 *
 * @tparam Rotation rope_params or rope_cos_sin_table<U>
 * @param position position (forward, inverse) or delta (shift)
 */
template <class T, class Rotation>
INFERSCALE_HOST_DEVICE inline void rope_apply_head(
  Rotation const& rotation, T* head, std::int64_t element_stride, std::int64_t position, rope_op op)
{
  bool const round_each = rope_rounds_each_operation<T>(rotation, op);
  bool const fused      = rope_fuses_multiply_add(rotation, op);
  for (std::int32_t pair = 0; pair < rotation.num_pairs(); ++pair) {
    std::int32_t first, second;
    detail::pair_elements(rotation.pairing, rotation.rotary_dim, pair, &first, &second);
    rope_cos_sin const cs = rope_angle_cos_sin(rotation, position, pair, op);
    if (fused) {
      rope_rotate_pair_fused(head[first * element_stride], head[second * element_stride], cs);
    } else {
      rope_rotate_pair(head[first * element_stride], head[second * element_stride], cs, round_each);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Host backend: batch operations

/**
 * @brief Checks that positions `first .. first + count - 1` are valid for `rotation` before
 * anything is written: non-negative, below rope_position_limit (always), below a table's rows, and
 * below rope_params::max_position unless rope_params::allow_beyond_max_position is set.
 * injection_batch::run does this for a whole batch; call it before injection_batch::add(plan,
 * adapter) to refuse before the adapter allocates (memory::inject does).
 * @param who prefix of the message
 * @throw logic_error naming the offending position and the range.
 */
template <class Rotation>
void rope_check_positions(Rotation const& rotation,
                          std::int64_t first,
                          std::int64_t count,
                          char const* who = "rope");

/**
 * @brief Checks a rotation against a `[tokens, heads, head_dim]` view and its per-token positions.
 * @throw logic_error naming the mismatch.
 */
template <class T, class Rotation>
void rope_check_batch(token_head_view<T> x,
                      std::int64_t num_positions,
                      Rotation const& rotation,
                      rope_op op);

/**
 * @brief Host backend: applies `op` in place to every head of every token of `x`
 * (`[tokens, heads, head_dim]`, any strides), token t using `positions[t]`.
 *
 * @param[in,out] x         the keys (or queries) to rotate
 * @param[in]     positions one position (delta for rope_op::shift) per token
 * @param[in]     rotation  rope_params or rope_cos_sin_table
 * @throw logic_error if shapes disagree, a position is negative (forward/inverse) or beyond the
 *        table or the model's range (rope_params::max_position, unless opted out of; a shift's
 *        |delta| likewise), or at or beyond rope_position_limit; nothing is written then.
 */
template <class T, class Rotation>
void rope_apply_host(token_head_view<T> x,
                     std::int64_t const* positions,
                     std::int64_t num_positions,
                     Rotation const& rotation,
                     rope_op op);

}  // namespace inferscale

#include <inferscale/detail/rope/rope.inl>
