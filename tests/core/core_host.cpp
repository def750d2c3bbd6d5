// Host tests of the core: error types and macros, CUDA error reporting (no device needed: the
// macro is fed error codes directly), strided views, the rounding and division helpers
// (detail/math.hpp) and memory resources with device_buffer (routing and ownership, with a
// recording resource of host memory).
#include "counting_resource.hpp"

#include <inferscale/config.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_resource.hpp>
#include <inferscale/views.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using Catch::Matchers::Contains;

namespace {
int checked_twice(int x)
{
  INFERSCALE_EXPECTS(x >= 0, "x must be non-negative, got " + std::to_string(x));
  return 2 * x;
}
}  // namespace

TEST_CASE("INFERSCALE_EXPECTS throws logic_error naming the reason, condition, file and line",
          "[core]")
{
  REQUIRE(checked_twice(4) == 8);
  REQUIRE_THROWS_AS(checked_twice(-3), inferscale::logic_error);
  REQUIRE_THROWS_AS(checked_twice(-3), std::logic_error);  // catchable as the standard base
  REQUIRE_THROWS_WITH(
    checked_twice(-3),
    Contains("x must be non-negative, got -3") && Contains("x >= 0") && Contains("core_host.cpp:"));
  REQUIRE_THROWS_WITH(INFERSCALE_FAIL("no such dtype"), Contains("no such dtype"));
}

TEST_CASE("INFERSCALE_CUDA_TRY throws cuda_error with the call, the error name and its text",
          "[core]")
{
  // The macro is a statement: wrap it to hand it error codes (no device is needed for that).
#if INFERSCALE_HAS_CUDA_RUNTIME
  auto const try_call = [](cudaError_t status) { INFERSCALE_CUDA_TRY(status); };
  REQUIRE_NOTHROW(try_call(cudaSuccess));
  REQUIRE_THROWS_AS(try_call(cudaErrorInvalidValue), inferscale::cuda_error);
  REQUIRE_THROWS_AS(try_call(cudaErrorInvalidValue), std::runtime_error);
  REQUIRE_THROWS_WITH(try_call(cudaErrorMemoryAllocation),
                      Contains("status returned cudaErrorMemoryAllocation") &&
                        Contains("out of memory") && Contains("core_host.cpp:"));
#else
  // The stand-in runtime of the CPU-only build knows one failure, cudaErrorNoDevice, whose text
  // says the build has no CUDA runtime.
  namespace rt        = inferscale::detail::host_only_runtime;
  auto const try_call = [](rt::cudaError_t status) { INFERSCALE_CUDA_TRY(status); };
  REQUIRE_NOTHROW(try_call(rt::cudaSuccess));
  REQUIRE_THROWS_AS(try_call(rt::cudaErrorNoDevice), inferscale::cuda_error);
  REQUIRE_THROWS_AS(try_call(rt::cudaErrorNoDevice), std::runtime_error);
  REQUIRE_THROWS_WITH(try_call(rt::cudaErrorNoDevice),
                      Contains("status returned cudaErrorNoDevice") &&
                        Contains("compiled without the CUDA runtime") &&
                        Contains("core_host.cpp:"));
#endif
  static_assert(!std::is_base_of_v<inferscale::logic_error, inferscale::cuda_error>,
                "a CUDA failure is not a precondition violation");
}

TEST_CASE("visible_device_count never throws and is non-negative", "[core]")
{
  int const count = inferscale::visible_device_count();
  REQUIRE(count >= 0);
  REQUIRE(inferscale::visible_device_count() == count);  // stable across calls
}

