/**
 * @file bench/index/tenants_bench.cpp
 * @brief The multi-tenant shape (issue 32): many users with small memories in one fact index,
 * one query from each of B users per step, against the natural peer design, one hnswlib index
 * per user, measured in the same run. Host only, one search thread on each side.
 *
 * Data (deterministic; libstdc++'s std::normal_distribution and std::shuffle):
 *  - users U = 1,000 or 10,000; user u's namespace size is a discretised log-normal clipped to
 *    [50, 5000]: n_u = clamp(round(exp(ln 100 + 1.0 z)), 50, 5000), z ~ N(0, 1) from
 *    std::mt19937_64(20261205) (median 100, so about a quarter of the users sit at 50, mean ~170,
 *    p99 ~1,000, a few users in the thousands). The set's N, mean, median, p99 and max are
 *    printed to stderr and reported as counters.
 *  - (bench/common/tenants_shape.hpp, shared with the device and serving-step benchmarks)
 *    each user's vectors come from its own Gaussian mixture (tests/common/gaussian_mixture.hpp:
 *    1 + n_u / 50 anisotropic centres, L2-normalised, seed 20261205 + 1,000,003 dim + u):
 *    ceil(1,024 / U) queries drawn first (two at 1,000 users, one at 10,000), then the n_u facts.
 * dim 384 (MiniLM-sized) and 768.
 *  - the queries: Q = 1,024, query i belongs to user perm[i mod U] (perm: a random permutation
 *    of the users, std::mt19937_64(20261206)) and is that user's (i div U)-th query. So at
 *    10,000 users the 1,024 queries come from 1,024 distinct users drawn uniformly (most of them
 *    small); at 1,000 users every user is queried once and 24 twice.
 *  - truth: brute force in fp32 over the query's own namespace (sixteen partial sums).
 *
 * Indexes:
 *  - the fact index: one graph_index (index_config defaults: graph degree 32, intermediate 64,
 *    exact kNN up to 4,000 rows, automatic compaction), every user a namespace, built by one
 *    `add` per user in user order (all of the user's facts at once). Searched with the free
 *    `search` over a step's B queries at once with per-query namespaces, `search_algo::automatic`
 *    (exact below the namespace size the cost model picks, graph above), `itopk_size` swept,
 *    `threads` 1.
 *  - the peer: hnswlib 0.6.2 (bench/index/hnsw_baseline.hpp, M 16, efConstruction 200, capacity
 *    n_u), one index per queried user (at 1,000 users every user; at 10,000 users the 1,024
 *    queried users only, since the other indexes would never be touched by a timed search and
 *    hnswlib's fixed 2.5 MiB of locks per index would need 25 GiB for 10,000; the overhead
 *    figure counts it per index as it is), built by `addPoint` per fact, users spread over every
 *    hardware thread. A step runs its B queries one after another on the calling thread.
 *
 * Cases: index_tenants/users:U/dim:d/store:S/target:T/batch:B. S, how the fact index holds its
 * rows: `f32` (float32 rows, the index_config defaults); `f32_f16copy` (the same index with
 * `host_traversal_dtype` float16: a float16 copy beside the float32 rows, which the graph walk
 * and, under cosine, the exact search of small namespaces read, the candidates then measured
 * again on the float32 rows, so results and distances are the float32 rows'; the copy counts as
 * overhead); `f16` (a second index with `vector_dtype` float16: the rows themselves in float16,
 * half the vector memory, distances and results those of the rounded rows, recall still against
 * the float32 truth). T = 95, 99: recall@10 >= 0.T over the Q queries; B = 1, 16, 128, 1,024. In
 * setup (untimed), once per (U, d) for hnswlib and once per (U, d, S) for the index, each side's
 * list size (graph `itopk_size`, hnswlib `ef`) is swept over bench_index_host's grid (10, 11, ...,
 * 40, 44, ..., 512) on the Q queries and the smallest reaching the target is used. Each iteration
 * then runs the Q queries as Q / B steps with the fact index (`Time`), then with hnswlib; every
 * step is timed. Counters:
 *  - `QPS`, `hnswlib_QPS`, `vs_hnswlib` = hnswlib time / fact index time (> 1: the index is
 *    faster); `recall`, `hnswlib_recall`, `itopk`, `hnswlib_ef`; `exact_share`: the share of the
 *    queries whose namespace the automatic choice searched exactly;
 *  - `p50_step_ms`, `p99_step_ms` and the `hnswlib_` twins: the step's wall time, which is what
 *    each of its B requests waits (at B = 1, the per-query latency); `steps` timed;
 *  - the build, once per set: `build_cpu_us_per_fact` (CPU seconds of the process, all threads,
 *    `std::clock`, over the N facts) and `hnswlib_build_cpu_us_per_fact` (over the facts of the
 *    indexes built), `build_cpu_vs_hnswlib` = index / hnswlib (< 1: the index is cheaper);
 *  - index overhead, vectors excluded, in bytes per fact: `overhead_B_per_fact` from the index's
 *    own accounting: the arena's graph (degree x 4), fact id (8) and deleted flag (1) for every
 *    arena row allocated (`arena_bytes` less the vectors), the vector bytes of the arena's spare
 *    rows (`arena_rows() - total_size()`), each namespace's entry points (`host_entry_bytes`:
 *    4 bytes each, and a packed copy of their rows in namespaces of at least
 *    `detail::index::packed_entry_min_rows` rows), the id -> row hash map (48 a node: next, key,
 * row location, glibc's chunk header rounded to 16; 8 a bucket at load factor 1) and per namespace
 * 200 bytes (its tenant record and map node, an estimate); `hnswlib_overhead_B_per_fact` from
 *    hnsw_baseline::overhead_bytes (its formula there: 0.6.2's layout read off the index), summed
 *    over the built indexes, over their facts; `hnswlib_fixed_B_per_fact`, the part of it that is
 *    the per-index update locks; `overhead_vs_hnswlib` = index / hnswlib (< 1: smaller). Beside
 *    them the resident-memory growth (/proc/self/statm after malloc_trim) while each side was
 *    built, less the vectors and the data kept for the peer: `rss_overhead_B_per_fact`,
 *    `hnswlib_rss_overhead_B_per_fact` (it includes the allocator's slack and freed build
 *    scratch the allocator kept). The index's parts: `arena_B_per_fact` (graph, id, flag of every
 *    arena row), `spare_B_per_fact` (spare rows' vectors), `entries_B_per_fact`,
 *    `maps_B_per_fact`; `arena_rows_per_fact` = arena_rows() / N; `copy_B_per_fact`, the
 *    float16 copies under f32_f16copy (`host_traversal_bytes`, included in
 *    `overhead_B_per_fact`); `vector_B_per_fact` and `hnswlib_vector_B_per_fact`, the vectors
 *    themselves (dim x 4, or dim x 2 under f16), so that overhead + vectors compares the memory.
 *  - the set: `users`, `N`, `size_mean`, `size_median`, `size_p99`, `size_max`.
 *
 * Two experiment knobs (the defaults are what the headline reports): INFERSCALE_BENCH_NEIGHBORS=n
 * searches the fact index with `search_params::host_neighbors` n (the first n neighbours of each
 * expanded node), INFERSCALE_BENCH_EXACT_THRESHOLD=t builds it with
 * `index_config::exact_search_threshold` t (namespaces of at most t live facts searched exactly;
 * -1, the default, the cost model's choice).
 *
 * Sizes: every (U, d) set is built when its first case runs, and one set is kept at a time (the
 * cases are registered set by set). The user counts registered are INFERSCALE_BENCH_TENANTS_USERS
 * (a comma list; default "1000", about 3 minutes on two cores, since `.ci/bench --full` runs
 * every bench_*); 10,000 users is INFERSCALE_BENCH_TENANTS_USERS=10000 (about 14 minutes on two
 * busy cores, and a peak of 14.2 GB resident at 768-d: ~8.6 GB of index, ~0.6 GB kept for the
 * peer, ~3.3 GB of hnswlib indexes, 2.6 GB of them locks). Within them, --benchmark_filter
 * chooses (e.g. 'users:1000/dim:384/').
 */
