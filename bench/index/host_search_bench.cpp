/**
 * @file bench/index/host_search_bench.cpp
 * @brief The host graph search against hnswlib at equal recall, one thread, one query at a time,
 * on a Gaussian mixture and on real text embeddings; and the host's exact scan against a pass of
 * the same distance kernel over the same bytes. Host only (no CUDA in this translation unit).
 *
 * Data:
 *  - `mixture`: bench_index's data (tests/common/gaussian_mixture.hpp, 100 anisotropic centres,
 *    seed 20261130 + dim, L2-normalised): 1,024 queries drawn first, then the N indexed points.
 *  - `locomo_minilm`: real text, real embedder: every turn (speaker and text, a shared photo's
 *    caption) and every observation fact of the ten LoCoMo conversations
 *    (../shared/data/locomo/locomo10.json, read in place) embedded by all-MiniLM-L6-v2 through
 *    llama.cpp (examples/engine/llama_cpp/embedder.hpp: mean-pooled, L2-normalised, 384-d), and
 *    every question of the data set as the queries (1,986 questions, 1,024 used, the first ones).
 *    The embeddings are cached (INFERSCALE_BENCH_CACHE, default the executable's directory:
 *    locomo-minilm-<crc>.f32, keyed by the CRC-64 of every text), since embedding the 9,447
 *    texts takes about 2.5 minutes on two cores.
 *  Cosine metric, fp32, recall@10 against brute force in fp32 computed here (sixteen partial
 *  sums, the ties' order by row).
 *
 * Indexes: the fact index with the index_config defaults (graph degree 32, intermediate 64,
 * kNN exact up to 4,000 rows, NN-descent above), searched with the defaults but `itopk_size`
 * (the host's fast mode: best-first from the entry points; `ef` below); hnswlib 0.6.2 (Debian's
 * libhnswlib-dev) with M 16, efConstruction 200, built on every hardware thread. hnswlib's
 * translation unit is compiled with -march=native where the compiler accepts it, so it uses its
 * best SIMD kernels for this CPU (AVX-512 here), while the library is the portable build choosing
 * its kernels at run time: the comparison is against hnswlib at its fastest.
 *
 * INFERSCALE_BENCH_GRAPH_DEGREE=d builds the fact index with graph degree d (intermediate 2d)
 * instead of index_config's 32 (64), INFERSCALE_BENCH_ENTRY_POINTS=e with
 * `index_config::host_entry_points` e (-1, the default: automatic, at least 64), and
 * INFERSCALE_BENCH_NEIGHBORS=n searches with `search_params::host_neighbors` n (the first n
 * neighbours of each expanded node): the levers measured for one user's 1,000 facts.
 *
 * Cases:
 *  - index_host/equal_recall/data:D/dim:d[/N:n]/target:T (T = 95, 98, 99: recall@10 >= 0.T):
 *    in setup (untimed) each side's `ef` is swept over one grid (10, 11, ..., 40, 44, 48, 56, 64,
 *    80, 96, 128, 160, 192, 256, 384, 512) on the 1,024 queries, and the smallest reaching the
 *    target is used. Each iteration then searches the 1,024 queries one at a time on the calling
 *    thread with the graph (`Time`), then with hnswlib. Counters: `us_per_query`, `QPS`,
 *    `recall`, `ef`, `entry_points` (graph); `hnswlib_us_per_query`, `hnswlib_recall`,
 * `hnswlib_ef`; `vs_hnswlib` = hnswlib time / graph time (> 1: the graph is faster). The builds,
 * once per data set: `graph_build_s` / `hnswlib_build_s` (wall) and `graph_build_cpu_s` /
 *    `hnswlib_build_cpu_s` (CPU seconds of the process, all threads; `std::clock`),
 *    `build_cpu_vs_hnswlib` = graph CPU seconds / hnswlib CPU seconds (< 1: the graph is cheaper).
 *  - index_host/equal_recall/data:mixture/dim:d/N:{1000,100000}/rows:fp16/target:T: the same, with
 * the fact index storing its rows in fp16 (`index_config::vector_dtype`; half the bytes per
 *    distance, half the memory), built and searched on them; hnswlib, the queries and the truth
 *    are the fp32 set's (hnswlib stores fp32). `hnswlib_build_*` repeat the fp32 set's build.
 *  - index_host/equal_recall/data:D/dim:d[/N:n]/traversal:fp16/target:T: the fp32 set's
 *    index itself with `index_config::host_traversal_dtype` float16 (set on it for the case's
 *    sweep and timing, `graph_index::set_host_traversal_dtype`): the walk reads the rows' float16
 *    copy, and its best entries are measured again on the fp32 rows; results and distances are the
 *    fp32 rows'. `graph_build_*` repeat the fp32 set's build (the copy is made in the setter).
 *  - index_host/defaults/data:D/dim:d[/N:n]: `search_params{}` as a user leaves it (automatic
 *    algorithm, automatic list size: the namespace's calibrated `host_default_ef`): `recall`,
 *    `us_per_query`, `default_ef`, beside the cheapest grid ef that reached 0.99 in the sweep
 *    (`cheapest_099_ef`, `cheapest_099_us`, timed in the same iteration), `vs_cheapest_099` =
 *    default time / that time.
 *  - index_host/incremental_add/n:N/m:M: adding M facts to a namespace of N (384-d, 20-cluster
 *    mixture; the incremental path above 256 rows) beside building the N + M facts from scratch,
 *    CPU seconds of each (`add_cpu_ms`, `rebuild_cpu_ms`), `vs_rebuild` = add / rebuild.
 *  - index_host/exact/data:D/dim:d[/N:n]: batch-1 exact search (search_algo::exact) of the
 *    queries, `us_per_query` and `GBps` (the rows' bytes per query / time); beside it, in the
 *    same iteration, `stream_GBps`: the same distance kernel run once over the whole arena as
 *    one vector (no per-row work, no top-k: the scan's ceiling on this machine), and
 *    `memcpy_GBps` (memcpy of the same bytes); `vs_stream` = exact GB/s / stream GB/s.
 */
