// GPU tests of injection and extraction: the device backend (inject.cuh) against the host backend
// (inject.hpp), which shares its per-element code, so the two must agree byte for byte over the
// whole storage of an engine's cache (padding included) for every engine layout of
// tests/common/engine_caches.hpp and every store -> cache dtype pair. The rotation is an engine
// cos/sin table (the same values on both sides); with computed rope_params the host's and the
// device's sincos may differ in the last fp32 bit, so that case is compared to one unit in the
// last place of the cache dtype. Also: CUDA-graph capture and replay with restaged positions, the
// raw launch's skipping of out-of-range slots and positions, device extraction against host
// extraction, and refused checked launches leaving the cache unchanged. The device seam too
// (engine.cuh, memory.cuh): a capture stored into a device store on a stream, a one-request step
// run on the device through a cache adapter and memory::serve / serve_step / inject from a device
// store, each equal
// byte for byte to the host seam's result, and their refusals changing nothing; the device capture
// buffer (kv_capture.cuh) filled from engine-dtype device rows and stored on the device against
// the host capture stored, byte for byte. Reported skipped by CTest where no GPU is visible.
#include "counting_resource.hpp"
#include "device_memory.hpp"
#include "engine_cache_descriptor.hpp"
#include "engine_caches.hpp"
#include "fake_model.hpp"
#include "inject_common.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/engine.cuh>
#include <inferscale/inject.cuh>
#include <inferscale/inject.hpp>
#include <inferscale/kv_capture.cuh>
#include <inferscale/memory.cuh>
#include <inferscale/memory_resource.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

using namespace inferscale;

namespace {

using inferscale_test::cuda_stream;
using inferscale_test::describe_engine_cache;
using inferscale_test::device_buffer;
using inferscale_test::engine_cache;
using inferscale_test::engine_layout;

using bytes = std::vector<unsigned char>;

using inferscale_test::bf16_to_bf16;
using inferscale_test::bf16_to_e4m3;
using inferscale_test::fp16_to_fp16;
using inferscale_test::fp32_to_e5m2;
using inferscale_test::fp32_to_fp32;

/// Shape of one scenario: the shard, the rotation and the cache size.
struct geometry_case {
  char const* name;
  std::int32_t layers;
  std::int32_t heads;        ///< heads of the store's shard and of the cache
  std::int32_t model_heads;  ///< heads of the model (the facts' views)
  std::int32_t first_head;   ///< first head of the shard
  std::int32_t head_dim;
  std::int32_t rotary_dim;
  rope_pairing pairing;
  bool round_each;      ///< the table's vLLM per-operation rounding (16-bit stores)
  bool vectorizable;    ///< the device takes the 16-byte path where the layout allows
  std::int64_t blocks;  ///< engine blocks of the cache
};

std::vector<geometry_case> geometry_cases()
{
  using rp = rope_pairing;
  // clang-format off
  //  name, then: layers, heads, model heads, first head, head_dim, rotary_dim, pairing,
  //  round_each, vectorizable, blocks
  return {{"d128 halves, full rotary",
           3, 2, 2, 0, 128, 128, rp::halves,      true,  true,  12},
          {"d64 interleaved, full rotary, heads 1..3 of 4",
           2, 3, 4, 1, 64,  64,  rp::interleaved, false, true,  12},
          {"d64 halves, rotary 34 (scalar path)",
           2, 2, 2, 0, 64,  34,  rp::halves,      true,  false, 12},
          {"d128 interleaved, rotary 64 (pass-through dims)",
           3, 1, 1, 0, 128, 64,  rp::interleaved, true,  true,  12}};
  // clang-format on
}

/// 10 layers and 1185 tokens: on an H200 the grid keeps 8 layers per block (a full and a partial
/// layer tile) and the last token tile is partial.
geometry_case large_case()
{
  return {"10 layers, 1185 tokens", 10, 2, 2, 0, 64, 64, rope_pairing::halves, true, true, 80};
}

constexpr std::int32_t block_size      = 16;  // engine tokens per block
constexpr std::int32_t store_page_size = 8;   // store tokens per page: facts span pages
constexpr std::int64_t store_pages     = 32;
constexpr std::int64_t default_rows    = 2048;  // cos/sin table rows

// Facts (id, tokens): an instruction prefix and seven facts of odd lengths.
constexpr std::uint64_t prefix_id = 1;
struct fact_spec {
  std::uint64_t id;
  std::int32_t tokens;
};
constexpr fact_spec facts[] = {{11, 7}, {12, 13}, {13, 1}, {14, 21}, {15, 5}, {16, 9}, {17, 17}};

/// Deterministic pre-RoPE K and V of a fact, `[layers, tokens, model heads, head_dim]` (fp32, so
/// both stores convert the same values to their dtype).
void insert_fact(
  kv_store& store, std::uint64_t id, std::uint64_t ns, std::int32_t tokens, geometry_case const& g)
{
  std::mt19937_64 rng(0x5eed0000 + id);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::size_t const n = static_cast<std::size_t>(g.layers) * tokens * g.model_heads * g.head_dim;
  std::vector<float> k(n), v(n);
  for (auto& x : k) {
    x = normal(rng);
  }
  for (auto& x : v) {
    x = normal(rng);
  }
  std::vector<std::int32_t> ids(static_cast<std::size_t>(tokens));
  for (std::int32_t j = 0; j < tokens; ++j) {
    ids[static_cast<std::size_t>(j)] = 1000 * static_cast<std::int32_t>(id) + j;
  }
  store.insert(
    id,
    ns,
    ids,
    make_fact_kv_view<float const>(k.data(), g.layers, tokens, g.model_heads, g.head_dim),
    make_fact_kv_view<float const>(v.data(), g.layers, tokens, g.model_heads, g.head_dim));
}

/// The same history on every store: a filler fact is erased so later facts reuse its pages (a
/// fact's pages are then not in order).
void populate(kv_store& store, geometry_case const& g)
{
  insert_fact(store, 100, 9, 10, g);
  insert_fact(store, prefix_id, 1, 6, g);
  store.erase(100);
  for (auto const& f : facts) {
    insert_fact(store, f.id, 7, f.tokens, g);
  }
}

kv_store_config store_config(geometry_case const& g, dtype store_dtype, memory_space space)
{
  kv_store_config c{};
  c.model       = kv_geometry{g.layers, g.model_heads, g.head_dim};
  c.first_head  = g.first_head;
  c.num_heads   = g.heads;
  c.store_dtype = store_dtype;
  c.page_size   = store_page_size;
  c.num_pages   = store_pages;
  c.space       = space;
  return c;
}

rope_params make_params(geometry_case const& g, double theta = 10000.0)
{
  rope_spec spec{};
  spec.head_dim   = g.head_dim;
  spec.rotary_dim = g.rotary_dim;
  spec.theta      = theta;
  spec.pairing    = g.pairing;
  return make_rope_params(spec);
}

/// fp8 scales, `[layer][K, V][count]`, count = heads (per head) or 1 (per tensor); 0.5 .. 1.5.
std::vector<float> make_scales(geometry_case const& g, kv_scale_granularity granularity)
{
  if (granularity == kv_scale_granularity::none) { return {}; }
  std::int32_t const count = granularity == kv_scale_granularity::per_head ? g.heads : 1;
  std::vector<float> s;
  for (std::int32_t l = 0; l < g.layers; ++l) {
    for (std::int32_t kv = 0; kv < 2; ++kv) {
      for (std::int32_t i = 0; i < count; ++i) {
        s.push_back(0.5f + 0.25f * float((l + 2 * kv + i) % 5));
      }
    }
  }
  return s;
}

void set_scales(paged_kv_cache& cache,
                float const* scales,
                geometry_case const& g,
                kv_scale_granularity granularity,
                kv_scale_convention convention)
{
  if (granularity == kv_scale_granularity::none) { return; }
  std::int32_t const count = granularity == kv_scale_granularity::per_head ? g.heads : 1;
  std::vector<float const*> k, v;
  for (std::int32_t l = 0; l < g.layers; ++l) {
    k.push_back(scales + (2 * l) * count);
    v.push_back(scales + (2 * l + 1) * count);
  }
  cache.set_fp8_scales(convention, granularity, k, v);
}

template <class C>
bytes fill_and_copy(engine_cache<C>& cache, std::uint64_t seed)
{
  cache.fill_random(seed);
  auto const* p = reinterpret_cast<unsigned char const*>(cache.storage());
  return bytes(p, p + cache.storage_bytes());
}

/**
 * Everything twice: a host store and a device store with the same history, the simulated cache
 * in host memory and a device copy of its storage, descriptors of both made by the library's
 * factories (same byte offsets), fp8 scales and the cos/sin table in both memories.
 */
template <class Pair>
struct scenario {
  using S = typename Pair::store_t;
  using C = typename Pair::cache_t;

  scenario(engine_layout layout_, geometry_case const& g_, std::int64_t rows = default_rows)
    : g{g_},
      layout{layout_},
      host_store{store_config(g_, dtype_of_v<S>, memory_space::host)},
      device_store{store_config(g_, dtype_of_v<S>, memory_space::device)},
      cache{layout_, g_.layers, g_.blocks, block_size, g_.heads, g_.head_dim},
      original{fill_and_copy(cache, 42 + static_cast<std::uint64_t>(layout_))},
      device_storage{original},
      scales{make_scales(g_, Pair::granularity)},
      device_scales{scales},
      params{make_params(g_)},
      table{make_rope_cos_sin_values<S>(params, rows)},
      device_table{table},
      host_rotation{make_rope_cos_sin_table(params, table.data(), rows, g_.round_each)},
      device_rotation{make_rope_cos_sin_table(params, device_table.data(), rows, g_.round_each)},
      host_desc{describe_engine_cache(cache, cache.storage())},
      device_desc{describe_engine_cache(cache, reinterpret_cast<std::byte*>(device_storage.data()))}
  {
    set_scales(host_desc, scales.data(), g, Pair::granularity, Pair::convention);
    set_scales(device_desc, device_scales.data(), g, Pair::granularity, Pair::convention);
    populate(host_store, g);
    populate(device_store, g);
    // Pageable cudaMemcpy may return before its DMA lands; kernels go to non-blocking streams.
    INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
  }

