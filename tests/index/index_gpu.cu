/**
 * @file index_gpu.cu
 * @brief GPU tests of the fact index's device backend (index.cuh):
 *  - `inferscale::search` on a device-memory index returns exactly (ids and float bits) what
 *    the host `search` returns on a host-memory index built by the same calls, over both
 *    dtypes, the three metrics and the three algorithms, for a mixed multi-tenant batch (tenants
 *    of 1, 2, degree + 1, 300 and 5000 facts with deletions, and one with every fact deleted)
 *    larger than two CTAs per SM; also with team sizes 16 and 32, with queries and visited sets
 *    in global memory, and with strided queries and outputs;
 *  - NaN / infinite / zero-cosine device queries get invalid rows;
 *  - refused calls throw and leave the device outputs unchanged;
 *  - the device graph builder: kNN against `exact_knn_host` (reordering only among near-ties),
 *    pruning equal to `prune_host`, and an index built with it reaching the stated recall;
 *  - `exact_search` against a brute-force double-precision loop written here.
 *  - after automatic compactions (a repack that only moves segments, then repacks that rebuild
 *    namespaces) the device index answers as before the move, and as the host index, bit for bit;
 *  - the memory facade over a device index (memory_device_index.cuh): after the same additions,
 *    erasure and compaction, a scheduler step and a lone request of serve_step(...,
 *    device_context{res}) / serve(..., device_context{res}) give the ids, plans and cache bytes
 *    of the host index's serve_step / serve; a GPU engine's step (device index and device store,
 *    serve_step(..., device_context{res, workspace, stream}) into a cache in device memory) gives
 *    the bytes of the host's step.
 * Reported skipped by CTest where no GPU is visible.
 */
#include "device_memory.hpp"
#include "fake_model.hpp"
#include "float_bits.hpp"
#include "memory_checks.hpp"
#include "memory_fixtures.hpp"

#include <inferscale/cuda_error.hpp>
// the backend's internals (launch shapes, brute force) are tested here too: their headers
// directly, as index.cuh declares its functions only in this build
// (INFERSCALE_EXTERN_DEVICE_INSTANCES)
#include <inferscale/detail/index/device_brute_force.inl>
#include <inferscale/detail/index/device_launch.inl>
#include <inferscale/detail/index/graph_build.hpp>
#include <inferscale/index.cuh>
#include <inferscale/index.hpp>
#include <inferscale/memory.cuh>
#include <inferscale/memory.hpp>
#include <inferscale/memory_device_index.cuh>

#include <raft/core/device_resources.hpp>
#include <raft/core/resource/cuda_stream.hpp>

#include <catch2/catch.hpp>

#include <degenerate_vectors.hpp>
#include <gaussian_mixture.hpp>
#include <index_reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

using namespace inferscale;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using inferscale_test::bits_of;
using inferscale_test::device_buffer;

namespace {

constexpr float infinity = std::numeric_limits<float>::infinity();

/// A namespace of the test: its size, how many facts the first add() gets (the rest come in a
/// second add(), which inserts into the existing graph) and how many facts are then deleted.
struct tenant_spec {
  std::uint64_t ns;
  std::int64_t size;
  std::int64_t first_batch;
  std::int64_t erased;
};

std::vector<tenant_spec> standard_tenants(std::uint32_t degree)
{
  std::int64_t const small = std::int64_t{degree} + 1;
  return {{1, 1, 1, 0},
          {2, 2, 2, 1},
          {3, small, small, 0},
          {4, 300, 200, 30},
          {5, 5000, 5000, 250},
          {6, 3, 3, 3}};  // every fact deleted: answers nothing
}

std::uint64_t fact_id(std::uint64_t ns, std::int64_t row)
{
  return ns * 1000000 + static_cast<std::uint64_t>(row);
}

/// The same calls on a host-memory and a device-memory index (the default, host, builder is
/// deterministic, so the two hold the same graph).
struct index_pair {
  graph_index host;
  graph_index device;
  std::vector<std::uint64_t> namespaces;
};

test::mixture_spec mixture_for(index_config const& config, std::uint64_t seed)
{
  test::mixture_spec spec;
  spec.dim       = config.dim;
  spec.centres   = 40;
  spec.normalise = config.metric != distance_metric::squared_l2;
  spec.seed      = seed;
  return spec;
}

index_pair make_index_pair(index_config config,
                           std::vector<tenant_spec> const& tenants,
                           std::uint64_t seed)
{
  index_config host_config   = config;
  index_config device_config = config;
  host_config.space          = memory_space::host;
  device_config.space        = memory_space::device;
  // the reference mode: both graphs from the exact kNN (NN-descent graphs are host-only)
  host_config.host_knn   = knn_build::exact;
  device_config.host_knn = knn_build::exact;
  index_pair pair{graph_index{host_config}, graph_index{device_config}, {}};
  test::gaussian_mixture mixture{mixture_for(config, seed)};
  std::int64_t const dim = config.dim;
  for (auto const& t : tenants) {
    auto const data = mixture.draw(t.size);
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(t.size));
    for (std::int64_t r = 0; r < t.size; ++r) {
      ids[static_cast<std::size_t>(r)] = fact_id(t.ns, r);
    }
    std::vector<std::uint64_t> erased;
    for (std::int64_t j = 0; j < t.erased; ++j) {
      erased.push_back(fact_id(t.ns, j * t.size / t.erased));
    }
    for (graph_index* index : {&pair.host, &pair.device}) {
      auto add = [&](std::int64_t begin, std::int64_t end) {
        index->add(t.ns,
                   make_matrix_view<float const>(data.data() + begin * dim, end - begin, dim),
                   cuda::std::span<std::uint64_t const>{ids.data() + begin,
                                                        static_cast<std::size_t>(end - begin)});
      };
      add(0, t.first_batch);
      if (t.first_batch < t.size) { add(t.first_batch, t.size); }
      index->erase(cuda::std::span<std::uint64_t const>{erased.data(), erased.size()});
    }
    pair.namespaces.push_back(t.ns);
  }
  return pair;
}

struct search_result {
  std::vector<std::uint64_t> ids;
  std::vector<float> distances;
};

search_result host_search(graph_index const& index,
                          std::vector<float> const& queries,
                          std::int64_t nq,
                          std::vector<std::uint64_t> const& namespaces,
                          std::uint32_t k,
                          search_params const& params)
{
  search_result r;
  r.ids.assign(static_cast<std::size_t>(nq) * k, 0);
  r.distances.assign(static_cast<std::size_t>(nq) * k, 0.0f);
  search_params reference = params;  // the device's algorithm and distance order, bit for bit
  reference.host_mode     = host_search_mode::reference;
  inferscale::search(index,
                     make_matrix_view<float const>(queries.data(), nq, index.dim()),
                     cuda::std::span<std::uint64_t const>{namespaces.data(), namespaces.size()},
                     k,
                     reference,
                     make_matrix_view<std::uint64_t>(r.ids.data(), nq, k),
                     make_matrix_view<float>(r.distances.data(), nq, k));
  return r;
}

