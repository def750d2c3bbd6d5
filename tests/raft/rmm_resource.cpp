// rmm_resource.hpp: an RMM resource as an InferScale memory_resource. RMM's statistics adaptor
// counts what goes through it, so every allocation of a device_buffer, a device store's pool and
// a device index's arrays is seen to reach RMM and come back. Skipped where no GPU is visible.
#include <inferscale/device_buffer.hpp>
#include <inferscale/index.hpp>
#include <inferscale/rmm_resource.hpp>
#include <inferscale/store.hpp>

#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

TEST_CASE("rmm_resource routes allocations to the RMM resource", "[gpu][rmm]")
{
  rmm::mr::statistics_resource_adaptor statistics{rmm::mr::cuda_memory_resource{}};
  inferscale::rmm_resource resource{statistics};
  SECTION("device_buffer: one allocation of its bytes, returned on destruction")
  {
    {
      std::vector<std::int64_t> const host{1, -2, 3, -4, 5};
      inferscale::device_buffer<std::int64_t> buffer(host, nullptr, &resource);
      REQUIRE(statistics.get_allocations_counter().value == 1);
      REQUIRE(statistics.get_bytes_counter().value == 5 * sizeof(std::int64_t));
      REQUIRE(buffer.to_host() == host);
    }
    REQUIRE(statistics.get_allocations_counter().value == 0);
    REQUIRE(statistics.get_allocations_counter().total == 1);
  }
  SECTION("a device store's pool")
  {
    inferscale::kv_store_config c;
    c.model     = inferscale::kv_geometry{2, 2, 8};
    c.page_size = 4;
    c.num_pages = 3;
    c.space     = inferscale::memory_space::device;
    c.resource  = &resource;
    {
      inferscale::kv_store store{c};
      REQUIRE(statistics.get_allocations_counter().value == 1);
      // [3 pages][2 layers][K, V][4 tokens][2 heads][8 dims] of bf16
      REQUIRE(statistics.get_bytes_counter().value == 3 * 2 * 2 * 4 * 2 * 8 * 2);
    }
    REQUIRE(statistics.get_allocations_counter().value == 0);
  }
  SECTION("a device index's arrays")
  {
    inferscale::index_config c;
    c.dim      = 4;
    c.space    = inferscale::memory_space::device;
    c.resource = &resource;
    {
      inferscale::graph_index index{c};
      std::vector<float> const vectors{1, 0, 0, 0, 0, 1, 0, 0};
      std::vector<std::uint64_t> const ids{10, 11};
      index.add<float>(0,
                       inferscale::make_matrix_view<float const>(vectors.data(), 2, 4),
                       cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
      // vectors, graph, ids and deletion flags
      REQUIRE(statistics.get_allocations_counter().value == 4);
    }
    REQUIRE(statistics.get_allocations_counter().value == 0);
  }
}
