/**
 * @file contraction_index.cpp
 * @brief The index's reference distance (`team_distance`, the order a device team uses) under
 * -O3 -march=native -ffp-contract=fast, against the same order written out here with every
 * product formed in double and rounded to fp32 through a volatile (so neither the compiler nor
 * this test can fuse it with the addition): identical bits, or the host/device equality the
 * README states would not survive a consumer's flags.
 */
#include <inferscale/detail/index/math.hpp>
#include <inferscale/dtype.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

using namespace inferscale;

namespace {

/// `x * y` rounded once to fp32: the double product of two floats is exact, then one rounding.
float product_rounded_once(float x, float y)
{
  double const volatile p = static_cast<double>(x) * static_cast<double>(y);
  return static_cast<float>(p);
}

/// The device team's order: lane l sums chunks l, l + team, ... (elements in order), then a
/// butterfly p[l] + p[l ^ o] for o = team / 2 .. 1; the metric's finish.
template <class T>
float team_order_distance(
  T const* row, float const* q, std::int64_t chunks, int team, distance_metric m)
{
  constexpr int per_chunk = detail::index::chunk_elements<T>;
  bool const l2           = m == distance_metric::squared_l2;
  std::vector<float> partial(static_cast<std::size_t>(team), 0.0f);
  for (int l = 0; l < team; ++l) {
    float acc = 0.0f;
    for (std::int64_t c = l; c < chunks; c += team) {
      for (int e = 0; e < per_chunk; ++e) {
        float const x = to_float(row[c * per_chunk + e]);
        float const y = q[c * per_chunk + e];
        if (l2) {
          float const volatile d = x - y;
          acc                    = acc + product_rounded_once(d, d);
        } else {
          acc = acc + product_rounded_once(x, y);
        }
      }
    }
    partial[static_cast<std::size_t>(l)] = acc;
  }
  for (int o = team / 2; o >= 1; o /= 2) {
    std::vector<float> next(partial.size());
    for (int l = 0; l < team; ++l) {
      next[static_cast<std::size_t>(l)] =
        partial[static_cast<std::size_t>(l)] + partial[static_cast<std::size_t>(l ^ o)];
    }
    partial = next;
  }
  float const sum = partial[0];
  switch (m) {
    case distance_metric::inner_product: return -sum;
    case distance_metric::cosine: return 1.0f - sum;
    default: return sum;
  }
}

}  // namespace

TEST_CASE("the reference distance keeps one rounding per product under -ffp-contract=fast",
          "[index][contraction]")
{
  std::mt19937 rng(41);
  std::normal_distribution<float> normal;
  for (std::int64_t dim : {4, 64, 100, 384, 768}) {
    for (auto m :
         {distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2}) {
      auto check = [&](auto tag) {
        using T                   = decltype(tag);
        std::int64_t const row    = detail::index::padded_dim(dim, sizeof(T));
        std::int64_t const chunks = row / detail::index::chunk_elements<T>;
        std::vector<T> x(static_cast<std::size_t>(row), from_float<T>(0.0f));
        std::vector<float> q(static_cast<std::size_t>(row), 0.0f);
        int differing = 0;
        for (int trial = 0; trial < 50; ++trial) {
          for (std::int64_t e = 0; e < dim; ++e) {
            x[static_cast<std::size_t>(e)] = from_float<T>(normal(rng));
            q[static_cast<std::size_t>(e)] = normal(rng);
          }
          for (int team : {2, 4, 8, 16, 32}) {
            float const got  = detail::index::team_distance(x.data(), q.data(), chunks, team, m);
            float const want = team_order_distance(x.data(), q.data(), chunks, team, m);
            differing += std::memcmp(&got, &want, sizeof(float)) != 0 ? 1 : 0;
          }
        }
        CAPTURE(dim, to_string(m), sizeof(T));
        CHECK(differing == 0);
      };
      check(float{});
      check(half_t{});
    }
  }
}
