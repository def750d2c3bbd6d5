/**
 * @file search_host.hpp
 * @brief The search algorithm, written once in sequential form: the host backend runs it, and the
 * device kernel must produce exactly its result (see `math.hpp` for the distance order).
 *
 * One query against one tenant's graph of `n` nodes:
 *  1. Seeds: buffer slot `s` in `[0, itopk + width * degree)` takes the closest of
 *     `num_random_samplings` draws `seed_node(s, j)`; a node already taken by an earlier slot is
 *     dropped. The visited set is exact (a node's distance is computed at most once per query).
 *  2. The best `itopk` entries by (distance, node) form the top list.
 *  3. Each iteration takes as parents the first `search_width` top-list entries not yet used as
 *     parents; with none left, or after `max_iterations`, the search stops. Every neighbour of a
 *     parent not visited before is visited and becomes a candidate; the top list becomes the best
 *     `itopk` of itself and the candidates.
 *  4. The answer is the first `k` entries of the top list that are not deleted (deleted nodes still
 *     route). Entries are unique and the order is total, so the answer does not depend on the order
 *     in which a parallel implementation visits nodes.
 */
#pragma once

#include <inferscale/detail/index/distance_simd.hpp>
#include <inferscale/detail/index/math.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace inferscale::detail::index {

/// @brief Resolved search parameters (after defaults and clamping).
struct search_plan {
  std::uint32_t k{0};
  std::uint32_t itopk{0};
  std::uint32_t width{1};
  std::uint32_t max_iterations{0};
  std::uint32_t samplings{1};
  std::uint64_t xor_mask{0};
};

/// @brief A buffer entry: distance, local node id and whether it has been a parent.
struct search_entry {
  float distance;
  std::uint32_t node;
  bool parent;
};

inline bool operator<(search_entry const& a, search_entry const& b) noexcept
{
  return entry_less(a.distance, a.node, b.distance, b.node);
}

/// @brief Per-thread scratch for host searches (a visited stamp per node, reused across queries).
struct search_scratch {
  std::vector<std::uint32_t> stamp;
  std::uint32_t epoch{0};
  std::vector<search_entry> top, candidates;
  std::vector<std::uint32_t> fresh;  ///< the fast search's unvisited neighbours of one node
  std::vector<float> scanned;        ///< the fast search's entry / exact-scan distances
  std::vector<search_entry> walked;  ///< the float16 walk's list before it is measured again

  void begin(std::uint32_t n)
  {
    if (stamp.size() < n) {
      stamp.assign(n, 0);
      epoch = 0;
    }
    if (++epoch == 0) {
      std::fill(stamp.begin(), stamp.end(), 0);
      epoch = 1;
    }
  }
  /// @brief Marks `node` visited; false when it already was.
  bool visit(std::uint32_t node)
  {
    if (stamp[node] == epoch) { return false; }
    stamp[node] = epoch;
    return true;
  }
};

/**
 * @brief Graph search of one query (already padded, normalised for cosine) in one tenant.
 *
 * @param rows    the tenant's first padded row; @param graph its first graph row
 * @param top_out receives the final top list (size `plan.itopk`, sorted, padded with invalid)
 */
