// Example: a fact index shared by several users. Each user (a namespace) owns a few thousand facts
// whose embeddings come from that user's own Gaussian mixture (normalised, 384 dimensions, cosine);
// one index holds them all, one graph per user. A batch of queries, each for its own user, is
// answered in one call with the graph search and checked against exact search of the same index
// (recall@10). Then the index changes under the queries: new facts are inserted (and found),
// facts are deleted (and never come back), and compaction reclaims their rows (and the answers
// stay right).
//
// Runs everywhere: the device backend (GPU kNN build, batched search on the GPU) where a CUDA
// device is visible, the host backend otherwise. Exit status 0 when every check passes, 1 when
// recall@10 falls below 0.95 or a deleted fact is returned.
#include <inferscale/cuda_error.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/index.cuh>
#include <inferscale/index.hpp>

#include <raft/core/device_resources.hpp>
#include <raft/core/resource/cuda_stream.hpp>

#include <cuda_runtime_api.h>

#include <gaussian_mixture.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <vector>

using namespace inferscale;

namespace {

constexpr std::int64_t dim              = 384;
constexpr std::uint32_t k               = 10;
constexpr int num_users                 = 6;
constexpr std::int64_t facts_per_user   = 1500;
constexpr std::int64_t queries_per_user = 50;
constexpr std::int64_t new_facts        = 200;  // inserted into user 0
constexpr std::int64_t deleted_per_user = 300;  // deleted from user 1
constexpr double required_recall        = 0.95;

double seconds_since(std::chrono::steady_clock::time_point t0)
{
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Fact ids: user u's i-th fact is u * 1,000,000 + i (any distinct 64-bit ids would do).
std::uint64_t fact_id(int user, std::int64_t i)
{
  return std::uint64_t(user) * 1000000 + std::uint64_t(i);
}

/// The search of one backend: host vectors in, host results out.
class searcher {
 public:
  explicit searcher(bool device) : device_{device}
  {
    if (device_) { res_.emplace(); }
  }

  /// Device: kNN (RAFT gemm + select_k) and pruning on the GPU; host: the index's own.
  graph_builder builder(graph_index const& index) const
  {
    return device_ ? make_device_graph_builder(*res_, index.config()) : graph_builder{};
  }

  /// Query q of `queries` ([nq][dim]) looks in namespace `users[q]`.
  void operator()(graph_index const& index,
                  std::vector<float> const& queries,
                  std::vector<std::uint64_t> const& users,
                  search_params const& params,
                  std::vector<std::uint64_t>& ids,
                  std::vector<float>& distances) const
  {
    auto const nq = static_cast<std::int64_t>(users.size());
    ids.assign(std::size_t(nq) * k, 0);
    distances.assign(ids.size(), 0.0f);
    cuda::std::span<std::uint64_t const> const ns{users.data(), users.size()};
    if (!device_) {
      inferscale::search(index,
                         make_matrix_view<float const>(queries.data(), nq, dim),
                         ns,
                         k,
                         params,
                         make_matrix_view<std::uint64_t>(ids.data(), nq, k),
                         make_matrix_view<float>(distances.data(), nq, k));
      return;
    }
    device_buffer<float> const d_queries(queries);  // copied to the device
    device_buffer<std::uint64_t> d_ids(ids.size());
    device_buffer<float> d_distances(distances.size());
    search(*res_,
           index,
           make_matrix_view<float const>(d_queries.data(), nq, dim),
           ns,
           k,
           params,
           make_matrix_view<std::uint64_t>(d_ids.data(), nq, k),
           make_matrix_view<float>(d_distances.data(), nq, k));
    raft::resource::sync_stream(*res_);
    ids       = d_ids.to_host();
    distances = d_distances.to_host();
  }

 private:
  bool device_;
  std::optional<raft::device_resources> res_;
};

/// Mean over queries of |graph answer ∩ exact answer| / k (empty slots of short answers match).
double recall_at_k(std::vector<std::uint64_t> const& got, std::vector<std::uint64_t> const& exact)
{
  std::size_t const nq = got.size() / k;
  double sum           = 0.0;
  for (std::size_t q = 0; q < nq; ++q) {
    std::set<std::uint64_t> truth(exact.begin() + std::ptrdiff_t(q * k),
                                  exact.begin() + std::ptrdiff_t((q + 1) * k));
    std::uint32_t hits = 0;
    for (std::uint32_t j = 0; j < k; ++j) {
      hits += truth.count(got[q * k + j]) != 0 ? 1 : 0;
    }
    sum += double(hits) / k;
  }
  return nq == 0 ? 1.0 : sum / double(nq);
}

/// How many returned ids are in `deleted`.
std::size_t count_deleted(std::vector<std::uint64_t> const& ids,
                          std::set<std::uint64_t> const& deleted)
{
  return std::size_t(std::count_if(
    ids.begin(), ids.end(), [&](std::uint64_t id) { return deleted.count(id) != 0; }));
}

}  // namespace

int main()
{
  bool const device = visible_device_count() > 0;
  std::printf("fact index, %d users x %lld facts, %lld-d cosine, %s backend\n",
              num_users,
              static_cast<long long>(facts_per_user),
              static_cast<long long>(dim),
              device ? "device (GPU)" : "host (no GPU visible)");
  searcher const run{device};

  index_config config;
  config.dim    = dim;
  config.metric = distance_metric::cosine;
  config.space  = device ? memory_space::device : memory_space::host;
  graph_index index{config};

  // Each user's facts and queries come from that user's own mixture of 20 clusters.
  std::vector<test::gaussian_mixture> mixtures;
  for (int u = 0; u < num_users; ++u) {
    mixtures.emplace_back(test::mixture_spec{dim, 20, true, 1000 + std::uint64_t(u)});
  }

  // --- build: one add per user (a fresh graph each) ----------------------------------------------
  auto t0 = std::chrono::steady_clock::now();
  for (int u = 0; u < num_users; ++u) {
    std::vector<float> const vectors = mixtures[std::size_t(u)].draw(facts_per_user);
    std::vector<std::uint64_t> ids;
    for (std::int64_t i = 0; i < facts_per_user; ++i) {
      ids.push_back(fact_id(u, i));
    }
    index.add(std::uint64_t(u),
              make_matrix_view<float const>(vectors.data(), facts_per_user, dim),
              cuda::std::span<std::uint64_t const>{ids.data(), ids.size()},
              run.builder(index));
  }
  std::printf(
    "build: %llu facts in %.2f s (automatic search would answer namespaces of up to %lld "
    "facts exactly; the graph is forced below)\n",
    static_cast<unsigned long long>(index.total_size()),
    seconds_since(t0),
    static_cast<long long>(
      index.exact_search_threshold(search_params{}, static_cast<std::uint32_t>(facts_per_user))));

  // --- one batch of queries, query q for user q % num_users
  // ---------------------------------------
  std::vector<float> queries;
  std::vector<std::uint64_t> users;
  for (std::int64_t q = 0; q < queries_per_user * num_users; ++q) {
    int const u    = int(q % num_users);
    auto const one = mixtures[std::size_t(u)].draw(1);
    queries.insert(queries.end(), one.begin(), one.end());
    users.push_back(std::uint64_t(u));
  }
  // The default search on the graph (on the host: best-first from each namespace's entry points,
  // vectorised distances; on the device: itopk 64, 8 random samplings per seed slot). With the
  // default `automatic`, namespaces of up to exact_search_threshold() live facts are answered by
  // brute force, which at this size is as fast; the graph is forced here to show it at work.
  search_params graph_params;
  graph_params.algo          = search_algo::graph;
  search_params exact_params = graph_params;
  exact_params.algo          = search_algo::exact;

  int failures = 0;
  std::set<std::uint64_t> deleted;
  // Searches the batch both ways, prints recall@10 and timings, checks recall and deletions.
  auto const check = [&](char const* when) {
    std::vector<std::uint64_t> ids, exact_ids;
    std::vector<float> distances, exact_distances;
    run(index, queries, users, graph_params, ids, distances);  // warm-up (first launch, pages)
    auto const g0 = std::chrono::steady_clock::now();
    run(index, queries, users, graph_params, ids, distances);
    double const graph_s = seconds_since(g0);
    auto const e0        = std::chrono::steady_clock::now();
    run(index, queries, users, exact_params, exact_ids, exact_distances);
    double const exact_s  = seconds_since(e0);
    double const recall   = recall_at_k(ids, exact_ids);
    std::size_t const bad = count_deleted(ids, deleted) + count_deleted(exact_ids, deleted);
    // every answer must come from the query's own user
    std::size_t foreign = 0;
    for (std::size_t q = 0; q < users.size(); ++q) {
      for (std::uint32_t j = 0; j < k; ++j) {
        std::uint64_t const id = ids[q * k + j];
        if (id != invalid_fact_id && id / 1000000 != users[q]) { ++foreign; }
      }
    }
    std::printf(
      "%-28s %zu queries: graph %.2f ms, exact %.2f ms, recall@10 %.4f, deleted facts "
      "returned %zu, facts of another user %zu\n",
      when,
      users.size(),
      graph_s * 1e3,
      exact_s * 1e3,
      recall,
      bad,
      foreign);
    if (recall < required_recall) {
      std::printf("FAIL: recall@10 %.4f < %.2f\n", recall, required_recall);
      ++failures;
    }
    if (bad != 0 || foreign != 0) {
      std::printf("FAIL: a deleted fact or another user's fact was returned\n");
      ++failures;
    }
  };
  check("after build:");

  // --- insert: new facts for user 0, each found by its own embedding -----------------------------
  {
    std::vector<float> const vectors = mixtures[0].draw(new_facts);
    std::vector<std::uint64_t> ids;
    for (std::int64_t i = 0; i < new_facts; ++i) {
      ids.push_back(fact_id(0, facts_per_user + i));
    }
    auto const i0 = std::chrono::steady_clock::now();
    index.add(0,
              make_matrix_view<float const>(vectors.data(), new_facts, dim),
              cuda::std::span<std::uint64_t const>{ids.data(), ids.size()},
              run.builder(index));
    double const insert_s = seconds_since(i0);
    std::vector<std::uint64_t> got;
    std::vector<float> distances;
    run(index,
        vectors,
        std::vector<std::uint64_t>(std::size_t(new_facts), 0),
        graph_params,
        got,
        distances);
    std::int64_t found = 0;
    for (std::int64_t i = 0; i < new_facts; ++i) {
      found += got[std::size_t(i) * k] == ids[std::size_t(i)] ? 1 : 0;
    }
    std::printf(
      "insert: %lld facts into user 0 in %.1f ms; %lld of them are their own nearest "
      "neighbour\n",
      static_cast<long long>(new_facts),
      insert_s * 1e3,
      static_cast<long long>(found));
    if (found < new_facts * 95 / 100) {
      std::printf("FAIL: fewer than 95%% of the inserted facts were found\n");
      ++failures;
    }
  }
  check("after insert:");

  // --- delete: user 1's facts that the batch currently returns first, and more -------------------
  {
    std::vector<std::uint64_t> ids;
    std::vector<float> distances;
    run(index, queries, users, graph_params, ids, distances);
    std::vector<std::uint64_t> erase;
    for (std::size_t q = 0; q < users.size(); ++q) {  // the top answers of user 1's queries
      if (users[q] != 1) { continue; }
      for (std::uint32_t j = 0; j < 3; ++j) {
        std::uint64_t const id = ids[q * k + j];
        if (id != invalid_fact_id && deleted.insert(id).second) { erase.push_back(id); }
      }
    }
    for (std::int64_t i = 0; std::int64_t(erase.size()) < deleted_per_user; ++i) {
      std::uint64_t const id = fact_id(1, i);
      if (deleted.insert(id).second) { erase.push_back(id); }
    }
    auto const d0 = std::chrono::steady_clock::now();
    index.erase(cuda::std::span<std::uint64_t const>{erase.data(), erase.size()});
    std::printf(
      "delete: %zu facts of user 1 (among them the top answers of its queries) in %.2f "
      "ms; user 1 now has %u live facts in %u rows\n",
      erase.size(),
      seconds_since(d0) * 1e3,
      index.size(1),
      index.rows(1));
  }
  check("after delete:");

  // --- compaction: deleted rows reclaimed, graphs of changed users rebuilt ----------------------
  {
    std::int64_t const before = index.arena_rows();
    auto const c0             = std::chrono::steady_clock::now();
    index.compact(run.builder(index));
    std::printf("compact: arena %lld -> %lld rows in %.2f s; user 1 has %u rows\n",
                static_cast<long long>(before),
                static_cast<long long>(index.arena_rows()),
                seconds_since(c0),
                index.rows(1));
    for (std::uint64_t id : deleted) {
      if (index.contains(id)) {
        std::printf("FAIL: deleted fact %llu is back after compaction\n",
                    static_cast<unsigned long long>(id));
        ++failures;
        break;
      }
    }
  }
  check("after compaction:");

  std::printf("%s\n", failures == 0 ? "OK" : "FAILED");
  return failures == 0 ? 0 : 1;
}
