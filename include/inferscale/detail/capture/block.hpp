/**
 * @file detail/capture/block.hpp
 * @brief The device capture's per-element code (device_kv_capture, kv_capture.cuh): a hook's
 * strided rows converted to fp32 into the capture buffer (capture_write_element), the facts'
 * captured rows checked finite in the store dtype before anything is stored
 * (capture_check_element), and captured rows converted to the store dtype and scattered into
 * facts' pool pages (capture_scatter_element), as __host__ __device__ functions that
 * detail/capture/kernels.cuh wraps in __global__ shells and that a plain C++ compiler compiles too
 * (the host test runs every element of a launch on the CPU with them); plus the host side of a
 * scatter, its page list (append_scatter_pages), built without any CUDA call.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/dtype/conversion.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace inferscale::detail {

/// @brief True unless `x` is NaN or an infinity (on the bits: the same on the host and device).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool finite_bits(float x) noexcept
{
  return (float_bits(x) & 0x7f800000u) != 0x7f800000u;
}

/**
 * @brief True when captured `x` stores as a finite value of StoreT: `x` is neither NaN nor an
 * infinity, nor beyond StoreT's range (rounded to an infinity by from_float). The host capture's
 * check (engine.hpp) asks the same of every element.
 */
template <class StoreT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool stores_finite(float x) noexcept
{
  return finite_bits(x) && finite_bits(to_float(from_float<StoreT>(x)));
}

/**
 * @brief One hook write into the capture buffer: `count` tokens of `[heads, head_dim]` rows of a
 * device view (element type T, any non-negative strides) into the buffer's contiguous fp32 rows.
 */
template <class T>
struct capture_write_args {
  float* rows;  ///< the buffer's row of (layer, first token); `count * heads * head_dim` follow
  T const* src;
  std::int64_t count;
  std::int64_t heads;
  std::int64_t head_dim;
  std::int64_t token_stride;  ///< in elements of T, as the view's strides
  std::int64_t head_stride;
  std::int64_t dim_stride;
};

/// @brief Elements of a write: one per (token, head, dim).
template <class T>
INFERSCALE_HOST_DEVICE std::int64_t capture_write_elements(capture_write_args<T> const& a) noexcept
{
  return a.count * a.heads * a.head_dim;
}

/**
 * @brief Element `i` (= (token * heads + head) * head_dim + dim) of a write: the source element
 * converted to fp32 (exact from float, half_t and bfloat16_t).
 * @pre 0 <= i < capture_write_elements(a)
 */
template <class T>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void capture_write_element(
  capture_write_args<T> const& a, std::int64_t i) noexcept
{
  index_quotient const td = index_divmod(i, a.head_dim);  // (token * heads + head, dim)
  index_quotient const th = index_divmod(td.quotient, a.heads);
  a.rows[i] = to_float(a.src[th.quotient * a.token_stride + th.remainder * a.head_stride +
                             td.remainder * a.dim_stride]);
}

/// @brief One token range of a finiteness check: a fact's captured tokens.
struct capture_token_range {
  std::int64_t first_token;  ///< the capture token of the range's first token
  std::int64_t count;        ///< its tokens (at least 1)
};

/**
 * @brief The check that runs before a device capture's facts are stored: every element of K and
 * V of every layer of the listed ranges' tokens, converted to the store dtype; a token whose
 * element does not store as a finite value is flagged.
 */
struct capture_check_args {
  float const* keys;    ///< the capture's keys, `[layers, capture_tokens, row_elements]`
  float const* values;  ///< its values, the same shape
  std::int64_t capture_tokens;
  std::int32_t num_layers;
  std::int64_t row_elements;          ///< heads * head_dim
  capture_token_range const* ranges;  ///< `num_ranges` entries (device memory for the kernel)
  std::int64_t num_ranges;
  /// Per capture token (zeroed before the check): set to 1 where one of its elements is NaN or
  /// infinite as captured, or beyond the store dtype's range.
  std::uint32_t* faults;
};

/// @brief Elements of listed range `r`: `layers * 2 * count * row_elements`.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::int64_t capture_check_elements(
  capture_check_args const& a, std::int64_t r) noexcept
{
  return 2 * static_cast<std::int64_t>(a.num_layers) * a.ranges[r].count * a.row_elements;
}

/**
 * @brief Element `e` of listed range `r`: `e = ((layer * 2 + kv) * count + token) * row_elements
 * + x`; flags capture token `first_token + token` in `faults` unless the element stores as a
 * finite StoreT value (stores_finite).
 * @pre 0 <= r < num_ranges, 0 <= e < capture_check_elements(a, r)
 */
