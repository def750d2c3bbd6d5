/**
 * @file index_nn_descent.cpp
 * @brief The host's approximate kNN build (NN-descent) against expectations written here: the
 * exact kNN brute-forced in double (tests/common/index_reference.hpp), determinism for a seed,
 * the automatic exact/NN-descent switch, the knobs' refusals, and the search recall of an index
 * built on it beside the exact-built index's.
 *
 * NN-descent graphs are host-only: the device builder (index.cuh) computes the exact kNN, so the
 * host/device graph comparisons (index_gpu.cu) build in the reference mode `knn_build::exact`.
 */
#include <inferscale/index.hpp>

#include <catch2/catch.hpp>

#include <gaussian_mixture.hpp>
#include <index_reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <vector>

using namespace inferscale;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using inferscale::detail::index::invalid_node;

namespace {

/// The true `k` nearest other rows of row `v` (by double distance, ties by id).
std::vector<std::uint32_t> true_neighbours(std::vector<float> const& data,
                                           std::int64_t dim,
                                           std::uint32_t v,
                                           std::uint32_t k,
                                           distance_metric m)
{
  std::int64_t const n = static_cast<std::int64_t>(data.size()) / dim;
  std::vector<std::pair<double, std::uint32_t>> all;
  for (std::int64_t u = 0; u < n; ++u) {
    if (u == v) { continue; }
    all.emplace_back(
      test::reference_distance(data.data() + std::int64_t{v} * dim, data.data() + u * dim, dim, m),
      static_cast<std::uint32_t>(u));
  }
  std::partial_sort(all.begin(), all.begin() + k, all.end());
  std::vector<std::uint32_t> out;
  for (std::uint32_t i = 0; i < k; ++i) {
    out.push_back(all[i].second);
  }
  return out;
}

/// Every row: k ids in [0, n), none the row itself, no repeats, sorted by the true distance
/// (up to fp32 rounding: relative 1e-5); returns the mean recall of `sample` rows against brute
/// force.
double check_knn(std::vector<std::uint32_t> const& knn,
                 std::vector<float> const& data,
                 std::int64_t dim,
                 std::uint32_t k,
                 distance_metric m,
                 std::uint32_t sample)
{
  std::uint32_t const n = static_cast<std::uint32_t>(data.size() / static_cast<std::size_t>(dim));
  for (std::uint32_t v = 0; v < n; ++v) {
    std::set<std::uint32_t> row;
    double previous = -1e300;
    for (std::uint32_t i = 0; i < k; ++i) {
      std::uint32_t const u = knn[std::size_t{v} * k + i];
      CAPTURE(v, i, u);
      REQUIRE(u < n);
      REQUIRE(u != v);
      REQUIRE(row.insert(u).second);
      double const d = test::reference_distance(
        data.data() + std::int64_t{v} * dim, data.data() + std::int64_t{u} * dim, dim, m);
      REQUIRE(d >= previous - 1e-5 * (1.0 + std::abs(previous)));
      previous = d;
    }
  }
  std::size_t hits = 0;
  for (std::uint32_t s = 0; s < sample; ++s) {
    std::uint32_t const v = static_cast<std::uint32_t>(std::uint64_t{s} * 7919 % n);
    auto const truth      = true_neighbours(data, dim, v, k, m);
    std::set<std::uint32_t> want(truth.begin(), truth.end());
    for (std::uint32_t i = 0; i < k; ++i) {
      hits += want.count(knn[std::size_t{v} * k + i]);
    }
  }
  return static_cast<double>(hits) / (double{1} * sample * k);
}

std::vector<std::uint64_t> ids_from(std::uint64_t first, std::size_t n)
{
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) {
    ids[i] = first + i;
  }
  return ids;
}

void add_all(graph_index& index,
             std::uint64_t ns,
             std::vector<float> const& data,
             std::vector<std::uint64_t> const& ids)
{
  index.add(ns,
            make_matrix_view(data.data(), static_cast<std::int64_t>(ids.size()), index.dim()),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
}

std::vector<std::uint32_t> graph_of(graph_index const& index, std::uint64_t ns)
{
  return {index_access::graph_rows(index, ns),
          index_access::graph_rows(index, ns) +
            std::size_t{index.rows(ns)} * index_access::graph_degree(index)};
}

}  // namespace

TEST_CASE("index nn_descent: kNN recall >= 0.95 against brute force (k 32, N 20,000)",
          "[index][nn_descent]")
{
  std::int64_t const dim = 128;
  std::int64_t const n   = 20000;
  std::uint32_t const k  = 32;
  test::gaussian_mixture mix({dim, 200, true, 21});
  auto const data = mix.draw(n);
  std::vector<std::uint32_t> knn(static_cast<std::size_t>(n) * k, invalid_node);
  auto const report = detail::index::nn_descent_knn_host(
    data.data(), dim, n, distance_metric::cosine, k, nn_descent_params{}, knn.data());
  double const r = check_knn(knn, data, dim, k, distance_metric::cosine, 300);
  CAPTURE(r, report.iterations, report.distances);
  CHECK(r >= 0.95);
  // it is approximate for a reason: far fewer distances than the exact graph's n (n - 1)
  CHECK(report.distances < static_cast<std::uint64_t>(n) * (n - 1) / 4);
  CHECK(report.iterations >= 1);
  CHECK(report.iterations <= nn_descent_params{}.max_iterations);
}