template <class T>
void graph_search_host(T const* rows,
                       std::int64_t row_elements,
                       std::uint32_t const* graph,
                       std::uint32_t degree,
                       std::uint32_t n,
                       float const* query,
                       distance_metric metric,
                       search_plan const& plan,
                       search_scratch& scratch,
                       std::vector<search_entry>& top_out)
{
  std::int64_t const chunks = row_elements / chunk_elements<T>;
  int const team            = team_size_for(chunks);
  float const inf           = std::numeric_limits<float>::infinity();
  auto dist                 = [&](std::uint32_t v) {
    return team_distance(rows + std::int64_t{v} * row_elements, query, chunks, team, metric);
  };
  scratch.begin(n);
  auto& top        = scratch.top;
  auto& candidates = scratch.candidates;
  top.clear();
  candidates.clear();

  std::uint32_t const buffer = plan.itopk + plan.width * degree;
  for (std::uint32_t s = 0; s < buffer && n > 0; ++s) {
    std::uint32_t best = invalid_node;
    float best_d       = inf;
    for (std::uint32_t j = 0; j < plan.samplings; ++j) {
      std::uint32_t const v = seed_node(s, j, plan.samplings, plan.xor_mask, n);
      float const d         = dist(v);
      if (best == invalid_node || entry_less(d, v, best_d, best)) {
        best   = v;
        best_d = d;
      }
    }
    if (scratch.visit(best)) { candidates.push_back({best_d, best, false}); }
  }
  auto merge = [&] {
    top.insert(top.end(), candidates.begin(), candidates.end());
    candidates.clear();
    std::size_t const keep = std::min<std::size_t>(top.size(), plan.itopk);
    std::partial_sort(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(keep), top.end());
    top.resize(keep);
  };
  merge();

  for (std::uint32_t iteration = 0; iteration < plan.max_iterations; ++iteration) {
    std::uint32_t parents[64];
    std::uint32_t taken = 0;
    for (auto& e : top) {
      if (taken == plan.width) { break; }
      if (!e.parent) {
        e.parent         = true;
        parents[taken++] = e.node;
      }
    }
    if (taken == 0) { break; }
    for (std::uint32_t p = 0; p < taken; ++p) {
      std::uint32_t const* row = graph + std::uint64_t{parents[p]} * degree;
      for (std::uint32_t r = 0; r < degree; ++r) {
        std::uint32_t const v = row[r];
        if (v == invalid_node || v >= n) { continue; }
        if (scratch.visit(v)) { candidates.push_back({dist(v), v, false}); }
      }
    }
    merge();
  }
  top_out.assign(plan.itopk, search_entry{inf, invalid_node, false});
  std::copy(top.begin(), top.end(), top_out.begin());
}

/// @brief Resolved parameters of the host's fast search (`host_search_mode::fast`).
struct fast_plan {
  std::uint32_t k{0};
  std::uint32_t ef{0};  ///< result list kept during the search (itopk, at least k)
  /// Entry points: `entry_nodes[0, entry_count)` when given (the tenant's routing sample,
  /// `choose_entry_points`), else the first `entry_count` draws of the seed generator.
  std::uint32_t const* entry_nodes{nullptr};
  /// The entry points' rows packed one after the other (`entry_count` rows of the index dtype),
  /// or null: scanned as one stream, they cost a fraction of the same rows read at random.
  void const* entry_rows{nullptr};
  std::uint32_t entry_count{1};
  std::uint32_t max_expansions{0};  ///< nodes expanded at most; 0 = until the list stops improving
  /// Neighbours read per expanded node, the first of its list (search_params::host_neighbors);
  /// 0 = all of them.
  std::uint32_t neighbors{0};
  /// A node the search neither returns nor routes through (`calibrate_ef`'s probe: a row
  /// searched for as if it were not indexed); `invalid_node` = none.
  std::uint32_t excluded{invalid_node};
  std::uint64_t xor_mask{0};
};

/// @brief Min-heap order of the candidates (closest on top) and max-heap order of the results
/// (farthest on top), both by the total (distance, node) order.
struct farther {
  bool operator()(search_entry const& a, search_entry const& b) const noexcept
  {
    return entry_less(b.distance, b.node, a.distance, a.node);
  }
};
struct closer {
  bool operator()(search_entry const& a, search_entry const& b) const noexcept
  {
    return entry_less(a.distance, a.node, b.distance, b.node);
  }
};

/// @brief Offers `(d, v)` to a bounded max-heap (`closer` order) of the best `k` entries.
inline void offer_bounded(std::vector<search_entry>& heap, std::size_t k, float d, std::uint32_t v)
{
  if (heap.size() == k) {
    if (!entry_less(d, v, heap.front().distance, heap.front().node)) { return; }
    std::pop_heap(heap.begin(), heap.end(), closer{});
    heap.back() = {d, v, false};
  } else {
    heap.push_back({d, v, false});
  }
  std::push_heap(heap.begin(), heap.end(), closer{});
}

