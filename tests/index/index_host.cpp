/**
 * @file index_host.cpp
 * @brief The fact index's host backend against expectations written here: brute-force nearest
 * neighbours in double precision, a breadth-first search for reachability, detour counts by
 * definition, and the stated contracts of insert, delete, compaction, tenants and refusals.
 */
#include <inferscale/index.hpp>

#include <catch2/catch.hpp>

#include <degenerate_vectors.hpp>
#include <float_bits.hpp>
#include <gaussian_mixture.hpp>
#include <index_answers.hpp>
#include <index_reference.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

using namespace inferscale;
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using inferscale::detail::index::index_access;
using inferscale::detail::index::invalid_node;

// -------------------------------------------------------------------------------------------------
// graph_index's public surface (issue 50): what a user calls (construction, properties, sizes,
// add / build / erase / erase_namespace / compact / set_host_traversal_dtype) is public; searches
// are the free `inferscale::search`; the backends' plumbing is private and reached only through
// `detail::index::index_access`. Checked from outside the class, where access applies: each
// concept holds iff the call compiles here.

namespace surface {

using ids_view      = matrix_view<std::uint64_t>;
using distance_view = matrix_view<float>;
using query_view    = matrix_view<float const>;
using ns_span       = cuda::std::span<std::uint64_t const>;

// the plumbing, called as the members it was
template <class I>
concept member_row_elements = requires(I const& i)
{
  i.row_elements();
};
template <class I>
concept member_graph_degree = requires(I const& i)
{
  i.graph_degree();
};
template <class I>
concept member_uses_nn_descent = requires(I const& i)
{
  i.uses_nn_descent(1u);
};
template <class I>
concept member_last_nn_descent = requires(I const& i)
{
  i.last_nn_descent();
};
template <class I>
concept member_host_entry_points = requires(I const& i)
{
  i.host_entry_points(std::uint64_t{});
};
template <class I>
concept member_host_default_ef = requires(I const& i)
{
  i.host_default_ef(std::uint64_t{});
};
template <class I>
concept member_host_traversal_rows = requires(I const& i)
{
  i.host_traversal_rows(std::uint64_t{});
};
template <class I>
concept member_arena_rows_in_use = requires(I const& i)
{
  i.arena_rows_in_use();
};
template <class I>
concept member_max_arena_rows = requires(I const& i)
{
  i.max_arena_rows();
};
template <class I>
concept member_compactions = requires(I const& i)
{
  i.compactions();
};
template <class I>
concept member_tenant_segment = requires(I const& i)
{
  i.tenant_segment(std::uint64_t{});
};
template <class I>
concept member_tenant_table = requires(I const& i)
{
  i.tenant_table();
};
template <class I>
concept member_graph_rows = requires(I const& i)
{
  i.graph_rows(std::uint64_t{});
};
template <class I>
concept member_vector_rows = requires(I const& i)
{
  i.vector_rows(std::uint64_t{});
};
template <class I>
concept member_id_rows = requires(I const& i)
{
  i.id_rows(std::uint64_t{});
};
template <class I>
concept member_deleted_rows = requires(I const& i)
{
  i.deleted_rows(std::uint64_t{});
};
template <class I>
concept member_ref = requires(I const& i)
{
  i.ref();
};
template <class I>
concept member_plan_for = requires(I const& i, search_params const& p)
{
  i.plan_for(1u, 1u, p);
};
template <class I>
concept member_resolve_split = requires(search_params const& p)
{
  I::resolve_split(p, std::int64_t{1}, 1u);
};
template <class I>
concept member_split_part = requires(search_params const& p)
{
  I::split_part(p, 1u, 0u);
};
template <class I>
concept member_uses_exact = requires(I const& i, search_params const& p)
{
  i.uses_exact(detail::index::tenant_ref{}, p);
};
template <class I>
concept member_prepare_queries = requires(I const& i, query_view q)
{
  i.prepare_queries(q);
};
template <class I>
concept member_check_search = requires(I const& i, query_view q, ns_span ns, search_params p)
{
  i.check_search(q, ns, 1u, p, std::int64_t{}, std::int64_t{}, std::int64_t{}, std::int64_t{});
};
template <class I>
concept member_tenant_ref = requires
{
  typename I::tenant_ref;
};
template <class I>
concept member_packed_entry_min_rows = requires
{
  I::packed_entry_min_rows;
};
// the member search that wrapped the free one is gone (one search entry point)
template <class I>
concept member_search =
  requires(I const& i, query_view q, ns_span ns, search_params p, ids_view ids, distance_view d)
{
  i.search(q, ns, 1u, p, ids, d);
};
template <class I>
concept member_search_template =
  requires(I const& i, query_view q, ns_span ns, search_params p, ids_view ids, distance_view d)
{
  i.template search<float>(q, ns, 1u, p, ids, d);
};

static_assert(!member_row_elements<graph_index> && !member_graph_degree<graph_index> &&
              !member_uses_nn_descent<graph_index> && !member_last_nn_descent<graph_index> &&
              !member_host_entry_points<graph_index> && !member_host_default_ef<graph_index> &&
              !member_host_traversal_rows<graph_index> && !member_arena_rows_in_use<graph_index> &&
              !member_max_arena_rows<graph_index> && !member_compactions<graph_index>);
static_assert(!member_tenant_segment<graph_index> && !member_tenant_table<graph_index> &&
              !member_graph_rows<graph_index> && !member_vector_rows<graph_index> &&
              !member_id_rows<graph_index> && !member_deleted_rows<graph_index> &&
              !member_ref<graph_index> && !member_tenant_ref<graph_index> &&
              !member_packed_entry_min_rows<graph_index>);
static_assert(!member_plan_for<graph_index> && !member_resolve_split<graph_index> &&
              !member_split_part<graph_index> && !member_uses_exact<graph_index> &&
              !member_prepare_queries<graph_index> && !member_check_search<graph_index>);
static_assert(!member_search<graph_index> && !member_search_template<graph_index>);

// The same kind of check sees what stays public (so the negatives above are not vacuous) ...
template <class I>
concept user_surface = requires(I& i,
                                I const& c,
                                query_view q,
                                ns_span ns,
                                search_params p,
                                ids_view ids,
                                distance_view d,
                                graph_builder const& b)
{
  c.config();
  c.dim();
  c.space();
  c.version();
  c.exact_search_threshold(p, 1u);
  c.num_namespaces();
  c.namespaces();
  c.has_namespace(std::uint64_t{});
  c.size(std::uint64_t{});
  c.total_size();
  c.contains(std::uint64_t{});
  c.namespace_of(std::uint64_t{});
  c.ids(std::uint64_t{});
  c.rows(std::uint64_t{});
  c.arena_rows();
  c.arena_bytes();
  c.host_traversal_bytes();
  c.host_entry_bytes();
  i.add(std::uint64_t{}, q, ns, b);
  i.build(std::uint64_t{}, q, ns, b);
  i.erase(ns, b);
  i.erase_namespace(std::uint64_t{}, b);
  i.compact(b);
  i.set_host_traversal_dtype(dtype::float16);
  inferscale::search(c, q, ns, 1u, p, ids, d);
};
static_assert(user_surface<graph_index>);
static_assert(std::is_nothrow_move_constructible_v<graph_index> &&
              !std::is_copy_constructible_v<graph_index> &&
              !std::is_copy_assignable_v<graph_index>);

// ... and the detail accessor still reaches the plumbing the library's own code needs.
template <class A>
concept accessor_surface = requires(graph_index const& i, query_view q, ns_span ns, search_params p)
{
  A::row_elements(i);
  A::graph_degree(i);
  A::uses_nn_descent(i, 1u);
  A::last_nn_descent(i);
  A::host_entry_points(i, std::uint64_t{});
  A::host_default_ef(i, std::uint64_t{});
  A::host_traversal_rows(i, std::uint64_t{});
  A::arena_rows_in_use(i);
  A::max_arena_rows(i);
  A::compactions(i);
  A::tenant_segment(i, std::uint64_t{});
  A::tenant_table(i);
  A::graph_rows(i, std::uint64_t{});
  A::vector_rows(i, std::uint64_t{});
  A::id_rows(i, std::uint64_t{});
  A::deleted_rows(i, std::uint64_t{});
  A::ref(i);
  A::plan_for(i, 1u, 1u, p);
  A::resolve_split(p, std::int64_t{1}, 1u);
  A::split_part(p, 1u, 0u);
  A::uses_exact(i, detail::index::tenant_ref{}, p);
  A::prepare_queries(i, q);
  A::check_search(i, q, ns, 1u, p, std::int64_t{}, std::int64_t{}, std::int64_t{}, std::int64_t{});
};
static_assert(accessor_surface<index_access>);

}  // namespace surface