#include "../common/env_knob.hpp"
#include "../common/tenants_shape.hpp"
#include "hnsw_baseline.hpp"

#include <inferscale/index.hpp>

#include <benchmark/benchmark.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace is = inferscale;
namespace ib = inferscale::bench;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using clock_type = std::chrono::steady_clock;

constexpr std::uint32_t top_k      = 10;
constexpr std::int64_t num_queries = 1024;
using ib::tenants::size_min;
constexpr int hnsw_m                   = 16;
constexpr int hnsw_ef_construction     = 200;
constexpr std::int64_t tenant_estimate = 200;  ///< bytes per namespace: tenant record, map node

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

double cpu_seconds_since(std::clock_t c0)
{
  return static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
}

/// @brief Resident bytes of the process, after handing freed heap back to the system.
std::int64_t resident_bytes()
{
  malloc_trim(0);
  std::ifstream in{"/proc/self/statm"};
  std::int64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
}

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

/// @brief The fact index's overhead in bytes (see the file comment): graph + ids + flags of every
/// arena row, the spare rows' vectors, entry points, hash maps and tenant records.
struct index_accounting {
  double arena{0}, spare{0}, entries{0}, maps{0};
  double total() const { return arena + spare + entries + maps; }
};

index_accounting account(is::graph_index const& ix, std::int64_t users)
{
  double const element   = ix.config().vector_dtype == is::dtype::float16 ? 2.0 : 4.0;
  double const row_bytes = static_cast<double>(index_access::row_elements(ix)) * element;
  double const arena_vec = static_cast<double>(ix.arena_rows()) * row_bytes;
  index_accounting a;
  a.entries = static_cast<double>(ix.host_entry_bytes());
  a.arena   = static_cast<double>(ix.arena_bytes()) - arena_vec;
  a.spare =
    static_cast<double>(ix.arena_rows() - static_cast<std::int64_t>(ix.total_size())) * row_bytes;
  a.maps = static_cast<double>(ix.total_size()) * (48.0 + 8.0) +
           static_cast<double>(users * tenant_estimate);
  return a;
}