/// @brief Row `v` of a tenant as an fp32 query (`row_elements` floats at `out`).
template <class T>
void row_as_query(T const* rows, std::int64_t row_elements, std::uint32_t v, float* out)
{
  T const* row = rows + std::int64_t{v} * row_elements;
  for (std::int64_t i = 0; i < row_elements; ++i) {
    out[i] = to_float(row[i]);
  }
}

/**
 * @brief The host's fast graph search of one query in one tenant: best-first search (the
 * candidate nearest the query is expanded next) with a result list of `ef` live nodes, stopping
 * when the nearest unexpanded candidate is farther than the list's worst entry while the list is
 * full. Seeds are the first `entries` draws of the seed generator (`seed_node(s, 0, 1, ...)`, the
 * same nodes for every query of a tenant, so they stay in cache). Deleted nodes route (they are
 * candidates) but never enter the results. Each node's distance is computed at most once, with
 * its row prefetched two nodes ahead.
 *
 * Unlike `graph_search_host` (the device's spec), the result is not required to equal the
 * device's: it is the best the host finds fastest. `out` gets up to `k` live entries, sorted.
 */
template <class T>
void graph_search_fast(T const* rows,
                       std::int64_t row_elements,
                       std::uint32_t const* graph,
                       std::uint32_t degree,
                       std::uint32_t n,
                       std::uint8_t const* deleted,
                       float const* query,
                       fast_kernels<T> const& kernels,
                       fast_plan const& plan,
                       search_scratch& scratch,
                       std::vector<search_entry>& out)
{
  out.clear();
  if (n == 0) { return; }
  scratch.begin(n);
  if (plan.excluded < n) { (void)scratch.visit(plan.excluded); }
  auto& candidates = scratch.candidates;  // min-heap (closer on top)
  auto& results    = scratch.top;         // max-heap (farther on top), at most ef
  auto& fresh      = scratch.fresh;
  candidates.clear();
  results.clear();
  std::size_t const row_bytes = static_cast<std::size_t>(row_elements) * sizeof(T);
  auto const distance         = kernels.distance;
  std::size_t const ef        = plan.ef;
  // rows fetched ahead of their distance, their first four cache lines (the hardware prefetcher
  // follows the rest of a row). Measured at 100,000 x 384 fp32 (rows from memory, ef 64):
  // whole rows 1, 2, 4, 8, 32 ahead gave 265, 264, 235, 240, 300 us per query; four lines 4
  // ahead 184 us against 195 for whole rows (another run, +-5 % between runs)
  constexpr std::size_t prefetch_ahead = 4;
  constexpr std::size_t prefetch_bytes = 256;
  auto row_of   = [&](std::uint32_t v) { return rows + std::int64_t{v} * row_elements; };
  auto consider = [&](std::uint32_t v, float d) {
    if (results.size() == ef && !entry_less(d, v, results.front().distance, results.front().node)) {
      return;
    }
    candidates.push_back({d, v, false});
    std::push_heap(candidates.begin(), candidates.end(), farther{});
    if (deleted != nullptr && deleted[v]) { return; }
    results.push_back({d, v, false});
    std::push_heap(results.begin(), results.end(), closer{});
    if (results.size() > ef) {
      std::pop_heap(results.begin(), results.end(), closer{});
      results.pop_back();
    }
  };
  auto visit_all = [&] {
    std::size_t const m           = fresh.size();
    std::size_t const ahead_bytes = std::min(row_bytes, prefetch_bytes);
    for (std::size_t j = 0; j < m && j < prefetch_ahead; ++j) {
      prefetch_row(row_of(fresh[j]), ahead_bytes);
    }
    for (std::size_t j = 0; j < m; ++j) {
      if (j + prefetch_ahead < m) { prefetch_row(row_of(fresh[j + prefetch_ahead]), ahead_bytes); }
      std::uint32_t const v = fresh[j];
      consider(v, distance(row_of(v), query, row_elements));
    }
  };

  fresh.clear();
  if (plan.entry_nodes != nullptr && plan.entry_rows != nullptr) {
    auto& d = scratch.scanned;
    d.resize(plan.entry_count);
    kernels.scan(
      static_cast<T const*>(plan.entry_rows), row_elements, plan.entry_count, query, d.data());
    for (std::uint32_t s = 0; s < plan.entry_count; ++s) {
      std::uint32_t const v = plan.entry_nodes[s];
      if (v < n && scratch.visit(v)) { consider(v, d[s]); }
    }
  } else {
    for (std::uint32_t s = 0; s < plan.entry_count; ++s) {
      std::uint32_t const v =
        plan.entry_nodes != nullptr ? plan.entry_nodes[s] : seed_node(s, 0, 1, plan.xor_mask, n);
      if (v < n && scratch.visit(v)) { fresh.push_back(v); }
    }
    visit_all();
  }

  std::uint32_t expanded = 0;
  std::uint32_t const read =
    plan.neighbors != 0 && plan.neighbors < degree ? plan.neighbors : degree;
  while (!candidates.empty()) {
    search_entry const c = candidates.front();
    if (results.size() == ef &&
        !entry_less(c.distance, c.node, results.front().distance, results.front().node)) {
      break;
    }
    if (plan.max_expansions != 0 && expanded == plan.max_expansions) { break; }
    std::pop_heap(candidates.begin(), candidates.end(), farther{});
    candidates.pop_back();
    ++expanded;
    std::uint32_t const* row = graph + std::uint64_t{c.node} * degree;
    fresh.clear();
    for (std::uint32_t r = 0; r < read; ++r) {
      std::uint32_t const v = row[r];
      if (v >= n) { continue; }  // an empty slot (invalid_node) or a stale id
      if (scratch.visit(v)) { fresh.push_back(v); }
    }
    visit_all();
  }
  std::sort(results.begin(), results.end(), closer{});
  std::size_t const keep = std::min<std::size_t>(results.size(), plan.k);
  out.assign(results.begin(), results.begin() + static_cast<std::ptrdiff_t>(keep));
}

