/**
 * @file index_degenerate.cpp
 * @brief Degenerate vectors (issue 49) through every metric, both dtypes and every host search
 * path, against brute force in long double: all zeros, float32 denormals, the largest finite
 * values, duplicates of one vector, namespaces whose rows are all identical. No search returns a
 * NaN or infinite distance, an id twice, an id of another namespace, or a set farther than the
 * true top k; what the index refuses (NaN and infinite elements, a zero vector under cosine, a
 * squared norm above 1e30 under inner product and squared L2) throws before anything is written.
 * The device kernel's query preparation and distance order (shared __host__ __device__ code) run
 * here on the CPU and must give the host search's bits.
 */
#include <inferscale/detail/index/math.hpp>
#include <inferscale/index.hpp>

#include <degenerate_vectors.hpp>
#include <float_bits.hpp>
#include <index_answers.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

using namespace inferscale;
using inferscale_test::bits_of;

namespace {

/// What the index stores for `v`: normalised in long double (cosine), rounded to float, then
/// to the dtype.
std::vector<float> stored_row(float const* v, std::int64_t dim, distance_metric m, dtype t)
{
  long double norm2 = 0;
  for (std::int64_t e = 0; e < dim; ++e) { norm2 += static_cast<long double>(v[e]) * v[e]; }
  long double const scale = m == distance_metric::cosine ? 1.0L / std::sqrt(norm2) : 1.0L;
  std::vector<float> out(static_cast<std::size_t>(dim));
  for (std::int64_t e = 0; e < dim; ++e) {
    float const x = static_cast<float>(v[e] * scale);
    out[static_cast<std::size_t>(e)] = t == dtype::float16 ? to_float(from_float<half_t>(x)) : x;
  }
  return out;
}

/// A distance by definition in long double, and how far a float32 computation may be from it.
struct reference {
  long double distance;
  long double tolerance;
};

reference reference_distance(std::vector<float> const& q, std::vector<float> const& x,
                             distance_metric m)
{
  long double dot = 0, l2 = 0, qq = 0, xx = 0;
  for (std::size_t e = 0; e < q.size(); ++e) {
    long double const a = q[e], b = x[e];
    dot += a * b;
    l2 += (a - b) * (a - b);
    qq += a * a;
    xx += b * b;
  }
  // float32 sums of 20 products, plus the query's own rounding: well inside 1e-5 of the scale;
  // a floor for the results that underflow float32 (denormal rows under squared L2)
  long double const scale = m == distance_metric::squared_l2
                              ? (std::sqrt(qq) + std::sqrt(xx)) * (std::sqrt(qq) + std::sqrt(xx))
                              : std::sqrt(qq) * std::sqrt(xx);
  long double const tolerance = 1e-5L * scale + 1e-36L;
  switch (m) {
    case distance_metric::inner_product: return {-dot, tolerance};
    case distance_metric::cosine: return {1 - dot, tolerance};
    case distance_metric::squared_l2: return {l2, tolerance};
  }
  return {0, 0};
}

struct namespace_rows {
  std::uint64_t ns;
  std::vector<float> const* rows;
  std::uint64_t first_id;
};

/// Every answer of `got` (queries `[nq][dim]`, `k` per query) against brute force over the
/// namespace's rows as stored.
void check_answers(test::degenerate_set const& set, namespace_rows const& nsr,
                   test::answers const& got, std::uint32_t k, distance_metric m, dtype t)
{
  std::int64_t const dim = set.dim;
  std::int64_t const n   = set.rows(*nsr.rows);
  std::vector<std::vector<float>> stored;
  for (std::int64_t r = 0; r < n; ++r) {
    stored.push_back(stored_row(nsr.rows->data() + r * dim, dim, m, t));
  }
  std::int64_t const nq = set.rows(set.queries);
  for (std::int64_t q = 0; q < nq; ++q) {
    std::string const& name = set.query_names[static_cast<std::size_t>(q)];
    CAPTURE(nsr.ns, q, name);
    // the query as the search compares it: normalised (cosine), never rounded to float16
    std::vector<float> const query =
      stored_row(set.queries.data() + q * dim, dim, m, dtype::float32);
    std::vector<reference> all;
    for (auto const& row : stored) { all.push_back(reference_distance(query, row, m)); }
    std::vector<reference> returned;
    std::set<std::uint64_t> seen;
    for (std::uint32_t j = 0; j < k; ++j) {
      std::uint64_t const id = got.ids[static_cast<std::size_t>(q * k + j)];
      float const d          = got.distances[static_cast<std::size_t>(q * k + j)];
      CAPTURE(j, id, d);
      REQUIRE(std::isfinite(d));
      REQUIRE(id >= nsr.first_id);
      REQUIRE(id < nsr.first_id + static_cast<std::uint64_t>(n));  // this namespace's
      REQUIRE(seen.insert(id).second);                             // never twice
      reference const ref = all[static_cast<std::size_t>(id - nsr.first_id)];
      CAPTURE(static_cast<double>(ref.distance), static_cast<double>(ref.tolerance));
      REQUIRE(std::fabs(static_cast<long double>(d) - ref.distance) <= ref.tolerance);
      if (j > 0) { REQUIRE(got.distances[static_cast<std::size_t>(q * k + j - 1)] <= d); }
      returned.push_back(ref);
    }
    // the j-th nearest returned is no farther than the j-th nearest of all (to rounding)
    auto by_distance = [](reference const& a, reference const& b) {
      return a.distance < b.distance;
    };
    std::sort(all.begin(), all.end(), by_distance);
    std::sort(returned.begin(), returned.end(), by_distance);
    for (std::uint32_t j = 0; j < k; ++j) {
      CAPTURE(j);
      REQUIRE(returned[j].distance <= all[j].distance + all[j].tolerance + returned[j].tolerance);
    }
  }
}

struct search_path {
  char const* name;
  search_params params;
};

std::vector<search_path> search_paths()
{
  std::vector<search_path> paths;
  for (auto mode : {host_search_mode::fast, host_search_mode::reference}) {
    for (auto algo : {search_algo::exact, search_algo::graph}) {
      search_params p;
      p.host_mode = mode;
      p.algo      = algo;
      bool const fast = mode == host_search_mode::fast;
      bool const exact = algo == search_algo::exact;
      paths.push_back({fast ? (exact ? "fast exact" : "fast graph")
                            : (exact ? "reference exact" : "reference graph"),
                       p});
    }
  }
  search_params split;
  split.host_mode      = host_search_mode::reference;
  split.algo           = search_algo::graph;
  split.ctas_per_query = 2;
  paths.push_back({"reference graph, split in 2", split});
  return paths;
}

void add_rows(graph_index& index, std::uint64_t ns, std::vector<float> const& rows,
              std::uint64_t first_id)
{
  std::int64_t const n = static_cast<std::int64_t>(rows.size()) / index.dim();
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < n; ++r) { ids[static_cast<std::size_t>(r)] = first_id + r; }
  index.add(ns, make_matrix_view(rows.data(), n, index.dim()),
            cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
}

struct index_case {
  distance_metric metric;
  dtype vector_dtype;
  bool fp16_traversal;
};

std::vector<index_case> index_cases()
{
  std::vector<index_case> cases;
  for (auto m : {distance_metric::inner_product, distance_metric::cosine,
                 distance_metric::squared_l2}) {
    cases.push_back({m, dtype::float32, false});
    cases.push_back({m, dtype::float16, false});
  }
  cases.push_back({distance_metric::cosine, dtype::float32, true});  // the float16 walk, reranked
  return cases;
}

index_config config_for(index_case const& c, std::int64_t dim)
{
  index_config cfg;
  cfg.dim          = dim;
  cfg.metric       = c.metric;
  cfg.vector_dtype = c.vector_dtype;
  if (c.fp16_traversal) { cfg.host_traversal_dtype = dtype::float16; }
  return cfg;
}

}  // namespace

