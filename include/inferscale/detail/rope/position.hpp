/**
 * @file detail/rope/position.hpp
 * @brief The device rope's rule for which positions it may rotate (rope_position_ok), apart from
 * the kernel so that plain C++ (the host tests) reaches it.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/rope.hpp>

#include <cstdint>

namespace inferscale::detail {

/**
 * @brief Whether the kernel may rotate a token by `position`: forward and inverse need a position
 * in `[0, rows)`, shift a delta with `|delta| < rows` (table row |delta|); INT64_MIN, whose
 * magnitude does not fit 64 bits, is never valid. Shared with the host tests.
 */
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE bool rope_position_ok(std::int64_t position,
                                                                    std::int64_t rows,
                                                                    rope_op op)
{
  if (op == rope_op::shift) {
    return position != (-0x7fffffffffffffffLL - 1) && (position < 0 ? -position : position) < rows;
  }
  return position >= 0 && position < rows;
}

}  // namespace inferscale::detail
