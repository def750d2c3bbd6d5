// Host tests of injection and extraction (inject.hpp) with the store (store.hpp), composition
// (compose.hpp) and the cache descriptors (cache.hpp). Expectations come from the test side only:
// caches are the simulators of tests/common/engine_caches.hpp (engines.md), rotations are
// recomputed in double from theta (inject_common.hpp), element rounding is written from the
// formats' specs, and which token goes to which slot at which position is written out by hand.
#include "engine_caches.hpp"
#include "inject_common.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/extract.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test;
using Catch::Matchers::Contains;

namespace {

constexpr double eps32 = 1.0 / 16777216.0;  // 2^-24, fp32 unit roundoff

/// One token the test expects in the cache: token `token` of `fact` at `position` in `slot`. The
/// fact's arrays may hold the whole model while the cache holds a shard at the offsets given.
struct placed_token {
  fact_data const* fact;
  int token;
  std::int64_t slot;
  std::int64_t position;
  int layer_offset{0};
  int head_offset{0};
};

/// fp8 scales as the test sets them (host arrays, per layer one scale or one per head).
struct quant_ref {
  kv_scale_convention convention{kv_scale_convention::divide};
  std::vector<std::vector<float>> k, v;  // empty: no scaling

  float scale(int l, int h, bool value) const
  {
    auto const& s = value ? v : k;
    if (s.empty()) { return 1.0f; }
    auto const& row = s[static_cast<std::size_t>(l)];
    return row.size() == 1 ? row[0] : row[static_cast<std::size_t>(h)];
  }
  /// The fp32 value stored for real fp32 value x (engines.md §9).
  float apply(float x, float s) const
  {
    return convention == kv_scale_convention::divide ? x / s : x * s;
  }
  /// The factor between a real value and its stored value.
  double factor(float s) const
  {
    return convention == kv_scale_convention::divide ? 1.0 / s : static_cast<double>(s);
  }
};

/**
 * Checks every element of `writes` through the simulator's accessors:
 *  - rotary key dims: within half an ulp of T (the conversion) plus a few fp32 roundings of the
 *    pair's norm (fp32 cos/sin, products and sum) of the reference rotation, scaled;
 *  - pass-through key dims and values: exactly the conversion of the scaled fp32 value;
 * and that every other byte of the storage equals `before`.
 */
template <class T>
void check_cache(engine_cache<T> const& ec,
                 std::vector<unsigned char> const& before,
                 std::vector<placed_token> const& writes,
                 ref_rope const& rope,
                 dtype store_dtype,
                 quant_ref const& q = {})
{
  REQUIRE(before.size() == ec.storage_bytes());
  auto const* base = reinterpret_cast<unsigned char const*>(ec.storage());
  std::vector<char> written(ec.storage_bytes(), 0);
  auto const mark = [&](T const& e) {
    auto const off = reinterpret_cast<unsigned char const*>(&e) - base;
    for (std::size_t b = 0; b < sizeof(T); ++b) {
      written[static_cast<std::size_t>(off) + b] = 1;
    }
  };
  std::int64_t bad = 0, checked = 0;
  std::string first_bad;
  int const D = ec.head_dim();
  std::vector<double> x(static_cast<std::size_t>(D));
  for (auto const& w : writes) {
    for (int l = 0; l < ec.num_layers(); ++l) {
      for (int h = 0; h < ec.num_heads(); ++h) {
        int const fl = l + w.layer_offset, fh = h + w.head_offset;
        for (int d = 0; d < D; ++d) {
          x[static_cast<std::size_t>(d)] =
            stored_value(store_dtype, w.fact->key(fl, w.token, fh, d));
        }
        auto const y   = rope.rotate(x, w.position);
        float const ks = q.scale(l, h, false), vs = q.scale(l, h, true);
        for (int d = 0; d < D; ++d) {
          T const& ke      = ec.key(l, w.slot, h, d);
          double const got = decode(ke);
          mark(ke);
          bool ok         = false;
          double expected = 0;
          if (d < rope.rotary_dim) {
            expected           = y[static_cast<std::size_t>(d)] * q.factor(ks);
            double const err32 = 16 * eps32 * rope.pair_norm(x, d) * q.factor(ks);
            double const bound =
              0.5 * ulp_at<T>(std::max(std::fabs(got), std::fabs(expected))) + err32;
            ok = std::fabs(got - expected) <= bound;
          } else {
            expected = round_to<T>(q.apply(static_cast<float>(x[static_cast<std::size_t>(d)]), ks));
            ok       = got == expected;
          }
          T const& ve        = ec.value(l, w.slot, h, d);
          double const gotv  = decode(ve);
          double const wantv = round_to<T>(q.apply(
            static_cast<float>(stored_value(store_dtype, w.fact->value(fl, w.token, fh, d))), vs));
          mark(ve);
          ok = ok && gotv == wantv;
          checked += 2;
          if (!ok && bad++ == 0) {
            first_bad = "fact " + std::to_string(w.fact->id) + " token " + std::to_string(w.token) +
                        " slot " + std::to_string(w.slot) + " position " +
                        std::to_string(w.position) + " layer " + std::to_string(l) + " head " +
                        std::to_string(h) + " dim " + std::to_string(d) + ": key " +
                        std::to_string(got) + " expected " + std::to_string(expected) + ", value " +
                        std::to_string(gotv) + " expected " + std::to_string(wantv);
          }
        }
      }
    }
  }
  std::int64_t changed_elsewhere = 0;
  std::size_t first_changed      = 0;
  for (std::size_t i = 0; i < written.size(); ++i) {
    if (!written[i] && before[i] != base[i]) {
      if (changed_elsewhere++ == 0) { first_changed = i; }
    }
  }
  INFO(first_bad);
  CAPTURE(checked, first_changed);
  REQUIRE(checked ==
          2 * static_cast<std::int64_t>(writes.size()) * ec.num_layers() * ec.num_heads() * D);
  REQUIRE(bad == 0);
  REQUIRE(changed_elsewhere == 0);
}

/// Tokens [first, first + count) of `fact` at positions from `position`, into `slots` (negative:
/// skipped, not expected anywhere).
void place(std::vector<placed_token>& out,
           fact_data const& fact,
           int first,
           int count,
           std::int64_t position,
           std::vector<std::int64_t> const& slots)
{
  REQUIRE(static_cast<int>(slots.size()) == count);
  for (int j = 0; j < count; ++j) {
    if (slots[static_cast<std::size_t>(j)] >= 0) {
      out.push_back({&fact, first + j, slots[static_cast<std::size_t>(j)], position + j});
    }
  }
}

compose_options at(std::int64_t p0)
{
  compose_options o;
  o.first_position = p0;
  o.order          = fact_order::as_given;
  return o;
}

/// Everything a refused call must leave as it was.
struct state {
  std::uint64_t cache_hash;
  std::vector<unsigned char> pool;
  std::int64_t free_pages;
  std::int64_t num_facts;
  std::uint64_t version;

