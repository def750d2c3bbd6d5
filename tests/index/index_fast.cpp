/**
 * @file index_fast.cpp
 * @brief The host's fast search (`host_search_mode::fast`) against expectations written here:
 * its distances against the metric's definition in double on every instruction set the CPU has,
 * its exact search against brute force, its graph search's recall on a clustered mixture, the
 * entry points' coverage of the clusters, and the contracts it shares with the reference mode
 * (live results only, sorted, unique, tenants isolated, identical after save and load).
 */
#include <inferscale/index.hpp>
#include <inferscale/index_snapshot.hpp>

#include <catch2/catch.hpp>

#include <gaussian_mixture.hpp>
#include <index_answers.hpp>
#include <index_reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace inferscale;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
namespace ix = inferscale::detail::index;

namespace {

using test::answers;

/// Restores the default instruction-set cap when a test that lowered it ends (or fails).
struct simd_cap_guard {
  ~simd_cap_guard() { detail::set_host_simd_cap(detail::host_simd::avx512_bf16); }
};

/// The instruction sets to check: every level up to the one this CPU has.
std::vector<detail::host_simd> levels()
{
  std::vector<detail::host_simd> out{detail::host_simd::scalar};
  if (detail::detected_host_simd() != detail::host_simd::scalar) {
    out.push_back(detail::host_simd::avx2);
  }
  if (detail::uses_avx512(detail::detected_host_simd())) {
    out.push_back(detail::host_simd::avx512);
  }
  return out;
}

std::vector<std::uint64_t> iota_ids(std::size_t n, std::uint64_t first = 0)
{
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) {
    ids[i] = first + i;
  }
  return ids;
}

answers run(graph_index const& index,
            std::vector<float> const& queries,
            std::uint64_t ns,
            std::uint32_t k,
            search_params const& p)
{
  return test::run_search(index, queries, {ns}, k, p);
}

/// The true k nearest row positions of each query, by the double-precision definition on the
/// normalised data (the mixture is normalised already; cosine = 1 - dot).
std::vector<std::vector<std::uint32_t>> truth_of(std::vector<float> const& data,
                                                 std::vector<float> const& queries,
                                                 std::int64_t dim,
                                                 std::uint32_t k)
{
  std::size_t const n  = data.size() / static_cast<std::size_t>(dim);
  std::size_t const nq = queries.size() / static_cast<std::size_t>(dim);
  std::vector<std::vector<std::uint32_t>> out(nq);
  std::vector<std::pair<double, std::uint32_t>> all(n);
  for (std::size_t q = 0; q < nq; ++q) {
    for (std::size_t r = 0; r < n; ++r) {
      all[r] = {test::reference_distance(
                  data.data() + r * dim, queries.data() + q * dim, dim, distance_metric::cosine),
                static_cast<std::uint32_t>(r)};
    }
    std::partial_sort(all.begin(), all.begin() + k, all.end());
    for (std::uint32_t j = 0; j < k; ++j) {
      out[q].push_back(all[j].second);
    }
  }
  return out;
}

double recall_of(answers const& got,
                 std::vector<std::vector<std::uint32_t>> const& truth,
                 std::uint32_t k)
{
  std::size_t hits = 0;
  for (std::size_t q = 0; q < truth.size(); ++q) {
    std::set<std::uint64_t> want(truth[q].begin(), truth[q].end());
    for (std::uint32_t j = 0; j < k; ++j) {
      hits += want.count(got.ids[q * k + j]);
    }
  }
  return static_cast<double>(hits) / static_cast<double>(truth.size() * k);
}

}  // namespace

TEST_CASE("fast distances equal the definition to within rounding on every instruction set",
          "[index][fast]")
{
  simd_cap_guard guard;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  // lengths: padded rows of 4 (fp32) / 8 (fp16) elements, short and long, with every tail
  for (std::int64_t n : {4, 8, 12, 16, 28, 32, 36, 60, 64, 68, 100, 128, 384, 388, 768, 1540}) {
    std::vector<float> x(static_cast<std::size_t>(n)), q(x.size());
    for (auto& v : x) {
      v = normal(rng);
    }
    for (auto& v : q) {
      v = normal(rng);
    }
    std::vector<half_t> xh(x.size());
    std::vector<float> xr(x.size());  // x as fp16 stores it
    for (std::size_t i = 0; i < x.size(); ++i) {
      xh[i] = from_float<half_t>(x[i]);
      xr[i] = to_float(xh[i]);
    }
    // |error| of a sum of n products in fp32, any order, fused or not: n * eps * sum |terms|
    double abs_dot = 0.0, abs_l2 = 0.0, abs_dot_h = 0.0, abs_l2_h = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      abs_dot += std::fabs(double{x[i]} * q[i]);
      abs_l2 += (double{x[i]} - q[i]) * (double{x[i]} - q[i]);
      abs_dot_h += std::fabs(double{xr[i]} * q[i]);
      abs_l2_h += (double{xr[i]} - q[i]) * (double{xr[i]} - q[i]);
    }
    double const eps = std::ldexp(1.0, -23);
    for (auto level : levels()) {
      detail::set_host_simd_cap(level);
      for (auto m :
           {distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2}) {
        CAPTURE(n, static_cast<int>(level), to_string(m));
        bool const l2 = m == distance_metric::squared_l2;
        // (x - q)^2 adds one rounding of the difference: 3 eps per term instead of 2
        double const bound = (static_cast<double>(n) + 3.0) * eps * (l2 ? abs_l2 : abs_dot) + 1e-30;
        double const bound_h =
          (static_cast<double>(n) + 3.0) * eps * (l2 ? abs_l2_h : abs_dot_h) + 1e-30;
        double const want   = test::reference_distance(x.data(), q.data(), n, m);
        double const want_h = test::reference_distance(xr.data(), q.data(), n, m);
        float const got     = ix::fast_distance_for<float>(m)(x.data(), q.data(), n);
        float const got_h   = ix::fast_distance_for<half_t>(m)(xh.data(), q.data(), n);
        REQUIRE(std::fabs(got - want) <= bound * 1.0000001 + std::fabs(want) * eps);
        REQUIRE(std::fabs(got_h - want_h) <= bound_h * 1.0000001 + std::fabs(want_h) * eps);
      }
    }
  }
}

