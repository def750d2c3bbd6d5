/**
 * @file detail/index/maintenance.inl
 * @brief `graph_index`'s graph maintenance (included at the end of `index.hpp`, not a header of
 * its own): `add` / `build` / `erase` / `erase_namespace`, the checks of new facts, full graph
 * builds (kNN -> prune -> reverse -> merge), sequential inserts (CAGRA extend), the reachability
 * repair, and the fast host search's entry points and calibrated list size.
 */
#pragma once

#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace inferscale {

// ---------------------------------------------------------------------------------------------
// Mutations

template <class T>
void graph_index::add(std::uint64_t ns,
                      matrix_view<T const> vectors,
                      cuda::std::span<std::uint64_t const> ids,
                      graph_builder const& builder)
{
  check_new_facts(vectors, ids);
  std::uint32_t const m = static_cast<std::uint32_t>(ids.size());
  if (m == 0) { return; }
  auto it                    = tenant_of_.find(ns);
  std::uint32_t const before = it == tenant_of_.end() ? 0 : tenants_[it->second].ref.size;
  INFERSCALE_EXPECTS(std::uint64_t{before} + m < (std::uint64_t{1} << 31),
                     "graph_index::add: a namespace holds fewer than 2^31 rows");

  std::size_t const t = ensure_room(ns, before + m, total_size() + m);
  write_rows(t, before, vectors, ids);
  auto& tr = tenants_[t].ref;
  tr.size  = before + m;
  tr.live += m;
  if (before == 0 || m > before || tr.size <= rebuild_limit()) {
    rebuild_graph(t, builder);
  } else {
    std::vector<std::uint32_t> in_degree(tr.size, 0);
    std::uint32_t const* graph = graph_.data() + tr.row_begin * config_.graph_degree;
    for (std::size_t e = 0; e < std::size_t{before} * config_.graph_degree; ++e) {
      if (graph[e] != detail::index::invalid_node) { ++in_degree[graph[e]]; }
    }
    detail::index::search_scratch scratch;  // one visited table for the whole batch
    for (std::uint32_t v = before; v < tr.size; ++v) {
      insert_node(t, v, in_degree, scratch);
    }
    repair(t);
    // the old entry points stay valid (the new rows are reachable through the graph); they
    // are chosen afresh once the namespace has grown by a quarter
    if (std::uint64_t{tr.size} * 4 > std::uint64_t{tenants_[t].entries_rows} * 5) {
      refresh_entry_points(t);
    }
  }
  ++version_;
  if (!compact_if_needed(builder)) { upload_tenant(t, before, upload_vectors | upload_graph); }
}

template <class T>
void graph_index::build(std::uint64_t ns,
                        matrix_view<T const> vectors,
                        cuda::std::span<std::uint64_t const> ids,
                        graph_builder const& builder)
{
  check_new_facts(vectors, ids, ns);
  INFERSCALE_EXPECTS(ids.size() < (std::size_t{1} << 31),
                     "graph_index::build: a namespace holds fewer than 2^31 rows");
  std::uint64_t const before = version_;
  erase_namespace_rows(ns);
  ensure_room(ns, 0, total_size());  // an empty build still creates the namespace
  add(ns, vectors, ids, builder);
  if (version_ == before) { ++version_; }
  compact_if_needed(builder);  // an empty build leaves the old rows behind (add did not check)
}

