/**
 * @file detail/math.hpp
 * @brief Integer rounding and division, once for the whole library: ceil_div (pages of a fact,
 * tiles of a grid), round_up (padding to chunks, pages, alignment) and index_divmod (the fast
 * quotient-and-remainder of slot and token indices in kernels).
 *
 * Host and device (`INFERSCALE_HOST_DEVICE constexpr`); plain C++17.
 */
#pragma once

#include <inferscale/config.hpp>

#include <cstdint>
#include <type_traits>

namespace inferscale::detail {

/**
 * @brief `ceil(a / b)` for integers, exactly, for every `a` (negative included) and `b > 0`, and
 * without the overflow of `(a + b - 1) / b` near the type's maximum: the truncating quotient,
 * plus one where a positive remainder was cut off.
 * @pre b > 0
 */
template <class A, class B>
INFERSCALE_HOST_DEVICE constexpr std::common_type_t<A, B> ceil_div(A a, B b) noexcept
{
  static_assert(std::is_integral_v<A> && std::is_integral_v<B>, "ceil_div takes integers");
  using T     = std::common_type_t<A, B>;
  T const q   = static_cast<T>(a) / static_cast<T>(b);
  T const rem = static_cast<T>(a) % static_cast<T>(b);
  return rem > 0 ? q + 1 : q;
}

/**
 * @brief The least multiple of `b` not below `a` (`ceil_div(a, b) * b`).
 * @pre b > 0 and the result representable in the common type (the caller bounds `a`)
 */
template <class A, class B>
INFERSCALE_HOST_DEVICE constexpr std::common_type_t<A, B> round_up(A a, B b) noexcept
{
  return ceil_div(a, b) * static_cast<std::common_type_t<A, B>>(b);
}

/// @brief Quotient and remainder of an index division (index_divmod).
struct index_quotient {
  std::int64_t quotient;
  std::int64_t remainder;
};

/// @brief Whether index_divmod may divide `a` by `b` in 32 bits: both in `[0, 2^32)`.
INFERSCALE_HOST_DEVICE constexpr bool index_divmod_narrow_ok(std::int64_t a,
                                                             std::int64_t b) noexcept
{
  return ((static_cast<std::uint64_t>(a) | static_cast<std::uint64_t>(b)) >> 32) == 0;
}

/// @brief index_divmod's 32-bit form. @pre index_divmod_narrow_ok(a, b) and b != 0
INFERSCALE_HOST_DEVICE constexpr index_quotient index_divmod_narrow(std::int64_t a,
                                                                    std::int64_t b) noexcept
{
  std::uint32_t const q = static_cast<std::uint32_t>(a) / static_cast<std::uint32_t>(b);
  return {static_cast<std::int64_t>(q), a - static_cast<std::int64_t>(q) * b};
}

/**
 * @brief `a / b` and `a % b` (C++'s truncating division), in one 32-bit unsigned division on the
 * device whenever both operands are non-negative and below 2^32, as slot and token indices are:
 * a 64-bit division is a subroutine of about seventy instructions there, a 32-bit one about
 * twenty. Other operands (and the host) take the 64-bit division; the result is the same
 * (`[cache][divmod]` compares the two forms).
 * @pre b != 0
 */
INFERSCALE_HOST_DEVICE constexpr index_quotient index_divmod(std::int64_t a,
                                                             std::int64_t b) noexcept
{
#if INFERSCALE_IS_DEVICE_CODE
  if (index_divmod_narrow_ok(a, b)) { return index_divmod_narrow(a, b); }
#endif
  std::int64_t const q = a / b;
  return {q, a - q * b};
}

}  // namespace inferscale::detail