/**
 * @brief A bound on |d16 - d32| under the cosine metric, where d32 is the fast distance of a
 * stored fp32 row (unit norm, as the index stores cosine rows) to a unit query of `elements`
 * elements, and d16 the fast distance of the same row rounded to fp16 (`from_float<half_t>`).
 *
 * Both are `1 - s` with s a dot product. Rounding x to fp16 moves each element by at most 2^-11
 * |x_i| (normal results) or 2^-25 (subnormal ones), so the exact dots differ by at most
 * 2^-11 |x| |q| + 2^-25 sqrt(n) |q| (Cauchy-Schwarz). Each computed dot is within
 * gamma_n |x| |q| of its exact value (n products summed in any order, fused or not:
 * gamma_n = n u / (1 - n u), u = 2^-24), and the subtraction from 1 adds at most u |1 - s| <= 2u
 * each. The norms are 1 to within n u; 1.001 covers them.
 */
inline double cosine_fp16_error_bound(std::int64_t elements) noexcept
{
  double const u     = 0x1.0p-24;
  double const n     = static_cast<double>(elements);
  double const gamma = n * u / (1.0 - n * u);
  double const norm  = 1.001;
  return 0x1.0p-11 * norm * norm + 0x1.0p-25 * std::sqrt(n) * norm + 2.0 * gamma * norm * norm +
         4.0 * u;
}