#include "../common/env_knob.hpp"
#include "hnsw_baseline.hpp"

#include <inferscale/detail/index/distance_simd.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/index.hpp>

#include <gaussian_mixture.hpp>

#if INFERSCALE_BENCH_LOCOMO
#include "../../examples/engine/llama_cpp/embedder.hpp"
#include "../../examples/engine/llama_cpp/llama_adapter.hpp"
#include "../../examples/engine/llama_cpp/model_paths.hpp"
#include "../locomo/locomo_data.hpp"
#endif

#include <benchmark/benchmark.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace is = inferscale;
namespace ib = inferscale::bench;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t top_k         = 10;
constexpr std::int64_t num_queries    = 1024;
constexpr std::uint64_t data_seed     = 20261130;
constexpr std::uint64_t the_namespace = 7;
constexpr int hnsw_m                  = 16;
constexpr int hnsw_ef_construction    = 200;

std::vector<int> ef_grid()
{
  std::vector<int> g;
  for (int ef = 10; ef <= 40; ++ef) {
    g.push_back(ef);
  }
  for (int ef : {44, 48, 56, 64, 80, 96, 128, 160, 192, 256, 384, 512}) {
    g.push_back(ef);
  }
  return g;
}

double seconds_since(clock_type::time_point t0)
{
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// @brief Runs fn(begin, end) over [0, n) on every hardware thread (setup work only).
template <class Fn>
void on_all_threads(std::int64_t n, Fn&& fn)
{
  unsigned const hw = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> workers;
  for (unsigned p = 0; p < hw; ++p) {
    workers.emplace_back([&, p] { fn(n * p / hw, n * (p + 1) / hw); });
  }
  for (auto& w : workers) {
    w.join();
  }
}

// ------------------------------------------------------------------------------------------------
// Data

struct vectors {
  std::string name;
  std::int64_t dim{0};
  std::vector<float> base;     ///< [n][dim]
  std::vector<float> queries;  ///< [num_queries][dim]
  std::int64_t n() const { return static_cast<std::int64_t>(base.size()) / dim; }
  float const* row(std::int64_t r) const { return base.data() + r * dim; }
  float const* query(std::int64_t q) const { return queries.data() + q * dim; }
};

vectors mixture(std::int64_t dim, std::int64_t n)
{
  is::test::gaussian_mixture mix{
    is::test::mixture_spec{dim, 100, true, data_seed + std::uint64_t(dim)}};
  vectors v;
  v.name    = "mixture";
  v.dim     = dim;
  v.queries = mix.draw(num_queries);
  v.base    = mix.draw(n);
  return v;
}

#if INFERSCALE_BENCH_LOCOMO
/// @brief Where the embeddings are cached: $INFERSCALE_BENCH_CACHE, else the executable's
/// directory (the build tree, never the source tree), else the working directory.
std::string cache_dir()
{
  if (char const* env = std::getenv("INFERSCALE_BENCH_CACHE"); env != nullptr && *env != '\0') {
    return env;
  }
  char buf[4096];
  ssize_t const len = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (len > 0) {
    std::string exe(buf, static_cast<std::size_t>(len));
    auto const slash = exe.find_last_of('/');
    if (slash != std::string::npos) { return exe.substr(0, slash); }
  }
  return ".";
}

/// @brief LoCoMo's turns and facts (base) and questions (queries), embedded by MiniLM (cached).
vectors locomo_minilm()
{
  namespace lm                          = is::locomo;
  namespace lc                          = is::llama_cpp;
  std::vector<lm::sample> const samples = lm::load(lm::default_path());
  std::vector<std::string> base, questions;
  for (auto const& s : samples) {
    for (auto const& t : s.turns) {
      base.push_back(lm::turn_text(t));
    }
    for (auto const& f : s.facts) {
      base.push_back(lm::fact_text(s, f));
    }
    for (auto const& q : s.questions) {
      questions.push_back(q.text);
    }
  }
  if (questions.size() > static_cast<std::size_t>(num_queries)) {
    questions.resize(static_cast<std::size_t>(num_queries));
  }
  if (questions.size() < static_cast<std::size_t>(num_queries)) {
    throw std::runtime_error("locomo_minilm: the data set has " + std::to_string(questions.size()) +
                             " questions, the benchmark needs " + std::to_string(num_queries));
  }
  std::string all;
  for (auto const& t : base) {
    all += t;
    all.push_back('\0');
  }
  for (auto const& t : questions) {
    all += t;
    all.push_back('\0');
  }
  std::uint64_t const crc =
    is::detail::serial::crc64_of(reinterpret_cast<unsigned char const*>(all.data()), all.size());
  std::string const dir = cache_dir();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(crc));
  std::string const path = dir + "/locomo-minilm-" + hex + ".f32";

  vectors v;
  v.name                 = "locomo_minilm";
  v.dim                  = 384;
  std::size_t const rows = base.size() + questions.size();
  std::vector<float> flat(rows * 384);
  std::ifstream in{path, std::ios::binary};
  if (in &&
      in.read(reinterpret_cast<char*>(flat.data()),
              static_cast<std::streamsize>(flat.size() * 4)) &&
      in.peek() == std::char_traits<char>::eof()) {
    std::fprintf(stderr, "bench_index_host: LoCoMo embeddings from %s\n", path.c_str());
  } else {
    std::fprintf(stderr,
                 "bench_index_host: embedding %zu LoCoMo texts with MiniLM into %s\n",
                 rows,
                 path.c_str());
    lc::quiet_logs();  // llama.cpp logs a line per embedded text otherwise
    lc::model model{lc::minilm_path()};
    lc::embedder embedder{model};
    if (embedder.dimension() != 384) {
      throw std::runtime_error("locomo_minilm: MiniLM has " + std::to_string(embedder.dimension()) +
                               " dimensions, expected 384");
    }
    auto t0 = clock_type::now();
    for (std::size_t i = 0; i < rows; ++i) {
      std::string const& text    = i < base.size() ? base[i] : questions[i - base.size()];
      std::vector<float> const e = embedder.embed(text);
      std::copy(e.begin(), e.end(), flat.begin() + static_cast<std::ptrdiff_t>(i * 384));
    }
    std::fprintf(stderr, "bench_index_host: embedded in %.1f s\n", seconds_since(t0));
    std::ofstream out{path + ".tmp", std::ios::binary};
    out.write(reinterpret_cast<char const*>(flat.data()),
              static_cast<std::streamsize>(flat.size() * 4));
    out.close();
    if (!out || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
      std::fprintf(
        stderr, "bench_index_host: could not cache the embeddings at %s\n", path.c_str());
    }
  }
  v.base.assign(flat.begin(), flat.begin() + static_cast<std::ptrdiff_t>(base.size() * 384));
  v.queries.assign(flat.begin() + static_cast<std::ptrdiff_t>(base.size() * 384), flat.end());
  return v;
}
#endif

