// The host backend's vector paths (AVX2 and AVX-512F, chosen at run time) against its scalar loops,
// bit for bit: the same injection and rotation run twice, once with the vector level capped to
// scalar (detail::set_host_simd_cap), then at AVX2 and at AVX-512 where the CPU has them, and every
// byte of the caches and key arrays must agree. The scalar loops are checked against independent
// references in inject_host.cpp and rope_host.cpp; this file adds the equality of the two paths
// over the cases the vector code distinguishes: store and cache dtypes, fp8 scales (none, per
// tensor, per head; both conventions; powers of two, which the vector code multiplies by the
// reciprocal, and other values, which it divides by), rotation sources (fp32 and exact angles, fp32
// and bf16 engine tables with and without vLLM's per-operation rounding, the fused multiply-add
// table), partial rotary dims and pair counts that are not multiples of eight (the vectors' partial
// tails), contiguous and strided layouts.
#include "inject_common.hpp"
#include "simd_paths.hpp"

#include <inferscale/compose.hpp>
#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>
#include <inferscale/views.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test;

namespace {

enum class scale_kind { none, per_tensor_power_of_two, per_tensor, per_head, per_head_multiply };

/// Injects two facts (one longer than a store page) into a cache of `CacheT` with both paths and
/// requires identical bytes (padding included).
template <class CacheT>
void check_injection(dtype store_dt,
                     engine_layout layout,
                     int head_dim,
                     int rotary_dim,
                     rotation_kind rotation,
                     scale_kind scales,
                     rope_pairing pairing)
{
  int const L = 2, H = 3;
  std::int64_t const rows = 4096;
  kv_store store          = make_host_store(L, H, head_dim, store_dt, 4, 8);
  fact_data const a(1, L, 9, H, head_dim, 11);
  fact_data const b(2, L, 3, H, head_dim, 12);
  a.insert_into(store);
  b.insert_into(store);
  rotation_case const rot(head_dim, rotary_dim, rotation, rows, pairing);

  // fp8 scales: small ones push |x| / scale beyond the format's range, so saturation is exercised.
  std::vector<std::vector<float>> k_scales, v_scales;
  for (int l = 0; l < L; ++l) {
    std::vector<float> k, v;
    for (int h = 0; h < H; ++h) {
      switch (scales) {
        case scale_kind::per_tensor_power_of_two:
          k.push_back(l == 0 ? 0.0078125f : 1.0f);   // 2^-7 (|x| / s up to 256), 1
          v.push_back(l == 0 ? 0.5f : 0.00390625f);  // 2^-1, 2^-8 (beyond e4m3's 448)
          break;
        case scale_kind::per_tensor:
          k.push_back(0.0037f * float(1 + l));
          v.push_back(0.011f * float(1 + l));
          break;
        case scale_kind::per_head:
          k.push_back(0.003f * float(1 + h + l));
          v.push_back(h == 1 ? 0.25f : 0.021f * float(1 + h));
          break;
        case scale_kind::per_head_multiply:
          k.push_back(100.0f + float(h + 3 * l));
          v.push_back(h == 0 ? 64.0f : 37.5f);
          break;
        default: break;
      }
    }
    k_scales.push_back(k);
    v_scales.push_back(v);
  }

  std::vector<std::vector<unsigned char>> results;
  all_paths([&](detail::host_simd) {
    engine_cache<CacheT> ec(layout, L, 6, 4, H, head_dim);
    ec.fill_random(3);
    paged_kv_cache cache = describe_cache(ec);
    if (scales != scale_kind::none) {
      std::vector<float const*> kp, vp;
      for (int l = 0; l < L; ++l) {
        kp.push_back(k_scales[static_cast<std::size_t>(l)].data());
        vp.push_back(v_scales[static_cast<std::size_t>(l)].data());
      }
      bool const per_head =
        scales == scale_kind::per_head || scales == scale_kind::per_head_multiply;
      cache.set_fp8_scales(
        scales == scale_kind::per_head_multiply ? kv_scale_convention::multiply
                                                : kv_scale_convention::divide,
        per_head ? kv_scale_granularity::per_head : kv_scale_granularity::per_tensor,
        kp,
        vp);
    }
    injection_batch batch(store);
    compose_options options;
    options.first_position = 3001;  // angles far from 0: cos and sin of every sign
    options.order          = fact_order::as_given;
    composition const plan = compose(store, {1, 2}, options);
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < plan.length(); ++j) {
      slots.push_back((5 * j + 2) % 24);  // distinct, scattered over the blocks
    }
    slots[4] = -1;  // a skipped token
    batch.add(plan, slots);
    rot.visit(rotation, rows, [&](auto const& r) { batch.run(cache, r); });
    results.push_back(storage_bytes(ec));
  });
  REQUIRE(results.size() >= 2);
  for (std::size_t level = 1; level < results.size(); ++level) {
    CAPTURE(level);  // 1: avx2, 2: avx512, 3: avx512_bf16
    REQUIRE(results[level].size() == results[0].size());
    std::size_t differing = 0;
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      differing += results[level][i] != results[0][i];
    }
    CHECK(differing == 0);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("the vector host injection writes the scalar loop's bytes",
                   "[inject][simd]",
                   float,
                   half_t,
                   bfloat16_t,
                   float8_e4m3_t,
                   float8_e5m2_t)
{
  if (!vector_path_available()) { return; }
  using CacheT        = TestType;
  constexpr bool fp8  = sizeof(CacheT) == 1;
  auto const store_dt = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  auto const rotation = GENERATE(rotation_kind::fp32_angles,
                                 rotation_kind::exact_angles,
                                 rotation_kind::table_fp32,
                                 rotation_kind::table_bf16_round,
                                 rotation_kind::table_fused);
  auto const geometry = GENERATE(std::make_pair(128, 128),
                                 std::make_pair(48, 24),
                                 std::make_pair(20, 20),
                                 std::make_pair(64, 38));
  auto const layout   = GENERATE(engine_layout::vllm_flash_attn_nhd,
                               engine_layout::vllm_flash_attn_hnd,
                               engine_layout::vllm_legacy);
  auto const scales   = fp8 ? GENERATE(scale_kind::none,
                                     scale_kind::per_tensor_power_of_two,
                                     scale_kind::per_tensor,
                                     scale_kind::per_head,
                                     scale_kind::per_head_multiply)
                            : scale_kind::none;
  // Both pairings: halves, and interleaved pairs (llama.cpp's rotation of Llama-family models),
  // the latter at the geometries with a full vector of pairs and with a partial last one.
  auto const pairing = GENERATE(rope_pairing::halves, rope_pairing::interleaved);
  if (pairing == rope_pairing::interleaved && geometry.first != 128 && geometry.second != 38) {
    return;
  }
  CAPTURE(sizeof(CacheT),
          to_string(store_dt),
          name_of(rotation),
          geometry.first,
          geometry.second,
          to_string(layout),
          static_cast<int>(scales),
          static_cast<int>(pairing));
  // vLLM's legacy key layout splits heads into chunks of 16 bytes (its dims are not contiguous, so
  // it takes the scalar loop at every level): only head dims it can hold.
  if (layout == engine_layout::vllm_legacy && geometry.first % (16 / int(sizeof(CacheT))) != 0) {
    return;
  }
  check_injection<CacheT>(
    store_dt, layout, geometry.first, geometry.second, rotation, scales, pairing);
}

#if INFERSCALE_HOST_X86_SIMD
namespace {

/// fp8 codes of `x / scale` for sixteen inputs by the vector scaling (AVX-512 or AVX2) and encoder.
INFERSCALE_TARGET_AVX512 void scaled_codes_avx512(float const* x,
                                                  detail::simd::scale_step const& step,
                                                  float* quotient,
                                                  float8_e4m3_t* codes)
{
  __m512 const q = detail::simd512::apply_scale<true>(_mm512_loadu_ps(x), step);
  _mm512_storeu_ps(quotient, q);
  detail::simd512::store16(codes, q);
}
INFERSCALE_TARGET_AVX2 void scaled_codes_avx2(float const* x,
                                              detail::simd::scale_step const& step,
                                              float* quotient,
                                              float8_e4m3_t* codes)
{
  for (int half = 0; half < 2; ++half) {
    __m256 const q = detail::simd::apply_scale<true>(_mm256_loadu_ps(x + 8 * half), step);
    _mm256_storeu_ps(quotient + 8 * half, q);
    detail::simd::store8(codes + 8 * half, q);
  }
}

}  // namespace

TEST_CASE("host injection: the vector fp8 scaling and encoding of every bf16 value",
          "[inject][simd]")
{
  if (!vector_path_available()) { return; }
  // Every bf16 value (zeros, subnormals, infinities, NaNs, the largest finite ones) divided by
  // calibrated scales, multiplied by a power of two's reciprocal, and encoded to e4m3: the fp32
  // quotient equals x / s bit for bit, and the fp8 code equals from_float(x / s).
  std::vector<float> inputs;
  for (std::uint32_t code = 0; code < 65536; ++code) {
    inputs.push_back(detail::bits_to_float(code << 16));
  }
  bool const avx512 = detail::uses_avx512(detail::detected_host_simd());
  for (float scale : {0.0537f, 0.0213f, 3.7f, 1.3e-6f, 7.1e5f, 1.0e-7f, 5.3e6f, 0.125f}) {
    detail::simd::scale_step const step{scale, kv_scale_convention::divide};
    CAPTURE(scale);
    REQUIRE(step.divide == (scale != 0.125f));
    long checked = 0;
    for (std::size_t i = 0; i < inputs.size(); i += 16) {
      for (int level = 0; level < (avx512 ? 2 : 1); ++level) {
        float quotient[16];
        float8_e4m3_t codes[16];
        if (level == 1) {
          scaled_codes_avx512(inputs.data() + i, step, quotient, codes);
        } else {
          scaled_codes_avx2(inputs.data() + i, step, quotient, codes);
        }
        for (int j = 0; j < 16; ++j) {
          float const x        = inputs[i + static_cast<std::size_t>(j)];
          float const expected = x / scale;
          CAPTURE(x, level);
          REQUIRE((detail::float_bits(quotient[j]) == detail::float_bits(expected) ||
                   (std::isnan(expected) && std::isnan(quotient[j]))));
          REQUIRE(codes[j].bits == from_float<float8_e4m3_t>(expected).bits);
          ++checked;
        }
      }
    }
    REQUIRE(checked == (avx512 ? 2 : 1) * 65536);
  }
}
#endif

TEST_CASE(
  "token-major keys with vLLM's truncating rotation: the vector path writes the scalar "
  "loop's bytes",
  "[inject][simd]")
{
  // vLLM's CPU cache (keys [head_dim, block_size] per block and head): runs of eight consecutive
  // slots of one block take simd::inject8_token_major_truncate, everything else the scalar loop.
  if (!vector_path_available()) { return; }
  auto const store_dt = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  auto const pairing  = GENERATE(rope_pairing::halves, rope_pairing::interleaved);
  auto const geometry = GENERATE(std::make_pair(64, 64),
                                 std::make_pair(48, 24),
                                 std::make_pair(128, 128),
                                 std::make_pair(20, 20));
  CAPTURE(to_string(store_dt), static_cast<int>(pairing), geometry.first, geometry.second);
  int const L = 2, H = 3, D = geometry.first, block = 32, blocks = 4;
  std::int64_t const rows = 4096;
  kv_store store          = make_host_store(L, H, D, store_dt, 8, 12);
  fact_data a(1, L, 45, H, D, 21);
  fact_data const b(2, L, 11, H, D, 22);
  // Values the conversions treat apart: signed zeros, subnormals of fp32 and of fp16, the
  // largest values (their rotations overflow to infinities), exact bf16 values.
  float const special[] = {
    0.0f, -0.0f, 1e-40f, -3e-39f, 6e-8f, -5.9e-5f, 60000.0f, -65000.0f, 1.0f, -2.5f};
  float const big = store_dt == dtype::float16 ? 65504.0f : 3.3e38f;
  for (std::size_t i = 0; i < a.k.size(); i += 7) {
    a.k[i] = (i / 7) % 5 == 0 ? ((i / 35) % 2 ? -big : big) : special[(i / 7) % 10];
    if (store_dt == dtype::float16 && std::fabs(a.k[i]) > 65504.0f) { a.k[i] = 1.5f; }
    a.v[i] = special[(i / 3) % 10];
    if (store_dt == dtype::float16 && std::fabs(a.v[i]) > 65504.0f) { a.v[i] = -0.75f; }
  }
  a.insert_into(store);
  b.insert_into(store);
  rope_spec spec                  = rope_presets::llama_3_1_8b();
  spec.head_dim                   = D;
  spec.rotary_dim                 = geometry.second;
  spec.pairing                    = pairing;
  auto const params               = make_rope_params(spec);
  std::vector<bfloat16_t> const t = make_rope_cos_sin_values<bfloat16_t>(params, rows);
  auto table                      = make_rope_cos_sin_table(params, t.data(), rows, true);
  table.truncate_to_bfloat16      = true;

  std::vector<std::vector<unsigned char>> results;
  all_paths([&](detail::host_simd) {
    engine_cache<bfloat16_t> ec(engine_layout::vllm_cpu, L, blocks, block, H, D);
    ec.fill_random(5);
    injection_batch batch(store);
    compose_options options;
    options.first_position = 2001;
    options.order          = fact_order::as_given;
    composition const plan = compose(store, {1, 2}, options);
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < plan.length(); ++j) {
      // 3..47 forwards (runs of eight, a block boundary at 32 inside a would-be run), then the
      // second fact scattered backwards through the last block.
      slots.push_back(j < 45 ? 3 + j : 127 - 2 * (j - 45));
    }
    slots[20] = -1;  // a skipped token breaks a run
    batch.add(plan, slots);
    batch.run(describe_cache(ec), table);
    results.push_back(storage_bytes(ec));
  });
  REQUIRE(results.size() >= 2);
  for (std::size_t level = 1; level < results.size(); ++level) {
    CAPTURE(level);
    REQUIRE(results[level].size() == results[0].size());
    std::size_t differing = 0;
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      differing += results[level][i] != results[0][i];
    }
    CHECK(differing == 0);
  }
}

