/**
 * @file kv_capture.hpp
 * @brief The capture buffer: the host buffer a model adapter's capture hook fills during one
 * encoding forward (pre-RoPE K and V of every layer and token, fp32), recording which rows were
 * written. C++17, host only (the engine seam is engine.hpp; a GPU engine's device twin is
 * device_kv_capture, kv_capture.cuh).
 */
#pragma once

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
    : geometry_{geometry}, num_tokens_{num_tokens}
  {
    geometry.validate();
    INFERSCALE_EXPECTS(
      num_tokens > 0,
      "kv_capture: token count must be positive, got " + std::to_string(num_tokens));
    std::size_t const n = static_cast<std::size_t>(geometry.num_layers) *
                          static_cast<std::size_t>(num_tokens) *
                          static_cast<std::size_t>(geometry.elements_per_token_layer());
    keys_.assign(n, 0.0f);
    values_.assign(n, 0.0f);
    std::size_t const rows =
      static_cast<std::size_t>(geometry.num_layers) * static_cast<std::size_t>(num_tokens);
    key_written_.assign(rows, 0);
    value_written_.assign(rows, 0);
  }

  kv_geometry geometry() const noexcept { return geometry_; }
  std::int64_t num_tokens() const noexcept { return num_tokens_; }

  /**
   * @brief Copies the pre-RoPE keys of tokens `first_token .. first_token + rows.extent(0) - 1` of
   * layer `layer` (`rows` is `[tokens, heads, head_dim]` with any strides, fp32 host memory).
   * @throw logic_error if the layer or token range is outside the buffer or the heads/head_dim
   *        differ from the geometry; nothing is written then.
   */
  void write_keys(std::int32_t layer, std::int64_t first_token, token_head_view<float const> rows)
  {
    write(keys_, key_written_, layer, first_token, rows, "kv_capture::write_keys");
  }

  /// @brief As write_keys, for the values.
  void write_values(std::int32_t layer, std::int64_t first_token, token_head_view<float const> rows)
  {
    write(values_, value_written_, layer, first_token, rows, "kv_capture::write_values");
  }

  /// @brief True when K and V of tokens `[begin, begin + count)` were written in every layer.
  bool complete(std::int64_t begin, std::int64_t count) const noexcept
  {
    if (begin < 0 || count < 0 || begin > num_tokens_ - count) { return false; }
    for (std::int32_t l = 0; l < geometry_.num_layers; ++l) {
      for (std::int64_t t = begin; t < begin + count; ++t) {
        std::size_t const r = row(l, t);
        if (!key_written_[r] || !value_written_[r]) { return false; }
      }
    }
    return true;
  }
  /// @brief True when every token of every layer was written.
  bool complete() const noexcept { return complete(0, num_tokens_); }

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
  fact_kv_view<float const> keys() const { return keys(0, num_tokens_); }
  fact_kv_view<float const> values() const { return values(0, num_tokens_); }

 private:
  std::size_t row(std::int32_t layer, std::int64_t token) const noexcept
  {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_tokens_) +
           static_cast<std::size_t>(token);
  }

  void write(std::vector<float>& dst,
             std::vector<unsigned char>& written,
             std::int32_t layer,
             std::int64_t first_token,
             token_head_view<float const> rows,
             char const* who)
  {
    std::int64_t const count = rows.extent(0);
    INFERSCALE_EXPECTS(layer >= 0 && layer < geometry_.num_layers,
                       std::string{who} + ": layer " + std::to_string(layer) + " is outside [0, " +
                         std::to_string(geometry_.num_layers) + ")");
    INFERSCALE_EXPECTS(first_token >= 0 && count >= 0 && first_token <= num_tokens_ - count,
                       std::string{who} + ": tokens [" + std::to_string(first_token) + ", " +
                         std::to_string(first_token + count) + ") are outside the buffer's " +
                         detail::count_of(num_tokens_, "token"));
    INFERSCALE_EXPECTS(
      rows.extent(1) == geometry_.num_kv_heads && rows.extent(2) == geometry_.head_dim,
      std::string{who} + ": rows of " + detail::count_of(rows.extent(1), "head") + " x " +
        detail::count_of(rows.extent(2), "dim") + ", the geometry has " +
        std::to_string(geometry_.num_kv_heads) + " x " + std::to_string(geometry_.head_dim));
    INFERSCALE_EXPECTS(count == 0 || rows.data_handle() != nullptr,
                       std::string{who} + ": null data");
    std::int64_t const heads = geometry_.num_kv_heads;
    std::int64_t const dim   = geometry_.head_dim;
    for (std::int64_t t = 0; t < count; ++t) {
      float* out = dst.data() + row(layer, first_token + t) * static_cast<std::size_t>(heads * dim);
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t d = 0; d < dim; ++d) {
          out[h * dim + d] = rows(t, h, d);
        }
      }
      written[row(layer, first_token + t)] = 1;
    }
  }

  fact_kv_view<float const> slice(std::vector<float> const& src,
                                  std::int64_t begin,
                                  std::int64_t count,
                                  char const* who) const
  {
    INFERSCALE_EXPECTS(begin >= 0 && count > 0 && begin <= num_tokens_ - count,
                       std::string{who} + ": tokens [" + std::to_string(begin) + ", " +
                         std::to_string(begin + count) + ") are not a non-empty range of the " +
                         std::to_string(num_tokens_) + " captured tokens");
    std::int64_t const row_elements = geometry_.elements_per_token_layer();
    return make_fact_kv_view(src.data() + begin * row_elements,
                             geometry_.num_layers,
                             count,
                             geometry_.num_kv_heads,
                             geometry_.head_dim,
                             {num_tokens_ * row_elements, row_elements, geometry_.head_dim, 1});
  }

  kv_geometry geometry_;
  std::int64_t num_tokens_;
  std::vector<float> keys_;
  std::vector<float> values_;
  std::vector<unsigned char> key_written_;
  std::vector<unsigned char> value_written_;
};

}  // namespace inferscale