/// Device outputs `[nq][k]` with a row stride, prefilled with a sentinel byte pattern.
struct device_outputs {
  device_outputs(std::int64_t nq, std::uint32_t k, std::int64_t stride)
    : rows{nq},
      cols{k},
      row_stride{stride},
      ids{static_cast<std::size_t>(nq * stride)},
      distances{static_cast<std::size_t>(nq * stride)}
  {
    INFERSCALE_CUDA_TRY(cudaMemset(ids.data(), 0xAB, ids.size() * sizeof(std::uint64_t)));
    INFERSCALE_CUDA_TRY(cudaMemset(distances.data(), 0xAB, distances.size() * sizeof(float)));
  }
  matrix_view<std::uint64_t> ids_view() const
  {
    return make_matrix_view<std::uint64_t>(ids.data(), rows, cols, row_stride);
  }
  matrix_view<float> distances_view() const
  {
    return make_matrix_view<float>(distances.data(), rows, cols, row_stride);
  }
  /// The `[nq][k]` results (the padding of each row must still hold the sentinel).
  search_result result() const
  {
    auto const all_ids = ids.to_host();
    auto const all_d   = distances.to_host();
    search_result r;
    for (std::int64_t q = 0; q < rows; ++q) {
      for (std::int64_t j = 0; j < row_stride; ++j) {
        auto const at = static_cast<std::size_t>(q * row_stride + j);
        if (j < cols) {
          r.ids.push_back(all_ids[at]);
          r.distances.push_back(all_d[at]);
        } else {
          REQUIRE(all_ids[at] == 0xABABABABABABABABull);
          REQUIRE(bits_of(all_d[at]) == 0xABABABABu);
        }
      }
    }
    return r;
  }

  std::int64_t rows;
  std::int64_t cols;
  std::int64_t row_stride;
  device_buffer<std::uint64_t> ids;
  device_buffer<float> distances;
};

/// Copies host queries `[nq][dim]` to the device with a row stride.
device_buffer<float> upload_queries(std::vector<float> const& queries,
                                    std::int64_t nq,
                                    std::int64_t dim,
                                    std::int64_t stride)
{
  std::vector<float> padded(static_cast<std::size_t>(std::max<std::int64_t>(nq * stride, 1)), 0.0f);
  for (std::int64_t q = 0; q < nq; ++q) {
    std::copy_n(queries.begin() + q * dim, dim, padded.begin() + q * stride);
  }
  return device_buffer<float>{padded};
}

search_result device_search(raft::resources const& res,
                            graph_index const& index,
                            device_buffer<float> const& queries,
                            std::int64_t nq,
                            std::int64_t query_stride,
                            std::vector<std::uint64_t> const& namespaces,
                            std::uint32_t k,
                            search_params const& params,
                            std::int64_t out_stride = -1)
{
  device_outputs out{nq, k, out_stride < 0 ? std::int64_t{k} : out_stride};
  search(res,
         index,
         make_matrix_view<float const>(queries.data(), nq, index.dim(), query_stride),
         cuda::std::span<std::uint64_t const>{namespaces.data(), namespaces.size()},
         k,
         params,
         out.ids_view(),
         out.distances_view());
  raft::resource::sync_stream(res);
  return out.result();
}

/// Requires identical ids and identical float bits, reporting the first difference.
void require_identical(search_result const& expected,
                       search_result const& got,
                       std::vector<std::uint64_t> const& namespaces,
                       std::uint32_t k)
{
  REQUIRE(expected.ids.size() == got.ids.size());
  for (std::size_t at = 0; at < expected.ids.size(); ++at) {
    if (expected.ids[at] == got.ids[at] &&
        bits_of(expected.distances[at]) == bits_of(got.distances[at])) {
      continue;
    }
    std::size_t const q    = at / k;
    std::size_t const j    = at % k;
    std::uint64_t const ns = namespaces.size() == 1 ? namespaces[0] : namespaces[q];
    CAPTURE(q, j, ns, expected.ids[at], got.ids[at], expected.distances[at], got.distances[at]);
    REQUIRE(expected.ids[at] == got.ids[at]);
    REQUIRE(bits_of(expected.distances[at]) == bits_of(got.distances[at]));
  }
}

int sm_count()
{
  int device = 0;
  int sms    = 0;
  INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
  INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

/// Search parameter sets: CAGRA's defaults; a wide search (itopk 256, 8 parents, whose visited
/// set for the 5000-fact tenant exceeds the shared-memory hash); itopk below k, two parents, one
/// sampling and a fixed iteration bound.
struct param_case {
  char const* name;
  std::uint32_t k;
  search_params params;
};

std::vector<param_case> param_cases(search_algo algo)
{
  std::vector<param_case> cases(5);
  cases[0].name                        = "defaults, k 10";
  cases[0].k                           = 10;
  cases[1].name                        = "itopk 256, width 8, 2 samplings, k 20";
  cases[1].k                           = 20;
  cases[1].params.itopk_size           = 256;
  cases[1].params.search_width         = 8;
  cases[1].params.num_random_samplings = 2;
  cases[2].name                        = "itopk 16 < k 32, width 2, 1 sampling, 5 iterations";
  cases[2].k                           = 32;
  cases[2].params.itopk_size           = 16;
  cases[2].params.search_width         = 2;
  cases[2].params.num_random_samplings = 1;
  cases[2].params.max_iterations       = 5;
  cases[2].params.rand_xor_mask        = 0xDEADBEEFull;
  // split searches (search_params::ctas_per_query): the parts on several CTAs, then the merge
  cases[3].name                  = "split into 4 parts (itopk 16 each), k 10";
  cases[3].k                     = 10;
  cases[3].params.ctas_per_query = 4;
  cases[4].name                  = "split into 3 parts, itopk 128 (43 each), width 2, k 16";
  cases[4].k                     = 16;
  cases[4].params.itopk_size     = 128;
  cases[4].params.search_width   = 2;
  cases[4].params.ctas_per_query = 3;
  for (auto& c : cases) {
    c.params.algo = algo;
  }
  return cases;
}

std::vector<float> rows_as_float(graph_index const& index, std::uint64_t ns)
{
  std::int64_t const n  = index.rows(ns);
  std::int64_t const re = index_access::row_elements(index);
  std::vector<float> out(static_cast<std::size_t>(n * re));
  if (index.config().vector_dtype == dtype::float32) {
    std::memcpy(out.data(), index_access::vector_rows(index, ns), out.size() * sizeof(float));
  } else {
    auto const* h = static_cast<half_t const*>(index_access::vector_rows(index, ns));
    for (std::size_t i = 0; i < out.size(); ++i) {
      out[i] = to_float(h[i]);
    }
  }
  return out;
}

using test::reference_distance;

index_config small_config(dtype t, distance_metric m, std::int64_t dim)
{
  index_config c;
  c.dim                       = dim;
  c.metric                    = m;
  c.vector_dtype              = t;
  c.graph_degree              = 32;
  c.intermediate_graph_degree = 64;
  c.exact_search_threshold    = 100;  // the same on both sides (the defaults differ by memory)
  return c;
}

}  // namespace

TEST_CASE("index device search equals the host search bit for bit (multi-tenant batch)",
          "[index][gpu]")
{
  auto const vector_dtype = GENERATE(dtype::float32, dtype::float16);
  auto const metric =
    GENERATE(distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2);
  CAPTURE(to_string(vector_dtype), to_string(metric));
  raft::device_resources res;
  std::int64_t const dim = 72;  // fp32: teams of 4 lanes; fp16: 2 lanes; rows padded to 72
  auto const config      = small_config(vector_dtype, metric, dim);
  auto const pair        = make_index_pair(config, standard_tenants(config.graph_degree), 7);

  std::int64_t const nq = std::max<std::int64_t>(300, 2 * std::int64_t{sm_count()} + 37);
  test::gaussian_mixture mixture{mixture_for(config, 7)};
  auto const queries = mixture.draw(nq);
  std::vector<std::uint64_t> namespaces(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q) {
    namespaces[static_cast<std::size_t>(q)] =
      pair.namespaces[static_cast<std::size_t>(q) % pair.namespaces.size()];
  }
  auto const d_queries = upload_queries(queries, nq, dim, dim);

  for (auto const algo : {search_algo::graph, search_algo::exact, search_algo::automatic}) {
    for (auto const& c : param_cases(algo)) {
      CAPTURE(static_cast<int>(algo), c.name);
      auto const expected = host_search(pair.host, queries, nq, namespaces, c.k, c.params);
      auto const got =
        device_search(res, pair.device, d_queries, nq, dim, namespaces, c.k, c.params);
      require_identical(expected, got, namespaces, c.k);
      // the comparison is not vacuous: the namespaces with live facts answer
      std::size_t valid = 0;
      for (auto id : got.ids) {
        valid += id != invalid_fact_id ? 1 : 0;
      }
      REQUIRE(valid > static_cast<std::size_t>(nq) * c.k / 3);
    }
  }
}

