/**
 * @file detail/cache/overlap.hpp
 * @brief The overlap rule of paged_kv_cache::validate() (cache.hpp): whether strided address maps
 * touch any byte twice, and the names of the regions its messages speak of.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace inferscale {

namespace detail {
/// @brief One dimension of a strided address map: `extent` indices, `stride` bytes apart.
struct stride_dimension {
  std::int64_t extent{};
  std::int64_t stride{};
};

/**
 * @brief Whether a strided map of elements of `element_bytes` bytes touches every byte at most
 * once, by a sufficient rule: take the dimensions of extent > 1 by increasing stride; each
 * stride must exceed the reach of all smaller ones (`element_bytes - 1 + sum stride * (extent -
 * 1)` over them), so that, as in a mixed-radix number, no two index tuples give overlapping
 * elements. Every padded or permuted nesting of dimensions passes; a zero stride, or strides that
 * interleave (e.g. a token stride smaller than heads * head_dim with head stride head_dim), fail.
 * @param reach set to the byte offset of the last byte the map touches (when it passes)
 * @return false if the rule fails or the reach overflows 64 bits
 */
inline bool strides_disjoint(stride_dimension* dims,
                             int count,
                             std::int64_t element_bytes,
                             std::int64_t* reach)
{
  // Insertion sort: at most seven dimensions.
  for (int i = 1; i < count; ++i) {
    for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) {
      stride_dimension const t = dims[j];
      dims[j]                  = dims[j - 1];
      dims[j - 1]              = t;
    }
  }
  std::int64_t r = element_bytes - 1;
  for (int i = 0; i < count; ++i) {
    if (dims[i].extent <= 1) { continue; }
    if (dims[i].stride <= r) { return false; }
    std::int64_t const n = dims[i].extent - 1;
    if (dims[i].stride > (std::numeric_limits<std::int64_t>::max() - r) / n) { return false; }
    r += dims[i].stride * n;
  }
  *reach = r;
  return true;
}
/**
 * @brief Whether two regions with different layouts but the same blocks and heads (same extents
 * and strides: K and V sharing each (block, head) cell, as in vLLM's CPU cache) touch disjoint
 * bytes, by a sufficient rule: within one cell each region's tokens and dims reach an interval
 * `[base, base + inner span)`; the two intervals must not meet, and the blocks and heads must nest
 * over the union of both (each cell's stride beyond the union's span).
 * @param a, b  the layouts (each already valid); `base_a`, `base_b` their base addresses in bytes
 */
template <class Layout>
inline bool interleaved_blocks_disjoint(Layout const& a,
                                        std::int64_t base_a,
                                        Layout const& b,
                                        std::int64_t base_b,
                                        std::int64_t element_bytes)
{
  if (a.num_blocks != b.num_blocks || a.block_stride != b.block_stride ||
      a.num_heads != b.num_heads || a.head_stride != b.head_stride) {
    return false;
  }
  auto const inner_span = [element_bytes](Layout const& l) -> std::int64_t {
    stride_dimension dims[6];
    l.dimensions(element_bytes, dims);
    // tokens, dims, dim chunks, token chunks
    stride_dimension inner[4] = {dims[1], dims[3], dims[4], dims[5]};
    std::int64_t reach        = 0;
    return strides_disjoint(inner, 4, element_bytes, &reach) ? reach + 1 : -1;
  };
  std::int64_t const na = inner_span(a);
  std::int64_t const nb = inner_span(b);
  if (na <= 0 || nb <= 0) { return false; }
  constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 4;
  if (base_a > limit || base_b > limit || na > limit || nb > limit) { return false; }
  if (!(base_a + na <= base_b || base_b + nb <= base_a)) { return false; }
  std::int64_t const lo     = std::min(base_a, base_b);
  std::int64_t const union_ = std::max(base_a + na, base_b + nb) - lo;
  stride_dimension outer[2] = {{a.num_blocks, a.block_stride * element_bytes},
                               {a.num_heads, a.head_stride * element_bytes}};
  std::int64_t reach        = 0;
  return strides_disjoint(outer, 2, union_, &reach);
}

/// @brief "the key of layer 3" / "the value of layer 0" for messages about region `r` (K, V of
/// layer r / 2).
inline std::string cache_region_name(std::int32_t r)
{
  return std::string{r % 2 == 0 ? "the key" : "the value"} + " of layer " + std::to_string(r / 2);
}

}  // namespace detail

}  // namespace inferscale
