/**
 * @file rope_layers.hpp
 * @brief A rotation per layer (per_layer_rotation): for models whose layers rotate their keys
 * differently. Gemma 2 and 3 rotate their sliding-window layers with one rope base and their
 * global layers with another (Gemma 3 270M in llama.cpp: 10,000 and 1,000,000); a model adapter
 * that reads each layer's rotation from the engine hands injection one of these instead of a
 * single rotation.
 *
 * The host run of injection (injection_batch::run(cache, rotation), memory::serve) takes it: the
 * cos/sin rows of each distinct rotation are computed once per token and chunk, as for a single
 * rotation, and layer l reads those of `rotations[layer_rotation[l]]`. The distinct rotations
 * must share their shape (head_dim, rotary_dim, pairing) and their arithmetic switches (a table's
 * rounding, fused multiply-adds, bfloat16 truncation); only their angles differ. Extraction takes
 * one too. The device run and device extraction take it as a kernel argument
 * (device_layer_rotation: the rotations by value, a byte per layer, up to 256 layers): the
 * injection kernel's tile holds each distinct rotation's cos/sin, layer l reading its own.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/rope.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

namespace inferscale {

/**
 * @brief One rotation per layer: layer l is rotated by `rotations[layer_rotation[l]]`.
 * A view: the arrays belong to the caller and must outlive every use.
 * @tparam Rotation rope_params or rope_cos_sin_table<U>
 */
template <class Rotation>
struct per_layer_rotation {
  Rotation const* rotations{};           ///< the distinct rotations, `num_rotations` of them
  std::int32_t num_rotations{};          ///< 1 .. max_rotations
  std::int32_t const* layer_rotation{};  ///< per layer: the index of its rotation
  std::int32_t num_layers{};             ///< entries of layer_rotation: the model's layers

  static constexpr std::int32_t max_rotations = 8;

  // The shared shape, as the single rotations have it (the checks make them equal).
  [[nodiscard]] std::int32_t head_dim() const noexcept { return rotations[0].head_dim; }
  [[nodiscard]] std::int32_t rotary_dim() const noexcept { return rotations[0].rotary_dim; }
  [[nodiscard]] Rotation const& of_layer(std::int32_t l) const noexcept
  {
    return rotations[layer_rotation[l]];
  }
};

/// @brief Whether `T` is a per_layer_rotation.
template <class T>
struct is_per_layer_rotation : std::false_type {
};
template <class R>
struct is_per_layer_rotation<per_layer_rotation<R>> : std::true_type {
};
template <class T>
inline constexpr bool is_per_layer_rotation_v = is_per_layer_rotation<T>::value;

namespace detail {
/// @brief A rotation source's rotations as loops read them: `rotation_count` of them,
/// `rotation_at(r, i)` the i-th, layer l reading `rotation_of_layer(r, l)`; a single rotation is
/// one rotation for every layer.
template <class R>
INFERSCALE_HOST_DEVICE R const& rotation_at(R const& rotation, std::int32_t) noexcept
{
  return rotation;
}
template <class R>
R const& rotation_at(per_layer_rotation<R> const& rotation, std::int32_t i) noexcept
{
  return rotation.rotations[i];
}
template <class R>
INFERSCALE_HOST_DEVICE constexpr std::int32_t rotation_count(R const&) noexcept
{
  return 1;
}
template <class R>
std::int32_t rotation_count(per_layer_rotation<R> const& rotation) noexcept
{
  return rotation.num_rotations;
}
template <class R>
INFERSCALE_HOST_DEVICE constexpr std::int32_t rotation_of_layer(R const&, std::int32_t) noexcept
{
  return 0;
}
template <class R>
std::int32_t rotation_of_layer(per_layer_rotation<R> const& rotation, std::int32_t l) noexcept
{
  return rotation.layer_rotation[l];
}

/**
 * @brief A per_layer_rotation as a kernel argument: its rotations by value and one byte per layer
 * (a trivially copyable __grid_constant__ parameter; a table's data must be device memory, as for
 * a single table). The shared shape is copied out so launch code reads it as a single rotation's.
 */
template <class R>
struct device_layer_rotation {
  static constexpr std::int32_t max_layers = 256;
  R rotations[per_layer_rotation<R>::max_rotations]{};
  std::int32_t num_rotations{};
  std::uint8_t layer_rotation[max_layers]{};
  std::int32_t head_dim{};
  std::int32_t rotary_dim{};
  rope_pairing pairing{rope_pairing::halves};

