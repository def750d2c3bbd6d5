/**
 * @file bench/index/index_bench.cu
 * @brief The fact index: build time, search QPS / latency and recall@10 of the graph search,
 * each beside its ceiling measured in the same run (exact search of the same queries) and, on the
 * host, beside hnswlib at equal recall; and the crossover N below which exact search is faster.
 *
 * Data (reference/ann.md section 7): a Gaussian mixture (tests/common/gaussian_mixture.hpp, 100
 * anisotropic centres, seed fixed per dimension), L2-normalised, cosine metric, fp32 vectors;
 * 1,024 queries drawn from the same mixture first, then the N indexed points (so the data of a
 * smaller N is a prefix of a larger one's, and the queries are the same for every N). Fact ids
 * are row numbers, one namespace. Index: index_config defaults (graph degree 32, intermediate 64).
 *
 * Recall (ann.md section 3): recall@10 = mean over the 1,024 queries of |returned ∩ true top-10|
 * / 10, the true top-10 computed here by brute force (fp32, sixteen partial sums per row), and
 * `recall_tol`, which counts a returned fact whose true distance is within 1e-3 of the 10th
 * true distance (ann-benchmarks' tie tolerance); distances of returned facts are recomputed here.
 *
 * Parameter choice, in setup and outside every timed region, once per (N, dim) and backend:
 *  - graph: itopk in {32, 64, 128, 256} (device; the host from hnswlib's k = 10: {10, 12, 16,
 *    20, 24, 32, 64, 128, 256}) x num_random_samplings in {1, 4, 8} (search_width 1),
 *    each timed on the whole 1,024-query batch; the fastest setting with recall@10 >= 0.95 is
 *    used (if none reaches it, the one with the highest recall, and the label says so). The
 *    chosen setting is printed as counters `itopk`, `samplings` and in the label; every setting
 *    of the sweep is printed to stderr.
 *  - hnswlib (host only; M = 16, efConstruction = 200, InnerProductSpace on the normalised data):
 *    the smallest ef in {10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512}
 *    with recall@10 >= 0.95 (`hnswlib_ef`).
 *
 * Cases (names carry the axes):
 *  - index/host/build/dim:D/N:N: graph_index::add of N vectors into an empty namespace (kNN:
 *    exact up to 10,000 rows, NN-descent above; rank pruning, reverse edges, merge; all hardware
 *    threads), wall time, `vectors_per_s`; beside it the hnswlib build of the same vectors with
 *    as many threads (`hnswlib_build_s`, `vs_hnswlib` = hnswlib seconds / graph seconds, > 1: the
 *    graph builds faster). One iteration per repetition; the index built last is kept for the
 *    search cases.
 *  - index/host/build_cpu/dim:D/N:N/exact:E/rho_pct:R: CPU seconds of the NN-descent build (and of
 * the exact one when E = 1) beside hnswlib's build, recall@10 after pruning at a fixed setting
 *    beside hnswlib's at the matched ef (see host_build_cpu_bench).
 *  - index/host/search/dim:D/N:N/batch:B (k = 10): each iteration searches the next B queries
 *    (cycling through the 1,024) with the graph (search_algo::graph, the chosen parameters; this
 *    is `Time`), then exactly (search_algo::exact, same call), then with hnswlib. Counters: `QPS`,
 *    `us_per_query` (wall time / B), `recall`, `recall_tol`; `exact_QPS`, `exact_us_per_query`,
 *    `speedup` = exact seconds / graph seconds; `hnswlib_QPS`, `hnswlib_us_per_query`,
 *    `hnswlib_recall`, `vs_hnswlib` = hnswlib seconds / graph seconds. Threads: the host search
 *    splits a batch over the hardware threads (one range of queries per thread, batches of 64 or
 *    more); hnswlib runs one query per thread (ann-benchmarks' single-query mode) with the batch
 *    split over the same threads in the same way (`threads`).
 *  - index/host/crossover/dim:384/N:N for N = 256 .. 16,384: batch-1 latency of the graph search
 *    (parameters chosen as above, recall >= 0.95) and of exact search, `graph_us`, `exact_us`,
 *    `speedup`, and the index's automatic switch-over beside it (`cost_factor`, `auto_threshold`,
 *    `auto_picks_exact`: see report_cost_model); index/host/crossover/summary/dim:384 then
 *    reports `crossover_N`, the smallest measured N from which the graph is faster at that N and
 *    every larger measured N, and `parity_cost_factor`, the cost factor interpolated at the
 *    parity point (what detail::index::host_graph_cost_factor should be), every N in the label.
 *    index/host/crossover_default_params/...: the same with the default search_params (graph
 *    forced), the parameters `automatic` uses when the caller sets none.
 *  - index/device/build/dim:D/N:N (N up to 1,000,000): graph_index::add into a device-memory
 *    index with make_device_graph_builder(res, config) (kNN by RAFT gemm + select_k and the
 *    pruning kernel on the GPU; reverse edges, merge and the upload on the host), wall time.
 *  - index/device/search/dim:D/N:N/batch:B/ctas:P: inferscale::search (graph, parameters chosen
 *    by the same sweep, its graph search split into P parts, `search_params::ctas_per_query`;
 *    P > 1 only for batches of 1 and 16 at N = 100,000, and P = 0, the automatic choice, at
 *    batches 1, 16 and 1,024 there; timed on the device) between CUDA
 *    events on the resources' stream (`Time`, `QPS`, `us_per_query`; `wall_us_per_query`: host
 * clock from the call to the end of the work, launch and staging included), then
 * inferscale::exact_search (RAFT gemm + select_k) of the same queries (`exact_*`, `speedup`); each
 * from a cold L2 (the fixture's l2_flusher). Recall is measured against exact_search's answer.
 *  - index/device/multi_tenant/dim:D: 1,024 queries over 64 namespaces of 2,000 facts each (query
 *    q in namespace q / 16), one search call with the graph forced (2,000 is below the device's
 *    exact-search threshold), beside the same call with search_algo::exact (`exact_*`, the
 *    in-kernel brute force, also the recall reference) and exact_search once per namespace
 *    (`raft_exact_us_per_query`, 64 calls).
 *  - index/device/tenants/dim:D/batch:B: the multi-tenant shape (bench/common/tenants_shape.hpp:
 *    1,000 users, namespaces of 50 to 5,000 facts, median 100), one search call per B queries of
 *    distinct users with search_params{}, beside the same call exact; recall against fp32 brute
 *    force; the exact part's bytes against the copy bandwidth of the same run (see
 *    device_tenants_bench).
 *  - index/device/crossover/dim:384/N:N for N = 256 .. 65,536: batch 1, graph vs the in-kernel
 *    exact search (search_algo::exact, what default_device_exact_threshold chooses between;
 *    `raft_exact_us` = exact_search beside), index/device/crossover/summary/dim:384, and the
 *    same with the default search_params (index/device/crossover_default_params/...).
 *  Without a GPU every device case reports "no CUDA device visible".
 *
 * The host builds are the slow part (exact kNN is O(N^2 dim)): an index is built once per (N,
 * dim) and process and reused by every case (the build cases replace it with the one they time).
 * N = 100,000 on the host takes many minutes, and 1,000,000 on the device needs a minute of data
 * generation; .ci/bench filters N >= 100,000 out by default (--benchmark_filter=-N:[0-9]{6}),
 * .ci/device runs the device cases up to N = 100,000. Full runs:
 *   bench_index --benchmark_filter=index/host --benchmark_repetitions=3 \
 *               --benchmark_report_aggregates_only=true
 *   bench_index --benchmark_filter=index/device
 */
#include "../common/fixture.hpp"
#include "../common/tenants_shape.hpp"

#if INFERSCALE_BENCH_HNSWLIB
#include "hnsw_baseline.hpp"
#endif

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/index/graph_build.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.cuh>
#include <inferscale/index.hpp>

#include <raft/core/device_resources.hpp>
#include <raft/core/resource/cuda_stream.hpp>

#include <benchmark/benchmark.h>

#include <gaussian_mixture.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace ib = inferscale::bench;
namespace is = inferscale;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t top_k          = 10;
constexpr std::int64_t num_queries     = 1024;
constexpr double target_recall         = 0.95;
constexpr double tie_tolerance         = 1e-3;
constexpr std::int64_t mixture_centres = 100;
constexpr std::uint64_t data_seed      = 20261130;
constexpr std::uint64_t the_namespace  = 7;
constexpr int hnsw_m                   = 16;
constexpr int hnsw_ef_construction     = 200;
constexpr std::uint32_t sweep_itopk[]  = {32, 64, 128, 256};
/// The host's list sizes: its fast search walks from entry points with any list of at least k,
/// so its grid starts where hnswlib's does (k = 10), not at the device's 32.
constexpr std::uint32_t sweep_itopk_host[] = {10, 12, 16, 20, 24, 32, 64, 128, 256};
constexpr std::uint32_t sweep_samplings[]  = {1, 4, 8};
constexpr int hnsw_efs[]                   = {
                    10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512};

