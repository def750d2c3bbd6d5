/**
 * @file geometry.hpp
 * @brief The KV geometry of a model (layers, KV heads, head dim) and its byte accounting.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>

#include <cstdint>
#include <limits>
#include <string>

namespace inferscale {

/**
 * @brief Shape of a model's KV cache: what one token costs in every layer.
 *
 * One token holds, per layer, a key and a value of `num_kv_heads * head_dim` elements each, so a
 * token of a fact costs `2 * num_layers * num_kv_heads * head_dim * size_of(dtype)` bytes
 * (DESIGN.md's `2·L·h·d·b` per token; times `c` tokens for a fact).
 */
struct kv_geometry {
  std::int32_t num_layers{};    ///< transformer layers that keep a KV cache
  std::int32_t num_kv_heads{};  ///< key/value heads per layer (after GQA grouping)
  std::int32_t head_dim{};      ///< elements per head

  /// @brief Elements of one key (or one value) of one token in one layer.
  INFERSCALE_HOST_DEVICE constexpr std::int64_t elements_per_token_layer() const noexcept
  {
    return static_cast<std::int64_t>(num_kv_heads) * head_dim;
  }

  /// @brief Elements of K and V of one token over all layers.
  INFERSCALE_HOST_DEVICE constexpr std::int64_t elements_per_token() const noexcept
  {
    return 2 * static_cast<std::int64_t>(num_layers) * elements_per_token_layer();
  }

  /// @brief Bytes of K and V of one token over all layers when stored as `t`.
  constexpr std::int64_t bytes_per_token(dtype t) const noexcept
  {
    return elements_per_token() * static_cast<std::int64_t>(size_of(t));
  }

  /**
   * @brief Bytes of K and V of `tokens` tokens over all layers when stored as `t`.
   * @throw logic_error if `tokens` is negative or the product overflows 64 bits.
   */
  std::int64_t bytes(std::int64_t tokens, dtype t) const
  {
    INFERSCALE_EXPECTS(
      tokens >= 0,
      "kv_geometry::bytes: token count must be non-negative, got " + std::to_string(tokens));
    validate();  // also bounds the per-token product, so bytes_per_token cannot overflow
    std::int64_t const per_token = bytes_per_token(t);
    INFERSCALE_EXPECTS(
      per_token == 0 || tokens <= std::numeric_limits<std::int64_t>::max() / per_token,
      "kv_geometry::bytes: " + std::to_string(tokens) + " tokens overflow a 64-bit byte count");
    return tokens * per_token;
  }

  /**
   * @brief Checks that every dimension is positive and `head_dim` is even (rotary pairs).
   * @throw logic_error naming the offending field.
   */
  void validate() const
  {
    INFERSCALE_EXPECTS(
      num_layers > 0,
      "kv_geometry: num_layers must be positive, got " + std::to_string(num_layers));
    INFERSCALE_EXPECTS(
      num_kv_heads > 0,
      "kv_geometry: num_kv_heads must be positive, got " + std::to_string(num_kv_heads));
    INFERSCALE_EXPECTS(
      head_dim > 0 && head_dim % 2 == 0,
      "kv_geometry: head_dim must be positive and even, got " + std::to_string(head_dim));
    // 2 * L * H * D * 4 bytes (the widest element) must fit in 64 bits.
    constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 8;
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(num_kv_heads) * head_dim <= limit / num_layers,
                       "kv_geometry: " + std::to_string(num_layers) + " x " +
                         std::to_string(num_kv_heads) + " x " + std::to_string(head_dim) +
                         " overflows a 64-bit byte count per token");
  }

  friend constexpr bool operator==(kv_geometry const& a, kv_geometry const& b) noexcept
  {
    return a.num_layers == b.num_layers && a.num_kv_heads == b.num_kv_heads &&
           a.head_dim == b.head_dim;
  }
  friend constexpr bool operator!=(kv_geometry const& a, kv_geometry const& b) noexcept
  {
    return !(a == b);
  }
};

}  // namespace inferscale