TEST_CASE(
  "block dot products: each pair the same bits in any block and either order, and the "
  "definition to within rounding",
  "[index][fast][nn_descent]")
{
  simd_cap_guard guard;
  std::mt19937 rng(29);
  std::normal_distribution<float> normal;
  // row lengths with every tail of the eight- and sixteen-lane chunks, rows that need edge blocks
  for (std::int64_t n : {4, 12, 16, 20, 60, 64, 100, 384, 388, 768}) {
    std::uint32_t const rows = 11;
    std::vector<float> data(static_cast<std::size_t>(n) * rows);
    for (auto& v : data) {
      v = normal(rng);
    }
    std::vector<float const*> ptr(rows);
    for (std::uint32_t r = 0; r < rows; ++r) {
      ptr[r] = data.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(n);
    }
    double const eps = std::ldexp(1.0, -23);
    for (auto level : levels()) {
      detail::set_host_simd_cap(level);
      ix::dot_block_fn const block = ix::dot_block_for();
      CAPTURE(n, static_cast<int>(level));
      // every pair alone (a 1 x 1 block)
      std::vector<float> single(static_cast<std::size_t>(rows) * rows);
      for (std::uint32_t a = 0; a < rows; ++a) {
        for (std::uint32_t b = 0; b < rows; ++b) {
          block(&ptr[a], 1, &ptr[b], 1, n, &single[a * rows + b], 1);
          double want = 0.0, scale = 0.0;
          for (std::int64_t i = 0; i < n; ++i) {
            want += double{ptr[a][i]} * double{ptr[b][i]};
            scale += std::fabs(double{ptr[a][i]} * double{ptr[b][i]});
          }
          REQUIRE(std::fabs(single[a * rows + b] - want) <=
                  (static_cast<double>(n) + 2.0) * eps * scale + 1e-30);
        }
      }
      for (std::uint32_t a = 0; a < rows; ++a) {
        for (std::uint32_t b = 0; b < rows; ++b) {
          REQUIRE(std::memcmp(&single[a * rows + b], &single[b * rows + a], sizeof(float)) == 0);
        }
      }
      // every block shape and offset (rows 1..11 against columns 1..11, out with a wider stride)
      for (std::uint32_t na = 1; na <= rows; ++na) {
        for (std::uint32_t nb = 1; nb <= rows; ++nb) {
          std::uint32_t const a0 = (na * 7) % (rows - na + 1), b0 = (nb * 5) % (rows - nb + 1);
          std::size_t const ld = nb + 3;
          std::vector<float> out(na * ld, -1.0f);
          block(ptr.data() + a0, na, ptr.data() + b0, nb, n, out.data(), ld);
          for (std::uint32_t i = 0; i < na; ++i) {
            for (std::uint32_t j = 0; j < nb; ++j) {
              REQUIRE(std::memcmp(
                        &out[i * ld + j], &single[(a0 + i) * rows + (b0 + j)], sizeof(float)) == 0);
            }
            for (std::size_t j = nb; j < ld; ++j) {
              REQUIRE(out[i * ld + j] == -1.0f);  // nothing written past the block
            }
          }
        }
      }
    }
  }
}

TEST_CASE("fast scans give each row's fast distance to within rounding", "[index][fast]")
{
  simd_cap_guard guard;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (std::int64_t n : {4, 8, 20, 36, 100, 384, 388}) {
    for (std::uint32_t count : {1u, 3u, 4u, 7u, 9u}) {
      std::vector<float> rows(static_cast<std::size_t>(n) * count), q(static_cast<std::size_t>(n));
      for (auto& v : rows) {
        v = normal(rng);
      }
      for (auto& v : q) {
        v = normal(rng);
      }
      std::vector<half_t> hrows(rows.size());
      std::vector<float> hr(rows.size());
      for (std::size_t i = 0; i < rows.size(); ++i) {
        hrows[i] = from_float<half_t>(rows[i]);
        hr[i]    = to_float(hrows[i]);
      }
      for (auto level : levels()) {
        detail::set_host_simd_cap(level);
        for (auto m : {distance_metric::inner_product, distance_metric::squared_l2}) {
          std::vector<float> out(count, -99.0f), hout(count, -99.0f);
          ix::fast_scan_for<float>(m)(rows.data(), n, count, q.data(), out.data());
          ix::fast_scan_for<half_t>(m)(hrows.data(), n, count, q.data(), hout.data());
          for (std::uint32_t r = 0; r < count; ++r) {
            CAPTURE(n, count, r, static_cast<int>(level), to_string(m));
            double abs_sum = 0.0, abs_sum_h = 0.0;
            for (std::int64_t e = 0; e < n; ++e) {
              double const x = rows[r * n + e], xh = hr[r * n + e],
                           y = q[static_cast<std::size_t>(e)];
              abs_sum += m == distance_metric::squared_l2 ? (x - y) * (x - y) : std::fabs(x * y);
              abs_sum_h +=
                m == distance_metric::squared_l2 ? (xh - y) * (xh - y) : std::fabs(xh * y);
            }
            double const eps    = std::ldexp(1.0, -23);
            double const want   = test::reference_distance(rows.data() + r * n, q.data(), n, m);
            double const want_h = test::reference_distance(hr.data() + r * n, q.data(), n, m);
            REQUIRE(std::fabs(out[r] - want) <= (n + 3.0) * eps * abs_sum + 1e-30);
            REQUIRE(std::fabs(hout[r] - want_h) <= (n + 3.0) * eps * abs_sum_h + 1e-30);
          }
        }
      }
    }
  }
}