double seconds_since(clock_type::time_point t0)
{
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

int hardware_threads()
{
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// @brief Threads the host search (and hnswlib here) uses for a batch (detail::parallel_ranges).
int threads_for_batch(std::int64_t batch)
{
  return static_cast<int>(
    std::min<std::int64_t>(hardware_threads(), std::max<std::int64_t>(1, batch / 64)));
}

// ------------------------------------------------------------------------------------------------
// Data

/// @brief The queries and the first `rows` points of one dimension's mixture (grown on demand).
struct dataset {
  std::int64_t dim;
  is::test::gaussian_mixture mixture;
  std::vector<float> queries;  ///< [num_queries][dim]
  std::vector<float> base;     ///< [rows][dim]

  explicit dataset(std::int64_t d)
    : dim{d},
      mixture{is::test::mixture_spec{d, mixture_centres, true, data_seed + std::uint64_t(d)}}
  {
    queries = mixture.draw(num_queries);
  }

  std::int64_t rows() const { return static_cast<std::int64_t>(base.size()) / dim; }
  float const* row(std::int64_t r) const { return base.data() + r * dim; }
  float const* query(std::int64_t q) const { return queries.data() + q * dim; }

  void grow(std::int64_t n)
  {
    if (rows() >= n) { return; }
    auto more = mixture.draw(n - rows());
    base.insert(base.end(), more.begin(), more.end());
  }
};

dataset& data_for(std::int64_t dim, std::int64_t n)
{
  static std::map<std::int64_t, std::unique_ptr<dataset>> all;
  auto& d = all[dim];
  if (!d) { d = std::make_unique<dataset>(dim); }
  d->grow(n);
  return *d;
}

/// @brief Dot product in fp32 with sixteen partial sums (vectorisable without reassociation).
float dot(float const* a, float const* b, std::int64_t dim)
{
  float acc[16]             = {};
  std::int64_t const blocks = dim / 16;
  for (std::int64_t c = 0; c < blocks; ++c) {
    for (int j = 0; j < 16; ++j) {
      acc[j] += a[c * 16 + j] * b[c * 16 + j];
    }
  }
  float s = 0.0f;
  for (std::int64_t e = blocks * 16; e < dim; ++e) {
    s += a[e] * b[e];
  }
  for (float x : acc) {
    s += x;
  }
  return s;
}

/// @brief Cosine distance of normalised vectors, as the index and hnswlib report it.
float cosine_distance(float const* a, float const* b, std::int64_t dim)
{
  return 1.0f - dot(a, b, dim);
}

/// @brief The true top-k of every query over the first n points: ids and the k-th distance.
struct truth {
  std::int64_t n{0};
  std::vector<std::uint64_t> ids;  ///< [num_queries][top_k], closest first
  std::vector<float> kth;          ///< [num_queries]
};

truth brute_force_truth(dataset const& data, std::int64_t n)
{
  truth t;
  t.n = n;
  t.ids.assign(static_cast<std::size_t>(num_queries * top_k), is::invalid_fact_id);
  t.kth.assign(static_cast<std::size_t>(num_queries), std::numeric_limits<float>::infinity());
  is::detail::index::parallel_ranges(num_queries, 0, [&](std::int64_t begin, std::int64_t end) {
    std::vector<std::pair<float, std::uint64_t>> best;
    for (std::int64_t q = begin; q < end; ++q) {
      best.clear();
      for (std::int64_t r = 0; r < n; ++r) {
        std::pair<float, std::uint64_t> const e{
          cosine_distance(data.query(q), data.row(r), data.dim), static_cast<std::uint64_t>(r)};
        if (best.size() < top_k) {
          best.insert(std::upper_bound(best.begin(), best.end(), e), e);
        } else if (e < best.back()) {
          best.pop_back();
          best.insert(std::upper_bound(best.begin(), best.end(), e), e);
        }
      }
      for (std::size_t j = 0; j < best.size(); ++j) {
        t.ids[static_cast<std::size_t>(q) * top_k + j] = best[j].second;
      }
      t.kth[static_cast<std::size_t>(q)] = best.empty() ? 0.0f : best.back().first;
    }
  });
  return t;
}

struct recall_figures {
  double strict{0.0};
  double tolerant{0.0};
};

/**
 * @brief recall@10 of answers `ids` ([count][top_k]) for queries `first .. first + count - 1`
 * against `t`; the tolerant figure recomputes each returned fact's distance here.
 */
recall_figures recall_of(dataset const& data,
                         truth const& t,
                         std::int64_t first,
                         std::int64_t count,
                         std::uint64_t const* ids)
{
  double strict = 0.0, tolerant = 0.0;
  for (std::int64_t i = 0; i < count; ++i) {
    std::int64_t const q = (first + i) % num_queries;
    auto const* expected = t.ids.data() + q * top_k;
    std::uint32_t hits = 0, near = 0;
    for (std::uint32_t j = 0; j < top_k; ++j) {
      std::uint64_t const id = ids[i * top_k + j];
      if (id == is::invalid_fact_id || id >= static_cast<std::uint64_t>(t.n)) { continue; }
      if (std::find(expected, expected + top_k, id) != expected + top_k) { ++hits; }
      float const d =
        cosine_distance(data.query(q), data.row(static_cast<std::int64_t>(id)), data.dim);
      if (d <= t.kth[static_cast<std::size_t>(q)] + tie_tolerance) { ++near; }
    }
    strict += static_cast<double>(hits) / top_k;
    tolerant += static_cast<double>(std::min(near, top_k)) / top_k;
  }
  return {strict / static_cast<double>(count), tolerant / static_cast<double>(count)};
}

/**
 * @brief Calls `measure(params)` for the sweep's settings, samplings outer, itopk ascending;
 * `measure` returns whether the setting reached the target recall. A larger itopk with the same
 * samplings only adds seeds and iterations (slower, never chosen over a smaller one that reached
 * the target), so it is skipped once a smaller one has reached it.
 */
template <class Measure>
void for_each_sweep_setting(bool host, Measure&& measure)
{
  for (std::uint32_t samplings : sweep_samplings) {
    auto const* first = host ? std::begin(sweep_itopk_host) : std::begin(sweep_itopk);
    auto const* last  = host ? std::end(sweep_itopk_host) : std::end(sweep_itopk);
    for (auto const* it = first; it != last; ++it) {
      std::uint32_t const itopk = *it;
      is::search_params p;
      p.itopk_size           = itopk;
      p.num_random_samplings = samplings;
      p.algo                 = is::search_algo::graph;
      if (measure(p)) { break; }
    }
  }
}

/// @brief One setting of the parameter sweep and what it measured.
struct sweep_point {
  is::search_params params;
  recall_figures recall;
  double seconds_per_query{0.0};
};

/// @brief The sweep's choice: the fastest point reaching the target recall (else the best recall).
struct graph_choice {
  sweep_point chosen;
  bool reached{false};
  bool swept{true};  ///< false: the default search_params (graph forced), not a sweep's choice
};

graph_choice choose(std::vector<sweep_point> const& points)
{
  graph_choice c;
  for (auto const& p : points) {
    bool const ok = p.recall.strict >= target_recall;
    if (ok && (!c.reached || p.seconds_per_query < c.chosen.seconds_per_query)) {
      c.chosen  = p;
      c.reached = true;
    } else if (!ok && !c.reached && p.recall.strict > c.chosen.recall.strict) {
      c.chosen = p;
    }
  }
  return c;
}

void print_sweep(char const* backend,
                 std::int64_t dim,
                 std::int64_t n,
                 std::vector<sweep_point> const& points,
                 graph_choice const& c)
{
  std::ostringstream os;
  os << "bench_index sweep " << backend << " dim " << dim << " N " << n << " (itopk/samplings: "
     << "recall@10, us per query over the 1024-query batch; larger itopk skipped once reached):";
  for (auto const& p : points) {
    os << " " << p.params.itopk_size << "/" << p.params.num_random_samplings << ": "
       << p.recall.strict << ", " << p.seconds_per_query * 1e6 << ";";
  }
  os << " chosen " << c.chosen.params.itopk_size << "/" << c.chosen.params.num_random_samplings
     << (c.reached ? "" : " (target recall not reached)") << "\n";
  std::fputs(os.str().c_str(), stderr);
}

std::string choice_label(graph_choice const& c)
{
  std::ostringstream os;
  os << "itopk=" << c.chosen.params.itopk_size << " width=" << c.chosen.params.search_width
     << " samplings=" << c.chosen.params.num_random_samplings;
  if (!c.swept) {
    os << (c.reached ? " (the defaults)" : " (the defaults; recall below 0.95)");
  } else {
    os << (c.reached ? " (fastest with recall>=0.95 of the sweep)"
                     : " (NO setting reached recall 0.95)");
  }
  return os.str();
}

/// @brief The default search_params with the graph forced, as a choice (recall filled in later).
graph_choice default_choice()
{
  graph_choice c;
  c.chosen.params.algo = is::search_algo::graph;
  c.swept              = false;
  return c;
}

void report_choice(benchmark::State& state, graph_choice const& c)
{
  state.counters["recall"]        = c.chosen.recall.strict;
  state.counters["recall_tol"]    = c.chosen.recall.tolerant;
  state.counters["itopk"]         = c.chosen.params.itopk_size;
  state.counters["samplings"]     = c.chosen.params.num_random_samplings;
  state.counters["target_recall"] = target_recall;
}

std::vector<std::uint64_t> row_ids(std::int64_t n)
{
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
  std::iota(ids.begin(), ids.end(), std::uint64_t{0});
  return ids;
}

// ------------------------------------------------------------------------------------------------
// Host cases

/// @brief Everything built for one (N, dim) on the host, kept across cases.
struct host_case {
  std::int64_t dim{0};
  std::int64_t n{0};
  std::unique_ptr<is::graph_index> index;
  std::optional<truth> gt;
  std::optional<graph_choice> graph;
  std::optional<graph_choice> defaults;  ///< the default search_params, recall measured
#if INFERSCALE_BENCH_HNSWLIB
  std::unique_ptr<ib::hnsw_baseline> hnsw;
  std::optional<recall_figures> hnsw_recall;
#endif
};

std::unique_ptr<is::graph_index> build_host_index(dataset const& data,
                                                  std::int64_t n,
                                                  is::knn_build knn = is::knn_build::automatic,
                                                  float rho         = is::nn_descent_params{}.rho)
{
  is::index_config config;
  config.dim            = data.dim;
  config.metric         = is::distance_metric::cosine;
  config.space          = is::memory_space::host;
  config.host_knn       = knn;
  config.nn_descent.rho = rho;
  auto index            = std::make_unique<is::graph_index>(config);
  auto const ids        = row_ids(n);
  index->add(the_namespace,
             is::make_matrix_view<float const>(data.base.data(), n, data.dim),
             cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  return index;
}

#if INFERSCALE_BENCH_HNSWLIB
std::unique_ptr<ib::hnsw_baseline> build_hnsw(dataset const& data, std::int64_t n)
{
  auto h = std::make_unique<ib::hnsw_baseline>(data.dim, n, hnsw_m, hnsw_ef_construction);
  h->add(data.row(0), 0);  // the entry point first, then the rest in parallel
  is::detail::index::parallel_ranges(n - 1, 0, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin + 1; r < end + 1; ++r) {
      h->add(data.row(r), static_cast<std::uint64_t>(r));
    }
  });
  return h;
}
#endif

host_case& host_case_for(std::int64_t dim, std::int64_t n)
{
  static std::map<std::pair<std::int64_t, std::int64_t>, host_case> all;
  auto& c = all[{dim, n}];
  c.dim   = dim;
  c.n     = n;
  return c;
}

/// @brief Graph search of queries `first .. first + count - 1` (count divides num_queries).
void host_search(is::graph_index const& index,
                 dataset const& data,
                 std::int64_t first,
                 std::int64_t count,
                 is::search_params const& params,
                 std::uint64_t* ids,
                 float* distances)
{
  std::uint64_t const ns[1] = {the_namespace};
  is::search(index,
             is::make_matrix_view<float const>(data.query(first), count, data.dim),
             cuda::std::span<std::uint64_t const>{ns, 1},
             top_k,
             params,
             is::make_matrix_view<std::uint64_t>(ids, count, top_k),
             is::make_matrix_view<float>(distances, count, top_k));
}

/// @brief The case's index, ground truth and chosen parameters, made on first use (untimed).
host_case& prepare_host(std::int64_t dim, std::int64_t n, bool with_hnsw)
{
  host_case& c  = host_case_for(dim, n);
  dataset& data = data_for(dim, n);
  if (!c.index) { c.index = build_host_index(data, n); }
  if (!c.gt) { c.gt = brute_force_truth(data, n); }
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> distances(ids.size());
  if (!c.graph) {
    std::vector<sweep_point> points;
    for_each_sweep_setting(true, [&](is::search_params const& params) {
      sweep_point p;
      p.params      = params;
      auto const t0 = clock_type::now();
      host_search(*c.index, data, 0, num_queries, p.params, ids.data(), distances.data());
      p.seconds_per_query = seconds_since(t0) / num_queries;
      p.recall            = recall_of(data, *c.gt, 0, num_queries, ids.data());
      points.push_back(p);
      return p.recall.strict >= target_recall;
    });
    c.graph = choose(points);
    print_sweep("host", dim, n, points, *c.graph);
  }
  if (!c.defaults) {
    graph_choice d = default_choice();
    host_search(*c.index, data, 0, num_queries, d.chosen.params, ids.data(), distances.data());
    d.chosen.recall = recall_of(data, *c.gt, 0, num_queries, ids.data());
    d.reached       = d.chosen.recall.strict >= target_recall;
    c.defaults      = d;
  }
#if INFERSCALE_BENCH_HNSWLIB
  if (with_hnsw && !c.hnsw) { c.hnsw = build_hnsw(data, n); }
  if (with_hnsw && !c.hnsw_recall) {
    std::ostringstream os;
    os << "bench_index sweep hnswlib dim " << dim << " N " << n << " (ef: recall@10):";
    for (int ef : hnsw_efs) {
      c.hnsw->set_ef(ef);
      is::detail::index::parallel_ranges(num_queries, 0, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t q = begin; q < end; ++q) {
          c.hnsw->search(
            data.query(q), top_k, ids.data() + q * top_k, distances.data() + q * top_k);
        }
      });
      c.hnsw_recall = recall_of(data, *c.gt, 0, num_queries, ids.data());
      os << " " << ef << ": " << c.hnsw_recall->strict << ";";
      if (c.hnsw_recall->strict >= target_recall) { break; }
    }
    os << " chosen ef " << c.hnsw->ef() << "\n";
    std::fputs(os.str().c_str(), stderr);
  }
