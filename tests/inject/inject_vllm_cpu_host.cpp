// Host injection into vLLM's CPU cache layouts (make_vllm_cpu_cache, isa `vec` and `amx`), which
// the host backend writes by whole 64-byte lines on a CPU with AVX-512BW
// (detail/inject/vllm_cpu_lines.hpp), token by token elsewhere. Every element of every layer's
// tensor is checked at every vector level against a brute-force loop written out here from the
// layouts' formulas (measured on an AMX Xeon with vLLM 0.32's own op:
// bench/results/2026-12-05-vllm-amx.md) and vLLM's CPU rotation (fp32 products, each rounded once,
// the difference and sum rounded once, the upper 16 bits kept); the elements of no injected slot
// must keep their bytes. Segments of odd length, partly filled last blocks, runs starting at
// every offset of a 32-token window, skipped slots, slots out of order, tensors on 64-byte
// boundaries and off them.
#include "inject_common.hpp"
#include "simd_paths.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/detail/inject/vllm_cpu_lines.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test;

namespace {

std::uint16_t upper_bits(float f)
{
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return static_cast<std::uint16_t>(b >> 16);
}

/// fp32 to bf16 rounded to nearest, ties to even (a NaN: its upper half, made quiet), written
/// out: the rounding vLLM's rotary kernel does on a CPU with AVX512_BF16 ("fp32_nearest").
std::uint16_t nearest_bits(float f)
{
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) { return static_cast<std::uint16_t>((b >> 16) | 0x40u); }
  return static_cast<std::uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/// One layer tensor per layer, `(NB, H, B, 2 D)` contiguous, `offset` elements past a 64-byte
/// boundary, filled with random codes.
struct vllm_cpu_tensors {
  std::int64_t blocks, heads, block, dim;
  std::vector<std::uint16_t> storage;
  std::vector<std::uint16_t*> layers;

  vllm_cpu_tensors(int L,
                   std::int64_t nb,
                   std::int64_t h,
                   std::int64_t b,
                   std::int64_t d,
                   std::int64_t offset,
                   std::uint64_t seed)
    : blocks{nb}, heads{h}, block{b}, dim{d}
  {
    std::int64_t const per_layer = nb * h * b * 2 * d;
    storage.resize(static_cast<std::size_t>(L * (per_layer + 64) + 64));
    std::mt19937_64 rng(seed);
    for (auto& x : storage) {
      x = static_cast<std::uint16_t>(rng());
    }
    auto const address = reinterpret_cast<std::uintptr_t>(storage.data());
    std::uint16_t* at  = storage.data() + ((64 - address % 64) % 64) / 2 + offset;
    for (int l = 0; l < L; ++l) {
      layers.push_back(at);
      at += per_layer + 32;  // the next layer on a 64-byte boundary again (+ offset)
    }
  }

