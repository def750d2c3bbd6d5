/**
 * @file
 * @brief detail::index::index_access: the library's own way into graph_index's private members
 * (index.hpp includes it after the class, as its definitions.inl; not part of the public API).
 */
#pragma once

// Included by <inferscale/index.hpp> after graph_index is complete.

namespace inferscale {

namespace detail::index {

/**
 * @brief The library's own way into `graph_index`'s internals (the class befriends it): what the
 * device backend (`index.cuh`) plans a search from, and what tests and benchmarks inspect (raw
 * rows, tenant segments, the fast host search's state, the compaction counters). Not part of the
 * public API: every function forwards to the private member of the same name, documented there.
 */
struct index_access {
  static std::int64_t row_elements(graph_index const& index) noexcept
  {
    return index.row_elements();
  }
  static std::uint32_t graph_degree(graph_index const& index) noexcept
  {
    return index.graph_degree();
  }
  static bool uses_nn_descent(graph_index const& index, std::uint32_t rows) noexcept
  {
    return index.uses_nn_descent(rows);
  }
  static nn_descent_report const& last_nn_descent(graph_index const& index) noexcept
  {
    return index.last_nn_descent();
  }
  static std::uint32_t host_entry_points(graph_index const& index, std::uint64_t ns) noexcept
  {
    return index.host_entry_points(ns);
  }
  static std::uint32_t host_default_ef(graph_index const& index, std::uint64_t ns) noexcept
  {
    return index.host_default_ef(ns);
  }
  static half_t const* host_traversal_rows(graph_index const& index, std::uint64_t ns) noexcept
  {
    return index.host_traversal_rows(ns);
  }
  static std::int64_t arena_rows_in_use(graph_index const& index) noexcept
  {
    return index.arena_rows_in_use();
  }
  static std::int64_t max_arena_rows(graph_index const& index) noexcept
  {
    return index.max_arena_rows();
  }
  static std::uint64_t compactions(graph_index const& index) noexcept
  {
    return index.compactions();
  }
  static tenant_ref tenant_segment(graph_index const& index, std::uint64_t ns) noexcept
  {
    return index.tenant_segment(ns);
  }
  static std::vector<tenant_ref> tenant_table(graph_index const& index)
  {
    return index.tenant_table();
  }
  static std::uint32_t const* graph_rows(graph_index const& index, std::uint64_t ns)
  {
    return index.graph_rows(ns);
  }
  static void const* vector_rows(graph_index const& index, std::uint64_t ns)
  {
    return index.vector_rows(ns);
  }
  static std::uint64_t const* id_rows(graph_index const& index, std::uint64_t ns)
  {
    return index.id_rows(ns);
  }
  static std::uint8_t const* deleted_rows(graph_index const& index, std::uint64_t ns)
  {
    return index.deleted_rows(ns);
  }
  static graph_index_ref ref(graph_index const& index) noexcept { return index.ref(); }
  static search_plan plan_for(graph_index const& index,
                              std::uint32_t n,
                              std::uint32_t k,
                              search_params const& p) noexcept
  {
    return index.plan_for(n, k, p);
  }
  static search_params resolve_split(search_params const& p,
                                     std::int64_t queries,
                                     std::uint32_t k) noexcept
  {
    return graph_index::resolve_split(p, queries, k);
  }
  static search_params split_part(search_params const& p, std::uint32_t k, std::uint32_t c) noexcept
  {
    return graph_index::split_part(p, k, c);
  }
  static bool uses_exact(graph_index const& index,
                         tenant_ref const& t,
                         search_params const& p) noexcept
  {
    return index.uses_exact(t, p);
  }
  template <class T>
  static std::vector<float> prepare_queries(graph_index const& index, matrix_view<T const> queries)
  {
    return index.prepare_queries(queries);
  }
  template <class T>
  static std::vector<std::int64_t> check_search(graph_index const& index,
                                                matrix_view<T const> queries,
                                                cuda::std::span<std::uint64_t const> namespaces,
                                                std::uint32_t k,
                                                search_params const& params,
                                                std::int64_t ids_rows,
                                                std::int64_t ids_cols,
                                                std::int64_t dist_rows,
                                                std::int64_t dist_cols)
  {
    return index.check_search(
      queries, namespaces, k, params, ids_rows, ids_cols, dist_rows, dist_cols);
  }
};

}  // namespace detail::index

}  // namespace inferscale