/// @brief How the fact index holds its rows (the `store:` of a case).
enum class store_kind { f32, f32_f16copy, f16 };

char const* store_name(store_kind k)
{
  return k == store_kind::f32 ? "f32" : k == store_kind::f32_f16copy ? "f32_f16copy" : "f16";
}

/// @brief One (users, dim) set: both sides built, the queries, the truth and the sweep.
struct tenants_set {
  std::int64_t users{0}, dim{0};
  std::vector<std::uint32_t> sizes;
  std::vector<std::uint64_t> first_id;  ///< [users] the fact id of a user's row 0
  std::uint64_t n{0};
  std::unique_ptr<is::graph_index> index;  ///< float32 rows (stores f32 and f32_f16copy)
  std::unique_ptr<is::graph_index> half;   ///< float16 rows (store f16), built on first use
  std::vector<std::int64_t> query_user;    ///< [Q]
  std::vector<std::int64_t> peer_of_user;  ///< [users] slot in `peers`, -1 when not built
  std::vector<std::unique_ptr<ib::hnsw_baseline>> peers;
  std::uint64_t peer_facts{0};
  std::vector<float> queries;           ///< [Q][dim]
  std::vector<std::uint64_t> query_ns;  ///< [Q]
  std::vector<std::uint64_t> truth;     ///< [Q][top_k] fact ids
  double build_cpu_s{0}, build_s{0}, peer_build_cpu_s{0}, peer_build_s{0};
  double half_build_cpu_s{0};
  double rss_overhead_bytes{0}, half_rss_overhead_bytes{0};
  index_accounting acct, half_acct;
  double peer_overhead_bytes{0}, peer_fixed_bytes{0}, peer_rss_overhead_bytes{0};
  /// (store, target percent) -> the index's chosen list size and its recall
  std::map<std::pair<int, int>, int> itopk;
  std::map<std::pair<int, int>, double> recall;
  std::map<int, int> ef;  ///< target (percent) -> hnswlib's chosen ef
  std::map<int, double> peer_recall;
};

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

is::search_params index_params(int itopk)
{
  is::search_params p;
  p.host_neighbors =
    static_cast<std::uint32_t>(ib::env_knob("INFERSCALE_BENCH_NEIGHBORS", 0, 1024, 0));
  p.itopk_size = static_cast<std::uint32_t>(itopk);
  p.algo       = is::search_algo::automatic;
  p.threads    = 1;
  return p;
}

