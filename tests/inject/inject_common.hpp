// Test-side helpers of the injection tests, written independently of the code under test:
//  - element formats from their specs (IEEE binary32/16, bfloat16, OCP fp8 E4M3 / E5M2): decoding
//    bits to a value and rounding to nearest even on the value set, in double precision;
//  - a reference rotary embedding (inv_i = 1 / theta^(2i/r) kept in fp32 as engines keep it;
//    angles float(p) * inv rounded to fp32 as HF does, or in double; rotation in double);
//  - facts as test-side arrays and a cache descriptor of a simulated engine cache (the library's
//    factory fed the tensors' shape and strides, as a connector would).
#pragma once

#include "engine_cache_descriptor.hpp"
#include "engine_caches.hpp"
#include "float_bits.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace inferscale_test {

// ------------------------------------------------------------------------------------------------
// Element formats

struct float_format {
  int mantissa_bits;  ///< explicit fraction bits
  int min_exponent;   ///< exponent of the smallest normal
  double max_finite;
  bool saturates;  ///< fp8 conversions saturate (CUDA __NV_SATFINITE), others overflow to inf
};

template <class T>
constexpr float_format format_of()
{
  if constexpr (std::is_same_v<T, float>) {
    return {23, -126, 3.4028234663852886e38, false};
  } else if constexpr (std::is_same_v<T, inferscale::half_t>) {
    return {10, -14, 65504.0, false};
  } else if constexpr (std::is_same_v<T, inferscale::bfloat16_t>) {
    return {7, -126, 3.3895313892515355e38, false};
  } else if constexpr (std::is_same_v<T, inferscale::float8_e4m3_t>) {
    return {3, -6, 448.0, true};
  } else {
    return {2, -14, 57344.0, true};
  }
}

inline double decode(float x) { return x; }
inline double decode(inferscale::bfloat16_t x)
{
  return float_from_bits(static_cast<std::uint32_t>(x.bits) << 16);
}
inline double decode(inferscale::half_t x)
{
  int const s = x.bits >> 15, e = (x.bits >> 10) & 0x1f, m = x.bits & 0x3ff;
  double v = e == 0    ? std::ldexp(m, -24)
             : e == 31 ? (m == 0 ? INFINITY : NAN)
                       : std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}
inline double decode(inferscale::float8_e4m3_t x)
{
  int const s = x.bits >> 7, e = (x.bits >> 3) & 0xf, m = x.bits & 0x7;
  double v = e == 0 ? std::ldexp(m, -9) : (e == 15 && m == 7) ? NAN : std::ldexp(8 + m, e - 10);
  return s ? -v : v;
}
inline double decode(inferscale::float8_e5m2_t x)
{
  int const s = x.bits >> 7, e = (x.bits >> 2) & 0x1f, m = x.bits & 0x3;
  double v = e == 0    ? std::ldexp(m, -16)
             : e == 31 ? (m == 0 ? INFINITY : NAN)
                       : std::ldexp(4 + m, e - 17);
  return s ? -v : v;
}

/// Spacing of T's values at magnitude `magnitude` (subnormal spacing below the normals).
template <class T>
double ulp_at(double magnitude)
{
  constexpr float_format f = format_of<T>();
  int e                    = magnitude == 0 ? f.min_exponent : std::ilogb(magnitude);
  if (e < f.min_exponent) { e = f.min_exponent; }
  return std::ldexp(1.0, e - f.mantissa_bits);
}

/// x rounded to nearest even on T's values (overflow: saturate for fp8, infinity otherwise).
template <class T>
double round_to(double x)
{
  if (x == 0 || !std::isfinite(x)) { return x; }
  constexpr float_format f = format_of<T>();
  double const step        = ulp_at<T>(std::fabs(x));
  double q                 = std::nearbyint(x / step) * step;  // x / step is exact
  if (std::fabs(q) > f.max_finite) {
    q = f.saturates ? std::copysign(f.max_finite, x) : std::copysign(INFINITY, x);
  }
  return q;
}

/// The value a store of dtype `t` holds for input x (float32, float16 or bfloat16).
inline double stored_value(inferscale::dtype t, float x)
{
  switch (t) {
    case inferscale::dtype::float32: return x;
    case inferscale::dtype::float16: return round_to<inferscale::half_t>(x);
    case inferscale::dtype::bfloat16: return round_to<inferscale::bfloat16_t>(x);
    default: FAIL("not a store dtype"); return 0;
  }
}

// ------------------------------------------------------------------------------------------------
// Reference rotary embedding (default rope type)

struct ref_rope {
  int head_dim{};
  int rotary_dim{};
  double theta{10000.0};
  bool interleaved{false};
  bool fp32_angles{true};