  bytes host_bytes() const
  {
    auto const* p = reinterpret_cast<unsigned char const*>(cache.storage());
    return bytes(p, p + cache.storage_bytes());
  }

  /// The device copy, after the stream's work.
  bytes device_bytes(cudaStream_t stream) const
  {
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
    return device_storage.to_host();
  }

  geometry_case g;
  engine_layout layout;
  kv_store host_store;
  kv_store device_store;
  engine_cache<C> cache;  // the host backend's cache
  bytes original;         // its storage before any injection
  device_buffer<unsigned char> device_storage;
  std::vector<float> scales;
  device_buffer<float> device_scales;
  rope_params params;
  std::vector<S> table;
  device_buffer<S> device_table;
  rope_cos_sin_table<S> host_rotation;
  rope_cos_sin_table<S> device_rotation;
  paged_kv_cache host_desc;
  paged_kv_cache device_desc;
};

/// Index of element `e` of the simulator's storage.
template <class C>
std::size_t element_index(engine_cache<C> const& cache, C const& e)
{
  return static_cast<std::size_t>(&e - reinterpret_cast<C const*>(cache.storage()));
}

/// Index of the first differing byte, -1 if equal (sizes must agree).
std::int64_t first_difference(bytes const& a, bytes const& b)
{
  if (a.size() != b.size()) { return 0; }
  auto const m = std::mismatch(a.begin(), a.end(), b.begin());
  return m.first == a.end() ? -1 : static_cast<std::int64_t>(m.first - a.begin());
}

/// Engine blocks no request of make_batch uses (12-block caches).
std::vector<std::int32_t> unused_blocks() { return {6, 4, 10, 11}; }

/// One request of a batch: its plan and where its memory tokens go (a block table from a prompt
/// position, or an explicit slot mapping when `blocks` is empty).
struct request {
  composition plan;
  std::vector<std::int32_t> blocks;
  std::int64_t start_position{};
  std::vector<std::int64_t> slot_mapping;

  /// The slots of the plan's tokens, whichever way they are given.
  std::vector<std::int64_t> slots() const
  {
    if (blocks.empty()) { return slot_mapping; }
    return slots_from_block_table(blocks.data(),
                                  static_cast<std::int64_t>(blocks.size()),
                                  block_size,
                                  start_position,
                                  plan.length());
  }
};

/**
 * Three requests (98 memory tokens), positions shifted by `shift`:
 *  A: prefix + facts {11, 12, 13} best_last at p0 = 12, prompt tokens 3.. of blocks {7, 2};
 *  B: facts {14, 15, 16} as given at p0 = 0, an explicit slot mapping with every fourth slot
 *     negative (skipped) and three query-token slots past m;
 *  C: prefix + facts {17, 12} at p0 = 1500 (fact 12 again), prompt tokens 5.. of blocks {3, 8, 1}.
 */
std::vector<request> make_requests(kv_store const& store, std::int64_t shift)
{
  std::vector<request> requests;
  {
    compose_options o{};
    o.first_position     = 12 + shift;
    o.order              = fact_order::best_last;
    o.instruction_prefix = prefix_id;
    requests.push_back({compose(store, {11, 12, 13}, o), {7, 2}, 3, {}});
  }
  {
    compose_options o{};
    o.first_position = shift;
    o.order          = fact_order::as_given;
    request r{compose(store, {14, 15, 16}, o), {}, 0, {}};
    std::int32_t const blocks[] = {9, 0, 5};
    r.slot_mapping = slots_from_block_table(blocks, 3, block_size, 0, r.plan.length() + 3);
    for (std::size_t j = 1; j < r.slot_mapping.size(); j += 4) {
      r.slot_mapping[j] = -1;
    }
    requests.push_back(std::move(r));
  }
  {
    compose_options o{};
    o.first_position     = 1500 + shift;
    o.order              = fact_order::as_given;
    o.instruction_prefix = prefix_id;
    requests.push_back({compose(store, {17, 12}, o), {3, 8, 1}, 5, {}});
  }
  return requests;
}

/// The batch of make_requests (block tables as their slots: the batch is built before a cache).
injection_batch make_batch(kv_store const& store, std::int64_t shift)
{
  injection_batch batch(store);
  for (request const& r : make_requests(store, shift)) {
    batch.add(r.plan, r.slots());
  }
  return batch;
}

/// Fifteen requests of all the facts (1185 tokens) over blocks 0, 7, 14, ... (mod 80).
injection_batch make_large_batch(kv_store const& store)
{
  injection_batch batch(store);
  std::vector<std::int32_t> order(80);
  for (std::int32_t i = 0; i < 80; ++i) {
    order[static_cast<std::size_t>(i)] = (7 * i) % 80;
  }
  std::vector<std::uint64_t> ids;
  for (auto const& f : facts) {
    ids.push_back(f.id);
  }
  std::size_t next = 0;
  for (int r = 0; r < 15; ++r) {
    std::rotate(ids.begin(), ids.begin() + 1, ids.end());
    compose_options o{};
    o.first_position        = 37 * r;
    o.order                 = r % 2 ? fact_order::best_last : fact_order::as_given;
    o.instruction_prefix    = prefix_id;
    auto const plan         = compose(store, ids, o);
    std::int64_t const need = (plan.length() + block_size - 1) / block_size;
    batch.add(plan,
              slots_from_block_table(order.data() + next, need, block_size, 0, plan.length()));
    next += static_cast<std::size_t>(need);
  }
  return batch;
}

/// Injects the same batch with both backends and requires identical storage.
template <class Pair>
void require_device_equals_host(scenario<Pair>& s, bool large)
{
  using S            = typename Pair::store_t;
  using C            = typename Pair::cache_t;
  injection_batch hb = large ? make_large_batch(s.host_store) : make_batch(s.host_store, 0);
  injection_batch db = large ? make_large_batch(s.device_store) : make_batch(s.device_store, 0);
  REQUIRE(hb.store_tokens() == db.store_tokens());  // same history, same pages
  REQUIRE(hb.positions() == db.positions());
  REQUIRE(hb.slots() == db.slots());
  bool const vectorized =
    detail::inject_vectorizable<S, C>(s.device_store.ref(), s.device_desc, s.device_rotation);
  CAPTURE(vectorized, hb.num_tokens());
  // vLLM's legacy V and its CPU K are token-fastest (dims not contiguous): the scalar kernel.
  REQUIRE(vectorized == (s.g.vectorizable && s.layout != engine_layout::vllm_legacy &&
                         s.layout != engine_layout::vllm_cpu));

  hb.run(s.host_desc, s.host_rotation);
  cuda_stream stream;
  injection_workspace workspace(db.num_tokens());
  db.run<S, C>(
    s.device_desc, s.device_rotation, device_context{workspace, cuda::stream_ref{stream.get()}});
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);  // something was written
  REQUIRE(first_difference(device, host) == -1);
}

}  // namespace

TEMPLATE_TEST_CASE("device injection equals the host injection byte for byte",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3,
                   fp16_to_fp16,
                   fp32_to_e5m2)
{
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g      = GENERATE(from_range(geometry_cases()));
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<TestType> s(layout, g);
  require_device_equals_host(s, false);
}

TEMPLATE_TEST_CASE("device injection with a per-layer rotation equals the host run byte for byte",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32)
{
  // Gemma's shape: two bases, every third layer at the other one. The kernel takes the rotations
  // by value (device_layer_rotation) and its tile holds both; the host run is checked against
  // single rotations and a double-precision reference (inject_simd_host.cpp).
  using S           = typename TestType::store_t;
  using C           = typename TestType::cache_t;
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g      = GENERATE(from_range(geometry_cases()));
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<TestType> s(layout, g);
  rope_params const other = make_params(g, 1000000.0);
  std::vector<S> const t2 = make_rope_cos_sin_values<S>(other, default_rows);
  device_buffer<S> const d2{t2};
  std::vector<std::int32_t> layers(static_cast<std::size_t>(g.layers));
  for (std::int32_t l = 0; l < g.layers; ++l) {
    layers[static_cast<std::size_t>(l)] = l % 3 == 2 ? 0 : 1;
  }
  rope_cos_sin_table<S> const host_tables[2] = {
    s.host_rotation, make_rope_cos_sin_table(other, t2.data(), default_rows, g.round_each)};
  rope_cos_sin_table<S> const device_tables[2] = {
    s.device_rotation, make_rope_cos_sin_table(other, d2.data(), default_rows, g.round_each)};
  per_layer_rotation<rope_cos_sin_table<S>> const host_layers{
    host_tables, 2, layers.data(), g.layers};
  per_layer_rotation<rope_cos_sin_table<S>> const device_layers{
    device_tables, 2, layers.data(), g.layers};
  injection_batch hb = make_batch(s.host_store, 0);
  injection_batch db = make_batch(s.device_store, 0);
  hb.run(s.host_desc, host_layers);
  cuda_stream stream;
  injection_workspace workspace(db.num_tokens());
  db.run<S, C>(
    s.device_desc, device_layers, device_context{workspace, cuda::stream_ref{stream.get()}});
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);
  REQUIRE(first_difference(device, host) == -1);
}

TEMPLATE_TEST_CASE("device injection of a batch larger than a wave equals the host injection",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   bf16_to_e4m3)
{
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  CAPTURE(inferscale_test::to_string(layout));
  scenario<TestType> s(layout, large_case());
  require_device_equals_host(s, true);
}