/// @brief Queries [begin, begin + count) with one batched `search` call.
void index_step(tenants_set const& s,
                is::graph_index const& index,
                is::search_params const& p,
                std::int64_t begin,
                std::int64_t count,
                std::uint64_t* ids,
                float* dist)
{
  is::search(index,
             is::make_matrix_view<float const>(s.queries.data() + begin * s.dim, count, s.dim),
             cuda::std::span<std::uint64_t const>{s.query_ns.data() + begin,
                                                  static_cast<std::size_t>(count)},
             top_k,
             p,
             is::make_matrix_view<std::uint64_t>(ids + begin * top_k, count, top_k),
             is::make_matrix_view<float>(dist + begin * top_k, count, top_k));
}

/// @brief Queries [begin, begin + count), each on its user's hnswlib index.
void peer_step(
  tenants_set const& s, std::int64_t begin, std::int64_t count, std::uint64_t* ids, float* dist)
{
  for (std::int64_t q = begin; q < begin + count; ++q) {
    auto const& peer = s.peers[static_cast<std::size_t>(
      s.peer_of_user[static_cast<std::size_t>(s.query_user[static_cast<std::size_t>(q)])])];
    peer->search(s.queries.data() + q * s.dim, top_k, ids + q * top_k, dist + q * top_k);
  }
}

void set_peer_ef(tenants_set& s, int ef)
{
  for (auto& p : s.peers) {
    p->set_ef(ef);
  }
}

