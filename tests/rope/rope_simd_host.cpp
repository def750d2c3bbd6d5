// The host rotation's vector paths (AVX2 and AVX-512F, chosen at run time) against its scalar loop, bit for bit:
// the same rope_apply_host call with the vector level capped to scalar, then at AVX2 and AVX-512 where present, over key
// dtypes, rotation sources (fp32 and exact angles, fp32 and bf16 tables with and without vLLM's
// per-operation rounding, the fused multiply-add table), the three operations, partial rotary
// dims and pair counts that are not multiples of eight, packed and padded heads. The scalar loop
// is checked against independent references in rope_host.cpp.
#include "simd_paths.hpp"

#include <inferscale/rope.hpp>
#include <inferscale/views.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

using namespace inferscale;
using namespace inferscale_test;

namespace {

/// Rotates `[tokens, heads, head_dim]` keys with both paths and requires identical bits.
template <class T>
void check_rotation(int heads, int head_dim, int rotary_dim, rotation_kind rotation, rope_op op,
                    bool padded)
{
  std::int64_t const rows   = 8192;
  std::int64_t const tokens = 37;
  rotation_case const rot(head_dim, rotary_dim, rotation, rows);
  // Padded: heads `head_dim + 8` apart (a strided view whose dims are still contiguous).
  std::int64_t const head_stride  = padded ? head_dim + 8 : head_dim;
  std::int64_t const token_stride = heads * head_stride;
  std::vector<T> original(static_cast<std::size_t>(tokens * token_stride));
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (auto& x : original) {
    x = from_float<T>(u(rng));
  }
  std::vector<std::int64_t> positions;
  for (std::int64_t t = 0; t < tokens; ++t) {
    positions.push_back(op == rope_op::shift ? (t % 2 ? -1 : 1) * (t * 211 % 8000)
                                             : t * 211 % 8000);
  }
  std::vector<std::vector<T>> results;
  all_paths([&](detail::host_simd) {
    std::vector<T> data = original;
    auto const view =
      make_token_head_view(data.data(), tokens, heads, head_dim, token_stride, head_stride);
    rot.visit(rotation, rows, [&](auto const& r) {
      rope_apply_host(view, positions.data(), tokens, r, op);
    });
    results.push_back(std::move(data));
  });
  REQUIRE(results.size() >= 2);
  for (std::size_t level = 1; level < results.size(); ++level) {
    CAPTURE(level);  // 1: avx2, 2: avx512
    std::size_t differing = 0;
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      differing += std::memcmp(&results[level][i], &results[0][i], sizeof(T)) != 0;
    }
    CHECK(differing == 0);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("the vector host rotation gives the scalar loop's bits",
                   "[rope][simd]",
                   float,
                   half_t,
                   bfloat16_t)
{
  if (!vector_path_available()) { return; }
  using T             = TestType;
  auto const rotation = GENERATE(rotation_kind::fp32_angles,
                                 rotation_kind::exact_angles,
                                 rotation_kind::table_fp32,
                                 rotation_kind::table_bf16_round,
                                 rotation_kind::table_fused);
  auto const op       = GENERATE(rope_op::forward, rope_op::inverse, rope_op::shift);
  auto const geometry = GENERATE(std::make_pair(128, 128), std::make_pair(96, 64),
                                 std::make_pair(20, 20), std::make_pair(64, 38));
  auto const heads    = GENERATE(1, 8);
  auto const padded   = GENERATE(false, true);
  CAPTURE(sizeof(T), name_of(rotation), static_cast<int>(op), geometry.first, geometry.second,
          heads, padded);
  check_rotation<T>(heads, geometry.first, geometry.second, rotation, op, padded);
}
