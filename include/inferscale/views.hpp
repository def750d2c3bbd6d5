/**
 * @file views.hpp
 * @brief Non-owning tensor views used across the API (cuda::std::mdspan with runtime strides).
 */
#pragma once

#include <inferscale/config.hpp>

#include <cuda/std/array>
#include <cuda/std/mdspan>

#include <array>
#include <cstddef>
#include <cstdint>

namespace inferscale {

/// @brief Runtime extents with 64-bit indices (sizes can exceed 2^31 elements).
template <std::size_t Rank>
using extents_t = cuda::std::dextents<std::int64_t, Rank>;

/**
 * @brief A `[tokens, heads, head_dim]` view with arbitrary strides (in elements), as engine
 * tensors come: e.g. vLLM's key `[T, H*D]` viewed with strides `{H*D, D, 1}`.
 */
template <class T>
using token_head_view = cuda::std::mdspan<T, extents_t<3>, cuda::std::layout_stride>;

/**
 * @brief Makes a token_head_view from a pointer, its extents and its strides (in elements).
 */
template <class T>
token_head_view<T> make_token_head_view(T* data,
                                        std::int64_t tokens,
                                        std::int64_t heads,
                                        std::int64_t head_dim,
                                        std::int64_t token_stride,
                                        std::int64_t head_stride,
                                        std::int64_t element_stride = 1)
{
  using mapping = cuda::std::layout_stride::mapping<extents_t<3>>;
  return token_head_view<T>{
    data,
    mapping{extents_t<3>{tokens, heads, head_dim},
            cuda::std::array<std::int64_t, 3>{token_stride, head_stride, element_stride}}};
}

/// @brief A contiguous `[tokens, heads, head_dim]` view.
template <class T>
token_head_view<T> make_token_head_view(T* data,
                                        std::int64_t tokens,
                                        std::int64_t heads,
                                        std::int64_t head_dim)
{
  return make_token_head_view(data, tokens, heads, head_dim, heads * head_dim, head_dim, 1);
}

/**
 * @brief A fact's keys or values for every layer: `[layers, tokens, heads, head_dim]` with any
 * strides (in elements).
 */
template <class T>
using fact_kv_view = cuda::std::mdspan<T, extents_t<4>, cuda::std::layout_stride>;

/// @brief Makes a fact_kv_view with explicit strides (in elements).
template <class T>
fact_kv_view<T> make_fact_kv_view(T* data,
                                  std::int64_t layers,
                                  std::int64_t tokens,
                                  std::int64_t heads,
                                  std::int64_t head_dim,
                                  std::array<std::int64_t, 4> const& strides)
{
  using mapping = cuda::std::layout_stride::mapping<extents_t<4>>;
  return fact_kv_view<T>{
    data,
    mapping{extents_t<4>{layers, tokens, heads, head_dim},
            cuda::std::array<std::int64_t, 4>{strides[0], strides[1], strides[2], strides[3]}}};
}

/// @brief Makes a contiguous `[layers, tokens, heads, head_dim]` fact_kv_view.
template <class T>
fact_kv_view<T> make_fact_kv_view(
  T* data, std::int64_t layers, std::int64_t tokens, std::int64_t heads, std::int64_t head_dim)
{
  return make_fact_kv_view(data,
                           layers,
                           tokens,
                           heads,
                           head_dim,
                           {tokens * heads * head_dim, heads * head_dim, head_dim, 1});
}

}  // namespace inferscale
