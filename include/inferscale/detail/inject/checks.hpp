/**
 * @file detail/inject/checks.hpp
 * @brief What injection and extraction check before writing: the store's and the cache's
 * geometry, the rotation (its table's rows or the model's position range, vLLM's truncating
 * conversion), the batch.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/rope_layers.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale::detail {

/// @brief Checks that a store shard and a cache describe the same heads, layers and head_dim.
inline void check_store_cache_geometry(kv_store const& store,
                                       paged_kv_cache const& cache,
                                       char const* who)
{
  cache.validate();
  kv_geometry const g = store.geometry();
  INFERSCALE_EXPECTS(
    cache.num_layers == g.num_layers && cache.num_heads() == g.num_kv_heads &&
      cache.head_dim() == g.head_dim,
    std::string{who} + ": geometry mismatch: the store holds " +
      detail::count_of(g.num_layers, "layer") + " x " + detail::count_of(g.num_kv_heads, "head") +
      " x " + std::to_string(g.head_dim) + ", the cache " + std::to_string(cache.num_layers) +
      " x " + std::to_string(cache.num_heads()) + " x " + std::to_string(cache.head_dim()));
}

/// @brief Whether a rotation asks for vLLM's AVX2 CPU conversion (rope_cos_sin_table).
template <class Rotation>
constexpr bool truncates_to_bfloat16(Rotation const&) noexcept
{
  return false;
}
template <class U>
constexpr bool truncates_to_bfloat16(rope_cos_sin_table<U> const& table) noexcept
{
  return table.truncate_to_bfloat16;
}
template <class R>
bool truncates_to_bfloat16(per_layer_rotation<R> const& r) noexcept
{
  return truncates_to_bfloat16(r.rotations[0]);  // equal for all (check_per_layer_rotation)
}

/// @brief fp32 -> bfloat16 by truncation (the upper 16 bits; NaN stays NaN).
inline bfloat16_t bfloat16_toward_zero(float x) noexcept
{
  if (x != x) { return from_float<bfloat16_t>(x); }
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  std::uint16_t const top = static_cast<std::uint16_t>(bits >> 16);
  bfloat16_t out;
  std::memcpy(&out, &top, sizeof out);
  return out;
}

/// @brief Checks a rotation against a head_dim and the largest position it will be asked for.
template <class Rotation>
void check_rotation(Rotation const& rotation,
                    std::int32_t head_dim,
                    std::int64_t max_position,
                    char const* who)
{
  rope_check_rotation(rotation);
  INFERSCALE_EXPECTS(rotation.head_dim == head_dim,
                     std::string{who} + ": the rotation's head_dim " +
                       std::to_string(rotation.head_dim) + " differs from the store's " +
                       std::to_string(head_dim));
  INFERSCALE_EXPECTS(rotation.rotary_dim > 0 && rotation.rotary_dim % 2 == 0 &&
                       rotation.rotary_dim <= head_dim &&
                       rotation.rotary_dim / 2 <= rope_params::max_pairs,
                     std::string{who} + ": rotary_dim " + std::to_string(rotation.rotary_dim) +
                       " must be even, positive, at most head_dim and at most " +
                       std::to_string(2 * rope_params::max_pairs));
  // A table's rows, the model's max_position (unless opted out of), rope_position_limit.
  INFERSCALE_EXPECTS(max_position < rope_table_rows(rotation),
                     std::string{who} + ": position " + std::to_string(max_position) +
                       " is beyond " + rope_range_text(rotation) + ": positions must be in [0, " +
                       std::to_string(rope_table_rows(rotation)) + ")");
}

/// @brief check_rotation of a per-layer rotation: its structure, then each of its rotations.
template <class R>
void check_rotation(per_layer_rotation<R> const& rotation,
                    std::int32_t head_dim,
                    std::int64_t max_position,
                    char const* who)
{
  check_per_layer_rotation(rotation, -1, who);
  for (std::int32_t i = 0; i < rotation.num_rotations; ++i) {
    check_rotation(rotation.rotations[i], head_dim, max_position, who);
  }
}

/// @brief A per-layer rotation covers the cache's layers (a single rotation covers any). Called
/// after check_rotation, which has checked the rest of its structure.
template <class Rotation>
void check_rotation_layers(Rotation const&, std::int32_t, char const*)
{
}
template <class R>
void check_rotation_layers(per_layer_rotation<R> const& rotation,
                           std::int32_t num_layers,
                           char const* who)
{
  INFERSCALE_EXPECTS(rotation.num_layers == num_layers,
                     std::string{who} + ": per_layer_rotation: covers " +
                       std::to_string(rotation.num_layers) + " layers, the cache has " +
                       std::to_string(num_layers));
}

/// @brief Everything the host and the device run (injection_batch::run) check before writing.
template <class Rotation>
void check_injection(kv_store const& store,
                     injection_batch const& batch,
                     paged_kv_cache const& cache,
                     Rotation const& rotation,
                     memory_space backend,
                     char const* who)
{
  INFERSCALE_EXPECTS(&batch.store() == &store,
                     std::string{who} + ": the batch was built for a different store");
  batch.check_store(who);
  INFERSCALE_EXPECTS(store.space() == backend,
                     std::string{who} + ": the store's pool is in " + to_string(store.space()) +
                       " memory, this backend reads " + to_string(backend) + " memory");
  check_store_cache_geometry(store, cache, who);
  INFERSCALE_EXPECTS(batch.max_slot() < cache.num_slots(),
                     std::string{who} + ": slot " + std::to_string(batch.max_slot()) +
                       " is beyond the cache's " + detail::count_of(cache.num_slots(), "slot"));
  check_rotation(rotation, store.geometry().head_dim, batch.max_position(), who);
  check_rotation_layers(rotation, cache.num_layers, who);
  if (truncates_to_bfloat16(rotation)) {
    INFERSCALE_EXPECTS(backend == memory_space::host && cache.cache_dtype == dtype::bfloat16 &&
                         cache.scale_granularity == kv_scale_granularity::none,
                       std::string{who} +
                         ": truncate_to_bfloat16 (vLLM's AVX2 CPU rotary kernel) applies to "
                         "unscaled bfloat16 caches on the host backend; this is a " +
                         to_string(cache.cache_dtype) + " cache on the " + to_string(backend) +
                         " backend");
  }
  // The host backend reads its scales from host memory: check their values. The device backend's
  // scales are device memory the host does not read; its kernel skips and counts a row whose
  // scale is not positive and finite (inject_device_errors).
  if (backend == memory_space::host) { cache.check_scale_values(who); }
}

}  // namespace inferscale::detail