#else
  (void)with_hnsw;
#endif
  return c;
}

void host_build_bench(benchmark::State& state)
{
  std::int64_t const dim = state.range(0);
  std::int64_t const n   = state.range(1);
  ib::run_guarded(state, [&] {
    dataset& data  = data_for(dim, n);
    host_case& c   = host_case_for(dim, n);
    double seconds = 0.0;
#if INFERSCALE_BENCH_HNSWLIB
    double hnsw_seconds = 0.0;
#endif
    for (auto _ : state) {
      auto const t0  = clock_type::now();
      auto index     = build_host_index(data, n);
      double const s = seconds_since(t0);
      state.SetIterationTime(s);
      seconds += s;
      c.index = std::move(index);
      c.graph.reset();  // a new graph: choose its parameters again
      c.defaults.reset();
#if INFERSCALE_BENCH_HNSWLIB
      auto const h0 = clock_type::now();
      auto hnsw     = build_hnsw(data, n);
      hnsw_seconds += seconds_since(h0);
      c.hnsw = std::move(hnsw);
      c.hnsw_recall.reset();
#endif
    }
    auto const iterations           = static_cast<double>(state.iterations());
    state.counters["vectors_per_s"] = static_cast<double>(n) * iterations / seconds;
    state.counters["build_s"]       = seconds / iterations;
    state.counters["threads"]       = hardware_threads();
#if INFERSCALE_BENCH_HNSWLIB
    state.counters["hnswlib_build_s"]       = hnsw_seconds / iterations;
    state.counters["hnswlib_vectors_per_s"] = static_cast<double>(n) * iterations / hnsw_seconds;
    state.counters["vs_hnswlib"]            = hnsw_seconds / seconds;
    state.SetLabel(
      "graph: automatic kNN (exact <= 10,000 rows, NN-descent above) + prune + "
      "merge, degree 32/64; hnswlib M=16 efC=200; " +
      std::to_string(hardware_threads()) + " threads each");
#else
    state.SetLabel("graph: automatic kNN + prune + merge, degree 32/64; hnswlib not built in");
#endif
    state.SetItemsProcessed(n * state.iterations());
  });
}

/// @brief CPU seconds of the whole process (every thread), the build comparison's measure.
double cpu_seconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

/// @brief recall@10 over the 1,024 queries of a host index at fixed search parameters.
recall_figures host_recall(is::graph_index const& index,
                           dataset const& data,
                           truth const& gt,
                           is::search_params const& params)
{
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> distances(ids.size());
  host_search(index, data, 0, num_queries, params, ids.data(), distances.data());
  return recall_of(data, gt, 0, num_queries, ids.data());
}

/**
 * @brief index/host/build_cpu/dim:D/N:N/exact:E/rho_pct:R (issue 12, item 2; R = NN-descent's
 * sampling rate rho in percent, 50 = the default): CPU seconds (std::clock,
 * every thread) of graph_index::add of N vectors with the NN-descent kNN (`knn_build::nn_descent`,
 * single-threaded; pruning and the merge on all threads), with the exact kNN when E = 1 (O(N^2),
 * 12 CPU-minutes at 100k x 384, so off by default there), and of the hnswlib build (M 16, efC 200,
 * all threads), in the same iteration; then recall@10 after pruning at a fixed search setting
 * (itopk 64, width 1, 4 samplings, graph forced) and hnswlib's at the smallest ef of the list
 * reaching the NN-descent graph's recall (`hnswlib_ef`, the matched ef). `nnd_vs_hnswlib` =
 * NN-descent CPU seconds / hnswlib CPU seconds (target <= 1.5). Time = the NN-descent build's wall
 * time.
 */
