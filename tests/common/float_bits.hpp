// Bit casts between float and its 32-bit pattern for the tests (written here, not taken from the
// library, so that expectations stay independent of the code under test).
#pragma once

#include <cstdint>
#include <cstring>

namespace inferscale_test {

inline std::uint32_t bits_of(float x)
{
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

inline float float_from_bits(std::uint32_t bits)
{
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

}  // namespace inferscale_test
