/**
 * @file detail/inject/host_rotation.hpp
 * @brief The rotation as the host injection loops read it: its shape, its switches and one
 * function that computes a position's cos/sin row. The loops differ between rotation types
 * (rope_params, the engines' cos/sin tables of float, bfloat16 and float16) only in that row, so
 * they are compiled once for the three table types and once, without the tables' roundings, for
 * rope_params (two sets of dtype x layout x vector-level loops instead of four), and each rotation
 * type adds a front of a few lines (inject_host_view).
 */
#pragma once

#include <inferscale/detail/inject/checks.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/rope_layers.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace inferscale::detail {

/// Whether `Rotation` is an engine's cos/sin table (rope_cos_sin_table<U>): only a table can ask
/// for vLLM's roundings (round each operation, fused multiply-adds, bfloat16 truncation), so the
/// loops of rope_params are compiled without them.
template <class Rotation>
struct is_cos_sin_table : std::false_type {
};
template <class U>
struct is_cos_sin_table<rope_cos_sin_table<U>> : std::true_type {
};
template <class R>
struct is_cos_sin_table<per_layer_rotation<R>> : is_cos_sin_table<R> {
};

struct host_rotation {
  std::int32_t rotary_dim{};
  rope_pairing pairing{rope_pairing::halves};
  /// rope_fuses_multiply_add(rotation, forward)
  bool fused{};
  /// rope_rounds_each_operation<T>(rotation, forward) for a store type T other than float (it is
  /// false for float whatever the rotation)
  bool round_each{};
  /// truncates_to_bfloat16(rotation): vLLM's AVX2 bfloat16 conversion (a cos/sin table)
  bool truncate_to_bfloat16{};
  void const* rotation{};  ///< the first rotation
  /// rope_cos_sin_row(rotation, position, op, cos, sin) of the rotation's own type
  void (*row)(void const* rotation, std::int64_t position, rope_op op, float* cos, float* sin){};
  /// per_layer_rotation: its rotations lie `rotation_bytes` apart from `rotation`, and layer l
  /// reads rotation `layer_rotation[l]`; a single rotation: 1 and null (every layer reads it)
  std::int32_t num_rotations{1};
  std::int32_t const* layer_rotation{};
  std::size_t rotation_bytes{};

  [[nodiscard]] constexpr std::int32_t num_pairs() const noexcept { return rotary_dim / 2; }
  /// @brief Which of the rotations layer `l` reads.
  [[nodiscard]] std::int32_t of_layer(std::int32_t l) const noexcept
  {
    return layer_rotation != nullptr ? layer_rotation[l] : 0;
  }
};

/// @brief The row of rotation `which` of a host_rotation: its own type's rope_cos_sin_row, the
/// same bits.
inline void rope_cos_sin_row(host_rotation const& rotation,
                             std::int32_t which,
                             std::int64_t position,
                             rope_op op,
                             float* cos,
                             float* sin)
{
  rotation.row(static_cast<char const*>(rotation.rotation) + which * rotation.rotation_bytes,
               position,
               op,
               cos,
               sin);
}
inline void rope_cos_sin_row(
  host_rotation const& rotation, std::int64_t position, rope_op op, float* cos, float* sin)
{
  rope_cos_sin_row(rotation, 0, position, op, cos, sin);
}
/// @brief rope_cos_sin_row of rotation `which` into (cos, sin) pairs.
inline void rope_cos_sin_row(host_rotation const& rotation,
                             std::int32_t which,
                             std::int64_t position,
                             rope_op op,
                             rope_cos_sin* out)
{
  float cos[rope_params::max_pairs];
  float sin[rope_params::max_pairs];
  rope_cos_sin_row(rotation, which, position, op, cos, sin);
  for (std::int32_t p = 0; p < rotation.num_pairs(); ++p) {
    out[p] = {cos[p], sin[p]};
  }
}

/// @brief One token of a chunk of the host loops: its store row's base (row_offset(token, 0, 0):
/// a layer's K or V row is that plus (2 l + kv) pages) and its forward cos/sin rows, for every
/// rotation of a per-layer one (rotation r's at `r * rows + j * pairs`).
template <class Store, class Batch, class Rotation>
inline void chunk_token_rows(Store const& store,
                             Batch const& batch,
                             Rotation const& rotation,
                             std::int64_t first,
                             std::int64_t j,
                             std::int64_t rows,
                             std::int64_t* row_base,
                             float* cos,
                             float* sin)
{
  std::int32_t const pairs = rotation.num_pairs();
  row_base[j]              = store.row_offset(batch.store_token[first + j], 0, 0);
  for (std::int32_t r = 0; r < rotation.num_rotations; ++r) {
    std::int64_t const at = r * rows + j * pairs;
    rope_cos_sin_row(rotation, r, batch.position[first + j], rope_op::forward, cos + at, sin + at);
  }
}

/// @brief `rotation` (rope_params or a rope_cos_sin_table) as the host loops read it; refers to
/// `rotation`, which must outlive the result.
template <class Rotation>
host_rotation erase_host_rotation(Rotation const& rotation)
{
  host_rotation erased;
  erased.rotary_dim           = rotation.rotary_dim;
  erased.pairing              = rotation.pairing;
  erased.fused                = rope_fuses_multiply_add(rotation, rope_op::forward);
  erased.round_each           = rope_rounds_each_operation<bfloat16_t>(rotation, rope_op::forward);
  erased.truncate_to_bfloat16 = truncates_to_bfloat16(rotation);
  erased.rotation             = &rotation;
  erased.row = [](void const* r, std::int64_t position, rope_op op, float* cos, float* sin) {
    rope_cos_sin_row(*static_cast<Rotation const*>(r), position, op, cos, sin);
  };
  return erased;
}

/// @brief A per-layer rotation as the host loops read it: its first rotation erased, with the
/// others beside it and the layers' indices; refers to `rotation`'s arrays.
template <class Rotation>
host_rotation erase_host_rotation(per_layer_rotation<Rotation> const& rotation)
{
  host_rotation erased  = erase_host_rotation(rotation.rotations[0]);
  erased.num_rotations  = rotation.num_rotations;
  erased.layer_rotation = rotation.layer_rotation;
  erased.rotation_bytes = sizeof(Rotation);
  return erased;
}

}  // namespace inferscale::detail