  /// inv_i = 1 / theta^(2i / rotary_dim), rounded to fp32 (HF keeps inv_freq in fp32).
  float inv_freq(int i) const
  {
    return static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / rotary_dim));
  }
  /// Angle of pair i at position p: fp32 `float(p) * inv` (HF), or exact in double.
  double angle(std::int64_t p, int i) const
  {
    float const inv = inv_freq(i);
    if (fp32_angles) {
      float const a = static_cast<float>(p) * inv;
      return a;
    }
    return static_cast<double>(p) * static_cast<double>(inv);
  }
  int first(int i) const { return interleaved ? 2 * i : i; }
  int second(int i) const { return interleaved ? 2 * i + 1 : i + rotary_dim / 2; }

  /// x (head_dim values) rotated to position p in double: (x_f + i x_s) * exp(i angle).
  std::vector<double> rotate(std::vector<double> const& x, std::int64_t p) const
  {
    std::vector<double> y = x;
    for (int i = 0; i < rotary_dim / 2; ++i) {
      double const c = std::cos(angle(p, i)), s = std::sin(angle(p, i));
      double const a = x[first(i)], b = x[second(i)];
      y[first(i)]  = a * c - b * s;
      y[second(i)] = b * c + a * s;
    }
    return y;
  }
  /// |(x_f, x_s)| of the pair element d belongs to (|x_d| for a pass-through dim).
  double pair_norm(std::vector<double> const& x, int d) const
  {
    if (d >= rotary_dim) { return std::fabs(x[d]); }
    int const i = interleaved ? d / 2 : d % (rotary_dim / 2);
    return std::hypot(x[first(i)], x[second(i)]);
  }

  inferscale::rope_spec spec() const
  {
    inferscale::rope_spec s{};
    s.head_dim   = head_dim;
    s.rotary_dim = rotary_dim;
    s.theta      = theta;
    s.pairing =
      interleaved ? inferscale::rope_pairing::interleaved : inferscale::rope_pairing::halves;
    s.angle_mode =
      fp32_angles ? inferscale::rope_angle_mode::fp32 : inferscale::rope_angle_mode::exact;
    return s;
  }
  inferscale::rope_params params() const { return inferscale::make_rope_params(spec()); }
};

// ------------------------------------------------------------------------------------------------
// Facts

/// A fact's pre-RoPE K and V as test-side arrays `[layers][tokens][heads][head_dim]` (the model's
/// whole geometry, or a shard's), uniform in [-2, 2) from a fixed seed.
struct fact_data {
  std::uint64_t id{};
  int layers{}, tokens{}, heads{}, head_dim{};
  std::vector<float> k, v;
  std::vector<std::int32_t> token_ids;

  fact_data() = default;
  fact_data(std::uint64_t id_, int l, int c, int h, int d, std::uint64_t seed)
    : id{id_}, layers{l}, tokens{c}, heads{h}, head_dim{d}
  {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    std::size_t const n = static_cast<std::size_t>(l) * c * h * d;
    k.resize(n);
    v.resize(n);
    for (auto& x : k) {
      x = u(rng);
    }
    for (auto& x : v) {
      x = u(rng);
    }
    for (int j = 0; j < c; ++j) {
      token_ids.push_back(static_cast<std::int32_t>(1000 * id_ + j));
    }
  }
  std::size_t index(int l, int j, int h, int d) const
  {
    return ((static_cast<std::size_t>(l) * tokens + j) * heads + h) * head_dim + d;
  }
  float key(int l, int j, int h, int d) const { return k[index(l, j, h, d)]; }
  float value(int l, int j, int h, int d) const { return v[index(l, j, h, d)]; }

  void insert_into(inferscale::kv_store& store, std::uint64_t ns = 0) const
  {
    auto const kv = inferscale::make_fact_kv_view(k.data(), layers, tokens, heads, head_dim);
    auto const vv = inferscale::make_fact_kv_view(v.data(), layers, tokens, heads, head_dim);
    store.insert(id, ns, token_ids, kv, vv);
  }
};

/// A host store of `pages` pages for a model of (layers, heads, head_dim).
inline inferscale::kv_store make_host_store(int layers,
                                            int heads,
                                            int head_dim,
                                            inferscale::dtype store_dtype,
                                            std::int32_t page_size,
                                            std::int64_t pages)
{
  inferscale::kv_store_config c{};
  c.model       = inferscale::kv_geometry{layers, heads, head_dim};
  c.store_dtype = store_dtype;
  c.page_size   = page_size;
  c.num_pages   = pages;
  c.space       = inferscale::memory_space::host;
  return inferscale::kv_store{c};
}

// ------------------------------------------------------------------------------------------------
// Cache descriptors of simulated engine caches

/// The library's descriptor of `ec` in its host storage (see describe_engine_cache()).
template <class T>
inferscale::paged_kv_cache describe_cache(engine_cache<T>& ec)
{
  return describe_engine_cache(ec, ec.storage());
}

template <class T>
std::vector<unsigned char> storage_bytes(engine_cache<T> const& ec)
{
  std::vector<unsigned char> out(ec.storage_bytes());
  std::memcpy(out.data(), ec.storage(), out.size());
  return out;
}

/// A store -> cache dtype pair and, for fp8 caches, how its scales are given (the test matrices
/// of inject_gpu.cu and inject_emulation.cpp).
template <class StoreT,
          class CacheT,
          inferscale::kv_scale_granularity Granularity = inferscale::kv_scale_granularity::none,
          inferscale::kv_scale_convention Convention   = inferscale::kv_scale_convention::divide>
struct dtype_pair {
  using store_t                                                 = StoreT;
  using cache_t                                                 = CacheT;
  static constexpr inferscale::kv_scale_granularity granularity = Granularity;
  static constexpr inferscale::kv_scale_convention convention   = Convention;
};
using bf16_to_bf16 = dtype_pair<inferscale::bfloat16_t, inferscale::bfloat16_t>;
using fp32_to_fp32 = dtype_pair<float, float>;
using fp16_to_fp16 = dtype_pair<inferscale::half_t, inferscale::half_t>;
using bf16_to_fp32 = dtype_pair<inferscale::bfloat16_t, float>;
using bf16_to_e4m3 = dtype_pair<inferscale::bfloat16_t,
                                inferscale::float8_e4m3_t,
                                inferscale::kv_scale_granularity::per_head,
                                inferscale::kv_scale_convention::divide>;
using fp32_to_e5m2 = dtype_pair<float,
                                inferscale::float8_e5m2_t,
                                inferscale::kv_scale_granularity::per_tensor,
                                inferscale::kv_scale_convention::multiply>;

}  // namespace inferscale_test