  paged_kv_cache describe(vllm_cpu_isa isa)
  {
    std::vector<void*> bases(layers.begin(), layers.end());
    return make_vllm_cpu_cache(dtype::bfloat16,
                               bases,
                               {blocks, heads, block, 2 * dim},
                               {heads * block * 2 * dim, block * 2 * dim, 2 * dim, 1},
                               isa);
  }
};

/// Element (t, d) of a block's keys / values within a (block, head) cell of 2 B D elements, as
/// make_vllm_cpu_cache documents vLLM 0.32's layouts.
std::int64_t key_at(
  vllm_cpu_isa isa, std::int64_t B, std::int64_t D, std::int64_t t, std::int64_t d)
{
  return isa == vllm_cpu_isa::amx ? (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + d % 2
                                  : d * B + t;
}
std::int64_t value_at(
  vllm_cpu_isa isa, std::int64_t B, std::int64_t D, std::int64_t t, std::int64_t d)
{
  return B * D + (isa == vllm_cpu_isa::amx ? (d / 16) * 16 * B + (t / 2) * 32 + (d % 16) * 2 + t % 2
                                           : t * D + d);
}

}  // namespace

TEST_CASE(
  "vLLM's CPU layouts: every element as the layout formulas and vLLM's rotation (truncated "
  "or rounded to nearest) say, at every vector level",
  "[inject][simd]")
{
  auto const isa      = GENERATE(vllm_cpu_isa::vec, vllm_cpu_isa::amx);
  bool const nearest  = GENERATE(false, true);  // vLLM's AVX2 kernel truncates, AVX512_BF16 rounds
  auto const geometry = GENERATE(std::make_pair(64, 64),
                                 std::make_pair(128, 128),
                                 std::make_pair(64, 32),
                                 std::make_pair(32, 32));
  auto const B        = GENERATE(32, 128);
  auto const scenario = GENERATE(range(0, 4));
  auto const offset   = GENERATE(0, 1);  // elements past a 64-byte boundary
  int const D = geometry.first, rotary = geometry.second, half = rotary / 2;
  CAPTURE(to_string(isa), nearest, D, rotary, B, scenario, offset);
  int const L = 2, H = 3;
  std::int64_t const NB = 6;

  // Facts of 45, 11, 20, 1 and 30 tokens (107 in all: odd).
  std::vector<fact_data> facts;
  int const lengths[] = {45, 11, 20, 1, 30};
  std::int64_t m      = 0;
  for (int f = 0; f < 5; ++f) {
    facts.emplace_back(static_cast<std::uint64_t>(f + 1), L, lengths[f], H, D, 40 + f);
    m += lengths[f];
  }
  // Values the rotation treats apart: zeros of both signs, the largest bf16 values (products
  // overflow to infinities, inf - inf is NaN), subnormals, exact small values.
  float const special[] = {0.0f, -0.0f, 3.3e38f, -3.3e38f, 1e-40f, -3e-39f, 1.0f, -2.5f};
  for (std::size_t i = 0; i < facts[0].k.size(); i += 5) {
    facts[0].k[i] = special[(i / 5) % 8];
    facts[0].v[i] = special[(i / 5 + 3) % 8];
  }
  kv_store store = make_host_store(L, H, D, dtype::bfloat16, 16, 16);
  for (auto const& f : facts) {
    f.insert_into(store);
  }

  // Slots of the segment's m tokens: 0 from slot 0 of block 2 on (the connector's leading run,
  // its last block partly filled), 1 from offset 5 of block 1 (runs starting mid-window), 2 from
  // offset 1 of block 1 with every 7th slot skipped (runs starting and ending at every offset of
  // a window), 3 alternately backwards from the last slot and forwards from slot 1 (runs of one).
  std::int64_t const p0 = scenario == 1 ? 5 : 0;
  std::vector<std::int64_t> slots(static_cast<std::size_t>(m));
  for (std::int64_t j = 0; j < m; ++j) {
    std::int64_t s = 0;
    switch (scenario) {
      case 0: s = 2 * B + j; break;
      case 1: s = B + 5 + j; break;
      case 2: s = j % 7 == 3 ? -1 : B + 1 + j; break;
      default: s = j % 2 == 0 ? NB * B - 1 - j / 2 : 1 + j / 2; break;
    }
    slots[static_cast<std::size_t>(j)] = s;
  }
  std::int64_t const rows         = p0 + m + 1;
  rope_spec spec                  = rope_presets::llama_3_1_8b();
  spec.head_dim                   = D;
  spec.rotary_dim                 = rotary;
  auto const params               = make_rope_params(spec);
  std::vector<bfloat16_t> const t = make_rope_cos_sin_values<bfloat16_t>(params, rows);
  auto table                      = make_rope_cos_sin_table(params, t.data(), rows, false);
  table.truncate_to_bfloat16      = !nearest;
  auto const rounded = [&](float f) { return nearest ? nearest_bits(f) : upper_bits(f); };

  std::vector<std::uint64_t> ids{1, 2, 3, 4, 5};
  compose_options options;
  options.first_position = p0;
  options.order          = fact_order::as_given;
  composition const plan = compose(store, ids, options);
  REQUIRE(plan.length() == m);

  int const levels = all_paths([&](detail::host_simd level) {
    CAPTURE(static_cast<int>(level));
    vllm_cpu_tensors tensors(L, NB, H, B, D, offset, 7);
    std::vector<std::uint16_t> const before = tensors.storage;
    injection_batch batch(store);
    batch.add(plan, slots);
    batch.run(tensors.describe(isa), table);

    // The expected tensors: the random bytes, then every injected element written out.
    std::vector<std::uint16_t> expected = before;
    auto const at                       = [&](int l, std::int64_t cell_element) {
      return static_cast<std::size_t>(tensors.layers[static_cast<std::size_t>(l)] -
                                      tensors.storage.data() + cell_element);
    };
    std::int64_t j = 0, injected = 0;
    for (auto const& f : facts) {
      for (int i = 0; i < f.tokens; ++i, ++j) {
        std::int64_t const slot = slots[static_cast<std::size_t>(j)];
        if (slot < 0) { continue; }
        ++injected;
        std::int64_t const b = slot / B, tk = slot % B, position = p0 + j;
        for (int l = 0; l < L; ++l) {
          for (int h = 0; h < H; ++h) {
            std::int64_t const cell = (b * H + h) * 2 * B * D;
            for (int p = 0; p < half; ++p) {
              float const volatile x =
                static_cast<float>(stored_value(dtype::bfloat16, f.key(l, i, h, p)));
              float const volatile y =
                static_cast<float>(stored_value(dtype::bfloat16, f.key(l, i, h, p + half)));
              float const volatile c = to_float(t[static_cast<std::size_t>(position * rotary + p)]);
              float const volatile sn =
                to_float(t[static_cast<std::size_t>(position * rotary + half + p)]);
              float const volatile xc = x * c, ys = y * sn, yc = y * c, xs = x * sn;
              float const volatile first = xc - ys, second = yc + xs;
              expected[at(l, cell + key_at(isa, B, D, tk, p))]        = rounded(first);
              expected[at(l, cell + key_at(isa, B, D, tk, p + half))] = rounded(second);
            }
            for (int d = rotary; d < D; ++d) {
              expected[at(l, cell + key_at(isa, B, D, tk, d))] =
                upper_bits(static_cast<float>(stored_value(dtype::bfloat16, f.key(l, i, h, d))));
            }
            for (int d = 0; d < D; ++d) {
              expected[at(l, cell + value_at(isa, B, D, tk, d))] =
                upper_bits(static_cast<float>(stored_value(dtype::bfloat16, f.value(l, i, h, d))));
            }
          }
        }
      }
    }
    REQUIRE(injected > 0);
    std::size_t differing = 0, first_difference = expected.size();
    for (std::size_t e = 0; e < expected.size(); ++e) {
      if (tensors.storage[e] != expected[e]) {
        ++differing;
        first_difference = std::min(first_difference, e);
      }
    }
    CAPTURE(first_difference);
    CHECK(differing == 0);
    // and something was written where the random bytes were
    CHECK(tensors.storage != before);
  });
  REQUIRE(levels >= 1);
}

TEST_CASE("vLLM's CPU layouts: a refused injection writes no line", "[inject]")
{
  // A batch whose slot lies past the cache is refused before the line path runs.
  int const L = 1, H = 2, D = 64, B = 32;
  kv_store store = make_host_store(L, H, D, dtype::bfloat16, 16, 4);
  fact_data const fact(1, L, 40, H, D, 3);
  fact.insert_into(store);
  auto const params               = make_rope_params(rope_presets::smollm2_135m());
  std::vector<bfloat16_t> const t = make_rope_cos_sin_values<bfloat16_t>(params, 64);
  auto table                      = make_rope_cos_sin_table(params, t.data(), 64, false);
  table.truncate_to_bfloat16      = true;
  for (auto const isa : {vllm_cpu_isa::vec, vllm_cpu_isa::amx}) {
    vllm_cpu_tensors tensors(L, 2, H, B, D, 0, 9);
    std::vector<std::uint16_t> const before = tensors.storage;
    std::vector<std::int64_t> slots(40);
    std::iota(slots.begin(), slots.end(), std::int64_t{0});
    slots.back() = 2 * B;  // one past the last slot
    injection_batch batch(store);
    compose_options options;
    options.first_position = 0;
    batch.add(compose(store, {1}, options), slots);
    REQUIRE_THROWS(batch.run(tensors.describe(isa), table));
    CHECK(tensors.storage == before);
  }
}

TEST_CASE("vLLM's CPU layouts: the line path's forms are recognised from the strides", "[inject]")
{
  std::vector<std::uint16_t> storage(2 * 2 * 128 * 2 * 64 + 64);
  std::vector<void*> const layers{storage.data()};
  std::array<std::int64_t, 4> const shape{2, 2, 128, 128};
  std::array<std::int64_t, 4> const strides{2 * 128 * 128, 128 * 128, 128, 1};
  auto const vec = make_vllm_cpu_cache(dtype::bfloat16, layers, shape, strides, vllm_cpu_isa::vec);
  auto const amx = make_vllm_cpu_cache(dtype::bfloat16, layers, shape, strides, vllm_cpu_isa::amx);
  CHECK(detail::line_key_form_of(vec.key_layout) == detail::line_key_form::token_major);
  CHECK(detail::line_value_form_of(vec.value_layout) == detail::line_value_form::rows);
  CHECK(detail::line_key_form_of(amx.key_layout) == detail::line_key_form::token_tiles16);
  CHECK(detail::line_value_form_of(amx.value_layout) == detail::line_value_form::dim_strips16);
  // head_dim 80 (vLLM's vec16 models, not a multiple of 32): not taken
  std::array<std::int64_t, 4> const shape80{2, 2, 32, 160};
  std::array<std::int64_t, 4> const strides80{2 * 32 * 160, 32 * 160, 160, 1};
  auto const vec80 =
    make_vllm_cpu_cache(dtype::bfloat16, layers, shape80, strides80, vllm_cpu_isa::vec);
  CHECK_FALSE(detail::line_path_takes(vec80));
}
