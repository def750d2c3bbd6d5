/**
 * @file bench/common/env_knob.hpp
 * @brief An experiment's knob for the benchmarks: an integer read from the environment, checked
 * against its range, so that a lever can be measured without a rebuild (the default is what the
 * benchmark otherwise uses, and what its headline reports).
 */
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace inferscale::bench {

/// @brief The integer in environment variable `name`, in [lo, hi], or `fallback` when it is unset
/// or empty. @throw std::runtime_error naming the variable when it is out of range.
inline long env_knob(char const* name, long lo, long hi, long fallback)
{
  char const* e = std::getenv(name);
  if (e == nullptr || *e == '\0') { return fallback; }
  char* end    = nullptr;
  long const v = std::strtol(e, &end, 10);
  if (*end != '\0' || v < lo || v > hi) {
    throw std::runtime_error(std::string{name} + " must be an integer in [" + std::to_string(lo) +
                             ", " + std::to_string(hi) + "], got '" + e + "'");
  }
  return v;
}

}  // namespace inferscale::bench
