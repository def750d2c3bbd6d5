// The device kernels' code run on the CPU: inject_kernel's two phases (prepare, work) and
// extract_kernel's units are __host__ __device__ functions, and make_inject_launch resolves a
// launch without any CUDA call. Emulating every block and thread of that launch on the host, with
// the same arguments the device would get, tests the kernel's tiling, unit indexing, vectorized
// and scalar paths against the host backend (the host run, extract_host) on machines without a GPU.
// Both sides compute cos/sin with the same host functions, so the results must agree bit for bit.
// A plain C++ unit: the block code (detail/inject/block.hpp) needs no CUDA compiler.

#include "engine_cache_descriptor.hpp"
#include "engine_caches.hpp"
#include "inject_common.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/detail/inject/block.hpp>
#include <inferscale/detail/rope/position.hpp>
#include <inferscale/extract.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/rope_layers.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace inferscale;
using inferscale_test::engine_cache;
using inferscale_test::engine_layout;
using inferscale_test::fact_data;
using bytes  = std::vector<unsigned char>;
using policy = detail::inject_policy_sm90;

/// Runs every block and thread of an inject_kernel launch on the CPU: phase 1 for all threads of
/// a block, then phase 2 (the kernel's __syncthreads between them).
template <class StoreT, class CacheT, bool Vectorized, class Rotation>
void emulate_blocks(detail::inject_launch_config<Rotation> const& config)
{
  using block = detail::inject_block<policy, StoreT, CacheT, Rotation, Vectorized>;
  std::vector<rope_cos_sin> cos_sin(
    std::max<std::size_t>(config.shared_bytes / sizeof(rope_cos_sin), 1));
  std::int64_t slot[policy::tile_tokens], blk[policy::tile_tokens], source[policy::tile_tokens];
  std::int32_t in_block[policy::tile_tokens];
  detail::inject_tile_state const tile{cos_sin.data(), slot, blk, in_block, source};
  for (std::int64_t bx = 0; bx < config.grid_x; ++bx) {
    for (std::int32_t by = 0; by < config.grid_y; ++by) {
      for (std::int32_t t = 0; t < policy::block_threads; ++t) {
        block::prepare(config.args, bx, by, t, policy::block_threads, tile);
      }
      for (std::int32_t t = 0; t < policy::block_threads; ++t) {
        block::work(config.args, bx, by, t, policy::block_threads, tile);
      }
    }
  }
}

/// Emulates the device launch's configuration (detail::inject_view_async) for a host store and a
/// host cache on a GPU with `sm_count` SMs; returns whether the vectorized path was taken.
template <class StoreT, class CacheT, class Rotation>
bool emulate_inject(kv_store const& store,
                    injection_batch const& batch,
                    paged_kv_cache const& cache,
                    Rotation const& rotation,
                    int sm_count)
{
  auto const config = detail::make_inject_launch<StoreT, CacheT>(
    store.ref(), batch.host_view(), cache, rotation, sm_count);
  if (batch.num_tokens() == 0) { return config.vectorized; }
  if (config.vectorized) {
    emulate_blocks<StoreT, CacheT, true>(config);
  } else {
    emulate_blocks<StoreT, CacheT, false>(config);
  }
  return config.vectorized;
}

using inferscale_test::bf16_to_bf16;
using inferscale_test::bf16_to_e4m3;
using inferscale_test::bf16_to_fp32;
using inferscale_test::fp16_to_fp16;
using inferscale_test::fp32_to_e5m2;
using inferscale_test::fp32_to_fp32;

struct shape_case {
  char const* name;
  int layers, heads, head_dim, rotary_dim;
  rope_pairing pairing;
  std::int64_t blocks;  // engine blocks (block size 16)
};

/// Geometries that take each path: 16-byte runs for both pairings, partial rotary with
/// pass-through dims, a rotary half that does not split into runs (scalar path), many layers.
std::vector<shape_case> shape_cases()
{
  return {{"d128 halves", 3, 2, 128, 128, rope_pairing::halves, 12},
          {"d64 interleaved", 2, 3, 64, 64, rope_pairing::interleaved, 12},
          {"d128 interleaved, rotary 64", 3, 1, 128, 64, rope_pairing::interleaved, 12},
          {"d64 halves, rotary 34 (scalar)", 2, 2, 64, 34, rope_pairing::halves, 12},
          {"d96 halves (Phi-3.5)", 2, 1, 96, 96, rope_pairing::halves, 12},
          {"10 layers", 10, 2, 64, 64, rope_pairing::halves, 12}};
}