template <class StoreT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void capture_check_element(
  capture_check_args const& a, std::int64_t r, std::int64_t e) noexcept
{
  capture_token_range const range = a.ranges[r];
  index_quotient const rx         = index_divmod(e, a.row_elements);  // (.., element of the row)
  index_quotient const lt         = index_divmod(rx.quotient, range.count);
  auto const layer                = lt.quotient / 2;
  float const* const src          = lt.quotient % 2 == 0 ? a.keys : a.values;
  std::int64_t const token        = range.first_token + lt.remainder;
  float const x = src[(layer * a.capture_tokens + token) * a.row_elements + rx.remainder];
  if (!stores_finite<StoreT>(x)) { a.faults[token] = 1u; }
}

/// @brief One destination page of a scatter: which pool page, and which captured tokens fill it.
struct capture_scatter_page {
  std::int64_t pool_page;    ///< the page of the store's pool written
  std::int64_t first_token;  ///< the capture token of the page's row 0
  std::int64_t rows;         ///< rows taken from the capture (1 .. page_size); the rest are zeroed
};

/**
 * @brief A scatter of captured rows into the store's pool: every element of every listed page is
 * written (a fact's last page's unused rows with zero, as kv_store::insert leaves them), so the
 * pool's bytes depend only on what was stored.
 */
struct capture_scatter_args {
  kv_store_ref store;
  float const* keys;    ///< the capture's keys, `[layers, capture_tokens, heads * head_dim]`
  float const* values;  ///< its values, the same shape
  std::int64_t capture_tokens;
  capture_scatter_page const* pages;  ///< `num_pages` entries (device memory for the kernel)
  std::int64_t num_pages;
};

/// @brief Elements of one pool page: `layers * 2 * page_size * heads * head_dim`.
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::int64_t capture_page_elements(
  kv_store_ref const& store) noexcept
{
  return 2 * static_cast<std::int64_t>(store.num_layers) * store.page_size * store.row_elements();
}

/**
 * @brief Element `e` of listed page `p`: `e = ((layer * 2 + kv) * page_size + row) * row_elements
 * + x`, the order of the pool's page layout (store.hpp), written at kv_store_ref::row_offset.
 * Row `row < pages[p].rows` takes capture token `first_token + row`'s element converted to the
 * store dtype (checked finite there before: capture_check_element); a later row is zero.
 * @pre 0 <= p < num_pages, 0 <= e < capture_page_elements(store)
 */
template <class StoreT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void capture_scatter_element(
  capture_scatter_args const& a, std::int64_t p, std::int64_t e) noexcept
{
  std::int64_t const row_elements = a.store.row_elements();
  index_quotient const rx         = index_divmod(e, row_elements);  // (.., element of the row)
  index_quotient const lr         = index_divmod(rx.quotient, a.store.page_size);
  auto const layer                = static_cast<std::int32_t>(lr.quotient / 2);
  auto const kv                   = static_cast<std::int32_t>(lr.quotient % 2);
  capture_scatter_page const page = a.pages[p];
  StoreT out                      = from_float<StoreT>(0.0f);
  if (lr.remainder < page.rows) {
    std::int64_t const token = page.first_token + lr.remainder;
    float const* const src   = kv == 0 ? a.keys : a.values;
    float const x =
      src[(static_cast<std::int64_t>(layer) * a.capture_tokens + token) * row_elements +
          rx.remainder];
    out = from_float<StoreT>(x);
  }
  static_cast<StoreT*>(
    a.store.pool)[a.store.row_offset(page.pool_page * a.store.page_size + lr.remainder, layer, kv) +
                  rx.remainder] = out;
}

/**
 * @brief Appends the pages of one reserved fact to a scatter list: page `j` of `record` takes
 * capture tokens `first_token + j * page_size ..` (at most page_size of them, the fact's
 * `length()` in all).
 */
inline void append_scatter_pages(std::vector<capture_scatter_page>& out,
                                 fact_record const& record,
                                 std::int64_t first_token,
                                 std::int32_t page_size)
{
  std::int64_t const count = record.length();
  for (std::size_t j = 0; j < record.pages.size(); ++j) {
    std::int64_t const first = static_cast<std::int64_t>(j) * page_size;
    out.push_back(
      {record.pages[j], first_token + first, std::min<std::int64_t>(page_size, count - first)});
  }
}

}  // namespace inferscale::detail