TEMPLATE_TEST_CASE("device injection with computed rope_params is within one unit of the host's",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3)
{
  using S           = typename TestType::store_t;
  using C           = typename TestType::cache_t;
  auto const layout = GENERATE(engine_layout::vllm_flash_attn_nhd, engine_layout::vllm_legacy);
  auto const g      = GENERATE(from_range(geometry_cases()));
  auto const mode   = GENERATE(rope_angle_mode::fp32, rope_angle_mode::exact);
  CAPTURE(inferscale_test::to_string(layout), g.name, static_cast<int>(mode));
  scenario<TestType> s(layout, g);
  rope_params params = s.params;
  params.angle_mode  = mode;
  // Positions near 90000: large angles, where the two sincos implementations differ most.
  injection_batch hb = make_batch(s.host_store, 90000);
  injection_batch db = make_batch(s.device_store, 90000);
  hb.run(s.host_desc, params);
  cuda_stream stream;
  injection_workspace workspace(db.num_tokens());
  db.run<S, C>(s.device_desc, params, device_context{workspace, cuda::stream_ref{stream.get()}});
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);
  std::size_t const n = host.size() / sizeof(C);
  std::vector<C> h(n), d(n);
  std::memcpy(h.data(), host.data(), n * sizeof(C));
  std::memcpy(d.data(), device.data(), n * sizeof(C));
  // Only the rotated dims of written keys may differ; everything else is copied or converted
  // without cos/sin and must be identical.
  std::vector<bool> rotated(n, false);
  for (std::int64_t slot : hb.slots()) {
    if (slot < 0) { continue; }
    for (std::int32_t l = 0; l < g.layers; ++l) {
      for (std::int32_t head = 0; head < g.heads; ++head) {
        for (std::int32_t dim = 0; dim < g.rotary_dim; ++dim) {
          rotated[element_index(s.cache, s.cache.key(l, slot, head, dim))] = true;
        }
      }
    }
  }
  float const unit      = std::ldexp(1.0f, -mantissa_bits<C>());
  std::size_t differing = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&h[i], &d[i], sizeof(C)) == 0) { continue; }
    ++differing;
    float const a = to_float(h[i]), b = to_float(d[i]);
    CAPTURE(i, a, b);
    REQUIRE(rotated[i]);
    // cos/sin differ by an fp32 ulp or two, |x| + |y| < 16: below 1e-5 before the final rounding,
    // which then moves a result by at most one unit of the cache dtype.
    REQUIRE(std::fabs(a - b) <= unit * std::max({1.0f, std::fabs(a), std::fabs(b)}) + 1e-5f);
  }
  INFO(differing << " of " << n << " elements differ");
  SUCCEED();
}

TEMPLATE_TEST_CASE("a captured CUDA graph of the raw injection replays restaged positions",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   bf16_to_e4m3)
{
  auto const layout = GENERATE(engine_layout::vllm_flash_attn_nhd,
                               engine_layout::vllm_legacy,
                               engine_layout::tensorrt_llm_pool);
  auto const g      = geometry_cases()[0];
  CAPTURE(inferscale_test::to_string(layout));
  scenario<TestType> s(layout, g, 4096);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Captured with the batch at its first positions; replayed after restaging the same tokens and
  // slots at positions shifted by 700, then by 1900.
  injection_batch const first  = make_batch(s.device_store, 0);
  injection_batch const second = make_batch(s.device_store, 700);
  injection_batch const third  = make_batch(s.device_store, 1900);
  REQUIRE(second.slots() == first.slots());
  REQUIRE(third.slots() == first.slots());
  REQUIRE(second.positions() != first.positions());
  injection_workspace workspace(first.num_tokens());
  workspace.stage(first, ref);

  struct graph_owner {
    cudaGraph_t graph{};
    cudaGraphExec_t exec{};
    ~graph_owner()
    {
      if (exec) { (void)cudaGraphExecDestroy(exec); }
      if (graph) { (void)cudaGraphDestroy(graph); }
    }
  } owner;
  INFERSCALE_CUDA_TRY(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  try {
    detail::inject_view_async<typename TestType::store_t, typename TestType::cache_t>(
      s.device_store.ref(), workspace.view(), s.device_desc, s.device_rotation, nullptr, ref);
  } catch (...) {
    (void)cudaStreamEndCapture(stream.get(), &owner.graph);
    throw;
  }
  INFERSCALE_CUDA_TRY(cudaStreamEndCapture(stream.get(), &owner.graph));
  INFERSCALE_CUDA_TRY(cudaGraphInstantiate(&owner.exec, owner.graph, 0));
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);  // nothing ran yet

  bytes after_second;
  for (auto const* batch : {&second, &third}) {
    std::int64_t const shift = batch == &second ? 700 : 1900;
    CAPTURE(shift);
    workspace.stage(*batch, ref);
    INFERSCALE_CUDA_TRY(cudaGraphLaunch(owner.exec, stream.get()));
    make_batch(s.host_store, shift).run(s.host_desc, s.host_rotation);
    bytes const device = s.device_bytes(stream.get());
    REQUIRE(first_difference(device, s.host_bytes()) == -1);
    if (batch == &second) {
      after_second = device;
    } else {
      REQUIRE(first_difference(device, after_second) != -1);  // the new positions took effect
    }
  }
}

namespace {
/// Holds a stream for about `cycles` SM clock cycles (a launch that is still to come behind it).
__global__ void hold_stream(long long cycles)
{
  long long const start = clock64();
  while (clock64() - start < cycles) {}
}
}  // namespace

TEST_CASE("staging on another stream waits for the launch still to read the previous arrays",
          "[gpu][inject]")
{
  // Stream A: stage the first batch, hold, then the raw injection that reads the staged arrays
  // (marked as their user). Stream B stages a second batch (same slots, positions + 700) while A
  // still holds. Without the device-side wait, B's copy would land first and A would inject the
  // second batch's positions.
  auto const g = geometry_cases()[0];
  scenario<bf16_to_bf16> s(engine_layout::vllm_flash_attn_nhd, g, 4096);
  cuda_stream a, b;
  injection_batch const first  = make_batch(s.device_store, 0);
  injection_batch const second = make_batch(s.device_store, 700);
  REQUIRE(second.positions() != first.positions());
  injection_workspace workspace(first.num_tokens());
  workspace.stage(first, cuda::stream_ref{a.get()});
  hold_stream<<<1, 1, 0, a.get()>>>(200'000'000ll);  // about 0.1 s
  INFERSCALE_CUDA_TRY(cudaGetLastError());
  detail::inject_view_async<bfloat16_t, bfloat16_t>(s.device_store.ref(),
                                                    workspace.view(),
                                                    s.device_desc,
                                                    s.device_rotation,
                                                    nullptr,
                                                    cuda::stream_ref{a.get()});
  workspace.mark_used(cuda::stream_ref{a.get()});
  workspace.stage(second, cuda::stream_ref{b.get()});
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(b.get()));

  make_batch(s.host_store, 0).run(s.host_desc, s.host_rotation);
  REQUIRE(first_difference(s.device_bytes(a.get()), s.host_bytes()) == -1);
}

namespace {

/// Raw launch over device arrays the host never checked: tokens whose slot lies outside the cache
/// or whose position lies outside the table (beyond it, or negative) are skipped.
template <class Pair>
void require_raw_launch_skips(engine_layout layout, geometry_case const& g)
{
  using S = typename Pair::store_t;
  using C = typename Pair::cache_t;
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<Pair> s(layout, g);
  std::vector<request> const requests = make_requests(s.host_store, 0);
  std::vector<std::int64_t> store_tokens, positions, device_slots;
  std::vector<std::vector<std::int64_t>> host_slots;  // per request; -1 where the device skips
  {
    injection_batch const batch = make_batch(s.host_store, 0);
    store_tokens                = batch.store_tokens();
    positions                   = batch.positions();
    device_slots                = batch.slots();
  }
  std::int64_t const n = static_cast<std::int64_t>(store_tokens.size());
  std::vector<std::int64_t> free_slots;  // slots no request writes: must stay untouched
  for (std::int32_t b : unused_blocks()) {
    for (std::int32_t t = 0; t < block_size; ++t) {
      free_slots.push_back(std::int64_t{b} * block_size + t);
    }
  }
  std::int64_t const rows      = s.device_rotation.max_position;
  std::int64_t const num_slots = s.device_desc.num_slots();
  std::size_t next_free        = 0;
  std::int64_t i               = 0;  // token of the batch
  for (request const& r : requests) {
    std::vector<std::int64_t> slots = r.slots();
    for (std::int64_t j = 0; j < r.plan.length(); ++j, ++i) {
      auto const k = static_cast<std::size_t>(i);
      REQUIRE(device_slots[k] == slots[static_cast<std::size_t>(j)]);
      switch (i % 6) {
        case 1:  // position beyond the table, a writable slot
          positions[k]    = rows + 13 * i;
          device_slots[k] = free_slots.at(next_free++);
          break;
        case 3:  // negative position, a writable slot
          positions[k]    = -1 - i;
          device_slots[k] = free_slots.at(next_free++);
          break;
        case 5:  // slot beyond the cache
          device_slots[k] = i % 12 == 5 ? num_slots + i : std::numeric_limits<std::int64_t>::max();
          break;
        default: continue;
      }
      slots[static_cast<std::size_t>(j)] = -1;
    }
    host_slots.push_back(std::move(slots));
  }
  REQUIRE(i == n);
  std::vector<std::int64_t> arrays = store_tokens;
  arrays.insert(arrays.end(), positions.begin(), positions.end());
  arrays.insert(arrays.end(), device_slots.begin(), device_slots.end());
  device_buffer<std::int64_t> device_arrays(arrays);
  INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
  injection_batch_view const view{
    device_arrays.data(), device_arrays.data() + n, device_arrays.data() + 2 * n, n};
  cuda_stream stream;
  device_buffer<inject_device_errors> errors(std::vector<inject_device_errors>(1));
  detail::inject_view_async<S, C>(s.device_store.ref(),
                                  view,
                                  s.device_desc,
                                  s.device_rotation,
                                  errors.data(),
                                  cuda::stream_ref{stream.get()});
  inject_device_errors counted{};
  INFERSCALE_CUDA_TRY(cudaMemcpy(&counted, errors.data(), sizeof counted, cudaMemcpyDeviceToHost));
  // Every corrupted token is counted once: i % 6 == 1 or 3 (positions), i % 6 == 5 (slots).
  unsigned long long bad_positions = 0, bad_slots = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    bad_positions += (t % 6 == 1 || t % 6 == 3) ? 1 : 0;
    bad_slots += t % 6 == 5 ? 1 : 0;
  }
  CHECK(counted.bad_position == bad_positions);
  CHECK(counted.bad_slot == bad_slots);
  CHECK(counted.bad_store_token == 0);
  CHECK(counted.bad_scale == 0);