TEST_CASE("index nn_descent: squared L2 and inner product, fp16 rows, small sampling rate",
          "[index][nn_descent]")
{
  auto const m = GENERATE(distance_metric::squared_l2, distance_metric::inner_product);
  CAPTURE(to_string(m));
  std::int64_t const dim = 48;
  std::int64_t const n   = 3000;
  std::uint32_t const k  = 16;
  test::gaussian_mixture mix({dim, 30, m != distance_metric::squared_l2, 5});
  auto const raw = mix.draw(n);
  // fp16 rows: the reference works on the rounded values the function reads
  std::vector<half_t> rows(raw.size());
  std::vector<float> rounded(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) {
    rows[i]    = from_float<half_t>(raw[i]);
    rounded[i] = to_float(rows[i]);
  }
  nn_descent_params p;
  p.rho = 0.3f;
  std::vector<std::uint32_t> knn(static_cast<std::size_t>(n) * k);
  detail::index::nn_descent_knn_host(rows.data(), dim, n, m, k, p, knn.data());
  double const r = check_knn(knn, rounded, dim, k, m, 200);
  CAPTURE(r);
  CHECK(r >= 0.95);
}

TEST_CASE("index nn_descent: k = n - 1 gives every other node, sorted", "[index][nn_descent]")
{
  auto const n = GENERATE(2, 3, 9, 40);
  CAPTURE(n);
  std::int64_t const dim = 8;
  test::gaussian_mixture mix({dim, 3, false, 8});
  auto const data       = mix.draw(n);
  std::uint32_t const k = static_cast<std::uint32_t>(n - 1);
  std::vector<std::uint32_t> knn(static_cast<std::size_t>(n) * k);
  detail::index::nn_descent_knn_host(
    data.data(), dim, n, distance_metric::squared_l2, k, nn_descent_params{}, knn.data());
  // every other node appears (check_knn: in range, no self, no repeats, sorted), so recall is 1
  CHECK(check_knn(knn, data, dim, k, distance_metric::squared_l2, static_cast<std::uint32_t>(n)) ==
        1.0);
}

TEST_CASE("index nn_descent: deterministic for a seed, index graphs included",
          "[index][nn_descent]")
{
  std::int64_t const dim = 32;
  std::int64_t const n   = 4000;
  test::gaussian_mixture mix({dim, 40, true, 13});
  auto const data       = mix.draw(n);
  std::uint32_t const k = 24;
  std::vector<std::uint32_t> a(static_cast<std::size_t>(n) * k), b(a.size()), c(a.size());
  nn_descent_params p;
  auto const ra = detail::index::nn_descent_knn_host(
    data.data(), dim, n, distance_metric::cosine, k, p, a.data());
  auto const rb = detail::index::nn_descent_knn_host(
    data.data(), dim, n, distance_metric::cosine, k, p, b.data());
  CHECK(a == b);
  CHECK(ra.distances == rb.distances);
  CHECK(ra.iterations == rb.iterations);
  // another seed is another (still good) approximation: a different random start and samples
  p.seed        = 99;
  auto const rc = detail::index::nn_descent_knn_host(
    data.data(), dim, n, distance_metric::cosine, k, p, c.data());
  CHECK(rc.distances != ra.distances);
  CHECK(check_knn(c, data, dim, k, distance_metric::cosine, 100) >= 0.95);

  index_config cfg;
  cfg.dim      = dim;
  cfg.host_knn = knn_build::nn_descent;
  graph_index x(cfg), y(cfg);
  auto const ids = ids_from(1, static_cast<std::size_t>(n));
  add_all(x, 3, data, ids);
  add_all(y, 3, data, ids);
  CHECK(index_access::last_nn_descent(x).iterations >= 1);
  CHECK(graph_of(x, 3) == graph_of(y, 3));
}

TEST_CASE("index nn_descent: the automatic switch is exact up to exact_knn_max_rows",
          "[index][nn_descent]")
{
  index_config cfg;
  cfg.dim = 8;
  SECTION("uses_nn_descent by mode and size")
  {
    graph_index automatic(cfg);
    CHECK(exact_knn_max_rows == 4000);
    CHECK_FALSE(index_access::uses_nn_descent(automatic, 2));
    CHECK_FALSE(index_access::uses_nn_descent(automatic, 4000));
    CHECK(index_access::uses_nn_descent(automatic, 4001));
    cfg.host_knn = knn_build::exact;
    CHECK_FALSE(index_access::uses_nn_descent(graph_index(cfg), 1000000));
    cfg.host_knn = knn_build::nn_descent;
    CHECK(index_access::uses_nn_descent(graph_index(cfg), 2));
  }
  SECTION("a small automatic build is the exact build; one above the limit runs NN-descent")
  {
    test::gaussian_mixture mix({8, 20, true, 4});
    auto const data = mix.draw(exact_knn_max_rows + 1);
    std::vector<float> const small(data.begin(), data.begin() + 2000 * 8);
    auto const ids = ids_from(1, exact_knn_max_rows + 1);
    graph_index automatic(cfg);
    cfg.host_knn = knn_build::exact;
    graph_index exact(cfg);
    add_all(automatic, 1, small, std::vector<std::uint64_t>(ids.begin(), ids.begin() + 2000));
    add_all(exact, 1, small, std::vector<std::uint64_t>(ids.begin(), ids.begin() + 2000));
    CHECK(index_access::last_nn_descent(automatic).iterations == 0);
    CHECK(graph_of(automatic, 1) == graph_of(exact, 1));
    add_all(automatic, 2, data, ids_from(100000, ids.size()));
    CHECK(index_access::last_nn_descent(automatic).iterations >= 1);
    CHECK(index_access::last_nn_descent(automatic).distances > 0);
  }
}