TEST_CASE("fast distances see every element (a change at any position changes the result)",
          "[index][fast]")
{
  simd_cap_guard guard;
  for (auto level : levels()) {
    detail::set_host_simd_cap(level);
    for (std::int64_t n : {4, 36, 100, 388}) {
      std::vector<float> x(static_cast<std::size_t>(n), 0.0f), q(x.size(), 1.0f);
      for (std::int64_t at = 0; at < n; ++at) {
        x[static_cast<std::size_t>(at)] = 1.0f;
        CAPTURE(static_cast<int>(level), n, at);
        REQUIRE(ix::fast_distance_for<float>(distance_metric::inner_product)(
                  x.data(), q.data(), n) == -1.0f);
        REQUIRE(ix::fast_distance_for<float>(distance_metric::squared_l2)(x.data(), q.data(), n) ==
                static_cast<float>(n - 1));
        x[static_cast<std::size_t>(at)] = 0.0f;
      }
    }
  }
}

TEST_CASE("entry points are distinct, deterministic and cover every cluster", "[index][fast]")
{
  // 20 well-separated clusters of about 150 points: with 64 entry points (over 3 per cluster)
  // D^2 sampling must hit every cluster (a uniform sample of 64 misses one with probability
  // about 20 * 0.95^64 = 0.75)
  std::int64_t const dim = 32;
  test::gaussian_mixture mix({dim, 20, true, 5});
  std::vector<float> data       = mix.draw(3000);
  std::vector<float> const rows = data;  // fp32, dim a multiple of 4: already padded rows
  auto const a                  = ix::choose_entry_points(rows.data(), dim, 3000, 64, 512, 99);
  auto const b                  = ix::choose_entry_points(rows.data(), dim, 3000, 64, 512, 99);
  REQUIRE(a == b);
  REQUIRE(a.size() == 64);
  REQUIRE(std::set<std::uint32_t>(a.begin(), a.end()).size() == 64);
  for (auto v : a) {
    REQUIRE(v < 3000);
  }
  // coverage, stated without the generator's cluster labels: (nearly) every point has an entry
  // point closer than half the median distance between two random points (two points of one
  // cluster are far closer than that, two of different clusters far farther)
  std::vector<double> pair_d;
  for (int i = 0; i < 2000; ++i) {
    pair_d.push_back(test::reference_distance(rows.data() + (i * 7 % 3000) * dim,
                                              rows.data() + (i * 13 % 3000 + 1) % 3000 * dim,
                                              dim,
                                              distance_metric::squared_l2));
  }
  std::nth_element(pair_d.begin(), pair_d.begin() + 1000, pair_d.end());
  double const median = pair_d[1000];
  std::size_t far     = 0;
  for (std::uint32_t v = 0; v < 3000; ++v) {
    double best = std::numeric_limits<double>::infinity();
    for (auto e : a) {
      best =
        std::min(best,
                 test::reference_distance(
                   rows.data() + v * dim, rows.data() + e * dim, dim, distance_metric::squared_l2));
    }
    far += best >= median / 2 ? 1 : 0;
  }
  // a missed cluster leaves its ~150 points far; a stray point of a cluster's tail may be far
  REQUIRE(far <= 30);
  // every node when the count reaches n
  auto const all = ix::choose_entry_points(rows.data(), dim, 50, 64, 512, 99);
  REQUIRE(all.size() == 50);
  for (std::uint32_t v = 0; v < 50; ++v) {
    REQUIRE(all[v] == v);
  }
}