/// @brief Cosine distance of normalised vectors in fp32, sixteen partial sums.
float cosine(float const* a, float const* b, std::int64_t dim)
{
  float acc[16]  = {};
  std::int64_t e = 0;
  for (; e + 16 <= dim; e += 16) {
    for (int j = 0; j < 16; ++j) {
      acc[j] += a[e + j] * b[e + j];
    }
  }
  float s = 0.0f;
  for (; e < dim; ++e) {
    s += a[e] * b[e];
  }
  for (float x : acc) {
    s += x;
  }
  return 1.0f - s;
}

/// @brief Everything built for one data set, kept across cases.
struct prepared {
  vectors data;
  std::shared_ptr<is::graph_index> index;   ///< shared by the fp32 rows' two traversals
  is::dtype traversal{is::dtype::float32};  ///< the host_traversal_dtype this set searches with
  std::shared_ptr<ib::hnsw_baseline> hnsw;  ///< shared by the fp32- and fp16-row sets of a data set
  std::vector<std::uint64_t> truth;         ///< [num_queries][top_k] row ids
  double graph_build_s{0.0}, hnsw_build_s{0.0};          ///< wall seconds
  double graph_build_cpu_s{0.0}, hnsw_build_cpu_s{0.0};  ///< CPU seconds, all threads
  std::map<int, int> graph_ef, hnsw_ef;                  ///< target (percent) -> chosen ef
  std::map<int, double> graph_recall, hnsw_recall;
};