TEST_CASE("index: degenerate vectors - every metric, dtype and host search path against brute "
          "force, never NaN",
          "[index][degenerate]")
{
  for (index_case const& c : index_cases()) {
    CAPTURE(to_string(c.metric), to_string(c.vector_dtype), c.fp16_traversal);
    test::degenerate_set const set = test::make_degenerate_set(c.metric, c.vector_dtype);
    graph_index index(config_for(c, set.dim));
    std::vector<namespace_rows> const spaces{{1, &set.mixed, 1000},
                                             {2, &set.identical, 2000},
                                             {3, &set.degenerate_identical, 3000}};
    for (auto const& s : spaces) { add_rows(index, s.ns, *s.rows, s.first_id); }
    std::uint32_t const k = 8;
    for (search_path const& path : search_paths()) {
      CAPTURE(path.name);
      for (auto const& s : spaces) {
        check_answers(set, s, test::run_search(index, set.queries, {s.ns}, k, path.params), k,
                      c.metric, c.vector_dtype);
      }
      // k above a namespace's size: the extra slots are empty (invalid id, +inf), never NaN
      auto const all = test::run_search(index, set.queries, {3}, 15, path.params);
      for (std::size_t at = 0; at < all.ids.size(); ++at) {
        CAPTURE(at);
        bool const empty = at % 15 >= 12;
        REQUIRE((all.ids[at] == invalid_fact_id) == empty);
        REQUIRE((all.distances[at] == std::numeric_limits<float>::infinity()) == empty);
      }
    }
    // a namespace of identical rows answers with distinct facts, all at the same distance (the
    // reference mode: one distance function; the fast mode's block and single-row kernels may
    // round one pair differently, within the tolerance checked above)
    search_params reference;
    reference.host_mode = host_search_mode::reference;
    auto const same     = test::run_search(index, set.queries, {2}, k, reference);
    for (std::size_t q = 0; q * k < same.ids.size(); ++q) {
      for (std::uint32_t j = 1; j < k; ++j) {
        REQUIRE(bits_of(same.distances[q * k + j]) == bits_of(same.distances[q * k]));
      }
    }
  }
}