INFERSCALE_INDEX_LINKAGE void graph_index::erase(cuda::std::span<std::uint64_t const> ids,
                                                 graph_builder const& builder)
{
  INFERSCALE_EXPECTS(ids.empty() || ids.data() != nullptr,
                     std::string{"graph_index::erase: null ids"});
  std::unordered_set<std::uint64_t> seen;
  for (auto id : ids) {
    INFERSCALE_EXPECTS(id_to_row_.count(id) != 0,
                       "graph_index::erase: unknown fact id " + std::to_string(id));
    INFERSCALE_EXPECTS(seen.insert(id).second,
                       "graph_index::erase: fact id " + std::to_string(id) + " given twice");
  }
  std::vector<std::size_t> touched;
  for (auto id : ids) {
    auto const loc                        = id_to_row_.at(id);
    auto& t                               = tenants_[loc.tenant];
    deleted_[t.ref.row_begin + loc.local] = 1;
    --t.ref.live;
    id_to_row_.erase(id);
    touched.push_back(loc.tenant);
  }
  if (ids.empty()) { return; }
  ++version_;
  if (compact_if_needed(builder)) { return; }  // the device got the whole arena
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (auto t : touched) {
    upload_tenant(t, 0, upload_flags);
  }
}

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::erase_namespace(std::uint64_t ns,
                                                                    graph_builder const& builder)
{
  auto it = tenant_of_.find(ns);
  if (it == tenant_of_.end()) { return 0; }
  std::uint32_t const live = tenants_[it->second].ref.live;
  erase_namespace_rows(ns);
  tenants_[it->second].alive = false;
  tenant_of_.erase(it);
  ++version_;
  compact_if_needed(builder);
  return live;
}

// ---------------------------------------------------------------------------------------------
// Checks and row removal

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::rebuild_limit() const noexcept
{
  return std::max<std::uint32_t>(256, 2 * config_.intermediate_graph_degree);
}

template <class T>
void graph_index::check_new_facts(matrix_view<T const> vectors,
                                  cuda::std::span<std::uint64_t const> ids,
                                  std::uint64_t replacing_ns) const
{
  static_assert(
    std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, half_t>,
    "graph_index: vectors are float or half_t");
  INFERSCALE_EXPECTS(vectors.extent(1) == config_.dim,
                     "graph_index: vectors have " +
                       detail::count_of(vectors.extent(1), "dimension") + ", the index " +
                       std::to_string(config_.dim));
  INFERSCALE_EXPECTS(
    static_cast<std::int64_t>(ids.size()) == vectors.extent(0),
    "graph_index: " + detail::count_of(static_cast<std::int64_t>(ids.size()), "id") + " for " +
      detail::count_of(vectors.extent(0), "vector"));
  INFERSCALE_EXPECTS(vectors.size() == 0 || vectors.data_handle() != nullptr,
                     std::string{"graph_index: null vector data"});
  INFERSCALE_EXPECTS(ids.empty() || ids.data() != nullptr, std::string{"graph_index: null ids"});
  std::unordered_set<std::uint64_t> seen;
  seen.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::uint64_t const id = ids[i];
    INFERSCALE_EXPECTS(id != invalid_fact_id,
                       "graph_index: fact id 2^64-1 is reserved (invalid_fact_id)");
    INFERSCALE_EXPECTS(seen.insert(id).second,
                       "graph_index: fact id " + std::to_string(id) + " given twice");
    auto it = id_to_row_.find(id);
    INFERSCALE_EXPECTS(it == id_to_row_.end() || (replacing_ns != invalid_fact_id &&
                                                  tenants_[it->second.tenant].ns == replacing_ns),
                       "graph_index: fact id " + std::to_string(id) + " is already indexed");
  }
  bool const cosine = config_.metric == distance_metric::cosine;
  for (std::int64_t r = 0; r < vectors.extent(0); ++r) {
    for (std::int64_t e = 0; e < config_.dim; ++e) {
      float const x = to_float(vectors(r, e));
      INFERSCALE_EXPECTS(std::isfinite(x),
                         "graph_index: vector " + std::to_string(r) + " (fact id " +
                           std::to_string(ids[r]) + ") has a NaN or infinite element at " +
                           std::to_string(e));
    }
    double const norm2 = row_norm2(vectors, r);
    INFERSCALE_EXPECTS(!cosine || norm2 > 0.0,
                       "graph_index: vector " + std::to_string(r) + " (fact id " +
                         std::to_string(ids[r]) + ") is zero, which has no cosine");
    // cosine stores directions: a denormal or huge vector is normalised like any other
    INFERSCALE_EXPECTS(cosine || norm2 <= max_norm2,
                       "graph_index: vector " + std::to_string(r) + " (fact id " +
                         std::to_string(ids[r]) +
                         ") has a squared norm above 1e30: its distances would overflow float32");
    if (config_.vector_dtype == dtype::float16 || traverses_fp16()) {
      double const scale = cosine ? detail::index::cosine_scale(norm2) : 1.0;
      for (std::int64_t e = 0; e < config_.dim; ++e) {
        float const x = cosine ? detail::index::cosine_normalised(to_float(vectors(r, e)), scale)
                               : to_float(vectors(r, e));
        INFERSCALE_EXPECTS(std::isfinite(to_float(from_float<half_t>(x))),
                           "graph_index: vector " + std::to_string(r) +
                             " overflows float16 at element " + std::to_string(e) +
                             (config_.vector_dtype == dtype::float16
                                ? std::string{}
                                : std::string{" (index_config::host_traversal_dtype float16)"}));
      }
    }
  }
}

