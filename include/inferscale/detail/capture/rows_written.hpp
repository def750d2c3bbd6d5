/**
 * @file detail/capture/rows_written.hpp
 * @brief The capture buffers' bookkeeping, shared by the host kv_capture (kv_capture.hpp) and the
 * device device_kv_capture (kv_capture.cuh): the geometry and token count, the checks of a write
 * and of a slice, and which (layer, token) rows of K and of V were written. Plain C++17.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/views.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace inferscale::detail {

/// @brief Which rows of a `[layers, tokens]` capture were written, K and V apart.
class rows_written {
 public:
  rows_written() = default;

  /// @throw logic_error if the geometry is invalid or `num_tokens` is not positive (`who` names
  /// the buffer in the message).
  rows_written(kv_geometry const& geometry, std::int64_t num_tokens, char const* who)
    : geometry_{geometry}, num_tokens_{num_tokens}
  {
    geometry.validate();
    INFERSCALE_EXPECTS(
      num_tokens > 0,
      std::string{who} + ": token count must be positive, got " + std::to_string(num_tokens));
    std::size_t const rows =
      static_cast<std::size_t>(geometry.num_layers) * static_cast<std::size_t>(num_tokens);
    written_[0].assign(rows, 0);
    written_[1].assign(rows, 0);
  }

  kv_geometry const& geometry() const noexcept { return geometry_; }
  std::int64_t num_tokens() const noexcept { return num_tokens_; }

  /// @brief Row `(layer, token)` of the `[layers, tokens]` grid.
  std::size_t row(std::int32_t layer, std::int64_t token) const noexcept
  {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_tokens_) +
           static_cast<std::size_t>(token);
  }

  /**
   * @brief Refuses a write of `count` tokens from `first_token` into layer `layer` whose rows are
   * `heads x dim` at `data`: a layer or token range outside the buffer, other heads / head_dim
   * than the geometry's, null data.
   */
  void check_write(std::int32_t layer,
                   std::int64_t first_token,
                   std::int64_t count,
                   std::int64_t heads,
                   std::int64_t dim,
                   void const* data,
                   char const* who) const
  {
    INFERSCALE_EXPECTS(layer >= 0 && layer < geometry_.num_layers,
                       std::string{who} + ": layer " + std::to_string(layer) + " is outside [0, " +
                         std::to_string(geometry_.num_layers) + ")");
    INFERSCALE_EXPECTS(first_token >= 0 && count >= 0 && first_token <= num_tokens_ - count,
                       std::string{who} + ": tokens [" + std::to_string(first_token) + ", " +
                         std::to_string(first_token + count) + ") are outside the buffer's " +
                         detail::count_of(num_tokens_, "token"));
    INFERSCALE_EXPECTS(heads == geometry_.num_kv_heads && dim == geometry_.head_dim,
                       std::string{who} + ": rows of " + detail::count_of(heads, "head") + " x " +
                         detail::count_of(dim, "dim") + ", the geometry has " +
                         std::to_string(geometry_.num_kv_heads) + " x " +
                         std::to_string(geometry_.head_dim));
    INFERSCALE_EXPECTS(count == 0 || data != nullptr, std::string{who} + ": null data");
  }

  /// @brief Records tokens `[first_token, first_token + count)` of `layer` as written, in K
  /// (`kv` 0) or V (1).
  void mark(int kv, std::int32_t layer, std::int64_t first_token, std::int64_t count)
  {
    for (std::int64_t t = 0; t < count; ++t) {
      written_[kv][row(layer, first_token + t)] = 1;
    }
  }

  /// @brief True when K and V of tokens `[begin, begin + count)` were written in every layer.
  bool complete(std::int64_t begin, std::int64_t count) const noexcept
  {
    if (begin < 0 || count < 0 || begin > num_tokens_ - count) { return false; }
    for (std::int32_t l = 0; l < geometry_.num_layers; ++l) {
      for (std::int64_t t = begin; t < begin + count; ++t) {
        std::size_t const r = row(l, t);
        if (!written_[0][r] || !written_[1][r]) { return false; }
      }
    }
    return true;
  }

  /**
   * @brief Tokens `[begin, begin + count)` of a `[layers, tokens, heads, head_dim]` plane at
   * `plane`, as a view.
   * @throw logic_error if the range is empty or outside the tokens.
   */
  fact_kv_view<float const> slice(float const* plane,
                                  std::int64_t begin,
                                  std::int64_t count,
                                  char const* who) const
  {
    INFERSCALE_EXPECTS(begin >= 0 && count > 0 && begin <= num_tokens_ - count,
                       std::string{who} + ": tokens [" + std::to_string(begin) + ", " +
                         std::to_string(begin + count) + ") are not a non-empty range of the " +
                         std::to_string(num_tokens_) + " captured tokens");
    std::int64_t const row_elements = geometry_.elements_per_token_layer();
    return make_fact_kv_view<float const>(
      plane + begin * row_elements,
      geometry_.num_layers,
      count,
      geometry_.num_kv_heads,
      geometry_.head_dim,
      {num_tokens_ * row_elements, row_elements, geometry_.head_dim, 1});
  }

 private:
  kv_geometry geometry_{};
  std::int64_t num_tokens_{};
  std::vector<unsigned char> written_[2];
};

}  // namespace inferscale::detail