namespace {

using test::answers;
using test::run_search;

constexpr std::uint32_t k10 = 10;

/// Distance by definition, in double, on the vectors as the index stores them (rounded to the
/// index dtype, normalised for cosine).
double reference_distance(std::vector<float> const& a,
                          std::vector<float> const& b,
                          distance_metric m)
{
  return test::reference_distance(a.data(), b.data(), static_cast<std::int64_t>(a.size()), m);
}

/// What the index stores for a vector: normalised (cosine) in double, then rounded to the dtype.
std::vector<float> as_stored(float const* v, std::int64_t dim, distance_metric m, dtype t)
{
  double norm2 = 0.0;
  for (std::int64_t e = 0; e < dim; ++e) {
    norm2 += double{v[e]} * v[e];
  }
  double const scale = m == distance_metric::cosine ? 1.0 / std::sqrt(norm2) : 1.0;
  std::vector<float> out(static_cast<std::size_t>(dim));
  for (std::int64_t e = 0; e < dim; ++e) {
    float const x                    = static_cast<float>(v[e] * scale);
    out[static_cast<std::size_t>(e)] = t == dtype::float16 ? to_float(from_float<half_t>(x)) : x;
  }
  return out;
}

/// Brute-force k nearest (by double distance, ties by position) among `rows` for each query.
std::vector<std::vector<std::pair<double, std::size_t>>> brute_force(
  std::vector<std::vector<float>> const& rows,
  std::vector<std::vector<float>> const& queries,
  distance_metric m,
  std::size_t k)
{
  std::vector<std::vector<std::pair<double, std::size_t>>> out;
  for (auto const& q : queries) {
    std::vector<std::pair<double, std::size_t>> all;
    for (std::size_t r = 0; r < rows.size(); ++r) {
      all.emplace_back(reference_distance(rows[r], q, m), r);
    }
    std::size_t const keep = std::min(k, all.size());
    std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(keep), all.end());
    all.resize(keep);
    out.push_back(all);
  }
  return out;
}

std::vector<std::vector<float>> split_rows(std::vector<float> const& flat, std::int64_t dim)
{
  std::vector<std::vector<float>> rows;
  for (std::size_t i = 0; i < flat.size(); i += static_cast<std::size_t>(dim)) {
    rows.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(i),
                      flat.begin() + static_cast<std::ptrdiff_t>(i) + dim);
  }
  return rows;
}