  bool operator==(state const& o) const
  {
    return cache_hash == o.cache_hash && pool == o.pool && free_pages == o.free_pages &&
           num_facts == o.num_facts && version == o.version;
  }
};

template <class T>
state snapshot(engine_cache<T> const& ec, kv_store const& store)
{
  return {ec.hash(), store.pool_to_host(), store.free_pages(), store.num_facts(), store.version()};
}

/// A float32 store's element, read with the documented pool layout
/// `[pages][layers][2][page_size][heads][head_dim]` (store.hpp) and the fact's page list.
float read_store(kv_store const& store,
                 std::vector<unsigned char> const& pool,
                 std::uint64_t id,
                 int kv,
                 int l,
                 int j,
                 int h,
                 int d)
{
  REQUIRE(store.store_dtype() == dtype::float32);
  auto const& fact       = store.at(id);
  std::int64_t const ps  = store.page_size();
  std::int64_t const L   = store.geometry().num_layers;
  std::int64_t const H   = store.geometry().num_kv_heads;
  std::int64_t const D   = store.geometry().head_dim;
  std::int64_t const pg  = fact.pages[static_cast<std::size_t>(j / ps)];
  std::int64_t const idx = ((((pg * L + l) * 2 + kv) * ps + j % ps) * H + h) * D + d;
  float x;
  std::memcpy(&x, pool.data() + idx * 4, 4);
  return x;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// a. Rotation and conversion

TEMPLATE_TEST_CASE("the host run writes keys rotated to their positions and values converted",
                   "[inject]",
                   float,
                   half_t,
                   bfloat16_t)
{
  using T                = TestType;
  auto const store_dt    = GENERATE(dtype::float32, dtype::bfloat16);
  auto const theta       = GENERATE(10000.0, 500000.0);
  auto const interleaved = GENERATE(false, true);
  auto const head_dim    = GENERATE(16, 48);
  auto const partial     = GENERATE(false, true);
  auto const fp32_angles = GENERATE(true, false);
  auto const tokens      = GENERATE(1, 7);
  auto const p0          = GENERATE(as<std::int64_t>{}, 0, 4093, 100001);
  int const L = 2, H = 3;
  CAPTURE(
    sizeof(T), to_string(store_dt), theta, interleaved, head_dim, partial, fp32_angles, tokens, p0);

  ref_rope const rope{head_dim, partial ? head_dim / 2 : head_dim, theta, interleaved, fp32_angles};
  kv_store store = make_host_store(L, H, head_dim, store_dt, 4, 4);
  fact_data const fact(7, L, tokens, H, head_dim, 1234 + static_cast<std::uint64_t>(tokens));
  fact.insert_into(store);

  engine_cache<T> ec(engine_layout::vllm_flash_attn_hnd, L, 4, 4, H, head_dim);
  ec.fill_random(99);
  auto const before = storage_bytes(ec);
  std::vector<std::int64_t> slots;
  for (int j = 0; j < tokens; ++j) {
    slots.push_back((7 * j + 3) % 16);  // 7 is prime to 16: distinct, scattered over blocks
  }
  injection_batch batch(store);
  batch.add(compose(store, {7}, at(p0)), slots);
  batch.run(describe_cache(ec), rope.params());

  std::vector<placed_token> writes;
  place(writes, fact, 0, tokens, p0, slots);
  check_cache(ec, before, writes, rope, store_dt);
}

TEMPLATE_TEST_CASE("the host run into fp8 caches: within one fp8 step, both scale conventions",
                   "[inject]",
                   float8_e4m3_t,
                   float8_e5m2_t)
{
  using T               = TestType;
  auto const convention = GENERATE(kv_scale_convention::divide, kv_scale_convention::multiply);
  auto const granularity =
    GENERATE(kv_scale_granularity::per_tensor, kv_scale_granularity::per_head);
  auto const interleaved = GENERATE(false, true);
  auto const tokens      = GENERATE(1, 5);
  auto const layout      = GENERATE(engine_layout::vllm_legacy, engine_layout::vllm_flashinfer_nhd);
  int const L = 2, H = 3, D = 32;
  CAPTURE(sizeof(T),
          static_cast<int>(convention),
          static_cast<int>(granularity),
          interleaved,
          tokens,
          to_string(layout));

  ref_rope const rope{D, D, 500000.0, interleaved, true};
  kv_store store = make_host_store(L, H, D, dtype::float32, 4, 4);
  fact_data const fact(3, L, tokens, H, D, 77);
  fact.insert_into(store);

  // Real scales: K of layer l, head h 0.02 (1 + h + 2l) (per head) or 0.03 (1 + l) (per tensor);
  // V 1.5 times that. Multiply-convention caches hold the reciprocals (engines.md §9), so the
  // stored values have the same size either way (|x| <= 2.83 -> at most ~141, below fp8 max).
  quant_ref q;
  q.convention = convention;
  for (int l = 0; l < L; ++l) {
    std::vector<float> k, v;
    int const n = granularity == kv_scale_granularity::per_head ? H : 1;
    for (int h = 0; h < n; ++h) {
      float const real = granularity == kv_scale_granularity::per_head
                           ? 0.02f * float(1 + h + 2 * l)
                           : 0.03f * float(1 + l);
      float const kr   = real;
      float const vr   = 1.5f * real;
      k.push_back(convention == kv_scale_convention::divide ? kr : 1.0f / kr);
      v.push_back(convention == kv_scale_convention::divide ? vr : 1.0f / vr);
    }
    q.k.push_back(k);
    q.v.push_back(v);
  }
  std::vector<float const*> kp, vp;
  for (int l = 0; l < L; ++l) {
    kp.push_back(q.k[static_cast<std::size_t>(l)].data());
    vp.push_back(q.v[static_cast<std::size_t>(l)].data());
  }

  engine_cache<T> ec(layout, L, 3, 4, H, D);
  ec.fill_random(5);
  auto const before    = storage_bytes(ec);
  paged_kv_cache cache = describe_cache(ec);
  cache.set_fp8_scales(convention, granularity, kp, vp);
  std::vector<std::int64_t> slots{11, 0, 5, 6, 7};
  slots.resize(static_cast<std::size_t>(tokens));
  injection_batch batch(store);
  batch.add(compose(store, {3}, at(29)), slots);
  batch.run(cache, rope.params());

  std::vector<placed_token> writes;
  place(writes, fact, 0, tokens, 29, slots);
  check_cache(ec, before, writes, rope, dtype::float32, q);
}

// ------------------------------------------------------------------------------------------------
// b. Every engine layout, a multi-request batch

TEMPLATE_TEST_CASE("a multi-request batch lands in every engine layout and nowhere else",
                   "[inject]",
                   float,
                   bfloat16_t,
                   float8_e4m3_t)
{
  using T           = TestType;
  auto const layout = GENERATE(from_range(all_engine_layouts()));
  // Engine block size 1 or 4 (40 slots either way); the request's block table below has 4-token
  // blocks, as a connector's table does whatever the engine's kernel block size.
  auto const BS = GENERATE(1, 4);
  int const L = 2, H = 3, D = 16, NB = 40 / BS, TB = 4;
  CAPTURE(sizeof(T), to_string(layout), BS);

  kv_store store = make_host_store(L, H, D, dtype::float32, 3, 16);
  fact_data const f11(11, L, 5, H, D, 11), f12(12, L, 3, H, D, 12), f13(13, L, 7, H, D, 13),
    f14(14, L, 1, H, D, 14), f15(15, L, 9, H, D, 15), f16(16, L, 2, H, D, 16);
  for (auto const* f : {&f11, &f12, &f13, &f14, &f15, &f16}) {
    f->insert_into(store, f->id % 2);
  }
  REQUIRE(store.num_facts() == 6);

  engine_cache<T> ec(layout, L, NB, BS, H, D);
  ec.fill_random(2024);
  auto const before = storage_bytes(ec);
  ref_rope const rope{D, D, 10000.0, false, true};

  injection_batch batch(store);
  // r0: facts 11, 13 at p0 = 0 through an explicit slot mapping with skipped tokens; entries
  // past the plan's 12 tokens belong to the query and must not be read.
  std::vector<std::int64_t> const r0{3, -1, 17, 18, 19, 0, 1, 2, -1, 30, 31, 29, 4, 5};
  batch.add(compose(store, {11, 13}, at(0)), r0);
  // r1: facts 12, 14, 15 ranked best first, laid out reversed (15, 14, 12) at p0 = 37, as prompt
  // tokens 2 .. 14 of a request with block table {5, 8, 6, 9} (block size 4).
  compose_options o1         = at(37);
  o1.order                   = fact_order::best_last;
  std::int32_t const table[] = {5, 8, 6, 9};
  // (The table's block size TB is not the cache's: the slots are computed by the slot rule.)
  batch.add(compose(store, {12, 14, 15}, o1), slots_from_block_table(table, 4, TB, 2, 13));
  // r2: instruction prefix 16 then fact 11 at p0 = 1000; the prefix's slots are skipped.
  compose_options o2    = at(1000);
  o2.instruction_prefix = 16;
  batch.add(compose(store, {11}, o2), std::vector<std::int64_t>{-1, -1, 8, 9, 10, 11, 12});

  REQUIRE(batch.num_requests() == 3);
  REQUIRE(batch.num_tokens() == 12 + 13 + 7);
  REQUIRE(batch.request_offsets() == (std::vector<std::int64_t>{0, 12, 25, 32}));
  REQUIRE(batch.max_slot() == 38);
  REQUIRE(batch.max_position() == 1006);

  batch.run(describe_cache(ec), rope.params());

  std::vector<placed_token> writes;
  place(writes, f11, 0, 5, 0, {3, -1, 17, 18, 19});
  place(writes, f13, 0, 7, 5, {0, 1, 2, -1, 30, 31, 29});
  // Block-table slots of prompt positions 2 .. 14: table[p / 4] * 4 + p % 4.
  std::vector<std::int64_t> r1;
  for (int p = 2; p < 15; ++p) {
    r1.push_back(std::int64_t{table[p / TB]} * TB + p % TB);
  }
  REQUIRE(r1 == (std::vector<std::int64_t>{22, 23, 32, 33, 34, 35, 24, 25, 26, 27, 36, 37, 38}));
  place(writes, f15, 0, 9, 37, {r1.begin(), r1.begin() + 9});
  place(writes, f14, 0, 1, 46, {r1[9]});
  place(writes, f12, 0, 3, 47, {r1.begin() + 10, r1.end()});
  place(writes, f16, 0, 2, 1000, {-1, -1});
  place(writes, f11, 0, 5, 1002, {8, 9, 10, 11, 12});
  REQUIRE(writes.size() == 10 + 13 + 5);
  check_cache(ec, before, writes, rope, dtype::float32);
}

// ------------------------------------------------------------------------------------------------
// c. Round trip through extraction

TEMPLATE_TEST_CASE("inject, extract, inject again reproduces the cache",
                   "[inject]",
                   float,
                   bfloat16_t)
{
  using T                = TestType;
  auto const layout      = GENERATE(engine_layout::vllm_flash_attn_hnd,
                               engine_layout::vllm_legacy,
                               engine_layout::sglang_token_pool);
  auto const interleaved = GENERATE(false, true);
  int const L = 2, H = 3, D = 32, m = 9;
  std::int64_t const p0 = 123;
  CAPTURE(sizeof(T), to_string(layout), interleaved);

  ref_rope const rope{D, D, 500000.0, interleaved, true};
  auto const params = rope.params();
  kv_store store    = make_host_store(L, H, D, dtype::float32, 4, 8);
  fact_data const fact(21, L, m, H, D, 21);
  fact.insert_into(store);

  engine_cache<T> a(layout, L, 8, 4, H, D), b(layout, L, 8, 4, H, D);
  a.fill_random(8);
  b.fill_random(8);
  REQUIRE(a.hash() == b.hash());
  std::vector<std::int64_t> const slots{14, 2, 3, 27, 28, 29, 30, 5, 6};
  {
    injection_batch batch(store);
    batch.add(compose(store, {21}, at(p0)), slots);
    batch.run(describe_cache(a), params);
  }
  std::vector<std::int32_t> const ids(fact.token_ids);
  extract_host(describe_cache(a), slots, p0, params, store, 99, 1, ids);
  REQUIRE(store.contains(99));
  REQUIRE(store.at(99).token_ids == ids);
  REQUIRE(store.at(99).namespace_id == 1);

  // The extracted fact is the original pre-RoPE fact up to the cache's rounding: the inverse
  // rotation of a value within half an ulp of T of the rotated key, values exactly converted.
  auto const pool = store.pool_to_host();
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < m; ++j) {
      for (int h = 0; h < H; ++h) {
        double norm = 0;
        for (int d = 0; d < D; ++d) {
          norm = std::max(norm, std::fabs(double(fact.key(l, j, h, d))));
        }
        for (int d = 0; d < D; ++d) {
          CAPTURE(l, j, h, d);
          double const tol = (std::is_same_v<T, float> ? 16 * eps32 : 1.0 / 256) * 2 * norm;
          REQUIRE(std::fabs(read_store(store, pool, 99, 0, l, j, h, d) - fact.key(l, j, h, d)) <=
                  tol);
          REQUIRE(read_store(store, pool, 99, 1, l, j, h, d) ==
                  round_to<T>(fact.value(l, j, h, d)));
        }
      }
    }
  }