std::vector<std::uint64_t> brute_force(vectors const& v)
{
  std::vector<std::uint64_t> t(static_cast<std::size_t>(num_queries * top_k));
  on_all_threads(num_queries, [&](std::int64_t begin, std::int64_t end) {
    std::vector<std::pair<float, std::uint64_t>> all(static_cast<std::size_t>(v.n()));
    for (std::int64_t q = begin; q < end; ++q) {
      for (std::int64_t r = 0; r < v.n(); ++r) {
        all[static_cast<std::size_t>(r)] = {cosine(v.query(q), v.row(r), v.dim),
                                            static_cast<std::uint64_t>(r)};
      }
      std::partial_sort(all.begin(), all.begin() + top_k, all.end());
      for (std::uint32_t j = 0; j < top_k; ++j) {
        t[static_cast<std::size_t>(q) * top_k + j] = all[j].second;
      }
    }
  });
  return t;
}

double recall_of(std::vector<std::uint64_t> const& truth, std::vector<std::uint64_t> const& got)
{
  std::size_t hits = 0;
  for (std::int64_t q = 0; q < num_queries; ++q) {
    auto const* want = truth.data() + q * top_k;
    for (std::uint32_t j = 0; j < top_k; ++j) {
      std::uint64_t const id = got[static_cast<std::size_t>(q) * top_k + j];
      hits += std::find(want, want + top_k, id) != want + top_k ? 1 : 0;
    }
  }
  return static_cast<double>(hits) / static_cast<double>(num_queries * top_k);
}

is::search_params graph_params(int ef, is::search_algo algo = is::search_algo::graph)
{
  is::search_params p;
  p.itopk_size = static_cast<std::uint32_t>(ef);
  p.algo       = algo;
  // INFERSCALE_BENCH_NEIGHBORS: search_params::host_neighbors (0, all, by default)
  p.host_neighbors =
    static_cast<std::uint32_t>(ib::env_knob("INFERSCALE_BENCH_NEIGHBORS", 0, 1024, 0));
  return p;
}

/// @brief One query at a time on the calling thread; ids into `ids` ([q][top_k]).
void graph_queries(prepared const& c, is::search_params const& p, std::uint64_t* ids, float* dist)
{
  std::uint64_t const ns[1] = {the_namespace};
  for (std::int64_t q = 0; q < num_queries; ++q) {
    is::search(*c.index,
               is::make_matrix_view<float const>(c.data.query(q), 1, c.data.dim),
               cuda::std::span<std::uint64_t const>{ns, 1},
               top_k,
               p,
               is::make_matrix_view<std::uint64_t>(ids + q * top_k, 1, top_k),
               is::make_matrix_view<float>(dist + q * top_k, 1, top_k));
  }
}

void hnsw_queries(prepared const& c, std::uint64_t* ids, float* dist)
{
  for (std::int64_t q = 0; q < num_queries; ++q) {
    c.hnsw->search(c.data.query(q), top_k, ids + q * top_k, dist + q * top_k);
  }
}

/// @brief Sets a shared index's host_traversal_dtype for a scope, float32 again after it.
struct traversal_scope {
  is::graph_index& index;
  traversal_scope(is::graph_index& i, is::dtype d) : index(i) { index.set_host_traversal_dtype(d); }
  ~traversal_scope() { index.set_host_traversal_dtype(is::dtype::float32); }
  traversal_scope(traversal_scope const&)            = delete;
  traversal_scope& operator=(traversal_scope const&) = delete;
};