TEST_CASE("index device search: teams of 16 and 32 lanes (768-d rows)", "[index][gpu]")
{
  auto const vector_dtype = GENERATE(dtype::float32, dtype::float16);
  auto const metric       = GENERATE(distance_metric::cosine, distance_metric::squared_l2);
  CAPTURE(to_string(vector_dtype), to_string(metric));
  raft::device_resources res;
  std::int64_t const dim = 768;  // fp32: 192 chunks -> 32 lanes; fp16: 96 chunks -> 16 lanes
  auto const config      = small_config(vector_dtype, metric, dim);
  auto const pair        = make_index_pair(config, {{10, 1, 1, 0}, {11, 700, 700, 50}}, 11);

  std::int64_t const nq = 64;
  test::gaussian_mixture mixture{mixture_for(config, 11)};
  auto const queries = mixture.draw(nq);
  std::vector<std::uint64_t> namespaces(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q) {
    namespaces[static_cast<std::size_t>(q)] = q % 5 == 0 ? 10 : 11;
  }
  auto const d_queries = upload_queries(queries, nq, dim, dim);
  for (auto const algo : {search_algo::graph, search_algo::exact}) {
    search_params params;
    params.algo           = algo;
    params.ctas_per_query = 0;  // automatic: 2 parts for 64 queries at k 10
    CAPTURE(static_cast<int>(algo));
    REQUIRE(auto_ctas_per_query(nq, default_itopk, 10) == 2);
    auto const expected = host_search(pair.host, queries, nq, namespaces, 10, params);
    auto const got = device_search(res, pair.device, d_queries, nq, dim, namespaces, 10, params);
    require_identical(expected, got, namespaces, 10);
  }
  // a batch of 8: the automatic split takes 4 parts, on both sides alike
  std::int64_t const small = 8;
  REQUIRE(auto_ctas_per_query(small, default_itopk, 10) == 4);
  std::vector<float> const few(queries.begin(), queries.begin() + small * dim);
  std::vector<std::uint64_t> const few_namespaces(namespaces.begin(), namespaces.begin() + small);
  auto const d_few = upload_queries(few, small, dim, dim);
  search_params graph;
  graph.algo           = search_algo::graph;
  graph.ctas_per_query = 0;
  auto const expected  = host_search(pair.host, few, small, few_namespaces, 10, graph);
  auto const got = device_search(res, pair.device, d_few, small, dim, few_namespaces, 10, graph);
  require_identical(expected, got, few_namespaces, 10);
}

TEST_CASE(
  "index device search: the kernel's shared-memory attribute is the device's fixed limit, "
  "whatever the batch",
  "[index][gpu]")
{
  // Searches may run concurrently (README): a per-call attribute sized to one call's batch could
  // be lowered by another call between its set and its launch. It must be set once, to the limit.
  using policy = detail::index::device_policy;
  raft::device_resources res;
  std::int64_t const dim = 96;
  auto const config      = small_config(dtype::float32, distance_metric::cosine, dim);
  auto const pair        = make_index_pair(config, {{11, 900, 900, 0}}, 13);
  int device             = 0;
  REQUIRE(cudaGetDevice(&device) == cudaSuccess);
  std::size_t const limit = detail::index::search_shared_limit<policy>(device);
  test::gaussian_mixture mixture{mixture_for(config, 13)};
  for (std::int64_t nq : {1, 300}) {
    for (std::uint32_t itopk : {16u, 256u}) {  // different buffers and hash tables per call
      auto const queries = mixture.draw(nq);
      std::vector<std::uint64_t> namespaces(static_cast<std::size_t>(nq), 11);
      auto const d_queries = upload_queries(queries, nq, dim, dim);
      search_params params;
      params.algo       = search_algo::graph;
      params.itopk_size = itopk;
      (void)device_search(res, pair.device, d_queries, nq, dim, namespaces, 10, params);
      cudaFuncAttributes attributes{};
      REQUIRE(cudaFuncGetAttributes(&attributes, detail::index::search_kernel<policy, float>) ==
              cudaSuccess);
      CAPTURE(nq, itopk);
      REQUIRE(static_cast<std::size_t>(attributes.maxDynamicSharedSizeBytes) == limit);
    }
  }
}

TEST_CASE("index device search: queries in global memory (9000-d), strided queries and outputs",
          "[index][gpu]")
{
  auto const vector_dtype = GENERATE(dtype::float32, dtype::float16);
  CAPTURE(to_string(vector_dtype));
  raft::device_resources res;
  std::int64_t const dim = 9000;  // 36 kB prepared query: above the shared-memory budget
  auto const config      = small_config(vector_dtype, distance_metric::cosine, dim);
  auto const pair        = make_index_pair(config, {{20, 60, 60, 5}, {21, 200, 200, 10}}, 13);

  std::int64_t const nq = 40;
  test::gaussian_mixture mixture{mixture_for(config, 13)};
  auto const queries = mixture.draw(nq);
  std::vector<std::uint64_t> const one_namespace{21};
  std::vector<std::uint64_t> namespaces(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q) {
    namespaces[static_cast<std::size_t>(q)] = 20 + static_cast<std::uint64_t>(q % 2);
  }
  std::int64_t const query_stride = dim + 5;
  auto const d_queries            = upload_queries(queries, nq, dim, query_stride);
  for (auto const algo : {search_algo::graph, search_algo::exact}) {
    search_params params;
    params.algo = algo;
    CAPTURE(static_cast<int>(algo));
    auto const expected = host_search(pair.host, queries, nq, namespaces, 10, params);
    auto const got      = device_search(
      res, pair.device, d_queries, nq, query_stride, namespaces, 10, params, /*out_stride=*/13);
    require_identical(expected, got, namespaces, 10);
    // one namespace for the whole batch
    auto const expected_one = host_search(pair.host, queries, nq, one_namespace, 10, params);
    auto const got_one =
      device_search(res, pair.device, d_queries, nq, query_stride, one_namespace, 10, params);
    require_identical(expected_one, got_one, one_namespace, 10);
  }
}