constexpr std::int32_t block_size = 16;

/// Facts of odd lengths over pages of 8 tokens, one erased so later facts reuse its pages.
std::vector<fact_data> make_facts(shape_case const& s)
{
  std::vector<fact_data> facts;
  std::int32_t const lengths[] = {6, 7, 13, 1, 21, 5, 9, 17};
  std::uint64_t id             = 1;
  for (std::int32_t c : lengths) {
    facts.emplace_back(id, s.layers, c, s.heads, s.head_dim, 0xface + id);
    ++id;
  }
  return facts;
}

void populate(kv_store& store, std::vector<fact_data> const& facts, shape_case const& s)
{
  fact_data const filler(99, s.layers, 10, s.heads, s.head_dim, 7);
  filler.insert_into(store);
  facts[0].insert_into(store);
  store.erase(99);
  for (std::size_t i = 1; i < facts.size(); ++i) {
    facts[i].insert_into(store);
  }
}

/// Three requests (a block table, an explicit slot mapping with skipped slots, a block table at a
/// larger position) over a 12-block cache.
injection_batch make_batch(kv_store const& store, std::int64_t shift)
{
  injection_batch batch(store);
  {
    compose_options o{};
    o.first_position            = 12 + shift;
    o.order                     = fact_order::best_last;
    o.instruction_prefix        = 1;
    std::int32_t const blocks[] = {7, 2, 5};
    auto const plan             = compose(store, {2, 3, 4}, o);
    batch.add(plan, slots_from_block_table(blocks, 3, block_size, 3, plan.length()));
  }
  {
    compose_options o{};
    o.first_position            = shift;
    o.order                     = fact_order::as_given;
    auto const plan             = compose(store, {5, 6, 7}, o);
    std::int32_t const blocks[] = {9, 0, 11};
    auto slots                  = slots_from_block_table(blocks, 3, block_size, 0, plan.length());
    for (std::size_t j = 1; j < slots.size(); j += 4) {
      slots[j] = -1;
    }
    batch.add(plan, slots);
  }
  {
    compose_options o{};
    o.first_position            = 1500 + shift;
    o.order                     = fact_order::as_given;
    o.instruction_prefix        = 1;
    std::int32_t const blocks[] = {3, 8, 1};
    auto const plan             = compose(store, {8, 3}, o);
    batch.add(plan, slots_from_block_table(blocks, 3, block_size, 5, plan.length()));
  }
  return batch;
}

std::vector<float> make_scales(shape_case const& s, kv_scale_granularity g)
{
  std::int32_t const count = g == kv_scale_granularity::per_head ? s.heads : 1;
  std::vector<float> out;
  for (int l = 0; l < s.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int i = 0; i < count; ++i) {
        out.push_back(0.5f + 0.25f * float((l + 2 * kv + i) % 5));
      }
    }
  }
  return out;
}

template <class Pair>
void set_scales(paged_kv_cache& cache, std::vector<float> const& scales, shape_case const& s)
{
  if (Pair::granularity == kv_scale_granularity::none) { return; }
  std::int32_t const count = Pair::granularity == kv_scale_granularity::per_head ? s.heads : 1;
  std::vector<float const*> k, v;
  for (int l = 0; l < s.layers; ++l) {
    k.push_back(scales.data() + (2 * l) * count);
    v.push_back(scales.data() + (2 * l + 1) * count);
  }
  cache.set_fp8_scales(Pair::convention, Pair::granularity, k, v);
}

template <class C>
bytes storage_of(engine_cache<C> const& cache)
{
  auto const* p = reinterpret_cast<unsigned char const*>(cache.storage());
  return bytes(p, p + cache.storage_bytes());
}

rope_params make_params(shape_case const& s, double theta = 10000.0)
{
  rope_spec spec{};
  spec.head_dim   = s.head_dim;
  spec.rotary_dim = s.rotary_dim;
  spec.theta      = theta;
  spec.pairing    = s.pairing;
  return make_rope_params(spec);
}

/// True if the kernel should take 16-byte runs: the rotary half (halves) or the rotary dims
/// (interleaved) split into whole runs of 16 bytes of the store dtype, and the cache's dims are
/// contiguous (vLLM legacy's value is token-fastest, so its launch is scalar).
template <class S>
bool expect_vectorized(shape_case const& s, engine_layout layout)
{
  int const run = 16 / static_cast<int>(sizeof(S));
  bool const fits =
    s.pairing == rope_pairing::halves ? (s.rotary_dim / 2) % run == 0 : s.rotary_dim % run == 0;
  return fits && s.rotary_dim % run == 0 && s.head_dim % run == 0 &&
         layout != engine_layout::vllm_legacy && layout != engine_layout::vllm_cpu;
}

