/**
 * @file memory_kind.hpp
 * @brief Where a buffer lives: the one enumeration the store, the index and the tiers share.
 * Plain C++17.
 */
#pragma once

#include <cstdint>

namespace inferscale {

/// @brief Where a buffer lives.
enum class memory_kind : std::uint8_t { host, device };

/// @brief Name of a memory kind.
inline char const* to_string(memory_kind m) noexcept
{
  return m == memory_kind::host ? "host" : "device";
}

}  // namespace inferscale