TEST_CASE("index: the device's query preparation and distance order, run on the CPU, give the "
          "host's bits on degenerate vectors",
          "[index][degenerate]")
{
  for (index_case const& c : index_cases()) {
    if (c.fp16_traversal) { continue; }
    CAPTURE(to_string(c.metric), to_string(c.vector_dtype));
    test::degenerate_set const set = test::make_degenerate_set(c.metric, c.vector_dtype);
    std::int64_t const dim         = set.dim;
    graph_index index(config_for(c, dim));
    add_rows(index, 1, set.mixed, 1000);
    std::int64_t const row_elements = detail::index::padded_dim(dim, size_of(c.vector_dtype));
    std::int64_t const chunks =
      row_elements / (c.vector_dtype == dtype::float16 ? detail::index::chunk_elements<half_t>
                                                       : detail::index::chunk_elements<float>);
    int const team = detail::index::team_size_for(chunks);
    for (std::int64_t q = 0; q < set.rows(set.queries); ++q) {
      CAPTURE(q, set.query_names[static_cast<std::size_t>(q)]);
      std::vector<float> raw(set.queries.begin() + q * dim, set.queries.begin() + (q + 1) * dim);
      // prepare_query's steps as the kernel takes them: 32 lanes' double partials, the warp's
      // butterfly, lane 0's verdict and scale, each element normalised
      std::vector<float> padded(static_cast<std::size_t>(row_elements), 0.0f);
      std::copy(raw.begin(), raw.end(), padded.begin());
      double lanes[32];
      for (int l = 0; l < 32; ++l) { lanes[l] = detail::index::lane_norm2(padded.data(), dim, l); }
      for (int o = 16; o >= 1; o /= 2) {
        double next[32];
        for (int l = 0; l < 32; ++l) { next[l] = lanes[l] + lanes[l ^ o]; }
        std::copy(next, next + 32, lanes);
      }
      bool const cosine = c.metric == distance_metric::cosine;
      bool const bad    = cosine ? !(lanes[0] > 0.0) : lanes[0] > 1e30;
      REQUIRE_FALSE(bad);  // every query of the set is one the index accepts
      if (cosine) {
        double const scale = detail::index::cosine_scale(lanes[0]);
        for (std::int64_t e = 0; e < dim; ++e) {
          padded[static_cast<std::size_t>(e)] =
            detail::index::cosine_normalised(padded[static_cast<std::size_t>(e)], scale);
        }
      }
      // against the definition (x / |x| in long double: within one rounding), finite
      std::vector<float> const expected = stored_row(raw.data(), dim, c.metric, dtype::float32);
      for (std::int64_t e = 0; e < dim; ++e) {
        float const got = padded[static_cast<std::size_t>(e)];
        CAPTURE(e, got, expected[static_cast<std::size_t>(e)]);
        REQUIRE(std::isfinite(got));
        REQUIRE(std::fabs(got - expected[static_cast<std::size_t>(e)]) <=
                std::ldexp(std::fabs(expected[static_cast<std::size_t>(e)]), -23) +
                  std::numeric_limits<float>::denorm_min());
      }
      // the host's prepared query is the device's, bit for bit
      std::vector<float> const host =
        index.prepare_queries(make_matrix_view<float const>(raw.data(), 1, dim));
      REQUIRE(host.size() == padded.size());
      for (std::size_t e = 0; e < host.size(); ++e) {
        CAPTURE(e);
        REQUIRE(bits_of(host[e]) == bits_of(padded[e]));
      }
      // the reference-mode exact search's distances are the kernel's lane order's, bit for bit
      search_params p;
      p.host_mode                 = host_search_mode::reference;
      p.algo                      = search_algo::exact;
      std::uint32_t const k       = 8;
      auto const got              = test::run_search(index, raw, {1}, k, p);
      std::uint64_t const* ids    = index.id_rows(1);
      std::uint32_t const n       = index.rows(1);
      for (std::uint32_t j = 0; j < k; ++j) {
        std::uint32_t const local =
          static_cast<std::uint32_t>(std::find(ids, ids + n, got.ids[j]) - ids);
        REQUIRE(local < n);
        float const lane_order =
          c.vector_dtype == dtype::float16
            ? detail::index::team_distance_by_lane(
                static_cast<half_t const*>(index.vector_rows(1)) + local * row_elements,
                padded.data(), chunks, team, c.metric)
            : detail::index::team_distance_by_lane(
                static_cast<float const*>(index.vector_rows(1)) + local * row_elements,
                padded.data(), chunks, team, c.metric);
        CAPTURE(j, got.distances[j], lane_order);
        REQUIRE(std::isfinite(lane_order));
        REQUIRE(bits_of(lane_order) == bits_of(got.distances[j]));
      }
    }
  }
}

