// Fetch latency of k retrieved facts from each tier (issue 52, item 5), SmolLM2-135M geometry
// (30 layers, 3 KV heads, head_dim 64, bf16, pages of 16 tokens, facts of 30 tokens: 2 pages,
// 737,280 bytes each), with host tiers (the host backend: both tiers in host memory):
// Each case for bf16 facts and for the same facts as fp8 / int4 pages (compression.hpp):
// `<case>/{bf16,fp8_e4m3,int4}/k:K`.
//  - tier/host/k:K   admit of K host-only facts + the host->device tier copy (stage_host);
//  - tier/disk/k:K   admit(keys, directory_fact_source): pread of the K facts' pages from one
//                    snapshot file (page cache warm: the same file every iteration), the fact
//                    table's CRC, the copy into the host tier, then the device tier copy;
//  - tier/redis/k:K  admit(keys, redis_fact_store) from a redis-server started here on 127.0.0.1
//                    (one MULTI/EXEC of K GETs and the generation, checksums, copies);
//  - tier/redis_over_disk{,_cold}/k:K  admit(keys, read_through_source(redis, disk)): every fact
//                    in Redis (and checked against the file's fact table), or none (read from
//                    disk and written into Redis);
// and the ceilings measured in the same run:
//  - ceiling/memcpy/k:K     memcpy of the same bytes;
//  - ceiling/redis_get/k:K  K raw GETs of the same values in one pipeline (hiredis, no checks).
// Each iteration is timed alone (steady_clock, UseManualTime); counters p50_us and p99_us are
// the percentiles of the iterations, GB/s the fact bytes per second. The facts fetched are
// dropped from the tiers outside the timed region.

#include "../common/fixture.hpp"

#include <inferscale/directory_source.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>
#include <inferscale/tier.hpp>

#if defined(INFERSCALE_BENCH_REDIS)
#include "redis_server.hpp"

#include <inferscale/read_through_source.hpp>
#include <inferscale/redis_source.hpp>
#endif

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace ib = inferscale::bench;
using namespace inferscale;

namespace {

constexpr std::int32_t layers = 30, heads = 3, head_dim = 64, page = 16, tokens = 30;
constexpr std::int64_t facts = 50;
constexpr std::uint64_t ns   = 1;

kv_store_config store_config(std::int64_t pages, kv_compression compression)
{
  kv_store_config c;
  c.model       = kv_geometry{layers, heads, head_dim};
  c.store_dtype = dtype::bfloat16;
  c.compression = compression;
  c.page_size   = page;
  c.num_pages   = pages;
  c.space       = memory_space::host;
  return c;
}

tiered_store_config tiers_config(kv_compression compression)
{
  tiered_store_config c;
  c.device     = store_config(facts * 2, compression);
  c.host_pages = facts * 2;
  return c;
}

/// The data every case shares: a store of the facts, its snapshot, a Redis server holding them.
struct shared_data {
  kv_compression compression;
  std::filesystem::path dir;
  kv_store store{store_config(facts * 2, compression)};
  std::unique_ptr<directory_fact_source> disk;
#if defined(INFERSCALE_BENCH_REDIS)
  std::unique_ptr<inferscale_test::redis_server> server;
  std::unique_ptr<redis_fact_store> redis;
  std::string redis_error;
#endif

