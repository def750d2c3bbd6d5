/**
 * @file math.hpp
 * @brief The index's per-element math, shared by the host backend and the device kernels:
 * distances in one fixed summation order, the seed generator and the automatic iteration bound.
 *
 * Host and device must return the same neighbours for the same graph and seeds, so every
 * floating-point operation of a distance happens in the same order on both sides: a distance is
 * computed by a *team* of `team` lanes; lane `l` accumulates the 16-byte chunks `l, l + team, ...`
 * of the row in element order with separately rounded multiplies and adds (never fused), and the
 * lanes' partial sums are combined by a butterfly (`p[l] + p[l ^ o]` for `o = team/2 .. 1`), which
 * leaves the same value in every lane because fp32 addition is commutative. The device kernel does
 * exactly this with warp shuffles; `team_distance` below does it with a loop.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/dtype.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace inferscale {

/// @brief How two embeddings are compared. Every distance is "smaller is closer".
enum class distance_metric : std::uint8_t {
  inner_product,  ///< distance = -dot(q, x)
  cosine,         ///< vectors and queries are L2-normalised on the way in; distance = 1 - dot(q, x)
  squared_l2      ///< distance = sum((q - x)^2)
};

/// @brief Name of a metric ("inner_product", "cosine", "squared_l2").
inline char const* to_string(distance_metric m) noexcept
{
  switch (m) {
    case distance_metric::inner_product: return "inner_product";
    case distance_metric::cosine: return "cosine";
    case distance_metric::squared_l2: return "squared_l2";
  }
  return "unknown";
}

/// @brief The id reported for an empty result slot (k larger than the live set).
inline constexpr std::uint64_t invalid_fact_id = ~std::uint64_t{0};

namespace detail::index {

/// @brief An empty graph slot or an unused buffer entry (local node ids are below 2^31).
inline constexpr std::uint32_t invalid_node = 0xFFFFFFFFu;

/// @brief Stored rows are padded to a multiple of 16 bytes (zeros), so the chunks are aligned.
inline constexpr int chunk_bytes = 16;

template <class T>
inline constexpr int chunk_elements = chunk_bytes / static_cast<int>(sizeof(T));

/// @brief Row length in elements after padding `dim` to whole 16-byte chunks of `T`.
constexpr std::int64_t padded_dim(std::int64_t dim, std::size_t element_size) noexcept
{
  std::int64_t const per_chunk = chunk_bytes / static_cast<std::int64_t>(element_size);
  return round_up(dim, per_chunk);
}

/**
 * @brief Lanes per distance for rows of `chunks` 16-byte chunks: about four chunks per lane,
 * a power of two between 2 and 32 (CAGRA's team sizes; 384-d fp32 -> 16, 768-d fp32 -> 32).
 */
INFERSCALE_HOST_DEVICE constexpr int team_size_for(std::int64_t chunks) noexcept
{
  int team = 2;
  while (team < 32 && std::int64_t{team} * 2 * 4 <= chunks) {
    team *= 2;
  }
  return team;
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float mul_rn(float a, float b) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return unfused(a * b);  // never fused with the addition it feeds, whatever the flags
#endif
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float add_rn(float a, float b) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float sub_rn(float a, float b) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

/**
 * @brief One lane's partial sum: chunks `lane, lane + team, ...` of a padded row against the
 * (padded, fp32) query, elements in order. Inner product and cosine accumulate `x * q`, squared
 * L2 accumulates `(x - q)^2`.
 */
template <class T>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float lane_partial(
  T const* row, float const* query, std::int64_t chunks, int lane, int team, bool l2) noexcept
{
  constexpr int per_chunk = chunk_elements<T>;
  float acc               = 0.0f;
  for (std::int64_t c = lane; c < chunks; c += team) {
    INFERSCALE_UNROLL
    for (int e = 0; e < per_chunk; ++e) {
      float const x = to_float(row[c * per_chunk + e]);
      float const q = query[c * per_chunk + e];
      if (l2) {
        float const d = sub_rn(x, q);
        acc           = add_rn(acc, mul_rn(d, d));
      } else {
        acc = add_rn(acc, mul_rn(x, q));
      }
    }
  }
  return acc;
}

/// @brief Maps the combined sum (a dot product or a squared L2) to the metric's distance.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE float finish_distance(float sum,
                                                                    distance_metric m) noexcept
{
  switch (m) {
    case distance_metric::inner_product: return -sum;
    case distance_metric::cosine: return sub_rn(1.0f, sum);
    case distance_metric::squared_l2: return sum;
  }
  return sum;
}

