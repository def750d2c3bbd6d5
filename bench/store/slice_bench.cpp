// slice_store (store_slice.hpp): a tensor-parallel rank's KV heads of a store's facts, copied into
// a store of their own (what the vLLM connector does for every rank at every new generation),
// next to std::memcpy of the same bytes between pre-touched buffers in the same iterations
// (fixture.hpp's run_host: copy_GB/s, vs_copy), and next to a new store of the slice's size
// allocated and filled by one memcpy (fresh_copy_GB/s: the copy into untouched memory that any new
// store pays, the kernel zeroing each page at its first touch).
//
// Cases: bench_store_slice/<model>/heads:<held of the model's>. The source: 256 facts of 48
// tokens (3 pages of 16) of random bf16 KV in a host store of the whole model. Bytes counted: the
// slice's bytes read plus written (2 x the slice). The measured call allocates the new store
// (its pages first touched by the copy), as the connector's does.
#include "common/fixture.hpp"

#include <inferscale/store.hpp>
#include <inferscale/store_slice.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

using namespace inferscale;
using namespace inferscale::bench;

struct model_case {
  char const* name;
  kv_geometry geometry;
};

model_case const models[] = {{"smollm2-135m", {30, 3, 64}}, {"llama3.1-8b", {32, 8, 128}}};

constexpr std::int64_t facts     = 256;
constexpr std::int64_t tokens    = 48;
constexpr std::int32_t page_size = 16;

void slice_bench(benchmark::State& state)
{
  run_guarded(state, [&] {
    model_case const& m       = models[state.range(0)];
    std::int32_t const heads  = static_cast<std::int32_t>(state.range(1));
    kv_geometry const g       = m.geometry;
    std::int64_t const layers = g.num_layers;
    kv_store_config c;
    c.model       = g;
    c.store_dtype = dtype::bfloat16;
    c.page_size   = page_size;
    c.space       = memory_space::host;
    c.num_pages   = facts * ((tokens + page_size - 1) / page_size);
    kv_store full{c};
    std::vector<float> k(static_cast<std::size_t>(layers * tokens * g.num_kv_heads * g.head_dim));
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (float& x : k) {
      x = normal(rng);
    }
    auto const view = make_fact_kv_view(
      static_cast<float const*>(k.data()), layers, tokens, g.num_kv_heads, g.head_dim);
    std::vector<std::uint64_t> ids;
    for (std::int64_t f = 0; f < facts; ++f) {
      std::uint64_t const id = static_cast<std::uint64_t>(f + 1);
      full.insert(
        id, 0, std::vector<std::int32_t>(static_cast<std::size_t>(tokens), 1), view, view);
      ids.push_back(id);
    }
    std::int64_t const slice_bytes = c.num_pages * layers * 2 * page_size * heads * g.head_dim *
                                     static_cast<std::int64_t>(size_of(dtype::bfloat16));
    traffic const t{2 * slice_bytes, facts};
    store_slice const s{0, 0, g.num_kv_heads - heads, heads};  // the last rank's heads
    run_host(state, t, full.ref().pool, [&] {
      kv_store out = slice_store(full, s, ids);
      benchmark::DoNotOptimize(out.ref().pool);
    });
    // A second ceiling: a new store of the slice's configuration allocated, and memcpy of the
    // same bytes into its (fresh, untouched) pool: what any copy into new memory pays.
    kv_store_config const sliced = slice_store(full, s, {}).config();
    kv_store_config fresh_config = sliced;
    fresh_config.num_pages       = c.num_pages;
    double fresh_seconds         = 0;
    int const rounds             = 5;
    for (int r = 0; r < rounds; ++r) {
      auto const t0 = std::chrono::steady_clock::now();
      kv_store fresh{fresh_config};
      std::memcpy(fresh.ref().pool, full.ref().pool, static_cast<std::size_t>(slice_bytes));
      benchmark::DoNotOptimize(fresh.ref().pool);
      fresh_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    state.counters["fresh_copy_GB/s"] =
      2.0 * static_cast<double>(slice_bytes) * rounds / fresh_seconds / 1e9;
    state.counters["full_store_MB"] = static_cast<double>(full.pool_bytes()) / 1e6;
    state.counters["slice_MB"]      = static_cast<double>(slice_bytes) / 1e6;
  });
}

}  // namespace

BENCHMARK(slice_bench)
  ->Name("store/slice")
  ->ArgNames({"model", "heads"})
  ->Args({0, 1})  // SmolLM2, TP = 3
  ->Args({1, 1})  // Llama-3.1-8B, TP = 8
  ->Args({1, 2})  // TP = 4
  ->Args({1, 4})  // TP = 2
  ->Apply(inferscale::bench::host_benchmark);

INFERSCALE_BENCHMARK_MAIN();