TEST_CASE("index: degenerate vectors the metric cannot take are refused at add and search, "
          "nothing written",
          "[index][degenerate][validation]")
{
  float const nan = std::numeric_limits<float>::quiet_NaN();
  float const inf = std::numeric_limits<float>::infinity();
  for (auto m : {distance_metric::inner_product, distance_metric::cosine,
                 distance_metric::squared_l2}) {
    CAPTURE(to_string(m));
    test::degenerate_set const set = test::make_degenerate_set(m, dtype::float32);
    std::int64_t const dim         = set.dim;
    graph_index index(config_for({m, dtype::float32, false}, dim));
    add_rows(index, 1, set.mixed, 1000);
    std::uint64_t const version = index.version();
    std::uint64_t const size    = index.total_size();
    auto const before           = test::run_search(index, set.queries, {1}, 8, search_params{});

    // each bad row is the second of a batch of three ordinary rows
    std::vector<std::pair<std::string, std::vector<float>>> bad_rows;
    for (float x : {nan, inf, -inf}) {
      std::vector<float> v(static_cast<std::size_t>(dim), 0.5f);
      v[5] = x;
      bad_rows.push_back({"NaN or infinite", v});
    }
    if (m == distance_metric::cosine) {
      bad_rows.push_back({"zero", std::vector<float>(static_cast<std::size_t>(dim), 0.0f)});
      bad_rows.push_back({"zero", std::vector<float>(static_cast<std::size_t>(dim), -0.0f)});
    } else {
      std::vector<float> v(static_cast<std::size_t>(dim), 0.0f);
      v[0] = 1.01e15f;  // squared 1.02e30
      bad_rows.push_back({"overflow", v});
      v[0] = std::numeric_limits<float>::max();
      bad_rows.push_back({"overflow", v});
    }
    for (auto const& [what, row] : bad_rows) {
      CAPTURE(what);
      std::vector<float> batch(set.mixed.begin(), set.mixed.begin() + dim);
      batch.insert(batch.end(), row.begin(), row.end());
      batch.insert(batch.end(), set.mixed.begin() + dim, set.mixed.begin() + 2 * dim);
      for (std::uint64_t ns : {1, 9}) {  // an existing namespace, and a new one
        REQUIRE_THROWS_WITH(add_rows(index, ns, batch, 9000), Catch::Contains(what));
      }
      // the same vector as the second of two queries: refused, outputs untouched
      std::vector<float> queries(set.queries.begin(), set.queries.begin() + dim);
      queries.insert(queries.end(), row.begin(), row.end());
      std::vector<std::uint64_t> ids(16, 42);
      std::vector<float> distances(16, 4.2f);
      std::uint64_t const ns = 1;
      REQUIRE_THROWS_WITH(
        inferscale::search(index, make_matrix_view<float const>(queries.data(), 2, dim),
                           cuda::std::span<std::uint64_t const>{&ns, 1}, 8, search_params{},
                           make_matrix_view(ids.data(), 2, 8),
                           make_matrix_view(distances.data(), 2, 8)),
        Catch::Contains(what));
      REQUIRE(std::all_of(ids.begin(), ids.end(), [](std::uint64_t v) { return v == 42; }));
      REQUIRE(std::all_of(distances.begin(), distances.end(), [](float v) { return v == 4.2f; }));
    }
    REQUIRE(index.version() == version);
    REQUIRE(index.total_size() == size);
    REQUIRE_FALSE(index.has_namespace(9));
    REQUIRE_FALSE(index.contains(9000));
    auto const after = test::run_search(index, set.queries, {1}, 8, search_params{});
    REQUIRE(after.ids == before.ids);
  }
}