template <class Pair, class Rotation>
void check_inject(engine_layout layout,
                  shape_case const& s,
                  kv_store const& store,
                  Rotation const& rotation,
                  int sm_count)
{
  using S = typename Pair::store_t;
  using C = typename Pair::cache_t;
  engine_cache<C> by_host(layout, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  engine_cache<C> by_kernel(layout, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  by_host.fill_random(42);
  by_kernel.fill_random(42);
  bytes const original     = storage_of(by_host);
  auto const scales        = make_scales(s, Pair::granularity);
  paged_kv_cache host_desc = inferscale_test::describe_engine_cache(by_host, by_host.storage());
  paged_kv_cache kernel_desc =
    inferscale_test::describe_engine_cache(by_kernel, by_kernel.storage());
  set_scales<Pair>(host_desc, scales, s);
  set_scales<Pair>(kernel_desc, scales, s);

  injection_batch batch = make_batch(store, 0);
  batch.run(host_desc, rotation);
  bool const vectorized = emulate_inject<S, C>(store, batch, kernel_desc, rotation, sm_count);
  CAPTURE(vectorized, batch.num_tokens());
  REQUIRE(vectorized ==
          (store.compression() == kv_compression::none && expect_vectorized<S>(s, layout)));
  bytes const host = storage_of(by_host);
  REQUIRE(host != original);  // something was written
  bytes const kernel = storage_of(by_kernel);
  auto const m       = std::mismatch(host.begin(), host.end(), kernel.begin());
  CAPTURE(m.first - host.begin());
  REQUIRE(m.first == host.end());
}

template <class Pair>
void check_all(int sm_count, kv_compression compression = kv_compression::none)
{
  using S                = typename Pair::store_t;
  shape_case const s     = GENERATE(from_range(shape_cases()));
  engine_layout const ly = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  CAPTURE(s.name, to_string(ly), sm_count, to_string(compression));
  kv_store_config config{};
  config.model       = kv_geometry{s.layers, s.heads, s.head_dim};
  config.store_dtype = dtype_of_v<S>;
  config.compression = compression;
  config.page_size   = 8;
  config.num_pages   = 32;
  config.space       = memory_space::host;
  kv_store store{config};
  auto const facts = make_facts(s);
  populate(store, facts, s);
  rope_params const params   = make_params(s);
  std::vector<S> const table = make_rope_cos_sin_values<S>(params, 2048);
  SECTION("computed rope_params") { check_inject<Pair>(ly, s, store, params, sm_count); }
  SECTION("engine cos/sin table, vLLM per-operation rounding")
  {
    check_inject<Pair>(
      ly, s, store, make_rope_cos_sin_table(params, table.data(), 2048, true), sm_count);
  }
  SECTION("engine cos/sin table, fused multiply-adds (llama.cpp's CPU rope)")
  {
    auto fused               = make_rope_cos_sin_table(params, table.data(), 2048, false);
    fused.fused_multiply_add = true;
    check_inject<Pair>(ly, s, store, fused, sm_count);
  }
  SECTION("a per-layer rotation: two bases, alternating layers (Gemma's shape)")
  {
    // The tile holds both rotations' cos/sin; layer l reads its own (the host run is checked
    // against single rotations and a double-precision reference in inject_simd_host.cpp).
    rope_params other       = make_params(s, 1000000.0);
    std::vector<S> const t2 = make_rope_cos_sin_values<S>(other, 2048);
    std::vector<std::int32_t> layers(static_cast<std::size_t>(s.layers));
    for (int l = 0; l < s.layers; ++l) {
      layers[static_cast<std::size_t>(l)] = (l % 3 == 2) ? 0 : 1;
    }
    rope_params const both_params[2] = {params, other};
    check_inject<Pair>(ly,
                       s,
                       store,
                       per_layer_rotation<rope_params>{both_params, 2, layers.data(), s.layers},
                       sm_count);
    rope_cos_sin_table<S> both_tables[2] = {
      make_rope_cos_sin_table(params, table.data(), 2048, true),
      make_rope_cos_sin_table(other, t2.data(), 2048, true)};
    check_inject<Pair>(
      ly,
      s,
      store,
      per_layer_rotation<rope_cos_sin_table<S>>{both_tables, 2, layers.data(), s.layers},
      sm_count);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("the inject kernel's code, emulated on the CPU, equals the host run bit for bit",
                   "[inject][emulation]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   fp16_to_fp16,
                   bf16_to_fp32,
                   bf16_to_e4m3,
                   fp32_to_e5m2)
{
  // 132 SMs (H200): few tokens, so layers per block shrink to fill the grid; 1 SM: 8 layers per
  // block (a partial layer tile with 10 layers).
  int const sm_count = GENERATE(132, 1);
  check_all<TestType>(sm_count);
}

TEMPLATE_TEST_CASE("the inject kernel's code dequantizes compressed facts as the host run does",
                   "[inject][emulation][compression]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3)
{
  // The scalar path, dequantizing each element (compression.hpp), bit for bit the host's chunks.
  check_all<TestType>(132, GENERATE(kv_compression::fp8_e4m3, kv_compression::int4));
}

TEST_CASE("make_inject_launch: grid, tiles and units per head", "[inject][emulation]")
{
  shape_case const s{"d128 halves", 32, 8, 128, 128, rope_pairing::halves, 64};
  kv_store store = inferscale_test::make_host_store(32, 8, 128, dtype::bfloat16, 16, 8);
  engine_cache<bfloat16_t> cache(
    engine_layout::vllm_flash_attn_nhd, 32, s.blocks, block_size, 8, 128);
  paged_kv_cache const desc = inferscale_test::describe_engine_cache(cache, cache.storage());
  std::vector<std::int64_t> arrays(3 * 1024, 0);
  injection_batch_view const view{arrays.data(), arrays.data() + 1024, arrays.data() + 2048, 1024};
  auto const c = detail::make_inject_launch<bfloat16_t, bfloat16_t>(
    store.ref(), view, desc, make_params(s), 132);
  REQUIRE(c.vectorized);
  // 8 bf16 per 16-byte run: 64 rotary pairs = 8 key units, 128 value dims = 16 value units.
  REQUIRE(c.args.rotary_units == 8);
  REQUIRE(c.args.key_units == 8);
  REQUIRE(c.args.units_per_head == 24);
  REQUIRE(c.args.tile_tokens == policy::tile_tokens);
  REQUIRE(c.grid_x == (1024 + policy::tile_tokens - 1) / policy::tile_tokens);
  // 256 token tiles x 4 layer groups of 8 = 1024 blocks >= 132 SMs x 4: 8 layers per block.
  REQUIRE(c.args.tile_layers == 8);
  REQUIRE(c.grid_y == 4);
  REQUIRE(c.shared_bytes == policy::tile_tokens * 64 * sizeof(rope_cos_sin));
  // 128 tokens: 32 tiles; 8 layers per block gives 128 blocks < 528, so halve down to 1 layer
  // (1024 blocks); 2 layers would give 512 < 528.
  injection_batch_view const small{arrays.data(), arrays.data() + 1024, arrays.data() + 2048, 128};
  auto const c2 = detail::make_inject_launch<bfloat16_t, bfloat16_t>(
    store.ref(), small, desc, make_params(s), 132);
  REQUIRE(c2.args.tile_layers == 1);
  REQUIRE(c2.grid_y == 32);
}

TEMPLATE_TEST_CASE("the extract kernel's units, emulated on the CPU, equal extract_host",
                   "[inject][emulation]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3,
                   fp32_to_e5m2)
{
  using S                = typename TestType::store_t;
  using C                = typename TestType::cache_t;
  shape_case const s     = GENERATE(from_range(shape_cases()));
  engine_layout const ly = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  CAPTURE(s.name, to_string(ly));
  engine_cache<C> cache(ly, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  cache.fill_random(7);
  paged_kv_cache desc = inferscale_test::describe_engine_cache(cache, cache.storage());
  auto const scales   = make_scales(s, TestType::granularity);
  set_scales<TestType>(desc, scales, s);
  rope_params const params = make_params(s);

  auto make_store = [&] {
    return inferscale_test::make_host_store(s.layers, s.heads, s.head_dim, dtype_of_v<S>, 8, 16);
  };
  kv_store by_host            = make_store();
  kv_store by_kernel          = make_store();
  std::int32_t const blocks[] = {4, 9, 2};
  auto const slots            = slots_from_block_table(blocks, 3, block_size, 3, 29);
  std::vector<std::int32_t> token_ids(slots.size());
  for (std::size_t j = 0; j < token_ids.size(); ++j) {
    token_ids[j] = static_cast<std::int32_t>(500 + j);
  }
  std::int64_t const first_position = 40;
  // One rotation, or two bases over alternating layers (each layer de-rotated by its own).
  bool const layered = GENERATE(false, true);
  CAPTURE(layered);
  rope_params const both[2] = {params, make_params(s, 1000000.0)};
  std::vector<std::int32_t> layer_map(static_cast<std::size_t>(s.layers));
  for (int l = 0; l < s.layers; ++l) {
    layer_map[static_cast<std::size_t>(l)] = l % 2;
  }
  per_layer_rotation<rope_params> const per_layer{both, 2, layer_map.data(), s.layers};
  auto const run_with = [&](auto&& f) { layered ? f(per_layer) : f(params); };
  run_with(
    [&](auto const& r) { extract_host(desc, slots, first_position, r, by_host, 5, 1, token_ids); });

  fact_record const& fact = by_kernel.reserve(5, 1, token_ids);
  std::int64_t const n    = static_cast<std::int64_t>(slots.size());
  std::vector<std::int64_t> arrays(static_cast<std::size_t>(3 * n));
  for (std::int64_t j = 0; j < n; ++j) {
    arrays[static_cast<std::size_t>(j)] = by_kernel.store_token(fact, static_cast<std::int32_t>(j));
    arrays[static_cast<std::size_t>(n + j)]     = first_position + j;
    arrays[static_cast<std::size_t>(2 * n + j)] = slots[static_cast<std::size_t>(j)];
  }
  run_with([&](auto const& r) {
    auto const args = detail::make_extract_args(
      by_kernel.ref(), desc, r, {arrays.data(), arrays.data() + n, arrays.data() + 2 * n, n});
    std::int64_t const units = detail::extract_units(args);
    // tokens x layers x heads x (pairs + pass-through dims + value dims)
    REQUIRE(units ==
            n * s.layers * s.heads * (s.rotary_dim / 2 + (s.head_dim - s.rotary_dim) + s.head_dim));
    std::int64_t const per_token = detail::extract_units_per_token(args);
    REQUIRE(units == n * per_token);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int32_t w = 0; w < per_token; ++w) {
        detail::extract_unit<S, C>(args, i, w);
      }
    }
  });
  REQUIRE(by_kernel.at(5).pages == by_host.at(5).pages);
  REQUIRE(by_kernel.pool_to_host() == by_host.pool_to_host());
  if (layered && s.layers > 1) {
    // The two bases de-rotate differently: extracting with one base for every layer differs.
    kv_store single = make_store();
    extract_host(desc, slots, first_position, params, single, 5, 1, token_ids);
    REQUIRE(single.pool_to_host() != by_host.pool_to_host());
  }
}

namespace {
/// Element offsets (within a layer's base) of (slot, head, dim) for every dim of one head row.
template <class C>
void restore_row(bytes& expected,
                 bytes const& original,
                 engine_cache<C> const& ec,
                 void const* base,
                 paged_kv_layout const& layout,
                 std::int64_t slot,
                 std::int32_t head)
{
  auto const* storage = reinterpret_cast<unsigned char const*>(ec.storage());
  for (std::int32_t d = 0; d < layout.head_dim; ++d) {
    std::size_t const at =
      static_cast<std::size_t>(static_cast<unsigned char const*>(base) - storage) +
      static_cast<std::size_t>(layout.slot_offset(slot, head, d)) * sizeof(C);
    std::memcpy(expected.data() + at, original.data() + at, sizeof(C));
  }
}
}  // namespace

TEST_CASE("the inject kernel's code skips and counts what the host did not validate",
          "[inject][emulation]")
{
  // Device arrays are never read by the host: a kernel handed a bad slot, position or store token
  // must skip the token (write nothing of it) and count it in inject_device_errors. The expected
  // cache is what the host backend writes for the same arrays with those tokens' slots set to -1
  // (its plain skip), and the counts are those of the corruptions made below.
  using S                = bfloat16_t;
  using C                = bfloat16_t;
  shape_case const s     = {"d64 halves", 2, 2, 64, 64, rope_pairing::halves, 12};
  engine_layout const ly = GENERATE(engine_layout::vllm_flash_attn_nhd, engine_layout::vllm_legacy);
  int const sm_count     = GENERATE(132, 1);
  CAPTURE(to_string(ly), sm_count);
  kv_store store =
    inferscale_test::make_host_store(s.layers, s.heads, s.head_dim, dtype::bfloat16, 8, 32);
  populate(store, make_facts(s), s);
  rope_params const params    = make_params(s);
  std::int64_t const rows     = 2048;
  std::vector<S> const table  = make_rope_cos_sin_values<S>(params, rows);
  auto const rotation         = make_rope_cos_sin_table(params, table.data(), rows, true);
  injection_batch const batch = make_batch(store, 0);

  engine_cache<C> by_host(ly, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  engine_cache<C> by_kernel(ly, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  by_host.fill_random(3);
  by_kernel.fill_random(3);
  bytes const original = storage_of(by_host);
  paged_kv_cache const host_desc =
    inferscale_test::describe_engine_cache(by_host, by_host.storage());
  paged_kv_cache const kernel_desc =
    inferscale_test::describe_engine_cache(by_kernel, by_kernel.storage());

  std::vector<std::int64_t> store_tokens = batch.store_tokens();
  std::vector<std::int64_t> positions    = batch.positions();
  std::vector<std::int64_t> slots        = batch.slots();
  std::vector<std::int64_t> reference    = slots;  // the host backend's slots: corrupted -> -1
  std::vector<std::size_t> written;                // tokens with a slot, in order
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= 0) { written.push_back(i); }
  }
  REQUIRE(written.size() >= 12);
  std::int64_t const pool_tokens = store.num_pages() * store.page_size();
  slots[written[0]]              = host_desc.num_slots();                     // bad slot
  slots[written[1]]              = std::numeric_limits<std::int64_t>::max();  // bad slot
  positions[written[2]]          = -1;                                        // bad position
  positions[written[3]]          = rows;                                      // bad position
  positions[written[4]]          = std::numeric_limits<std::int64_t>::min();  // bad position
  store_tokens[written[5]]       = pool_tokens;                               // bad store token
  store_tokens[written[6]]       = -5;                                        // bad store token
  slots[written[7]]              = -1;  // a plain skip, with a bad position too: not counted
  positions[written[7]]          = -7;
  for (int c = 0; c < 8; ++c) {
    reference[written[static_cast<std::size_t>(c)]] = -1;
  }

  injection_batch_view const corrupted{
    store_tokens.data(), positions.data(), slots.data(), static_cast<std::int64_t>(slots.size())};
  injection_batch_view const host_view{
    batch.store_tokens().data(), batch.positions().data(), reference.data(), batch.num_tokens()};
  detail::inject_host_view(store.ref(), host_view, host_desc, rotation);

  inject_device_errors errors{};
  auto const config = detail::make_inject_launch<S, C>(
    store.ref(), corrupted, kernel_desc, rotation, sm_count, &errors);
  if (config.vectorized) {
    emulate_blocks<S, C, true>(config);
  } else {
    emulate_blocks<S, C, false>(config);
  }
  CHECK(errors.bad_slot == 2);
  CHECK(errors.bad_position == 3);
  CHECK(errors.bad_store_token == 2);
  CHECK(errors.bad_scale == 0);
  CHECK(errors.total() == 7);
  bytes const host = storage_of(by_host);
  REQUIRE(host != original);
  REQUIRE(storage_of(by_kernel) == host);

  SECTION("null counters: the same skips, uncounted")
  {
    engine_cache<C> quiet(ly, s.layers, s.blocks, block_size, s.heads, s.head_dim);
    quiet.fill_random(3);
    auto const cfg = detail::make_inject_launch<S, C>(
      store.ref(),
      corrupted,
      inferscale_test::describe_engine_cache(quiet, quiet.storage()),
      rotation,
      sm_count,
      nullptr);
    if (cfg.vectorized) {
      emulate_blocks<S, C, true>(cfg);
    } else {
      emulate_blocks<S, C, false>(cfg);
    }
    REQUIRE(storage_of(quiet) == host);
  }
}

TEST_CASE("the inject kernel's code skips and counts rows whose fp8 scale is unusable",
          "[inject][emulation]")
{
  // Device scales are not read by the host. Layer 0's key scale is NaN and layer 1's value scale
  // is 0 (per tensor): those rows must keep their old bytes, every other row must equal the host
  // backend's with usable scales, and each skipped (token, layer, head, K/V) row counts once.
  using S                = bfloat16_t;
  using C                = float8_e4m3_t;
  shape_case const s     = {"d64 halves", 2, 2, 64, 64, rope_pairing::halves, 12};
  engine_layout const ly = engine_layout::vllm_flash_attn_nhd;
  kv_store store =
    inferscale_test::make_host_store(s.layers, s.heads, s.head_dim, dtype::bfloat16, 8, 32);
  populate(store, make_facts(s), s);
  rope_params const params = make_params(s);
  injection_batch batch    = make_batch(store, 0);

  engine_cache<C> by_host(ly, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  engine_cache<C> by_kernel(ly, s.layers, s.blocks, block_size, s.heads, s.head_dim);
  by_host.fill_random(5);
  by_kernel.fill_random(5);
  bytes const original     = storage_of(by_host);
  paged_kv_cache host_desc = inferscale_test::describe_engine_cache(by_host, by_host.storage());
  paged_kv_cache kernel_desc =
    inferscale_test::describe_engine_cache(by_kernel, by_kernel.storage());
  float const good[4] = {0.5f, 0.75f, 1.25f, 2.0f};  // K0, V0, K1, V1
  float const bad[4]  = {std::numeric_limits<float>::quiet_NaN(), 0.75f, 1.25f, 0.0f};
  host_desc.set_fp8_scales(kv_scale_convention::divide,
                           kv_scale_granularity::per_tensor,
                           {good + 0, good + 2},
                           {good + 1, good + 3});
  kernel_desc.set_fp8_scales(kv_scale_convention::divide,
                             kv_scale_granularity::per_tensor,
                             {bad + 0, bad + 2},
                             {bad + 1, bad + 3});
  batch.run(host_desc, params);

  inject_device_errors errors{};
  auto const config = detail::make_inject_launch<S, C>(
    store.ref(), batch.host_view(), kernel_desc, params, GENERATE(132, 1), &errors);
  if (config.vectorized) {
    emulate_blocks<S, C, true>(config);
  } else {
    emulate_blocks<S, C, false>(config);
  }
  bytes expected      = storage_of(by_host);
  std::int64_t tokens = 0;
  for (std::int64_t slot : batch.slots()) {
    if (slot < 0) { continue; }
    ++tokens;
    for (std::int32_t h = 0; h < s.heads; ++h) {
      restore_row(
        expected, original, by_host, host_desc.key_base[0], host_desc.key_layout, slot, h);
      restore_row(
        expected, original, by_host, host_desc.value_base[1], host_desc.value_layout, slot, h);
    }
  }
  CHECK(errors.bad_scale == static_cast<unsigned long long>(tokens * s.heads * 2));
  CHECK(errors.bad_slot + errors.bad_position + errors.bad_store_token == 0);
  REQUIRE(storage_of(by_kernel) == expected);
}

TEST_CASE("the rope kernel's position rule refuses INT64_MIN and rows beyond the table",
          "[inject][emulation][rope]")
{
  // rope_position_ok decides, on the device, which tokens rope_apply_async rotates.
  std::int64_t const rows = 100;
  std::int64_t const min  = std::numeric_limits<std::int64_t>::min();
  CHECK(detail::rope_position_ok(0, rows, rope_op::forward));
  CHECK(detail::rope_position_ok(99, rows, rope_op::inverse));
  CHECK_FALSE(detail::rope_position_ok(100, rows, rope_op::forward));
  CHECK_FALSE(detail::rope_position_ok(-1, rows, rope_op::forward));
  CHECK(detail::rope_position_ok(-99, rows, rope_op::shift));
  CHECK_FALSE(detail::rope_position_ok(-100, rows, rope_op::shift));
  // -INT64_MIN overflows: it must not pass as a negative magnitude below the row count.
  CHECK_FALSE(detail::rope_position_ok(min, rows, rope_op::shift));
  CHECK_FALSE(
    detail::rope_position_ok(min, std::numeric_limits<std::int64_t>::max(), rope_op::shift));
  // |INT64_MIN + 2| = INT64_MAX - 1 is below INT64_MAX rows (computed rotations have no table).
  CHECK(
    detail::rope_position_ok(min + 2, std::numeric_limits<std::int64_t>::max(), rope_op::shift));
  CHECK_FALSE(
    detail::rope_position_ok(min + 1, std::numeric_limits<std::int64_t>::max(), rope_op::shift));
}

TEMPLATE_TEST_CASE(
  "degenerate shapes - one layer, one head, head_dim off the 16-byte run, blocks "
  "of one token, one-token batches: the kernels' code equals the host run",
  "[inject][emulation][degenerate]",
  bf16_to_bf16,
  bf16_to_e4m3)
{
  // inject_host.cpp checks the host run against a brute-force rotation on these shapes (fp32,
  // fp16 and bf16 caches); here the inject kernel's blocks and the extract kernel's units, run on
  // the CPU, must give its bytes (16-bit and fp8 caches: runs of 8 and 16 elements).
  using S                = typename TestType::store_t;
  using C                = typename TestType::cache_t;
  shape_case const s     = GENERATE(values<shape_case>(
    {{"1 layer, 1 head, d2", 1, 1, 2, 2, rope_pairing::halves, 0},
         {"1 layer, 1 head, d6 interleaved", 1, 1, 6, 6, rope_pairing::interleaved, 0},
         {"d36 halves (not a whole 16-byte run)", 1, 1, 36, 36, rope_pairing::halves, 0},
         {"d40 halves, rotary 36", 1, 1, 40, 36, rope_pairing::halves, 0},
         {"3 heads, d10", 1, 3, 10, 10, rope_pairing::halves, 0}}));
  engine_layout const ly = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  int const block        = GENERATE(1, 16);
  int const sm_count     = GENERATE(132, 1);
  CAPTURE(s.name, to_string(ly), block, sm_count);
  if (ly == engine_layout::vllm_legacy && s.head_dim % (16 / static_cast<int>(sizeof(C))) != 0) {
    return;  // no such vLLM cache
  }
  kv_store store = inferscale_test::make_host_store(s.layers,
                                                    s.heads,
                                                    s.head_dim,
                                                    dtype_of_v<S>,
                                                    /*page_size*/ 1,
                                                    /*pages*/ 8);
  fact_data const one(1, s.layers, 1, s.heads, s.head_dim, 11);
  fact_data const three(2, s.layers, 3, s.heads, s.head_dim, 12);
  one.insert_into(store);
  three.insert_into(store);
  rope_params const params       = make_params(s);
  std::int64_t const slots_total = 4 * 16;
  auto make_cache                = [&] {
    engine_cache<C> c(ly, s.layers, slots_total / block, block, s.heads, s.head_dim);
    c.fill_random(42);
    return c;
  };
  engine_cache<C> by_host = make_cache(), by_kernel = make_cache();
  auto const scales        = make_scales(s, TestType::granularity);
  paged_kv_cache host_desc = inferscale_test::describe_engine_cache(by_host, by_host.storage());
  paged_kv_cache kernel_desc =
    inferscale_test::describe_engine_cache(by_kernel, by_kernel.storage());
  set_scales<TestType>(host_desc, scales, s);
  set_scales<TestType>(kernel_desc, scales, s);
  for (int step = 0; step < 2; ++step) {  // a batch of one token, then one of four
    injection_batch batch(store);
    compose_options o{};
    o.order = fact_order::as_given;
    if (step == 0) {
      o.first_position = 9;
      batch.add(compose(store, {1}, o), std::vector<std::int64_t>{slots_total - 1});
    } else {
      o.first_position = 2000;
      batch.add(compose(store, {2, 1}, o), std::vector<std::int64_t>{5, 0, 17, 40});
    }
    batch.run(host_desc, params);
    emulate_inject<S, C>(store, batch, kernel_desc, params, sm_count);
    REQUIRE(storage_of(by_kernel) == storage_of(by_host));
  }
  // extract the four slots back: the kernel's units against extract_host
  std::vector<std::int64_t> const slots{5, 0, 17, 40};
  std::vector<std::int32_t> const ids{7, 8, 9, 10};
  kv_store ex_host =
    inferscale_test::make_host_store(s.layers, s.heads, s.head_dim, dtype_of_v<S>, 1, 8);
  kv_store ex_kernel =
    inferscale_test::make_host_store(s.layers, s.heads, s.head_dim, dtype_of_v<S>, 1, 8);
  extract_host(host_desc, slots, 2000, params, ex_host, 5, 1, ids);
  fact_record const& fact = ex_kernel.reserve(5, 1, ids);
  std::int64_t const n    = 4;
  std::vector<std::int64_t> arrays(static_cast<std::size_t>(3 * n));
  for (std::int64_t j = 0; j < n; ++j) {
    arrays[static_cast<std::size_t>(j)] = ex_kernel.store_token(fact, static_cast<std::int32_t>(j));
    arrays[static_cast<std::size_t>(n + j)]     = 2000 + j;
    arrays[static_cast<std::size_t>(2 * n + j)] = slots[static_cast<std::size_t>(j)];
  }
  auto const args =
    detail::make_extract_args(ex_kernel.ref(),
                              host_desc,
                              params,
                              {arrays.data(), arrays.data() + n, arrays.data() + 2 * n, n});
  std::int64_t const per_token = detail::extract_units_per_token(args);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int32_t w = 0; w < per_token; ++w) {
      detail::extract_unit<S, C>(args, i, w);
    }
  }
  REQUIRE(ex_kernel.pool_to_host() == ex_host.pool_to_host());
}