  // Expected: the host backend on the same requests with the skipped tokens' slots negative.
  injection_batch expected(s.host_store);
  for (std::size_t r = 0; r < requests.size(); ++r) {
    expected.add(requests[r].plan, host_slots[r]);
  }
  REQUIRE(expected.store_tokens() == store_tokens);
  expected.run(s.host_desc, s.host_rotation);
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);
  REQUIRE(first_difference(device, host) == -1);
  // The free slots given to skipped tokens are untouched (also implied by the equality above).
  for (std::size_t j = 0; j < next_free; ++j) {
    for (std::int32_t l = 0; l < g.layers; ++l) {
      for (std::int32_t h = 0; h < g.heads; ++h) {
        for (std::int32_t d = 0; d < g.head_dim; ++d) {
          std::size_t const ko =
            element_index(s.cache, s.cache.key(l, free_slots[j], h, d)) * sizeof(C);
          std::size_t const vo =
            element_index(s.cache, s.cache.value(l, free_slots[j], h, d)) * sizeof(C);
          REQUIRE(std::memcmp(&device[ko], &s.original[ko], sizeof(C)) == 0);
          REQUIRE(std::memcmp(&device[vo], &s.original[vo], sizeof(C)) == 0);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("the raw device injection skips slots beyond the cache and positions beyond the table",
          "[gpu][inject]")
{
  auto const cases = geometry_cases();
  SECTION("vLLM FlashAttention NHD, bf16 -> bf16, vectorized")
  {
    require_raw_launch_skips<bf16_to_bf16>(engine_layout::vllm_flash_attn_nhd, cases[0]);
  }
  SECTION("vLLM legacy, bf16 -> fp8 e4m3 per-head scales, scalar")
  {
    require_raw_launch_skips<bf16_to_e4m3>(engine_layout::vllm_legacy, cases[2]);
  }
  SECTION("SGLang token pool, fp32 -> fp32")
  {
    require_raw_launch_skips<fp32_to_fp32>(engine_layout::sglang_token_pool, cases[1]);
  }
}

TEMPLATE_TEST_CASE("device extraction equals host extraction",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3,
                   fp16_to_fp16,
                   fp32_to_e5m2)
{
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g      = GENERATE(from_range(geometry_cases()));
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<TestType> s(layout, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Inject first, so that one extracted span holds injected keys (request A's 27 tokens at their
  // positions 12..); the other is 19 random tokens in unused blocks at positions 777...
  injection_batch hb = make_batch(s.host_store, 0);
  injection_batch db = make_batch(s.device_store, 0);
  hb.run(s.host_desc, s.host_rotation);
  injection_workspace workspace(db.num_tokens());
  using S = typename TestType::store_t;
  using C = typename TestType::cache_t;
  db.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref});
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);

  std::vector<std::int32_t> const blocks = unused_blocks();
  struct span {
    std::uint64_t id;
    std::vector<std::int64_t> slots;
    std::int64_t first_position;
  };
  std::vector<span> const spans{
    {500, slots_from_block_table(blocks.data(), 2, block_size, 5, 19), 777},
    {501, std::vector<std::int64_t>(hb.slots().begin(), hb.slots().begin() + 27), 12}};
  for (auto const& sp : spans) {
    std::vector<std::int32_t> ids(sp.slots.size());
    for (std::size_t j = 0; j < ids.size(); ++j) {
      ids[j] = 7000 + static_cast<std::int32_t>(j);
    }
    extract_host(
      s.host_desc, sp.slots, sp.first_position, s.host_rotation, s.host_store, sp.id, 3, ids);
    extract<S, C>(s.device_desc,
                  sp.slots,
                  sp.first_position,
                  s.device_rotation,
                  s.device_store,
                  sp.id,
                  3,
                  ids,
                  ref);
  }
  // The new facts' pages, byte for byte (the other rows of their last pages are the same on both
  // sides too: both pools start zeroed and saw the same inserts).
  bytes const host_pool        = s.host_store.pool_to_host();
  bytes const device_pool      = s.device_store.pool_to_host();
  std::size_t const page_bytes = host_pool.size() / static_cast<std::size_t>(store_pages);
  for (auto const& sp : spans) {
    fact_record const& hf = s.host_store.at(sp.id);
    fact_record const& df = s.device_store.at(sp.id);
    REQUIRE(hf.pages == df.pages);
    REQUIRE(df.token_ids == hf.token_ids);
    for (std::int64_t page : hf.pages) {
      CAPTURE(sp.id, page);
      std::size_t const at = static_cast<std::size_t>(page) * page_bytes;
      REQUIRE(std::memcmp(&host_pool[at], &device_pool[at], page_bytes) == 0);
    }
  }
  REQUIRE(first_difference(host_pool, device_pool) == -1);
  // Extraction reads the cache only.
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);
}

namespace {

/// Every refusal of the checked device run leaves the device cache as it was.
template <class Pair>
void require_refusals_leave_cache_unchanged(engine_layout layout, geometry_case const& g)
{
  using S = typename Pair::store_t;
  using C = typename Pair::cache_t;
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<Pair> s(layout, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  injection_workspace workspace(256);
  auto const unchanged = [&] {
    REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);
  };
  std::vector<std::int32_t> const blocks = unused_blocks();
  compose_options near{};
  near.first_position    = 40;
  near.order             = fact_order::as_given;
  composition const plan = compose(s.device_store, {11, 13}, near);  // 8 tokens
  auto const free_slots  = slots_from_block_table(blocks.data(), 1, block_size, 0, plan.length());

  SECTION("a slot beyond the cache")
  {
    injection_batch batch(s.device_store);
    auto slots = free_slots;
    slots[5]   = s.device_desc.num_slots();
    batch.add(plan, slots);
    REQUIRE_THROWS_AS(
      (batch.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
  }
  SECTION("a position beyond the table")
  {
    compose_options far{};
    far.first_position = s.device_rotation.max_position - 4;
    far.order          = fact_order::as_given;
    injection_batch batch(s.device_store);
    batch.add(compose(s.device_store, {11, 13}, far), free_slots);
    REQUIRE_THROWS_AS(
      (batch.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
  }
  SECTION("a workspace too small for the batch")
  {
    injection_batch batch = make_batch(s.device_store, 0);
    injection_workspace small(batch.num_tokens() - 1);
    REQUIRE_THROWS_AS(
      (batch.run<S, C>(s.device_desc, s.device_rotation, device_context{small, ref})), logic_error);
    unchanged();
  }
  SECTION("a batch of a host store")
  {
    injection_batch host_batch = make_batch(s.host_store, 0);
    REQUIRE_THROWS_AS(
      (host_batch.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
  }
  SECTION("a stale batch, then a fresh one is accepted")
  {
    injection_batch stale = make_batch(s.device_store, 0);
    insert_fact(s.device_store, 900, 2, 3, g);
    insert_fact(s.host_store, 900, 2, 3, g);
    REQUIRE_THROWS_AS(
      (stale.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
    injection_batch fresh = make_batch(s.device_store, 0);
    fresh.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref});
    make_batch(s.host_store, 0).run(s.host_desc, s.host_rotation);
    REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);
  }
}

}  // namespace

TEST_CASE("a refused checked device injection leaves the cache unchanged", "[gpu][inject]")
{
  auto const cases = geometry_cases();
  SECTION("vLLM FlashAttention HND, bf16 -> fp8 e4m3")
  {
    require_refusals_leave_cache_unchanged<bf16_to_e4m3>(engine_layout::vllm_flash_attn_hnd,
                                                         cases[0]);
  }
  SECTION("vLLM legacy, fp32 -> fp32")
  {
    require_refusals_leave_cache_unchanged<fp32_to_fp32>(engine_layout::vllm_legacy, cases[2]);
  }
}

TEST_CASE(
  "the dtype dispatch and a named dtype pair launch the same kernels; a wrong pair is "
  "refused",
  "[gpu][inject]")
{
  // Every other test here names its pair (run<S, C>, extract<S, C>), which compiles only
  // that pair's kernels; this one goes through the run-time dispatch (all fifteen pairs compiled
  // for the bfloat16 table) and checks it lands on the same bytes as the host.
  auto const g = geometry_cases()[0];
  scenario<bf16_to_bf16> s(engine_layout::vllm_flash_attn_nhd, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  injection_batch db = make_batch(s.device_store, 0);
  injection_workspace workspace(db.num_tokens());

  // A pair other than the store's and the cache's: refused before staging, cache unchanged.
  REQUIRE_THROWS_AS(
    (db.run<float, float>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
    logic_error);
  REQUIRE_THROWS_AS((db.run<bfloat16_t, float8_e4m3_t>(
                      s.device_desc, s.device_rotation, device_context{workspace, ref})),
                    logic_error);
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);

  db.run(s.device_desc, s.device_rotation, device_context{workspace, ref});
  make_batch(s.host_store, 0).run(s.host_desc, s.host_rotation);
  REQUIRE(first_difference(s.host_bytes(), s.original) != -1);
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);

  // Extraction through the dispatch: the first 27 injected tokens back into both stores.
  std::vector<std::int64_t> const slots(db.slots().begin(), db.slots().begin() + 27);
  std::vector<std::int32_t> ids(slots.size(), 7);
  REQUIRE_THROWS_AS(
    (extract<float, bfloat16_t>(
      s.device_desc, slots, 12, s.device_rotation, s.device_store, 600, 3, ids, ref)),
    logic_error);
  REQUIRE_FALSE(s.device_store.contains(600));
  extract_host(s.host_desc, slots, 12, s.host_rotation, s.host_store, 600, 3, ids);
  extract(s.device_desc, slots, 12, s.device_rotation, s.device_store, 600, 3, ids, ref);
  REQUIRE(s.host_store.at(600).pages == s.device_store.at(600).pages);
  REQUIRE(first_difference(s.host_store.pool_to_host(), s.device_store.pool_to_host()) == -1);
}

// ------------------------------------------------------------------------------------------------
// The device seam (engine.cuh, memory.cuh): a capture stored into a device store on a stream,
// one request injected from a device store through a cache adapter, and the memory facade serving
// from a device store; each against the host path of the same calls (engine.hpp, memory.hpp).

namespace {

using inferscale_test::memory_fixtures::slot_adapter;
static_assert(is_cache_adapter_v<slot_adapter>);

/// A capture of `tokens` tokens in the store's shard geometry, every row written with values of
/// a fixed seed (normal, sd 1.5: within every store dtype's range).
kv_capture make_capture(kv_geometry const& g, std::int64_t tokens)
{
  kv_capture c{g, tokens};
  std::mt19937_64 rng(0xca97);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<float> rows(static_cast<std::size_t>(tokens * g.num_kv_heads * g.head_dim));
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (auto& x : rows) {
        x = normal(rng);
      }
      auto const view =
        make_token_head_view<float const>(rows.data(), tokens, g.num_kv_heads, g.head_dim);
      if (kv == 0) {
        c.write_keys(l, 0, view);
      } else {
        c.write_values(l, 0, view);
      }
    }
  }
  return c;
}

std::vector<std::int32_t> token_ids(std::int32_t first, std::int32_t count)
{
  std::vector<std::int32_t> out(static_cast<std::size_t>(count));
  for (std::int32_t j = 0; j < count; ++j) {
    out[static_cast<std::size_t>(j)] = first + j;
  }
  return out;
}

/// What a refused call must leave as it was: the store's catalogue and pool.
struct store_state {
  std::int64_t facts;
  std::int64_t free_pages;
  std::uint64_t version;
  bytes pool;
  bool operator==(store_state const& o) const
  {
    return facts == o.facts && free_pages == o.free_pages && version == o.version && pool == o.pool;
  }
};
store_state state_of(kv_store const& s)
{
  return {s.num_facts(), s.free_pages(), s.version(), s.pool_to_host()};
}

template <class Pair>
void require_seam_equals_host(engine_layout layout, geometry_case const& g)
{
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<Pair> s(layout, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // 1. A capture's ranges stored on the stream land in the device pool as a host insert writes
  // them into the host pool (the stores share their history, so the same pages; the populated
  // history leaves the free pages out of order, so a fact's pages are not one run).
  kv_capture const capture = make_capture(s.device_store.geometry(), 40);
  std::vector<captured_fact> const captured{
    {201, 7, 0, token_ids(2010, 9)}, {202, 7, 9, token_ids(2020, 17)}, {203, 7, 39, {2030}}};
  store_captured_facts(s.host_store, capture, captured);
  store_captured_facts(s.device_store, capture, captured, ref);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  for (captured_fact const& f : captured) {
    REQUIRE(s.device_store.at(f.fact_id).pages == s.host_store.at(f.fact_id).pages);
    REQUIRE(s.device_store.at(f.fact_id).token_ids == f.token_ids);
  }
  REQUIRE(first_difference(s.device_store.pool_to_host(), s.host_store.pool_to_host()) == -1);

  // Refusals store nothing: an id already stored, a fact beyond the capture, more pages than are
  // free (five 40-token facts), an incomplete capture, a NaN.
  store_state const before = state_of(s.device_store);
  REQUIRE_THROWS_AS(
    store_captured_facts(s.device_store, capture, {{301, 7, 0, {1}}, {11, 7, 1, {2}}}, ref),
    logic_error);
  REQUIRE_THROWS_AS(
    store_captured_facts(s.device_store, capture, {{301, 7, 35, token_ids(0, 6)}}, ref),
    logic_error);
  std::vector<captured_fact> too_many;
  for (std::uint64_t id = 301; id < 306; ++id) {
    too_many.push_back({id, 7, 0, token_ids(0, 40)});
  }
  REQUIRE_THROWS_AS(store_captured_facts(s.device_store, capture, too_many, ref), logic_error);
  kv_capture partial{s.device_store.geometry(), 4};
  REQUIRE_THROWS_AS(
    store_captured_facts(s.device_store, partial, {{301, 7, 0, token_ids(0, 4)}}, ref),
    logic_error);
  kv_capture poisoned = make_capture(s.device_store.geometry(), 40);
  std::vector<float> nan_row(
    static_cast<std::size_t>(s.device_store.geometry().num_kv_heads * g.head_dim), 0.0f);
  nan_row[1] = std::numeric_limits<float>::quiet_NaN();
  poisoned.write_values(0,
                        20,
                        make_token_head_view<float const>(
                          nan_row.data(), 1, s.device_store.geometry().num_kv_heads, g.head_dim));
  REQUIRE_THROWS_AS(
    store_captured_facts(
      s.device_store, poisoned, {{301, 7, 0, token_ids(0, 4)}, {302, 7, 18, token_ids(0, 4)}}, ref),
    logic_error);
  REQUIRE(state_of(s.device_store) == before);

  // 2. One request through a cache adapter: the prefix and the captured facts at p0 = 12, in the
  // blocks no request of make_batch uses; the device cache ends equal to the host's.
  compose_options o{};
  o.first_position                       = 12;
  o.instruction_prefix                   = prefix_id;
  composition const host_plan            = compose(s.host_store, {202, 201, 203, 13}, o);
  composition const device_plan          = compose(s.device_store, {202, 201, 203, 13}, o);
  std::vector<std::int32_t> const blocks = unused_blocks();
  std::vector<std::int64_t> const slots  = slots_from_block_table(
    blocks.data(), static_cast<std::int64_t>(blocks.size()), block_size, 0, host_plan.length());
  slot_adapter host_adapter{s.host_desc, slots};
  slot_adapter device_adapter{s.device_desc, slots};
  injection_workspace workspace(host_plan.length());

  // One request as a step of one: planned (the adapter allocates), run on the device.
  auto const run_one = [&](kv_store const& store,
                           composition const& plan,
                           slot_adapter& adapter,
                           injection_workspace& ws) {
    injection_batch step{store};
    step.add(plan, adapter);
    step.run(adapter.cache(), s.device_rotation, device_context{ws, ref});
  };

  // Refused before anything is written or committed: an empty plan (before the adapter
  // allocates), then, at the run, a host store, a workspace too small, too few slots, a slot
  // beyond the cache, a position beyond the table.
  injection_workspace small(host_plan.length() - 1);
  REQUIRE_THROWS_AS(run_one(s.device_store, composition{}, device_adapter, workspace), logic_error);
  REQUIRE(device_adapter.allocated_at == -1);
  REQUIRE_THROWS_AS(run_one(s.host_store, host_plan, device_adapter, workspace), logic_error);
  REQUIRE_THROWS_AS(run_one(s.device_store, device_plan, device_adapter, small), logic_error);
  device_adapter.short_by = 1;
  REQUIRE_THROWS_AS(run_one(s.device_store, device_plan, device_adapter, workspace), logic_error);
  device_adapter.short_by = 0;
  device_adapter.slots[5] = s.device_desc.num_slots();
  REQUIRE_THROWS_AS(run_one(s.device_store, device_plan, device_adapter, workspace), logic_error);
  device_adapter.slots[5] = slots[5];
  compose_options far     = o;
  far.first_position      = s.device_rotation.max_position - 4;
  REQUIRE_THROWS_AS(
    run_one(
      s.device_store, compose(s.device_store, {202, 201, 203, 13}, far), device_adapter, workspace),
    logic_error);
  REQUIRE(device_adapter.committed.empty());
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);
  REQUIRE(state_of(s.device_store) == before);

  {
    injection_batch host_one{s.host_store};
    host_one.add(host_plan, host_adapter);
    host_one.run(host_adapter.cache(), s.host_rotation);
  }
  run_one(s.device_store, device_plan, device_adapter, workspace);
  REQUIRE(device_adapter.allocated_at == 12);
  REQUIRE(device_adapter.committed == std::vector<std::int64_t>{device_plan.length()});
  REQUIRE(host_adapter.committed == device_adapter.committed);
  bytes const device = s.device_bytes(stream.get());
  REQUIRE(first_difference(s.host_bytes(), s.original) != -1);  // something was written
  REQUIRE(first_difference(device, s.host_bytes()) == -1);

  // 3. One injection step planned three ways — fact 11 at p0 = 300 through a span (block 6), facts
  // {12, 13} at p0 = 40 as prompt tokens 3.. of the block table {10, 11} (the cache's block size),
  // fact 15 at p0 = 7 through an adapter (block 4) — run on the device equals the same step run
  // on the host; each adapter commits once, after its run.
  compose_options p{};
  p.order          = fact_order::as_given;
  auto const plans = [&](kv_store const& st) {
    std::vector<composition> out;
    std::vector<std::pair<std::vector<std::uint64_t>, std::int64_t>> const requests{
      {{11}, 300}, {{12, 13}, 40}, {{15}, 7}};
    for (auto const& [ids, p0] : requests) {
      p.first_position = p0;
      out.push_back(compose(st, ids, p));
    }
    return out;
  };
  std::vector<composition> const hp = plans(s.host_store), dp = plans(s.device_store);
  std::vector<std::int64_t> span_slots;
  for (std::int64_t j = 0; j < 7; ++j) {
    span_slots.push_back(6 * block_size + j);
  }
  std::vector<std::int32_t> const table{10, 11};
  slot_adapter host_step_adapter{s.host_desc, {64, 65, 66, 67, 68}};
  slot_adapter device_step_adapter{s.device_desc, {64, 65, 66, 67, 68}};
  injection_batch host_step(s.host_store), device_step(s.device_store);
  for (auto [step, ps, desc, adapter] :
       {std::tuple{&host_step, &hp, &s.host_desc, &host_step_adapter},
        std::tuple{&device_step, &dp, &s.device_desc, &device_step_adapter}}) {
    step->add((*ps)[0], span_slots);
    step->add((*ps)[1], *desc, table, 3);
    step->add((*ps)[2], *adapter);
  }
  REQUIRE(device_step.slots() == host_step.slots());
  REQUIRE(
    std::vector<std::int64_t>(device_step.slots().begin() + 7, device_step.slots().begin() + 21) ==
    std::vector<std::int64_t>{
      163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 173, 174, 175, 176});
  injection_workspace step_workspace(device_step.num_tokens());
  // A refused device run (a workspace too small) stages, launches and commits nothing.
  injection_workspace tiny(device_step.num_tokens() - 1);
  REQUIRE_THROWS_AS(device_step.run(s.device_desc, s.device_rotation, device_context{tiny, ref}),
                    logic_error);
  REQUIRE(device_step_adapter.committed.empty());
  REQUIRE(first_difference(s.device_bytes(stream.get()), device) == -1);
  host_step.run(s.host_desc, s.host_rotation);
  device_step.run(s.device_desc, s.device_rotation, device_context{step_workspace, ref});
  REQUIRE(device_step_adapter.committed == std::vector<std::int64_t>{5});
  REQUIRE(host_step_adapter.committed == device_step_adapter.committed);
  REQUIRE(step_workspace.read_errors(ref).total() == 0);
  bytes const stepped = s.device_bytes(stream.get());
  REQUIRE(first_difference(stepped, device) != -1);  // the step wrote something
  REQUIRE(first_difference(stepped, s.host_bytes()) == -1);
}

}  // namespace

TEST_CASE(
  "the device seam: a capture stored on a stream and a request injected through a cache "
  "adapter equal the host seam's",
  "[gpu][inject][engine]")
{
  auto const cases = geometry_cases();
  SECTION("vLLM FlashAttention NHD, bf16 -> bf16, heads 1..3 of 4 (the capture is the shard's)")
  {
    require_seam_equals_host<bf16_to_bf16>(engine_layout::vllm_flash_attn_nhd, cases[1]);
  }
  SECTION("vLLM legacy, fp32 -> fp32, scalar path")
  {
    require_seam_equals_host<fp32_to_fp32>(engine_layout::vllm_legacy, cases[2]);
  }
  SECTION("SGLang token pool, bf16 -> fp8 e4m3 per-head scales")
  {
    require_seam_equals_host<bf16_to_e4m3>(engine_layout::sglang_token_pool, cases[0]);
  }
}

namespace {

kv_geometry const capture_geometry{3, 2, 16};

/// A host or device store of `t` with a history (facts inserted and erased): its free pages are
/// out of order and hold stale bytes, the same on either memory space.
kv_store capture_store(dtype t, memory_space where)
{
  kv_store_config c{};
  c.model       = capture_geometry;
  c.store_dtype = t;
  c.page_size   = 8;
  c.num_pages   = 12;
  c.space       = where;
  kv_store s{c};
  std::vector<float> fill(static_cast<std::size_t>(3 * 16 * 2 * 16), 2.5f);
  auto const v = make_fact_kv_view<float const>(fill.data(), 3, 16, 2, 16);
  for (std::uint64_t id = 90; id < 93; ++id) {
    s.insert<float>(id, 1, token_ids(0, 16), v, v);
  }
  s.erase(90);
  s.erase(92);
  return s;
}

/// Writes `rows` (`[tokens, heads, head_dim]`, any strides) as layer `l`'s K (kv 0) or V.
template <class Capture, class View, class... Stream>
void write_rows(Capture& c, int kv, std::int32_t l, std::int64_t first, View rows, Stream... s)
{
  if (kv == 0) {
    c.write_keys(l, first, rows, s...);
  } else {
    c.write_values(l, first, rows, s...);
  }
}

}  // namespace

TEMPLATE_TEST_CASE(
  "the device capture: hook rows written and stored on a stream equal the host "
  "capture stored, byte for byte; refusals change nothing",
  "[gpu][engine][capture]",
  float,
  half_t,
  bfloat16_t)
{
  using T                 = TestType;  // the element type the engine's hooks hand over
  dtype const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(dtype_of_v<T>), to_string(store_dtype));
  kv_geometry const g   = capture_geometry;
  std::int64_t const n  = 29;
  std::int64_t const ld = 40;  // the engine tensors' row stride: [n, H*D] rows padded to 40
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Each layer's K and V as an engine tensor of T (normal, sd 1.5), padding included.
  std::mt19937_64 rng(0x5eed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<T> engine(static_cast<std::size_t>(2 * g.num_layers * n * ld));
  for (T& x : engine) {
    x = from_float<T>(normal(rng));
  }
  device_buffer<T> const device_rows(engine);
  kv_capture host{g, n};
  device_kv_capture device{g, n, ref};
  std::vector<float> converted(static_cast<std::size_t>(n * 32));
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      std::int64_t const base = (l * 2 + kv) * n * ld;
      for (std::int64_t t = 0; t < n; ++t) {
        for (std::int64_t e = 0; e < 32; ++e) {
          converted[static_cast<std::size_t>(t * 32 + e)] =
            to_float(engine[static_cast<std::size_t>(base + t * ld + e)]);
        }
      }
      write_rows(host, kv, l, 0, make_token_head_view<float const>(converted.data(), n, 2, 16));
      T const* const rows = device_rows.data() + base;
      if (l == 2 && kv == 1) {  // two ubatches: tokens [0, 10), then [10, n)
        write_rows(device, kv, l, 0, make_token_head_view<T const>(rows, 10, 2, 16, ld, 16), ref);
        write_rows(device,
                   kv,
                   l,
                   10,
                   make_token_head_view<T const>(rows + 10 * ld, n - 10, 2, 16, ld, 16),
                   ref);
      } else {
        write_rows(device, kv, l, 0, make_token_head_view<T const>(rows, n, 2, 16, ld, 16), ref);
      }
    }
  }
  REQUIRE(device.complete());

  // Ranges of 9, 17, 1 and 8 tokens (last pages partly used, an overlap under another id).
  std::vector<captured_fact> const facts{{201, 7, 0, token_ids(2010, 9)},
                                         {202, 7, 9, token_ids(2020, 17)},
                                         {203, 7, 28, {2030}},
                                         {204, 7, 3, token_ids(0, 8)}};
  kv_store host_store   = capture_store(store_dtype, memory_space::host);
  kv_store device_store = capture_store(store_dtype, memory_space::device);
  store_captured_facts(host_store, host, facts);
  store_captured_facts(device_store, device, facts, ref);
  REQUIRE(device.faulty_tokens(ref).empty());  // waits for the stream
  for (captured_fact const& f : facts) {
    REQUIRE(device_store.at(f.fact_id).pages == host_store.at(f.fact_id).pages);
    REQUIRE(device_store.at(f.fact_id).token_ids == f.token_ids);
  }
  REQUIRE(first_difference(device_store.pool_to_host(), host_store.pool_to_host()) == -1);

  // Refused before anything is reserved or enqueued: an id already stored, an id twice, a range
  // beyond the capture, more pages than are free (3 left), an incomplete capture, another
  // geometry, a host store.
  store_state const before = state_of(device_store);
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, device, {{301, 7, 0, {1}}, {201, 7, 1, {2}}}, ref),
    logic_error);
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, device, {{301, 7, 0, {1}}, {301, 7, 1, {2}}}, ref),
    logic_error);
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, device, {{301, 7, 25, token_ids(0, 6)}}, ref), logic_error);
  REQUIRE_THROWS_AS(store_captured_facts(
                      device_store, device, {{301, 7, 0, token_ids(0, 29)}, {302, 7, 0, {1}}}, ref),
                    logic_error);
  device_kv_capture partial{g, 4, ref};
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    write_rows(partial, 0, l, 0, make_token_head_view<T const>(device_rows.data(), 4, 2, 16), ref);
    if (l != 1) {
      write_rows(
        partial, 1, l, 0, make_token_head_view<T const>(device_rows.data(), 4, 2, 16), ref);
    }
  }
  REQUIRE_FALSE(partial.complete(0, 1));
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, partial, {{301, 7, 0, token_ids(0, 4)}}, ref), logic_error);
  device_kv_capture other{kv_geometry{3, 2, 8}, 4, ref};
  REQUIRE_THROWS_AS(store_captured_facts(device_store, other, {{301, 7, 0, {1}}}, ref),
                    logic_error);
  kv_store host_target = capture_store(store_dtype, memory_space::host);
  REQUIRE_THROWS_AS(store_captured_facts(host_target, device, {{301, 7, 0, {1}}}, ref),
                    logic_error);
  REQUIRE(host_target.num_facts() == 1);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  REQUIRE(state_of(device_store) == before);

  // Refused writes record nothing: a layer beyond the geometry, tokens beyond the buffer, rows of
  // another head count, null data.
  device_kv_capture fresh{g, 4, ref};
  auto const rows4 = make_token_head_view<T const>(device_rows.data(), 4, 2, 16);
  REQUIRE_THROWS_AS(fresh.write_keys(3, 0, rows4, ref), logic_error);
  REQUIRE_THROWS_AS(fresh.write_keys(0, 1, rows4, ref), logic_error);
  REQUIRE_THROWS_AS(
    fresh.write_keys(0, 0, make_token_head_view<T const>(device_rows.data(), 4, 1, 32), ref),
    logic_error);
  REQUIRE_THROWS_AS(fresh.write_keys(0, 0, make_token_head_view<T const>(nullptr, 4, 2, 16), ref),
                    logic_error);
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    fresh.write_values(l, 0, rows4, ref);
  }
  REQUIRE_FALSE(fresh.complete(0, 1));
}