INFERSCALE_INDEX_LINKAGE void graph_index::erase_namespace_rows(std::uint64_t ns)
{
  auto it = tenant_of_.find(ns);
  if (it == tenant_of_.end()) { return; }
  std::size_t const index = it->second;
  auto& t                 = tenants_[index];
  for (std::uint32_t v = 0; v < t.ref.size; ++v) {
    std::int64_t const row = t.ref.row_begin + v;
    if (!deleted_[row]) { id_to_row_.erase(ids_[row]); }
    deleted_[row] = 1;
  }
  upload_tenant(index, 0, upload_flags);
  t.ref.live = 0;
  t.ref.size = 0;
  // no rows, no entry points (the next add rebuilds the graph and chooses them): nothing stale
  // stays behind for a snapshot to carry
  t.entries.clear();
  t.entry_vectors.clear();
  t.entries_rows = 0;
  t.default_ef   = default_itopk;
  rebuild_traversal(index);
}

// ---------------------------------------------------------------------------------------------
// Graph builds, inserts and repair

INFERSCALE_INDEX_LINKAGE bool graph_index::uses_nn_descent(std::uint32_t rows) const noexcept
{
  if (config_.host_knn == knn_build::automatic) { return rows > exact_knn_max_rows; }
  return config_.host_knn == knn_build::nn_descent;
}

INFERSCALE_INDEX_LINKAGE void graph_index::rebuild_graph(std::size_t t,
                                                         graph_builder const& builder)
{
  auto const& tr             = tenants_[t].ref;
  std::uint32_t const n      = tr.size;
  std::uint32_t const degree = config_.graph_degree;
  std::uint32_t* graph       = graph_.data() + tr.row_begin * degree;
  std::fill_n(graph, std::size_t{n} * degree, detail::index::invalid_node);
  auto const eff = detail::index::degrees_for(config_.intermediate_graph_degree, degree, n);
  if (n <= 1 || eff.final == 0) {
    refresh_entry_points(t);
    return;
  }
  std::vector<std::uint32_t> knn(std::size_t{n} * eff.intermediate);
  void const* rows =
    vectors_.data() + static_cast<std::size_t>(tr.row_begin * row_elements_) * element_size_;
  if (builder.knn) {
    builder.knn(rows, n, eff.intermediate, knn.data());
  } else if (uses_nn_descent(n)) {
    with_rows(t, [&](auto const* r) {
      last_nn_descent_ = detail::index::nn_descent_knn_host(
        r, row_elements_, n, config_.metric, eff.intermediate, config_.nn_descent, knn.data());
    });
  } else {
    with_rows(t, [&](auto const* r) {
      detail::index::exact_knn_host(
        r, row_elements_, n, config_.metric, eff.intermediate, knn.data(), config_.build_threads);
    });
  }
  std::vector<std::uint32_t> pruned(std::size_t{n} * eff.final);
  if (builder.prune) {
    builder.prune(knn.data(), n, eff.intermediate, eff.final, pruned.data());
  } else {
    detail::index::prune_host(knn.data(),
                              eff.intermediate,
                              eff.intermediate,
                              n,
                              eff.final,
                              pruned.data(),
                              config_.build_threads);
  }
  detail::index::reverse_and_merge_host(
    pruned.data(), n, eff.final, graph, degree, config_.build_threads);
  repair(t);
  refresh_entry_points(t);
}