  explicit shared_data(kv_compression c) : compression{c}
  {
    std::mt19937 random{42};
    std::uniform_real_distribution<float> value{-2.0f, 2.0f};
    std::vector<float> k(static_cast<std::size_t>(layers) * tokens * heads * head_dim), v(k.size());
    for (std::int64_t id = 0; id < facts; ++id) {
      for (std::size_t i = 0; i < k.size(); ++i) {
        k[i] = value(random);
        v[i] = value(random);
      }
      std::vector<std::int32_t> ids(tokens);
      for (std::int32_t j = 0; j < tokens; ++j) {
        ids[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(id * 100 + j);
      }
      store.insert<float>(
        static_cast<std::uint64_t>(id),
        ns,
        ids,
        make_fact_kv_view<float const>(k.data(), layers, tokens, heads, head_dim),
        make_fact_kv_view<float const>(v.data(), layers, tokens, heads, head_dim));
    }
    char const* base = std::getenv("INFERSCALE_BENCH_DIR");
    dir              = std::filesystem::path(base != nullptr ? base : "/tmp") /
          ("inferscale-fact-tiers-" + std::to_string(::getpid()) + "-" + to_string(c));
    std::filesystem::create_directories(dir);
    save_store(store, (dir / "facts.iskv").string());
    disk = std::make_unique<directory_fact_source>(dir.string());
#if defined(INFERSCALE_BENCH_REDIS)
    try {
      server = std::make_unique<inferscale_test::redis_server>();
      redis_options o;
      o.port  = server->port();
      o.model = "HuggingFaceTB/SmolLM2-135M@bench";
      redis   = std::make_unique<redis_fact_store>(o, store.config());
      for (std::int64_t id = 0; id < facts; ++id) {
        redis->put(store, static_cast<std::uint64_t>(id));
      }
    } catch (std::exception const& e) {
      redis_error = e.what();
    }
#endif
  }
  ~shared_data()
  {
    std::error_code ignored;
    std::filesystem::remove_all(dir, ignored);
  }
};

/// The shared data of bf16 facts and of their fp8 / int4 pages (compression.hpp), built once.
shared_data& data(kv_compression c)
{
  static std::map<int, std::unique_ptr<shared_data>> all;
  auto& d = all[static_cast<int>(c)];
  if (!d) { d = std::make_unique<shared_data>(c); }
  return *d;
}

std::vector<fact_key> keys_of(std::int64_t k)
{
  std::vector<fact_key> out;
  for (std::int64_t id = 0; id < k; ++id) {
    out.push_back({ns, static_cast<std::uint64_t>(id)});
  }
  return out;
}

/// Runs `measure` (returns seconds) per iteration; reports p50/p99 and GB/s of `bytes`.
template <class Measure>
void run(benchmark::State& state, std::size_t bytes, Measure&& measure)
{
  std::vector<double> seconds;
  for (auto _ : state) {
    double const s = measure();
    state.SetIterationTime(s);
    seconds.push_back(s);
  }
  std::sort(seconds.begin(), seconds.end());
  auto const at = [&](double q) {
    return seconds[std::min(seconds.size() - 1, static_cast<std::size_t>(q * seconds.size()))];
  };
  state.counters["p50_us"] = at(0.50) * 1e6;
  state.counters["p99_us"] = at(0.99) * 1e6;
  state.counters["GB/s"]   = static_cast<double>(bytes) / at(0.50) / 1e9;
  state.counters["bytes"]  = static_cast<double>(bytes);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

double since(std::chrono::steady_clock::time_point t0)
{
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void host_case(benchmark::State& state, kv_compression c)
{
  std::int64_t const k = state.range(0);
  shared_data& d       = data(c);
  tiered_store tiers{tiers_config(c)};
  std::vector<std::uint64_t> ids;
  for (std::int64_t id = 0; id < k; ++id) {  // host-only: each admit copies them to the device
    fact_record const& r = d.store.at(static_cast<std::uint64_t>(id));
    tiers.admit(std::vector<fact_key>{{ns, r.fact_id}}, *d.disk);  // fetched into the host tier
    tiers.evict(r.fact_id);
    ids.push_back(r.fact_id);
  }
  run(state, static_cast<std::size_t>(k) * 2 * d.store.page_bytes(), [&] {
    auto const t0  = std::chrono::steady_clock::now();
    tier_request r = tiers.admit(ids);
    tiers.stage_host(r);
    double const s = since(t0);
    for (std::uint64_t id : ids) {
      tiers.evict(id);
    }
    return s;
  });
}

/// Admits k facts from `source` per iteration; `after(key)` runs for each fact outside the timed
/// region, once the fact is dropped from the tiers.
template <class Source, class After>
void source_case(benchmark::State& state, Source& source, kv_compression c, After&& after)
{
  std::int64_t const k = state.range(0);
  tiered_store tiers{tiers_config(c)};
  std::vector<fact_key> const keys = keys_of(k);
  run(state, static_cast<std::size_t>(k) * 2 * data(c).store.page_bytes(), [&] {
    auto const t0  = std::chrono::steady_clock::now();
    tier_request r = tiers.admit(keys, source);
    tiers.stage_host(r);
    double const s = since(t0);
    for (fact_key const& key : keys) {
      tiers.erase(key.fact_id);
      after(key);
    }
    return s;
  });
}

template <class Source>
void source_case(benchmark::State& state, Source& source, kv_compression c)
{
  source_case(state, source, c, [](fact_key const&) {});
}

void memcpy_case(benchmark::State& state, kv_compression c)
{
  std::int64_t const k  = state.range(0);
  std::size_t const n   = static_cast<std::size_t>(k) * 2 * data(c).store.page_bytes();
  auto const* const src = static_cast<unsigned char const*>(data(c).store.ref().pool);
  std::vector<unsigned char> dst(n, 1);
  run(state, n, [&] {
    auto const t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src, n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    return since(t0);
  });
}

void register_benchmarks()
{
  auto const ks = [](benchmark::internal::Benchmark* b) {
    b->ArgName("k")->Arg(5)->Arg(20)->Arg(50)->UseManualTime()->Iterations(200)->Unit(
      benchmark::kMicrosecond);
  };
  // bf16 facts, and the same facts as fp8 / int4 pages (fewer bytes per fact to move).
  for (kv_compression const c :
       {kv_compression::none, kv_compression::fp8_e4m3, kv_compression::int4}) {
    std::string const dt = c == kv_compression::none ? "bf16" : to_string(c);
    benchmark::RegisterBenchmark(("tier/host/" + dt).c_str(), [c](benchmark::State& s) {
      host_case(s, c);
    })->Apply(ks);
    benchmark::RegisterBenchmark(("tier/disk/" + dt).c_str(), [c](benchmark::State& s) {
      source_case(s, *data(c).disk, c);
    })->Apply(ks);
    benchmark::RegisterBenchmark(("ceiling/memcpy/" + dt).c_str(), [c](benchmark::State& s) {
      memcpy_case(s, c);
    })->Apply(ks);
#if defined(INFERSCALE_BENCH_REDIS)
    benchmark::RegisterBenchmark(("tier/redis/" + dt).c_str(), [c](benchmark::State& s) {
      if (!data(c).redis) {
        s.SkipWithError(("no Redis: " + data(c).redis_error).c_str());
        return;
      }
      source_case(s, *data(c).redis, c);
    })->Apply(ks);
    // Redis in front of the snapshot file (read_through_source): warm, every fact in Redis
    // (HKEYS of the catalogue, the MULTI/EXEC of GETs, the directory's check of each copy
    // against its fact table); cold, none in Redis (disk reads, then the writes into Redis; the
    // facts are erased from Redis again outside the timed region).
    for (bool const warm : {true, false}) {
      std::string const name = std::string{"tier/redis_over_disk"} + (warm ? "" : "_cold") + "/";
      benchmark::RegisterBenchmark((name + dt).c_str(), [c, warm](benchmark::State& s) {
        shared_data& d = data(c);
        if (!d.redis) {
          s.SkipWithError(("no Redis: " + d.redis_error).c_str());
          return;
        }
        redis_options o;
        o.port  = d.server->port();
        o.model = warm ? "HuggingFaceTB/SmolLM2-135M@bench" : "HuggingFaceTB/SmolLM2-135M@cold";
        redis_fact_store front{o, d.store.config()};
        read_through_source chain{front, *d.disk};
        source_case(s, chain, c, [&](fact_key const& key) {
          if (!warm) { (void)front.erase(key.namespace_id, key.fact_id); }
        });
        s.counters["redis_hits"] = static_cast<double>(chain.stats().front_hits);
        s.counters["disk_reads"] = static_cast<double>(chain.stats().back_reads);
      })->Apply(ks);
    }
    benchmark::RegisterBenchmark(("ceiling/redis_get/" + dt).c_str(), [c](benchmark::State& s) {
      shared_data& d = data(c);
      if (!d.redis) {
        s.SkipWithError(("no Redis: " + d.redis_error).c_str());
        return;
      }
      std::int64_t const k = s.range(0);
      detail::redis::connection conn{"127.0.0.1", d.server->port(), 5000};
      std::vector<std::vector<std::string>> gets;
      for (std::int64_t id = 0; id < k; ++id) {
        gets.push_back({"GET", d.redis->fact_key_name(ns, static_cast<std::uint64_t>(id))});
      }
      run(s, static_cast<std::size_t>(k) * 2 * d.store.page_bytes(), [&] {
        auto const t0  = std::chrono::steady_clock::now();
        auto replies   = conn.pipeline(gets);
        double const t = since(t0);
        benchmark::DoNotOptimize(replies.data());
        return t;
      });
    })->Apply(ks);
#endif
  }
}

}  // namespace

int main(int argc, char** argv)
{
  register_benchmarks();
  return ib::benchmark_main(argc, argv);
}