namespace {

constexpr double eps32_unit = 1.0 / 16777216.0;  // 2^-24, fp32 unit roundoff

/// Keys and values of layer `l` of `a` that differ from `b`'s in their bits (all slots, heads,
/// dims).
template <class T>
std::int64_t layer_differences(engine_cache<T> const& a, engine_cache<T> const& b, int l)
{
  std::int64_t differ = 0;
  for (std::int64_t s = 0; s < a.num_slots(); ++s) {
    for (int h = 0; h < a.num_heads(); ++h) {
      for (int d = 0; d < a.head_dim(); ++d) {
        T const ka = a.key(l, s, h, d), kb = b.key(l, s, h, d);
        T const va = a.value(l, s, h, d), vb = b.value(l, s, h, d);
        differ += std::memcmp(&ka, &kb, sizeof(T)) != 0;
        differ += std::memcmp(&va, &vb, sizeof(T)) != 0;
      }
    }
  }
  return differ;
}

}  // namespace

TEST_CASE("a per-layer rotation rotates each layer as its own rotation does, at every vector level",
          "[inject][simd][rope_layers]")
{
  // Gemma 3's shape: the sliding-window layers at one rope base, the global ones at another. The
  // expectation: layer l of the cache equals, bit for bit, a cache the same batch was injected
  // into with layer l's rotation alone (those single rotations are checked against independent
  // references in inject_host.cpp); and, for fp32, each key is the double-precision rotation at
  // layer l's own base (ref_rope), so a layer rotated at the other base would fail.
  auto const pairing = GENERATE(rope_pairing::halves, rope_pairing::interleaved);
  auto const layout  = GENERATE(engine_layout::vllm_flash_attn_nhd, engine_layout::vllm_legacy);
  auto const kind    = GENERATE(rotation_kind::fp32_angles, rotation_kind::table_fused);
  CAPTURE(static_cast<int>(pairing), to_string(layout), name_of(kind));
  int const L = 3, H = 2, D = 64;
  std::int64_t const rows              = 2048;
  double const bases[2]                = {10000.0, 1000000.0};
  std::int32_t const layer_rotation[L] = {1, 0, 1};
  std::vector<rope_params> params;
  std::vector<std::vector<float>> values;
  for (double const base : bases) {
    rope_spec spec  = rope_presets::llama_3_1_8b();
    spec.scaling    = rope_scaling::none;
    spec.theta      = base;
    spec.head_dim   = D;
    spec.rotary_dim = D;
    spec.pairing    = pairing;
    params.push_back(make_rope_params(spec));
    values.push_back(make_rope_cos_sin_values<float>(params.back(), rows));
  }
  std::vector<rope_cos_sin_table<float>> tables;
  for (int r = 0; r < 2; ++r) {
    tables.push_back(make_rope_cos_sin_table(params[r], values[r].data(), rows, false));
    tables.back().fused_multiply_add = true;
  }
  kv_store store = make_host_store(L, H, D, dtype::float32, 4, 8);
  fact_data const a(1, L, 21, H, D, 31);
  a.insert_into(store);
  compose_options options;
  options.first_position = 1500;
  composition const plan = compose(store, {1}, options);
  std::vector<std::int64_t> slots;
  for (std::int64_t j = 0; j < plan.length(); ++j) {
    slots.push_back((3 * j + 1) % 32);
  }
  slots[5] = -1;  // a skipped token

  auto const run = [&](engine_cache<float>& ec, auto const& rotation) {
    injection_batch batch(store);
    batch.add(plan, slots);
    batch.run(describe_cache(ec), rotation);
  };
  all_paths([&](detail::host_simd) {
    engine_cache<float> layered(layout, L, 4, 8, H, D);
    layered.fill_random(7);
    std::vector<engine_cache<float>> alone;
    for (int r = 0; r < 2; ++r) {
      alone.emplace_back(layout, L, 4, 8, H, D);
      alone.back().fill_random(7);
    }
    if (kind == rotation_kind::fp32_angles) {
      run(layered, per_layer_rotation<rope_params>{params.data(), 2, layer_rotation, L});
      for (int r = 0; r < 2; ++r) {
        run(alone[r], params[r]);
      }
    } else {
      run(layered,
          per_layer_rotation<rope_cos_sin_table<float>>{tables.data(), 2, layer_rotation, L});
      for (int r = 0; r < 2; ++r) {
        run(alone[r], tables[r]);
      }
    }
    for (int l = 0; l < L; ++l) {
      CAPTURE(l);
      REQUIRE(layer_differences(layered, alone[layer_rotation[l]], l) == 0);
      ref_rope const rope{
        D, D, bases[layer_rotation[l]], pairing == rope_pairing::interleaved, true};
      std::vector<double> x(D);
      for (std::int64_t j = 0; j < plan.length(); ++j) {
        if (slots[j] < 0) { continue; }
        for (int h = 0; h < H; ++h) {
          for (int d = 0; d < D; ++d) {
            x[d] = a.key(l, static_cast<int>(j), h, d);
          }
          auto const y = rope.rotate(x, options.first_position + j);
          for (int d = 0; d < D; ++d) {
            CAPTURE(j, h, d);
            // fp32 cos/sin and a fp32 rotation of |x| <= 2.83 pairs: a few ulps of the pair.
            REQUIRE(std::fabs(layered.key(l, slots[j], h, d) - y[d]) <=
                    64 * eps32_unit * rope.pair_norm(x, d) + 1e-7);
          }
        }
      }
    }
  });
}

