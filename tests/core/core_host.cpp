// Host tests of the core: error types and macros, CUDA error reporting (no device needed: the
// macro is fed error codes directly), and strided views.
#include <inferscale/config.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/error.hpp>
#include <inferscale/views.hpp>

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

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
  auto const try_call = [](cudaError_t status) { INFERSCALE_CUDA_TRY(status); };
  REQUIRE_NOTHROW(try_call(cudaSuccess));
  REQUIRE_THROWS_AS(try_call(cudaErrorInvalidValue), inferscale::cuda_error);
  REQUIRE_THROWS_AS(try_call(cudaErrorInvalidValue), std::runtime_error);
  REQUIRE_THROWS_WITH(try_call(cudaErrorMemoryAllocation),
                      Contains("status returned cudaErrorMemoryAllocation") &&
                        Contains("out of memory") && Contains("core_host.cpp:"));
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
