// GPU tests of the element types (inferscale/dtype.hpp): the device backend (CUDA's conversion
// instructions) must give the same bits as the host backend (the bit-level routines), which
// dtype_host.cpp checks against independent references. NaN payloads may differ: a NaN only has
// to stay a NaN.
#include "device_memory.hpp"
#include "float_bits.hpp"

#include <inferscale/config.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/dtype.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using inferscale::bfloat16_t;
using inferscale::float8_e4m3_t;
using inferscale::float8_e5m2_t;
using inferscale::half_t;

// The kernel has external linkage (a named namespace): INFERSCALE_KERNEL gives it hidden
// visibility, which applies to external names only.
namespace inferscale_test {

/// One launch's work: round `inputs` to T, and widen the codes `i mod 2^bits(T)` to fp32.
struct conversion_params {
  float const* inputs;
  std::uint32_t* rounded_codes;  ///< from_float<T>(inputs[i]).bits
  float* widened;                ///< to_float(T{i mod 2^bits(T)})
  std::int64_t size;
};

template <class T>
INFERSCALE_KERNEL
void conversion_kernel(__grid_constant__ conversion_params const params)
{
  using bits_type           = decltype(T::bits);
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < params.size;
       i += stride) {
    params.rounded_codes[i] = inferscale::from_float<T>(params.inputs[i]).bits;
    params.widened[i]       = inferscale::to_float(T{static_cast<bits_type>(i)});
  }
}

}  // namespace inferscale_test

namespace {

using inferscale_test::device_buffer;
using stream = inferscale_test::cuda_stream;

using inferscale_test::bits_of;
using inferscale_test::float_from_bits;

bool same_float(float a, float b)
{
  if (std::isnan(a) || std::isnan(b)) { return std::isnan(a) && std::isnan(b); }
  return bits_of(a) == bits_of(b);
}

std::string describe(float x)
{
  char text[64];
  std::snprintf(text, sizeof(text), "%a (0x%08x)", static_cast<double>(x), bits_of(x));
  return text;
}

/**
 * `size` inputs: special values first, then the value of every code of T (both signs, so the
 * round trip is covered), then random fp32 bit patterns (fixed seed).
 */
template <class T>
std::vector<float> make_inputs(std::int64_t size)
{
  std::vector<float> inputs;
  inputs.reserve(static_cast<std::size_t>(size));
  float const infinity = std::numeric_limits<float>::infinity();
  for (float const x : {0.0f,
                        -0.0f,
                        infinity,
                        -infinity,
                        std::numeric_limits<float>::quiet_NaN(),
                        float_from_bits(0xffc00001u),
                        float_from_bits(0x7f800001u),
                        std::numeric_limits<float>::max(),
                        -std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::denorm_min(),
                        inferscale::max_finite<T>(),
                        65520.0f,
                        464.0f,
                        61440.0f,
                        0x1.ffp127f}) {
    if (static_cast<std::int64_t>(inputs.size()) < size) { inputs.push_back(x); }
  }
  std::uint32_t const codes = 1u << (8 * sizeof(T));
  using bits_type           = decltype(T::bits);
  for (std::uint32_t code = 0; code < codes && static_cast<std::int64_t>(inputs.size()) < size;
       ++code) {
    inputs.push_back(inferscale::to_float(T{static_cast<bits_type>(code)}));
  }
  std::mt19937 rng{2718281u};
  std::uniform_int_distribution<std::uint32_t> any_bits;
  while (static_cast<std::int64_t>(inputs.size()) < size) {
    inputs.push_back(float_from_bits(any_bits(rng)));
  }
  return inputs;
}

}  // namespace

TEMPLATE_TEST_CASE("device conversions give the host backend's bits",
                   "[gpu][dtype]",
                   half_t,
                   bfloat16_t,
                   float8_e4m3_t,
                   float8_e5m2_t)
{
  using bits_type = decltype(TestType::bits);
  // 0, 1, odd, and larger than one grid (grid_blocks * block_threads elements per sweep).
  auto const size = GENERATE(as<std::int64_t>{}, 0, 1, 4097, 3 << 21);
  CAPTURE(inferscale::to_string(inferscale::dtype_of_v<TestType>), size);

  std::vector<float> const inputs = make_inputs<TestType>(size);
  auto const count                = static_cast<std::size_t>(size);

  stream const work;
  device_buffer<float> device_inputs{count};
  device_buffer<std::uint32_t> device_codes{count};
  device_buffer<float> device_widened{count};
  INFERSCALE_CUDA_TRY(cudaMemcpyAsync(device_inputs.data(),
                                      inputs.data(),
                                      count * sizeof(float),
                                      cudaMemcpyHostToDevice,
                                      work.get()));

  constexpr int block_threads = 256;
  constexpr int grid_blocks   = 1024;
  int const blocks            = static_cast<int>(std::min<std::int64_t>(
    grid_blocks, std::max<std::int64_t>(1, (size + block_threads - 1) / block_threads)));
  inferscale_test::conversion_params const params{
    device_inputs.data(), device_codes.data(), device_widened.data(), size};
  inferscale_test::conversion_kernel<TestType><<<blocks, block_threads, 0, work.get()>>>(params);
  INFERSCALE_CHECK_LAUNCH();

  std::vector<std::uint32_t> codes(count);
  std::vector<float> widened(count);
  INFERSCALE_CUDA_TRY(cudaMemcpyAsync(codes.data(),
                                      device_codes.data(),
                                      count * sizeof(std::uint32_t),
                                      cudaMemcpyDeviceToHost,
                                      work.get()));
  INFERSCALE_CUDA_TRY(cudaMemcpyAsync(widened.data(),
                                      device_widened.data(),
                                      count * sizeof(float),
                                      cudaMemcpyDeviceToHost,
                                      work.get()));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(work.get()));

  std::size_t code_mismatches  = 0;
  std::size_t widen_mismatches = 0;
  std::string first_mismatches;
  for (std::size_t i = 0; i < count; ++i) {
    std::uint32_t const host_code = inferscale::from_float<TestType>(inputs[i]).bits;
    bool const same_code =
      std::isnan(inputs[i])
        ? std::isnan(inferscale::to_float(TestType{static_cast<bits_type>(codes[i])})) &&
            std::isnan(inferscale::to_float(TestType{static_cast<bits_type>(host_code)}))
        : codes[i] == host_code;
    if (!same_code) {
      if (code_mismatches + widen_mismatches < 8) {
        first_mismatches += "from_float(" + describe(inputs[i]) + "): device " +
                            std::to_string(codes[i]) + ", host " + std::to_string(host_code) + "\n";
      }
      ++code_mismatches;
    }
    auto const code          = static_cast<bits_type>(i);
    float const host_widened = inferscale::to_float(TestType{code});
    if (!same_float(widened[i], host_widened)) {
      if (code_mismatches + widen_mismatches < 8) {
        first_mismatches += "to_float(" + std::to_string(code) + "): device " +
                            describe(widened[i]) + ", host " + describe(host_widened) + "\n";
      }
      ++widen_mismatches;
    }
  }
  INFO(first_mismatches);
  CHECK(code_mismatches == 0);
  CHECK(widen_mismatches == 0);
}
