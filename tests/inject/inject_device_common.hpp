// The fixtures of the device tests of injection and of the device seam, shared by
// tests/inject/inject_gpu.cu, tests/engine/engine_gpu.cu and tests/memory/memory_gpu.cu: geometry
// cases, facts populated into a store, engine caches on both sides (scenario), batches and
// requests, a capture of fixed values, and a store's state for the refusal checks. Written
// independently of the code under test (inject_common.hpp holds the element formats and the
// reference rotation). Functions are inline: each test unit uses a part of them.
#pragma once

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

namespace inferscale_inject_device {

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

inline std::vector<geometry_case> geometry_cases()
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
inline geometry_case large_case()
{
  return {"10 layers, 1185 tokens", 10, 2, 2, 0, 64, 64, rope_pairing::halves, true, true, 80};
}

inline constexpr std::int32_t block_size      = 16;  // engine tokens per block
inline constexpr std::int32_t store_page_size = 8;   // store tokens per page: facts span pages
inline constexpr std::int64_t store_pages     = 32;
inline constexpr std::int64_t default_rows    = 2048;  // cos/sin table rows

// Facts (id, tokens): an instruction prefix and seven facts of odd lengths.
inline constexpr std::uint64_t prefix_id = 1;
struct fact_spec {
  std::uint64_t id;
  std::int32_t tokens;
};
inline constexpr fact_spec facts[] = {
  {11, 7}, {12, 13}, {13, 1}, {14, 21}, {15, 5}, {16, 9}, {17, 17}};

/// Deterministic pre-RoPE K and V of a fact, `[layers, tokens, model heads, head_dim]` (fp32, so
/// both stores convert the same values to their dtype).
inline void insert_fact(
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
inline void populate(kv_store& store, geometry_case const& g)
{
  insert_fact(store, 100, 9, 10, g);
  insert_fact(store, prefix_id, 1, 6, g);
  store.erase(100);
  for (auto const& f : facts) {
    insert_fact(store, f.id, 7, f.tokens, g);
  }
}

inline kv_store_config store_config(geometry_case const& g,
                                    dtype store_dtype,
                                    memory_space space,
                                    kv_compression compression = kv_compression::none)
{
  kv_store_config c{};
  c.compression = compression;
  c.model       = kv_geometry{g.layers, g.model_heads, g.head_dim};
  c.first_head  = g.first_head;
  c.num_heads   = g.heads;
  c.store_dtype = store_dtype;
  c.page_size   = store_page_size;
  c.num_pages   = store_pages;
  c.space       = space;
  return c;
}

inline rope_params make_params(geometry_case const& g, double theta = 10000.0)
{
  rope_spec spec{};
  spec.head_dim   = g.head_dim;
  spec.rotary_dim = g.rotary_dim;
  spec.theta      = theta;
  spec.pairing    = g.pairing;
  return make_rope_params(spec);
}

/// fp8 scales, `[layer][K, V][count]`, count = heads (per head) or 1 (per tensor); 0.5 .. 1.5.
inline std::vector<float> make_scales(geometry_case const& g, kv_scale_granularity granularity)
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

inline void set_scales(paged_kv_cache& cache,
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

  scenario(engine_layout layout_,
           geometry_case const& g_,
           std::int64_t rows          = default_rows,
           kv_compression compression = kv_compression::none)
    : g{g_},
      layout{layout_},
      host_store{store_config(g_, dtype_of_v<S>, memory_space::host, compression)},
      device_store{store_config(g_, dtype_of_v<S>, memory_space::device, compression)},
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
inline std::int64_t first_difference(bytes const& a, bytes const& b)
{
  if (a.size() != b.size()) { return 0; }
  auto const m = std::mismatch(a.begin(), a.end(), b.begin());
  return m.first == a.end() ? -1 : static_cast<std::int64_t>(m.first - a.begin());
}

/// Engine blocks no request of make_batch uses (12-block caches).
inline std::vector<std::int32_t> unused_blocks() { return {6, 4, 10, 11}; }

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
inline std::vector<request> make_requests(kv_store const& store, std::int64_t shift)
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
inline injection_batch make_batch(kv_store const& store, std::int64_t shift)
{
  injection_batch batch(store);
  for (request const& r : make_requests(store, shift)) {
    batch.add(r.plan, r.slots());
  }
  return batch;
}

/// Fifteen requests of all the facts (1185 tokens) over blocks 0, 7, 14, ... (mod 80).
inline injection_batch make_large_batch(kv_store const& store)
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
                         s.layout != engine_layout::vllm_cpu &&
                         s.host_store.compression() == kv_compression::none));

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

// ------------------------------------------------------------------------------------------------
// The device seam's helpers (tests/engine/engine_gpu.cu, tests/memory/memory_gpu.cu)

using inferscale_test::memory_fixtures::slot_adapter;
static_assert(is_cache_adapter_v<slot_adapter>);

/// A capture of `tokens` tokens in the store's shard geometry, every row written with values of
/// a fixed seed (normal, sd 1.5: within every store dtype's range).
inline kv_capture make_capture(kv_geometry const& g, std::int64_t tokens)
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

inline std::vector<std::int32_t> token_ids(std::int32_t first, std::int32_t count)
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
inline store_state state_of(kv_store const& s)
{
  return {s.num_facts(), s.free_pages(), s.version(), s.pool_to_host()};
}

}  // namespace inferscale_inject_device