  {
    injection_batch batch(store);
    batch.add(compose(store, {99}, at(p0)), slots);
    batch.run(describe_cache(b), params);
  }
  std::int64_t elements = 0, identical = 0, beyond = 0;
  for (int l = 0; l < L; ++l) {
    for (auto s : slots) {
      for (int h = 0; h < H; ++h) {
        std::vector<double> ka(static_cast<std::size_t>(D));
        for (int d = 0; d < D; ++d) {
          ka[static_cast<std::size_t>(d)] = decode(a.key(l, s, h, d));
        }
        for (int d = 0; d < D; ++d) {
          double const x = ka[static_cast<std::size_t>(d)], y = decode(b.key(l, s, h, d));
          ++elements;
          if (std::memcmp(&a.key(l, s, h, d), &b.key(l, s, h, d), sizeof(T)) == 0) { ++identical; }
          // fp32: forward, inverse and forward rotations in fp32 of a pair of norm r.
          // bf16: at most one bf16 ulp of the element apart.
          double const bound = std::is_same_v<T, float>
                                 ? 32 * eps32 * rope.pair_norm(ka, d)
                                 : ulp_at<T>(std::max(std::fabs(x), std::fabs(y)));
          if (std::fabs(x - y) > bound) { ++beyond; }
          REQUIRE(std::memcmp(&a.value(l, s, h, d), &b.value(l, s, h, d), sizeof(T)) == 0);
        }
      }
    }
  }
  CAPTURE(elements, identical, beyond);
  REQUIRE(elements == std::int64_t{L} * m * H * D);
  REQUIRE(beyond == 0);
  if (!std::is_same_v<T, float>) { REQUIRE(identical * 100 >= elements * 99); }
  // Nothing else differs: both caches started equal and received the same slots.
  auto const ba = storage_bytes(a), bb = storage_bytes(b);
  std::vector<char> slot_bytes(ba.size(), 0);
  for (int l = 0; l < L; ++l) {
    for (auto s : slots) {
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          for (auto const* e : {&a.key(l, s, h, d), &a.value(l, s, h, d)}) {
            auto const off = reinterpret_cast<unsigned char const*>(e) -
                             reinterpret_cast<unsigned char const*>(a.storage());
            for (std::size_t i = 0; i < sizeof(T); ++i) {
              slot_bytes[static_cast<std::size_t>(off) + i] = 1;
            }
          }
        }
      }
    }
  }
  std::int64_t other_diff = 0;
  for (std::size_t i = 0; i < ba.size(); ++i) {
    if (!slot_bytes[i] && ba[i] != bb[i]) { ++other_diff; }
  }
  REQUIRE(other_diff == 0);
}

// ------------------------------------------------------------------------------------------------
// d. Relocation: attention scores depend only on the relative distance

TEST_CASE("scores against injected keys depend only on the query-key distance", "[inject]")
{
  auto const fp32_angles = GENERATE(true, false);
  auto const interleaved = GENERATE(false, true);
  int const L = 2, H = 2, D = 32, m = 5, gap = 4;
  // fp32 angles are rounded to fp32 (half an ulp of p * inv), so their placements stay small;
  // exact angles relocate to fp32 rounding at any distance.
  std::int64_t const p0a = 3, p0b = fp32_angles ? 300 : 70001;
  CAPTURE(fp32_angles, interleaved);

  ref_rope const rope{D, D, 10000.0, interleaved, fp32_angles};
  kv_store store = make_host_store(L, H, D, dtype::float32, 4, 4);
  fact_data const fact(5, L, m, H, D, 55);
  fact.insert_into(store);
  std::vector<std::int64_t> const slots{4, 9, 0, 13, 2};

  auto inject_at = [&](engine_cache<float>& ec, std::int64_t p0) {
    ec.fill_random(1);
    injection_batch batch(store);
    batch.add(compose(store, {5}, at(p0)), slots);
    batch.run(describe_cache(ec), rope.params());
  };
  engine_cache<float> ca(engine_layout::contiguous, L, 4, 4, H, D);
  engine_cache<float> cb(engine_layout::contiguous, L, 4, 4, H, D);
  inject_at(ca, p0a);
  inject_at(cb, p0b);

  std::mt19937_64 rng(17);
  std::normal_distribution<double> normal(0.0, 1.0);
  double key_moved = 0;
  for (int l = 0; l < L; ++l) {
    for (int h = 0; h < H; ++h) {
      std::vector<double> q(static_cast<std::size_t>(D));
      for (auto& e : q) {
        e = normal(rng);
      }
      // The query follows the segment: position p0 + m + gap.
      auto const qa = rope.rotate(q, p0a + m + gap);
      auto const qb = rope.rotate(q, p0b + m + gap);
      for (int j = 0; j < m; ++j) {
        double sa = 0, sb = 0, qn = 0, kn = 0;
        for (int d = 0; d < D; ++d) {
          double const ka = ca.key(l, slots[j], h, d), kb = cb.key(l, slots[j], h, d);
          sa += qa[d] * ka;
          sb += qb[d] * kb;
          qn += q[d] * q[d];
          kn += ka * ka;
          key_moved = std::max(key_moved, std::fabs(ka - kb));
        }
        CAPTURE(l, h, j, sa, sb);
        REQUIRE(std::fabs(sa - sb) <= 1e-4 * std::sqrt(qn * kn));
      }
    }
  }
  // The placements differ (the keys were rotated differently), so the equality is not trivial.
  REQUIRE(key_moved > 0.1);
}

