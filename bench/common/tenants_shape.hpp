/**
 * @file bench/common/tenants_shape.hpp
 * @brief The multi-tenant workload shape (issue 32), one definition for every benchmark that
 * measures it: the host (bench_index_tenants), the device (bench_index's index/device/tenants)
 * and the serving step on llama.cpp (locomo_eval --step).
 *
 *  - user u's namespace size: a discretised log-normal clipped to [50, 5000],
 *    n_u = clamp(round(exp(ln 100 + 1.0 z)), 50, 5000), z ~ N(0, 1) drawn in user order from
 *    std::mt19937_64(20261205) (libstdc++'s std::normal_distribution): median 100, about a quarter
 *    of the users at 50, mean ~165, p99 ~1,000, a few users in the thousands;
 *  - user u's vectors: its own Gaussian mixture (tests/common/gaussian_mixture.hpp) of
 *    1 + n_u / 50 anisotropic centres, L2-normalised, seeded 20261205 + 1,000,003 dim + u; a
 *    user's queries are drawn from it first, then its n_u facts.
 */
#pragma once

#include <gaussian_mixture.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace inferscale::bench::tenants {

inline constexpr std::uint64_t size_seed = 20261205;
inline constexpr std::uint64_t data_seed = 20261205;
inline constexpr double size_median      = 100.0;
inline constexpr double size_sigma       = 1.0;
inline constexpr std::uint32_t size_min  = 50;
inline constexpr std::uint32_t size_max  = 5000;

/// @brief The namespace sizes of users 0 .. users - 1 (see the file comment).
inline std::vector<std::uint32_t> namespace_sizes(std::int64_t users)
{
  std::mt19937_64 rng{size_seed};
  std::normal_distribution<double> normal;
  std::vector<std::uint32_t> sizes(static_cast<std::size_t>(users));
  for (auto& n : sizes) {
    double const x = std::round(std::exp(std::log(size_median) + size_sigma * normal(rng)));
    n              = static_cast<std::uint32_t>(std::clamp(x, double{size_min}, double{size_max}));
  }
  return sizes;
}

/**
 * @brief Which user each of `count` queries belongs to, and which of its own queries it is: query
 * i is user perm[i mod users]'s (i div users)-th, perm a random permutation of the users
 * (std::shuffle with std::mt19937_64(20261206)). So with more users than queries the queries come
 * from distinct users drawn uniformly (most of them small), and with fewer every user is queried.
 */
struct query_owner {
  std::int64_t user;
  std::int64_t nth;  ///< the user's own query number
};

inline std::vector<query_owner> query_owners(std::int64_t users, std::int64_t count)
{
  std::vector<std::int64_t> perm(static_cast<std::size_t>(users));
  for (std::int64_t u = 0; u < users; ++u) {
    perm[static_cast<std::size_t>(u)] = u;
  }
  std::mt19937_64 order{20261206};
  std::shuffle(perm.begin(), perm.end(), order);
  std::vector<query_owner> out(static_cast<std::size_t>(count));
  for (std::int64_t q = 0; q < count; ++q) {
    out[static_cast<std::size_t>(q)] = {perm[static_cast<std::size_t>(q % users)], q / users};
  }
  return out;
}

/// @brief User `u`'s vectors: `queries` queries, then its `n` facts (row-major, `dim` floats each).
struct user_data {
  std::vector<float> queries;
  std::vector<float> facts;
};

inline user_data user_vectors(std::int64_t u,
                              std::int64_t dim,
                              std::uint32_t n,
                              std::int64_t queries)
{
  test::gaussian_mixture mix{test::mixture_spec{
    dim,
    1 + n / 50,
    true,
    data_seed + 1000003 * static_cast<std::uint64_t>(dim) + static_cast<std::uint64_t>(u)}};
  user_data d;
  d.queries = mix.draw(queries);
  d.facts   = mix.draw(n);
  return d;
}

}  // namespace inferscale::bench::tenants