TEST_CASE("fast exact search equals brute force", "[index][fast]")
{
  simd_cap_guard guard;
  std::int64_t const dim = 100;  // 25 chunks: tails in every instruction set
  for (auto metric :
       {distance_metric::cosine, distance_metric::inner_product, distance_metric::squared_l2}) {
    for (auto vt : {dtype::float32, dtype::float16}) {
      index_config c;
      c.dim          = dim;
      c.metric       = metric;
      c.vector_dtype = vt;
      graph_index index{c};
      test::gaussian_mixture mix({dim, 10, metric != distance_metric::squared_l2, 3});
      std::vector<float> data = mix.draw(700), queries = mix.draw(20);
      auto const ids = iota_ids(700, 1000);
      index.add(4,
                make_matrix_view<float const>(data.data(), 700, dim),
                cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
      std::vector<std::uint64_t> gone{1003, 1100, 1200, 1333};
      index.erase(cuda::std::span<std::uint64_t const>{gone.data(), gone.size()});
      // the rows as the index stores them, and the queries as it compares them
      auto const* stored = static_cast<unsigned char const*>(index_access::vector_rows(index, 4));
      std::int64_t const re = index_access::row_elements(index);
      auto row_value        = [&](std::uint32_t r, std::int64_t e) {
        return vt == dtype::float32 ? reinterpret_cast<float const*>(stored)[r * re + e]
                                           : to_float(reinterpret_cast<half_t const*>(stored)[r * re + e]);
      };
      auto const prepared = index_access::prepare_queries(
        index, make_matrix_view<float const>(queries.data(), 20, dim));
      search_params p;
      p.algo = search_algo::exact;
      for (auto level : levels()) {
        detail::set_host_simd_cap(level);
        answers const got = run(index, queries, 4, 10, p);
        for (std::size_t q = 0; q < 20; ++q) {
          std::vector<std::pair<double, std::uint64_t>> all;
          for (std::uint32_t r = 0; r < 700; ++r) {
            if (std::find(gone.begin(), gone.end(), ids[r]) != gone.end()) { continue; }
            std::vector<float> row(static_cast<std::size_t>(dim));
            for (std::int64_t e = 0; e < dim; ++e) {
              row[static_cast<std::size_t>(e)] = row_value(r, e);
            }
            all.emplace_back(
              test::reference_distance(row.data(), prepared.data() + q * re, dim, metric), ids[r]);
          }
          std::sort(all.begin(), all.end());
          CAPTURE(to_string(metric), to_string(vt), static_cast<int>(level), q);
          double const tol = 1e-5 * (1.0 + std::fabs(all[9].first));
          for (std::size_t j = 0; j < 10; ++j) {
            // the same distance to within rounding, in order; the same id unless a near-tie
            REQUIRE(std::fabs(got.distances[q * 10 + j] - all[j].first) <= tol);
            if (j > 0) { REQUIRE(got.distances[q * 10 + j - 1] <= got.distances[q * 10 + j]); }
            bool const tie_free = (j == 0 || all[j].first - all[j - 1].first > 2 * tol) &&
                                  (all[j + 1].first - all[j].first > 2 * tol);
            if (tie_free) { REQUIRE(got.ids[q * 10 + j] == all[j].second); }
          }
        }
      }
    }
  }
}

TEST_CASE("fast graph search: recall on a clustered mixture, live results only, save and load",
          "[index][fast]")
{
  std::int64_t const dim = 64;
  std::uint32_t const n  = 6000;
  test::gaussian_mixture mix({dim, 60, true, 17});
  std::vector<float> const queries = mix.draw(200);
  std::vector<float> const data    = mix.draw(n);
  index_config c;
  c.dim = dim;
  graph_index index{c};
  auto const ids = iota_ids(n);
  index.add(9,
            make_matrix_view<float const>(data.data(), n, dim),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  auto const truth = truth_of(data, queries, dim, 10);

  search_params graph;
  graph.algo             = search_algo::graph;  // the defaults otherwise: host_mode fast
  answers const got      = run(index, queries, 9, 10, graph);
  double const r         = recall_of(got, truth, 10);
  std::uint32_t const ef = index_access::host_default_ef(index, 9);
  std::printf(
    "fast graph search, 6000 x 64, 60 clusters: recall@10 %.4f at the defaults "
    "(calibrated ef %u, %u entry points)\n",
    r,
    ef,
    index_access::host_entry_points(index, 9));
  REQUIRE(r >= 0.99);  // held-out queries: the calibration on the namespace's rows carries over
  REQUIRE(ef >= 10);
  REQUIRE(ef <= 64);  // below CAGRA's 64, which the defaults used before the calibration

  // the reference mode (itopk 0 -> 64) runs the sequential spec; the fast mode finds as good a set
  search_params reference = graph;
  reference.host_mode     = host_search_mode::reference;
  double const r_ref      = recall_of(run(index, queries, 9, 10, reference), truth, 10);
  std::printf("reference mode (itopk 64): recall@10 %.4f\n", r_ref);
  REQUIRE(r >= r_ref - 0.01);

  // results are sorted, unique, and their distances are the rows' distances
  for (std::size_t q = 0; q < 200; ++q) {
    std::set<std::uint64_t> seen;
    for (std::size_t j = 0; j < 10; ++j) {
      std::uint64_t const id = got.ids[q * 10 + j];
      REQUIRE(id < n);
      REQUIRE(seen.insert(id).second);
      if (j > 0) { REQUIRE(got.distances[q * 10 + j - 1] <= got.distances[q * 10 + j]); }
      double const d = test::reference_distance(
        data.data() + id * dim, queries.data() + q * dim, dim, distance_metric::cosine);
      REQUIRE(std::fabs(got.distances[q * 10 + j] - d) <= 1e-5);
    }
  }

  // deleted facts route but never come back; every query still gets 10 results
  std::vector<std::uint64_t> gone;
  for (std::size_t q = 0; q < 200; ++q) {
    gone.push_back(got.ids[q * 10]);  // every query's nearest fact
  }
  std::sort(gone.begin(), gone.end());
  gone.erase(std::unique(gone.begin(), gone.end()), gone.end());
  index.erase(cuda::std::span<std::uint64_t const>{gone.data(), gone.size()});
  answers const after = run(index, queries, 9, 10, graph);
  for (std::size_t j = 0; j < after.ids.size(); ++j) {
    REQUIRE(after.ids[j] != invalid_fact_id);
    REQUIRE(!std::binary_search(gone.begin(), gone.end(), after.ids[j]));
  }

  // a saved and loaded index has the same entry points (the file carries them): identical
  // answers, bit for bit
  std::string const path = "index_fast_roundtrip.isidx";
  save_index(index, path);
  graph_index const loaded = load_index(path);
  std::remove(path.c_str());
  answers const again = run(loaded, queries, 9, 10, graph);
  REQUIRE(again.ids == after.ids);
  REQUIRE(std::memcmp(again.distances.data(),
                      after.distances.data(),
                      after.distances.size() * sizeof(float)) == 0);
}

TEST_CASE("fast graph search: a namespace of packed_entry_min_rows scans its packed entry rows",
          "[index][fast]")
{
  // at the threshold the entry points' rows are packed (the index dtype, and float16 under
  // float16 traversal); one row fewer reads them in place. Both answer as a brute force does.
  std::int64_t const dim = 16;
  std::uint32_t const n  = detail::index::packed_entry_min_rows;
  test::gaussian_mixture mix({dim, 40, true, 23});
  std::vector<float> const queries = mix.draw(100);
  std::vector<float> const data    = mix.draw(n);
  auto const ids                   = iota_ids(n);
  index_config c;
  c.dim                  = dim;
  c.host_traversal_dtype = dtype::float16;
  graph_index index{c};
  index.add(3,
            make_matrix_view<float const>(data.data(), n, dim),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  auto const ids4 = iota_ids(n - 1, 100000);
  index.add(4,
            make_matrix_view<float const>(data.data(), n - 1, dim),
            cuda::std::span<std::uint64_t const>{ids4.data(), ids4.size()});
  std::uint64_t const e3           = index_access::host_entry_points(index, 3),
                      e4           = index_access::host_entry_points(index, 4);
  std::uint64_t const row_elements = static_cast<std::uint64_t>(index_access::row_elements(index));
  REQUIRE(e3 >= 64);
  REQUIRE(e4 >= 64);
  // ids of both, rows of namespace 3 only: float32 in the index's copy, float16 in the walk's
  REQUIRE(index.host_entry_bytes() == (e3 + e4) * 4 + e3 * row_elements * 4);
  REQUIRE(index.host_traversal_bytes() == (std::uint64_t{n} + (n - 1) + e3) * row_elements * 2);

  std::vector<float> const data4(data.begin(), data.end() - dim);
  auto const truth3 = truth_of(data, queries, dim, 10), truth4 = truth_of(data4, queries, dim, 10);
  search_params graph;
  graph.algo = search_algo::graph;
  for (std::uint64_t ns : {std::uint64_t{3}, std::uint64_t{4}}) {
    answers got = run(index, queries, ns, 10, graph);
    for (auto& id : got.ids) {
      id = ns == 4 && id != invalid_fact_id ? id - 100000 : id;
    }
    double const r = recall_of(got, ns == 3 ? truth3 : truth4, 10);
    std::printf("namespace of %u rows (%s entry rows): recall@10 %.4f at the defaults (ef %u)\n",
                index.rows(ns),
                ns == 3 ? "packed" : "in-place",
                r,
                index_access::host_default_ef(index, ns));
    REQUIRE(r >= 0.98);
  }

  // a loaded index packs the same rows again: identical answers, bit for bit
  std::string const path = "index_packed_entries.isidx";
  save_index(index, path);
  graph_index const loaded = load_index(path);
  std::remove(path.c_str());
  REQUIRE(loaded.host_entry_bytes() == index.host_entry_bytes());
  REQUIRE(loaded.host_traversal_bytes() == index.host_traversal_bytes());
  for (std::uint64_t ns : {std::uint64_t{3}, std::uint64_t{4}}) {
    answers const a = run(index, queries, ns, 10, graph), b = run(loaded, queries, ns, 10, graph);
    REQUIRE(a.ids == b.ids);
    REQUIRE(
      std::memcmp(a.distances.data(), b.distances.data(), a.distances.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("fast graph search keeps tenants apart and answers tiny namespaces", "[index][fast]")
{
  std::int64_t const dim = 16;
  index_config c;
  c.dim = dim;
  graph_index index{c};
  test::gaussian_mixture mix({dim, 5, true, 2});
  std::vector<float> a = mix.draw(400), b = mix.draw(3), q = mix.draw(5);
  auto const ida = iota_ids(400, 0), idb = iota_ids(3, 5000);
  index.add(1,
            make_matrix_view<float const>(a.data(), 400, dim),
            cuda::std::span<std::uint64_t const>{ida.data(), ida.size()});
  index.add(2,
            make_matrix_view<float const>(b.data(), 3, dim),
            cuda::std::span<std::uint64_t const>{idb.data(), idb.size()});
  search_params p;
  p.algo            = search_algo::graph;
  answers const in1 = run(index, q, 1, 10, p);
  for (auto id : in1.ids) {
    REQUIRE(id < 400);
  }
  answers const in2 = run(index, q, 2, 5, p);
  for (std::size_t i = 0; i < 5; ++i) {
    std::set<std::uint64_t> got;
    for (std::size_t j = 0; j < 3; ++j) {
      got.insert(in2.ids[i * 5 + j]);
    }
    REQUIRE(got == std::set<std::uint64_t>{5000, 5001, 5002});  // all three, each once
    REQUIRE(in2.ids[i * 5 + 3] == invalid_fact_id);
    REQUIRE(in2.ids[i * 5 + 4] == invalid_fact_id);
    REQUIRE(std::isinf(in2.distances[i * 5 + 4]));
  }
}

TEST_CASE("index_config::host_entry_points is validated", "[index][fast]")
{
  index_config c;
  c.dim               = 8;
  c.host_entry_points = 0;
  REQUIRE_THROWS_WITH(graph_index{c}, Catch::Contains("host_entry_points"));
  c.host_entry_points = -2;
  REQUIRE_THROWS_WITH(graph_index{c}, Catch::Contains("host_entry_points"));
  c.host_entry_points = 5;
  REQUIRE_NOTHROW(graph_index{c});
  REQUIRE(default_host_entry_points(10) == 10);
  REQUIRE(default_host_entry_points(200) == 64);         // 4 sqrt(200) = 56.6 -> the floor
  REQUIRE(default_host_entry_points(1000) == 127);       // ceil(4 sqrt(1000)) = ceil(126.49)
  REQUIRE(default_host_entry_points(20000) == 566);      // ceil(565.69)
  REQUIRE(default_host_entry_points(100000) == 1265);    // ceil(1264.91)
  REQUIRE(default_host_entry_points(10000000) == 2048);  // the cap
}

namespace {

/// Every row of `ns` in the float16 copy is `from_float<half_t>` of the stored float32 row.
void require_copy_current(graph_index const& index, std::uint64_t ns)
{
  half_t const* copy = index_access::host_traversal_rows(index, ns);
  REQUIRE(copy != nullptr);
  auto const* rows = static_cast<float const*>(index_access::vector_rows(index, ns));
  std::size_t const count =
    std::size_t{index.rows(ns)} * static_cast<std::size_t>(index_access::row_elements(index));
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) {
    half_t const want = from_float<half_t>(rows[i]);
    wrong += std::memcmp(&want, copy + i, sizeof want) != 0 ? 1 : 0;
  }
  REQUIRE(wrong == 0);
}

}  // namespace

TEST_CASE("float16 traversal: the copy follows the rows through every mutation and a load",
          "[index][fast][traversal]")
{
  std::int64_t const dim = 48;
  test::gaussian_mixture mix({dim, 20, true, 5});
  index_config c;
  c.dim                  = dim;
  c.host_traversal_dtype = dtype::float16;
  graph_index index{c};
  std::vector<float> const a = mix.draw(1500), b = mix.draw(40), d = mix.draw(700);
  auto const ida = iota_ids(1500), idb = iota_ids(40, 10000), idd = iota_ids(700, 20000);
  index.add(1,
            make_matrix_view<float const>(a.data(), 1500, dim),
            cuda::std::span<std::uint64_t const>{ida.data(), ida.size()});
  require_copy_current(index, 1);
  index.add(1,
            make_matrix_view<float const>(b.data(), 40, dim),  // the incremental path
            cuda::std::span<std::uint64_t const>{idb.data(), idb.size()});
  require_copy_current(index, 1);
  index.add(2,
            make_matrix_view<float const>(d.data(), 700, dim),
            cuda::std::span<std::uint64_t const>{idd.data(), idd.size()});
  require_copy_current(index, 2);
  std::vector<std::uint64_t> gone;
  for (std::uint64_t i = 0; i < 1500; i += 3) {
    gone.push_back(i);
  }
  index.erase(cuda::std::span<std::uint64_t const>{gone.data(), gone.size()});
  index.compact();  // namespace 1 rebuilt from its live rows, namespace 2 moved
  require_copy_current(index, 1);
  require_copy_current(index, 2);
  REQUIRE(index.rows(1) == 1500 - 500 + 40);
  index.build(2,
              make_matrix_view<float const>(b.data(), 0, dim),
              cuda::std::span<std::uint64_t const>{idb.data(), 0});  // an empty build
  REQUIRE(index.rows(2) == 0);
  (void)index.erase_namespace(2);
  REQUIRE(index_access::host_traversal_rows(index, 2) == nullptr);
  require_copy_current(index, 1);

  // a loaded index walks as the saved one did (the file carries the setting), with its copy
  // made from the loaded rows; the setter takes the copy away and makes it again
  std::string const path = "index_traversal_roundtrip.isidx";
  save_index(index, path);
  graph_index loaded = load_index(path);
  std::remove(path.c_str());
  REQUIRE(loaded.config().host_traversal_dtype == dtype::float16);
  require_copy_current(loaded, 1);
  std::uint64_t const version = loaded.version();
  loaded.set_host_traversal_dtype(dtype::float32);
  REQUIRE(index_access::host_traversal_rows(loaded, 1) == nullptr);
  REQUIRE(loaded.host_traversal_bytes() == 0);
  loaded.set_host_traversal_dtype(dtype::float16);
  REQUIRE(loaded.version() == version + 2);
  require_copy_current(loaded, 1);
  // the copy's bytes: every row of the namespace in float16, and its entry points' rows packed
  // (its entry points were chosen at 1,040 rows, at least packed_entry_min_rows); the index's own
  // packed entry rows are float32, beside their ids
  std::uint64_t const row_bytes =
    static_cast<std::uint64_t>(index_access::row_elements(loaded)) * 2;
  std::uint64_t const entries = index_access::host_entry_points(loaded, 1);
  REQUIRE(loaded.rows(1) >= detail::index::packed_entry_min_rows);
  REQUIRE(loaded.host_traversal_bytes() == (std::uint64_t{loaded.rows(1)} + entries) * row_bytes);
  REQUIRE(loaded.host_entry_bytes() == entries * 4 + entries * row_bytes * 2);
  search_params p;
  p.algo                           = search_algo::graph;
  std::vector<float> const queries = mix.draw(50);
  answers const x = run(index, queries, 1, 10, p), y = run(loaded, queries, 1, 10, p);
  REQUIRE(x.ids == y.ids);  // same rows, same graph, same walk
  loaded.set_host_traversal_dtype(dtype::float32);
  REQUIRE(index_access::host_traversal_rows(loaded, 1) == nullptr);
  REQUIRE(loaded.host_traversal_bytes() == 0);
}

TEST_CASE("float16 traversal: the walk's best entries measured again on the float32 rows",
          "[index][fast][traversal]")
{
  std::int64_t const dim = 96;
  std::uint32_t const n  = 6000;
  test::gaussian_mixture mix({dim, 60, true, 23});
  std::vector<float> const queries = mix.draw(200);
  std::vector<float> const data    = mix.draw(n);
  auto const ids                   = iota_ids(n);
  index_config c;
  c.dim = dim;
  graph_index plain{c};
  c.host_traversal_dtype = dtype::float16;
  graph_index half{c};
  for (graph_index* index : {&plain, &half}) {
    index->add(3,
               make_matrix_view<float const>(data.data(), n, dim),
               cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  }
  auto const truth = truth_of(data, queries, dim, 10);
  for (std::uint32_t ef : {10u, 24u, 64u}) {
    search_params p;
    p.algo          = search_algo::graph;
    p.itopk_size    = ef;
    answers const a = run(plain, queries, 3, 10, p), b = run(half, queries, 3, 10, p);
    double const ra = recall_of(a, truth, 10), rb = recall_of(b, truth, 10);
    std::printf(
      "float16 traversal, 6000 x 96, ef %u: recall@10 %.4f (float32 walk %.4f)\n", ef, rb, ra);
    REQUIRE(rb >= ra - 0.01);
    // each result's distance is the float32 fast distance of its row, bit for bit; sorted, unique
    std::vector<float> const prepared =
      index_access::prepare_queries(half, make_matrix_view<float const>(queries.data(), 200, dim));
    auto const fast32     = ix::fast_kernels_for<float>(distance_metric::cosine).distance;
    auto const* rows      = static_cast<float const*>(index_access::vector_rows(half, 3));
    std::int64_t const re = index_access::row_elements(half);
    for (std::size_t q = 0; q < 200; ++q) {
      std::set<std::uint64_t> seen;
      for (std::size_t j = 0; j < 10; ++j) {
        std::uint64_t const id = b.ids[q * 10 + j];
        REQUIRE(id < n);
        REQUIRE(seen.insert(id).second);
        float const want = fast32(rows + static_cast<std::int64_t>(id) * re,
                                  prepared.data() + q * static_cast<std::size_t>(re),
                                  re);
        REQUIRE(std::memcmp(&want, &b.distances[q * 10 + j], sizeof want) == 0);
        if (j > 0) { REQUIRE(b.distances[q * 10 + j - 1] <= b.distances[q * 10 + j]); }
      }
    }
  }
}

TEST_CASE("float16 traversal: the cosine error bound holds and the window changes nothing",
          "[index][fast][traversal]")
{
  std::mt19937_64 rng(99);
  std::normal_distribution<float> g(0.0f, 1.0f);
  auto const k32 = ix::fast_kernels_for<float>(distance_metric::cosine).distance;
  auto const k16 = ix::fast_kernels_for<half_t>(distance_metric::cosine).distance;
  for (std::int64_t n : {16, 384, 768, 4096}) {
    double const bound = ix::cosine_fp16_error_bound(n);
    // the first-order term is 2^-11 = 4.88e-4; the rest grows with n
    REQUIRE(bound > 0x1.0p-11);
    REQUIRE(bound < 0x1.0p-11 + 1e-3);
    double worst = 0.0;
    std::vector<float> x(static_cast<std::size_t>(n)), q(x.size());
    std::vector<half_t> xh(x.size());
    for (int trial = 0; trial < 400; ++trial) {
      // unit vectors; every fourth row concentrates its mass on one element (the largest
      // relative rounding), and a few elements are tiny (float16 subnormals)
      double nx = 0.0, nq = 0.0;
      for (std::int64_t e = 0; e < n; ++e) {
        x[e] = g(rng) * (trial % 4 == 0 && e == 0 ? 100.0f : 1.0f) * (e % 37 == 5 ? 1e-4f : 1.0f);
        q[e] = trial % 2 == 0 ? g(rng) : x[e] + 0.01f * g(rng);
        nx += double{x[e]} * x[e];
        nq += double{q[e]} * q[e];
      }
      for (std::int64_t e = 0; e < n; ++e) {
        x[e]  = static_cast<float>(x[e] / std::sqrt(nx));
        q[e]  = static_cast<float>(q[e] / std::sqrt(nq));
        xh[e] = from_float<half_t>(x[e]);
      }
      double const diff =
        std::fabs(double{k16(xh.data(), q.data(), n)} - k32(x.data(), q.data(), n));
      worst = std::max(worst, diff);
      REQUIRE(diff <= bound);
    }
    std::printf("cosine float16 bound, %lld elements: %.3g, worst seen %.3g\n",
                static_cast<long long>(n),
                bound,
                worst);
  }

  // rerank_exact with the window gives what measuring the whole list gives
  std::int64_t const re = 32;
  std::vector<float> rows(200 * re);
  for (auto& v : rows) {
    v = g(rng);
  }
  std::vector<float> query(re);
  for (auto& v : query) {
    v = g(rng);
  }
  auto const l2 = ix::fast_kernels_for<float>(distance_metric::squared_l2).distance;
  std::uniform_real_distribution<float> noise(-0.05f, 0.05f);
  for (int trial = 0; trial < 200; ++trial) {
    // an approximate list: exact distances moved by at most 0.05, sorted by the moved values
    std::vector<ix::search_entry> approx;
    for (std::uint32_t v = 0; v < 200; v += 1 + trial % 3) {
      approx.push_back({l2(rows.data() + v * re, query.data(), re) + noise(rng), v, false});
    }
    std::sort(approx.begin(), approx.end(), ix::closer{});
    std::vector<ix::search_entry> windowed, whole;
    std::uint32_t const k = 1 + trial % 12;
    ix::rerank_exact(rows.data(), re, query.data(), l2, approx, k, 0.1, windowed);
    ix::rerank_exact(
      rows.data(), re, query.data(), l2, approx, k, std::numeric_limits<double>::infinity(), whole);
    REQUIRE(whole.size() == std::min<std::size_t>(k, approx.size()));
    REQUIRE(windowed.size() == whole.size());
    for (std::size_t j = 0; j < whole.size(); ++j) {
      REQUIRE(windowed[j].node == whole[j].node);
      REQUIRE(windowed[j].distance == whole[j].distance);
    }
  }
}

TEST_CASE("float16 traversal: the exact search scans the copy and finds the float32 rows' top k",
          "[index][fast][traversal]")
{
  // Expected: brute force over each namespace's live float32 rows with the float32 fast
  // distance, sorted by (distance, row): the exact top k, ids and distance bits. Namespace 3
  // holds triples of near-duplicates (relative differences ~1e-5, below float16's 4.9e-4), which
  // the copy cannot order: only the measurement again on the float32 rows can.
  for (std::int64_t dim : {96, 384}) {
    test::gaussian_mixture mix({dim, 8, true, 31});
    std::mt19937_64 rng(7);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> const queries = mix.draw(60);
    std::vector<std::vector<float>> data{mix.draw(7), mix.draw(150), {}};
    std::vector<float> const bases = mix.draw(40);
    for (std::size_t b = 0; b < 40; ++b) {
      for (int copy = 0; copy < 3; ++copy) {
        double norm = 0.0;
        std::vector<float> row(static_cast<std::size_t>(dim));
        for (std::int64_t e = 0; e < dim; ++e) {
          row[e] = bases[b * dim + e] * (1.0f + 1e-5f * g(rng));
          norm += double{row[e]} * row[e];
        }
        for (auto& v : row) {
          data[2].push_back(static_cast<float>(v / std::sqrt(norm)));
        }
      }
    }
    index_config c;
    c.dim                  = dim;
    c.host_traversal_dtype = dtype::float16;
    graph_index index{c};
    std::vector<std::vector<std::uint64_t>> ids(3);
    for (std::uint64_t ns = 1; ns <= 3; ++ns) {
      std::size_t const n = data[ns - 1].size() / static_cast<std::size_t>(dim);
      ids[ns - 1]         = iota_ids(n, ns * 1000);
      index.add(
        ns,
        make_matrix_view<float const>(data[ns - 1].data(), static_cast<std::int64_t>(n), dim),
        cuda::std::span<std::uint64_t const>{ids[ns - 1].data(), n});
    }
    std::vector<std::uint64_t> const gone{2003, 2017, 2040, 2041, 2042, 3005};
    index.erase(cuda::std::span<std::uint64_t const>{gone.data(), gone.size()});
    std::set<std::uint64_t> const erased(gone.begin(), gone.end());

    std::vector<float> const prepared =
      index_access::prepare_queries(index, make_matrix_view<float const>(queries.data(), 60, dim));
    auto const fast32     = ix::fast_kernels_for<float>(distance_metric::cosine).distance;
    std::int64_t const re = index_access::row_elements(index);
    search_params p;
    p.algo = search_algo::exact;  // host_mode fast (the default)
    for (std::uint64_t ns = 1; ns <= 3; ++ns) {
      auto const* rows    = static_cast<float const*>(index_access::vector_rows(index, ns));
      std::size_t const n = ids[ns - 1].size();
      answers const got   = run(index, queries, ns, 10, p);
      for (std::size_t q = 0; q < 60; ++q) {
        std::vector<std::pair<float, std::uint32_t>> all;
        for (std::uint32_t r = 0; r < n; ++r) {
          if (erased.count(ids[ns - 1][r]) != 0) { continue; }
          all.push_back({fast32(rows + std::int64_t{r} * re, prepared.data() + q * re, re), r});
        }
        std::sort(all.begin(), all.end());
        for (std::size_t j = 0; j < 10; ++j) {
          if (j >= all.size()) {
            REQUIRE(got.ids[q * 10 + j] == invalid_fact_id);
            continue;
          }
          REQUIRE(got.ids[q * 10 + j] == ids[ns - 1][all[j].second]);
          REQUIRE(std::memcmp(&all[j].first, &got.distances[q * 10 + j], sizeof(float)) == 0);
        }
      }
    }
  }
}

TEST_CASE("float16 traversal: refused where it cannot apply, nothing changed",
          "[index][fast][traversal][validation]")
{
  index_config c;
  c.dim                  = 8;
  c.host_traversal_dtype = dtype::float16;
  c.vector_dtype         = dtype::float16;
  REQUIRE_THROWS_WITH(graph_index{c}, Catch::Contains("host_traversal_dtype float16 needs"));
  c.vector_dtype = dtype::float32;
  c.space        = memory_space::device;
  REQUIRE_THROWS_WITH(graph_index{c}, Catch::Contains("host-memory"));
  c.space                = memory_space::host;
  c.host_traversal_dtype = dtype::bfloat16;
  REQUIRE_THROWS_WITH(graph_index{c}, Catch::Contains("float32 or float16"));

  // an inner-product index holding a value float16 cannot represent
  c.metric               = distance_metric::inner_product;
  c.host_traversal_dtype = dtype::float32;
  graph_index index{c};
  std::vector<float> v(4 * 8, 1.0f);
  v[13]          = 1e5f;
  auto const ids = iota_ids(4);
  index.add(1,
            make_matrix_view<float const>(v.data(), 4, 8),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  std::uint64_t const version = index.version();
  REQUIRE_THROWS_WITH(index.set_host_traversal_dtype(dtype::float16),
                      Catch::Contains("fact id 1 overflows float16 at element 5"));
  REQUIRE(index.config().host_traversal_dtype == dtype::float32);
  REQUIRE(index.version() == version);
  REQUIRE(index_access::host_traversal_rows(index, 1) == nullptr);

  // under float16 traversal, such a vector is refused at add
  c.host_traversal_dtype = dtype::float16;
  graph_index half{c};
  REQUIRE_THROWS_WITH(half.add(1,
                               make_matrix_view<float const>(v.data(), 4, 8),
                               cuda::std::span<std::uint64_t const>{ids.data(), ids.size()}),
                      Catch::Contains("host_traversal_dtype float16"));
  REQUIRE(half.num_namespaces() == 0);
  REQUIRE(half.version() == 0);
}