TEST_CASE("vLLM's CPU cache with a per-layer truncating rotation: each layer as its own rotation",
          "[inject][simd][rope_layers]")
{
  // The token-major path (runs of eight slots) and its scalar remainder, per layer.
  int const L = 2, H = 2, D = 64, block = 32, blocks = 3;
  std::int64_t const rows              = 4096;
  std::int32_t const layer_rotation[L] = {1, 0};
  std::vector<rope_params> params;
  std::vector<std::vector<bfloat16_t>> values;
  std::vector<rope_cos_sin_table<bfloat16_t>> tables;
  for (double const base : {10000.0, 1000000.0}) {
    rope_spec spec  = rope_presets::qwen2_5_7b();
    spec.theta      = base;
    spec.head_dim   = D;
    spec.rotary_dim = D;
    params.push_back(make_rope_params(spec));
    values.push_back(make_rope_cos_sin_values<bfloat16_t>(params.back(), rows));
  }
  for (int r = 0; r < 2; ++r) {
    tables.push_back(make_rope_cos_sin_table(params[r], values[r].data(), rows, true));
    tables.back().truncate_to_bfloat16 = true;
  }
  kv_store store = make_host_store(L, H, D, dtype::bfloat16, 8, 8);
  fact_data const a(1, L, 37, H, D, 41);
  a.insert_into(store);
  compose_options options;
  options.first_position = 900;
  composition const plan = compose(store, {1}, options);
  std::vector<std::int64_t> slots;
  for (std::int64_t j = 0; j < plan.length(); ++j) {
    slots.push_back(j < 30 ? 2 + j : 95 - j);
  }
  auto const run = [&](engine_cache<bfloat16_t>& ec, auto const& rotation) {
    injection_batch batch(store);
    batch.add(plan, slots);
    batch.run(describe_cache(ec), rotation);
  };
  all_paths([&](detail::host_simd) {
    engine_cache<bfloat16_t> layered(engine_layout::vllm_cpu, L, blocks, block, H, D);
    layered.fill_random(9);
    run(layered,
        per_layer_rotation<rope_cos_sin_table<bfloat16_t>>{tables.data(), 2, layer_rotation, L});
    for (int r = 0; r < 2; ++r) {
      engine_cache<bfloat16_t> alone(engine_layout::vllm_cpu, L, blocks, block, H, D);
      alone.fill_random(9);
      run(alone, tables[r]);
      for (int l = 0; l < L; ++l) {
        CAPTURE(r, l);
        if (layer_rotation[l] == r) {
          REQUIRE(layer_differences(layered, alone, l) == 0);
        } else {
          REQUIRE(layer_differences(layered, alone, l) > 0);  // the other base differs
        }
      }
    }
  });
}