prepared& prepare(std::string const& name,
                  std::int64_t dim,
                  std::int64_t n,
                  is::dtype rows      = is::dtype::float32,
                  is::dtype traversal = is::dtype::float32)
{
  static std::map<std::string, std::unique_ptr<prepared>> all;
  std::string const key = name + "/" + std::to_string(dim) + "/" + std::to_string(n) +
                          (rows == is::dtype::float16 ? "/fp16" : "") +
                          (traversal == is::dtype::float16 ? "/traversal16" : "");
  auto& slot = all[key];
  if (slot) { return *slot; }
  auto c       = std::make_unique<prepared>();
  c->traversal = traversal;
  if (rows == is::dtype::float16 || traversal == is::dtype::float16) {
    // the same data, queries, truth and hnswlib index as the fp32 set; fp16 rows build their
    // own graph, a float16 walk searches the fp32 set's index itself
    prepared const& base = prepare(name, dim, n);
    c->data              = base.data;
    c->truth             = base.truth;
    c->hnsw              = base.hnsw;
    c->hnsw_build_s      = base.hnsw_build_s;
    c->hnsw_build_cpu_s  = base.hnsw_build_cpu_s;
    if (traversal == is::dtype::float16) {
      c->index             = base.index;
      c->graph_build_s     = base.graph_build_s;
      c->graph_build_cpu_s = base.graph_build_cpu_s;
    }
  } else {
#if INFERSCALE_BENCH_LOCOMO
    c->data = name == "locomo_minilm" ? locomo_minilm() : mixture(dim, n);
#else
    if (name == "locomo_minilm") {
      throw std::runtime_error(
        "locomo_minilm needs the reference engine (llama.cpp + MiniLM): "
        "configure with it (.ci/engine) to build this case");
    }
    c->data = mixture(dim, n);
#endif
  }
  vectors const& v  = c->data;
  auto t0           = clock_type::now();
  std::clock_t cpu0 = std::clock();
  if (traversal == is::dtype::float32) {
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(v.n()));
    std::iota(ids.begin(), ids.end(), std::uint64_t{0});
    is::index_config config;
    config.dim          = v.dim;
    config.vector_dtype = rows;
    config.graph_degree = static_cast<std::uint32_t>(
      ib::env_knob("INFERSCALE_BENCH_GRAPH_DEGREE", 2, 256, config.graph_degree));
    config.intermediate_graph_degree = 2 * config.graph_degree;
    config.host_entry_points =
      ib::env_knob("INFERSCALE_BENCH_ENTRY_POINTS", -1, 1 << 20, config.host_entry_points);
    c->index = std::make_shared<is::graph_index>(config);
    c->index->add(the_namespace,
                  is::make_matrix_view<float const>(v.base.data(), v.n(), v.dim),
                  cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    c->graph_build_s     = seconds_since(t0);
    c->graph_build_cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
  }
  if (rows == is::dtype::float32 && traversal == is::dtype::float32) {
    t0      = clock_type::now();
    cpu0    = std::clock();
    c->hnsw = std::make_shared<ib::hnsw_baseline>(v.dim, v.n(), hnsw_m, hnsw_ef_construction);
    c->hnsw->add(v.row(0), 0);
    on_all_threads(v.n() - 1, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin + 1; r < end + 1; ++r) {
        c->hnsw->add(v.row(r), static_cast<std::uint64_t>(r));
      }
    });
    c->hnsw_build_s     = seconds_since(t0);
    c->hnsw_build_cpu_s = static_cast<double>(std::clock() - cpu0) / CLOCKS_PER_SEC;
    c->truth            = brute_force(v);
  }

  // the sweep: recall of every ef of the grid on both sides (untimed), smallest per target
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  std::ostringstream os;
  traversal_scope const scope(*c->index, traversal);
  os << "bench_index_host sweep " << key << " (ef: graph recall / hnswlib recall):";
  for (int ef : ef_grid()) {
    graph_queries(*c, graph_params(ef), got.data(), dist.data());
    double const rg = recall_of(c->truth, got);
    c->hnsw->set_ef(ef);
    hnsw_queries(*c, got.data(), dist.data());
    double const rh = recall_of(c->truth, got);
    os << " " << ef << ": " << rg << "/" << rh << ";";
    for (int target : {95, 98, 99}) {
      if (rg >= target / 100.0 && !c->graph_ef.count(target)) {
        c->graph_ef[target]     = ef;
        c->graph_recall[target] = rg;
      }
      if (rh >= target / 100.0 && !c->hnsw_ef.count(target)) {
        c->hnsw_ef[target]     = ef;
        c->hnsw_recall[target] = rh;
      }
    }
    if (c->graph_ef.count(99) && c->hnsw_ef.count(99)) { break; }
  }
  os << "\n";
  std::fputs(os.str().c_str(), stderr);
  slot = std::move(c);
  return *slot;
}