TEST_CASE(
  "the device capture refuses facts whose K/V is not finite in the store dtype before storing "
  "anything",
  "[gpu][engine][capture]")
{
  kv_geometry const g = capture_geometry;
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  // 6 tokens of ones; the odd rows (K of layer 1, V of layer 0) hold 1e6 at token 2 (beyond
  // float16, within bfloat16) and a NaN at token 5.
  std::vector<float> rows(static_cast<std::size_t>(6 * 32), 1.0f);
  device_buffer<float> const ones(rows);
  rows[2 * 32 + 3]  = 1e6f;
  rows[5 * 32 + 17] = std::numeric_limits<float>::quiet_NaN();
  device_buffer<float> const odd(rows);
  device_kv_capture made{g, 6, ref};
  device_kv_capture capture = std::move(made);  // a moved buffer is the same buffer
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    capture.write_keys(
      l, 0, make_token_head_view<float const>(l == 1 ? odd.data() : ones.data(), 6, 2, 16), ref);
    capture.write_values(
      l, 0, make_token_head_view<float const>(l == 0 ? odd.data() : ones.data(), 6, 2, 16), ref);
  }
  REQUIRE(capture.faulty_tokens(ref).empty());  // no check yet

  // A NaN: refused in any dtype, the store unchanged (no page reserved, no fact recorded).
  kv_store bf16_store           = capture_store(dtype::bfloat16, memory_space::device);
  store_state const bf16_before = state_of(bf16_store);
  std::vector<captured_fact> nan_facts{{1, 1, 0, token_ids(0, 2)}, {2, 1, 4, token_ids(0, 2)}};
  REQUIRE_THROWS_WITH(
    store_captured_facts(bf16_store, capture, nan_facts, ref),
    Catch::Contains("fact 2 holds a NaN") && Catch::Contains("at token 1 (captured token 5)"));
  REQUIRE(capture.faulty_tokens(ref) == std::vector<std::int64_t>{5});
  REQUIRE(state_of(bf16_store) == bf16_before);
  // 1e6 is within bfloat16: the first 5 tokens are stored.
  store_captured_facts(bf16_store, capture, {{1, 1, 0, token_ids(0, 5)}}, ref);
  REQUIRE(capture.faulty_tokens(ref).empty());  // the last check's flags
  REQUIRE(bf16_store.contains(1));
  REQUIRE(bf16_store.num_facts() == bf16_before.facts + 1);

  // Beyond float16: refused with every faulty token listed, the store unchanged.
  kv_store half_store           = capture_store(dtype::float16, memory_space::device);
  store_state const half_before = state_of(half_store);
  REQUIRE_THROWS_AS(store_captured_facts(half_store, capture, {{1, 1, 0, token_ids(0, 6)}}, ref),
                    logic_error);
  REQUIRE(capture.faulty_tokens(ref) == std::vector<std::int64_t>{2, 5});
  REQUIRE(state_of(half_store) == half_before);
  store_captured_facts(half_store, capture, {{1, 1, 0, token_ids(0, 2)}, {2, 1, 3, {7}}}, ref);
  REQUIRE(half_store.num_facts() == half_before.facts + 2);
}