void host_build_cpu_bench(benchmark::State& state)
{
  std::int64_t const dim = state.range(0);
  std::int64_t const n   = state.range(1);
  bool const with_exact  = state.range(2) != 0;
  float const rho        = static_cast<float>(state.range(3)) / 100.0f;
  ib::run_guarded(state, [&] {
    dataset& data = data_for(dim, n);
    host_case& c  = host_case_for(dim, n);
    if (!c.gt) { c.gt = brute_force_truth(data, n); }
    is::search_params fixed;
    fixed.itopk_size           = 64;
    fixed.num_random_samplings = 4;
    fixed.algo                 = is::search_algo::graph;
    double nnd_cpu = 0.0, nnd_wall = 0.0, exact_cpu = 0.0, hnsw_cpu = 0.0;
    recall_figures nnd_recall, exact_recall, hnsw_recall;
    std::uint32_t iterations = 0;
    int ef_matched           = 0;
    for (auto _ : state) {
      double const c0 = cpu_seconds();
      auto const t0   = clock_type::now();
      auto index      = build_host_index(data, n, is::knn_build::nn_descent, rho);
      nnd_wall        = seconds_since(t0);
      nnd_cpu         = cpu_seconds() - c0;
      state.SetIterationTime(nnd_wall);
      iterations = index_access::last_nn_descent(*index).iterations;
      nnd_recall = host_recall(*index, data, *c.gt, fixed);
      index.reset();
      if (with_exact) {
        double const e0 = cpu_seconds();
        auto exact      = build_host_index(data, n, is::knn_build::exact);
        exact_cpu       = cpu_seconds() - e0;
        exact_recall    = host_recall(*exact, data, *c.gt, fixed);
      }
#if INFERSCALE_BENCH_HNSWLIB
      double const h0 = cpu_seconds();
      auto hnsw       = build_hnsw(data, n);
      hnsw_cpu        = cpu_seconds() - h0;
      std::vector<std::uint64_t> ids(static_cast<std::size_t>(num_queries * top_k));
      std::vector<float> distances(ids.size());
      for (int ef : hnsw_efs) {
        hnsw->set_ef(ef);
        for (std::int64_t q = 0; q < num_queries; ++q) {
          hnsw->search(data.query(q), top_k, ids.data() + q * top_k, distances.data() + q * top_k);
        }
        hnsw_recall = recall_of(data, *c.gt, 0, num_queries, ids.data());
        ef_matched  = ef;
        if (hnsw_recall.strict >= nnd_recall.strict) { break; }
      }
#endif
    }
    state.counters["nnd_cpu_s"]      = nnd_cpu;
    state.counters["nnd_wall_s"]     = nnd_wall;
    state.counters["nnd_iterations"] = iterations;
    state.counters["nnd_recall"]     = nnd_recall.strict;
    state.counters["nnd_recall_tol"] = nnd_recall.tolerant;
    if (with_exact) {
      state.counters["exact_cpu_s"]  = exact_cpu;
      state.counters["exact_recall"] = exact_recall.strict;
      state.counters["nnd_vs_exact"] = nnd_cpu / exact_cpu;
    }
    std::ostringstream os;
    os << "bench_index build_cpu dim " << dim << " N " << n << " rho " << rho << ": nn_descent "
       << nnd_cpu << " cpu-s (" << nnd_wall << " s wall, " << iterations
       << " iterations), recall@10 " << nnd_recall.strict << " at itopk 64/4 samplings";
    if (with_exact) {
      os << "; exact " << exact_cpu << " cpu-s, recall@10 " << exact_recall.strict;
    }
#if INFERSCALE_BENCH_HNSWLIB
    state.counters["hnswlib_cpu_s"]  = hnsw_cpu;
    state.counters["hnswlib_ef"]     = ef_matched;
    state.counters["hnswlib_recall"] = hnsw_recall.strict;
    state.counters["nnd_vs_hnswlib"] = nnd_cpu / hnsw_cpu;
    if (with_exact) { state.counters["exact_vs_hnswlib"] = exact_cpu / hnsw_cpu; }
    os << "; hnswlib " << hnsw_cpu << " cpu-s, recall@10 " << hnsw_recall.strict << " at ef "
       << ef_matched << "; nn_descent / hnswlib " << nnd_cpu / hnsw_cpu;
#endif
    os << "\n";
    std::fputs(os.str().c_str(), stderr);
    state.SetLabel(
      "CPU seconds: NN-descent (1 thread) + prune/merge (all threads) vs hnswlib M=16 "
      "efC=200 (all threads); recall@10 at itopk 64, 4 samplings vs hnswlib's matched ef");
  });
}

void host_search_bench(benchmark::State& state)
{
  std::int64_t const dim   = state.range(0);
  std::int64_t const n     = state.range(1);
  std::int64_t const batch = state.range(2);
  ib::run_guarded(state, [&] {
    host_case& c                         = prepare_host(dim, n, true);
    dataset& data                        = data_for(dim, n);
    is::search_params const graph_params = c.graph->chosen.params;
    is::search_params exact_params       = graph_params;
    exact_params.algo                    = is::search_algo::exact;
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(batch * top_k));
    std::vector<float> distances(ids.size());

    double seconds = 0.0, exact_seconds = 0.0;
#if INFERSCALE_BENCH_HNSWLIB
    double hnsw_seconds   = 0.0;
    auto const hnsw_batch = [&](std::int64_t first) {
      is::detail::index::parallel_ranges(batch, 0, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) {
          c.hnsw->search(
            data.query(first + i), top_k, ids.data() + i * top_k, distances.data() + i * top_k);
        }
      });
    };
#endif
    std::int64_t first  = 0;
    double exact_recall = 0.0, exact_batches = 0.0;
    for (auto _ : state) {
      auto const t0 = clock_type::now();
      host_search(*c.index, data, first, batch, graph_params, ids.data(), distances.data());
      benchmark::ClobberMemory();
      double const s = seconds_since(t0);
      state.SetIterationTime(s);
      seconds += s;
      auto const e0 = clock_type::now();
      host_search(*c.index, data, first, batch, exact_params, ids.data(), distances.data());
      benchmark::ClobberMemory();
      exact_seconds += seconds_since(e0);
      exact_recall += recall_of(data, *c.gt, first, batch, ids.data()).strict;
      exact_batches += 1.0;
#if INFERSCALE_BENCH_HNSWLIB
      auto const h0 = clock_type::now();
      hnsw_batch(first);
      benchmark::ClobberMemory();
      hnsw_seconds += seconds_since(h0);
#endif
      first = (first + batch) % num_queries;
    }
    double const queries = static_cast<double>(batch) * static_cast<double>(state.iterations());
    report_choice(state, *c.graph);
    state.counters["QPS"]                = queries / seconds;
    state.counters["us_per_query"]       = seconds / queries * 1e6;
    state.counters["exact_QPS"]          = queries / exact_seconds;
    state.counters["exact_us_per_query"] = exact_seconds / queries * 1e6;
    state.counters["exact_recall"]       = exact_recall / exact_batches;
    state.counters["speedup"]            = exact_seconds / seconds;
    state.counters["threads"]            = threads_for_batch(batch);
    std::string label                    = "graph " + choice_label(*c.graph);
#if INFERSCALE_BENCH_HNSWLIB
    state.counters["hnswlib_QPS"]          = queries / hnsw_seconds;
    state.counters["hnswlib_us_per_query"] = hnsw_seconds / queries * 1e6;
    state.counters["hnswlib_recall"]       = c.hnsw_recall->strict;
    state.counters["hnswlib_recall_tol"]   = c.hnsw_recall->tolerant;
    state.counters["hnswlib_ef"]           = c.hnsw->ef();
    state.counters["vs_hnswlib"]           = hnsw_seconds / seconds;
    label += "; hnswlib M=16 efC=200 ef=" + std::to_string(c.hnsw->ef()) +
             " one thread per query, batch over " + std::to_string(threads_for_batch(batch)) +
             " thread(s)";
#endif
    state.SetLabel(label);
    state.SetItemsProcessed(batch * state.iterations());
  });
}

/// @brief What one run of a crossover case measured (Google Benchmark also calls a case with
/// fewer iterations while it sizes the run; only the runs with the most iterations are used).
struct crossover_point {
  double speedup;
  double cost_factor;
  std::int64_t iterations;
};

/// @brief Which crossover: host or device, parameters of the sweep or the defaults.
enum class crossover_kind : int { host_swept, host_defaults, device_swept, device_defaults };

/// @brief Per kind, dimension and N: the crossover cases' measurements.
std::map<std::int64_t, std::vector<crossover_point>>& crossover_results(crossover_kind kind,
                                                                        std::int64_t dim)
{
  static std::map<std::pair<int, std::int64_t>,
                  std::map<std::int64_t, std::vector<crossover_point>>>
    all;
  return all[{static_cast<int>(kind), dim}];
}