TEST_CASE(
  "index device search: a batch of several resident grids reuses each CTA's global "
  "workspace and still equals the host bit for bit",
  "[index][gpu]")
{
  raft::device_resources res;
  std::int64_t const dim = 96;
  auto const config      = small_config(dtype::float32, distance_metric::cosine, dim);
  auto const pair        = make_index_pair(config, {{30, 5000, 5000, 0}}, 17);
  // itopk 256 with 8 parents: the visited hash (2^14 entries, 64 kB) exceeds the shared budget
  search_params params;
  params.algo         = search_algo::graph;
  params.itopk_size   = 256;
  params.search_width = 8;
  int device          = 0;
  INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
  std::size_t const shared =
    512 * sizeof(detail::index::buffer_entry) +
    static_cast<std::size_t>(index_access::row_elements(pair.device)) * sizeof(float);
  std::int64_t const resident =
    detail::index::resident_search_ctas<detail::index::device_policy, float>(device, shared);
  auto const plan = detail::index::search_launch_plan(
    3 * resident + 7, resident, true, false, index_access::row_elements(pair.device), 1 << 14);
  REQUIRE(plan.grid == resident);  // every CTA takes three or four queries
  std::int64_t const nq = 3 * resident + 7;
  test::gaussian_mixture mixture{mixture_for(config, 17)};
  auto const queries = mixture.draw(nq);
  std::vector<std::uint64_t> const one_namespace{30};
  auto const d_queries = upload_queries(queries, nq, dim, dim);
  auto const expected  = host_search(pair.host, queries, nq, one_namespace, 10, params);
  auto const got = device_search(res, pair.device, d_queries, nq, dim, one_namespace, 10, params);
  require_identical(expected, got, one_namespace, 10);
}

TEST_CASE("index device search: a small batch is one launch, capturable in a CUDA graph",
          "[index][gpu]")
{
  raft::device_resources res;
  std::int64_t const dim = 64;
  auto const config      = small_config(dtype::float32, distance_metric::cosine, dim);
  auto const pair        = make_index_pair(config, {{40, 3000, 3000, 0}}, 19);
  std::int64_t const nq  = detail::index::inline_search_tasks;  // tasks in the parameters
  test::gaussian_mixture mixture{mixture_for(config, 19)};
  auto const queries = mixture.draw(nq);
  std::vector<std::uint64_t> const one_namespace{40};
  auto const d_queries = upload_queries(queries, nq, dim, dim);
  search_params params;
  params.algo         = search_algo::graph;
  auto const expected = host_search(pair.host, queries, nq, one_namespace, 10, params);
  // a first call prepares the kernel (attributes, once per process), then a capture
  REQUIRE(device_search(res, pair.device, d_queries, nq, dim, one_namespace, 10, params).ids ==
          expected.ids);
  device_outputs out{nq, 10, 10};
  cudaStream_t const stream = raft::resource::get_cuda_stream(res).get();
  cudaGraph_t graph{};
  INFERSCALE_CUDA_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  {
    // A search that throws during the capture must not leave it open: every later CUDA call of
    // this thread would fail with cudaErrorStreamCaptureUnsupported.
    struct end_capture_on_throw {
      cudaStream_t stream;
      ~end_capture_on_throw()
      {
        cudaStreamCaptureStatus status{};
        if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
            status != cudaStreamCaptureStatusNone) {
          cudaGraph_t abandoned{};
          cudaStreamEndCapture(stream, &abandoned);
          if (abandoned != nullptr) { cudaGraphDestroy(abandoned); }
          cudaGetLastError();
        }
      }
    } guard{stream};
    search(res,
           pair.device,
           make_matrix_view<float const>(d_queries.data(), nq, dim, dim),
           cuda::std::span<std::uint64_t const>{one_namespace.data(), 1},
           10,
           params,
           out.ids_view(),
           out.distances_view());
    INFERSCALE_CUDA_TRY(cudaStreamEndCapture(stream, &graph));
  }
  std::size_t nodes = 0;
  INFERSCALE_CUDA_TRY(cudaGraphGetNodes(graph, nullptr, &nodes));
  REQUIRE(nodes == 1);  // the search kernel and nothing else
  cudaGraphExec_t exec{};
  INFERSCALE_CUDA_TRY(cudaGraphInstantiate(&exec, graph, 0));
  INFERSCALE_CUDA_TRY(cudaGraphLaunch(exec, stream));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
  require_identical(expected, out.result(), one_namespace, 10);
  INFERSCALE_CUDA_TRY(cudaGraphExecDestroy(exec));
  INFERSCALE_CUDA_TRY(cudaGraphDestroy(graph));
}

TEST_CASE("index device search: NaN, infinite and zero-cosine queries get invalid rows",
          "[index][gpu]")
{
  auto const metric = GENERATE(distance_metric::cosine, distance_metric::squared_l2);
  CAPTURE(to_string(metric));
  raft::device_resources res;
  std::int64_t const dim = 40;
  auto const config      = small_config(dtype::float32, metric, dim);
  auto const pair        = make_index_pair(config, {{1, 300, 300, 0}, {2, 50, 50, 0}}, 17);
  std::int64_t const nq  = 12;
  test::gaussian_mixture mixture{mixture_for(config, 17)};
  auto queries = mixture.draw(nq);
  std::vector<std::uint64_t> namespaces(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q) {
    namespaces[static_cast<std::size_t>(q)] = q % 3 == 0 ? 2 : 1;
  }
  queries[static_cast<std::size_t>(3 * dim + 5)]  = std::numeric_limits<float>::quiet_NaN();
  queries[static_cast<std::size_t>(6 * dim + 39)] = infinity;
  std::fill_n(queries.begin() + 9 * dim, dim, 0.0f);  // zero: invalid under cosine only
  std::set<std::int64_t> bad{3, 6};
  if (metric == distance_metric::cosine) { bad.insert(9); }

  auto const d_queries = upload_queries(queries, nq, dim, dim);
  for (auto const algo : {search_algo::graph, search_algo::exact}) {
    search_params params;
    params.algo = algo;
    CAPTURE(static_cast<int>(algo));
    std::uint32_t const k = 8;
    auto const got = device_search(res, pair.device, d_queries, nq, dim, namespaces, k, params);
    for (std::int64_t q = 0; q < nq; ++q) {
      CAPTURE(q);
      if (bad.count(q) != 0) {
        for (std::uint32_t j = 0; j < k; ++j) {
          REQUIRE(got.ids[static_cast<std::size_t>(q * k + j)] == invalid_fact_id);
          REQUIRE(got.distances[static_cast<std::size_t>(q * k + j)] == infinity);
        }
        continue;
      }
      // the other rows answer as the host does for the same query alone
      std::vector<float> one(queries.begin() + q * dim, queries.begin() + (q + 1) * dim);
      std::vector<std::uint64_t> const ns{namespaces[static_cast<std::size_t>(q)]};
      auto const expected = host_search(pair.host, one, 1, ns, k, params);
      search_result row;
      row.ids.assign(got.ids.begin() + q * k, got.ids.begin() + (q + 1) * k);
      row.distances.assign(got.distances.begin() + q * k, got.distances.begin() + (q + 1) * k);
      require_identical(expected, row, ns, k);
    }
    // exact_search gives the same invalid rows
    device_outputs out{nq, k, k};
    exact_search(res,
                 pair.device,
                 1,
                 make_matrix_view<float const>(d_queries.data(), nq, dim),
                 k,
                 out.ids_view(),
                 out.distances_view());
    raft::resource::sync_stream(res);
    auto const exact = out.result();
    for (std::int64_t q = 0; q < nq; ++q) {
      CAPTURE(q);
      bool const invalid = bad.count(q) != 0;
      for (std::uint32_t j = 0; j < k; ++j) {
        REQUIRE((exact.ids[static_cast<std::size_t>(q * k + j)] == invalid_fact_id) == invalid);
      }
    }
  }
}