namespace {

/// fake::plain_model (tests/common/fake_model.hpp) as a GPU engine's model adapter as well: its
/// device encode runs the host forward, uploads each plane and hands every layer's rows to the
/// device capture's write kernels on the stream, as a GPU engine's hooks would. `nan_at` puts a
/// NaN into V of layer 1 at that token.
struct device_plain_model : inferscale_test::fake::plain_model {
  using plain_model::encode;
  void encode(std::vector<std::int32_t> const& tokens,
              std::int64_t first_position,
              device_kv_capture& out,
              cuda::stream_ref stream)
  {
    kv_geometry const g  = geometry();
    std::int64_t const n = static_cast<std::int64_t>(tokens.size());
    kv_capture host{g, n};
    plain_model::encode(tokens, first_position, host);
    std::int64_t const row = g.elements_per_token_layer();
    for (int kv = 0; kv < 2; ++kv) {
      float const* const plane = kv == 0 ? host.keys().data_handle() : host.values().data_handle();
      std::vector<float> rows(plane, plane + g.num_layers * n * row);
      if (kv == 1 && nan_at >= 0) {
        rows[static_cast<std::size_t>((n + nan_at) * row + 2)] =
          std::numeric_limits<float>::quiet_NaN();
      }
      uploads.emplace_back(rows);  // kept until the writes have run
      for (std::int32_t l = 0; l < g.num_layers; ++l) {
        auto const view = make_token_head_view<float const>(
          uploads.back().data() + l * n * row, n, g.num_kv_heads, g.head_dim);
        if (kv == 0) {
          out.write_keys(l, 0, view, stream);
        } else {
          out.write_values(l, 0, view, stream);
        }
      }
    }
  }
  std::int64_t nan_at{-1};
  std::vector<device_buffer<float>> uploads;
};

static_assert(is_device_model_adapter_v<device_plain_model>);
static_assert(is_model_adapter_v<device_plain_model>);
static_assert(!is_device_model_adapter_v<inferscale_test::fake::plain_model>);

kv_store encode_store(dtype t, memory_space where)
{
  kv_store_config c{};
  c.model       = inferscale_test::fake::tiny;
  c.store_dtype = t;
  c.page_size   = 4;
  c.num_pages   = 16;
  c.space       = where;
  return kv_store{c};
}

}  // namespace