TEST_CASE("a malformed per-layer rotation is refused before anything is written",
          "[inject][rope_layers]")
{
  int const L = 2, H = 1, D = 32;
  std::int64_t const rows = 256;
  std::vector<rope_params> params;
  std::vector<std::vector<float>> values;
  for (double const base : {10000.0, 500000.0}) {
    rope_spec spec  = rope_presets::qwen2_5_7b();
    spec.theta      = base;
    spec.head_dim   = D;
    spec.rotary_dim = D;
    params.push_back(make_rope_params(spec));
    values.push_back(make_rope_cos_sin_values<float>(params.back(), rows));
  }
  std::vector<rope_cos_sin_table<float>> tables{
    make_rope_cos_sin_table(params[0], values[0].data(), rows, false),
    make_rope_cos_sin_table(params[1], values[1].data(), rows - 100, false)};
  kv_store store = make_host_store(L, H, D, dtype::float32, 4, 4);
  fact_data const a(1, L, 6, H, D, 3);
  a.insert_into(store);
  engine_cache<float> ec(engine_layout::vllm_flash_attn_nhd, L, 2, 4, H, D);
  ec.fill_random(2);
  auto const before = storage_bytes(ec);
  auto const refuse = [&](auto const& rotation, std::int64_t first, char const* why) {
    injection_batch batch(store);
    compose_options options;
    options.first_position = first;
    batch.add(compose(store, {1}, options), std::vector<std::int64_t>{0, 1, 2, 3, 4, 5});
    REQUIRE_THROWS_WITH(batch.run(describe_cache(ec), rotation), Catch::Matchers::Contains(why));
    REQUIRE(storage_bytes(ec) == before);
  };
  std::int32_t const both[2]    = {0, 1};
  std::int32_t const outside[2] = {0, 2};
  using table_layers            = per_layer_rotation<rope_cos_sin_table<float>>;
  refuse(table_layers{tables.data(), 2, both, 1}, 0, "covers 1 layers, the cache has 2");
  refuse(table_layers{tables.data(), 2, outside, 2}, 0, "layer 1 names rotation 2 of 2");
  refuse(table_layers{tables.data(), 0, both, 2}, 0, "0 rotations (1 to 8)");
  refuse(table_layers{nullptr, 2, both, 2}, 0, "the rotations and the layer indices");
  // Positions the second table does not hold: refused by it, though the first holds them.
  refuse(table_layers{tables.data(), 2, both, 2}, rows - 103, "beyond the cos/sin table");
  auto fused                  = tables;
  fused[1].fused_multiply_add = true;
  refuse(table_layers{fused.data(), 2, both, 2}, 0, "asks for other roundings than rotation 0");
  std::vector<rope_params> narrow = params;
  narrow[1].rotary_dim            = 16;
  refuse(per_layer_rotation<rope_params>{narrow.data(), 2, both, 2},
         0,
         "or its pairing different from rotation 0's");
  // And memory::inject's early check refuses the same positions.
  REQUIRE_THROWS_WITH(rope_check_positions(table_layers{tables.data(), 2, both, 2}, rows - 103, 6),
                      Catch::Matchers::Contains("beyond the cos/sin table"));
  // The well-formed rotation is accepted and writes.
  injection_batch batch(store);
  batch.add(compose(store, {1}, compose_options{}), std::vector<std::int64_t>{0, 1, 2, 3, 4, 5});
  REQUIRE_NOTHROW(batch.run(describe_cache(ec), table_layers{tables.data(), 2, both, 2}));
  REQUIRE(storage_bytes(ec) != before);
}