std::vector<std::uint64_t> sequential_ids(std::size_t n, std::uint64_t first, std::uint64_t step)
{
  std::vector<std::uint64_t> ids(n);
  for (std::size_t i = 0; i < n; ++i) {
    ids[i] = first + i * step;
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

/// recall@k of `got` (fact ids) against the true neighbours (positions mapped through `ids`).
double recall(answers const& got,
              std::vector<std::vector<std::pair<double, std::size_t>>> const& truth,
              std::vector<std::uint64_t> const& ids,
              std::uint32_t k)
{
  std::size_t hits = 0;
  for (std::size_t q = 0; q < truth.size(); ++q) {
    std::set<std::uint64_t> want;
    for (auto const& t : truth[q]) {
      want.insert(ids[t.second]);
    }
    for (std::uint32_t j = 0; j < k; ++j) {
      hits += want.count(got.ids[q * k + j]);
    }
  }
  return static_cast<double>(hits) / static_cast<double>(truth.size() * k);
}

/// Nodes reachable from node 0, by a breadth-first search written here.
std::size_t reachable_count(graph_index const& index, std::uint64_t ns)
{
  std::uint32_t const n      = index.rows(ns);
  std::uint32_t const d      = index_access::graph_degree(index);
  std::uint32_t const* graph = index_access::graph_rows(index, ns);
  std::vector<bool> seen(n, false);
  std::vector<std::uint32_t> frontier{0};
  seen[0]           = true;
  std::size_t count = 1;
  while (!frontier.empty()) {
    std::uint32_t const v = frontier.back();
    frontier.pop_back();
    for (std::uint32_t r = 0; r < d; ++r) {
      std::uint32_t const t = graph[std::size_t{v} * d + r];
      if (t != invalid_node && !seen[t]) {
        seen[t] = true;
        ++count;
        frontier.push_back(t);
      }
    }
  }
  return count;
}

/// Structural checks of every graph row: ids in range, no self loops, no repeats.
void check_rows_well_formed(graph_index const& index, std::uint64_t ns)
{
  std::uint32_t const n      = index.rows(ns);
  std::uint32_t const d      = index_access::graph_degree(index);
  std::uint32_t const* graph = index_access::graph_rows(index, ns);
  for (std::uint32_t v = 0; v < n; ++v) {
    std::set<std::uint32_t> row;
    for (std::uint32_t r = 0; r < d; ++r) {
      std::uint32_t const t = graph[std::size_t{v} * d + r];
      if (t == invalid_node) { continue; }
      CAPTURE(v, r, t);
      REQUIRE(t < n);
      REQUIRE(t != v);
      REQUIRE(row.insert(t).second);
    }
  }
}

}  // namespace

TEST_CASE("index: exact search equals a brute-force loop for every metric and dtype", "[index]")
{
  auto const metric =
    GENERATE(distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2);
  auto const vdtype      = GENERATE(dtype::float32, dtype::float16);
  std::int64_t const dim = GENERATE(as<std::int64_t>{}, 3, 100, 384);
  CAPTURE(to_string(metric), to_string(vdtype), dim);

  test::gaussian_mixture mix({dim, 20, metric != distance_metric::squared_l2, 7});
  std::size_t const n = 700;
  auto const data     = mix.draw(static_cast<std::int64_t>(n));
  auto const queries  = mix.draw(25);
  auto const ids      = sequential_ids(n, 5, 3);

  index_config cfg;
  cfg.dim          = dim;
  cfg.metric       = metric;
  cfg.vector_dtype = vdtype;
  graph_index index(cfg);
  add_all(index, 9, data, ids);

  std::vector<std::vector<float>> stored;
  for (std::size_t i = 0; i < n; ++i) {
    stored.push_back(as_stored(data.data() + i * dim, dim, metric, vdtype));
  }
  std::vector<std::vector<float>> qs;
  for (std::size_t q = 0; q < 25; ++q) {
    qs.push_back(as_stored(queries.data() + q * dim, dim, metric, dtype::float32));
  }
  std::uint32_t const k = 15;
  auto const truth      = brute_force(stored, qs, metric, k);
  search_params p;
  p.algo         = search_algo::exact;
  auto const got = run_search(index, queries, {9}, k, p);

  for (std::size_t q = 0; q < qs.size(); ++q) {
    for (std::uint32_t j = 0; j < k; ++j) {
      CAPTURE(q, j);
      double const want = truth[q][j].first;
      // fp32 accumulation of up to 384 products: within 1e-5 relative to the operands' scale
      double const scale =
        metric == distance_metric::squared_l2 ? std::max(1.0, std::abs(want)) : 1.0;
      REQUIRE(std::abs(got.distances[q * k + j] - want) <= 2e-5 * scale);
      if (got.ids[q * k + j] != ids[truth[q][j].second]) {
        // a swap is only allowed between near-ties
        auto const pos = std::find(ids.begin(), ids.end(), got.ids[q * k + j]) - ids.begin();
        double const d = reference_distance(stored[static_cast<std::size_t>(pos)], qs[q], metric);
        REQUIRE(std::abs(d - want) <= 4e-5 * scale);
      }
    }
    // sorted by distance
    REQUIRE(std::is_sorted(got.distances.begin() + static_cast<std::ptrdiff_t>(q * k),
                           got.distances.begin() + static_cast<std::ptrdiff_t>((q + 1) * k)));
  }
}

TEST_CASE("index: recall@10 >= 0.95 against exact search on Gaussian mixtures", "[index][recall]")
{
  struct scenario {
    std::int64_t dim;
    std::size_t n;
    dtype vdtype;
  };
  auto const s = GENERATE(scenario{384, 20000, dtype::float32},
                          scenario{768, 10000, dtype::float32},
                          scenario{384, 10000, dtype::float16});
  CAPTURE(s.dim, s.n, to_string(s.vdtype));
  test::gaussian_mixture mix({s.dim, 200, true, 11});
  auto const data    = mix.draw(static_cast<std::int64_t>(s.n));
  auto const queries = mix.draw(200);
  auto const ids     = sequential_ids(s.n, 1, 1);

  index_config cfg;
  cfg.dim          = s.dim;
  cfg.metric       = distance_metric::cosine;
  cfg.vector_dtype = s.vdtype;
  graph_index index(cfg);  // graph_degree 32, intermediate 64
  add_all(index, 0, data, ids);

  REQUIRE(reachable_count(index, 0) == s.n);
  check_rows_well_formed(index, 0);

  std::vector<std::vector<float>> stored, qs;
  for (std::size_t i = 0; i < s.n; ++i) {
    stored.push_back(as_stored(data.data() + i * s.dim, s.dim, cfg.metric, s.vdtype));
  }
  for (std::size_t q = 0; q < 200; ++q) {
    qs.push_back(as_stored(queries.data() + q * s.dim, s.dim, cfg.metric, dtype::float32));
  }
  auto const truth = brute_force(stored, qs, cfg.metric, k10);

  search_params p;  // the stated parameters: itopk 64, width 1, 8 samplings, automatic bound
  p.algo = search_algo::graph;
  for (auto mode : {host_search_mode::fast, host_search_mode::reference}) {
    p.host_mode    = mode;
    auto const got = run_search(index, queries, {0}, k10, p);
    double const r = recall(got, truth, ids, k10);
    CAPTURE(static_cast<int>(mode), r);
    CHECK(r >= 0.95);
  }
  p.host_mode = host_search_mode::reference;
  // one sampling per seed slot is the cuVS default that issue #2102 reports as weak; it stays
  // answerable, just less accurate (not asserted beyond validity)
  p.num_random_samplings = 1;
  auto const weak        = run_search(index, queries, {0}, k10, p);
  for (auto id : weak.ids) {
    REQUIRE(id <= s.n);
  }
}

TEST_CASE("index: a split search (ctas_per_query) answers the best distinct facts of its parts",
          "[index][split]")
{
  std::int64_t const dim = 64;
  test::gaussian_mixture mix({dim, 20, true, 5});
  std::size_t const n = 3000;
  auto const data     = mix.draw(static_cast<std::int64_t>(n));
  auto const queries  = mix.draw(60);
  auto const ids      = sequential_ids(n, 1, 1);
  index_config cfg;
  cfg.dim    = dim;
  cfg.metric = distance_metric::cosine;
  graph_index index(cfg);
  add_all(index, 0, data, ids);
  std::vector<std::uint64_t> erased;  // deleted facts must stay out of every part's answer
  for (std::uint64_t id = 3; id <= n; id += 7) {
    erased.push_back(id);
  }
  index.erase(cuda::std::span<std::uint64_t const>{erased.data(), erased.size()});
  std::set<std::uint64_t> const gone(erased.begin(), erased.end());

  std::vector<std::vector<float>> stored, qs;
  std::vector<std::uint64_t> live_ids;
  for (std::size_t i = 0; i < n; ++i) {
    if (gone.count(ids[i]) != 0) { continue; }
    stored.push_back(as_stored(data.data() + i * dim, dim, cfg.metric, dtype::float32));
    live_ids.push_back(ids[i]);
  }
  for (std::size_t q = 0; q < 60; ++q) {
    qs.push_back(as_stored(queries.data() + q * dim, dim, cfg.metric, dtype::float32));
  }
  std::uint32_t const k = 10;
  auto const truth      = brute_force(stored, qs, cfg.metric, k);

  search_params p;
  p.algo           = search_algo::graph;
  p.host_mode      = host_search_mode::reference;
  p.ctas_per_query = 1;  // (the default; 0 chooses by the batch size: the last section)
  for (std::uint32_t parts : {2u, 4u, 16u}) {
    CAPTURE(parts);
    search_params split  = p;
    split.ctas_per_query = parts;
    auto const got       = run_search(index, queries, {0}, k, split);
    // each part by hand: the top list max(k, ceil(64 / parts)), the mask XOR c * 0x9E3779B97F4A7C15
    std::vector<answers> part_answers;
    for (std::uint32_t c = 0; c < parts; ++c) {
      search_params one = p;
      one.itopk_size    = std::max<std::uint32_t>(k, (64 + parts - 1) / parts);
      one.rand_xor_mask = p.rand_xor_mask ^ (std::uint64_t{c} * 0x9E3779B97F4A7C15ull);
      part_answers.push_back(run_search(index, queries, {0}, k, one));
    }
    std::size_t differing_parts = 0;
    for (std::size_t q = 0; q < 60; ++q) {
      std::vector<std::pair<float, std::uint64_t>> all;  // (distance, id); ties by id
      for (auto const& a : part_answers) {
        for (std::uint32_t j = 0; j < k; ++j) {
          if (a.ids[q * k + j] != invalid_fact_id) {
            all.emplace_back(a.distances[q * k + j], a.ids[q * k + j]);
          }
        }
        differing_parts += a.ids != part_answers[0].ids;
      }
      std::sort(all.begin(), all.end());
      all.erase(std::unique(all.begin(),
                            all.end(),
                            [](auto const& x, auto const& y) { return x.second == y.second; }),
                all.end());
      CAPTURE(q);
      for (std::uint32_t j = 0; j < k; ++j) {
        if (j < all.size()) {
          REQUIRE(got.ids[q * k + j] == all[j].second);
          REQUIRE(got.distances[q * k + j] == all[j].first);
          REQUIRE(gone.count(got.ids[q * k + j]) == 0);
        } else {  // parts whose top lists (k entries at 16 parts) held deleted facts: fewer
          REQUIRE(got.ids[q * k + j] == invalid_fact_id);
          REQUIRE(std::isinf(got.distances[q * k + j]));
        }
      }
      // the union holds every true neighbour a part found, so the merge finds at least as many
      // as any part
      std::set<std::uint64_t> want;
      for (auto const& t : truth[q]) {
        want.insert(live_ids[t.second]);
      }
      auto const hits = [&](std::vector<std::uint64_t> const& row_ids) {
        std::size_t h = 0;
        for (std::uint32_t j = 0; j < k; ++j) {
          h += want.count(row_ids[q * k + j]);
        }
        return h;
      };
      for (auto const& a : part_answers) {
        REQUIRE(hits(got.ids) >= hits(a.ids));
      }
    }
    // (the parts' seeds differ, but on these 3,000 facts parts of 16 or more entries usually
    // converge on the same answer; with 16 parts of k entries, deleted facts in their lists leave
    // some rows short)
    if (parts == 16) { CHECK(differing_parts > 0); }
  }
  // one part is the plain search
  search_params one_part  = p;
  one_part.ctas_per_query = 1;
  auto const plain        = run_search(index, queries, {0}, k, p);
  auto const single       = run_search(index, queries, {0}, k, one_part);
  REQUIRE(plain.ids == single.ids);
  search_params refused  = p;
  refused.ctas_per_query = 17;
  REQUIRE_THROWS_WITH(run_search(index, queries, {0}, k, refused),
                      Catch::Contains("ctas_per_query must be in 0..16"));

  // automatic (0; the default is 1): the largest P in {1, 2, 4} with queries * P <= 128 whose
  // parts keep ceil(itopk / P) >= max(k, 16) entries; a batch's search equals the one with that P
  REQUIRE(search_params{}.ctas_per_query == 1);
  for (std::int64_t q : {1, 2, 31, 32}) {
    REQUIRE(auto_ctas_per_query(q, 64, 10) == 4);
  }
  for (std::int64_t q : {33, 64}) {
    REQUIRE(auto_ctas_per_query(q, 64, 10) == 2);
  }
  for (std::int64_t q : {65, 128, 1000000}) {
    REQUIRE(auto_ctas_per_query(q, 64, 10) == 1);
  }
  REQUIRE(auto_ctas_per_query(1, 32, 10) == 2);  // 4 parts of 8 would be shorter than 16
  REQUIRE(auto_ctas_per_query(1, 63, 10) == 4);  // ceil(63 / 4) = 16
  REQUIRE(auto_ctas_per_query(1, 60, 10) == 2);  // ceil(60 / 4) = 15 < 16
  REQUIRE(auto_ctas_per_query(1, 64, 32) == 2);  // 4 parts of 16 would be raised to k = 32
  REQUIRE(auto_ctas_per_query(1, 31, 10) == 2);  // ceil(31 / 2) = 16
  REQUIRE(auto_ctas_per_query(1, 30, 10) == 1);  // ceil(30 / 2) = 15 < 16
  REQUIRE(auto_ctas_per_query(1, 16, 10) == 1);
  REQUIRE(auto_ctas_per_query(40, 64, 10) == 2);  // 40 x 4 = 160 > 128
  REQUIRE(auto_ctas_per_query(1, 1024, 10) == 4);
  search_params automatic  = p;
  automatic.ctas_per_query = 0;
  for (auto const& [batch, parts] : {std::pair<std::size_t, std::uint32_t>{8, 4},
                                     std::pair<std::size_t, std::uint32_t>{60, 2}}) {
    CAPTURE(batch, parts);
    std::vector<float> const some(queries.begin(),
                                  queries.begin() + static_cast<std::ptrdiff_t>(batch * dim));
    search_params fixed  = p;
    fixed.ctas_per_query = parts;
    auto const chosen    = run_search(index, some, {0}, k, automatic);
    auto const expected  = run_search(index, some, {0}, k, fixed);
    REQUIRE(chosen.ids == expected.ids);
    REQUIRE(chosen.distances == expected.distances);
  }
  // above 64 queries: one part, the plain search
  std::vector<float> many;
  for (int r = 0; r < 2; ++r) {
    many.insert(many.end(), queries.begin(), queries.end());
  }
  auto const chosen_many = run_search(index, many, {0}, k, automatic);
  auto const plain_many  = run_search(index, many, {0}, k, p);
  REQUIRE(chosen_many.ids == plain_many.ids);
  REQUIRE(chosen_many.distances == plain_many.distances);
}

TEST_CASE("index: build is deterministic and a query's answer does not depend on its batch",
          "[index]")
{
  test::gaussian_mixture mix({64, 30, true, 3});
  auto const data    = mix.draw(3000);
  auto const queries = mix.draw(40);
  auto const ids     = sequential_ids(3000, 100, 1);
  index_config cfg;
  cfg.dim = 64;
  graph_index a(cfg), b(cfg);
  add_all(a, 1, data, ids);
  add_all(b, 1, data, ids);
  std::uint32_t const* const rows_a = index_access::graph_rows(a, 1);
  std::uint32_t const* const rows_b = index_access::graph_rows(b, 1);
  std::vector<std::uint32_t> ga(rows_a, rows_a + 3000 * index_access::graph_degree(a));
  std::vector<std::uint32_t> gb(rows_b, rows_b + 3000 * index_access::graph_degree(b));
  REQUIRE(ga == gb);

  search_params p;
  p.algo           = search_algo::graph;
  auto const batch = run_search(a, queries, {1}, k10, p);
  for (std::size_t q = 0; q < 40; ++q) {
    std::vector<float> one(queries.begin() + static_cast<std::ptrdiff_t>(q * 64),
                           queries.begin() + static_cast<std::ptrdiff_t>((q + 1) * 64));
    auto const alone = run_search(a, one, {1}, k10, p);
    for (std::uint32_t j = 0; j < k10; ++j) {
      REQUIRE(alone.ids[j] == batch.ids[q * k10 + j]);
      REQUIRE(alone.distances[j] == batch.distances[q * k10 + j]);
    }
  }
}

TEST_CASE("index: rank-based pruning counts detours by definition", "[index][build]")
{
  // random kNN rows over n nodes (not a real kNN graph: the rule is combinatorial)
  std::uint32_t const n = 60, k = 12, degree = 5;
  std::mt19937 rng(5);
  std::vector<std::uint32_t> knn(std::size_t{n} * k);
  for (std::uint32_t v = 0; v < n; ++v) {
    std::vector<std::uint32_t> others;
    for (std::uint32_t u = 0; u < n; ++u) {
      if (u != v) { others.push_back(u); }
    }
    std::shuffle(others.begin(), others.end(), rng);
    std::copy_n(others.begin(), k, knn.begin() + std::size_t{v} * k);
  }
  std::vector<std::uint32_t> pruned(std::size_t{n} * degree);
  detail::index::prune_host(knn.data(), k, k, n, degree, pruned.data());
  for (std::uint32_t a = 0; a < n; ++a) {
    // detours[b] = #{d < b : L[b] is in row(L[d]) at a rank j < b}
    std::vector<std::pair<std::uint32_t, std::uint32_t>> key;  // (detours, rank)
    for (std::uint32_t b = 0; b < k; ++b) {
      std::uint32_t detours = 0;
      for (std::uint32_t d = 0; d < b; ++d) {
        std::uint32_t const via = knn[std::size_t{a} * k + d];
        for (std::uint32_t j = 0; j < b; ++j) {
          if (knn[std::size_t{via} * k + j] == knn[std::size_t{a} * k + b]) { ++detours; }
        }
      }
      key.emplace_back(detours, b);
    }
    std::sort(key.begin(), key.end());
    for (std::uint32_t r = 0; r < degree; ++r) {
      CAPTURE(a, r);
      REQUIRE(pruned[std::size_t{a} * degree + r] == knn[std::size_t{a} * k + key[r].second]);
    }
  }
  // prune_node, the device kernel's per-thread function, as prune_kernel calls it: launches of
  // `count` threads, each thread's three scratch arrays interleaved with the others' (entry p of
  // thread i at p * count + i), must give the same rows
  for (std::uint32_t count : {1u, 7u, n}) {
    CAPTURE(count);
    std::vector<std::uint32_t> by_node(std::size_t{n} * degree, 0xdeadbeefu);
    std::vector<std::uint32_t> scratch(std::size_t{3} * k * count);
    for (std::uint32_t first = 0; first < n; first += count) {
      std::uint32_t const threads = std::min(count, n - first);
      std::uint64_t const array   = std::uint64_t{k} * threads;
      for (std::uint32_t i = 0; i < threads; ++i) {
        std::uint32_t const node = first + i;
        detail::index::prune_node(knn.data(),
                                  k,
                                  k,
                                  node,
                                  degree,
                                  by_node.data() + std::size_t{node} * degree,
                                  scratch.data() + i,
                                  scratch.data() + array + i,
                                  scratch.data() + 2 * array + i,
                                  threads);
      }
    }
    REQUIRE(by_node == pruned);
  }
}

TEST_CASE("index: reverse edges and the merge keep the documented order", "[index][build]")
{
  std::uint32_t const n = 40, degree = 6;
  std::mt19937 rng(9);
  std::vector<std::uint32_t> pruned(std::size_t{n} * degree);
  for (std::uint32_t v = 0; v < n; ++v) {
    std::vector<std::uint32_t> others;
    for (std::uint32_t u = 0; u < n; ++u) {
      if (u != v) { others.push_back(u); }
    }
    std::shuffle(others.begin(), others.end(), rng);
    std::copy_n(others.begin(), degree, pruned.begin() + std::size_t{v} * degree);
  }
  std::vector<std::uint32_t> merged(std::size_t{n} * degree);
  detail::index::reverse_and_merge_host(pruned.data(), n, degree, merged.data(), degree);
  for (std::uint32_t v = 0; v < n; ++v) {
    // expected, written out: first degree/2 forward edges; then sources s with s -> v, ordered by
    // the rank of that edge in s's row and then by s, at most `degree`; then the remaining
    // forward edges; skip repeats; truncate
    std::vector<std::pair<std::uint32_t, std::uint32_t>> sources;
    for (std::uint32_t s = 0; s < n; ++s) {
      for (std::uint32_t r = 0; r < degree; ++r) {
        if (pruned[std::size_t{s} * degree + r] == v) { sources.emplace_back(r, s); }
      }
    }
    std::sort(sources.begin(), sources.end());
    if (sources.size() > degree) { sources.resize(degree); }
    std::vector<std::uint32_t> want;
    auto push = [&](std::uint32_t x) {
      if (std::find(want.begin(), want.end(), x) == want.end()) { want.push_back(x); }
    };
    for (std::uint32_t r = 0; r < degree / 2; ++r) {
      push(pruned[std::size_t{v} * degree + r]);
    }
    for (auto const& s : sources) {
      push(s.second);
    }
    for (std::uint32_t r = degree / 2; r < degree; ++r) {
      push(pruned[std::size_t{v} * degree + r]);
    }
    want.resize(degree);
    for (std::uint32_t r = 0; r < degree; ++r) {
      CAPTURE(v, r);
      REQUIRE(merged[std::size_t{v} * degree + r] == want[r]);
    }
  }
}

TEST_CASE("index: the host kNN graph equals brute force", "[index][build]")
{
  auto const metric = GENERATE(distance_metric::inner_product, distance_metric::squared_l2);
  test::gaussian_mixture mix({48, 10, metric != distance_metric::squared_l2, 21});
  std::uint32_t const n = 500, k = 16;
  auto const data = mix.draw(n);
  std::vector<std::uint32_t> knn(std::size_t{n} * k);
  detail::index::exact_knn_host(data.data(), 48, n, metric, k, knn.data());
  auto const rows = split_rows(data, 48);
  for (std::uint32_t v = 0; v < n; ++v) {
    std::vector<std::pair<double, std::uint32_t>> all;
    for (std::uint32_t u = 0; u < n; ++u) {
      if (u != v) { all.emplace_back(reference_distance(rows[u], rows[v], metric), u); }
    }
    std::sort(all.begin(), all.end());
    for (std::uint32_t j = 0; j < k; ++j) {
      std::uint32_t const got = knn[std::size_t{v} * k + j];
      if (got != all[j].second) {
        CAPTURE(v, j, got, all[j].second);
        REQUIRE(std::abs(reference_distance(rows[got], rows[v], metric) - all[j].first) < 1e-5);
      }
    }
  }
}

TEST_CASE("index: tiny namespaces (N <= degree + 1) build and answer every fact", "[index]")
{
  std::size_t const n = GENERATE(as<std::size_t>{}, 1, 2, 3, 17, 32, 33, 34, 65);
  auto const algo     = GENERATE(search_algo::graph, search_algo::exact);
  CAPTURE(n, static_cast<int>(algo));
  test::gaussian_mixture mix({20, 4, true, n});
  auto const data = mix.draw(static_cast<std::int64_t>(n));
  auto const ids  = sequential_ids(n, 1000, 10);
  index_config cfg;
  cfg.dim = 20;
  graph_index index(cfg);
  add_all(index, 4, data, ids);
  REQUIRE(index.size(4) == n);
  REQUIRE(reachable_count(index, 4) == n);
  check_rows_well_formed(index, 4);

  // k larger than the set: every fact, sorted, then invalid_fact_id / +inf
  std::uint32_t const k = static_cast<std::uint32_t>(n) + 3;
  search_params p;
  p.algo             = algo;
  auto const queries = mix.draw(5);
  auto const got     = run_search(index, queries, {4}, k, p);
  for (std::size_t q = 0; q < 5; ++q) {
    std::set<std::uint64_t> seen;
    for (std::uint32_t j = 0; j < k; ++j) {
      std::uint64_t const id = got.ids[q * k + j];
      if (j < n) {
        REQUIRE(std::find(ids.begin(), ids.end(), id) != ids.end());
        REQUIRE(seen.insert(id).second);
        if (j > 0) { REQUIRE(got.distances[q * k + j - 1] <= got.distances[q * k + j]); }
      } else {
        REQUIRE(id == invalid_fact_id);
        REQUIRE(std::isinf(got.distances[q * k + j]));
      }
    }
  }
}

TEST_CASE("index: incremental insert keeps recall as the index doubles", "[index][insert]")
{
  std::int64_t const dim = 384;
  test::gaussian_mixture mix({dim, 100, true, 31});
  std::size_t const n0 = 5000;
  auto const first     = mix.draw(static_cast<std::int64_t>(n0));
  auto const second    = mix.draw(static_cast<std::int64_t>(n0));
  auto const queries   = mix.draw(200);
  auto const ids0      = sequential_ids(n0, 1, 1);
  auto const ids1      = sequential_ids(n0, 1 + n0, 1);

  index_config cfg;
  cfg.dim = dim;
  graph_index index(cfg);
  add_all(index, 0, first, ids0);
  std::uint64_t const v0 = index.version();
  // added in four batches, each inserted into the existing graph (no rebuild: each batch is
  // smaller than what is there)
  for (std::size_t b = 0; b < 4; ++b) {
    std::size_t const m = n0 / 4;
    std::vector<float> part(second.begin() + static_cast<std::ptrdiff_t>(b * m * dim),
                            second.begin() + static_cast<std::ptrdiff_t>((b + 1) * m * dim));
    std::vector<std::uint64_t> pid(ids1.begin() + static_cast<std::ptrdiff_t>(b * m),
                                   ids1.begin() + static_cast<std::ptrdiff_t>((b + 1) * m));
    add_all(index, 0, part, pid);
  }
  REQUIRE(index.version() == v0 + 4);
  REQUIRE(index.size(0) == 2 * n0);
  REQUIRE(reachable_count(index, 0) == 2 * n0);
  check_rows_well_formed(index, 0);

  std::vector<float> all(first);
  all.insert(all.end(), second.begin(), second.end());
  std::vector<std::uint64_t> all_ids(ids0);
  all_ids.insert(all_ids.end(), ids1.begin(), ids1.end());
  std::vector<std::vector<float>> stored, qs;
  for (std::size_t i = 0; i < 2 * n0; ++i) {
    stored.push_back(as_stored(all.data() + i * dim, dim, cfg.metric, dtype::float32));
  }
  for (std::size_t q = 0; q < 200; ++q) {
    qs.push_back(as_stored(queries.data() + q * dim, dim, cfg.metric, dtype::float32));
  }
  auto const truth = brute_force(stored, qs, cfg.metric, k10);
  search_params p;
  p.algo         = search_algo::graph;
  double const r = recall(run_search(index, queries, {0}, k10, p), truth, all_ids, k10);
  CAPTURE(r);
  CHECK(r >= 0.95);

  // every inserted fact finds itself first
  std::vector<float> self(second.begin(), second.begin() + 50 * dim);
  auto const found = run_search(index, self, {0}, 1, p);
  for (std::size_t i = 0; i < 50; ++i) {
    REQUIRE(found.ids[i] == ids1[i]);
  }
}

TEST_CASE("index: deleted facts leave results at once; compaction reclaims their rows",
          "[index][delete]")
{
  std::int64_t const dim = 64;
  test::gaussian_mixture mix({dim, 20, true, 41});
  std::size_t const n = 3000;
  auto const data     = mix.draw(static_cast<std::int64_t>(n));
  auto const ids      = sequential_ids(n, 50, 2);
  index_config cfg;
  cfg.dim              = dim;
  cfg.max_row_overhead = 0;  // deleted rows stay until compact() (index_knobs.cpp: automatic)
  graph_index index(cfg);
  add_all(index, 2, data, ids);

  std::vector<std::uint64_t> gone;
  for (std::size_t i = 0; i < n; i += 3) {
    gone.push_back(ids[i]);
  }
  std::uint64_t const v0 = index.version();
  index.erase(cuda::std::span<std::uint64_t const>{gone.data(), gone.size()});
  REQUIRE(index.version() == v0 + 1);
  REQUIRE(index.size(2) == n - gone.size());
  REQUIRE(index.rows(2) == n);
  for (auto id : gone) {
    REQUIRE_FALSE(index.contains(id));
  }
  std::set<std::uint64_t> const gone_set(gone.begin(), gone.end());

  // the deleted vectors themselves as queries: never returned, by either algorithm
  std::vector<float> probes(data.begin(), data.begin() + 300 * dim);
  for (auto algo : {search_algo::graph, search_algo::exact}) {
    search_params p;
    p.algo   = algo;
    auto got = run_search(index, probes, {2}, k10, p);
    for (auto id : got.ids) {
      REQUIRE(gone_set.count(id) == 0);
      REQUIRE(id != invalid_fact_id);
    }
  }

  // an erased id can be added again (to any namespace), even before compaction
  std::vector<float> again(data.begin(), data.begin() + dim);
  add_all(index, 3, again, {ids[0]});
  REQUIRE(index.namespace_of(ids[0]) == 3);

  std::int64_t const arena_before = index.arena_rows();
  index.compact();
  REQUIRE(index.rows(2) == n - gone.size());
  REQUIRE(index.size(2) == n - gone.size());
  REQUIRE(index.arena_rows() < arena_before);
  REQUIRE(index.arena_rows() == index_access::arena_rows_in_use(index));
  REQUIRE(reachable_count(index, 2) == n - gone.size());
  check_rows_well_formed(index, 2);

  // after compaction: still never returned, and recall is that of a fresh build
  std::vector<std::vector<float>> stored, qs;
  std::vector<std::uint64_t> live_ids;
  for (std::size_t i = 0; i < n; ++i) {
    if (gone_set.count(ids[i]) != 0) { continue; }
    stored.push_back(as_stored(data.data() + i * dim, dim, cfg.metric, dtype::float32));
    live_ids.push_back(ids[i]);
  }
  auto const queries = mix.draw(100);
  for (std::size_t q = 0; q < 100; ++q) {
    qs.push_back(as_stored(queries.data() + q * dim, dim, cfg.metric, dtype::float32));
  }
  auto const truth = brute_force(stored, qs, cfg.metric, k10);
  search_params p;
  p.algo         = search_algo::graph;
  auto const got = run_search(index, queries, {2}, k10, p);
  for (auto id : got.ids) {
    REQUIRE(gone_set.count(id) == 0);
  }
  CHECK(recall(got, truth, live_ids, k10) >= 0.95);
}

TEST_CASE("index: a multi-tenant batch answers each query from its own namespace",
          "[index][tenant]")
{
  std::int64_t const dim = 32;
  index_config cfg;
  cfg.dim = dim;
  graph_index index(cfg);
  std::map<std::uint64_t, std::vector<std::uint64_t>> owned;
  std::map<std::uint64_t, std::vector<float>> vectors;
  std::vector<std::size_t> sizes{1, 5, 40, 300, 2500, 900};
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    // every user draws from the same mixture: without isolation, answers would mix users
    test::gaussian_mixture mix({dim, 10, true, 77 + u});
    std::uint64_t const ns = 1000 + u;
    vectors[ns]            = mix.draw(static_cast<std::int64_t>(sizes[u]));
    owned[ns]              = sequential_ids(sizes[u], (u + 1) * 1000000, 1);
    add_all(index, ns, vectors[ns], owned[ns]);
  }
  // grow one namespace after others were created (its segment moves) and delete in another
  test::gaussian_mixture extra({dim, 10, true, 99});
  auto const more = extra.draw(100);
  add_all(index, 1002, more, sequential_ids(100, 3 * 1000000 + 500000, 1));
  for (auto id : sequential_ids(100, 3 * 1000000 + 500000, 1)) {
    owned[1002].push_back(id);
  }
  std::vector<std::uint64_t> gone{owned[1004][0], owned[1004][1]};
  index.erase(cuda::std::span<std::uint64_t const>{gone.data(), gone.size()});

  test::gaussian_mixture qmix({dim, 10, true, 5});
  std::size_t const nq = 120;
  auto const queries   = qmix.draw(static_cast<std::int64_t>(nq));
  std::vector<std::uint64_t> targets(nq);
  for (std::size_t q = 0; q < nq; ++q) {
    targets[q] = 1000 + (q * 7) % sizes.size();
  }
  for (auto algo : {search_algo::automatic, search_algo::graph, search_algo::exact}) {
    search_params p;
    p.algo         = algo;
    auto const got = run_search(index, queries, targets, k10, p);
    for (std::size_t q = 0; q < nq; ++q) {
      std::set<std::uint64_t> own(owned[targets[q]].begin(), owned[targets[q]].end());
      for (std::uint32_t j = 0; j < k10; ++j) {
        std::uint64_t const id = got.ids[q * k10 + j];
        CAPTURE(q, j, targets[q], id);
        if (id == invalid_fact_id) {
          REQUIRE(j >= index.size(targets[q]));
          continue;
        }
        REQUIRE(own.count(id) == 1);
        REQUIRE(std::find(gone.begin(), gone.end(), id) == gone.end());
      }
      // the same query alone against its namespace gives the same answer
      std::vector<float> one(queries.begin() + static_cast<std::ptrdiff_t>(q * dim),
                             queries.begin() + static_cast<std::ptrdiff_t>((q + 1) * dim));
      auto const alone = run_search(index, one, {targets[q]}, k10, p);
      for (std::uint32_t j = 0; j < k10; ++j) {
        REQUIRE(alone.ids[j] == got.ids[q * k10 + j]);
      }
    }
  }
  // compaction keeps every namespace's answers valid
  index.compact();
  REQUIRE(index.arena_rows() == index_access::arena_rows_in_use(index));
  for (auto const& [ns, list] : owned) {
    std::size_t const expect = ns == 1004 ? list.size() - 2 : list.size();
    REQUIRE(index.size(ns) == expect);
    REQUIRE(reachable_count(index, ns) == expect);
  }
}

