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
  void const* rotation{};
  /// rope_cos_sin_row(rotation, position, op, cos, sin) of the rotation's own type
  void (*row)(void const* rotation, std::int64_t position, rope_op op, float* cos, float* sin){};

  [[nodiscard]] constexpr std::int32_t num_pairs() const noexcept { return rotary_dim / 2; }
};

/// @brief The row of a host_rotation: its own type's rope_cos_sin_row, the same bits.
inline void rope_cos_sin_row(
  host_rotation const& rotation, std::int64_t position, rope_op op, float* cos, float* sin)
{
  rotation.row(rotation.rotation, position, op, cos, sin);
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

}  // namespace inferscale::detail