/**
 * @brief The index's automatic switch-over (a cost model: exact while live <= factor * the graph
 * search's estimated distances, detail::index::estimated_graph_distances) against this
 * measurement: `graph_distances_est` for the plan of these parameters, `cost_factor` = the factor
 * that puts the switch-over exactly here (graph seconds / exact seconds * N / estimate; the
 * model's host_graph_cost_factor / device_graph_cost_factor should be about this where graph and
 * exact are close), `auto_threshold` = the index's own threshold for these parameters and
 * `auto_picks_exact` (1 when automatic would search this N exactly).
 */
void report_cost_model(benchmark::State& state,
                       is::graph_index const& index,
                       is::search_params const& params,
                       std::int64_t n,
                       double graph_over_exact)
{
  auto const rows       = static_cast<std::uint32_t>(n);
  double const estimate = is::detail::index::estimated_graph_distances(
    index_access::plan_for(index, rows, top_k, params), index_access::graph_degree(index));
  std::int64_t const threshold          = index.exact_search_threshold(params, rows);
  state.counters["graph_distances_est"] = estimate;
  state.counters["cost_factor"]         = graph_over_exact * static_cast<double>(n) / estimate;
  state.counters["auto_threshold"]      = static_cast<double>(threshold);
  state.counters["auto_picks_exact"]    = n <= threshold ? 1.0 : 0.0;
}

void host_crossover_bench(benchmark::State& state, bool defaults)
{
  std::int64_t const dim = state.range(0);
  std::int64_t const n   = state.range(1);
  ib::run_guarded(state, [&] {
    host_case& c                         = prepare_host(dim, n, false);
    dataset& data                        = data_for(dim, n);
    graph_choice const& choice           = defaults ? *c.defaults : *c.graph;
    is::search_params const graph_params = choice.chosen.params;
    is::search_params exact_params       = graph_params;
    exact_params.algo                    = is::search_algo::exact;
    std::uint64_t ids[top_k];
    float distances[top_k];
    double seconds = 0.0, exact_seconds = 0.0;
    std::int64_t q = 0;
    for (auto _ : state) {
      auto const t0 = clock_type::now();
      host_search(*c.index, data, q, 1, graph_params, ids, distances);
      benchmark::ClobberMemory();
      double const s = seconds_since(t0);
      state.SetIterationTime(s);
      seconds += s;
      auto const e0 = clock_type::now();
      host_search(*c.index, data, q, 1, exact_params, ids, distances);
      benchmark::ClobberMemory();
      exact_seconds += seconds_since(e0);
      q = (q + 1) % num_queries;
    }
    double const iterations = static_cast<double>(state.iterations());
    report_choice(state, choice);
    state.counters["graph_us"] = seconds / iterations * 1e6;
    state.counters["exact_us"] = exact_seconds / iterations * 1e6;
    state.counters["speedup"]  = exact_seconds / seconds;
    report_cost_model(state, *c.index, graph_params, n, seconds / exact_seconds);
    state.SetLabel("batch 1, graph " + choice_label(choice));
    crossover_results(defaults ? crossover_kind::host_defaults : crossover_kind::host_swept, dim)[n]
      .push_back({exact_seconds / seconds,
                  state.counters["cost_factor"].value,
                  static_cast<std::int64_t>(state.iterations())});
  });
}

/// @brief Reports the crossover from the crossover cases that ran before it in this process.
void crossover_summary_bench(benchmark::State& state, crossover_kind kind)
{
  bool const device =
    kind == crossover_kind::device_swept || kind == crossover_kind::device_defaults;
  if (device && !ib::require_device(state)) { return; }
  std::int64_t const dim = state.range(0);
  auto const& by_n       = crossover_results(kind, dim);
  for (auto _ : state) {
    state.SetIterationTime(1e-9);  // nothing is measured here
  }
  if (by_n.empty()) {
    state.SkipWithError("no crossover case of this dimension ran before the summary");
    return;
  }
  // means per N; the crossover is the smallest N from which every larger N also wins
  struct row {
    std::int64_t n;
    double speedup;
    double cost_factor;
  };
  std::vector<row> mean;
  for (auto const& [n, points] : by_n) {
    std::int64_t most = 0;
    for (auto const& p : points) {
      most = std::max(most, p.iterations);
    }
    double speedup = 0.0, factor = 0.0, count = 0.0;
    for (auto const& p : points) {
      if (p.iterations != most) { continue; }  // a sizing run
      speedup += p.speedup;
      factor += p.cost_factor;
      count += 1.0;
    }
    mean.push_back({n, speedup / count, factor / count});
  }
  std::int64_t crossover  = 0;
  double crossover_factor = 0.0;
  for (auto it = mean.rbegin(); it != mean.rend() && it->speedup > 1.0; ++it) {
    crossover = it->n;
  }
  // the factor at parity: interpolated between the last N where exact won and the crossover N
  for (std::size_t i = 1; i < mean.size(); ++i) {
    if (mean[i].n == crossover) {
      double const a = std::log(mean[i - 1].speedup), b = std::log(mean[i].speedup);
      double const w = b > a ? -a / (b - a) : 1.0;
      crossover_factor =
        mean[i - 1].cost_factor + w * (mean[i].cost_factor - mean[i - 1].cost_factor);
    }
  }
  std::ostringstream label;
  label << "by N, speedup (exact/graph, batch 1) / cost factor:";
  for (auto const& r : mean) {
    label << " " << r.n << ": " << r.speedup << " / " << r.cost_factor << ";";
  }
  label << (crossover == 0 ? " graph not faster at the largest N" : "");
  state.counters["crossover_N"]        = static_cast<double>(crossover);
  state.counters["parity_cost_factor"] = crossover_factor;
  state.counters["measured_Ns"]        = static_cast<double>(mean.size());
  state.counters["largest_N"]          = static_cast<double>(mean.back().n);
  state.SetLabel(label.str());
}

// ------------------------------------------------------------------------------------------------
// Device cases

constexpr std::int64_t tenants_in_batch = 64;
constexpr std::int64_t facts_per_tenant = 2000;
constexpr std::uint64_t first_tenant    = 100;

/// @brief The resources every device case uses (created on first use, after require_device).
raft::device_resources& device_res()
{
  // never destroyed: its destructor would run after the CUDA runtime has shut down
  static auto* res = new raft::device_resources();
  return *res;
}

cudaStream_t device_stream() { return raft::resource::get_cuda_stream(device_res()).get(); }

std::unique_ptr<is::graph_index> new_device_index(std::int64_t dim)
{
  is::index_config config;
  config.dim    = dim;
  config.metric = is::distance_metric::cosine;
  config.space  = is::memory_space::device;
  return std::make_unique<is::graph_index>(config);
}

is::graph_builder device_builder(is::graph_index const& index)
{
  return is::make_device_graph_builder(device_res(), index.config());
}

/// @brief Adds rows [first, first + n) of `data` to namespace `ns` with ids = row numbers.
void device_add(
  is::graph_index& index, dataset const& data, std::uint64_t ns, std::int64_t first, std::int64_t n)
{
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
  std::iota(ids.begin(), ids.end(), static_cast<std::uint64_t>(first));
  index.add(ns,
            is::make_matrix_view<float const>(data.row(first), n, data.dim),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()},
            device_builder(index));
}

/// @brief Device outputs of a batch of up to num_queries queries.
struct device_outputs {
  ib::device_buffer<std::uint64_t> ids{static_cast<std::size_t>(num_queries * top_k)};
  ib::device_buffer<float> distances{static_cast<std::size_t>(num_queries * top_k)};