TEST_CASE("index: refused calls change nothing", "[index][validation]")
{
  std::int64_t const dim = 16;
  index_config cfg;
  cfg.dim = dim;
  graph_index index(cfg);
  test::gaussian_mixture mix({dim, 5, true, 2});
  auto const data = mix.draw(400);
  auto const ids  = sequential_ids(400, 1, 1);
  add_all(index, 0, data, ids);
  auto const queries = mix.draw(8);
  search_params p;
  auto const before_answers             = run_search(index, queries, {0}, k10, p);
  std::uint64_t const version           = index.version();
  std::uint32_t const* const graph_rows = index_access::graph_rows(index, 0);
  std::vector<std::uint32_t> const graph_before(
    graph_rows, graph_rows + 400 * index_access::graph_degree(index));

  auto unchanged = [&] {
    REQUIRE(index.version() == version);
    REQUIRE(index.size(0) == 400);
    REQUIRE(index.total_size() == 400);
    REQUIRE(
      std::equal(graph_before.begin(), graph_before.end(), index_access::graph_rows(index, 0)));
    auto const again = run_search(index, queries, {0}, k10, p);
    REQUIRE(again.ids == before_answers.ids);
  };

  auto good = mix.draw(3);
  std::vector<std::uint64_t> new_ids{9001, 9002, 9003};

  SECTION("NaN and Inf vectors")
  {
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      auto v     = good;
      v[dim + 5] = bad;
      REQUIRE_THROWS_WITH(add_all(index, 0, v, new_ids), Catch::Contains("NaN or infinite"));
      REQUIRE_THROWS_WITH(add_all(index, 7, v, new_ids), Catch::Contains("NaN or infinite"));
    }
    REQUIRE_FALSE(index.has_namespace(7));
    unchanged();
  }
  SECTION("zero vector under cosine; float16 overflow")
  {
    auto v = good;
    std::fill(v.begin() + dim, v.begin() + 2 * dim, 0.0f);
    REQUIRE_THROWS_WITH(add_all(index, 0, v, new_ids), Catch::Contains("zero"));
    index_config l2 = cfg;
    l2.metric       = distance_metric::squared_l2;
    l2.vector_dtype = dtype::float16;
    graph_index half_index(l2);
    auto big = good;
    big[3]   = 1e6f;
    REQUIRE_THROWS_WITH(add_all(half_index, 0, big, new_ids), Catch::Contains("float16"));
    // squared norm 9e30: overflows squared L2 (cosine takes it as a direction: issue 49's
    // [degenerate] cases below)
    index_config l2_float32 = cfg;
    l2_float32.metric       = distance_metric::squared_l2;
    graph_index l2_index(l2_float32);
    add_all(l2_index, 0, good, new_ids);
    auto huge = good;
    huge[1]   = 3e15f;
    REQUIRE_THROWS_WITH(add_all(l2_index, 0, huge, {9004, 9005, 9006}),
                        Catch::Contains("overflow"));
    REQUIRE(l2_index.total_size() == 3);
    auto huge_query = queries;
    huge_query[2]   = 3e15f;
    std::vector<std::uint64_t> qi(8 * k10);
    std::vector<float> qd(8 * k10);
    std::uint64_t ns = 0;
    REQUIRE_THROWS_WITH(inferscale::search(l2_index,
                                           make_matrix_view<float const>(huge_query.data(), 8, dim),
                                           cuda::std::span<std::uint64_t const>{&ns, 1},
                                           k10,
                                           p,
                                           make_matrix_view(qi.data(), 8, k10),
                                           make_matrix_view(qd.data(), 8, k10)),
                        Catch::Contains("overflow"));
    REQUIRE(half_index.total_size() == 0);
    unchanged();
  }
  SECTION("dimension mismatch and id count mismatch")
  {
    std::vector<float> wide(3 * (dim + 1), 0.5f);
    REQUIRE_THROWS_WITH(index.add(0,
                                  make_matrix_view<float const>(wide.data(), 3, dim + 1),
                                  cuda::std::span<std::uint64_t const>{new_ids.data(), 3}),
                        Catch::Contains("dimensions"));
    REQUIRE_THROWS_WITH(index.add(0,
                                  make_matrix_view<float const>(good.data(), 3, dim),
                                  cuda::std::span<std::uint64_t const>{new_ids.data(), 2}),
                        Catch::Contains("ids for"));
    unchanged();
  }
  SECTION("repeated, existing and reserved ids")
  {
    REQUIRE_THROWS_WITH(add_all(index, 0, good, {9001, 9002, 9001}), Catch::Contains("twice"));
    REQUIRE_THROWS_WITH(add_all(index, 5, good, {9001, 9002, 17}), Catch::Contains("already"));
    REQUIRE_THROWS_WITH(add_all(index, 0, good, {9001, 9002, invalid_fact_id}),
                        Catch::Contains("reserved"));
    unchanged();
  }
  SECTION("erase of unknown or repeated ids")
  {
    std::vector<std::uint64_t> mixed{1, 2, 777777};
    REQUIRE_THROWS_WITH(index.erase(cuda::std::span<std::uint64_t const>{mixed.data(), 3}),
                        Catch::Contains("unknown fact id 777777"));
    std::vector<std::uint64_t> twice{1, 2, 1};
    REQUIRE_THROWS_WITH(index.erase(cuda::std::span<std::uint64_t const>{twice.data(), 3}),
                        Catch::Contains("twice"));
    REQUIRE(index.contains(1));
    unchanged();
  }
  SECTION("bad searches leave the outputs untouched")
  {
    std::vector<std::uint64_t> out_ids(8 * k10, 42);
    std::vector<float> out_d(8 * k10, 4.2f);
    auto attempt = [&](matrix_view<float const> q,
                       std::vector<std::uint64_t> const& ns,
                       std::uint32_t k,
                       search_params const& sp,
                       std::int64_t rows,
                       std::int64_t cols) {
      inferscale::search(index,
                         q,
                         cuda::std::span<std::uint64_t const>{ns.data(), ns.size()},
                         k,
                         sp,
                         make_matrix_view(out_ids.data(), rows, cols),
                         make_matrix_view(out_d.data(), rows, cols));
    };
    auto const qv = make_matrix_view(queries.data(), 8, dim);
    REQUIRE_THROWS_WITH(attempt(qv, {0}, 0, p, 8, 0), Catch::Contains("k must be"));
    REQUIRE_THROWS_WITH(attempt(qv, {12}, k10, p, 8, k10), Catch::Contains("unknown namespace"));
    REQUIRE_THROWS_WITH(attempt(qv, {0, 0}, k10, p, 8, k10), Catch::Contains("one per query"));
    REQUIRE_THROWS_WITH(attempt(qv, {0}, k10, p, 8, k10 - 1), Catch::Contains("outputs"));
    REQUIRE_THROWS_WITH(attempt(make_matrix_view(queries.data(), 4, dim - 1), {0}, k10, p, 4, k10),
                        Catch::Contains("dimensions"));
    auto nan_queries = queries;
    nan_queries[3]   = std::numeric_limits<float>::quiet_NaN();
    REQUIRE_THROWS_WITH(attempt(make_matrix_view(nan_queries.data(), 8, dim), {0}, k10, p, 8, k10),
                        Catch::Contains("NaN"));
    search_params wide = p;
    wide.search_width  = 65;
    REQUIRE_THROWS_WITH(attempt(qv, {0}, k10, wide, 8, k10), Catch::Contains("search_width"));
    REQUIRE(std::all_of(out_ids.begin(), out_ids.end(), [](std::uint64_t v) { return v == 42; }));
    REQUIRE(std::all_of(out_d.begin(), out_d.end(), [](float v) { return v == 4.2f; }));
    unchanged();
  }
  SECTION("a device-memory index is not searched by the host")
  {
    index_config dev = cfg;
    dev.space        = memory_space::device;
    graph_index device_index(dev);  // empty: allocates nothing yet
    std::vector<std::uint64_t> out_ids(k10);
    std::vector<float> out_d(k10);
    std::uint64_t ns = 0;
    REQUIRE_THROWS_WITH(search(device_index,
                               make_matrix_view(queries.data(), 1, dim),
                               cuda::std::span<std::uint64_t const>{&ns, 1},
                               k10,
                               p,
                               make_matrix_view(out_ids.data(), 1, k10),
                               make_matrix_view(out_d.data(), 1, k10)),
                        Catch::Contains("device memory"));
  }
  SECTION("bad configurations")
  {
    index_config bad = cfg;
    bad.dim          = 0;
    REQUIRE_THROWS_WITH(graph_index{bad}, Catch::Contains("dim"));
    bad              = cfg;
    bad.vector_dtype = dtype::bfloat16;
    REQUIRE_THROWS_WITH(graph_index{bad}, Catch::Contains("float32 or float16"));
    bad                           = cfg;
    bad.graph_degree              = 80;
    bad.intermediate_graph_degree = 64;
    REQUIRE_THROWS_WITH(graph_index{bad}, Catch::Contains("graph_degree"));
  }
}