/**
 * @brief The best `k` of a candidate list by the stored rows' own distances: `approx` is the fast
 * search's result over a rounded copy of the rows (sorted by its distances), and each entry
 * within `window` of the k-th one is measured again on `rows` by `distance`; `out` gets the best
 * `k` of those by (distance, node), with those distances.
 *
 * With `window` at least twice a bound on |approx - exact| per row (`cosine_fp16_error_bound`),
 * this is exactly the best k of the whole list by the exact distances: an entry past the window
 * has exact distance > d_k + bound >= the exact distance of each of the k first entries. An
 * infinite window measures the whole list.
 */
template <class T>
void rerank_exact(T const* rows,
                  std::int64_t row_elements,
                  float const* query,
                  fast_distance_fn<T> distance,
                  std::vector<search_entry> const& approx,
                  std::uint32_t k,
                  double window,
                  std::vector<search_entry>& out)
{
  out.clear();
  if (approx.empty() || k == 0) { return; }
  double const last =
    static_cast<double>(approx[std::min<std::size_t>(approx.size(), k) - 1].distance) + window;
  std::size_t m = std::min<std::size_t>(approx.size(), k);
  while (m < approx.size() && static_cast<double>(approx[m].distance) <= last) {
    ++m;
  }
  // the rows are cold (the walk read their copies): fetched ahead as the walk does
  constexpr std::size_t ahead = 4;
  std::size_t const bytes =
    std::min<std::size_t>(256, static_cast<std::size_t>(row_elements) * sizeof(T));
  auto const row_of = [&](std::size_t j) {
    return rows + std::int64_t{approx[j].node} * row_elements;
  };
  for (std::size_t j = 0; j < m && j < ahead; ++j) {
    prefetch_row(row_of(j), bytes);
  }
  for (std::size_t j = 0; j < m; ++j) {
    if (j + ahead < m) { prefetch_row(row_of(j + ahead), bytes); }
    out.push_back({distance(row_of(j), query, row_elements), approx[j].node, false});
  }
  std::sort(out.begin(), out.end(), closer{});
  if (out.size() > k) { out.resize(k); }
}

/**
 * @brief Entry points of a tenant for the fast search: `count` nodes spread over the data the
 * way k-means++ seeds clusters (D^2 sampling), chosen from an evenly spaced subsample of
 * `subsample` rows. A proximity graph pruned from a kNN graph links the points of a tight cluster
 * among themselves and hardly ever across clusters, so a best-first search from a random node
 * stays in that node's cluster; starting from nodes that cover every cluster fixes that at the
 * cost of `count` distances per query (rows that stay in cache, being the same for every query).
 * Deterministic for a seed; returns every node when `count >= n`.
 */
template <class T>
std::vector<std::uint32_t> choose_entry_points(T const* rows,
                                               std::int64_t row_elements,
                                               std::uint32_t n,
                                               std::uint32_t count,
                                               std::uint32_t subsample,
                                               std::uint64_t seed)
{
  std::vector<std::uint32_t> out;
  if (count >= n) {
    for (std::uint32_t v = 0; v < n; ++v) {
      out.push_back(v);
    }
    return out;
  }
  if (count == 0) { return out; }
  std::uint32_t const s = std::max(count, std::min(n, subsample));
  std::vector<std::uint32_t> pool(s);
  for (std::uint32_t i = 0; i < s; ++i) {
    pool[i] = static_cast<std::uint32_t>(std::uint64_t{i} * n / s);
  }
  auto const l2 = fast_distance_for<T>(distance_metric::squared_l2);
  std::vector<float> centre(static_cast<std::size_t>(row_elements));
  std::vector<double> nearest(s, std::numeric_limits<double>::infinity());
  std::uint64_t state = seed | 1;
  std::uint32_t pick  = 0;  // the first centre: the subsample's first row
  for (std::uint32_t c = 0; c < count; ++c) {
    std::uint32_t const node = pool[pick];
    out.push_back(node);
    T const* row = rows + std::int64_t{node} * row_elements;
    for (std::int64_t e = 0; e < row_elements; ++e) {
      centre[static_cast<std::size_t>(e)] = to_float(row[e]);
    }
    double total = 0.0;
    for (std::uint32_t i = 0; i < s; ++i) {
      double const d = l2(rows + std::int64_t{pool[i]} * row_elements, centre.data(), row_elements);
      nearest[i]     = std::min(nearest[i], d);
      total += nearest[i];
    }
    if (!(total > 0.0)) { break; }  // every subsampled row coincides with a centre
    state         = xorshift64(state);
    double target = static_cast<double>(state >> 11) * 0x1.0p-53 * total;
    pick          = s - 1;
    for (std::uint32_t i = 0; i < s; ++i) {
      target -= nearest[i];
      if (target < 0.0 && nearest[i] > 0.0) {
        pick = i;
        break;
      }
    }
    if (nearest[pick] == 0.0) { break; }
  }
  return out;
}

