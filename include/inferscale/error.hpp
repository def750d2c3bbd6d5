/**
 * @file error.hpp
 * @brief Exception types and the precondition macro used on every host boundary.
 *
 * Host code throws; device code never does. Every operation validates its inputs with
 * INFERSCALE_EXPECTS before its first write, so a refused call leaves all state unchanged.
 */
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace inferscale {

/// @brief A precondition of an InferScale call was violated (bad shape, bad spec, bad id...).
struct logic_error : std::logic_error {
  using std::logic_error::logic_error;
};

/// @brief A CUDA runtime call failed; the message names the call site and the CUDA error.
struct cuda_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] inline void throw_logic_error(char const* condition,
                                           std::string const& reason,
                                           char const* file,
                                           int line)
{
  throw inferscale::logic_error(std::string{"InferScale failure at "} + file + ":" +
                                std::to_string(line) + ": " + reason + " (violated: " + condition +
                                ")");
}

/**
 * @brief A count and its noun for messages: "1 head", "2 heads", "0 heads" (`plural` when the
 * noun does not just take an "s", e.g. "entry" / "entries").
 */
inline std::string count_of(std::int64_t n, char const* singular, char const* plural = nullptr)
{
  std::string text = std::to_string(n) + " ";
  if (n == 1 || n == -1) { return text + singular; }
  return plural ? text + plural : text + singular + "s";
}
}  // namespace detail

}  // namespace inferscale

/**
 * @brief Throws inferscale::logic_error with `reason` (anything convertible to std::string) when
 * `condition` is false. The reason should say what was expected and what was seen.
 */
#define INFERSCALE_EXPECTS(condition, reason)                                            \
  do {                                                                                   \
    if (!(condition)) {                                                                  \
      ::inferscale::detail::throw_logic_error(#condition, (reason), __FILE__, __LINE__); \
    }                                                                                    \
  } while (0)

/// @brief Throws inferscale::logic_error unconditionally (an unsupported value reached a dispatch).
#define INFERSCALE_FAIL(reason) \
  ::inferscale::detail::throw_logic_error("unreachable", (reason), __FILE__, __LINE__)