/// @brief `prepare`, or the case skipped with the reason (a missing data set or model).
prepared* prepare_or_skip(benchmark::State& state,
                          std::string const& name,
                          std::int64_t dim,
                          std::int64_t n,
                          is::dtype rows      = is::dtype::float32,
                          is::dtype traversal = is::dtype::float32)
{
  try {
    return &prepare(name, dim, n, rows, traversal);
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
    return nullptr;
  }
}

void equal_recall(benchmark::State& state,
                  std::string const& name,
                  std::int64_t dim,
                  std::int64_t n,
                  int target,
                  is::dtype rows,
                  is::dtype traversal)
{
  prepared* c = prepare_or_skip(state, name, dim, n, rows, traversal);
  if (c == nullptr) { return; }
  traversal_scope const scope(*c->index, traversal);
  if (!c->graph_ef.count(target) || !c->hnsw_ef.count(target)) {
    state.SkipWithError("a side never reached the target recall on the ef grid (see the sweep)");
    return;
  }
  auto const p = graph_params(c->graph_ef[target]);
  c->hnsw->set_ef(c->hnsw_ef[target]);
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  double graph_s = 0.0, hnsw_s = 0.0;
  for (auto _ : state) {
    auto t0 = clock_type::now();
    graph_queries(*c, p, got.data(), dist.data());
    graph_s += seconds_since(t0);
    benchmark::DoNotOptimize(got.data());
    state.PauseTiming();
    t0 = clock_type::now();
    hnsw_queries(*c, got.data(), dist.data());
    hnsw_s += seconds_since(t0);
    benchmark::DoNotOptimize(got.data());
    state.ResumeTiming();
  }
  double const per                       = static_cast<double>(state.iterations() * num_queries);
  state.counters["us_per_query"]         = graph_s / per * 1e6;
  state.counters["QPS"]                  = per / graph_s;
  state.counters["recall"]               = c->graph_recall[target];
  state.counters["ef"]                   = c->graph_ef[target];
  state.counters["hnswlib_us_per_query"] = hnsw_s / per * 1e6;
  state.counters["hnswlib_recall"]       = c->hnsw_recall[target];
  state.counters["hnswlib_ef"]           = c->hnsw_ef[target];
  state.counters["vs_hnswlib"]           = hnsw_s / graph_s;
  state.counters["N"]                    = static_cast<double>(c->data.n());
  state.counters["entry_points"]        = index_access::host_entry_points(*c->index, the_namespace);
  state.counters["graph_build_s"]       = c->graph_build_s;
  state.counters["hnswlib_build_s"]     = c->hnsw_build_s;
  state.counters["graph_build_cpu_s"]   = c->graph_build_cpu_s;
  state.counters["hnswlib_build_cpu_s"] = c->hnsw_build_cpu_s;
  state.counters["build_cpu_vs_hnswlib"] = c->graph_build_cpu_s / c->hnsw_build_cpu_s;
  state.SetLabel(name + (rows == is::dtype::float16 ? ", graph rows fp16" : "") +
                 (traversal == is::dtype::float16 ? ", fp32 rows walked in fp16" : "") +
                 ", batch 1, one thread; hnswlib M16 efC200 (-march=native, fp32)");
}

/// @brief The default search_params (automatic algorithm, automatic list size) beside the
/// cheapest grid setting that reached recall 0.99 in the sweep, timed in the same iteration.
void defaults_case(benchmark::State& state,
                   std::string const& name,
                   std::int64_t dim,
                   std::int64_t n)
{
  prepared* c = prepare_or_skip(state, name, dim, n);
  if (c == nullptr) { return; }
  if (!c->graph_ef.count(99)) {
    state.SkipWithError("the graph never reached recall 0.99 on the ef grid (see the sweep)");
    return;
  }
  is::search_params const defaults{};
  auto const cheapest = graph_params(c->graph_ef[99]);
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  graph_queries(*c, defaults, got.data(), dist.data());
  double const recall = recall_of(c->truth, got);
  double default_s = 0.0, cheapest_s = 0.0;
  for (auto _ : state) {
    auto t0 = clock_type::now();
    graph_queries(*c, defaults, got.data(), dist.data());
    default_s += seconds_since(t0);
    state.PauseTiming();
    t0 = clock_type::now();
    graph_queries(*c, cheapest, got.data(), dist.data());
    cheapest_s += seconds_since(t0);
    state.ResumeTiming();
  }
  double const per                  = static_cast<double>(state.iterations() * num_queries);
  state.counters["us_per_query"]    = default_s / per * 1e6;
  state.counters["recall"]          = recall;
  state.counters["default_ef"]      = index_access::host_default_ef(*c->index, the_namespace);
  state.counters["cheapest_099_ef"] = c->graph_ef[99];
  state.counters["cheapest_099_us"] = cheapest_s / per * 1e6;
  state.counters["vs_cheapest_099"] = default_s / cheapest_s;
  state.counters["exact_threshold"] = static_cast<double>(
    c->index->exact_search_threshold(defaults, static_cast<std::uint32_t>(c->data.n())));
  state.SetLabel(name + ", search_params{} (automatic), batch 1, one thread");
}

