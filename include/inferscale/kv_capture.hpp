/**
 * @file kv_capture.hpp
 * @brief The capture buffer: the host buffer a model adapter's capture hook fills during one
 * encoding forward (pre-RoPE K and V of every layer and token, fp32), recording which rows were
 * written. C++17, host only (the engine seam is engine.hpp; a GPU engine's device twin is
 * device_kv_capture, kv_capture.cuh).
 */
#pragma once

#include <inferscale/detail/capture/rows_written.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/views.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace inferscale {

/**
 * @brief Host buffer a capture hook fills during one encoding forward: pre-RoPE K and V of every
 * layer and token as fp32, `[layers, tokens, heads, head_dim]` contiguous, with a record of which
 * (layer, token) rows were written, so an incomplete capture is refused instead of stored.
 */
class kv_capture {
 public:
  /**
   * @brief A buffer for `num_tokens` tokens of a model with geometry `geometry`.
   * @throw logic_error if the geometry is invalid or `num_tokens` is not positive.
   */
  kv_capture(kv_geometry const& geometry, std::int64_t num_tokens)
    : rows_{geometry, num_tokens, "kv_capture"}
  {
    std::size_t const n = static_cast<std::size_t>(geometry.num_layers) *
                          static_cast<std::size_t>(num_tokens) *
                          static_cast<std::size_t>(geometry.elements_per_token_layer());
    keys_.assign(n, 0.0f);
    values_.assign(n, 0.0f);
  }

  kv_geometry geometry() const noexcept { return rows_.geometry(); }
  std::int64_t num_tokens() const noexcept { return rows_.num_tokens(); }

  /**
   * @brief Copies the pre-RoPE keys of tokens `first_token .. first_token + rows.extent(0) - 1` of
   * layer `layer` (`rows` is `[tokens, heads, head_dim]` with any strides, fp32 host memory).
   * @throw logic_error if the layer or token range is outside the buffer or the heads/head_dim
   *        differ from the geometry; nothing is written then.
   */
  void write_keys(std::int32_t layer, std::int64_t first_token, token_head_view<float const> rows)
  {
    write(keys_, 0, layer, first_token, rows, "kv_capture::write_keys");
  }

  /// @brief As write_keys, for the values.
  void write_values(std::int32_t layer, std::int64_t first_token, token_head_view<float const> rows)
  {
    write(values_, 1, layer, first_token, rows, "kv_capture::write_values");
  }

  /// @brief True when K and V of tokens `[begin, begin + count)` were written in every layer.
  bool complete(std::int64_t begin, std::int64_t count) const noexcept
  {
    return rows_.complete(begin, count);
  }
  /// @brief True when every token of every layer was written.
  bool complete() const noexcept { return complete(0, num_tokens()); }

  /// @brief Keys of tokens `[begin, begin + count)` as a `[layers, count, heads, head_dim]` view.
  fact_kv_view<float const> keys(std::int64_t begin, std::int64_t count) const
  {
    return slice(keys_, begin, count, "kv_capture::keys");
  }
  /// @brief Values of tokens `[begin, begin + count)`.
  fact_kv_view<float const> values(std::int64_t begin, std::int64_t count) const
  {
    return slice(values_, begin, count, "kv_capture::values");
  }
  fact_kv_view<float const> keys() const { return keys(0, num_tokens()); }
  fact_kv_view<float const> values() const { return values(0, num_tokens()); }

 private:
  void write(std::vector<float>& dst,
             int kv,
             std::int32_t layer,
             std::int64_t first_token,
             token_head_view<float const> rows,
             char const* who)
  {
    std::int64_t const count = rows.extent(0);
    rows_.check_write(
      layer, first_token, count, rows.extent(1), rows.extent(2), rows.data_handle(), who);
    std::int64_t const heads = rows_.geometry().num_kv_heads;
    std::int64_t const dim   = rows_.geometry().head_dim;
    for (std::int64_t t = 0; t < count; ++t) {
      float* out =
        dst.data() + rows_.row(layer, first_token + t) * static_cast<std::size_t>(heads * dim);
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t d = 0; d < dim; ++d) {
          out[h * dim + d] = rows(t, h, d);
        }
      }
    }
    rows_.mark(kv, layer, first_token, count);
  }

  fact_kv_view<float const> slice(std::vector<float> const& src,
                                  std::int64_t begin,
                                  std::int64_t count,
                                  char const* who) const
  {
    return rows_.slice(src.data(), begin, count, who);
  }

  detail::rows_written rows_;
  std::vector<float> keys_;
  std::vector<float> values_;
};

}  // namespace inferscale