// ------------------------------------------------------------------------------------------------
// e. The engine's cos/sin table as the rotation

TEST_CASE("an engine cos/sin table rotates as rope_params do; positions beyond it are refused",
          "[inject]")
{
  auto const interleaved = GENERATE(false, true);
  auto const partial     = GENERATE(false, true);
  int const L = 2, H = 3, D = 32, m = 7;
  std::int64_t const rows = 64;
  CAPTURE(interleaved, partial);

  ref_rope const rope{D, partial ? 16 : D, 10000.0, interleaved, true};
  auto const params          = rope.params();
  std::vector<float> const t = make_rope_cos_sin_values<float>(params, rows);
  auto const table           = make_rope_cos_sin_table(params, t.data(), rows);
  REQUIRE(t.size() == static_cast<std::size_t>(rows * rope.rotary_dim));

  kv_store store = make_host_store(L, H, D, dtype::float32, 4, 4);
  fact_data const fact(8, L, m, H, D, 8);
  fact.insert_into(store);
  std::vector<std::int64_t> const slots{1, 2, 3, 4, 5, 6, 7};

  engine_cache<float> x(engine_layout::vllm_flashinfer_hnd, L, 3, 4, H, D);
  engine_cache<float> y(engine_layout::vllm_flashinfer_hnd, L, 3, 4, H, D);
  x.fill_random(3);
  y.fill_random(3);
  auto const before = storage_bytes(x);
  // Last position 63: the table's last row.
  injection_batch batch(store);
  batch.add(compose(store, {8}, at(rows - m)), slots);
  batch.run(describe_cache(x), table);
  batch.run(describe_cache(y), params);

  std::vector<placed_token> writes;
  place(writes, fact, 0, m, rows - m, slots);
  check_cache(x, before, writes, rope, dtype::float32);
  std::int64_t differ = 0;
  for (int l = 0; l < L; ++l) {
    for (auto s : slots) {
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          double const a = x.key(l, s, h, d), b = y.key(l, s, h, d);
          // fp32 rounding of a rotation of |a| <= 2.83 pairs: a few ulps of 2.83.
          if (std::fabs(a - b) > 8 * eps32 * 4) { ++differ; }
          if (x.value(l, s, h, d) != y.value(l, s, h, d)) { ++differ; }
        }
      }
    }
  }
  REQUIRE(differ == 0);

  // One row past the table: refused before anything is written.
  engine_cache<float> z(engine_layout::vllm_flashinfer_hnd, L, 3, 4, H, D);
  z.fill_random(3);
  state const s0 = snapshot(z, store);
  injection_batch late(store);
  late.add(compose(store, {8}, at(rows - m + 1)), slots);
  REQUIRE(late.max_position() == rows);
  REQUIRE_THROWS_WITH(late.run(describe_cache(z), table), Contains("beyond the cos/sin table"));
  REQUIRE(snapshot(z, store) == s0);
  // rope_params have no table: the same batch is accepted.
  REQUIRE_NOTHROW(late.run(describe_cache(z), params));
  REQUIRE(z.hash() != s0.cache_hash);
}

TEST_CASE("a 16-bit table with vLLM's per-operation rounding stays within bf16 rounding",
          "[inject]")
{
  int const L = 1, H = 2, D = 64, m = 5;
  std::int64_t const rows = 4096;
  ref_rope const rope{D, D, 500000.0, false, true};
  auto const params               = rope.params();
  std::vector<bfloat16_t> const t = make_rope_cos_sin_values<bfloat16_t>(params, rows);
  auto const table                = make_rope_cos_sin_table(params, t.data(), rows, true);
  kv_store store                  = make_host_store(L, H, D, dtype::bfloat16, 4, 4);
  fact_data const fact(1, L, m, H, D, 4);
  fact.insert_into(store);
  engine_cache<bfloat16_t> ec(engine_layout::vllm_flash_attn_nhd, L, 2, 4, H, D);
  ec.fill_random(6);
  std::vector<std::int64_t> const slots{7, 6, 5, 4, 3};
  injection_batch batch(store);
  batch.add(compose(store, {1}, at(4000)), slots);
  batch.run(describe_cache(ec), table);

  // cos and sin rounded to bf16 (the table), each product and the sum rounded to bf16: a few
  // bf16 roundings (2^-9 relative) of the pair's norm, on top of the exact rotation.
  std::vector<double> x(static_cast<std::size_t>(D));
  for (int j = 0; j < m; ++j) {
    for (int h = 0; h < H; ++h) {
      for (int d = 0; d < D; ++d) {
        x[d] = stored_value(dtype::bfloat16, fact.key(0, j, h, d));
      }
      auto const y = rope.rotate(x, 4000 + j);
      for (int d = 0; d < D; ++d) {
        CAPTURE(j, h, d);
        REQUIRE(std::fabs(decode(ec.key(0, slots[j], h, d)) - y[d]) <=
                6.0 / 512 * rope.pair_norm(x, d));
        REQUIRE(decode(ec.value(0, slots[j], h, d)) ==
                stored_value(dtype::bfloat16, fact.value(0, j, h, d)));
      }
    }
  }
}

TEST_CASE("truncate_to_bfloat16: fp32 rotation truncated to bf16, as vLLM's AVX2 CPU kernel",
          "[inject]")
{
  int const L = 2, H = 3, D = 64, m = 40;
  std::int64_t const rows = 2048;
  ref_rope const rope{D, D, 100000.0, false, true};
  auto const params               = rope.params();
  std::vector<bfloat16_t> const t = make_rope_cos_sin_values<bfloat16_t>(params, rows);
  auto table                      = make_rope_cos_sin_table(params, t.data(), rows, true);
  table.truncate_to_bfloat16      = true;
  kv_store store                  = make_host_store(L, H, D, dtype::bfloat16, 8, 16);
  fact_data const fact(1, L, m, H, D, 9);
  fact.insert_into(store);
  engine_cache<bfloat16_t> ec(engine_layout::vllm_cpu, L, 2, 32, H, D);
  ec.fill_random(3);
  // Backwards through both blocks (every token alone), or forwards from slot 5: runs of eight
  // consecutive slots in one block (the vector path where the CPU has AVX2), the tails of each
  // block (29-31, 40-44) token by token.
  bool const forwards = GENERATE(false, true);
  CAPTURE(forwards);
  std::vector<std::int64_t> slots(m);
  for (int j = 0; j < m; ++j) {
    slots[static_cast<std::size_t>(j)] = forwards ? 5 + j : 63 - j;
  }
  injection_batch batch(store);
  batch.add(compose(store, {1}, at(1000)), slots);
  batch.run(describe_cache(ec), table);

  // Written out: x c - y s and y c + x s in fp32 (each product and the sum rounded once, no
  // fused multiply-add), then the upper 16 bits of the fp32 result.
  auto const upper = [](float f) {
    std::uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return static_cast<std::uint16_t>(b >> 16);
  };
  auto const bits = [](bfloat16_t v) {
    std::uint16_t b;
    std::memcpy(&b, &v, sizeof b);
    return b;
  };
  int const half       = D / 2;
  std::int64_t checked = 0;
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < m; ++j) {
      std::int64_t const p = 1000 + j;
      for (int h = 0; h < H; ++h) {
        for (int i = 0; i < half; ++i) {
          float const volatile x =
            static_cast<float>(stored_value(dtype::bfloat16, fact.key(l, j, h, i)));
          float const volatile y =
            static_cast<float>(stored_value(dtype::bfloat16, fact.key(l, j, h, i + half)));
          float const volatile c  = to_float(t[static_cast<std::size_t>(p * D + i)]);
          float const volatile sn = to_float(t[static_cast<std::size_t>(p * D + half + i)]);
          float const volatile xc = x * c, ys = y * sn, yc = y * c, xs = x * sn;
          float const volatile a = xc - ys, b = yc + xs;
          CAPTURE(l, j, h, i);
          REQUIRE(bits(ec.key(l, slots[static_cast<std::size_t>(j)], h, i)) == upper(a));
          REQUIRE(bits(ec.key(l, slots[static_cast<std::size_t>(j)], h, i + half)) == upper(b));
          ++checked;
        }
        for (int d = 0; d < D; ++d) {
          REQUIRE(decode(ec.value(l, slots[static_cast<std::size_t>(j)], h, d)) ==
                  stored_value(dtype::bfloat16, fact.value(l, j, h, d)));
        }
      }
    }
  }
  REQUIRE(checked == std::int64_t{L} * m * H * half);

  SECTION("refused for other cache dtypes, and the cache is unchanged")
  {
    engine_cache<half_t> ech(engine_layout::vllm_cpu, L, 2, 32, H, D);
    ech.fill_random(4);
    std::uint64_t const before = ech.hash();
    REQUIRE_THROWS_WITH(batch.run(describe_cache(ech), table), Contains("truncate_to_bfloat16"));
    REQUIRE(ech.hash() == before);
  }
}