TEST_CASE("token_head_view addresses elements through its strides", "[core]")
{
  std::vector<int> buffer(2 * 3 * 4 * 2);
  for (std::size_t i = 0; i < buffer.size(); ++i) {
    buffer[i] = static_cast<int>(i);
  }
  SECTION("contiguous")
  {
    auto const v = inferscale::make_token_head_view(buffer.data(), 2, 3, 4);
    REQUIRE(v.extent(0) == 2);
    REQUIRE(v.extent(1) == 3);
    REQUIRE(v.extent(2) == 4);
    for (std::int64_t t = 0; t < 2; ++t) {
      for (std::int64_t h = 0; h < 3; ++h) {
        for (std::int64_t d = 0; d < 4; ++d) {
          REQUIRE(v(t, h, d) == (t * 3 + h) * 4 + d);
        }
      }
    }
  }
  SECTION("strided: every other element, heads 8 apart, tokens 24 apart")
  {
    auto const v = inferscale::make_token_head_view(buffer.data(), 2, 3, 4, 24, 8, 2);
    REQUIRE(v.stride(0) == 24);
    REQUIRE(v.stride(1) == 8);
    REQUIRE(v.stride(2) == 2);
    for (std::int64_t t = 0; t < 2; ++t) {
      for (std::int64_t h = 0; h < 3; ++h) {
        for (std::int64_t d = 0; d < 4; ++d) {
          REQUIRE(v(t, h, d) == t * 24 + h * 8 + d * 2);
        }
      }
    }
  }
}

TEST_CASE("config macros describe the compiler", "[core]")
{
  // This translation unit is compiled by the host compiler alone.
  STATIC_REQUIRE(INFERSCALE_HAS_CUDA_COMPILER == 0);
  STATIC_REQUIRE(INFERSCALE_IS_DEVICE_CODE == 0);
  STATIC_REQUIRE(INFERSCALE_VERSION_MAJOR == 0);
}

TEST_CASE("ceil_div and round_up: exact ceilings, edge cases written out", "[core][math]")
{
  using inferscale::detail::ceil_div;
  using inferscale::detail::round_up;
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();  // 2^63 - 1
  SECTION("zero, exact multiples, one past")
  {
    STATIC_REQUIRE(ceil_div(0, 16) == 0);
    STATIC_REQUIRE(ceil_div(1, 16) == 1);
    STATIC_REQUIRE(ceil_div(16, 16) == 1);
    STATIC_REQUIRE(ceil_div(17, 16) == 2);
    STATIC_REQUIRE(ceil_div(32, 16) == 2);
    STATIC_REQUIRE(ceil_div(7, 1) == 7);
    STATIC_REQUIRE(round_up(0, 16) == 0);
    STATIC_REQUIRE(round_up(1, 16) == 16);
    STATIC_REQUIRE(round_up(16, 16) == 16);
    STATIC_REQUIRE(round_up(17, 16) == 32);
  }
  SECTION("near INT64 max, where (a + b - 1) / b would overflow")
  {
    // max = 16 * (2^59 - 1) + 15: the quotient 2^59 - 1 plus one for the remainder 15.
    STATIC_REQUIRE(ceil_div(max, std::int64_t{16}) == (std::int64_t{1} << 59));
    STATIC_REQUIRE(ceil_div(max, max) == 1);
    STATIC_REQUIRE(ceil_div(max - 1, max) == 1);
    STATIC_REQUIRE(ceil_div(max, std::int64_t{1}) == max);
    // max - 15 = 16 * (2^59 - 1) exactly: no rounding, and round_up is the identity there.
    STATIC_REQUIRE(ceil_div(max - 15, std::int64_t{16}) == (std::int64_t{1} << 59) - 1);
    STATIC_REQUIRE(round_up(max - 15, std::int64_t{16}) == max - 15);
    constexpr std::uint64_t umax = std::numeric_limits<std::uint64_t>::max();  // 2^64 - 1
    STATIC_REQUIRE(ceil_div(umax, std::uint64_t{2}) == (std::uint64_t{1} << 63));
  }
  SECTION("negative dividends round toward +infinity")
  {
    STATIC_REQUIRE(ceil_div(-1, 16) == 0);  // ceil(-0.0625)
    STATIC_REQUIRE(ceil_div(-16, 16) == -1);
    STATIC_REQUIRE(ceil_div(-17, 16) == -1);  // ceil(-1.0625)
    STATIC_REQUIRE(ceil_div(-7, 2) == -3);    // ceil(-3.5)
  }
  SECTION("mixed widths take the common type")
  {
    STATIC_REQUIRE(std::is_same_v<decltype(ceil_div(std::int64_t{5}, 2)), std::int64_t>);
    STATIC_REQUIRE(std::is_same_v<decltype(ceil_div(std::uint32_t{5}, 2)), std::uint32_t>);
    STATIC_REQUIRE(ceil_div(std::int64_t{5000000000}, 3) == 1666666667);
  }
  SECTION("against the real ceiling, brute force over small operands")
  {
    for (std::int64_t a = -50; a <= 50; ++a) {
      for (std::int64_t b = 1; b <= 17; ++b) {
        // the least q with q * b >= a
        std::int64_t q = -50;
        while (q * b < a) {
          ++q;
        }
        CAPTURE(a, b);
        REQUIRE(ceil_div(a, b) == q);
        REQUIRE(round_up(a, b) == q * b);
      }
    }
  }
}