/**
 * @brief How many of a tenant's entry points (a prefix of `choose_entry_points`' order, which is
 * itself a D^2 sample at every length) the fast search needs: the smallest of `first`, 2 `first`,
 * 4 `first`, ..., `count` with which at least 99 % of `probes` rows of the tenant (seed-generator
 * draws), searched for as queries with a result list of 16, find themselves among their top 10.
 * A row of a cluster that no entry point reaches cannot find itself, so the check measures
 * exactly what the entry points are for; data without tight clusters stops at `first`.
 */
template <class T>
std::uint32_t entry_points_needed(T const* rows,
                                  std::int64_t row_elements,
                                  std::uint32_t const* graph,
                                  std::uint32_t degree,
                                  std::uint32_t n,
                                  std::uint32_t const* entries,
                                  T const* packed,
                                  std::uint32_t count,
                                  fast_kernels<T> const& kernels,
                                  std::uint32_t first,
                                  std::uint32_t probes)
{
  if (count <= first || n == 0) { return count; }
  probes                      = std::min(probes, n);
  std::uint32_t const allowed = probes / 100;  // misses tolerated (ties, duplicates)
  search_scratch scratch;
  std::vector<search_entry> out;
  std::vector<float> query(static_cast<std::size_t>(row_elements));
  for (std::uint32_t e = first;; e = std::min(count, 2 * e)) {
    fast_plan plan;
    plan.k               = 10;
    plan.ef              = 16;
    plan.entry_nodes     = entries;
    plan.entry_rows      = packed;
    plan.entry_count     = e;
    std::uint32_t missed = 0;
    for (std::uint32_t p = 0; p < probes && missed <= allowed; ++p) {
      std::uint32_t const node = seed_node(p, 0, 1, 0x5EED5EEDull, n);
      row_as_query(rows, row_elements, node, query.data());
      graph_search_fast(
        rows, row_elements, graph, degree, n, nullptr, query.data(), kernels, plan, scratch, out);
      bool found = false;
      for (auto const& r : out) {
        found = found || r.node == node;
      }
      missed += found ? 0 : 1;
    }
    if (missed <= allowed || e == count) { return e; }
  }
}

/**
 * @brief The smallest result-list size (`ef`) of a grid from 10 to 256 at which the fast search
 * of a tenant finds, on average, at least `target` of the true 10 nearest other rows of `probes`
 * of its own rows (seed-generator draws), each searched for as a query that is not indexed: the
 * probe is neither returned nor routed through (`fast_plan::excluded`), since its own edges
 * lead straight to its kNN list and would make the probe far easier than a new query. When the
 * probes' recall levels off first (three lists in a row gain less than 0.001 over the one
 * before them), the list two steps past where it levelled off. The true neighbours are the
 * fast scan's, computed in blocks of rows that stay in cache while every probe passes over them.
 * Rows of the tenant stand in for its future queries: the same distribution, by construction when
 * facts and questions are embedded alike, as in the benchmarks.
 */