// ------------------------------------------------------------------------------------------------
// f. Refusals leave the store and the cache unchanged

TEST_CASE("refused compositions, batches, injections and extractions change nothing", "[inject]")
{
  int const L = 2, H = 2, D = 16;
  ref_rope const rope{D, D, 10000.0, false, true};
  auto const params = rope.params();
  kv_store store    = make_host_store(L, H, D, dtype::float32, 4, 6);
  fact_data const f1(1, L, 5, H, D, 1), f2(2, L, 3, H, D, 2);
  f1.insert_into(store);
  f2.insert_into(store);
  engine_cache<bfloat16_t> ec(engine_layout::vllm_flash_attn_nhd, L, 4, 4, H, D);  // 16 slots
  ec.fill_random(1);
  paged_kv_cache const cache = describe_cache(ec);
  std::vector<std::int64_t> const eight{0, 1, 2, 3, 4, 5, 6, 7};

  SECTION("unknown and repeated fact ids: compose refuses")
  {
    state const s0 = snapshot(ec, store);
    REQUIRE_THROWS_WITH(compose(store, {1, 77}), Contains("unknown fact id 77"));
    compose_options o;
    o.instruction_prefix = 78;
    REQUIRE_THROWS_WITH(compose(store, {1}, o), Contains("unknown instruction prefix id 78"));
    REQUIRE_THROWS_WITH(compose(store, {2, 1, 2}), Contains("appears twice"));
    o.instruction_prefix = 1;
    REQUIRE_THROWS_WITH(compose(store, {1, 2}, o), Contains("appears twice"));
    REQUIRE_THROWS_AS(compose(store, {1}, at(-1)), logic_error);
    REQUIRE(snapshot(ec, store) == s0);
  }
  SECTION("a fact erased (or replaced by a shorter one) after compose: add refuses")
  {
    composition const plan = compose(store, {1, 2}, at(0));
    store.erase(2);
    state const s0 = snapshot(ec, store);
    injection_batch batch(store);
    REQUIRE_THROWS_WITH(batch.add(plan, eight), Contains("unknown fact id 2"));
    REQUIRE(batch.num_tokens() == 0);
    REQUIRE(batch.num_requests() == 0);
    REQUIRE(batch.max_slot() == -1);
    REQUIRE(snapshot(ec, store) == s0);

    fact_data const shorter(2, L, 1, H, D, 3);
    shorter.insert_into(store);
    state const s1 = snapshot(ec, store);
    injection_batch again(store);
    REQUIRE_THROWS_WITH(again.add(plan, eight), Contains("reads offset 1 of fact 2"));
    REQUIRE(again.num_tokens() == 0);
    REQUIRE(snapshot(ec, store) == s1);
  }
  SECTION("a plan longer than its slots: slot mapping or block table too short")
  {
    state const s0         = snapshot(ec, store);
    composition const plan = compose(store, {1, 2}, at(0));  // 8 tokens
    injection_batch batch(store);
    REQUIRE_THROWS_WITH(batch.add(plan, std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6}),
                        Contains("only 7 slots"));
    std::int32_t const table[] = {0, 1};
    // Prompt tokens 1 .. 8 need 3 blocks of 4.
    REQUIRE_THROWS_WITH(batch.add(plan, cache, table, 1), Contains("the table has 2"));
    REQUIRE(batch.num_tokens() == 0);
    REQUIRE(batch.num_requests() == 0);
    // The same table from token 0 fits, and the batch is still usable.
    batch.add(plan, cache, table, 0);  // the cache's own block size, 4
    REQUIRE(batch.num_tokens() == 8);
    REQUIRE(batch.slots() == eight);
    REQUIRE(snapshot(ec, store) == s0);
  }
  SECTION("a slot beyond the cache: inject refuses")
  {
    state const s0 = snapshot(ec, store);
    injection_batch batch(store);
    batch.add(compose(store, {2}), std::vector<std::int64_t>{15, 16, -1});
    REQUIRE(batch.max_slot() == 16);
    REQUIRE_THROWS_WITH(batch.run(cache, params), Contains("beyond the cache"));
    REQUIRE(snapshot(ec, store) == s0);
  }
  SECTION("a slot written twice in one batch: add refuses, the batch is unchanged")
  {
    state const s0 = snapshot(ec, store);
    injection_batch batch(store);
    REQUIRE_THROWS_WITH(
      batch.add(compose(store, {1, 2}, at(0)), std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 6}),
      Contains("slot 6 is written twice"));
    REQUIRE(batch.num_tokens() == 0);
    batch.add(compose(store, {1}), std::vector<std::int64_t>{0, 1, -1, 3, 4});
    REQUIRE_THROWS_WITH(batch.add(compose(store, {2}), std::vector<std::int64_t>{8, 9, 3}),
                        Contains("slot 3 is written twice"));
    REQUIRE(batch.num_tokens() == 5);
    REQUIRE(batch.num_requests() == 1);
    REQUIRE(batch.max_slot() == 4);
    // Skipped tokens may repeat -1.
    REQUIRE_NOTHROW(batch.add(compose(store, {2}), std::vector<std::int64_t>{-1, 9, -1}));
    REQUIRE(snapshot(ec, store) == s0);
  }
  SECTION("geometry mismatch between the store shard and the cache")
  {
    injection_batch batch(store);
    batch.add(compose(store, {1}), std::vector<std::int64_t>{0, 1, 2, 3, 4});
    engine_cache<bfloat16_t> heads3(engine_layout::vllm_flash_attn_nhd, L, 4, 4, 3, D);
    engine_cache<bfloat16_t> layers1(engine_layout::vllm_flash_attn_nhd, 1, 4, 4, H, D);
    engine_cache<bfloat16_t> dim32(engine_layout::vllm_flash_attn_nhd, L, 4, 4, H, 32);
    for (auto* other : {&heads3, &layers1, &dim32}) {
      other->fill_random(4);
      state const s0 = snapshot(*other, store);
      REQUIRE_THROWS_WITH(batch.run(describe_cache(*other), params), Contains("geometry mismatch"));
      REQUIRE(snapshot(*other, store) == s0);
    }
  }
  SECTION("a rotation for another head_dim, or a malformed one")
  {
    state const s0 = snapshot(ec, store);
    injection_batch batch(store);
    batch.add(compose(store, {1}), std::vector<std::int64_t>{0, 1, 2, 3, 4});
    ref_rope const wide{32, 32, 10000.0, false, true};
    REQUIRE_THROWS_WITH(batch.run(cache, wide.params()),
                        Contains("the rotation's head_dim 32 differs"));
    rope_params odd = params;
    odd.rotary_dim  = 18;  // more than head_dim 16
    REQUIRE_THROWS_WITH(batch.run(cache, odd), Contains("rotary_dim"));
    odd.rotary_dim = 7;
    REQUIRE_THROWS_WITH(batch.run(cache, odd), Contains("rotary_dim"));
    REQUIRE(snapshot(ec, store) == s0);
  }
  SECTION("a batch built before the store changed")
  {
    injection_batch batch(store);
    batch.add(compose(store, {1}), std::vector<std::int64_t>{0, 1, 2, 3, 4});
    fact_data const f3(3, L, 2, H, D, 3);
    f3.insert_into(store);
    state const s0 = snapshot(ec, store);
    REQUIRE_THROWS_WITH(batch.run(cache, params), Contains("the store changed"));
    REQUIRE_THROWS_WITH(batch.add(compose(store, {3}), std::vector<std::int64_t>{9, 10}),
                        Contains("the store changed"));
    REQUIRE(snapshot(ec, store) == s0);
    // Erasing is a change too, even of a fact the batch does not read.
    injection_batch fresh(store);
    fresh.add(compose(store, {1}), std::vector<std::int64_t>{0, 1, 2, 3, 4});
    store.erase(3);
    state const s1 = snapshot(ec, store);
    REQUIRE_THROWS_WITH(fresh.run(cache, params), Contains("the store changed"));
    REQUIRE(snapshot(ec, store) == s1);
  }
  SECTION("extraction: negative or out-of-range slot, existing id, exhausted capacity, counts")
  {
    std::vector<std::int32_t> const two{5, 6};
    state const s0 = snapshot(ec, store);
    REQUIRE_THROWS_WITH(extract_host(cache, {3, -1}, 0, params, store, 50, 0, two),
                        Contains("slot -1 of token 1 is outside"));
    REQUIRE_THROWS_WITH(extract_host(cache, {16, 0}, 0, params, store, 50, 0, two),
                        Contains("slot 16 of token 0 is outside"));
    REQUIRE_THROWS_WITH(extract_host(cache, {3, 4}, 0, params, store, 1, 0, two),
                        Contains("already stored"));
    REQUIRE_THROWS_WITH(extract_host(cache, {3, 4, 5}, 0, params, store, 50, 0, two),
                        Contains("3 slots for 2 token ids"));
    REQUIRE_THROWS_WITH(extract_host(cache, {}, 0, params, store, 50, 0, {}),
                        Contains("no tokens"));
    REQUIRE_THROWS_AS(extract_host(cache, {3, 4}, -1, params, store, 50, 0, two), logic_error);
    REQUIRE(snapshot(ec, store) == s0);
    // 6 pages of 4: facts 1 and 2 hold 3, a 12-token fact the other 3.
    fact_data const big(4, L, 12, H, D, 4);
    big.insert_into(store);
    REQUIRE(store.free_pages() == 0);
    state const s1 = snapshot(ec, store);
    REQUIRE_THROWS_WITH(extract_host(cache, {3, 4}, 0, params, store, 50, 0, two),
                        Contains("capacity exhausted"));
    REQUIRE(snapshot(ec, store) == s1);
    REQUIRE_FALSE(store.contains(50));
  }
}

