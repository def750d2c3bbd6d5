/**
 * @file degenerate_vectors.hpp
 * @brief The fact index's degenerate inputs (issue 49), per metric and dtype the ones the index
 * accepts: all zeros (not under cosine), float32 denormals, the largest finite values it takes
 * (cosine: float32's largest; inner product and squared L2: |x|^2 just below 1e30, or float16's
 * largest under float16), duplicates of one vector, and namespaces whose rows are all identical.
 */
#pragma once

#include <inferscale/detail/index/math.hpp>
#include <inferscale/dtype.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace inferscale::test {

/// @brief Rows of three namespaces and the queries, row-major `[n][dim]`, each with a name.
struct degenerate_set {
  std::int64_t dim{0};
  std::vector<float> mixed;  ///< namespace 1: ordinary rows beside every degenerate kind
  std::vector<std::string> mixed_names;
  std::vector<float> identical;             ///< namespace 2: one ordinary vector, 30 times
  std::vector<float> degenerate_identical;  ///< namespace 3: zero rows, or (cosine) one denormal
  std::vector<float> queries;
  std::vector<std::string> query_names;

  std::int64_t rows(std::vector<float> const& v) const
  {
    return static_cast<std::int64_t>(v.size()) / dim;
  }
};

/// @brief The set for `metric` and `vector_dtype` in `dim` dimensions (deterministic).
inline degenerate_set make_degenerate_set(distance_metric metric,
                                          dtype vector_dtype,
                                          std::int64_t dim = 20)
{
  bool const cosine   = metric == distance_metric::cosine;
  bool const half     = vector_dtype == dtype::float16;
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  auto uniform        = [&] {  // xorshift64 in [-1, 1)
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0);
  };
  auto ordinary = [&] {
    std::vector<float> v(static_cast<std::size_t>(dim));
    for (auto& x : v) {
      x = uniform();
    }
    return v;
  };
  auto scaled = [](std::vector<float> v, float s) {
    for (auto& x : v) {
      x *= s;
    }
    return v;
  };
  float const denorm_min = std::numeric_limits<float>::denorm_min();  // 2^-149
  // every element a denormal: |x| < 2^-126
  auto denormal = [&] { return scaled(ordinary(), 0x1.0p-130f); };
  std::vector<float> zero(static_cast<std::size_t>(dim), 0.0f);
  std::vector<float> one_denormal = zero;  // a single denorm_min
  one_denormal[7 % dim]           = denorm_min;
  std::vector<float> mixed_scale  = zero;  // a normal element beside denormals
  mixed_scale[0]                  = 1.0f;
  mixed_scale[1 % dim]            = denorm_min;
  mixed_scale[2 % dim]            = -3 * denorm_min;
  // the largest values accepted: every element, and one element alone
  float const largest_all = cosine ? std::numeric_limits<float>::max()
                            : half
                              ? 65504.0f
                              : static_cast<float>(std::sqrt(0.95e30 / static_cast<double>(dim)));
  float const largest_one = cosine ? std::numeric_limits<float>::max()
                            : half ? 65504.0f
                                   : 9.9e14f;  // squared 9.8e29
  std::vector<float> largest(static_cast<std::size_t>(dim));
  for (std::int64_t e = 0; e < dim; ++e) {
    largest[static_cast<std::size_t>(e)] = e % 2 == 0 ? largest_all : -largest_all;
  }
  std::vector<float> single_largest = zero;
  single_largest[0]                 = -largest_one;

  degenerate_set s;
  s.dim     = dim;
  auto push = [](std::vector<float>& to,
                 std::vector<std::string>* names,
                 std::string name,
                 std::vector<float> const& v) {
    to.insert(to.end(), v.begin(), v.end());
    if (names != nullptr) { names->push_back(std::move(name)); }
  };
  std::vector<float> const duplicated = ordinary();
  for (int i = 0; i < 20; ++i) {
    push(s.mixed, &s.mixed_names, "ordinary", ordinary());
  }
  for (int i = 0; i < 4; ++i) {
    push(s.mixed, &s.mixed_names, "duplicate", duplicated);
  }
  for (int i = 0; i < 3; ++i) {
    push(s.mixed, &s.mixed_names, "denormal", denormal());
  }
  push(s.mixed, &s.mixed_names, "one denorm_min", one_denormal);
  push(s.mixed, &s.mixed_names, "1 beside denormals", mixed_scale);
  push(s.mixed, &s.mixed_names, "largest", largest);
  push(s.mixed, &s.mixed_names, "single largest", single_largest);
  if (cosine) {  // the duplicated vector's direction at a denormal and a huge scale
    push(s.mixed, &s.mixed_names, "duplicate * 2^-130", scaled(duplicated, 0x1.0p-130f));
    push(s.mixed, &s.mixed_names, "duplicate * 2^100", scaled(duplicated, 0x1.0p100f));
  } else {
    push(s.mixed, &s.mixed_names, "zero", zero);
    push(s.mixed, &s.mixed_names, "zero", zero);
  }
  std::vector<float> const same = ordinary();
  for (int i = 0; i < 30; ++i) {
    push(s.identical, nullptr, "", same);
  }
  for (int i = 0; i < 12; ++i) {
    push(s.degenerate_identical, nullptr, "", cosine ? one_denormal : zero);
  }

  push(s.queries, &s.query_names, "ordinary", ordinary());
  push(s.queries, &s.query_names, "the duplicate", duplicated);
  push(s.queries, &s.query_names, "denormal", denormal());
  push(s.queries, &s.query_names, "one denorm_min", one_denormal);
  push(s.queries, &s.query_names, "1 beside denormals", mixed_scale);
  push(s.queries, &s.query_names, "largest", largest);
  push(s.queries, &s.query_names, "single largest", scaled(single_largest, -1.0f));
  if (cosine) {
    push(s.queries, &s.query_names, "the duplicate * 2^-130", scaled(duplicated, 0x1.0p-130f));
  } else {
    push(s.queries, &s.query_names, "zero", zero);
  }
  return s;
}

}  // namespace inferscale::test