  is::matrix_view<std::uint64_t> ids_view(std::int64_t count) const
  {
    return is::make_matrix_view<std::uint64_t>(ids.data(), count, top_k);
  }
  is::matrix_view<float> distances_view(std::int64_t count) const
  {
    return is::make_matrix_view<float>(distances.data(), count, top_k);
  }
  std::vector<std::uint64_t> host_ids(std::int64_t count) const
  {
    std::vector<std::uint64_t> out(static_cast<std::size_t>(count * top_k));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(device_stream()));
    INFERSCALE_CUDA_TRY(cudaMemcpy(
      out.data(), ids.data(), out.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
    return out;
  }
  std::vector<float> host_distances(std::int64_t count) const
  {
    std::vector<float> out(static_cast<std::size_t>(count * top_k));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(device_stream()));
    INFERSCALE_CUDA_TRY(
      cudaMemcpy(out.data(), distances.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
  }
};

/// @brief Everything built for one device (N, dim), kept across cases.
struct device_case {
  std::int64_t dim{0};
  std::int64_t n{0};
  std::unique_ptr<is::graph_index> index;
  std::unique_ptr<ib::device_buffer<float>> queries;  ///< [num_queries][dim]
  std::optional<truth> gt;                            ///< exact_search's answer
  std::optional<graph_choice> graph;
  std::optional<graph_choice> defaults;

  is::matrix_view<float const> query_view(std::int64_t first, std::int64_t count) const
  {
    return is::make_matrix_view<float const>(queries->data() + first * dim, count, dim);
  }
};

device_case& device_case_for(std::int64_t dim, std::int64_t n)
{
  static std::map<std::pair<std::int64_t, std::int64_t>, device_case> all;
  auto& c = all[{dim, n}];
  c.dim   = dim;
  c.n     = n;
  return c;
}

void device_graph_search(device_case const& c,
                         std::int64_t first,
                         std::int64_t count,
                         is::search_params const& params,
                         device_outputs const& out)
{
  std::uint64_t const ns[1] = {the_namespace};
  is::search(device_res(),
             *c.index,
             c.query_view(first, count),
             cuda::std::span<std::uint64_t const>{ns, 1},
             top_k,
             params,
             out.ids_view(count),
             out.distances_view(count));
}

void device_exact_search(device_case const& c,
                         std::int64_t first,
                         std::int64_t count,
                         device_outputs const& out)
{
  is::exact_search(device_res(),
                   *c.index,
                   the_namespace,
                   c.query_view(first, count),
                   top_k,
                   out.ids_view(count),
                   out.distances_view(count));
}

/// @brief Seconds between two events recorded on the device stream around `work()`.
template <class Work>
double event_seconds(ib::cuda_event const& start, ib::cuda_event const& stop, Work&& work)
{
  INFERSCALE_CUDA_TRY(cudaEventRecord(start.get(), device_stream()));
  work();
  INFERSCALE_CUDA_TRY(cudaEventRecord(stop.get(), device_stream()));
  INFERSCALE_CUDA_TRY(cudaEventSynchronize(stop.get()));
  return ib::elapsed_seconds(start, stop);
}

/// @brief The truth of a device case: exact_search of all queries (ids and 10th distance).
truth device_truth(device_case const& c, device_outputs const& out)
{
  device_exact_search(c, 0, num_queries, out);
  truth t;
  t.n          = c.n;
  t.ids        = out.host_ids(num_queries);
  auto const d = out.host_distances(num_queries);
  t.kth.resize(static_cast<std::size_t>(num_queries));
  for (std::int64_t q = 0; q < num_queries; ++q) {
    t.kth[static_cast<std::size_t>(q)] = d[static_cast<std::size_t>(q * top_k + top_k - 1)];
  }
  return t;
}

/// @brief The sweep of a device search over all queries: `run(params)` enqueues one batch search.
template <class Run>
graph_choice device_sweep(dataset const& data,
                          truth const& gt,
                          device_outputs const& out,
                          std::int64_t dim,
                          std::int64_t n,
                          Run&& run)
{
  ib::cuda_event start, stop;
  std::vector<sweep_point> points;
  for_each_sweep_setting(false, [&](is::search_params const& params) {
    sweep_point p;
    p.params = params;
    run(p.params);  // warm-up
    double best = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < 3; ++rep) {
      best = std::min(best, event_seconds(start, stop, [&] { run(p.params); }));
    }
    p.seconds_per_query = best / num_queries;
    p.recall            = recall_of(data, gt, 0, num_queries, out.host_ids(num_queries).data());
    points.push_back(p);
    return p.recall.strict >= target_recall;
  });
  graph_choice const c = choose(points);
  print_sweep("device", dim, n, points, c);
  return c;
}

/// @brief Builds (untimed, if the build case has not), computes the truth and chooses parameters.
device_case& prepare_device(std::int64_t dim, std::int64_t n, device_outputs const& out)
{
  device_case& c = device_case_for(dim, n);
  dataset& data  = data_for(dim, n);
  if (!c.index) {
    c.index = new_device_index(dim);
    device_add(*c.index, data, the_namespace, 0, n);
  }
  if (!c.queries) { c.queries = std::make_unique<ib::device_buffer<float>>(data.queries); }
  if (!c.gt) { c.gt = device_truth(c, out); }
  if (!c.graph) {
    c.graph = device_sweep(data, *c.gt, out, dim, n, [&](is::search_params const& p) {
      device_graph_search(c, 0, num_queries, p, out);
    });
  }
  return c;
}

void device_build_bench(benchmark::State& state)
{
  if (!ib::require_device(state)) { return; }
  std::int64_t const dim = state.range(0);
  std::int64_t const n   = state.range(1);
  ib::run_guarded(state, [&] {
    dataset& data  = data_for(dim, n);
    device_case& c = device_case_for(dim, n);
    double seconds = 0.0;
    for (auto _ : state) {
      auto const t0 = clock_type::now();
      auto index    = new_device_index(dim);
      device_add(*index, data, the_namespace, 0, n);
      INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
      double const s = seconds_since(t0);
      state.SetIterationTime(s);
      seconds += s;
      c.index = std::move(index);
      c.gt.reset();
      c.graph.reset();
      c.defaults.reset();
    }
    auto const iterations           = static_cast<double>(state.iterations());
    state.counters["vectors_per_s"] = static_cast<double>(n) * iterations / seconds;
    state.counters["build_s"]       = seconds / iterations;
    state.SetLabel(
      "graph_index::add, make_device_graph_builder(res, config): kNN gemm+select_k "
      "and pruning on the GPU, reverse/merge on the host; wall time");
    state.SetItemsProcessed(n * state.iterations());
  });
}

/**
 * @brief The timed loop of the device search cases: per iteration, from a cold L2, `graph(first)`
 * between CUDA events (the benchmark's time) and its host wall time to the end of the work, then
 * `exact(first)` between CUDA events; `first` cycles through the queries in steps of `batch`.
 * `p50_us_per_query`: the median call's time per query (at batch 1, the p50 latency).
 */
template <class Graph, class Exact>
void device_search_loop(benchmark::State& state, std::int64_t batch, Graph&& graph, Exact&& exact)
{
  ib::l2_flusher flusher;
  ib::cuda_event g0, g1, e0, e1;
  double seconds = 0.0, wall_seconds = 0.0, exact_seconds = 0.0;
  std::int64_t first = 0;
  graph(first);
  exact(first);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(device_stream()));
  std::vector<double> per_call;  // each call's event time, for the median (p50) latency
  for (auto _ : state) {
    flusher.flush(device_stream());
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(device_stream()));
    auto const w0  = clock_type::now();
    double const s = event_seconds(g0, g1, [&] { graph(first); });
    wall_seconds += seconds_since(w0);
    state.SetIterationTime(s);
    seconds += s;
    per_call.push_back(s);
    flusher.flush(device_stream());
    exact_seconds += event_seconds(e0, e1, [&] { exact(first); });
    first = (first + batch) % num_queries;
  }
  double const queries  = static_cast<double>(batch) * static_cast<double>(state.iterations());
  state.counters["QPS"] = queries / seconds;
  state.counters["us_per_query"] = seconds / queries * 1e6;
  if (!per_call.empty()) {  // the median call, per query (batch 1: the p50 query latency)
    std::nth_element(per_call.begin(), per_call.begin() + per_call.size() / 2, per_call.end());
    state.counters["p50_us_per_query"] =
      per_call[per_call.size() / 2] / static_cast<double>(batch) * 1e6;
  }
  state.counters["wall_us_per_query"]  = wall_seconds / queries * 1e6;
  state.counters["exact_QPS"]          = queries / exact_seconds;
  state.counters["exact_us_per_query"] = exact_seconds / queries * 1e6;
  state.counters["speedup"]            = exact_seconds / seconds;
  state.SetItemsProcessed(batch * state.iterations());
}

void device_search_bench(benchmark::State& state)
{
  if (!ib::require_device(state)) { return; }
  std::int64_t const dim   = state.range(0);
  std::int64_t const n     = state.range(1);
  std::int64_t const batch = state.range(2);
  ib::run_guarded(state, [&] {
    device_outputs const out;
    device_case& c           = prepare_device(dim, n, out);
    is::search_params params = c.graph->chosen.params;
    params.ctas_per_query    = static_cast<std::uint32_t>(state.range(3));
    device_search_loop(
      state,
      batch,
      [&](std::int64_t first) { device_graph_search(c, first, batch, params, out); },
      [&](std::int64_t first) { device_exact_search(c, first, batch, out); });
    report_choice(state, *c.graph);
    state.SetLabel("graph " + choice_label(*c.graph) +
                   "; exact = inferscale::exact_search (RAFT gemm + select_k); cold L2");
  });
}

/**
 * @brief 1,024 queries over 64 namespaces of 2,000 facts (query q in namespace q / 16, so each
 * namespace's queries are contiguous), one search call with the graph forced; beside it the same
 * call with search_algo::exact (`exact_*`: the in-kernel brute force) and exact_search once per
 * namespace (`raft_exact_us_per_query`, 64 calls). Recall against the in-kernel exact answer.
 */
