/**
 * @file index_reference.hpp
 * @brief The index tests' independent distance: the metric's definition evaluated in double.
 */
#pragma once

#include <inferscale/detail/index/math.hpp>

#include <cstdint>

namespace inferscale::test {

/// @brief Distance between `a` and `b` (`n` elements) by definition, in double: -dot (inner
/// product), 1 - dot (cosine, on normalised vectors), squared L2.
inline double reference_distance(float const* a, float const* b, std::int64_t n, distance_metric m)
{
  double dot = 0.0, l2 = 0.0;
  for (std::int64_t e = 0; e < n; ++e) {
    dot += double{a[e]} * b[e];
    l2 += (double{a[e]} - b[e]) * (double{a[e]} - b[e]);
  }
  switch (m) {
    case distance_metric::inner_product: return -dot;
    case distance_metric::cosine: return 1.0 - dot;
    case distance_metric::squared_l2: return l2;
  }
  return 0.0;
}

}  // namespace inferscale::test