TEST_CASE(
  "index device search: degenerate vectors (zeros, denormals, largest values, "
  "duplicates, all-identical namespaces) answer as the host, bit for bit, never NaN",
  "[index][gpu]")
{
  raft::device_resources res;
  for (auto const metric :
       {distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2}) {
    for (auto const t : {dtype::float32, dtype::float16}) {
      CAPTURE(to_string(metric), to_string(t));
      test::degenerate_set const set = test::make_degenerate_set(metric, t);
      std::int64_t const dim         = set.dim;
      index_config config            = small_config(t, metric, dim);
      config.host_knn                = knn_build::exact;
      index_config device_config     = config;
      device_config.space            = memory_space::device;
      graph_index host{config}, device{device_config};
      std::vector<std::vector<float> const*> const rows{
        &set.mixed, &set.identical, &set.degenerate_identical};
      for (std::uint64_t ns = 1; ns <= 3; ++ns) {
        auto const& r = *rows[ns - 1];
        std::vector<std::uint64_t> ids(r.size() / static_cast<std::size_t>(dim));
        std::iota(ids.begin(), ids.end(), ns * 1000);
        for (graph_index* index : {&host, &device}) {
          index->add(ns,
                     make_matrix_view<float const>(r.data(), set.rows(r), dim),
                     cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
        }
      }
      std::int64_t const nq = set.rows(set.queries);
      auto const d_queries  = upload_queries(set.queries, nq, dim, dim);
      std::uint32_t const k = 8;
      for (auto const algo : {search_algo::graph, search_algo::exact}) {
        search_params params;
        params.algo = algo;
        for (std::uint64_t ns = 1; ns <= 3; ++ns) {
          CAPTURE(static_cast<int>(algo), ns);
          std::vector<std::uint64_t> const one{ns};
          auto const expected = host_search(host, set.queries, nq, one, k, params);
          auto const got      = device_search(res, device, d_queries, nq, dim, one, k, params);
          require_identical(expected, got, one, k);
          for (float d : got.distances) {
            REQUIRE(std::isfinite(d));
          }
        }
      }
      // exact_search (the brute force on RAFT's gemm) on the mixed namespace: finite, its ids
      device_outputs out{nq, k, k};
      exact_search(res,
                   device,
                   1,
                   make_matrix_view<float const>(d_queries.data(), nq, dim),
                   k,
                   out.ids_view(),
                   out.distances_view());
      raft::resource::sync_stream(res);
      auto const exact = out.result();
      for (std::size_t at = 0; at < exact.ids.size(); ++at) {
        CAPTURE(at);
        REQUIRE(std::isfinite(exact.distances[at]));
        REQUIRE(exact.ids[at] >= 1000);
        REQUIRE(exact.ids[at] < 1000 + static_cast<std::uint64_t>(set.rows(set.mixed)));
      }
    }
  }
}

TEST_CASE("index device search and exact_search: refused calls throw and write nothing",
          "[index][gpu]")
{
  raft::device_resources res;
  std::int64_t const dim = 24;
  auto const config      = small_config(dtype::float32, distance_metric::cosine, dim);
  auto const pair        = make_index_pair(config, {{1, 80, 80, 0}, {2, 10, 10, 0}}, 19);
  std::int64_t const nq  = 6;
  std::uint32_t const k  = 5;
  test::gaussian_mixture mixture{mixture_for(config, 19)};
  auto const queries   = mixture.draw(nq);
  auto const d_queries = upload_queries(queries, nq, dim, dim);
  device_buffer<float> wide_queries{static_cast<std::size_t>(nq * (dim + 1))};
  std::vector<std::uint64_t> const ns{1, 2, 1, 2, 1, 2};
  std::vector<std::uint64_t> const unknown{1, 2, 1, 99, 1, 2};
  std::vector<std::uint64_t> const too_few{1, 2};

  device_outputs out{nq, k, k};
  device_outputs wide{nq, k + 1, k + 1};
  auto const untouched = out.result();
  auto const qview     = make_matrix_view<float const>(d_queries.data(), nq, dim);
  auto span_of         = [](std::vector<std::uint64_t> const& v) {
    return cuda::std::span<std::uint64_t const>{v.data(), v.size()};
  };
  search_params params;

  REQUIRE_THROWS_AS(search(res,
                           pair.device,
                           qview,
                           span_of(ns),
                           0,
                           params,
                           make_matrix_view<std::uint64_t>(out.ids.data(), nq, 0, 1),
                           make_matrix_view<float>(out.distances.data(), nq, 0, 1)),
                    logic_error);
  REQUIRE_THROWS_AS(
    search(
      res, pair.device, qview, span_of(unknown), k, params, out.ids_view(), out.distances_view()),
    logic_error);
  REQUIRE_THROWS_AS(
    search(
      res, pair.device, qview, span_of(too_few), k, params, out.ids_view(), out.distances_view()),
    logic_error);
  REQUIRE_THROWS_AS(
    search(res, pair.device, qview, span_of(ns), k, params, wide.ids_view(), out.distances_view()),
    logic_error);
  REQUIRE_THROWS_AS(search(res,
                           pair.device,
                           make_matrix_view<float const>(wide_queries.data(), nq, dim + 1),
                           span_of(ns),
                           k,
                           params,
                           out.ids_view(),
                           out.distances_view()),
                    logic_error);
  search_params zero_width;
  zero_width.search_width = 0;
  REQUIRE_THROWS_AS(
    search(
      res, pair.device, qview, span_of(ns), k, zero_width, out.ids_view(), out.distances_view()),
    logic_error);
  search_params huge_itopk;
  huge_itopk.itopk_size = 2000;
  REQUIRE_THROWS_AS(
    search(
      res, pair.device, qview, span_of(ns), k, huge_itopk, out.ids_view(), out.distances_view()),
    logic_error);
  // a host-memory index is refused by the device backend
  REQUIRE_THROWS_AS(
    search(res, pair.host, qview, span_of(ns), k, params, out.ids_view(), out.distances_view()),
    logic_error);

  REQUIRE_THROWS_AS(exact_search(res, pair.host, 1, qview, k, out.ids_view(), out.distances_view()),
                    logic_error);
  REQUIRE_THROWS_AS(
    exact_search(res, pair.device, 99, qview, k, out.ids_view(), out.distances_view()),
    logic_error);
  REQUIRE_THROWS_AS(exact_search(res,
                                 pair.device,
                                 1,
                                 qview,
                                 0,
                                 make_matrix_view<std::uint64_t>(out.ids.data(), nq, 0, 1),
                                 make_matrix_view<float>(out.distances.data(), nq, 0, 1)),
                    logic_error);
  REQUIRE_THROWS_AS(
    exact_search(res, pair.device, 1, qview, k, out.ids_view(), wide.distances_view()),
    logic_error);

  raft::resource::sync_stream(res);
  auto const after = out.result();
  REQUIRE(after.ids == untouched.ids);
  for (std::size_t i = 0; i < after.distances.size(); ++i) {
    REQUIRE(bits_of(after.distances[i]) == bits_of(untouched.distances[i]));
  }
  auto const wide_after = wide.result();
  for (auto id : wide_after.ids) {
    REQUIRE(id == 0xABABABABABABABABull);
  }
}

TEST_CASE("index device graph builder: kNN agrees with exact_knn_host, pruning with prune_host",
          "[index][gpu]")
{
  auto const vector_dtype = GENERATE(dtype::float32, dtype::float16);
  auto const metric =
    GENERATE(distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2);
  CAPTURE(to_string(vector_dtype), to_string(metric));
  raft::device_resources res;
  std::int64_t const dim = 72;
  auto config            = small_config(vector_dtype, metric, dim);
  // the rows exactly as an index stores them (padded, normalised for cosine, rounded to dtype)
  auto const pair          = make_index_pair(config, {{1, 1200, 1200, 0}}, 23);
  graph_index const& index = pair.host;
  std::uint32_t const n    = index.rows(1);
  std::uint32_t const k    = 64;
  std::int64_t const re    = index_access::row_elements(index);
  void const* rows         = index_access::vector_rows(index, 1);
  auto const as_float      = rows_as_float(index, 1);
  // ranking distance of the kNN graph: -dot for inner product and cosine, squared L2
  distance_metric const rank_metric =
    metric == distance_metric::squared_l2 ? metric : distance_metric::inner_product;
  auto dist = [&](std::uint32_t a, std::uint32_t b) {
    return reference_distance(as_float.data() + std::int64_t{a} * re,
                              as_float.data() + std::int64_t{b} * re,
                              re,
                              rank_metric);
  };

  auto norm2 = [&](std::uint32_t a) {
    double sum = 0.0;
    for (std::int64_t j = 0; j < re; ++j) {
      double const x = as_float[std::size_t(std::int64_t{a} * re + j)];
      sum += x * x;
    }
    return sum;
  };

  std::vector<std::uint32_t> expected(std::size_t{n} * k);
  if (vector_dtype == dtype::float32) {
    detail::index::exact_knn_host(
      static_cast<float const*>(rows), re, n, metric, k, expected.data());
  } else {
    detail::index::exact_knn_host(
      static_cast<half_t const*>(rows), re, n, metric, k, expected.data());
  }

  auto check_knn = [&](std::vector<std::uint32_t> const& got) {
    for (std::uint32_t v = 0; v < n; ++v) {
      std::set<std::uint32_t> seen;
      for (std::uint32_t j = 0; j < k; ++j) {
        std::uint32_t const g = got[std::size_t{v} * k + j];
        std::uint32_t const e = expected[std::size_t{v} * k + j];
        CAPTURE(v, j, g, e);
        REQUIRE(g < n);
        REQUIRE(g != v);
        REQUIRE(seen.insert(g).second);
        if (g != e) { REQUIRE(std::abs(dist(v, g) - dist(v, e)) < 1e-4); }
        if (j > 0) {  // sorted
          REQUIRE(dist(v, got[std::size_t{v} * k + j - 1]) <= dist(v, g) + 1e-4);
        }
      }
    }
  };

  SECTION("make_device_graph_builder: kNN and pruning")
  {
    auto const builder = make_device_graph_builder(res, config);
    REQUIRE(builder.knn);
    REQUIRE(builder.prune);
    std::vector<std::uint32_t> got(std::size_t{n} * k, 0);
    builder.knn(rows, n, k, got.data());
    check_knn(got);

    std::uint32_t const degree = 32;
    std::vector<std::uint32_t> pruned_host(std::size_t{n} * degree);
    std::vector<std::uint32_t> pruned_device(std::size_t{n} * degree, 0);
    detail::index::prune_host(expected.data(), k, k, n, degree, pruned_host.data());
    builder.prune(expected.data(), n, k, degree, pruned_device.data());
    REQUIRE(pruned_device == pruned_host);
  }

  SECTION("small tiles: selections merged across query and row tiles")
  {
    std::size_t const bytes = std::size_t{n} * static_cast<std::size_t>(re) * size_of(vector_dtype);
    device_buffer<unsigned char> d_rows{bytes};
    INFERSCALE_CUDA_TRY(cudaMemcpy(d_rows.data(), rows, bytes, cudaMemcpyHostToDevice));
    device_buffer<float> distances{std::size_t{n} * k};
    device_buffer<std::int64_t> selected{std::size_t{n} * k};
    auto const tm = metric == distance_metric::squared_l2
                      ? detail::index::tile_metric::squared_l2
                      : detail::index::tile_metric::negative_dot;
    detail::index::brute_force_blocks const blocks{37, 100};  // 100 < 2k: merges pad the tile
    if (vector_dtype == dtype::float32) {
      detail::index::brute_force_select(res,
                                        reinterpret_cast<float const*>(d_rows.data()),
                                        re,
                                        n,
                                        nullptr,
                                        nullptr,
                                        nullptr,
                                        0,
                                        n,
                                        tm,
                                        k,
                                        distances.data(),
                                        selected.data(),
                                        blocks);
    } else {
      detail::index::brute_force_select(res,
                                        reinterpret_cast<half_t const*>(d_rows.data()),
                                        re,
                                        n,
                                        nullptr,
                                        nullptr,
                                        nullptr,
                                        0,
                                        n,
                                        tm,
                                        k,
                                        distances.data(),
                                        selected.data(),
                                        blocks);
    }
    raft::resource::sync_stream(res);
    auto const rows64 = selected.to_host();
    auto const d      = distances.to_host();
    std::vector<std::uint32_t> got(rows64.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(rows64[i] >= 0);
      got[i] = static_cast<std::uint32_t>(rows64[i]);
      // reported distance: the ranking distance within fp32 rounding of the gemm's expansion
      // |a|^2 + |b|^2 - 2 a.b: each of its sums of re terms is off by at most gamma = re * 2^-24
      // of its magnitude (a floating-point dot product's bound), so the whole by at most
      // 2 gamma (|a|^2 + |b|^2) (|a.b| <= (|a|^2 + |b|^2) / 2). The first H200 run saw
      // 1.21e-4 here (fp16, squared L2) against a fixed 1e-4.
      auto const a = static_cast<std::uint32_t>(i / k);
      double const bound =
        1e-6 + 2.0 * static_cast<double>(re) * std::ldexp(1.0, -24) * (norm2(a) + norm2(got[i]));
      CAPTURE(i, d[i], dist(a, got[i]), bound);
      REQUIRE(std::abs(d[i] - dist(a, got[i])) <= bound);
    }
    check_knn(got);
  }
}

TEST_CASE("index device graph builder: an index built with it reaches recall@10 >= 0.9",
          "[index][gpu]")
{
  raft::device_resources res;
  std::int64_t const dim = 64;
  auto config            = small_config(dtype::float32, distance_metric::cosine, dim);
  config.space           = memory_space::device;
  graph_index index{config};
  test::gaussian_mixture mixture{mixture_for(config, 29)};
  std::int64_t const n = 3000;
  auto const data      = mixture.draw(n);
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
  std::iota(ids.begin(), ids.end(), std::uint64_t{1});
  index.add(7,
            make_matrix_view<float const>(data.data(), n, dim),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()},
            make_device_graph_builder(res, config));

  std::int64_t const nq = 200;
  auto const queries    = mixture.draw(nq);
  auto const d_queries  = upload_queries(queries, nq, dim, dim);
  std::vector<std::uint64_t> const ns{7};
  search_params graph;
  graph.algo             = search_algo::graph;
  auto const approximate = device_search(res, index, d_queries, nq, dim, ns, 10, graph);
  device_outputs exact_out{nq, 10, 10};
  exact_search(res,
               index,
               7,
               make_matrix_view<float const>(d_queries.data(), nq, dim),
               10,
               exact_out.ids_view(),
               exact_out.distances_view());
  raft::resource::sync_stream(res);
  auto const exact = exact_out.result();
  double hits      = 0;
  for (std::int64_t q = 0; q < nq; ++q) {
    std::set<std::uint64_t> truth(exact.ids.begin() + q * 10, exact.ids.begin() + (q + 1) * 10);
    for (std::int64_t j = 0; j < 10; ++j) {
      hits += truth.count(approximate.ids[static_cast<std::size_t>(q * 10 + j)]);
    }
  }
  double const recall = hits / static_cast<double>(nq * 10);
  CAPTURE(recall);
  REQUIRE(recall >= 0.9);
}