TEST_CASE(
  "encode_facts with a device model adapter: the device store equals the host adapter's, byte "
  "for byte; refusals change nothing",
  "[gpu][engine][capture]")
{
  dtype const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(store_dtype));
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  device_plain_model model;
  std::vector<std::int32_t> const tokens{11, 12, 13, 14, 15, 16, 17};
  // Ranges of 5, 1 and 2 tokens (last pages partly used), overlapping.
  std::vector<captured_fact> const facts{
    {1, 5, 1, {12, 13, 14, 15, 16}}, {2, 5, 6, {17}}, {3, 5, 0, {11, 12}}};
  kv_store host_store   = encode_store(store_dtype, memory_space::host);
  kv_store device_store = encode_store(store_dtype, memory_space::device);
  encode_facts(model, host_store, tokens, 3, facts);
  encode_facts(model, device_store, tokens, 3, facts, ref);
  REQUIRE(model.forwards == 2);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  for (captured_fact const& f : facts) {
    REQUIRE(device_store.at(f.fact_id).pages == host_store.at(f.fact_id).pages);
    REQUIRE(device_store.at(f.fact_id).token_ids == f.token_ids);
  }
  REQUIRE(first_difference(device_store.pool_to_host(), host_store.pool_to_host()) == -1);

  // Refused before the forward: token ids that differ from the encoded ones, a host store.
  store_state const before = state_of(device_store);
  REQUIRE_THROWS_WITH(encode_facts(model, device_store, tokens, 3, {{4, 5, 0, {11, 99}}}, ref),
                      Catch::Contains("token ids differ"));
  kv_store host_target = encode_store(store_dtype, memory_space::host);
  REQUIRE_THROWS_AS(encode_facts(model, host_target, tokens, 3, {{4, 5, 0, {11}}}, ref),
                    logic_error);
  REQUIRE(model.forwards == 2);
  // Refused after the forward: a NaN in one fact's tokens stores none of them.
  model.nan_at = 4;
  REQUIRE_THROWS_WITH(
    encode_facts(model, device_store, tokens, 3, {{4, 5, 0, {11}}, {5, 5, 3, {14, 15}}}, ref),
    Catch::Contains("fact 5 holds a NaN") && Catch::Contains("at token 1 (captured token 4)"));
  REQUIRE(model.forwards == 3);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  REQUIRE(state_of(device_store) == before);
  REQUIRE(host_target.num_facts() == 0);
}

namespace {

namespace mf = inferscale_test::memory_fixtures;

/// The memory of the facade tests (tests/memory/memory_host.cpp) with its store in `where`.
memory make_seam_memory(memory_space where)
{
  return memory{mf::tiny_memory_config(dtype::float32, 64, where)};
}

/// The same deployment with its store on the host and on the device: the prefix, the users
/// added alike, and the engine's own cos/sin table on each side (the same values: computed
/// rope_params may differ in the last bit between the host's and the device's sincos).
struct seam_memories {
  memory host_memory   = make_seam_memory(memory_space::host);
  memory device_memory = make_seam_memory(memory_space::device);
  inferscale_test::fake::branching_model model;
  mf::word_embedder embedder;
  encoding_options o;
  std::vector<float> values = make_rope_cos_sin_values<float>(model.rotation(), 256);
  device_buffer<float> device_values{values};
  rope_cos_sin_table<float> host_table =
    make_rope_cos_sin_table(model.rotation(), values.data(), 256);
  rope_cos_sin_table<float> device_table =
    make_rope_cos_sin_table(model.rotation(), device_values.data(), 256);

  explicit seam_memories(std::vector<std::pair<std::uint64_t, mf::user_data const*>> const& users)
  {
    o.window = 3;
    for (memory* m : {&host_memory, &device_memory}) {
      m->set_instruction_prefix(model, {11, 12, 13}, 1, 0);
      for (auto const& [ns, u] : users) {
        m->add_conversation(model, embedder, ns, u->c, u->facts, u->texts, o);
      }
    }
  }
};

}  // namespace

TEST_CASE(
  "memory::serve from a device store injects the host serve's bytes; a refusal commits "
  "nothing",
  "[gpu][memory]")
{
  mf::user_data const user = mf::make_user(7, 100, 9);
  seam_memories s({{7, &user}});
  memory& host_memory         = s.host_memory;
  memory& device_memory       = s.device_memory;
  mf::word_embedder& embedder = s.embedder;
  auto const& host_table      = s.host_table;
  auto const& device_table    = s.device_table;

  mf::host_cache host_cache;  // 2 layers x (K, V) x 256 slots x 1 head x 4, every element -1
  device_buffer<float> device_storage{host_cache.data};
  slot_adapter device_adapter{
    make_contiguous_cache(
      dtype::float32, device_storage.data(), {2, 2, 256, 1, 4}, {2 * 256 * 4, 256 * 4, 4, 4, 1}),
    {}};
  for (std::int64_t j = 0; j < 256; ++j) {
    device_adapter.slots.push_back(j);
  }
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  injection_workspace small(2);
  REQUIRE_THROWS_AS(
    device_memory.serve(
      embedder, 7, user.texts[4], 2, 5, device_adapter, device_table, device_context{small, ref}),
    logic_error);
  REQUIRE(device_adapter.committed.empty());
  REQUIRE(device_storage.to_host() == host_cache.data);  // untouched: every element still -1

  injection_workspace workspace(64);
  memory_request const h =
    host_memory.serve(embedder, 7, user.texts[4], 2, 5, host_cache, host_table);
  memory_request const d = device_memory.serve(
    embedder, 7, user.texts[4], 2, 5, device_adapter, device_table, device_context{workspace, ref});
  REQUIRE(d.fact_ids == h.fact_ids);
  REQUIRE(d.plan.token_ids == h.plan.token_ids);
  REQUIRE(device_adapter.allocated_at == 5);
  REQUIRE(device_adapter.committed == host_cache.committed);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  std::vector<float> const device = device_storage.to_host();
  REQUIRE(device != std::vector<float>(device.size(), -1.0f));
  REQUIRE(std::memcmp(device.data(), host_cache.data.data(), device.size() * sizeof(float)) == 0);

  // inject() of a prepared plan: the same bytes again, into slots 100 ..
  composition const plan = device_memory.prepare(d.fact_ids, 5);
  for (std::int64_t j = 0; j < 256; ++j) {
    device_adapter.slots[static_cast<std::size_t>(j)] = (j + 100) % 256;
  }
  device_memory.inject(plan, device_adapter, device_table, device_context{workspace, ref});
  mf::host_cache shifted{1, 100};
  host_memory.inject(host_memory.prepare(h.fact_ids, 5), shifted, host_table);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  std::vector<float> const again = device_storage.to_host();
  for (std::int64_t l = 0; l < 2; ++l) {
    for (std::int64_t slot = 100; slot < 100 + plan.length(); ++slot) {
      for (std::int64_t d4 = 0; d4 < 4; ++d4) {
        std::size_t const v = static_cast<std::size_t>(((l * 2 + 1) * 256 + slot) * 4 + d4);
        CAPTURE(l, slot, d4);
        REQUIRE(again[v] == shifted.data[v]);
        REQUIRE(again[v - 256 * 4] == shifted.data[v - 256 * 4]);  // the rotated key
      }
    }
  }
}