template <class T>
std::uint32_t calibrate_ef(T const* rows,
                           std::int64_t row_elements,
                           std::uint32_t const* graph,
                           std::uint32_t degree,
                           std::uint32_t n,
                           std::uint32_t const* entries,
                           T const* packed,
                           std::uint32_t entry_count,
                           fast_kernels<T> const& kernels,
                           std::uint32_t probes,
                           double target)
{
  constexpr std::uint32_t k      = 10;
  constexpr std::uint32_t grid[] = {
    10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128, 160, 192, 256};
  if (n <= 2 * k) { return k; }
  probes = std::min(probes, n);
  std::vector<std::uint32_t> probe(probes);
  std::vector<float> queries(static_cast<std::size_t>(probes) *
                             static_cast<std::size_t>(row_elements));
  for (std::uint32_t p = 0; p < probes; ++p) {
    probe[p] = seed_node(p, 0, 1, 0xCA11B8A7Eull, n);
    row_as_query(
      rows, row_elements, probe[p], queries.data() + p * static_cast<std::size_t>(row_elements));
  }
  // truth: each probe's k nearest other rows, as bounded max-heaps
  std::vector<std::vector<search_entry>> truth(probes);
  constexpr std::uint32_t block = 256;
  std::vector<float> d(block);
  for (std::uint32_t first = 0; first < n; first += block) {
    std::uint32_t const count = std::min(block, n - first);
    for (std::uint32_t p = 0; p < probes; ++p) {
      kernels.scan(rows + std::int64_t{first} * row_elements,
                   row_elements,
                   count,
                   queries.data() + p * static_cast<std::size_t>(row_elements),
                   d.data());
      for (std::uint32_t i = 0; i < count; ++i) {
        if (first + i != probe[p]) { offer_bounded(truth[p], k, d[i], first + i); }
      }
    }
  }
  search_scratch scratch;
  std::vector<search_entry> out;
  std::vector<double> recall;  // per grid value, while the target is not reached
  // The probes' recall may level off below the target (a probe taken out of the graph also
  // takes away the detours pruning left through it, so probes are somewhat harder than new
  // queries); then the list two grid steps past where it levelled off is taken. Measured on the
  // 384-d 100-cluster mixture, 10,000 rows: probe recall 0.982 (ef 10), 0.9875 (14), 0.9883
  // (16 .. 192), 0.9922 (256): ef 20 is taken; held-out queries get 0.9899 at 16, 0.9902 at 20.
  constexpr double gain = 0.001;
  for (std::uint32_t ef : grid) {
    fast_plan plan;
    plan.k           = k;
    plan.ef          = ef;
    plan.entry_nodes = entries;
    plan.entry_rows  = packed;
    plan.entry_count = entry_count;
    std::size_t hits = 0;
    for (std::uint32_t p = 0; p < probes; ++p) {
      plan.excluded = probe[p];  // as a query that is not indexed: its own edges give no help
      graph_search_fast(rows,
                        row_elements,
                        graph,
                        degree,
                        n,
                        nullptr,
                        queries.data() + p * static_cast<std::size_t>(row_elements),
                        kernels,
                        plan,
                        scratch,
                        out);
      for (auto const& r : out) {
        for (auto const& t : truth[p]) {
          hits += t.node == r.node ? 1 : 0;
        }
      }
    }
    double const r = static_cast<double>(hits) / (static_cast<double>(probes) * k);
    if (r >= target) { return ef; }
    recall.push_back(r);
    // levelled off: the three lists after recall[i - 3] gained less than `gain` over it
    std::size_t const i = recall.size() - 1;
    if (i >= 3 && std::max({recall[i - 2], recall[i - 1], recall[i]}) - recall[i - 3] < gain) {
      return grid[i - 1];  // two steps past where it levelled off
    }
  }
  return grid[sizeof grid / sizeof grid[0] - 1];
}

/**
 * @brief The host's fast exact search: the fast scan of every row in row order (one sequential
 * stream the hardware prefetcher follows), the live ones into a bounded max-heap of `k`.
 */