TEST_CASE("index exact_search equals a brute-force double-precision loop", "[index][gpu]")
{
  auto const vector_dtype = GENERATE(dtype::float32, dtype::float16);
  auto const metric =
    GENERATE(distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2);
  CAPTURE(to_string(vector_dtype), to_string(metric));
  raft::device_resources res;
  std::int64_t const dim = 72;
  auto config            = small_config(vector_dtype, metric, dim);
  // normalised data for every metric: distances of order 1, so fp32 gemm is within 1e-4
  index_config normalised_config = config;
  normalised_config.metric       = distance_metric::cosine;
  auto const spec                = mixture_for(normalised_config, 31);
  graph_index index{[&] {
    auto c  = config;
    c.space = memory_space::device;
    return c;
  }()};
  test::gaussian_mixture mixture{spec};
  struct tenant {
    std::uint64_t ns;
    std::int64_t size;
    std::int64_t erased;
  };
  std::vector<tenant> const tenants{{1, 2500, 200}, {2, 3, 1}};
  for (auto const& t : tenants) {
    auto const data = mixture.draw(t.size);
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(t.size));
    for (std::int64_t r = 0; r < t.size; ++r) {
      ids[static_cast<std::size_t>(r)] = fact_id(t.ns, r);
    }
    index.add(t.ns,
              make_matrix_view<float const>(data.data(), t.size, dim),
              cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    std::vector<std::uint64_t> erased;
    for (std::int64_t j = 0; j < t.erased; ++j) {
      erased.push_back(fact_id(t.ns, j * t.size / t.erased));
    }
    index.erase(cuda::std::span<std::uint64_t const>{erased.data(), erased.size()});
  }

  std::int64_t const nq = 50;
  std::uint32_t const k = 16;
  auto const queries    = mixture.draw(nq);
  auto const d_queries  = upload_queries(queries, nq, dim, dim);
  std::int64_t const re = index_access::row_elements(index);
  for (auto const& t : tenants) {
    CAPTURE(t.ns);
    device_outputs out{nq, k, k};
    exact_search(res,
                 index,
                 t.ns,
                 make_matrix_view<float const>(d_queries.data(), nq, dim),
                 k,
                 out.ids_view(),
                 out.distances_view());
    raft::resource::sync_stream(res);
    auto const got = out.result();

    auto const rows       = rows_as_float(index, t.ns);
    auto const* ids       = index_access::id_rows(index, t.ns);
    auto const* erased    = index_access::deleted_rows(index, t.ns);
    std::uint32_t const n = index.rows(t.ns);
    for (std::int64_t q = 0; q < nq; ++q) {
      CAPTURE(q);
      // the query as the index compares it: padded, normalised in double under cosine
      std::vector<float> query(static_cast<std::size_t>(re), 0.0f);
      double norm2 = 0.0;
      for (std::int64_t e = 0; e < dim; ++e) {
        norm2 += double{queries[static_cast<std::size_t>(q * dim + e)]} *
                 queries[static_cast<std::size_t>(q * dim + e)];
      }
      double const scale = metric == distance_metric::cosine ? 1.0 / std::sqrt(norm2) : 1.0;
      for (std::int64_t e = 0; e < dim; ++e) {
        query[static_cast<std::size_t>(e)] =
          static_cast<float>(queries[static_cast<std::size_t>(q * dim + e)] * scale);
      }
      std::vector<std::pair<double, std::uint64_t>> truth;
      for (std::uint32_t v = 0; v < n; ++v) {
        if (erased[v] != 0) { continue; }
        truth.emplace_back(
          reference_distance(rows.data() + std::int64_t{v} * re, query.data(), re, metric), ids[v]);
      }
      std::sort(truth.begin(), truth.end());
      auto true_distance = [&](std::uint64_t id) {
        for (auto const& p : truth) {
          if (p.second == id) { return p.first; }
        }
        FAIL("exact_search returned id " << id << ", not a live fact of the namespace");
        return 0.0;
      };
      std::set<std::uint64_t> seen;
      for (std::uint32_t j = 0; j < k; ++j) {
        CAPTURE(j);
        std::uint64_t const id = got.ids[static_cast<std::size_t>(q * k + j)];
        float const d          = got.distances[static_cast<std::size_t>(q * k + j)];
        if (j >= truth.size()) {
          REQUIRE(id == invalid_fact_id);
          REQUIRE(d == infinity);
          continue;
        }
        REQUIRE(seen.insert(id).second);
        double const expected_d = truth[j].first;
        // ties: a different id is fine when its true distance equals the j-th one
        REQUIRE(std::abs(true_distance(id) - expected_d) < 1e-4);
        REQUIRE(std::abs(double{d} - expected_d) < 1e-4);
      }
    }
  }
}