// ------------------------------------------------------------------------------------------------
// g. A sharded store injects into a rank's cache

TEST_CASE("a store holding a layer and head shard fills the rank's cache", "[inject]")
{
  auto const layout = GENERATE(engine_layout::vllm_flash_attn_separate,
                               engine_layout::tensorrt_llm_pool,
                               engine_layout::vllm_legacy);
  CAPTURE(to_string(layout));
  int const ML = 4, MH = 5, D = 16;
  kv_store_config c{};
  c.model       = kv_geometry{ML, MH, D};
  c.first_layer = 1;
  c.num_layers  = 2;
  c.first_head  = 2;
  c.num_heads   = 2;
  c.store_dtype = dtype::float32;
  c.page_size   = 2;
  c.num_pages   = 8;
  c.space       = memory_space::host;
  kv_store store{c};
  REQUIRE(store.geometry() == (kv_geometry{2, 2, D}));

  fact_data const whole(1, ML, 3, MH, D, 31);  // the model's views: the store takes its shard
  fact_data const shard(2, 2, 5, 2, D, 32);    // exactly the shard's views
  whole.insert_into(store);
  shard.insert_into(store);
  fact_data const wrong(3, 3, 2, MH, D, 33);  // 3 layers: neither the model's 4 nor the shard's 2
  REQUIRE_THROWS_WITH(wrong.insert_into(store), Contains("3 layers"));

  ref_rope const rope{D, D, 10000.0, true, true};
  engine_cache<float> ec(layout, 2, 4, 4, 2, D);
  ec.fill_random(12);
  auto const before = storage_bytes(ec);
  injection_batch batch(store);
  batch.add(compose(store, {1, 2}, at(11)), std::vector<std::int64_t>{15, 0, 1, 2, 3, 4, 5, 6});
  batch.run(describe_cache(ec), rope.params());

  std::vector<placed_token> writes;
  std::int64_t const whole_slots[] = {15, 0, 1};
  for (int j = 0; j < 3; ++j) {
    // The store's layer 0 is the model's layer 1, its head 0 the model's head 2.
    writes.push_back({&whole, j, whole_slots[j], 11 + j, 1, 2});
  }
  place(writes, shard, 0, 5, 14, {2, 3, 4, 5, 6});
  check_cache(ec, before, writes, rope, dtype::float32);

  // The model-sized cache is not this rank's.
  engine_cache<float> full(layout, ML, 4, 4, MH, D);
  full.fill_random(12);
  std::uint64_t const h = full.hash();
  REQUIRE_THROWS_WITH(batch.run(describe_cache(full), rope.params()),
                      Contains("geometry mismatch"));
  REQUIRE(full.hash() == h);
}

TEST_CASE("a batch reused across steps: clear() forgets the step, refused adds hold no slots",
          "[inject]")
{
  int const L = 1, H = 1, D = 8;
  kv_store store = make_host_store(L, H, D, dtype::float32, 4, 8);
  fact_data const f1(1, L, 5, H, D, 1), f2(2, L, 3, H, D, 2);
  f1.insert_into(store);
  f2.insert_into(store);
  composition const plan = compose(store, {1, 2}, at(0));  // 8 tokens

  injection_batch batch(store);
  batch.reserve(64);
  batch.add(plan, std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
  REQUIRE(batch.num_tokens() == 8);
  REQUIRE(batch.max_slot() == 7);
  // The same slots again in the same step: refused.
  REQUIRE_THROWS_WITH(batch.add(plan, std::vector<std::int64_t>{8, 9, 10, 11, 12, 13, 14, 7}),
                      Contains("slot 7 is written twice"));
  // That refused request held none of its slots: 8 .. 14 are still free in this step.
  batch.add(plan, std::vector<std::int64_t>{8, 9, 10, 11, 12, 13, 14, 15});
  REQUIRE(batch.num_tokens() == 16);
  REQUIRE(batch.num_requests() == 2);
  // A slot repeated inside one request: refused, and its earlier slots are not held either.
  REQUIRE_THROWS_WITH(batch.add(plan, std::vector<std::int64_t>{20, 21, 22, 20, 24, 25, 26, 27}),
                      Contains("slot 20 is written twice"));
  batch.add(plan, std::vector<std::int64_t>{20, 21, 22, 23, 24, 25, 26, 27});
  REQUIRE(batch.num_tokens() == 24);

  // Next step: the store changed (a fact was added), so the old contents are stale; clear()
  // empties the batch and ties it to the new state, and last step's slots are free again.
  fact_data const f3(3, L, 2, H, D, 3);
  f3.insert_into(store);
  REQUIRE_THROWS_WITH(batch.add(plan, std::vector<std::int64_t>{30, 31, 32, 33, 34, 35, 36, 37}),
                      Contains("store changed"));
  batch.clear();
  REQUIRE(batch.num_tokens() == 0);
  REQUIRE(batch.num_requests() == 0);
  REQUIRE(batch.max_slot() == -1);
  REQUIRE(batch.max_position() == -1);
  composition const plan2 = compose(store, {3, 1}, at(0));  // 7 tokens
  batch.add(plan2, std::vector<std::int64_t>{7, 6, 5, 4, 3, 2, 1});
  REQUIRE(batch.num_tokens() == 7);
  REQUIRE(batch.slots() == std::vector<std::int64_t>{7, 6, 5, 4, 3, 2, 1});
  REQUIRE(batch.positions() == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6});
  // Slots at and above the bitmap's range (2^28) are tracked too.
  std::int64_t const big = std::int64_t{1} << 40;
  batch.add(plan, std::vector<std::int64_t>{big, big + 1, -1, -1, big + 2, 0, 8, 9});
  REQUIRE_THROWS_WITH(
    batch.add(plan, std::vector<std::int64_t>{big + 1, 100, 101, 102, 103, 104, 105, 106}),
    Contains("is written twice"));
  REQUIRE(batch.max_slot() == big + 2);
  REQUIRE(batch.num_requests() == 2);
}

// ------------------------------------------------------------------------------------------------
// h. The injection step: slots three ways (a span, a block table, a cache adapter), one run

namespace {
/// A paged-cache adapter (engine.hpp) over a test cache: hands out the slots it was given and
/// records what the step asks of it.
struct recording_adapter {
  paged_kv_cache desc;
  std::vector<std::int64_t> slots;  // what allocate() returns
  std::int64_t allocations{0};
  std::int64_t commits{0};
  std::int64_t committed_tokens{0};
  std::vector<std::int64_t> released{};  // release(m) calls, in order

  std::vector<std::int64_t> allocate(std::int64_t, std::int64_t)
  {
    ++allocations;
    return slots;
  }
  paged_kv_cache const& cache() const { return desc; }
  void commit(std::int64_t tokens)
  {
    ++commits;
    committed_tokens += tokens;
  }
  void release(std::int64_t tokens) noexcept { released.push_back(tokens); }
};
static_assert(is_cache_adapter_v<recording_adapter>);
}  // namespace