INFERSCALE_INDEX_LINKAGE void graph_index::insert_node(std::size_t t,
                                                       std::uint32_t v,
                                                       std::vector<std::uint32_t>& in_degree,
                                                       detail::index::search_scratch& scratch)
{
  auto const& tr             = tenants_[t].ref;
  std::uint32_t const degree = config_.graph_degree;
  std::uint32_t* graph       = graph_.data() + tr.row_begin * degree;
  std::uint32_t const want   = std::min(config_.intermediate_graph_degree, v);
  // the candidates: the host's fast search of rows [0, v) from the tenant's entry points
  // (those below v), deleted rows included (they route, and stay linked until compaction)
  auto const& tn = tenants_[t];
  detail::index::fast_plan plan;
  plan.k           = want;
  plan.ef          = std::max<std::uint32_t>(2 * want, 64);
  plan.entry_nodes = tn.entries.empty() ? nullptr : tn.entries.data();
  plan.entry_rows  = packed_entry_rows(tn);
  plan.entry_count =
    tn.entries.empty() ? entry_point_count(v) : static_cast<std::uint32_t>(tn.entries.size());
  std::vector<detail::index::search_entry> top;
  with_rows(t, [&](auto const* rows) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
    std::vector<float> q(static_cast<std::size_t>(row_elements_));
    for (std::int64_t e = 0; e < row_elements_; ++e) {
      q[static_cast<std::size_t>(e)] = to_float(rows[std::int64_t{v} * row_elements_ + e]);
    }
    detail::index::graph_search_fast(rows,
                                     row_elements_,
                                     graph,
                                     degree,
                                     v,
                                     nullptr,
                                     q.data(),
                                     detail::index::fast_kernels_for<T>(config_.metric),
                                     plan,
                                     scratch,
                                     top);
  });
  // candidates L (by distance); detour counts use the candidates' graph rows
  std::vector<std::uint32_t> cand;
  for (auto const& e : top) {
    if (e.node != detail::index::invalid_node && cand.size() < want) { cand.push_back(e.node); }
  }
  std::uint32_t const k = static_cast<std::uint32_t>(cand.size());
  std::vector<std::uint32_t> counts(k, 0);
  std::unordered_map<std::uint32_t, std::uint32_t> rank;
  for (std::uint32_t i = 0; i < k; ++i) {
    rank[cand[i]] = i;
  }
  for (std::uint32_t a = 0; a < k; ++a) {
    std::uint32_t const* row = graph + std::size_t{cand[a]} * degree;
    for (std::uint32_t j = 0; j < degree; ++j) {
      auto it = rank.find(row[j]);
      if (it != rank.end() && it->second > a && j < it->second) { ++counts[it->second]; }
    }
  }
  std::uint32_t* out    = graph + std::size_t{v} * degree;
  std::uint32_t written = 0;
  for (std::uint32_t c = 0; c <= k && written < degree; ++c) {
    for (std::uint32_t r = 0; r < k && written < degree; ++r) {
      if (counts[r] == c) { out[written++] = cand[r]; }
    }
  }
  std::fill(out + written, out + degree, detail::index::invalid_node);
  // reverse edges: each of the first degree/2 neighbours points back at v, replacing an empty
  // slot or the second-half slot whose target has the most in-edges
  for (std::uint32_t i = 0; i < written; ++i) {
    ++in_degree[out[i]];
  }
  std::uint32_t const back = std::max<std::uint32_t>(1, degree / 2);
  for (std::uint32_t i = 0; i < std::min(back, written); ++i) {
    std::uint32_t* row = graph + std::size_t{out[i]} * degree;
    if (std::find(row, row + degree, v) != row + degree) { continue; }
    std::uint32_t slot = degree;
    for (std::uint32_t r = 0; r < degree && slot == degree; ++r) {
      if (row[r] == detail::index::invalid_node) { slot = r; }
    }
    if (slot == degree) {
      slot = degree - 1;
      for (std::uint32_t r = degree / 2; r < degree; ++r) {
        if (in_degree[row[r]] > in_degree[row[slot]]) { slot = r; }
      }
      --in_degree[row[slot]];
    }
    row[slot] = v;
    ++in_degree[v];
  }
}