/// @brief The butterfly that combines `team` lane partials (`p[l] + p[l ^ o]`, o = team/2 .. 1),
/// written as a loop: every lane ends with the same value; lane 0's is returned.
inline float butterfly_sum(float* partial, int team) noexcept
{
  for (int o = team / 2; o >= 1; o /= 2) {
    float next[32];
    for (int l = 0; l < team; ++l) {
      next[l] = add_rn(partial[l], partial[l ^ o]);
    }
    for (int l = 0; l < team; ++l) {
      partial[l] = next[l];
    }
  }
  return partial[0];
}

template <int Team, class T>
inline float team_distance_fixed(T const* row,
                                 float const* query,
                                 std::int64_t chunks,
                                 distance_metric m) noexcept
{
  // Lane l's chunks are l, l + Team, ...: round r holds chunk r * Team + l of every lane, so
  // looping rounds, then elements, then lanes keeps each lane's order (chunks ascending, elements
  // in order) while the innermost loop runs across lanes (vectorisable: Team is a constant).
  constexpr int per_chunk = chunk_elements<T>;
  bool const l2           = m == distance_metric::squared_l2;
  float partial[Team]     = {};
  std::int64_t const full = chunks / Team;
  for (std::int64_t r = 0; r < full; ++r) {
    T const* x     = row + r * Team * per_chunk;
    float const* q = query + r * Team * per_chunk;
    float xs[Team * per_chunk];
    for (int i = 0; i < Team * per_chunk; ++i) {
      xs[i] = to_float(x[i]);
    }
    for (int e = 0; e < per_chunk; ++e) {
      if (l2) {
        for (int l = 0; l < Team; ++l) {
          float const d = sub_rn(xs[l * per_chunk + e], q[l * per_chunk + e]);
          partial[l]    = add_rn(partial[l], mul_rn(d, d));
        }
      } else {
        for (int l = 0; l < Team; ++l) {
          partial[l] = add_rn(partial[l], mul_rn(xs[l * per_chunk + e], q[l * per_chunk + e]));
        }
      }
    }
  }
  int const tail_lanes = static_cast<int>(chunks - full * Team);
  for (int l = 0; l < tail_lanes; ++l) {
    T const* x     = row + (full * Team + l) * per_chunk;
    float const* q = query + (full * Team + l) * per_chunk;
    for (int e = 0; e < per_chunk; ++e) {
      float const v = to_float(x[e]);
      if (l2) {
        float const d = sub_rn(v, q[e]);
        partial[l]    = add_rn(partial[l], mul_rn(d, d));
      } else {
        partial[l] = add_rn(partial[l], mul_rn(v, q[e]));
      }
    }
  }
  return finish_distance(butterfly_sum(partial, Team), m);
}

/**
 * @brief The distance between a stored row and a query exactly as a device team computes it
 * (lane partials, then a butterfly). This is the host backend's distance and the reference the
 * device kernels are checked against bit for bit.
 */
template <class T>
inline float team_distance(
  T const* row, float const* query, std::int64_t chunks, int team, distance_metric m) noexcept
{
  switch (team) {
    case 2: return team_distance_fixed<2>(row, query, chunks, m);
    case 4: return team_distance_fixed<4>(row, query, chunks, m);
    case 8: return team_distance_fixed<8>(row, query, chunks, m);
    case 16: return team_distance_fixed<16>(row, query, chunks, m);
    default: return team_distance_fixed<32>(row, query, chunks, m);
  }
}

/// @brief `team_distance` written lane by lane with `lane_partial` (the device's own order);
/// the tests check that both give the same bits.
template <class T>
inline float team_distance_by_lane(
  T const* row, float const* query, std::int64_t chunks, int team, distance_metric m) noexcept
{
  bool const l2     = m == distance_metric::squared_l2;
  float partial[32] = {};
  for (int l = 0; l < team; ++l) {
    partial[l] = lane_partial(row, query, chunks, l, team, l2);
  }
  return finish_distance(butterfly_sum(partial, team), m);
}

/**
 * @brief Squared norm of `dim` fp32 values in double, in the order a warp computes it: element
 * `e` goes to lane `e % 32`, each lane sums in order, then a butterfly over the 32 lanes. Used to
 * normalise cosine queries identically on host and device (`cosine_scale`, `cosine_normalised`).
 */