TEST_CASE("an injection step planned three ways runs on the host as the reference path", "[inject]")
{
  int const L = 2, H = 2, D = 16;
  ref_rope const rope{D, D, 10000.0, false, true};
  auto const params = rope.params();
  kv_store store    = make_host_store(L, H, D, dtype::float32, 4, 8);
  fact_data const f1(1, L, 5, H, D, 11), f2(2, L, 3, H, D, 12), f3(3, L, 4, H, D, 13);
  for (auto const* f : {&f1, &f2, &f3}) {
    f->insert_into(store);
  }
  // Two identical caches of 8 blocks of 4 (32 slots): the step writes one, the reference the other.
  engine_cache<bfloat16_t> a(engine_layout::vllm_flash_attn_nhd, L, 8, 4, H, D);
  engine_cache<bfloat16_t> b(engine_layout::vllm_flash_attn_nhd, L, 8, 4, H, D);
  a.fill_random(5);
  b.fill_random(5);
  auto const before = storage_bytes(a);
  REQUIRE(before == storage_bytes(b));
  paged_kv_cache const desc_a = describe_cache(a), desc_b = describe_cache(b);

  composition const r0 = compose(store, {1}, at(0));      // 5 tokens
  composition const r1 = compose(store, {2, 3}, at(40));  // 7 tokens
  composition const r2 = compose(store, {3}, at(100));    // 4 tokens
  std::vector<std::int64_t> const s0{3, -1, 17, 18, 19};
  std::int32_t const table[] = {5, 2};
  // Prompt tokens 1 .. 7 of the table {5, 2} in blocks of 4 (the cache's): 5*4+1 .. 5*4+3, then
  // 2*4+0 .. 2*4+3.
  std::vector<std::int64_t> const s1{21, 22, 23, 8, 9, 10, 11};
  recording_adapter adapter{desc_a, {28, 29, 30, 31}};

  injection_batch step(store);
  step.add(r0, s0);
  step.add(r1, desc_a, table, 1);
  step.add(r2, adapter);
  REQUIRE(step.num_requests() == 3);
  REQUIRE(step.slots() ==
          (std::vector<std::int64_t>{3, -1, 17, 18, 19, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31}));
  REQUIRE(adapter.allocations == 1);
  REQUIRE(adapter.commits == 0);  // planned, not run: nothing adopted yet
  REQUIRE(step.num_pending_commits() == 1);

  SECTION("the run writes what the reference path writes, byte for byte, then commits")
  {
    step.run(desc_a, params);
    REQUIRE(adapter.commits == 1);
    REQUIRE(adapter.committed_tokens == 4);
    REQUIRE(step.num_pending_commits() == 0);

    // Independent expectation: every token at its hand-written slot and position.
    std::vector<placed_token> writes;
    place(writes, f1, 0, 5, 0, s0);
    place(writes, f2, 0, 3, 40, {s1.begin(), s1.begin() + 3});
    place(writes, f3, 0, 4, 43, {s1.begin() + 3, s1.end()});
    place(writes, f3, 0, 4, 100, {28, 29, 30, 31});
    REQUIRE(writes.size() == 4 + 7 + 4);
    check_cache(a, before, writes, rope, dtype::float32);

    // The reference path: one explicit slot mapping per request, run into b.
    injection_batch reference(store);
    reference.add(r0, s0);
    reference.add(r1, s1);
    reference.add(r2, std::vector<std::int64_t>{28, 29, 30, 31});
    reference.run(desc_b, params);
    REQUIRE(storage_bytes(a) == storage_bytes(b));

    // A second run rewrites the same bytes and commits nothing more.
    step.run(desc_a, params);
    REQUIRE(storage_bytes(a) == storage_bytes(b));
    REQUIRE(adapter.commits == 1);
  }
  SECTION("refused adds change neither the step, the store, the cache nor the adapter")
  {
    state const sa = snapshot(a, store);
    // Another cache's block table: the step targets a's.
    REQUIRE_THROWS_WITH(step.add(compose(store, {2}, at(7)), desc_b, table, 0),
                        Contains("targets another cache"));
    // An adapter over another cache: refused before it allocates.
    recording_adapter other{desc_b, {0, 1, 2}};
    REQUIRE_THROWS_WITH(step.add(compose(store, {2}, at(7)), other),
                        Contains("targets another cache"));
    REQUIRE(other.allocations == 0);
    // An adapter that allocates the wrong count, and one whose slot is already taken.
    recording_adapter short_one{desc_a, {0, 1}};
    REQUIRE_THROWS_WITH(step.add(compose(store, {2}, at(7)), short_one),
                        Contains("allocated 2 slots for 3 tokens"));
    recording_adapter taken{desc_a, {0, 1, 29}};
    REQUIRE_THROWS_WITH(step.add(compose(store, {2}, at(7)), taken),
                        Contains("slot 29 is written twice"));
    // An empty plan through an adapter: nothing to allocate.
    composition empty;
    REQUIRE_THROWS_WITH(step.add(empty, taken), Contains("the plan is empty"));
    REQUIRE(taken.allocations == 1);
    // Each adapter refused after its allocate() got its 3 slots back; the step's own is untouched.
    REQUIRE(other.released.empty());
    REQUIRE(short_one.released == std::vector<std::int64_t>{3});
    REQUIRE(taken.released == std::vector<std::int64_t>{3});
    REQUIRE(adapter.released.empty());
    REQUIRE(step.num_requests() == 3);
    REQUIRE(step.num_tokens() == 16);
    REQUIRE(step.num_pending_commits() == 1);
    REQUIRE(short_one.commits + taken.commits + other.commits == 0);
    REQUIRE(snapshot(a, store) == sa);
    // The step still runs as planned.
    step.run(desc_a, params);
    REQUIRE(adapter.commits == 1);
    std::vector<placed_token> writes;
    place(writes, f1, 0, 5, 0, s0);
    place(writes, f2, 0, 3, 40, {s1.begin(), s1.begin() + 3});
    place(writes, f3, 0, 4, 43, {s1.begin() + 3, s1.end()});
    place(writes, f3, 0, 4, 100, {28, 29, 30, 31});
    check_cache(a, before, writes, rope, dtype::float32);
  }
  SECTION("a refused run writes nothing, commits nothing and gives the adapter's slots back")
  {
    state const sa = snapshot(a, store), sb = snapshot(b, store);
    // Another cache than the one the block table and the adapter name.
    REQUIRE_THROWS_WITH(step.run(desc_b, params), Contains("targets another cache"));
    REQUIRE(snapshot(a, store) == sa);
    REQUIRE(snapshot(b, store) == sb);
    REQUIRE(adapter.commits == 0);
    // The adapter's 4 slots are released once, and the step, whose tokens named them, is empty.
    REQUIRE(adapter.released == std::vector<std::int64_t>{4});
    REQUIRE(step.num_pending_commits() == 0);
    REQUIRE(step.num_requests() == 0);
    REQUIRE(step.num_tokens() == 0);

    // A step without adapters, refused (a rotation for another head_dim), is kept as planned.
    ref_rope const wide{2 * D, 2 * D, 10000.0, false, true};
    step.add(r0, s0);
    REQUIRE_THROWS_AS(step.run(desc_a, wide.params()), logic_error);
    REQUIRE(snapshot(a, store) == sa);
    REQUIRE(step.num_tokens() == 5);
    // Planned again with an adapter: the store changed since, refused; released again.
    step.add(r2, adapter);
    REQUIRE(adapter.allocations == 2);
    fact_data const f9(9, L, 2, H, D, 19);
    f9.insert_into(store);
    state const changed = snapshot(a, store);
    REQUIRE_THROWS_WITH(step.run(desc_a, params), Contains("the store changed"));
    REQUIRE(snapshot(a, store) == changed);
    REQUIRE(adapter.commits == 0);
    REQUIRE(adapter.released == (std::vector<std::int64_t>{4, 4}));
    REQUIRE(step.num_pending_commits() == 0);
    // The emptied step targets no cache: it runs into b now.
    step.add(compose(store, {9}, at(3)), std::vector<std::int64_t>{6, 7});
    step.run(desc_b, params);
    REQUIRE(adapter.commits == 0);
    std::vector<placed_token> writes;
    place(writes, f9, 0, 2, 3, {6, 7});
    check_cache(b, before, writes, rope, dtype::float32);
  }
}