TEST_CASE(
  "memory::serve_step from a device store injects the host step's bytes in one launch; a refusal "
  "commits nothing",
  "[gpu][memory]")
{
  mf::user_data const a = mf::make_user(7, 100, 9);
  mf::user_data const b = mf::make_user(8, 200, 6, 2);
  seam_memories s({{7, &a}, {8, &b}});
  memory& host_memory         = s.host_memory;
  memory& device_memory       = s.device_memory;
  mf::word_embedder& embedder = s.embedder;
  auto const& host_table      = s.host_table;
  auto const& device_table    = s.device_table;

  // Three sequences of one cache on each side; sequence i's tokens go to slots 3 j + i.
  mf::host_cache host_cache;
  device_buffer<float> device_storage{host_cache.data};
  paged_kv_cache const device_desc = make_contiguous_cache(
    dtype::float32, device_storage.data(), {2, 2, 256, 1, 4}, {2 * 256 * 4, 256 * 4, 4, 4, 1});
  std::vector<slot_adapter> host_sequences;
  std::vector<slot_adapter> device_sequences;
  for (std::int64_t i = 0; i < 3; ++i) {
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < 60; ++j) {
      slots.push_back(3 * j + i);
    }
    host_sequences.emplace_back(host_cache.cache(), slots);
    device_sequences.emplace_back(device_desc, slots);
  }
  struct ask {
    std::uint64_t ns;
    std::string query;
    std::int64_t p0;
  };
  std::vector<ask> const asks{{7, a.texts[4], 5}, {8, b.texts[2], 0}, {7, a.texts[6], 9}};
  std::vector<memory_step_request<slot_adapter>> host_requests;
  std::vector<memory_step_request<slot_adapter>> device_requests;
  for (std::size_t i = 0; i < asks.size(); ++i) {
    host_requests.push_back({asks[i].ns, asks[i].query, asks[i].p0, &host_sequences[i]});
    device_requests.push_back({asks[i].ns, asks[i].query, asks[i].p0, &device_sequences[i]});
  }
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Refused before any sequence allocates: a workspace too small for the step's tokens (3 + 2 x 3,
  // 3 + 2 x 2 and 3 + 2 x 3), a host store.
  injection_workspace small(20);
  REQUIRE_THROWS_AS(device_memory.serve_step(
                      embedder, device_requests, 2, device_table, device_context{small, ref}),
                    logic_error);
  injection_workspace workspace(64);
  REQUIRE_THROWS_AS(
    host_memory.serve_step(embedder, host_requests, 2, host_table, device_context{workspace, ref}),
    logic_error);
  for (slot_adapter const& seq : device_sequences) {
    REQUIRE(seq.allocated_at == -1);
    REQUIRE(seq.committed.empty());
  }
  REQUIRE(device_storage.to_host() == host_cache.data);  // untouched: every element still -1

  std::vector<memory_request> const h =
    host_memory.serve_step(embedder, host_requests, 2, host_table);
  std::uint64_t const searches        = device_memory.searches();
  std::vector<memory_request> const d = device_memory.serve_step(
    embedder, device_requests, 2, device_table, device_context{workspace, ref});
  REQUIRE(device_memory.searches() == searches + 1);
  REQUIRE(d.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    REQUIRE(d[i].fact_ids == h[i].fact_ids);
    REQUIRE(d[i].plan.token_ids == h[i].plan.token_ids);
    REQUIRE(device_sequences[i].allocated_at == asks[i].p0);
    REQUIRE(device_sequences[i].committed == std::vector<std::int64_t>{d[i].plan.length()});
    REQUIRE(host_sequences[i].committed == device_sequences[i].committed);
  }
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  std::vector<float> const device = device_storage.to_host();
  REQUIRE(host_cache.data != std::vector<float>(host_cache.data.size(), -1.0f));
  REQUIRE(std::memcmp(device.data(), host_cache.data.data(), device.size() * sizeof(float)) == 0);

  // Forgetting user 8 on the stream: its pages zeroed there (no wait), as the host call does.
  std::vector<std::int64_t> pages;
  for (std::uint64_t id : device_memory.store().namespace_fact_ids(8)) {
    auto const& p = device_memory.store().at(id).pages;
    pages.insert(pages.end(), p.begin(), p.end());
  }
  REQUIRE_FALSE(pages.empty());
  REQUIRE(device_memory.store().pool_to_host() == host_memory.store().pool_to_host());
  REQUIRE(device_memory.erase_namespace(8, ref) == host_memory.erase_namespace(8));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  bytes const pool = device_memory.store().pool_to_host();
  std::size_t const page =
    pool.size() / static_cast<std::size_t>(device_memory.store().num_pages());
  for (std::int64_t p : pages) {
    REQUIRE(std::all_of(pool.begin() + static_cast<std::ptrdiff_t>(p * page),
                        pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * page),
                        [](auto x) { return x == 0; }));
  }
  REQUIRE(pool == host_memory.store().pool_to_host());
  // Adding the user again reuses those pages: the facade's write waits for the zeroing first.
  for (memory* m : {&host_memory, &device_memory}) {
    m->add_conversation(s.model, embedder, 8, b.c, b.facts, b.texts, s.o);
  }
  REQUIRE(device_memory.store().pool_to_host() == host_memory.store().pool_to_host());
}

TEST_CASE("store_captured_facts on a stream writes a host store on the host, as the host call does",
          "[inject][engine]")
{
  // Runs without a GPU: a host store never reaches the CUDA runtime, whatever the stream.
  kv_store_config c{};
  c.model       = kv_geometry{2, 2, 8};
  c.store_dtype = dtype::bfloat16;
  c.page_size   = 4;
  c.num_pages   = 8;
  c.space       = memory_space::host;
  kv_store by_host{c};
  kv_store by_stream{c};
  kv_capture const capture = make_capture(c.model, 12);
  std::vector<captured_fact> const captured{{1, 3, 0, token_ids(10, 5)},
                                            {2, 3, 5, token_ids(20, 7)}};
  cuda::stream_ref const no_stream{cudaStream_t{}};
  store_captured_facts(by_host, capture, captured);
  store_captured_facts(by_stream, capture, captured, no_stream);
  REQUIRE(by_stream.num_facts() == 2);
  REQUIRE(by_stream.at(2).token_ids == token_ids(20, 7));
  REQUIRE(first_difference(by_stream.pool_to_host(), by_host.pool_to_host()) == -1);
  // Element (layer 1, token 3 of fact 2, head 1, dim 5) of V, written out: the capture's value
  // rounded to bfloat16.
  std::int64_t const row =
    by_stream.ref().row_offset(by_stream.store_token(by_stream.at(2), 3), 1, 1);
  bytes const pool = by_stream.pool_to_host();
  bfloat16_t stored;
  std::memcpy(&stored, pool.data() + (row + 1 * 8 + 5) * 2, 2);
  REQUIRE(to_float(stored) == to_float(from_float<bfloat16_t>(capture.values()(1, 5 + 3, 1, 5))));

  store_state const before = state_of(by_stream);
  REQUIRE_THROWS_AS(
    store_captured_facts(by_stream, capture, {{3, 3, 10, token_ids(0, 3)}}, no_stream),
    logic_error);  // beyond the 12 captured tokens
  REQUIRE_THROWS_AS(
    store_captured_facts(by_stream, capture, {{3, 3, 0, {1}}, {3, 3, 1, {2}}}, no_stream),
    logic_error);  // an id twice
  REQUIRE(state_of(by_stream) == before);
}

// injection_workspace's resources: the device arrays ([3][capacity] int64 and the error counters)
// come from the device resource, the staging ([3][capacity] int64) from the pinned one, all on
// the null stream, and each goes back on destruction; staged arrays read back as staged.
TEST_CASE("an injection workspace allocates through the resources it is given",
          "[gpu][inject][memory_resource]")
{
  inferscale_test::counting_resource device{default_device_resource()};
  inferscale_test::counting_resource pinned{pinned_host_resource()};
  std::int64_t const capacity = 5;
  std::vector<std::int64_t> const tokens{7, 8, 9}, positions{100, 101, 102}, slots{3, -1, 40};
  {
    injection_workspace workspace(capacity, &device, &pinned);
    REQUIRE(device.allocations.size() == 2);
    REQUIRE(device.allocations[0].bytes == 3 * 5 * sizeof(std::int64_t));
    REQUIRE(device.allocations[1].bytes == sizeof(inject_device_errors));
    REQUIRE(pinned.allocations.size() == 1);
    REQUIRE(pinned.allocations[0].bytes == 3 * 5 * sizeof(std::int64_t));
    for (auto const& a : device.allocations) {
      REQUIRE(a.stream == nullptr);
    }
    REQUIRE(workspace.view().store_token == device.allocations[0].pointer);
    REQUIRE(workspace.device_errors() == device.allocations[1].pointer);

    cuda_stream stream;
    workspace.stage(injection_batch_view{tokens.data(), positions.data(), slots.data(), 3},
                    cuda::stream_ref{stream.get()});
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    injection_batch_view const v = workspace.view();
    REQUIRE(v.num_tokens == 3);
    auto const back = [&](std::int64_t const* p) {
      std::vector<std::int64_t> out(3);
      INFERSCALE_CUDA_TRY(
        cudaMemcpy(out.data(), p, 3 * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
      return out;
    };
    REQUIRE(back(v.store_token) == tokens);
    REQUIRE(back(v.position) == positions);
    REQUIRE(back(v.slot) == slots);
    REQUIRE(workspace.read_errors(cuda::stream_ref{stream.get()}).total() == 0);  // zeroed
    injection_workspace moved{std::move(workspace)};  // no second free of anything
    REQUIRE(device.deallocations.empty());
    REQUIRE(pinned.deallocations.empty());
  }
  REQUIRE(device.deallocations.size() == 2);
  REQUIRE(pinned.deallocations.size() == 1);
  REQUIRE(pinned.deallocations[0].pointer == pinned.allocations[0].pointer);
}
