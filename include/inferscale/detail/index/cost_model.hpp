/**
 * @file detail/index/cost_model.hpp
 * @brief The index's search cost model: the measured factors and the distance estimates that
 * choose, under `search_algo::automatic`, between the exact scan and the graph search of a
 * namespace (`graph_index::exact_search_threshold`).
 */
#pragma once

#include <inferscale/detail/index/search_host.hpp>

#include <cstdint>

namespace inferscale::detail::index {

/**
 * @brief The automatic exact/graph switch-over as a cost model: a graph search computes about
 * `graph_cost_factor * estimated_graph_distances(plan)` distances' worth of work, an exact search
 * one per live fact, so a tenant is searched exactly while `live <= factor * estimate`.
 *
 * Host factor, measured (bench_index `host/crossover`, and bench/results/2026-11-30-index-host.md):
 * at the batch-1 latency parity point the ratio was 0.48-0.61 for N = 500..8000 at 384-d
 * (itopk 64, 8 samplings, degree 32), i.e. a threshold of about 1,600 facts.
 * Device factor: an estimate, NOT yet measured on a GPU (a CTA scans exactly with all its teams
 * at once, while a graph iteration has only `width * degree` distances to spread over them);
 * `bench_index device/crossover` prints the measured crossover beside it.
 */
inline constexpr double host_graph_cost_factor   = 0.55;
inline constexpr double device_graph_cost_factor = 2.0;

/**
 * @brief The same for the host's fast search (`host_search_mode::fast`): its graph search costs
 * about `host_fast_graph_cost_factor * estimated_fast_graph_distances(...)` exact-scan distances
 * (a graph distance reads a row at random, an exact one streams it). Measured at batch 1 on the
 * 384-d 100-cluster mixture with the default search_params: the graph's and the exact search's
 * times cross between 1,500 rows (exact 0.83x the graph's time) and 2,000 rows (1.49x), about
 * 1,700, where the estimate is 1,209 distances: factor 1.4
 * (bench/results/2026-12-01-index-search-host.md).
 */
inline constexpr double host_fast_graph_cost_factor = 1.4;

/// @brief Estimate of the distances a fast host search computes: its entry points, then about
/// `degree / 2` new neighbours for each of about `ef` expanded nodes.
constexpr double estimated_fast_graph_distances(std::uint32_t ef,
                                                std::uint32_t entries,
                                                std::uint32_t degree) noexcept
{
  return static_cast<double>(entries) + static_cast<double>(ef) * degree / 2.0;
}

/// @brief Upper estimate of the distances a graph search computes: seeds, then every iteration.
constexpr double estimated_graph_distances(search_plan const& plan, std::uint32_t degree) noexcept
{
  return static_cast<double>(plan.itopk + plan.width * degree) * plan.samplings +
         static_cast<double>(plan.max_iterations) * plan.width * degree;
}

}  // namespace inferscale::detail::index