template <class T>
void exact_search_fast(T const* rows,
                       std::int64_t row_elements,
                       std::uint32_t n,
                       std::uint8_t const* deleted,
                       float const* query,
                       fast_kernels<T> const& kernels,
                       std::uint32_t k,
                       search_scratch& scratch,
                       std::vector<search_entry>& out)
{
  out.clear();
  constexpr std::uint32_t block = 256;  // distances per scan call (1 KiB, stays in L1)
  auto& d                       = scratch.scanned;
  d.resize(block);
  for (std::uint32_t first = 0; first < n; first += block) {
    std::uint32_t const count = std::min(block, n - first);
    kernels.scan(rows + std::int64_t{first} * row_elements, row_elements, count, query, d.data());
    for (std::uint32_t i = 0; i < count; ++i) {
      if (!deleted[first + i]) { offer_bounded(out, k, d[i], first + i); }
    }
  }
  std::sort(out.begin(), out.end(), closer{});
}

/**
 * @brief Exact search of one query in one tenant over a float16 copy of its rows, with the
 * float32 result: every live row's distance on `copy` (half the bytes of `rows`: a small
 * namespace searched exactly is read from memory, not cache, so its bytes are its time), then
 * every row within `window` of the k-th of those measured again on `rows` by `distance`
 * (`rerank_exact`). With `window` at least twice a bound on |copy distance - row distance| per
 * row (`cosine_fp16_error_bound` for cosine), `out` is the best `k` live rows by the rows'
 * own distances, as `exact_search_fast` on `rows` finds them (distances by `distance`).
 */
template <class T>
void exact_search_rounded(half_t const* copy,
                          T const* rows,
                          std::int64_t row_elements,
                          std::uint32_t n,
                          std::uint8_t const* deleted,
                          float const* query,
                          fast_scan_fn<half_t> scan,
                          fast_distance_fn<T> distance,
                          std::uint32_t k,
                          double window,
                          search_scratch& scratch,
                          std::vector<search_entry>& out)
{
  out.clear();
  auto& d = scratch.scanned;
  d.resize(n);
  constexpr std::uint32_t block = 256;
  auto& best = scratch.top;  // the k best by the copy's distances (a bounded max-heap)
  best.clear();
  for (std::uint32_t first = 0; first < n; first += block) {
    std::uint32_t const count = std::min(block, n - first);
    scan(copy + std::int64_t{first} * row_elements, row_elements, count, query, d.data() + first);
    for (std::uint32_t i = first; i < first + count; ++i) {
      if (!deleted[i]) { offer_bounded(best, k, d[i], i); }
    }
  }
  if (best.empty()) { return; }
  // the heap's front is the k-th best; every live row within the window of it is a candidate
  double const last = static_cast<double>(best.front().distance) + window;
  auto& approx      = scratch.walked;
  approx.clear();
  for (std::uint32_t i = 0; i < n; ++i) {
    if (!deleted[i] && static_cast<double>(d[i]) <= last) { approx.push_back({d[i], i, false}); }
  }
  std::sort(approx.begin(), approx.end(), closer{});
  rerank_exact(rows, row_elements, query, distance, approx, k, window, out);
}

/// @brief Exact search of one query in one tenant: every row, best `k` live rows by (distance,
/// node).
template <class T>
void exact_search_host(T const* rows,
                       std::int64_t row_elements,
                       std::uint32_t n,
                       std::uint8_t const* deleted,
                       float const* query,
                       distance_metric metric,
                       std::uint32_t k,
                       std::vector<search_entry>& out)
{
  std::int64_t const chunks = row_elements / chunk_elements<T>;
  int const team            = team_size_for(chunks);
  out.clear();
  for (std::uint32_t v = 0; v < n; ++v) {
    if (deleted[v]) { continue; }
    out.push_back(
      {team_distance(rows + std::int64_t{v} * row_elements, query, chunks, team, metric),
       v,
       false});
  }
  std::size_t const keep = std::min<std::size_t>(out.size(), k);
  std::partial_sort(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(keep), out.end());
  out.resize(keep);
}

}  // namespace inferscale::detail::index