INFERSCALE_HOST_DEVICE inline double lane_norm2(float const* x, std::int64_t dim, int lane) noexcept
{
  double acc = 0.0;
  for (std::int64_t e = lane; e < dim; e += 32) {
    double const v = x[e];
#if INFERSCALE_IS_DEVICE_CODE
    acc = __dadd_rn(acc, __dmul_rn(v, v));
#else
    acc = acc + v * v;
#endif
  }
  return acc;
}

/// @brief The butterfly of `lane_norm2` over 32 lanes, written as a loop (host reference).
inline double norm2_spec(float const* x, std::int64_t dim) noexcept
{
  double partial[32];
  for (int l = 0; l < 32; ++l) {
    partial[l] = lane_norm2(x, dim, l);
  }
  for (int o = 16; o >= 1; o /= 2) {
    double next[32];
    for (int l = 0; l < 32; ++l) {
      next[l] = partial[l] + partial[l ^ o];
    }
    for (int l = 0; l < 32; ++l) {
      partial[l] = next[l];
    }
  }
  return partial[0];
}

/**
 * @brief The cosine scale of a vector of squared norm `norm2` (> 0, finite): 1 / sqrt(norm2),
 * correctly rounded in double. It stays in double: for a vector of float32 denormals (norm below
 * about 1e-38) it exceeds float32's range, where a float scale would be +inf and the normalised
 * elements Inf or NaN (issue 49). Every finite non-zero float vector has a finite scale: its
 * squared norm lies between 2^-298 and 2^256 times the dimension, well inside double's range.
 */
INFERSCALE_HOST_DEVICE inline double cosine_scale(double norm2) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __ddiv_rn(1.0, __dsqrt_rn(norm2));
#else
  return 1.0 / std::sqrt(norm2);
#endif
}

/**
 * @brief One element of a cosine-normalised vector: `x * scale` in double, rounded once to
 * float32 (the same bits on host and device). A unit vector's elements are at most 1, so the
 * result is finite whatever the vector's magnitude.
 */
INFERSCALE_HOST_DEVICE inline float cosine_normalised(float x, double scale) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  return __double2float_rn(__dmul_rn(static_cast<double>(x), scale));
#else
  return static_cast<float>(static_cast<double>(x) * scale);
#endif
}

/// @brief xorshift64 (Marsaglia), the generator CAGRA draws its random seed nodes from.
INFERSCALE_HOST_DEVICE constexpr std::uint64_t xorshift64(std::uint64_t x) noexcept
{
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return x;
}

/**
 * @brief Seed draw `sampling` of buffer slot `slot`: a node in `[0, n)`. Depends only on the
 * slot, the draw and the mask, never on the query's place in a batch, so a query gets the same
 * answer alone or batched.
 */
INFERSCALE_HOST_DEVICE constexpr std::uint32_t seed_node(std::uint32_t slot,
                                                         std::uint32_t sampling,
                                                         std::uint32_t samplings,
                                                         std::uint64_t xor_mask,
                                                         std::uint32_t n) noexcept
{
  std::uint64_t const counter = std::uint64_t{slot} * samplings + sampling + 1;
  return static_cast<std::uint32_t>(xorshift64(counter ^ xor_mask) % n);
}

/**
 * @brief CAGRA's automatic iteration bound: `itopk / search_width + h`, `h` the smallest integer
 * with `max(2, degree / 2)^h >= n`.
 */
INFERSCALE_HOST_DEVICE constexpr std::uint32_t auto_max_iterations(std::uint32_t itopk,
                                                                   std::uint32_t search_width,
                                                                   std::uint32_t degree,
                                                                   std::uint64_t n) noexcept
{
  std::uint64_t const fanout = degree / 2 < 2 ? 2 : degree / 2;
  std::uint32_t h            = 0;
  for (std::uint64_t reach = 1; reach < n; reach *= fanout) {
    ++h;
  }
  return itopk / search_width + h;
}

/// @brief Buffer entries compare by (distance, node): a total order, so sorting is unique.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool entry_less(float da,
                                                              std::uint32_t ia,
                                                              float db,
                                                              std::uint32_t ib) noexcept
{
  return da < db || (da == db && ia < ib);
}

}  // namespace detail::index
}  // namespace inferscale