void device_multi_tenant_bench(benchmark::State& state)
{
  if (!ib::require_device(state)) { return; }
  std::int64_t const dim = state.range(0);
  ib::run_guarded(state, [&] {
    std::int64_t const total = tenants_in_batch * facts_per_tenant;
    dataset& data            = data_for(dim, total);
    static std::map<std::int64_t, std::unique_ptr<is::graph_index>> built;
    auto& index = built[dim];
    if (!index) {
      index = new_device_index(dim);
      for (std::int64_t t = 0; t < tenants_in_batch; ++t) {
        device_add(*index,
                   data,
                   first_tenant + static_cast<std::uint64_t>(t),
                   t * facts_per_tenant,
                   facts_per_tenant);
      }
    }
    std::int64_t const per_tenant = num_queries / tenants_in_batch;
    std::vector<std::uint64_t> namespaces(static_cast<std::size_t>(num_queries));
    for (std::int64_t q = 0; q < num_queries; ++q) {
      namespaces[static_cast<std::size_t>(q)] =
        first_tenant + static_cast<std::uint64_t>(q / per_tenant);
    }
    ib::device_buffer<float> const queries(data.queries);
    auto const query_view = is::make_matrix_view<float const>(queries.data(), num_queries, dim);
    device_outputs const out;
    auto const run = [&](is::search_params const& p) {
      is::search(device_res(),
                 *index,
                 query_view,
                 cuda::std::span<std::uint64_t const>{namespaces.data(), namespaces.size()},
                 top_k,
                 p,
                 out.ids_view(num_queries),
                 out.distances_view(num_queries));
    };
    // truth: the in-kernel exact search; ids are global row numbers, so recall_of applies
    is::search_params exact_params;
    exact_params.algo = is::search_algo::exact;
    run(exact_params);
    truth gt;
    gt.n         = total;
    gt.ids       = out.host_ids(num_queries);
    auto const d = out.host_distances(num_queries);
    gt.kth.resize(static_cast<std::size_t>(num_queries));
    for (std::int64_t q = 0; q < num_queries; ++q) {
      gt.kth[static_cast<std::size_t>(q)] = d[static_cast<std::size_t>(q * top_k + top_k - 1)];
    }
    graph_choice const choice = device_sweep(data, gt, out, dim, total, run);

    // exact_search once per namespace over its contiguous queries (the RAFT ceiling)
    ib::cuda_event r0, r1;
    auto const raft_exact = [&] {
      for (std::int64_t t = 0; t < tenants_in_batch; ++t) {
        is::exact_search(
          device_res(),
          *index,
          first_tenant + static_cast<std::uint64_t>(t),
          is::make_matrix_view<float const>(queries.data() + t * per_tenant * dim, per_tenant, dim),
          top_k,
          is::make_matrix_view<std::uint64_t>(
            out.ids.data() + t * per_tenant * top_k, per_tenant, top_k),
          is::make_matrix_view<float>(
            out.distances.data() + t * per_tenant * top_k, per_tenant, top_k));
      }
    };
    raft_exact();
    double raft_seconds = 0.0;
    device_search_loop(
      state,
      num_queries,
      [&](std::int64_t) { run(choice.chosen.params); },
      [&](std::int64_t) { run(exact_params); });
    for (std::int64_t i = 0; i < 5; ++i) {  // after the loop, on its own events
      raft_seconds += event_seconds(r0, r1, raft_exact);
    }
    report_choice(state, choice);
    state.counters["raft_exact_us_per_query"] = raft_seconds / 5.0 / num_queries * 1e6;
    state.counters["namespaces"]              = static_cast<double>(tenants_in_batch);
    state.SetLabel("graph " + choice_label(choice) +
                   "; one call, 64 namespaces x 2000 facts; exact = same call with "
                   "search_algo::exact; raft_exact = exact_search per namespace (64 calls)");
  });
}

/**
 * @brief The multi-tenant shape on the device (issue 32; the host's is bench_index_tenants):
 * 1,000 users with namespaces of bench/common/tenants_shape.hpp (median 100 facts, 50 to 5,000),
 * one device index, the 1,024 queries of tenants_shape::query_owners; each iteration one call
 * of inferscale::search over the next B queries (each in its own namespace; search_params{}, so
 * the automatic exact/graph choice and the calibrated list size), timed between CUDA events from
 * a cold L2, then the same call with search_algo::exact (`exact_*`). Recall against the fp32
 * brute force over each query's namespace, computed on the host. The ceiling beside it: the
 * bytes the exact part of a step must read (every row of each namespace searched exactly, its
 * `exact_share` of the queries) at the device's copy bandwidth measured in the same run
 * (cudaMemcpyAsync device to device, 256 MiB: `copy_GBps`, reads + writes), `exact_bytes_per_query`
 * and `scan_GBps` = those bytes / the step time: the fraction of the copy bandwidth the step's
 * scans reach (graph queries read less than their rows and are not counted).
 */
void device_tenants_bench(benchmark::State& state)
{
  if (!ib::require_device(state)) { return; }
  std::int64_t const dim       = state.range(0);
  std::int64_t const batch     = state.range(1);
  constexpr std::int64_t users = 1000;
  ib::run_guarded(state, [&] {
    struct shape_set {
      std::unique_ptr<is::graph_index> index;
      std::vector<std::uint32_t> sizes;
      std::vector<std::uint64_t> namespaces;  ///< [Q]
      std::vector<std::uint64_t> truth;       ///< [Q][k]
      std::unique_ptr<ib::device_buffer<float>> queries;
    };
    static std::map<std::int64_t, shape_set> sets;
    shape_set& set = sets[dim];
    if (!set.index) {
      set.index         = new_device_index(dim);
      set.sizes         = ib::tenants::namespace_sizes(users);
      auto const owners = ib::tenants::query_owners(users, num_queries);
      std::vector<float> queries(static_cast<std::size_t>(num_queries * dim));
      set.namespaces.resize(static_cast<std::size_t>(num_queries));
      set.truth.resize(static_cast<std::size_t>(num_queries * top_k));
      std::uint64_t first_id      = 0;
      std::int64_t const per_user = (num_queries + users - 1) / users;
      for (std::int64_t u = 0; u < users; ++u) {
        std::uint32_t const n = set.sizes[static_cast<std::size_t>(u)];
        auto const d          = ib::tenants::user_vectors(u, dim, n, per_user);
        std::vector<std::uint64_t> ids(n);
        std::iota(ids.begin(), ids.end(), first_id);
        set.index->add(static_cast<std::uint64_t>(u),
                       is::make_matrix_view<float const>(d.facts.data(), n, dim),
                       cuda::std::span<std::uint64_t const>{ids.data(), ids.size()},
                       device_builder(*set.index));
        for (std::int64_t q = 0; q < num_queries; ++q) {
          auto const& o = owners[static_cast<std::size_t>(q)];
          if (o.user != u) { continue; }
          float const* query = d.queries.data() + o.nth * dim;
          std::copy(query, query + dim, queries.begin() + q * dim);
          set.namespaces[static_cast<std::size_t>(q)] = static_cast<std::uint64_t>(u);
          std::vector<std::pair<float, std::uint64_t>> all(n);
          for (std::uint32_t r = 0; r < n; ++r) {
            float dot = 0.0f;
            for (std::int64_t e = 0; e < dim; ++e) {
              dot += query[e] * d.facts[static_cast<std::size_t>(r * dim + e)];
            }
            all[r] = {1.0f - dot, ids[r]};
          }
          std::partial_sort(all.begin(), all.begin() + top_k, all.end());
          for (std::int64_t j = 0; j < top_k; ++j) {
            set.truth[static_cast<std::size_t>(q * top_k + j)] =
              all[static_cast<std::size_t>(j)].second;
          }
        }
        first_id += n;
      }
      set.queries = std::make_unique<ib::device_buffer<float>>(queries);
    }
    device_outputs const out;
    auto const run = [&](std::int64_t first, is::search_params const& p) {
      is::search(device_res(),
                 *set.index,
                 is::make_matrix_view<float const>(set.queries->data() + first * dim, batch, dim),
                 cuda::std::span<std::uint64_t const>{set.namespaces.data() + first,
                                                      static_cast<std::size_t>(batch)},
                 top_k,
                 p,
                 out.ids_view(batch),
                 out.distances_view(batch));
    };
    is::search_params const automatic{};
    is::search_params exact;
    exact.algo = is::search_algo::exact;
    // recall and the exact share over the whole query set, outside the timed loop
    std::size_t hits     = 0;
    double exact_queries = 0.0, exact_bytes = 0.0;
    double const row_bytes = static_cast<double>(index_access::row_elements(*set.index)) * 4.0;
    for (std::int64_t first = 0; first + batch <= num_queries; first += batch) {
      run(first, automatic);
      auto const got = out.host_ids(batch);
      for (std::int64_t q = 0; q < batch; ++q) {
        auto const* want = set.truth.data() + (first + q) * top_k;
        for (std::int64_t j = 0; j < top_k; ++j) {
          hits += std::find(want, want + top_k, got[static_cast<std::size_t>(q * top_k + j)]) !=
                      want + top_k
                    ? 1
                    : 0;
        }
        auto const seg = index_access::tenant_segment(
          *set.index, set.namespaces[static_cast<std::size_t>(first + q)]);
        if (index_access::uses_exact(*set.index, seg, automatic)) {
          exact_queries += 1.0;
          exact_bytes += static_cast<double>(seg.size) * row_bytes;
        }
      }
    }
    double const measured = static_cast<double>(num_queries / batch * batch);
    // the copy ceiling, same run: 256 MiB device to device
    std::size_t const copy_bytes = std::size_t{256} << 20;
    ib::device_buffer<unsigned char> src(copy_bytes), dst(copy_bytes);
    ib::cuda_event c0, c1;
    double copy_s = 1e30;
    for (int i = 0; i < 5; ++i) {
      copy_s = std::min(
        copy_s, event_seconds(c0, c1, [&] {
          INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
            dst.data(), src.data(), copy_bytes, cudaMemcpyDeviceToDevice, device_stream()));
        }));
    }
    device_search_loop(
      state,
      batch,
      [&](std::int64_t first) { run(first % (num_queries - batch + 1), automatic); },
      [&](std::int64_t first) { run(first % (num_queries - batch + 1), exact); });
    double const copy_gbps                  = 2.0 * static_cast<double>(copy_bytes) / copy_s / 1e9;
    double const per_query                  = exact_bytes / measured;
    state.counters["recall"]                = static_cast<double>(hits) / (measured * top_k);
    state.counters["exact_share"]           = exact_queries / measured;
    state.counters["exact_bytes_per_query"] = per_query;
    state.counters["copy_GBps"]             = copy_gbps;
    state.counters["scan_GBps"]             = per_query * state.counters["QPS"].value / 1e9;
    state.counters["vs_copy"]               = state.counters["scan_GBps"].value / copy_gbps;
    state.counters["users"]                 = static_cast<double>(users);
    state.SetLabel("1,000 users (median 100 facts), batch " + std::to_string(batch) +
                   ", search_params{}; exact = search_algo::exact; cold L2");
  });
}

