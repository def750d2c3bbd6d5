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

#include <inferscale/detail/index/math.hpp>

#include <algorithm>
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

  void begin(std::uint32_t n)
  {
    if (stamp.size() < n) { stamp.assign(n, 0); epoch = 0; }
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
  auto dist = [&](std::uint32_t v) {
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
        e.parent          = true;
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

/// @brief Exact search of one query in one tenant: every row, best `k` live rows by (distance, node).
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
      {team_distance(rows + std::int64_t{v} * row_elements, query, chunks, team, metric), v, false});
  }
  std::size_t const keep = std::min<std::size_t>(out.size(), k);
  std::partial_sort(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(keep), out.end());
  out.resize(keep);
}

}  // namespace inferscale::detail::index
