// The device tier in device memory and the host tier in pinned host memory (tier.cuh): staged
// facts are copied layer by layer on a copy stream and injected per layer behind their copy
// events; the cache bytes must equal the device run from one device store holding every fact, over
// random requests with evictions. Reported skipped by CTest where no GPU is visible.
#include "device_memory.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/inject.cuh>
#include <inferscale/rope.hpp>
#include <inferscale/tier.cuh>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

using namespace inferscale;
using inferscale_test::cuda_stream;
using inferscale_test::device_buffer;

namespace {

constexpr std::int32_t gpu_layers = 4, gpu_heads = 2, gpu_dim = 64, gpu_page = 16;
constexpr std::int64_t gpu_slots = 512;

kv_store_config gpu_store_config(std::int64_t pages)
{
  kv_store_config c;
  c.model       = kv_geometry{gpu_layers, gpu_heads, gpu_dim};
  c.store_dtype = dtype::bfloat16;
  c.page_size   = gpu_page;
  c.num_pages   = pages;
  c.space       = memory_space::device;
  return c;
}

std::vector<float> gpu_values(std::uint64_t id, std::int32_t n, int salt)
{
  std::vector<float> x(static_cast<std::size_t>(gpu_layers) * n * gpu_heads * gpu_dim);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(static_cast<std::int64_t>((id * 131 + i * (7 + salt)) % 256) - 128) /
           64.0f;
  }
  return x;
}

}  // namespace

TEST_CASE("tier gpu: staged per-layer injection equals injection from one device store", "[gpu]")
{
  tiered_store_config tc;
  tc.device     = gpu_store_config(12);
  tc.host_pages = 128;
  tiered_store tiers{tc};
  kv_store reference{gpu_store_config(128)};
  for (std::uint64_t id = 0; id < 16; ++id) {
    std::int32_t const n = 10 + static_cast<std::int32_t>(id * 7 % 30);
    auto const k = gpu_values(id, n, 0), v = gpu_values(id, n, 6);
    auto const kv = make_fact_kv_view<float const>(k.data(), gpu_layers, n, gpu_heads, gpu_dim);
    auto const vv = make_fact_kv_view<float const>(v.data(), gpu_layers, n, gpu_heads, gpu_dim);
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(n), static_cast<std::int32_t>(id));
    bool const both = id % 4 == 0 && tiers.usage().device_free >= tiers.device_tier().pages_for(n);
    tiers.insert<float>(
      id, id % 3, tokens, kv, vv, both ? fact_residency::both : fact_residency::host);
    reference.insert<float>(id, id % 3, tokens, kv, vv);
  }
  rope_spec spec;
  spec.head_dim         = gpu_dim;
  rope_params const rot = make_rope_params(spec);
  std::size_t const cache_elems =
    static_cast<std::size_t>(gpu_layers) * 2 * gpu_slots * gpu_heads * gpu_dim;
  device_buffer<bfloat16_t> got(cache_elems), want(cache_elems);
  auto const describe = [&](bfloat16_t* data) {
    return make_contiguous_cache(dtype::bfloat16,
                                 data,
                                 {gpu_layers, 2, gpu_slots, gpu_heads, gpu_dim},
                                 {2 * gpu_slots * gpu_heads * gpu_dim,
                                  gpu_slots * gpu_heads * gpu_dim,
                                  gpu_heads * gpu_dim,
                                  gpu_dim,
                                  1});
  };
  paged_kv_cache const got_desc = describe(got.data()), want_desc = describe(want.data());
  injection_workspace ws_got{4096}, ws_want{4096};
  cuda_stream compute, copy;
  std::mt19937 rng{3};
  int staged = 0;
  for (int step = 0; step < 30; ++step) {
    std::vector<std::uint64_t> ids;
    while (ids.size() < 3) {
      std::uint64_t const id = rng() % 16;
      if (std::find(ids.begin(), ids.end(), id) == ids.end()) { ids.push_back(id); }
    }
    tier_request r;
    try {
      r = tiers.admit(ids);
    } catch (logic_error const&) {
      continue;
    }
    staged += r.staged.empty() ? 0 : 1;
    INFERSCALE_CUDA_TRY(cudaMemset(got.data(), 0, cache_elems * sizeof(bfloat16_t)));
    INFERSCALE_CUDA_TRY(cudaMemset(want.data(), 0, cache_elems * sizeof(bfloat16_t)));
    compose_options o;
    o.first_position            = 5 + step;
    composition const plan      = compose(tiers.device_tier(), ids, o);
    composition const want_plan = compose(reference, ids, o);
    std::vector<std::int64_t> slots(static_cast<std::size_t>(plan.length()));
    for (std::size_t j = 0; j < slots.size(); ++j) {
      slots[j] = static_cast<std::int64_t>(3 * j + step);
    }
    injection_batch batch{tiers.device_tier()}, want_batch{reference};
    batch.add(plan, slots);
    want_batch.add(want_plan, slots);
    tiers.run(r,
              batch,
              got_desc,
              rot,
              device_context{ws_got, cuda::stream_ref{compute.get()}}.with_copy_stream(
                cuda::stream_ref{copy.get()}));
    want_batch.run(want_desc, rot, device_context{ws_want, cuda::stream_ref{compute.get()}});
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(compute.get()));
    auto const g = got.to_host(), w = want.to_host();
    REQUIRE(std::equal(
      g.begin(), g.end(), w.begin(), [](bfloat16_t a, bfloat16_t b) { return a.bits == b.bits; }));
  }
  CHECK(staged > 3);
}
