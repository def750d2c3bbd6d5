// Reading a KV store's pool (inferscale/store.hpp) back through its documented layout
// [num_pages][layers][2 (K, V)][page_size][heads][head_dim], written here independently of the
// store (element sizes too). Test-side code shared by the host and GPU store tests; free of Catch
// macros.
#pragma once

#include <inferscale/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace inferscale_test {

/// @brief Bytes of one element of the store's dtypes: float32, float16, bfloat16.
inline std::size_t bytes_of(inferscale::dtype t)
{
  return t == inferscale::dtype::float32 ? 4u : 2u;
}

/// @brief The pool's shape: the shard's layers and heads, head_dim, tokens per page, store dtype.
struct pool_shape {
  std::int64_t layers;  // the shard's
  std::int64_t heads;   // the shard's
  std::int64_t head_dim;
  std::int64_t page_size;
  inferscale::dtype store;
};

/// @brief Bits of element (layer l, K/V kv, token t of the fact, head h, dim e) of the fact whose
/// page list is `pages` (little-endian host); throws std::out_of_range when the element lies
/// outside `pool`.
inline std::uint32_t read_pool(std::vector<unsigned char> const& pool,
                               pool_shape const& s,
                               std::vector<std::int64_t> const& pages,
                               std::int64_t l,
                               int kv,
                               std::int64_t t,
                               std::int64_t h,
                               std::int64_t e)
{
  std::int64_t const page = pages.at(static_cast<std::size_t>(t / s.page_size));
  std::int64_t const slot = t % s.page_size;
  std::int64_t const index =
    ((((page * s.layers + l) * 2 + kv) * s.page_size + slot) * s.heads + h) * s.head_dim + e;
  std::size_t const b      = bytes_of(s.store);
  std::size_t const offset = static_cast<std::size_t>(index) * b;
  if (index < 0 || offset + b > pool.size()) { throw std::out_of_range("read_pool: outside"); }
  std::uint32_t bits = 0;
  std::memcpy(&bits, pool.data() + offset, b);
  return bits;
}

}  // namespace inferscale_test