void device_crossover_bench(benchmark::State& state, bool defaults)
{
  if (!ib::require_device(state)) { return; }
  std::int64_t const dim = state.range(0);
  std::int64_t const n   = state.range(1);
  ib::run_guarded(state, [&] {
    device_outputs const out;
    device_case& c = prepare_device(dim, n, out);
    if (!c.defaults) {
      graph_choice d = default_choice();
      device_graph_search(c, 0, num_queries, d.chosen.params, out);
      d.chosen.recall =
        recall_of(data_for(dim, n), *c.gt, 0, num_queries, out.host_ids(num_queries).data());
      d.reached  = d.chosen.recall.strict >= target_recall;
      c.defaults = d;
    }
    graph_choice const& choice     = defaults ? *c.defaults : *c.graph;
    is::search_params const params = choice.chosen.params;
    is::search_params exact_params = params;
    exact_params.algo              = is::search_algo::exact;
    ib::cuda_event r0, r1;
    double raft_seconds     = 0.0;
    std::int64_t raft_first = 0;
    device_search_loop(
      state,
      1,
      [&](std::int64_t first) { device_graph_search(c, first, 1, params, out); },
      [&](std::int64_t first) { device_graph_search(c, first, 1, exact_params, out); });
    for (std::int64_t i = 0; i < 64; ++i) {
      raft_seconds += event_seconds(r0, r1, [&] { device_exact_search(c, raft_first, 1, out); });
      raft_first = (raft_first + 1) % num_queries;
    }
    report_choice(state, choice);
    state.counters["graph_us"]      = state.counters["us_per_query"].value;
    state.counters["exact_us"]      = state.counters["exact_us_per_query"].value;
    state.counters["raft_exact_us"] = raft_seconds / 64.0 * 1e6;
    report_cost_model(state, *c.index, params, n, 1.0 / state.counters["speedup"].value);
    state.SetLabel("batch 1, graph " + choice_label(choice) +
                   "; exact = search_algo::exact (what the threshold selects); raft_exact = "
                   "exact_search");
    crossover_results(defaults ? crossover_kind::device_defaults : crossover_kind::device_swept,
                      dim)[n]
      .push_back({state.counters["speedup"].value,
                  state.counters["cost_factor"].value,
                  static_cast<std::int64_t>(state.iterations())});
  });
}

// ------------------------------------------------------------------------------------------------
// Registration

void register_index_benchmarks()
{
  for (std::int64_t dim : {384, 768}) {
    for (std::int64_t n : {1000, 10000, 100000}) {
      auto* build = benchmark::RegisterBenchmark("index/host/build", host_build_bench)
                      ->UseManualTime()
                      ->Unit(benchmark::kMillisecond)
                      ->Iterations(1)
                      ->ArgNames({"dim", "N"})
                      ->Args({dim, n});
      if (n >= 100000) { build->Repetitions(1); }  // minutes per build: measured once
      benchmark::RegisterBenchmark("index/host/search", host_search_bench)
        ->Apply(ib::host_benchmark)
        ->Unit(benchmark::kMicrosecond)
        ->MinTime(0.1)
        ->ArgNames({"dim", "N", "batch"})
        ->ArgsProduct({{dim}, {n}, {1, 16, 1024}});
    }
  }
  for (std::int64_t dim : {384, 768}) {
    // the default rho (50 %) with and without the exact build, and a lower sampling rate
    for (auto const& a :
         {std::vector<std::int64_t>{20000, 1, 50}, {100000, 0, 50}, {100000, 0, 35}}) {
      benchmark::RegisterBenchmark("index/host/build_cpu", host_build_cpu_bench)
        ->UseManualTime()
        ->Unit(benchmark::kSecond)
        ->Iterations(1)
        ->ArgNames({"dim", "N", "exact", "rho_pct"})
        ->Args({dim, a[0], a[1], a[2]});
    }
  }
  for (bool defaults : {false, true}) {
    std::string const name =
      defaults ? "index/host/crossover_default_params" : "index/host/crossover";
    for (std::int64_t n : {256, 512, 1024, 2048, 4096, 8192, 16384}) {
      benchmark::RegisterBenchmark(name.c_str(), host_crossover_bench, defaults)
        ->Apply(ib::host_benchmark)
        ->Unit(benchmark::kMicrosecond)
        ->MinTime(0.1)
        ->ArgNames({"dim", "N"})
        ->Args({384, n});
    }
    benchmark::RegisterBenchmark(
      (name + "/summary").c_str(),
      crossover_summary_bench,
      defaults ? crossover_kind::host_defaults : crossover_kind::host_swept)
      ->UseManualTime()
      ->Iterations(1)
      ->ArgNames({"dim"})
      ->Args({384});
  }

  // Device: CUDA-event time; the cheap cases first, N = 1,000,000 last.
  constexpr double device_min_time = 0.05;
  benchmark::RegisterBenchmark("index/device/multi_tenant", device_multi_tenant_bench)
    ->Apply(ib::device_benchmark)
    ->MinTime(device_min_time)
    ->ArgNames({"dim"})
    ->Args({384})
    ->Args({768});
  benchmark::RegisterBenchmark("index/device/tenants", device_tenants_bench)
    ->Apply(ib::device_benchmark)
    ->MinTime(device_min_time)
    ->ArgNames({"dim", "batch"})
    ->ArgsProduct({{384, 768}, {1, 16, 128, 1024}});
  for (bool defaults : {false, true}) {
    std::string const name =
      defaults ? "index/device/crossover_default_params" : "index/device/crossover";
    for (std::int64_t n : {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536}) {
      benchmark::RegisterBenchmark(name.c_str(), device_crossover_bench, defaults)
        ->Apply(ib::device_benchmark)
        ->MinTime(device_min_time)
        ->ArgNames({"dim", "N"})
        ->Args({384, n});
    }
    benchmark::RegisterBenchmark(
      (name + "/summary").c_str(),
      crossover_summary_bench,
      defaults ? crossover_kind::device_defaults : crossover_kind::device_swept)
      ->UseManualTime()
      ->Iterations(1)
      ->ArgNames({"dim"})
      ->Args({384});
  }
  for (std::int64_t n : {1000, 10000, 100000, 1000000}) {
    for (std::int64_t dim : {384, 768}) {
      auto* build = benchmark::RegisterBenchmark("index/device/build", device_build_bench)
                      ->UseManualTime()
                      ->Unit(benchmark::kMillisecond)
                      ->Iterations(1)
                      ->ArgNames({"dim", "N"})
                      ->Args({dim, n});
      if (n >= 1000000) { build->Repetitions(1); }
      auto* search = benchmark::RegisterBenchmark("index/device/search", device_search_bench)
                       ->Apply(ib::device_benchmark)
                       ->MinTime(device_min_time)
                       ->ArgNames({"dim", "N", "batch", "ctas"})
                       ->ArgsProduct({{dim}, {n}, {1, 16, 1024}, {1}});
      if (n == 100000) {  // split searches (ctas_per_query) of small batches, at the target's N
        // (ctas 0: the automatic choice, auto_ctas_per_query: 4 parts at batches 1 and 16)
        search->Args({dim, n, 1, 4})->Args({dim, n, 1, 8})->Args({dim, n, 16, 4});
        search->Args({dim, n, 1, 0})->Args({dim, n, 16, 0})->Args({dim, n, 1024, 0});
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv)
{
  register_index_benchmarks();
  return inferscale::bench::benchmark_main(argc, argv);
}
