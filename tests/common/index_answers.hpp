/**
 * @file index_answers.hpp
 * @brief The index tests' search call: a host search of `queries` ([nq][dim], row-major) with
 * outputs prefilled by a sentinel (ids 12345, distances -7), so an output the search did not write
 * shows.
 */
#pragma once

#include <inferscale/index.hpp>

#include <cstdint>
#include <vector>

namespace inferscale::test {

/// @brief A query set's answers, row-major [q][k].
struct answers {
  std::vector<std::uint64_t> ids;
  std::vector<float> distances;
};

/// @brief `inferscale::search` of every query: query q in `namespaces[q]` (or all in
/// `namespaces[0]`).
inline answers run_search(graph_index const& index,
                          std::vector<float> const& queries,
                          std::vector<std::uint64_t> const& namespaces,
                          std::uint32_t k,
                          search_params const& p)
{
  std::int64_t const nq = static_cast<std::int64_t>(queries.size()) / index.dim();
  answers a;
  a.ids.assign(static_cast<std::size_t>(nq) * k, 12345);
  a.distances.assign(a.ids.size(), -7.0f);
  inferscale::search(index,
                     make_matrix_view(queries.data(), nq, index.dim()),
                     cuda::std::span<std::uint64_t const>{namespaces.data(), namespaces.size()},
                     k,
                     p,
                     make_matrix_view(a.ids.data(), nq, k),
                     make_matrix_view(a.distances.data(), nq, k));
  return a;
}

}  // namespace inferscale::test