std::unique_ptr<tenants_set> build_set(std::int64_t users, std::int64_t dim)
{
  auto s   = std::make_unique<tenants_set>();
  s->users = users;
  s->dim   = dim;
  s->sizes = ib::tenants::namespace_sizes(users);
  s->first_id.resize(static_cast<std::size_t>(users));
  for (std::int64_t u = 0; u < users; ++u) {
    s->first_id[static_cast<std::size_t>(u)] = s->n;
    s->n += s->sizes[static_cast<std::size_t>(u)];
  }
  {
    std::vector<std::uint32_t> sorted = s->sizes;
    std::sort(sorted.begin(), sorted.end());
    std::fprintf(stderr,
                 "bench_index_tenants users:%lld dim:%lld: N %llu, size mean %.1f, median %u, "
                 "p99 %u, max %u, at %u: %lld users\n",
                 static_cast<long long>(users),
                 static_cast<long long>(dim),
                 static_cast<unsigned long long>(s->n),
                 static_cast<double>(s->n) / static_cast<double>(users),
                 sorted[sorted.size() / 2],
                 sorted[sorted.size() * 99 / 100],
                 sorted.back(),
                 size_min,
                 static_cast<long long>(std::count(sorted.begin(), sorted.end(), size_min)));
  }

  // which user each query belongs to, and which users need a peer index
  std::vector<ib::tenants::query_owner> const owners =
    ib::tenants::query_owners(users, num_queries);
  s->query_user.resize(static_cast<std::size_t>(num_queries));
  s->query_ns.resize(static_cast<std::size_t>(num_queries));
  s->peer_of_user.assign(static_cast<std::size_t>(users), -1);
  std::vector<std::int64_t> peer_users;
  for (std::int64_t q = 0; q < num_queries; ++q) {
    std::int64_t const u                       = owners[static_cast<std::size_t>(q)].user;
    s->query_user[static_cast<std::size_t>(q)] = u;
    s->query_ns[static_cast<std::size_t>(q)]   = static_cast<std::uint64_t>(u);
    if (s->peer_of_user[static_cast<std::size_t>(u)] < 0) {
      s->peer_of_user[static_cast<std::size_t>(u)] = static_cast<std::int64_t>(peer_users.size());
      peer_users.push_back(u);
    }
  }
  s->queries.resize(static_cast<std::size_t>(num_queries * dim));
  s->truth.resize(static_cast<std::size_t>(num_queries * top_k));
  std::vector<std::vector<float>> peer_rows(peer_users.size());  // kept for the peer's build

  // the fact index: each user's data drawn, added, and dropped unless the peer needs it
  std::int64_t const rss0 = resident_bytes();
  is::index_config config;
  config.dim = dim;
  config.exact_search_threshold =
    ib::env_knob("INFERSCALE_BENCH_EXACT_THRESHOLD", -1, 1L << 30, config.exact_search_threshold);
  s->index     = std::make_unique<is::graph_index>(config);
  double gen_s = 0.0;
  std::vector<std::uint64_t> ids;
  std::int64_t const queries_per_user = (num_queries + users - 1) / users;
  for (std::int64_t u = 0; u < users; ++u) {
    std::uint32_t const nu      = s->sizes[static_cast<std::size_t>(u)];
    auto const g0               = clock_type::now();
    ib::tenants::user_data data = ib::tenants::user_vectors(u, dim, nu, queries_per_user);
    std::vector<float> const q2 = std::move(data.queries);
    std::vector<float> rows     = std::move(data.facts);
    ids.resize(nu);
    std::iota(ids.begin(), ids.end(), s->first_id[static_cast<std::size_t>(u)]);
    gen_s += seconds_since(g0);
    auto const t0         = clock_type::now();
    std::clock_t const c0 = std::clock();
    s->index->add(static_cast<std::uint64_t>(u),
                  is::make_matrix_view<float const>(rows.data(), nu, dim),
                  cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    s->build_cpu_s += cpu_seconds_since(c0);
    s->build_s += seconds_since(t0);
    std::int64_t const slot = s->peer_of_user[static_cast<std::size_t>(u)];
    if (slot < 0) { continue; }
    // this user's queries (the (i div U)-th of its own) and their truth
    for (std::int64_t q = 0; q < num_queries; ++q) {
      if (s->query_user[static_cast<std::size_t>(q)] != u) { continue; }
      float const* query = q2.data() + (q / users) * dim;
      std::copy(query, query + dim, s->queries.begin() + q * dim);
      std::vector<std::pair<float, std::uint64_t>> all(nu);
      for (std::uint32_t r = 0; r < nu; ++r) {
        all[r] = {cosine(query, rows.data() + std::int64_t{r} * dim, dim), ids[r]};
      }
      std::partial_sort(all.begin(), all.begin() + top_k, all.end());
      for (std::uint32_t j = 0; j < top_k; ++j) {
        s->truth[static_cast<std::size_t>(q * top_k + j)] = all[j].second;
      }
    }
    peer_rows[static_cast<std::size_t>(slot)] = std::move(rows);
  }
  std::int64_t const rss1  = resident_bytes();
  std::uint64_t kept_bytes = 0;
  for (auto const& r : peer_rows) {
    kept_bytes += r.capacity() * sizeof(float);
  }
  double const vector_bytes = static_cast<double>(s->n) * static_cast<double>(dim) * 4.0;
  s->rss_overhead_bytes =
    static_cast<double>(rss1 - rss0) - static_cast<double>(kept_bytes) - vector_bytes;

  s->acct = account(*s->index, users);

  // the peer: one hnswlib index per queried user, the users spread over the hardware threads
  s->peers.resize(peer_users.size());
  for (std::size_t slot = 0; slot < peer_users.size(); ++slot) {
    s->peer_facts += s->sizes[static_cast<std::size_t>(peer_users[slot])];
  }
  {
    std::int64_t const r0 = resident_bytes();
    auto const t0         = clock_type::now();
    std::clock_t const c0 = std::clock();
    unsigned const hw     = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> workers;
    for (unsigned w = 0; w < hw; ++w) {
      workers.emplace_back([&, w] {
        for (std::size_t slot = w; slot < peer_users.size(); slot += hw) {
          std::int64_t const u   = peer_users[slot];
          std::uint32_t const nu = s->sizes[static_cast<std::size_t>(u)];
          auto peer = std::make_unique<ib::hnsw_baseline>(dim, nu, hnsw_m, hnsw_ef_construction);
          float const* rows = peer_rows[slot].data();
          for (std::uint32_t r = 0; r < nu; ++r) {
            peer->add(rows + std::int64_t{r} * dim, s->first_id[static_cast<std::size_t>(u)] + r);
          }
          s->peers[slot] = std::move(peer);
        }
      });
    }
    for (auto& w : workers) {
      w.join();
    }
    s->peer_build_cpu_s        = cpu_seconds_since(c0);
    s->peer_build_s            = seconds_since(t0);
    std::int64_t const r1      = resident_bytes();
    s->peer_rss_overhead_bytes = static_cast<double>(r1 - r0) - static_cast<double>(s->peer_facts) *
                                                                  static_cast<double>(dim) * 4.0;
    for (auto const& p : s->peers) {
      s->peer_overhead_bytes += static_cast<double>(p->overhead_bytes());
      s->peer_fixed_bytes += static_cast<double>(p->fixed_overhead_bytes());
    }
  }
  peer_rows.clear();
  peer_rows.shrink_to_fit();
  std::fprintf(stderr,
               "bench_index_tenants users:%lld dim:%lld: data drawn in %.1f s; index built in "
               "%.1f s (%.1f CPU s), %zu hnswlib indexes (%llu facts) in %.1f s (%.1f CPU s)\n",
               static_cast<long long>(users),
               static_cast<long long>(dim),
               gen_s,
               s->build_s,
               s->build_cpu_s,
               s->peers.size(),
               static_cast<unsigned long long>(s->peer_facts),
               s->peer_build_s,
               s->peer_build_cpu_s);

  // the peer's sweep (untimed): the smallest ef of the grid reaching each target
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  std::ostringstream os;
  os << "bench_index_tenants sweep users:" << users << " dim:" << dim << " (ef: hnswlib recall):";
  for (int ef : ef_grid()) {
    set_peer_ef(*s, ef);
    peer_step(*s, 0, num_queries, got.data(), dist.data());
    double const rh = recall_of(s->truth, got);
    os << " " << ef << ": " << rh << ";";
    for (int target : {95, 99}) {
      if (rh >= target / 100.0 && !s->ef.count(target)) {
        s->ef[target]          = ef;
        s->peer_recall[target] = rh;
      }
    }
    if (s->ef.count(99)) { break; }
  }
  os << "\n";
  std::fputs(os.str().c_str(), stderr);
  return s;
}

/// @brief The fact index of store `kind`: `index` with `host_traversal_dtype` float32 (f32) or
/// float16 (f32_f16copy: a float16 copy beside the float32 rows), or `half`, built the first time
/// (f16: `vector_dtype` float16, the users' facts drawn again and added as for `index`); and, the
/// first time, its sweep (untimed): the smallest list size of the grid reaching each target.
is::graph_index& use_store(tenants_set& s, store_kind kind)
{
  is::graph_index* ix = s.index.get();
  if (kind == store_kind::f16) {
    if (!s.half) {
      // the float32 index's float16 copy goes first (memory: at 10,000 users x 768-d it is 2.6 GB)
      s.index->set_host_traversal_dtype(is::dtype::float32);
      std::int64_t const r0 = resident_bytes();
      is::index_config config;
      config.dim          = s.dim;
      config.vector_dtype = is::dtype::float16;
      s.half              = std::make_unique<is::graph_index>(config);
      std::vector<std::uint64_t> ids;
      for (std::int64_t u = 0; u < s.users; ++u) {
        std::uint32_t const nu              = s.sizes[static_cast<std::size_t>(u)];
        std::int64_t const queries_per_user = (num_queries + s.users - 1) / s.users;
        ib::tenants::user_data const data =
          ib::tenants::user_vectors(u, s.dim, nu, queries_per_user);
        ids.resize(nu);
        std::iota(ids.begin(), ids.end(), s.first_id[static_cast<std::size_t>(u)]);
        std::clock_t const c0 = std::clock();
        s.half->add(static_cast<std::uint64_t>(u),
                    is::make_matrix_view<float const>(data.facts.data(), nu, s.dim),
                    cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
        s.half_build_cpu_s += cpu_seconds_since(c0);
      }
      s.half_rss_overhead_bytes = static_cast<double>(resident_bytes() - r0) -
                                  static_cast<double>(s.n) * static_cast<double>(s.dim) * 2.0;
      s.half_acct = account(*s.half, s.users);
    }
    ix = s.half.get();
  } else {
    is::dtype const want =
      kind == store_kind::f32_f16copy ? is::dtype::float16 : is::dtype::float32;
    if (ix->config().host_traversal_dtype != want) { ix->set_host_traversal_dtype(want); }
  }
  int const key = static_cast<int>(kind);
  if (s.itopk.count({key, 99}) != 0) { return *ix; }
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  std::ostringstream os;
  os << "bench_index_tenants sweep users:" << s.users << " dim:" << s.dim
     << " store:" << store_name(kind) << " (list size: index recall):";
  for (int ef : ef_grid()) {
    auto p    = index_params(ef);
    p.threads = 0;  // setup: every hardware thread
    index_step(s, *ix, p, 0, num_queries, got.data(), dist.data());
    double const ri = recall_of(s.truth, got);
    os << " " << ef << ": " << ri << ";";
    for (int target : {95, 99}) {
      if (ri >= target / 100.0 && s.itopk.count({key, target}) == 0) {
        s.itopk[{key, target}]  = ef;
        s.recall[{key, target}] = ri;
      }
    }
    if (s.itopk.count({key, 99}) != 0) { break; }
  }
  os << "\n";
  std::fputs(os.str().c_str(), stderr);
  return *ix;
}

/// @brief The set of (users, dim), built on first use; one set is kept at a time.
tenants_set& prepare(std::int64_t users, std::int64_t dim)
{
  static std::unique_ptr<tenants_set> current;
  if (current && current->users == users && current->dim == dim) { return *current; }
  current.reset();  // free the previous set first
  current = build_set(users, dim);
  return *current;
}

double percentile(std::vector<double> v, double p)
{
  if (v.empty()) { return 0.0; }
  std::sort(v.begin(), v.end());
  auto const at = static_cast<std::size_t>(std::ceil(p * static_cast<double>(v.size()))) - 1;
  return v[std::min(at, v.size() - 1)];
}

void tenants_case(benchmark::State& state,
                  std::int64_t users,
                  std::int64_t dim,
                  store_kind kind,
                  int target,
                  std::int64_t batch)
{
  tenants_set* s      = nullptr;
  is::graph_index* ix = nullptr;
  int const key       = static_cast<int>(kind);
  try {
    s  = &prepare(users, dim);
    ix = &use_store(*s, kind);
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
    return;
  }
  if (!s->itopk.count({key, target}) || !s->ef.count(target)) {
    state.SkipWithError("a side never reached the target recall on the grid (see the sweep)");
    return;
  }
  auto const p = index_params(s->itopk[{key, target}]);
  set_peer_ef(*s, s->ef[target]);
  std::vector<std::uint64_t> got(static_cast<std::size_t>(num_queries * top_k));
  std::vector<float> dist(got.size());
  std::vector<double> index_steps, peer_steps;
  double index_s = 0.0, peer_s = 0.0;
  double index_recall = 0.0, peer_recall = 0.0;
  for (auto _ : state) {
    for (std::int64_t b = 0; b < num_queries; b += batch) {
      std::int64_t const count = std::min(batch, num_queries - b);
      auto const t0            = clock_type::now();
      index_step(*s, *ix, p, b, count, got.data(), dist.data());
      double const t = seconds_since(t0);
      index_steps.push_back(t);
      index_s += t;
    }
    benchmark::DoNotOptimize(got.data());
    state.PauseTiming();
    index_recall = recall_of(s->truth, got);
    for (std::int64_t b = 0; b < num_queries; b += batch) {
      std::int64_t const count = std::min(batch, num_queries - b);
      auto const t0            = clock_type::now();
      peer_step(*s, b, count, got.data(), dist.data());
      double const t = seconds_since(t0);
      peer_steps.push_back(t);
      peer_s += t;
    }
    benchmark::DoNotOptimize(got.data());
    peer_recall = recall_of(s->truth, got);
    state.ResumeTiming();
  }
  std::int64_t exact = 0;
  for (std::int64_t q = 0; q < num_queries; ++q) {
    exact += index_access::uses_exact(
               *ix, index_access::tenant_segment(*ix, s->query_ns[static_cast<std::size_t>(q)]), p)
               ? 1
               : 0;
  }
  double const queries              = static_cast<double>(state.iterations() * num_queries);
  double const nd                   = static_cast<double>(s->n);
  double const pf                   = static_cast<double>(s->peer_facts);
  std::vector<std::uint32_t> sorted = s->sizes;
  std::sort(sorted.begin(), sorted.end());
  auto& c                            = state.counters;
  c["QPS"]                           = queries / index_s;
  c["hnswlib_QPS"]                   = queries / peer_s;
  c["vs_hnswlib"]                    = peer_s / index_s;
  c["recall"]                        = index_recall;
  c["hnswlib_recall"]                = peer_recall;
  c["itopk"]                         = s->itopk[{key, target}];
  c["hnswlib_ef"]                    = s->ef[target];
  c["exact_share"]                   = static_cast<double>(exact) / num_queries;
  c["p50_step_ms"]                   = percentile(index_steps, 0.50) * 1e3;
  c["p99_step_ms"]                   = percentile(index_steps, 0.99) * 1e3;
  c["hnswlib_p50_step_ms"]           = percentile(peer_steps, 0.50) * 1e3;
  c["hnswlib_p99_step_ms"]           = percentile(peer_steps, 0.99) * 1e3;
  c["steps"]                         = static_cast<double>(index_steps.size());
  bool const half                    = kind == store_kind::f16;
  double const build_cpu_s           = half ? s->half_build_cpu_s : s->build_cpu_s;
  index_accounting const& a          = half ? s->half_acct : s->acct;
  c["build_cpu_us_per_fact"]         = build_cpu_s / nd * 1e6;
  c["hnswlib_build_cpu_us_per_fact"] = s->peer_build_cpu_s / pf * 1e6;
  c["build_cpu_vs_hnswlib"]          = (build_cpu_s / nd) / (s->peer_build_cpu_s / pf);
  // under f32_f16copy the float16 copies (rows and entry points) are overhead too
  double const copy_bytes          = static_cast<double>(ix->host_traversal_bytes());
  double const overhead            = a.total() + copy_bytes;
  c["overhead_B_per_fact"]         = overhead / nd;
  c["copy_B_per_fact"]             = copy_bytes / nd;
  c["vector_B_per_fact"]           = static_cast<double>(dim) * (half ? 2.0 : 4.0);
  c["hnswlib_vector_B_per_fact"]   = static_cast<double>(dim) * 4.0;
  c["hnswlib_overhead_B_per_fact"] = s->peer_overhead_bytes / pf;
  c["hnswlib_fixed_B_per_fact"]    = s->peer_fixed_bytes / pf;
  c["arena_B_per_fact"]            = a.arena / nd;
  c["spare_B_per_fact"]            = a.spare / nd;
  c["entries_B_per_fact"]          = a.entries / nd;
  c["maps_B_per_fact"]             = a.maps / nd;
  c["arena_rows_per_fact"]         = static_cast<double>(ix->arena_rows()) / nd;
  c["overhead_vs_hnswlib"]         = (overhead / nd) / (s->peer_overhead_bytes / pf);
  c["rss_overhead_B_per_fact"] = (half ? s->half_rss_overhead_bytes : s->rss_overhead_bytes) / nd;
  c["hnswlib_rss_overhead_B_per_fact"] = s->peer_rss_overhead_bytes / pf;
  c["users"]                           = static_cast<double>(users);
  c["N"]                               = nd;
  c["size_mean"]                       = nd / static_cast<double>(users);
  c["size_median"]                     = sorted[sorted.size() / 2];
  c["size_p99"]                        = sorted[sorted.size() * 99 / 100];
  c["size_max"]                        = sorted.back();
  state.SetLabel("batch " + std::to_string(batch) + ", store " + store_name(kind) +
                 ", one thread each side");
}

std::vector<std::int64_t> selected_users()
{
  std::vector<std::int64_t> out;
  char const* env        = std::getenv("INFERSCALE_BENCH_TENANTS_USERS");
  std::string const list = env != nullptr && *env != '\0' ? env : "1000";
  std::stringstream ss{list};
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) { out.push_back(std::stoll(item)); }
  }
  return out;
}

void register_all()
{
  for (std::int64_t users : selected_users()) {
    for (std::int64_t dim : {384, 768}) {
      for (store_kind kind : {store_kind::f32, store_kind::f32_f16copy, store_kind::f16}) {
        for (int target : {95, 99}) {
          for (std::int64_t batch : {1, 16, 128, 1024}) {
            std::string const name = "index_tenants/users:" + std::to_string(users) +
                                     "/dim:" + std::to_string(dim) + "/store:" + store_name(kind) +
                                     "/target:" + std::to_string(target) +
                                     "/batch:" + std::to_string(batch);
            benchmark::RegisterBenchmark(
              name.c_str(),
              [=](benchmark::State& st) { tenants_case(st, users, dim, kind, target, batch); })
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime()
              ->MinTime(0.5);
          }
        }
      }
    }
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