TEST_CASE("index device search after automatic compactions equals the host search bit for bit",
          "[index][gpu][compaction]")
{
  raft::device_resources res;
  std::int64_t const dim     = 40;
  index_config config        = small_config(dtype::float32, distance_metric::cosine, dim);
  config.host_knn            = knn_build::exact;
  index_config host_config   = config;
  index_config device_config = config;
  host_config.space          = memory_space::host;
  device_config.space        = memory_space::device;
  graph_index host{host_config};
  graph_index device{device_config};
  test::gaussian_mixture mixture{mixture_for(config, 17)};
  auto size_of_ns = [](std::uint64_t ns) { return static_cast<std::int64_t>(100 * ns + 50); };
  // namespaces 1..8 of 150..850 facts, and a big namespace 20 created between 4 and 5
  for (std::uint64_t ns : {1, 2, 3, 4, 20, 5, 6, 7, 8}) {
    std::int64_t const n = ns == 20 ? 3000 : size_of_ns(ns);
    auto const data      = mixture.draw(n);
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
    for (std::int64_t r = 0; r < n; ++r) {
      ids[static_cast<std::size_t>(r)] = fact_id(ns, r);
    }
    for (graph_index* index : {&host, &device}) {
      index->add(ns,
                 make_matrix_view<float const>(data.data(), n, dim),
                 cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    }
  }
  std::int64_t const nq = 240;
  auto const queries    = mixture.draw(nq);
  std::vector<std::uint64_t> targets(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q) {
    targets[static_cast<std::size_t>(q)] = 1 + static_cast<std::uint64_t>(q % 8);
  }
  auto const d_queries  = upload_queries(queries, nq, dim, dim);
  std::uint32_t const k = 10;
  search_params graph_params;
  graph_params.algo = search_algo::graph;
  auto const before = device_search(res, device, d_queries, nq, dim, targets, k, graph_params);

  // erasing namespace 20 leaves a hole past the bound: a repack that only moves segments
  REQUIRE(index_access::compactions(host) == 0);
  REQUIRE(index_access::compactions(device) == 0);
  host.erase_namespace(20);
  device.erase_namespace(20);
  REQUIRE(index_access::compactions(host) == 1);
  REQUIRE(index_access::compactions(device) == 1);
  REQUIRE(device.arena_rows() == host.arena_rows());
  auto const moved = device_search(res, device, d_queries, nq, dim, targets, k, graph_params);
  require_identical(before, moved, targets, k);

  // erasing 80 % of namespaces 5..8, 20 facts a call, makes repacks rebuild some of them
  for (std::uint64_t ns = 5; ns <= 8; ++ns) {
    std::int64_t const gone = size_of_ns(ns) * 4 / 5;
    for (std::int64_t r = 0; r < gone; r += 20) {
      std::vector<std::uint64_t> batch;
      for (std::int64_t j = r; j < std::min(gone, r + 20); ++j) {
        batch.push_back(fact_id(ns, j));
      }
      host.erase(cuda::std::span<std::uint64_t const>{batch.data(), batch.size()});
      device.erase(cuda::std::span<std::uint64_t const>{batch.data(), batch.size()});
    }
  }
  REQUIRE(index_access::compactions(device) == index_access::compactions(host));
  REQUIRE(index_access::compactions(device) > 1);
  bool rebuilt = false;
  for (std::uint64_t ns = 5; ns <= 8; ++ns) {
    REQUIRE(device.rows(ns) == host.rows(ns));
    rebuilt |= device.rows(ns) == device.size(ns);
  }
  REQUIRE(rebuilt);
  for (auto const algo : {search_algo::graph, search_algo::exact}) {
    CAPTURE(static_cast<int>(algo));
    search_params p;
    p.algo              = algo;
    auto const expected = host_search(host, queries, nq, targets, k, p);
    auto const got      = device_search(res, device, d_queries, nq, dim, targets, k, p);
    require_identical(expected, got, targets, k);
  }
}

namespace {
/// A memory of three users (namespaces 7, 8, 9) behind an instruction prefix, with its index in
/// `space` and its store in `store_space`; one fact erased and the index compacted (mutations of
/// the index's host mirror).
memory make_served_memory(memory_space space,
                          memory_space store_space,
                          inferscale_test::fake::branching_model& model,
                          inferscale_test::memory_fixtures::word_embedder& embedder)
{
  using namespace inferscale_test::memory_fixtures;
  memory m{tiny_memory_config(dtype::float32, 512, store_space, space)};
  encoding_options o;
  o.window = 3;
  m.set_instruction_prefix(model, {11, 12, 13}, 1, 0);
  user_data const a = make_user(7, 100, 12);
  user_data const b = make_user(8, 200, 9);
  user_data const u = make_user(9, 300, 6, 2);
  m.add_conversation(model, embedder, 7, a.c, a.facts, a.texts, o);
  m.add_conversation(model, embedder, 8, b.c, b.facts, b.texts, o);
  m.add_conversation(model, embedder, 9, u.c, u.facts, u.texts, o);
  m.erase_fact(104);
  m.compact_index();
  return m;
}
}  // namespace

TEST_CASE(
  "memory facade over a device index serves a step as over a host index (ids, plans, cache "
  "bytes), and with a device store too (a GPU engine's step) into a device cache",
  "[index][gpu][memory]")
{
  using namespace inferscale_test::memory_fixtures;
  raft::device_resources res;
  inferscale_test::fake::branching_model model;
  word_embedder embedder;
  memory const on_host =
    make_served_memory(memory_space::host, memory_space::host, model, embedder);
  memory const on_device =
    make_served_memory(memory_space::device, memory_space::host, model, embedder);
  REQUIRE(on_device.index().space() == memory_space::device);

  user_data const a = make_user(7, 100, 12);
  user_data const b = make_user(8, 200, 9);
  user_data const u = make_user(9, 300, 6, 2);
  std::vector<step_ask> const asks{{7, a.texts[4], 5},  // fact 104's own text: erased, not served
                                   {8, b.texts[2], 0},
                                   {9, u.texts[1] + " " + a.texts[3], 17},
                                   {7, a.texts[9], 3},
                                   {8, "no word of any fact", 40}};
  std::uint32_t const k = 3;
  host_cache host_cache_step;
  host_cache device_cache_step;
  std::vector<sequence_adapter> host_sequences;
  std::vector<sequence_adapter> device_sequences;
  auto const host_requests   = interleaved_step(asks, host_cache_step, host_sequences);
  auto const device_requests = interleaved_step(asks, device_cache_step, device_sequences);

  std::vector<memory_request> const expected =
    on_host.serve_step(embedder, host_requests, k, model.rotation());
  std::uint64_t const searches = on_device.searches();
  std::vector<memory_request> const got =
    on_device.serve_step(embedder, device_requests, k, model.rotation(), device_context{res});
  CHECK(on_device.searches() == searches + 1);
  check_same_step(
    got, expected, device_sequences, host_sequences, device_cache_step.data, host_cache_step.data);
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(std::find(got[i].fact_ids.begin(), got[i].fact_ids.end(), 104) == got[i].fact_ids.end());
    for (std::uint64_t id : got[i].fact_ids) {
      CHECK(on_device.store().at(id).namespace_id == asks[i].ns);
    }
  }

  // A lone request, and the host search refusing the device index (naming the call to use).
  host_cache alone;
  host_cache alone_device;
  memory_request const one =
    on_host.serve(embedder, 9, asks[2].query, k, 7, alone, model.rotation());
  memory_request const one_device = on_device.serve(
    embedder, 9, asks[2].query, k, 7, alone_device, model.rotation(), device_context{res});
  CHECK(one_device.fact_ids == one.fact_ids);
  CHECK(one_device.plan.token_ids == one.plan.token_ids);
  CHECK(alone_device.data == alone.data);
  CHECK_THROWS_WITH(on_device.serve_step(embedder, device_requests, k, model.rotation()),
                    Catch::Contains("serve_step(..., rotation, device_context{res"));
  CHECK_THROWS_WITH(
    on_host.serve_step(embedder, host_requests, k, model.rotation(), device_context{res}),
    Catch::Contains("the index is in host memory"));

  // A GPU engine's step: the index and the store in device memory, the cache too.
  memory const on_gpu =
    make_served_memory(memory_space::device, memory_space::device, model, embedder);
  REQUIRE(on_gpu.index().space() == memory_space::device);
  REQUIRE(on_gpu.store().space() == memory_space::device);
  // The engine's cos/sin table on each side, the same values (computed rope_params may differ
  // in the last bit between the host's and the device's sincos).
  std::vector<float> const values = make_rope_cos_sin_values<float>(model.rotation(), 256);
  device_buffer<float> device_values{values};
  auto const host_table   = make_rope_cos_sin_table(model.rotation(), values.data(), 256);
  auto const device_table = make_rope_cos_sin_table(model.rotation(), device_values.data(), 256);

  host_cache table_cache;
  std::vector<sequence_adapter> table_sequences;
  auto const table_requests = interleaved_step(asks, table_cache, table_sequences);
  device_buffer<float> gpu_storage{table_cache.data};  // every element -1, as the host's
  paged_kv_cache const gpu_cache = make_contiguous_cache(
    dtype::float32, gpu_storage.data(), {2, 2, 256, 1, 4}, {2 * 256 * 4, 256 * 4, 4, 4, 1});
  std::vector<slot_adapter> gpu_sequences;
  for (sequence_adapter const& s : table_sequences) {
    gpu_sequences.emplace_back(gpu_cache, s.slots);
  }
  std::vector<memory_step_request<slot_adapter>> gpu_requests;
  for (std::size_t i = 0; i < asks.size(); ++i) {
    gpu_requests.push_back({asks[i].ns, asks[i].query, asks[i].p0, &gpu_sequences[i]});
  }
  std::vector<memory_request> const table_expected =
    on_host.serve_step(embedder, table_requests, k, host_table);
  inferscale_test::cuda_stream stream;
  injection_workspace workspace(512);
  std::vector<memory_request> const gpu_got =
    on_gpu.serve_step(embedder,
                      gpu_requests,
                      k,
                      device_table,
                      device_context{res, workspace, cuda::stream_ref{stream.get()}});
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  check_same_step(gpu_got,
                  table_expected,
                  gpu_sequences,
                  table_sequences,
                  gpu_storage.to_host(),
                  table_cache.data);
}