TEST_CASE("index: namespaces whose facts are all deleted answer nothing", "[index][delete]")
{
  index_config cfg;
  cfg.dim = 8;
  graph_index index(cfg);
  test::gaussian_mixture mix({8, 3, true, 1});
  auto const data = mix.draw(50);
  auto const ids  = sequential_ids(50, 1, 1);
  add_all(index, 0, data, ids);
  index.erase(cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  REQUIRE(index.size(0) == 0);
  REQUIRE(index.has_namespace(0));
  for (auto algo : {search_algo::graph, search_algo::exact}) {
    search_params p;
    p.algo         = algo;
    auto const got = run_search(index, mix.draw(2), {0}, 3, p);
    for (auto id : got.ids) {
      REQUIRE(id == invalid_fact_id);
    }
  }
  REQUIRE(index.erase_namespace(0) == 0);
  REQUIRE_FALSE(index.has_namespace(0));
  REQUIRE(index.total_size() == 0);
}

TEST_CASE("index: the host distance keeps the device's lane order bit for bit", "[index]")
{
  // team_distance (rounds x lanes, vectorisable) against team_distance_by_lane (lane_partial per
  // lane, the order a device team uses): identical bits for every dim, dtype and metric
  std::int64_t const dim = GENERATE(as<std::int64_t>{}, 1, 7, 64, 100, 384, 768, 1536);
  auto const metric =
    GENERATE(distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2);
  test::gaussian_mixture mix({dim, 3, false, 13});
  auto const x = mix.draw(20);
  auto const q = mix.draw(1);
  auto check   = [&](auto tag) {
    using T                   = decltype(tag);
    std::int64_t const row    = detail::index::padded_dim(dim, sizeof(T));
    std::int64_t const chunks = row / detail::index::chunk_elements<T>;
    std::vector<T> rows(static_cast<std::size_t>(20 * row), from_float<T>(0.0f));
    std::vector<float> query(static_cast<std::size_t>(row), 0.0f);
    for (std::int64_t i = 0; i < 20; ++i) {
      for (std::int64_t e = 0; e < dim; ++e) {
        rows[static_cast<std::size_t>(i * row + e)] =
          from_float<T>(x[static_cast<std::size_t>(i * dim + e)]);
      }
    }
    std::copy(q.begin(), q.end(), query.begin());
    for (int team : {2, 4, 8, 16, 32}) {
      for (std::int64_t i = 0; i < 20; ++i) {
        float const a =
          detail::index::team_distance(rows.data() + i * row, query.data(), chunks, team, metric);
        float const b = detail::index::team_distance_by_lane(
          rows.data() + i * row, query.data(), chunks, team, metric);
        CAPTURE(dim, team, i);
        REQUIRE(std::memcmp(&a, &b, sizeof(float)) == 0);
      }
    }
  };
  check(float{});
  check(half_t{});
}

TEST_CASE("index: the automatic exact/graph switch follows the documented cost model", "[index]")
{
  index_config cfg;
  cfg.dim = 32;
  graph_index index(cfg);
  search_params p;  // itopk 64, width 1, 8 samplings, automatic iterations
  p.host_mode = host_search_mode::reference;
  // written out: (itopk + width * degree) * samplings + (itopk / width + h) * width * degree,
  // h = smallest integer with (degree / 2)^h >= rows; times the host factor 0.55
  std::uint32_t const rows = 5000;  // 16^3 = 4096 < 5000 <= 16^4, so h = 4
  double const estimate    = (64.0 + 32.0) * 8.0 + (64.0 + 4.0) * 32.0;
  REQUIRE(index.exact_search_threshold(p, rows) == static_cast<std::int64_t>(0.55 * estimate));
  // the fast mode's: entry points ceil(4 sqrt(5000)) = 283, plus ef * degree / 2, times its factor
  search_params fast = p;
  fast.host_mode     = host_search_mode::fast;
  REQUIRE(index.exact_search_threshold(fast, rows) ==
          static_cast<std::int64_t>(detail::index::host_fast_graph_cost_factor *
                                    (283.0 + 64.0 * 32.0 / 2.0)));

  // below the threshold, automatic answers exactly as exact search does; above it, as the graph
  test::gaussian_mixture mix({32, 8, true, 4});
  auto const small_data = mix.draw(300);
  auto const big_data   = mix.draw(4000);
  add_all(index, 1, small_data, sequential_ids(300, 1, 1));
  add_all(index, 2, big_data, sequential_ids(4000, 10000, 1));
  REQUIRE(300 <= index.exact_search_threshold(p, 300));
  REQUIRE(4000 > index.exact_search_threshold(p, 4000));
  auto const queries = mix.draw(30);
  for (std::uint64_t ns : {1, 2}) {
    search_params a = p, forced = p;
    forced.algo     = ns == 1 ? search_algo::exact : search_algo::graph;
    auto const got  = run_search(index, queries, {ns}, k10, a);
    auto const want = run_search(index, queries, {ns}, k10, forced);
    REQUIRE(got.ids == want.ids);
    REQUIRE(std::memcmp(got.distances.data(), want.distances.data(), got.distances.size() * 4) ==
            0);
  }
  // a configured threshold wins
  index_config fixed           = cfg;
  fixed.exact_search_threshold = 123;
  REQUIRE(graph_index{fixed}.exact_search_threshold(p, rows) == 123);
}

TEST_CASE("index: build replaces a namespace; erase_namespace leaves the others", "[index]")
{
  index_config cfg;
  cfg.dim = 24;
  graph_index index(cfg);
  test::gaussian_mixture mix({24, 6, true, 8});
  auto const a = mix.draw(500), b = mix.draw(300), c = mix.draw(200);
  add_all(index, 1, a, sequential_ids(500, 1, 1));
  add_all(index, 2, b, sequential_ids(300, 1000, 1));
  // rebuild namespace 1 from other data, keeping some of its old ids and adding new ones
  auto const ids = sequential_ids(200, 401, 1);  // 401..600: 401..500 were namespace 1's
  index.build(1,
              make_matrix_view(c.data(), 200, 24),
              cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  REQUIRE(index.size(1) == 200);
  REQUIRE_FALSE(index.contains(1));
  REQUIRE(index.contains(450));
  REQUIRE(index.contains(600));
  REQUIRE(reachable_count(index, 1) == 200);
  // ids of another namespace are still refused
  auto const clash = sequential_ids(200, 1100, 1);  // 1100..1299 are namespace 2's
  REQUIRE_THROWS_WITH(index.build(1,
                                  make_matrix_view(c.data(), 200, 24),
                                  cuda::std::span<std::uint64_t const>{clash.data(), clash.size()}),
                      Catch::Contains("already indexed"));
  REQUIRE(index.size(1) == 200);
  // each fact of the rebuilt namespace finds itself
  search_params p;
  p.algo         = search_algo::graph;
  auto const got = run_search(index, c, {1}, 1, p);
  REQUIRE(got.ids == ids);

  // an empty build empties a namespace (and counts as a change) or creates an empty one
  std::uint64_t const v = index.version();
  std::vector<float> none;
  std::vector<std::uint64_t> no_ids;
  index.build(5,
              make_matrix_view<float const>(none.data(), 0, 24),
              cuda::std::span<std::uint64_t const>{no_ids.data(), 0});
  REQUIRE(index.has_namespace(5));
  REQUIRE(index.size(5) == 0);
  REQUIRE(index.version() == v + 1);

  REQUIRE(index.erase_namespace(1) == 200);
  REQUIRE_FALSE(index.has_namespace(1));
  REQUIRE(index.size(2) == 300);
  REQUIRE(index.total_size() == 300);
  auto const still = run_search(index, b, {2}, 1, p);
  REQUIRE(still.ids == sequential_ids(300, 1000, 1));
  index.compact();
  REQUIRE(index.arena_rows() == 300);  // namespace 5 is empty and takes no rows
  REQUIRE(run_search(index, b, {2}, 1, p).ids == sequential_ids(300, 1000, 1));
}

// ---------------------------------------------------------------------------------------------
// Degenerate vectors (issue 49) through every metric, both dtypes and every host search path,
// against brute force in long double: all zeros, float32 denormals, the largest finite values,
// duplicates of one vector, namespaces whose rows are all identical. No search returns a NaN or
// infinite distance, an id twice, an id of another namespace, or a set farther than the true top
// k; what the index refuses (NaN and infinite elements, a zero vector under cosine, a squared
// norm above 1e30 under inner product and squared L2) throws before anything is written. The
// device kernel's query preparation and distance order (shared __host__ __device__ code) run
// here on the CPU and must give the host search's bits. (In this unit, not one of its own: one
// compile of the index headers less in CI.)

namespace degenerate {

using inferscale_test::bits_of;

namespace {

/// What the index stores for `v`: normalised in long double (cosine), rounded to float, then
/// to the dtype.
std::vector<float> stored_row(float const* v, std::int64_t dim, distance_metric m, dtype t)
{
  long double norm2 = 0;
  for (std::int64_t e = 0; e < dim; ++e) {
    norm2 += static_cast<long double>(v[e]) * v[e];
  }
  long double const scale = m == distance_metric::cosine ? 1.0L / std::sqrt(norm2) : 1.0L;
  std::vector<float> out(static_cast<std::size_t>(dim));
  for (std::int64_t e = 0; e < dim; ++e) {
    float const x                    = static_cast<float>(v[e] * scale);
    out[static_cast<std::size_t>(e)] = t == dtype::float16 ? to_float(from_float<half_t>(x)) : x;
  }
  return out;
}

/// A distance by definition in long double, and how far a float32 computation may be from it.
struct reference {
  long double distance;
  long double tolerance;
};

reference reference_distance(std::vector<float> const& q,
                             std::vector<float> const& x,
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
  long double const scale     = m == distance_metric::squared_l2
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
void check_answers(test::degenerate_set const& set,
                   namespace_rows const& nsr,
                   test::answers const& got,
                   std::uint32_t k,
                   distance_metric m,
                   dtype t)
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
    for (auto const& row : stored) {
      all.push_back(reference_distance(query, row, m));
    }
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
      p.host_mode      = mode;
      p.algo           = algo;
      bool const fast  = mode == host_search_mode::fast;
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

void add_rows(graph_index& index,
              std::uint64_t ns,
              std::vector<float> const& rows,
              std::uint64_t first_id)
{
  std::int64_t const n = static_cast<std::int64_t>(rows.size()) / index.dim();
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < n; ++r) {
    ids[static_cast<std::size_t>(r)] = first_id + r;
  }
  index.add(ns,
            make_matrix_view(rows.data(), n, index.dim()),
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
  for (auto m :
       {distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2}) {
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

TEST_CASE(
  "index: degenerate vectors - every metric, dtype and host search path against brute "
  "force, never NaN",
  "[index][degenerate]")
{
  for (index_case const& c : index_cases()) {
    CAPTURE(to_string(c.metric), to_string(c.vector_dtype), c.fp16_traversal);
    test::degenerate_set const set = test::make_degenerate_set(c.metric, c.vector_dtype);
    graph_index index(config_for(c, set.dim));
    std::vector<namespace_rows> const spaces{
      {1, &set.mixed, 1000}, {2, &set.identical, 2000}, {3, &set.degenerate_identical, 3000}};
    for (auto const& s : spaces) {
      add_rows(index, s.ns, *s.rows, s.first_id);
    }
    std::uint32_t const k = 8;
    for (search_path const& path : search_paths()) {
      CAPTURE(path.name);
      for (auto const& s : spaces) {
        check_answers(set,
                      s,
                      test::run_search(index, set.queries, {s.ns}, k, path.params),
                      k,
                      c.metric,
                      c.vector_dtype);
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

TEST_CASE(
  "index: the device's query preparation and distance order, run on the CPU, give the "
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
      for (int l = 0; l < 32; ++l) {
        lanes[l] = detail::index::lane_norm2(padded.data(), dim, l);
      }
      for (int o = 16; o >= 1; o /= 2) {
        double next[32];
        for (int l = 0; l < 32; ++l) {
          next[l] = lanes[l] + lanes[l ^ o];
        }
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
        index_access::prepare_queries(index, make_matrix_view<float const>(raw.data(), 1, dim));
      REQUIRE(host.size() == padded.size());
      for (std::size_t e = 0; e < host.size(); ++e) {
        CAPTURE(e);
        REQUIRE(bits_of(host[e]) == bits_of(padded[e]));
      }
      // the reference-mode exact search's distances are the kernel's lane order's, bit for bit
      search_params p;
      p.host_mode              = host_search_mode::reference;
      p.algo                   = search_algo::exact;
      std::uint32_t const k    = 8;
      auto const got           = test::run_search(index, raw, {1}, k, p);
      std::uint64_t const* ids = index_access::id_rows(index, 1);
      void const* const stored = index_access::vector_rows(index, 1);
      std::uint32_t const n    = index.rows(1);
      for (std::uint32_t j = 0; j < k; ++j) {
        std::uint32_t const local =
          static_cast<std::uint32_t>(std::find(ids, ids + n, got.ids[j]) - ids);
        REQUIRE(local < n);
        float const lane_order = c.vector_dtype == dtype::float16
                                   ? detail::index::team_distance_by_lane(
                                       static_cast<half_t const*>(stored) + local * row_elements,
                                       padded.data(),
                                       chunks,
                                       team,
                                       c.metric)
                                   : detail::index::team_distance_by_lane(
                                       static_cast<float const*>(stored) + local * row_elements,
                                       padded.data(),
                                       chunks,
                                       team,
                                       c.metric);
        CAPTURE(j, got.distances[j], lane_order);
        REQUIRE(std::isfinite(lane_order));
        REQUIRE(bits_of(lane_order) == bits_of(got.distances[j]));
      }
    }
  }
}

TEST_CASE(
  "index: degenerate vectors the metric cannot take are refused at add and search, "
  "nothing written",
  "[index][degenerate][validation]")
{
  float const nan = std::numeric_limits<float>::quiet_NaN();
  float const inf = std::numeric_limits<float>::infinity();
  for (auto m :
       {distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2}) {
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
      REQUIRE_THROWS_WITH(inferscale::search(index,
                                             make_matrix_view<float const>(queries.data(), 2, dim),
                                             cuda::std::span<std::uint64_t const>{&ns, 1},
                                             8,
                                             search_params{},
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

}  // namespace degenerate