TEST_CASE("device_buffer allocates from and returns to its resource", "[core][memory_resource]")
{
  inferscale_test::counting_resource resource;  // host memory: no device needed
  auto* const stream =
    reinterpret_cast<inferscale_test::stream_t>(std::uintptr_t{0x1000});  // recorded only
  SECTION("size, bytes, stream and the free on destruction")
  {
    {
      inferscale::device_buffer<std::int64_t> b(5, stream, &resource);
      REQUIRE(b.size() == 5);
      REQUIRE(b.bytes() == 40);
      REQUIRE(b.stream() == stream);
      REQUIRE(b.resource() == &resource);
      REQUIRE(resource.allocations.size() == 1);
      REQUIRE(resource.allocations[0].bytes == 40);
      REQUIRE(resource.allocations[0].alignment == 256);
      REQUIRE(resource.allocations[0].stream == stream);
      REQUIRE(resource.allocations[0].pointer == b.data());
      REQUIRE(resource.deallocations.empty());
    }
    REQUIRE(resource.deallocations.size() == 1);
    REQUIRE(resource.deallocations[0].pointer == resource.allocations[0].pointer);
    REQUIRE(resource.deallocations[0].bytes == 40);
    REQUIRE(resource.deallocations[0].stream == stream);
  }
  SECTION("0 elements still hold one element's room; a default buffer holds nothing")
  {
    {
      inferscale::device_buffer<double> b(0, nullptr, &resource);
      REQUIRE(b.empty());
      REQUIRE(b.data() != nullptr);
      REQUIRE(resource.allocations.at(0).bytes == sizeof(double));
      inferscale::device_buffer<double> none;
      REQUIRE(none.data() == nullptr);
      REQUIRE(none.resource() == nullptr);
    }
    REQUIRE(resource.deallocations.size() == 1);
    REQUIRE(resource.deallocations[0].bytes == sizeof(double));
  }
  SECTION("moves transfer ownership: one free per allocation")
  {
    inferscale::device_buffer<float> a(3, nullptr, &resource);
    float* const p = a.data();
    inferscale::device_buffer<float> b(std::move(a));
    REQUIRE(b.data() == p);
    REQUIRE(a.data() == nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state
    inferscale::device_buffer<float> c(7, nullptr, &resource);
    c = std::move(b);  // c's own 7 floats are freed now
    REQUIRE(c.data() == p);
    REQUIRE(resource.deallocations.size() == 1);
    REQUIRE(resource.deallocations[0].bytes == 7 * sizeof(float));
    c.release();
    REQUIRE(c.data() == nullptr);
    REQUIRE(resource.deallocations.size() == 2);
    REQUIRE(resource.deallocations[1].pointer == p);
  }
  SECTION("refusals: overflowing sizes, alignments that are not powers of two")
  {
    REQUIRE_THROWS_AS(inferscale::device_buffer<std::int64_t>(
                        std::numeric_limits<std::size_t>::max() / 4, nullptr, &resource),
                      inferscale::logic_error);
    REQUIRE_THROWS_AS((void)resource.allocate(nullptr, 64, 24), inferscale::logic_error);
    REQUIRE(resource.allocations.empty());
  }
}

TEST_CASE("the CUDA resources refuse alignments above 256 bytes", "[core][memory_resource]")
{
  REQUIRE_THROWS_WITH((void)inferscale::default_device_resource()->allocate(nullptr, 64, 512),
                      Contains("alignment 512"));
  REQUIRE_THROWS_WITH((void)inferscale::pinned_host_resource()->allocate(nullptr, 64, 1024),
                      Contains("alignment 1024"));
  inferscale::cuda_async_memory_resource async;
  REQUIRE_THROWS_WITH((void)async.allocate(nullptr, 64, 4096), Contains("alignment 4096"));
}