INFERSCALE_INDEX_LINKAGE float graph_index::node_distance(std::size_t t,
                                                          std::uint32_t a,
                                                          std::uint32_t b) const
{
  return with_rows(t, [&](auto const* rows) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
    std::vector<float> q(static_cast<std::size_t>(row_elements_));
    for (std::int64_t e = 0; e < row_elements_; ++e) {
      q[static_cast<std::size_t>(e)] = to_float(rows[std::int64_t{b} * row_elements_ + e]);
    }
    std::int64_t const chunks = row_elements_ / detail::index::chunk_elements<T>;
    return detail::index::team_distance(rows + std::int64_t{a} * row_elements_,
                                        q.data(),
                                        chunks,
                                        detail::index::team_size_for(chunks),
                                        config_.metric);
  });
}

INFERSCALE_INDEX_LINKAGE void graph_index::repair(std::size_t t)
{
  auto const& tr       = tenants_[t].ref;
  std::uint32_t* graph = graph_.data() + tr.row_begin * config_.graph_degree;
  detail::index::repair_reachability(
    graph,
    tr.size,
    config_.graph_degree,
    config_.graph_degree,
    [&](std::uint32_t a, std::uint32_t b) { return node_distance(t, a, b); });
}

// ---------------------------------------------------------------------------------------------
// Entry points of the fast host search

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::entry_point_count(
  std::uint32_t rows) const noexcept
{
  if (config_.host_entry_points < 0) { return default_host_entry_points(rows); }
  return static_cast<std::uint32_t>(std::min<std::int64_t>(config_.host_entry_points, rows));
}

INFERSCALE_INDEX_LINKAGE void graph_index::refresh_entry_points(std::size_t t)
{
  auto& tn                     = tenants_[t];
  std::uint32_t const n        = tn.ref.size;
  std::uint32_t const count    = entry_point_count(n);
  constexpr std::uint64_t seed = 0x9E3779B97F4A7C15ull;
  tn.entries                   = with_rows(t, [&](auto const* rows) {
    return detail::index::choose_entry_points(rows, row_elements_, n, count, 8 * count, seed);
  });
  tn.entries_rows              = n;
  pack_entry_rows(t);
  if (config_.host_entry_points < 0) {  // automatic: as many as the data's clusters need
    std::uint32_t const needed = with_rows(t, [&](auto const* rows) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
      return detail::index::entry_points_needed(
        rows,
        row_elements_,
        graph_.data() + tn.ref.row_begin * config_.graph_degree,
        config_.graph_degree,
        n,
        tn.entries.data(),
        static_cast<T const*>(packed_entry_rows(tn)),
        static_cast<std::uint32_t>(tn.entries.size()),
        detail::index::fast_kernels_for<T>(config_.metric),
        min_host_entry_points,
        entry_probes);
    });
    tn.entries.resize(needed);  // a prefix: its rows are the packed buffer's first ones
    pack_entry_rows(t);
  }
  tn.default_ef = with_rows(t, [&](auto const* rows) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
    return detail::index::calibrate_ef(rows,
                                       row_elements_,
                                       graph_.data() + tn.ref.row_begin * config_.graph_degree,
                                       config_.graph_degree,
                                       n,
                                       tn.entries.data(),
                                       static_cast<T const*>(packed_entry_rows(tn)),
                                       static_cast<std::uint32_t>(tn.entries.size()),
                                       detail::index::fast_kernels_for<T>(config_.metric),
                                       calibration_probes,
                                       calibration_recall);
  });
  rebuild_traversal(t);
}

INFERSCALE_INDEX_LINKAGE void graph_index::pack_entry_rows(std::size_t t)
{
  auto& tn                    = tenants_[t];
  std::size_t const row_bytes = static_cast<std::size_t>(row_elements_) * element_size_;
  if (tn.entries_rows < detail::index::packed_entry_min_rows) {
    std::vector<unsigned char>().swap(tn.entry_vectors);
    return;
  }
  tn.entry_vectors.resize(tn.entries.size() * row_bytes);
  tn.entry_vectors.shrink_to_fit();
  unsigned char const* base =
    vectors_.data() + static_cast<std::size_t>(tn.ref.row_begin) * row_bytes;
  for (std::size_t i = 0; i < tn.entries.size(); ++i) {
    std::memcpy(
      tn.entry_vectors.data() + i * row_bytes, base + tn.entries[i] * row_bytes, row_bytes);
  }
}

}  // namespace inferscale
