/**
 * @file memory_space.hpp
 * @brief Where a buffer lives: the one enumeration the store, the index and the tiers share.
 * Plain C++17.
 */
#pragma once

#include <cstdint>

namespace inferscale {

/// @brief Where a buffer lives.
enum class memory_space : std::uint8_t { host, device };

/// @brief Name of a memory space.
inline char const* to_string(memory_space m) noexcept
{
  return m == memory_space::host ? "host" : "device";
}

}  // namespace inferscale