TEST_CASE(
  "rope_params' max_position bounds injection: refused beyond it unless opted in, "
  "rope_position_limit always; nothing is written or allocated",
  "[inject][positions]")
{
  int const L = 2, H = 2, D = 16, m = 4;
  ref_rope const rope{D, D, 10000.0, false, true};
  rope_params ranged              = rope.params();
  ranged.max_position             = 100;  // the model's range: positions 0 .. 99
  rope_params opted               = ranged;
  opted.allow_beyond_max_position = true;
  kv_store store                  = make_host_store(L, H, D, dtype::float32, 4, 8);
  fact_data const f3(3, L, m, H, D, 13);
  f3.insert_into(store);
  engine_cache<bfloat16_t> c(engine_layout::vllm_flash_attn_nhd, L, 8, 4, H, D);
  c.fill_random(5);
  auto const before         = storage_bytes(c);
  paged_kv_cache const desc = describe_cache(c);
  std::vector<std::int64_t> const slots{4, 5, 6, 7};

  SECTION("the last allowed position is accepted and written where the rotation says")
  {
    injection_batch step(store);
    step.add(compose(store, {3}, at(100 - m)), slots);  // positions 96 .. 99
    REQUIRE_NOTHROW(step.run(desc, ranged));
    std::vector<placed_token> writes;
    place(writes, f3, 0, m, 100 - m, slots);
    check_cache(c, before, writes, rope, dtype::float32);
  }
  SECTION("the next is refused naming the position and the range; store and cache unchanged")
  {
    state const s0 = snapshot(c, store);
    injection_batch step(store);
    step.add(compose(store, {3}, at(100 - m + 1)), slots);  // positions 97 .. 100
    REQUIRE_THROWS_WITH(step.run(desc, ranged),
                        Contains("position 100 is beyond the model's range (max_position 100") &&
                          Contains("allow_beyond_max_position") &&
                          Contains("positions must be in [0, 100)"));
    REQUIRE(snapshot(c, store) == s0);
    REQUIRE(storage_bytes(c) == before);
    // p0 = 10^9 for the same model: refused the same way
    injection_batch far(store);
    far.add(compose(store, {3}, at(1000000000)), slots);
    REQUIRE_THROWS_WITH(far.run(desc, ranged),
                        Contains("position 1000000003 is beyond the model's range"));
    REQUIRE(storage_bytes(c) == before);
    // the opt-in accepts it, and writes what an unranged rotation writes
    REQUIRE_NOTHROW(far.run(desc, opted));
    std::vector<placed_token> writes;
    place(writes, f3, 0, m, 1000000000, slots);
    check_cache(c, before, writes, rope, dtype::float32);
  }
  SECTION("through a cache adapter: rope_check_positions refuses before it allocates; run after")
  {
    recording_adapter adapter{desc, slots};
    composition const plan = compose(store, {3}, at(100 - m + 1));
    REQUIRE_THROWS_WITH(
      rope_check_positions(ranged, plan.first_position, plan.length(), "inject"),
      Contains("inject: position 97 + 3 = 100 is beyond the model's range (max_position 100"));
    REQUIRE(adapter.allocations == 0);
    injection_batch step(store);
    step.add(plan, adapter);
    REQUIRE(adapter.allocations == 1);
    REQUIRE_THROWS_WITH(step.run(desc, ranged), Contains("position 100 is beyond"));
    REQUIRE(adapter.commits == 0);
    REQUIRE(adapter.released == std::vector<std::int64_t>{m});  // its slots given back
    REQUIRE(step.num_pending_commits() == 0);
    REQUIRE(storage_bytes(c) == before);
  }
  SECTION("near INT64_MAX: refused by add whatever the opt-in, before the adapter allocates")
  {
    composition plan = compose(store, {3}, at(0));
    recording_adapter adapter{desc, slots};
    for (std::int64_t p0 : {std::int64_t{1} << 53,
                            (std::int64_t{1} << 53) - m + 1,
                            std::numeric_limits<std::int64_t>::max() - 1}) {
      CAPTURE(p0);
      plan.first_position = p0;  // a hand-built plan: compose refuses these itself
      injection_batch step(store);
      REQUIRE_THROWS_WITH(step.add(plan, slots), Contains("below rope_position_limit"));
      REQUIRE_THROWS_WITH(step.add(plan, adapter), Contains("below rope_position_limit"));
      REQUIRE(adapter.allocations == 0);
      REQUIRE(step.num_tokens() == 0);
      REQUIRE_THROWS_WITH(rope_check_positions(opted, p0, m), Contains("rope_position_limit"));
    }
    REQUIRE(storage_bytes(c) == before);
  }
}

// ------------------------------------------------------------------------------------------------
// The smallest and degenerate shapes (issue 49's sweep)

TEMPLATE_TEST_CASE(
  "degenerate shapes - one layer, one head, head_dim off the 16-byte run, blocks "
  "of one token, one-token facts - inject and extract as brute force says",
  "[inject][degenerate]",
  float,
  half_t,
  bfloat16_t)
{
  using T = TestType;
  struct shape {
    char const* name;
    int layers, heads, head_dim, rotary_dim;
    bool interleaved;
  };
  shape const s         = GENERATE(values<shape>({{"1 layer, 1 head, d2", 1, 1, 2, 2, false},
                                                  {"1 layer, 1 head, d6 halves", 1, 1, 6, 6, false},
                                                  {"1 layer, 1 head, d6 interleaved", 1, 1, 6, 6, true},
                                                  {"d36 (not a whole 16-byte run)", 1, 1, 36, 36, false},
                                                  {"2 layers, d20, rotary 12", 2, 1, 20, 12, true},
                                                  {"3 heads, d10", 1, 3, 10, 10, false}}));
  auto const layout     = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  int const block       = GENERATE(1, 16);
  std::int64_t const p0 = GENERATE(as<std::int64_t>{}, 0, 4093);
  int const run         = 16 / static_cast<int>(sizeof(T));
  CAPTURE(sizeof(T), s.name, to_string(layout), block, p0);
  if (layout == engine_layout::vllm_legacy && s.head_dim % run != 0) {
    return;  // vLLM's legacy key layout splits head_dim into runs of x: it has no such cache
  }
  ref_rope const rope{s.head_dim, s.rotary_dim, 10000.0, s.interleaved, true};
  kv_store store = make_host_store(s.layers, s.heads, s.head_dim, dtype::float32, 1, 8);
  fact_data const one(3, s.layers, 1, s.heads, s.head_dim, 303);  // a fact of one token
  fact_data const two(4, s.layers, 2, s.heads, s.head_dim, 404);
  one.insert_into(store);
  two.insert_into(store);
  std::int64_t const blocks = 8 * 16 / block;  // 8 x 16 slots either way
  engine_cache<T> ec(layout, s.layers, blocks, block, s.heads, s.head_dim);
  ec.fill_random(5);
  auto const before = storage_bytes(ec);
  // a one-token batch, then one of both facts in scattered slots (the last slot included)
  std::vector<std::int64_t> const lone{77};
  std::vector<std::int64_t> const slots{8 * 16 - 1, 0, 33};
  injection_batch batch(store);
  batch.add(compose(store, {3}, at(p0)), lone);
  batch.add(compose(store, {4, 3}, at(p0 + 1)), slots);
  batch.run(describe_cache(ec), rope.params());
  std::vector<placed_token> writes;
  place(writes, one, 0, 1, p0, lone);
  place(writes, two, 0, 2, p0 + 1, {slots[0], slots[1]});
  place(writes, one, 0, 1, p0 + 3, {slots[2]});
  check_cache(ec, before, writes, rope, dtype::float32);

  // Extracting the lone token back gives the pre-RoPE fact to the cache's rounding: the inverse
  // rotation of a key within half an ulp of T, the value exactly converted.
  extract_host(describe_cache(ec), lone, p0, rope.params(), store, 99, 1, one.token_ids);
  auto const pool   = store.pool_to_host();
  double const unit = std::is_same_v<T, float> ? 16 * eps32 : 1.0 / 256;
  for (int l = 0; l < s.layers; ++l) {
    for (int h = 0; h < s.heads; ++h) {
      double norm = 0;
      for (int d = 0; d < s.head_dim; ++d) {
        norm = std::max(norm, std::fabs(double(one.key(l, 0, h, d))));
      }
      for (int d = 0; d < s.head_dim; ++d) {
        CAPTURE(l, h, d);
        REQUIRE(std::fabs(read_store(store, pool, 99, 0, l, 0, h, d) - one.key(l, 0, h, d)) <=
                unit * 2 * norm);
        REQUIRE(read_store(store, pool, 99, 1, l, 0, h, d) == round_to<T>(one.value(l, 0, h, d)));
      }
    }
  }
}
