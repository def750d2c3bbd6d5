/**
 * @file detail/index/search.inl
 * @brief `graph_index`'s host search (included at the end of `index.hpp`, not a header of its
 * own): `search`, and the validation, query preparation, plans, split parts and exact/graph
 * choice that the device backend (`index.cuh`) shares, then the per-tenant search of both host
 * modes (fast and reference).
 */
#pragma once

#include <inferscale/detail/index/parallel.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale {

// ---------------------------------------------------------------------------------------------
// search(): the free host search (a friend of graph_index)

template <class T>
void search(graph_index const& index,
            matrix_view<T const> queries,
            cuda::std::span<std::uint64_t const> namespaces,
            std::uint32_t k,
            search_params const& params,
            matrix_view<std::uint64_t> out_ids,
            matrix_view<float> out_distances)
{
  INFERSCALE_EXPECTS(index.config_.space == memory_space::host,
                     "inferscale::search: this index lives in device memory; use the overload "
                     "taking raft::resources from index.cuh");
  std::vector<std::int64_t> tenant_index = index.check_search(queries,
                                                              namespaces,
                                                              k,
                                                              params,
                                                              out_ids.extent(0),
                                                              out_ids.extent(1),
                                                              out_distances.extent(0),
                                                              out_distances.extent(1));
  INFERSCALE_EXPECTS(queries.extent(0) == 0 ||
                       (out_ids.data_handle() != nullptr && out_distances.data_handle() != nullptr),
                     std::string{"inferscale::search: null output"});
  std::vector<float> padded       = index.prepare_queries(queries);
  std::int64_t const nq           = queries.extent(0);
  std::int64_t const row_elements = index.row_elements_;
  search_params const split = graph_index::resolve_split(params, nq, k);  // (automatic: by size)
  // chunks of 8 queries handed out as threads come free: a step's queries differ in cost by up
  // to 100x (namespaces of 50 to 5,000 rows), so fixed ranges would leave a thread idle
  detail::index::parallel_chunks(nq, params.threads, 8, [&](std::int64_t begin, std::int64_t end) {
    // per thread, kept across calls: single-query searches reuse the visited stamps (an epoch
    // per query, so nothing is cleared) instead of allocating a table of n entries each time
    thread_local detail::index::search_scratch scratch;
    std::vector<detail::index::search_entry> result;
    for (std::int64_t q = begin; q < end; ++q) {
      auto const& tn = index.tenants_[static_cast<std::size_t>(tenant_index[q])];
      auto const& tr = tn.ref;
      index.search_tenant(tn, padded.data() + q * row_elements, k, split, scratch, result);
      for (std::uint32_t j = 0; j < k; ++j) {
        bool const valid    = j < result.size();
        out_ids(q, j)       = valid ? index.ids_[tr.row_begin + result[j].node] : invalid_fact_id;
        out_distances(q, j) = valid ? result[j].distance : std::numeric_limits<float>::infinity();
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Shared with the device backend: checks, queries, plans

template <class T>
std::vector<std::int64_t> graph_index::check_search(matrix_view<T const> queries,
                                                    cuda::std::span<std::uint64_t const> namespaces,
                                                    std::uint32_t k,
                                                    search_params const& params,
                                                    std::int64_t ids_rows,
                                                    std::int64_t ids_cols,
                                                    std::int64_t dist_rows,
                                                    std::int64_t dist_cols) const
{
  std::int64_t const nq = queries.extent(0);
  INFERSCALE_EXPECTS(queries.extent(1) == config_.dim,
                     "graph_index: queries have " +
                       detail::count_of(queries.extent(1), "dimension") + ", the index " +
                       std::to_string(config_.dim));
  INFERSCALE_EXPECTS(queries.size() == 0 || queries.data_handle() != nullptr,
                     std::string{"graph_index: null query data"});
  INFERSCALE_EXPECTS(namespaces.empty() || namespaces.data() != nullptr,
                     std::string{"graph_index: null namespaces"});
  INFERSCALE_EXPECTS(k >= 1, "graph_index: k must be at least 1");
  INFERSCALE_EXPECTS(
    params.search_width >= 1 && params.search_width <= 64,
    "graph_index: search_width must be in 1..64, got " + std::to_string(params.search_width));
  INFERSCALE_EXPECTS(resolved_itopk(params.itopk_size, k) <= 1024,
                     "graph_index: itopk_size (raised to k) must be at most 1024");
  INFERSCALE_EXPECTS(params.ctas_per_query <= 16,
                     "graph_index: ctas_per_query must be in 0..16 (0: automatic), got " +
                       std::to_string(params.ctas_per_query));
  INFERSCALE_EXPECTS(namespaces.size() == 1 || static_cast<std::int64_t>(namespaces.size()) == nq,
                     "graph_index: give one namespace, or one per query (" + std::to_string(nq) +
                       "), not " + std::to_string(namespaces.size()));
  INFERSCALE_EXPECTS(ids_rows == nq && dist_rows == nq && ids_cols == k && dist_cols == k,
                     "graph_index: outputs must be [queries=" + std::to_string(nq) +
                       "][k=" + std::to_string(k) + "]");
  std::vector<std::int64_t> tenant_index(static_cast<std::size_t>(nq));
  for (std::int64_t q = 0; q < nq; ++q) {
    std::uint64_t const ns = namespaces.size() == 1 ? namespaces[0] : namespaces[q];
    auto it                = tenant_of_.find(ns);
    INFERSCALE_EXPECTS(it != tenant_of_.end(),
                       "graph_index: unknown namespace " + std::to_string(ns));
    tenant_index[static_cast<std::size_t>(q)] = static_cast<std::int64_t>(it->second);
  }
  return tenant_index;
}

template <class T>
std::vector<float> graph_index::prepare_queries(matrix_view<T const> queries) const
{
  INFERSCALE_EXPECTS(queries.extent(1) == config_.dim,
                     "graph_index: queries have " +
                       detail::count_of(queries.extent(1), "dimension") + ", the index " +
                       std::to_string(config_.dim));
  INFERSCALE_EXPECTS(queries.size() == 0 || queries.data_handle() != nullptr,
                     std::string{"graph_index: null query data"});
  std::int64_t const nq = queries.extent(0);
  std::vector<float> out(static_cast<std::size_t>(nq * row_elements_), 0.0f);
  std::vector<float> row(static_cast<std::size_t>(config_.dim));
  for (std::int64_t q = 0; q < nq; ++q) {
    for (std::int64_t e = 0; e < config_.dim; ++e) {
      float const x = to_float(queries(q, e));
      INFERSCALE_EXPECTS(std::isfinite(x),
                         "graph_index: query " + std::to_string(q) +
                           " has a NaN or infinite element at " + std::to_string(e));
      row[static_cast<std::size_t>(e)] = x;
    }
    // the device kernel normalises with the same double-precision lane order
    double const norm2 = detail::index::norm2_spec(row.data(), config_.dim);
    bool const cosine  = config_.metric == distance_metric::cosine;
    INFERSCALE_EXPECTS(
      !cosine || norm2 > 0.0,
      "graph_index: query " + std::to_string(q) + " is a zero vector, which has no cosine");
    // cosine compares directions: a denormal or huge query is normalised like any other
    INFERSCALE_EXPECTS(cosine || norm2 <= max_norm2,
                       "graph_index: query " + std::to_string(q) +
                         " has a squared norm above 1e30: its distances would overflow float32");
    float* const dst = out.data() + q * row_elements_;
    if (!cosine) {
      std::copy(row.begin(), row.end(), dst);
      continue;
    }
    double const scale = detail::index::cosine_scale(norm2);
    for (std::int64_t e = 0; e < config_.dim; ++e) {
      dst[e] = detail::index::cosine_normalised(row[static_cast<std::size_t>(e)], scale);
    }
  }
  return out;
}

INFERSCALE_INDEX_LINKAGE detail::index::search_plan graph_index::plan_for(
  std::uint32_t n, std::uint32_t k, search_params const& p) const noexcept
{
  detail::index::search_plan plan;
  plan.k              = k;
  plan.itopk          = resolved_itopk(p.itopk_size, k);
  plan.width          = p.search_width;
  plan.samplings      = std::max<std::uint32_t>(1, p.num_random_samplings);
  plan.xor_mask       = p.rand_xor_mask;
  plan.max_iterations = p.max_iterations != 0 ? p.max_iterations
                                              : detail::index::auto_max_iterations(
                                                  plan.itopk, plan.width, config_.graph_degree, n);
  return plan;
}

INFERSCALE_INDEX_LINKAGE search_params graph_index::resolve_split(search_params const& p,
                                                                  std::int64_t queries,
                                                                  std::uint32_t k) noexcept
{
  search_params r = p;
  if (r.ctas_per_query == 0) {
    r.ctas_per_query = auto_ctas_per_query(queries, resolved_itopk(p.itopk_size, k), k);
  }
  return r;
}

INFERSCALE_INDEX_LINKAGE search_params graph_index::split_part(search_params const& p,
                                                               std::uint32_t k,
                                                               std::uint32_t c) noexcept
{
  search_params part  = p;
  part.itopk_size     = split_itopk(resolved_itopk(p.itopk_size, k), k, p.ctas_per_query);
  part.rand_xor_mask  = p.rand_xor_mask ^ split_seed_mix(c);
  part.ctas_per_query = 1;
  return part;
}

INFERSCALE_INDEX_LINKAGE std::int64_t graph_index::exact_search_threshold(
  search_params const& p, std::uint32_t rows) const noexcept
{
  if (config_.exact_search_threshold >= 0) { return config_.exact_search_threshold; }
  if (config_.space == memory_space::host && p.host_mode == host_search_mode::fast) {
    return static_cast<std::int64_t>(
      detail::index::host_fast_graph_cost_factor *
      detail::index::estimated_fast_graph_distances(
        resolved_itopk(p.itopk_size, 1), entry_point_count(rows), config_.graph_degree));
  }
  double const factor = config_.space == memory_space::device
                          ? detail::index::device_graph_cost_factor
                          : detail::index::host_graph_cost_factor;
  auto const plan     = plan_for(rows, 1, p);
  return static_cast<std::int64_t>(
    factor * detail::index::estimated_graph_distances(plan, config_.graph_degree));
}

INFERSCALE_INDEX_LINKAGE bool graph_index::uses_exact(tenant_ref const& t,
                                                      search_params const& p) const noexcept
{
  if (p.algo == search_algo::exact) { return true; }
  if (p.algo == search_algo::graph) { return false; }
  return static_cast<std::int64_t>(t.live) <= exact_search_threshold(p, t.size);
}

// ---------------------------------------------------------------------------------------------
// One tenant

INFERSCALE_INDEX_LINKAGE void graph_index::search_tenant(
  tenant const& tn,
  float const* query,
  std::uint32_t k,
  search_params const& params,
  detail::index::search_scratch& scratch,
  std::vector<detail::index::search_entry>& result) const
{
  tenant_ref const& tr = tn.ref;
  unsigned char const* base =
    vectors_.data() + static_cast<std::size_t>(tr.row_begin * row_elements_) * element_size_;
  if (config_.vector_dtype == dtype::float32) {
    search_tenant_typed(
      reinterpret_cast<float const*>(base), tn, query, k, params, scratch, result);
  } else {
    search_tenant_typed(
      reinterpret_cast<half_t const*>(base), tn, query, k, params, scratch, result);
  }
}

template <class T>
void graph_index::search_tenant_typed(T const* rows,
                                      tenant const& tn,
                                      float const* query,
                                      std::uint32_t k,
                                      search_params const& params,
                                      detail::index::search_scratch& scratch,
                                      std::vector<detail::index::search_entry>& result) const
{
  tenant_ref const& tr        = tn.ref;
  std::uint8_t const* deleted = deleted_.data() + tr.row_begin;
  if (tr.live == 0) {
    result.clear();
    return;
  }
  if (params.host_mode == host_search_mode::fast) {
    auto const kernels     = detail::index::fast_kernels_for<T>(config_.metric);
    search_params resolved = params;  // the namespace's calibrated list when itopk_size is 0
    if (resolved.itopk_size == 0) { resolved.itopk_size = tn.default_ef; }
    if (uses_exact(tr, resolved)) {
      if constexpr (std::is_same_v<T, float>) {
        // cosine under float16 traversal: the scan reads the float16 copy (half the bytes) and
        // the rows within the copy's error bound of the k-th are measured again, so the result
        // is the float32 rows' exact top k all the same (other metrics have no bound: float32)
        if (traverses_fp16() && config_.metric == distance_metric::cosine) {
          assert(tn.traversal.size() >=
                 std::size_t{tr.size} * static_cast<std::size_t>(row_elements_));
          detail::index::exact_search_rounded(
            tn.traversal.data(),
            rows,
            row_elements_,
            tr.size,
            deleted,
            query,
            detail::index::fast_kernels_for<half_t>(config_.metric).scan,
            kernels.distance,
            k,
            2.0 * detail::index::cosine_fp16_error_bound(row_elements_),
            scratch,
            result);
          return;
        }
      }
      detail::index::exact_search_fast(
        rows, row_elements_, tr.size, deleted, query, kernels, k, scratch, result);
      return;
    }
    detail::index::fast_plan plan;
    plan.k  = k;
    plan.ef = std::max(resolved.itopk_size, k);
    // a namespace built before its entry points existed (none yet) seeds from the generator
    plan.entry_nodes    = tn.entries.empty() ? nullptr : tn.entries.data();
    plan.entry_rows     = packed_entry_rows(tn);  // null unless packed (and with no entries)
    plan.entry_count    = tn.entries.empty() ? entry_point_count(tr.size)
                                             : static_cast<std::uint32_t>(tn.entries.size());
    plan.xor_mask       = params.rand_xor_mask;
    plan.max_expansions = params.max_iterations * params.search_width;
    plan.neighbors      = params.host_neighbors;
    if constexpr (std::is_same_v<T, float>) {
      if (traverses_fp16()) {  // the walk on the float16 copy, the best entries measured again
        assert(tn.traversal.size() >=
               std::size_t{tr.size} * static_cast<std::size_t>(row_elements_));
        plan.k          = plan.ef;  // the whole list
        plan.entry_rows = tn.entry_traversal.empty() ? nullptr : tn.entry_traversal.data();
        auto& walked    = scratch.walked;
        detail::index::graph_search_fast(tn.traversal.data(),
                                         row_elements_,
                                         graph_.data() + tr.row_begin * config_.graph_degree,
                                         config_.graph_degree,
                                         tr.size,
                                         deleted,
                                         query,
                                         detail::index::fast_kernels_for<half_t>(config_.metric),
                                         plan,
                                         scratch,
                                         walked);
        double const window = config_.metric == distance_metric::cosine
                                ? 2.0 * detail::index::cosine_fp16_error_bound(row_elements_)
                                : std::numeric_limits<double>::infinity();
        detail::index::rerank_exact(
          rows, row_elements_, query, kernels.distance, walked, k, window, result);
        return;
      }
    }
    detail::index::graph_search_fast(rows,
                                     row_elements_,
                                     graph_.data() + tr.row_begin * config_.graph_degree,
                                     config_.graph_degree,
                                     tr.size,
                                     deleted,
                                     query,
                                     kernels,
                                     plan,
                                     scratch,
                                     result);
    return;
  }
  if (uses_exact(tr, params)) {
    detail::index::exact_search_host(
      rows, row_elements_, tr.size, deleted, query, config_.metric, k, result);
    return;
  }
  std::uint32_t const parts = params.ctas_per_query;
  std::vector<detail::index::search_entry> top;
  result.clear();
  for (std::uint32_t c = 0; c < parts; ++c) {
    auto const plan = plan_for(tr.size, k, parts == 1 ? params : split_part(params, k, c));
    detail::index::graph_search_host(rows,
                                     row_elements_,
                                     graph_.data() + tr.row_begin * config_.graph_degree,
                                     config_.graph_degree,
                                     tr.size,
                                     query,
                                     config_.metric,
                                     plan,
                                     scratch,
                                     top);
    std::uint32_t taken = 0;  // the part's first k live entries (a part's answer)
    for (auto const& e : top) {
      if (taken == k) { break; }
      if (e.node != detail::index::invalid_node && !deleted[e.node]) {
        result.push_back({e.distance, e.node, false});
        ++taken;
      }
    }
  }
  if (parts > 1) {  // the best k distinct nodes of the parts, as the device's merge_split_kernel
    std::sort(result.begin(), result.end());
    result.erase(std::unique(result.begin(),
                             result.end(),
                             [](auto const& a, auto const& b) { return a.node == b.node; }),
                 result.end());
    if (result.size() > k) { result.resize(k); }
  }
}

}  // namespace inferscale