  INFERSCALE_HOST_DEVICE constexpr std::int32_t num_pairs() const noexcept
  {
    return rotary_dim / 2;
  }
};
template <class T>
struct is_device_layer_rotation : std::false_type {
};
template <class R>
struct is_device_layer_rotation<device_layer_rotation<R>> : std::true_type {
};
template <class R>
INFERSCALE_HOST_DEVICE R const& rotation_at(device_layer_rotation<R> const& rotation,
                                            std::int32_t i) noexcept
{
  return rotation.rotations[i];
}
template <class R>
INFERSCALE_HOST_DEVICE std::int32_t rotation_count(
  device_layer_rotation<R> const& rotation) noexcept
{
  return rotation.num_rotations;
}
template <class R>
INFERSCALE_HOST_DEVICE std::int32_t rotation_of_layer(device_layer_rotation<R> const& rotation,
                                                      std::int32_t l) noexcept
{
  return rotation.layer_rotation[l];
}

/// @brief The rotation type a kernel takes for `Rotation`: itself, or a per_layer_rotation's
/// device form.
template <class Rotation>
struct kernel_rotation {
  using type = Rotation;
};
template <class R>
struct kernel_rotation<per_layer_rotation<R>> {
  using type = device_layer_rotation<R>;
};
template <class Rotation>
using kernel_rotation_t = typename kernel_rotation<Rotation>::type;

template <class Rotation>
Rotation const& to_kernel_rotation(Rotation const& rotation)
{
  return rotation;
}
/// @brief The device form of a (checked) per_layer_rotation.
/// @throw logic_error if it covers more than device_layer_rotation::max_layers layers.
template <class R>
device_layer_rotation<R> to_kernel_rotation(per_layer_rotation<R> const& rotation)
{
  using out_t = device_layer_rotation<R>;
  INFERSCALE_EXPECTS(rotation.num_layers >= 0 && rotation.num_layers <= out_t::max_layers,
                     "per_layer_rotation: the device run takes up to " +
                       std::to_string(out_t::max_layers) + " layers, got " +
                       std::to_string(rotation.num_layers));
  out_t out{};
  out.num_rotations = rotation.num_rotations;
  for (std::int32_t i = 0; i < rotation.num_rotations; ++i) {
    out.rotations[i] = rotation.rotations[i];
  }
  for (std::int32_t l = 0; l < rotation.num_layers; ++l) {
    out.layer_rotation[l] = static_cast<std::uint8_t>(rotation.layer_rotation[l]);
  }
  out.head_dim   = rotation.rotations[0].head_dim;
  out.rotary_dim = rotation.rotations[0].rotary_dim;
  out.pairing    = rotation.rotations[0].pairing;
  return out;
}

template <class R>
bool same_arithmetic(R const&, R const&) noexcept
{
  return true;
}
template <class U>
bool same_arithmetic(rope_cos_sin_table<U> const& a, rope_cos_sin_table<U> const& b) noexcept
{
  return a.round_each_operation == b.round_each_operation &&
         a.fused_multiply_add == b.fused_multiply_add &&
         a.truncate_to_bfloat16 == b.truncate_to_bfloat16;
}
inline bool same_arithmetic(rope_params const& a, rope_params const& b) noexcept
{
  return a.angle_mode == b.angle_mode;
}
}  // namespace detail

/**
 * @brief Checks a per_layer_rotation's structure: the arrays present, 1 .. max_rotations
 * rotations, each layer's index in range, the rotations of one shape and one arithmetic; each
 * rotation is checked as a single one is (rope_check_rotation).
 * @param num_layers the layers it must cover (a cache's or store's); negative: not checked
 * @throw logic_error naming the problem.
 */
template <class Rotation>
void check_per_layer_rotation(per_layer_rotation<Rotation> const& r,
                              std::int32_t num_layers,
                              char const* who)
{
  std::string const w = std::string{who} + ": per_layer_rotation: ";
  INFERSCALE_EXPECTS(r.rotations != nullptr && r.layer_rotation != nullptr,
                     w + "the rotations and the layer indices must be given");
  INFERSCALE_EXPECTS(r.num_rotations >= 1 && r.num_rotations <= r.max_rotations,
                     w + std::to_string(r.num_rotations) + " rotations (1 to " +
                       std::to_string(r.max_rotations) + ")");
  INFERSCALE_EXPECTS(num_layers < 0 || r.num_layers == num_layers,
                     w + "covers " + std::to_string(r.num_layers) + " layers, the cache has " +
                       std::to_string(num_layers));
  for (std::int32_t l = 0; l < r.num_layers; ++l) {
    std::int32_t const i = r.layer_rotation[l];
    INFERSCALE_EXPECTS(i >= 0 && i < r.num_rotations,
                       w + "layer " + std::to_string(l) + " names rotation " + std::to_string(i) +
                         " of " + std::to_string(r.num_rotations));
  }
  for (std::int32_t i = 0; i < r.num_rotations; ++i) {
    Rotation const& a = r.rotations[0];
    Rotation const& b = r.rotations[i];
    detail::rope_check_rotation(b);
    INFERSCALE_EXPECTS(
      b.head_dim == a.head_dim && b.rotary_dim == a.rotary_dim && b.pairing == a.pairing,
      w + "rotation " + std::to_string(i) + " has head_dim " + std::to_string(b.head_dim) +
        ", rotary_dim " + std::to_string(b.rotary_dim) +
        " or its pairing different from rotation 0's (only the angles may differ)");
    INFERSCALE_EXPECTS(detail::same_arithmetic(a, b),
                       w + "rotation " + std::to_string(i) +
                         " asks for other roundings than rotation 0 (a table's "
                         "round_each_operation, fused_multiply_add, truncate_to_bfloat16 or the "
                         "angle mode must be equal)");
  }
}

/**
 * @brief rope_check_positions for every rotation of a per-layer one (after its structure).
 * @throw logic_error as rope_check_positions and check_per_layer_rotation.
 */
template <class Rotation>
void rope_check_positions(per_layer_rotation<Rotation> const& rotation,
                          std::int64_t first,
                          std::int64_t count,
                          char const* who = "rope")
{
  check_per_layer_rotation(rotation, -1, who);
  for (std::int32_t i = 0; i < rotation.num_rotations; ++i) {
    rope_check_positions(rotation.rotations[i], first, count, who);
  }
}

}  // namespace inferscale