/**
 * @brief Adding `m` facts to a namespace of `n` (the incremental path: each fact inserted into
 * the graph) beside building the `n + m` facts from scratch, both timed here on the same data
 * (CPU seconds, all threads). `vs_rebuild` = incremental / rebuild (< 1: adding is cheaper).
 */
void incremental_case(benchmark::State& state, std::int64_t n, std::int64_t m)
{
  std::int64_t const dim = 384;
  is::test::gaussian_mixture mix{is::test::mixture_spec{dim, 20, true, data_seed + 1}};
  std::vector<float> const data = mix.draw(n + m);
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(n + m));
  std::iota(ids.begin(), ids.end(), std::uint64_t{0});
  is::index_config config;
  config.dim   = dim;
  double add_s = 0.0, rebuild_s = 0.0;
  for (auto _ : state) {
    state.PauseTiming();
    is::graph_index grown{config};
    grown.add(1,
              is::make_matrix_view<float const>(data.data(), n, dim),
              cuda::std::span<std::uint64_t const>{ids.data(), static_cast<std::size_t>(n)});
    state.ResumeTiming();
    std::clock_t c0 = std::clock();
    grown.add(1,
              is::make_matrix_view<float const>(data.data() + n * dim, m, dim),
              cuda::std::span<std::uint64_t const>{ids.data() + n, static_cast<std::size_t>(m)});
    add_s += static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    state.PauseTiming();
    is::graph_index fresh{config};
    c0 = std::clock();
    fresh.add(1,
              is::make_matrix_view<float const>(data.data(), n + m, dim),
              cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    rebuild_s += static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
    state.ResumeTiming();
  }
  double const it                  = static_cast<double>(state.iterations());
  state.counters["add_cpu_ms"]     = add_s / it * 1e3;
  state.counters["rebuild_cpu_ms"] = rebuild_s / it * 1e3;
  state.counters["vs_rebuild"]     = add_s / rebuild_s;
  state.SetLabel("384-d, 20-cluster mixture; add m facts to n vs build n + m");
}

void exact_scan(benchmark::State& state, std::string const& name, std::int64_t dim, std::int64_t n)
{
  prepared* c = prepare_or_skip(state, name, dim, n);
  if (c == nullptr) { return; }
  auto const p = graph_params(64, is::search_algo::exact);
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  std::int64_t const rows     = c->data.n();
  std::int64_t const elements = rows * index_access::row_elements(*c->index);
  auto const* arena =
    static_cast<float const*>(index_access::vector_rows(*c->index, the_namespace));
  auto const kernel =
    is::detail::index::fast_distance_for<float>(is::distance_metric::inner_product);
  std::vector<float> copy(static_cast<std::size_t>(elements));
  double exact_s = 0.0, stream_s = 0.0, memcpy_s = 0.0;
  std::int64_t queries                 = 0;
  constexpr std::int64_t per_iteration = 32;
  for (auto _ : state) {
    std::uint64_t const ns[1] = {the_namespace};
    auto t0                   = clock_type::now();
    for (std::int64_t i = 0; i < per_iteration; ++i) {
      std::int64_t const q = (queries + i) % num_queries;
      is::search(*c->index,
                 is::make_matrix_view<float const>(c->data.query(q), 1, dim),
                 cuda::std::span<std::uint64_t const>{ns, 1},
                 top_k,
                 p,
                 is::make_matrix_view<std::uint64_t>(got.data() + q * top_k, 1, top_k),
                 is::make_matrix_view<float>(dist.data() + q * top_k, 1, top_k));
    }
    exact_s += seconds_since(t0);
    state.PauseTiming();
    queries += per_iteration;
    t0      = clock_type::now();
    float s = 0.0f;
    for (std::int64_t i = 0; i < per_iteration; ++i) {
      s += kernel(arena, arena, elements);  // one stream: both operands are the same bytes
    }
    benchmark::DoNotOptimize(s);
    stream_s += seconds_since(t0);
    t0 = clock_type::now();
    for (std::int64_t i = 0; i < per_iteration; ++i) {
      std::memcpy(copy.data(), arena, static_cast<std::size_t>(elements) * 4);
      benchmark::ClobberMemory();
    }
    memcpy_s += seconds_since(t0);
    state.ResumeTiming();
  }
  double const bytes             = static_cast<double>(elements) * 4 * static_cast<double>(queries);
  state.counters["us_per_query"] = exact_s / static_cast<double>(queries) * 1e6;
  state.counters["GBps"]         = bytes / exact_s / 1e9;
  state.counters["stream_GBps"]  = bytes / stream_s / 1e9;
  state.counters["memcpy_GBps"]  = bytes / memcpy_s / 1e9;
  state.counters["vs_stream"]    = stream_s / exact_s;
  state.counters["N"]            = static_cast<double>(rows);
  state.SetLabel(name + ", search_algo::exact, batch 1, one thread");
}