TEST_CASE("index nn_descent: search recall within 0.01 of the exact-built index",
          "[index][nn_descent][recall]")
{
  std::int64_t const dim = 128;
  std::int64_t const n   = 20000;
  std::uint32_t const k  = 10;
  std::int64_t const nq  = 200;
  test::gaussian_mixture mix({dim, 200, true, 17});
  auto const queries = mix.draw(nq);
  auto const data    = mix.draw(n);
  auto const ids     = ids_from(0, static_cast<std::size_t>(n));
  index_config cfg;
  cfg.dim      = dim;
  cfg.host_knn = knn_build::exact;
  graph_index exact(cfg);
  cfg.host_knn = knn_build::nn_descent;
  graph_index approx(cfg);
  add_all(exact, 0, data, ids);
  add_all(approx, 0, data, ids);
  REQUIRE(index_access::last_nn_descent(approx).iterations >= 1);
  REQUIRE(index_access::last_nn_descent(exact).iterations == 0);

  // truth: brute force in double on the normalised rows (the mixture is normalised already)
  std::vector<std::set<std::uint64_t>> truth;
  for (std::int64_t q = 0; q < nq; ++q) {
    std::vector<std::pair<double, std::uint64_t>> all;
    for (std::int64_t r = 0; r < n; ++r) {
      all.emplace_back(
        test::reference_distance(
          queries.data() + q * dim, data.data() + r * dim, dim, distance_metric::cosine),
        static_cast<std::uint64_t>(r));
    }
    std::partial_sort(all.begin(), all.begin() + k, all.end());
    std::set<std::uint64_t> s;
    for (std::uint32_t j = 0; j < k; ++j) {
      s.insert(all[j].second);
    }
    truth.push_back(s);
  }
  auto recall_of = [&](graph_index const& index, search_params const& p) {
    std::vector<std::uint64_t> got(static_cast<std::size_t>(nq) * k);
    std::vector<float> dist(got.size());
    std::vector<std::uint64_t> const ns{0};
    inferscale::search(index,
                       make_matrix_view(queries.data(), nq, dim),
                       cuda::std::span<std::uint64_t const>{ns.data(), 1},
                       k,
                       p,
                       make_matrix_view(got.data(), nq, std::int64_t{k}),
                       make_matrix_view(dist.data(), nq, std::int64_t{k}));
    std::size_t hits = 0;
    for (std::int64_t q = 0; q < nq; ++q) {
      for (std::uint32_t j = 0; j < k; ++j) {
        hits += truth[static_cast<std::size_t>(q)].count(got[static_cast<std::size_t>(q) * k + j]);
      }
    }
    return static_cast<double>(hits) / static_cast<double>(nq * k);
  };
  // a lean setting (where graph quality shows) and the defaults
  search_params lean;
  lean.algo                 = search_algo::graph;
  lean.itopk_size           = 32;
  lean.num_random_samplings = 2;
  search_params defaults;
  defaults.algo = search_algo::graph;
  for (auto const& p : {lean, defaults}) {
    double const re = recall_of(exact, p);
    double const ra = recall_of(approx, p);
    CAPTURE(p.itopk_size, p.num_random_samplings, re, ra);
    CHECK(ra >= re - 0.01);
    if (p.itopk_size == defaults.itopk_size) { CHECK(ra >= 0.95); }  // the defaults' stated recall
  }
}

TEST_CASE("index nn_descent: bad knobs are refused at construction",
          "[index][nn_descent][validation]")
{
  index_config cfg;
  cfg.dim          = 8;
  auto refused     = [](index_config const& c) { CHECK_THROWS_AS(graph_index{c}, logic_error); };
  index_config c   = cfg;
  c.nn_descent.rho = 0.0f;
  refused(c);
  c.nn_descent.rho = 1.5f;
  refused(c);
  c                  = cfg;
  c.nn_descent.delta = -0.1f;
  refused(c);
  c                           = cfg;
  c.nn_descent.max_iterations = 0;
  refused(c);
  c          = cfg;
  c.host_knn = static_cast<knn_build>(7);
  refused(c);
  CHECK_NOTHROW(graph_index{cfg});
}