void register_all()
{
  struct set {
    std::string name;
    std::int64_t dim, n;
  };
  std::vector<set> const sets{{"mixture", 384, 1000},
                              {"mixture", 384, 10000},
                              {"mixture", 384, 100000},
                              {"mixture", 768, 10000},
                              {"mixture", 768, 100000},
                              {"locomo_minilm", 384, -1}};
  // fp32 rows on every set; fp16 rows (half the bytes per distance, the graph built and searched
  // on them) on the 100,000-row sets and on one user's 1,000 facts (issue 32's single namespace),
  // against the same fp32 hnswlib index and fp32 truth; and fp32 rows walked on their float16 copy
  // (index_config::host_traversal_dtype) on every set
  struct variant {
    is::dtype rows, traversal;
    char const* suffix;
  };
  for (variant const var : {variant{is::dtype::float32, is::dtype::float32, ""},
                            variant{is::dtype::float16, is::dtype::float32, "/rows:fp16"},
                            variant{is::dtype::float32, is::dtype::float16, "/traversal:fp16"}}) {
    for (auto const& s : sets) {
      if (var.rows == is::dtype::float16 && s.n != 100000 && s.n != 1000) { continue; }
      std::string const base = "index_host/equal_recall/data:" + s.name +
                               "/dim:" + std::to_string(s.dim) +
                               (s.n < 0 ? "" : "/N:" + std::to_string(s.n)) + var.suffix;
      for (int target : {95, 98, 99}) {
        benchmark::RegisterBenchmark((base + "/target:" + std::to_string(target)).c_str(),
                                     [s, target, var](benchmark::State& st) {
                                       equal_recall(
                                         st, s.name, s.dim, s.n, target, var.rows, var.traversal);
                                     })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->MinTime(0.5);
      }
    }
  }
  for (auto const& s : sets) {
    std::string const name = "index_host/defaults/data:" + s.name +
                             "/dim:" + std::to_string(s.dim) +
                             (s.n < 0 ? "" : "/N:" + std::to_string(s.n));
    benchmark::RegisterBenchmark(
      name.c_str(), [s](benchmark::State& st) { defaults_case(st, s.name, s.dim, s.n); })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->MinTime(0.5);
  }
  for (std::int64_t n : {300, 1000, 3000}) {
    for (std::int64_t m : {1, 10, 50}) {
      std::string const name =
        "index_host/incremental_add/n:" + std::to_string(n) + "/m:" + std::to_string(m);
      benchmark::RegisterBenchmark(name.c_str(),
                                   [n, m](benchmark::State& st) { incremental_case(st, n, m); })
        ->Unit(benchmark::kMillisecond)
        ->Iterations(3);
    }
  }
  for (auto const& s : sets) {
    std::string const name = "index_host/exact/data:" + s.name + "/dim:" + std::to_string(s.dim) +
                             (s.n < 0 ? "" : "/N:" + std::to_string(s.n));
    benchmark::RegisterBenchmark(name.c_str(),
                                 [s](benchmark::State& st) { exact_scan(st, s.name, s.dim, s.n); })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->MinTime(0.5);
  }
}

}  // namespace

int main(int argc, char** argv)
{
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) { return 1; }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
