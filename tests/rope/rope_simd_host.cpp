// The host rotation's vector paths (AVX2 and AVX-512F, chosen at run time) against its scalar loop,
// bit for bit: the same rope_apply_host call with the vector level capped to scalar, then at AVX2
// and AVX-512 where present, over key dtypes, rotation sources (fp32 and exact angles, fp32 and
// bf16 tables with and without vLLM's per-operation rounding, the fused multiply-add table), the
// three operations, partial rotary dims and pair counts that are not multiples of eight, packed and
// padded heads. The scalar loop is checked against independent references in rope_host.cpp.
#include "simd_paths.hpp"

#include <inferscale/rope.hpp>
#include <inferscale/views.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

using namespace inferscale;
using namespace inferscale_test;

namespace {

/// The thread's MXCSR (x86; the vector paths exist only there).
unsigned read_mxcsr()
{
#if defined(__SSE__)
  return _mm_getcsr();
#else
  return 0;
#endif
}

void write_mxcsr([[maybe_unused]] unsigned value)
{
#if defined(__SSE__)
  _mm_setcsr(value);
#endif
}

/// Rotates `[tokens, heads, head_dim]` keys with both paths and requires identical bits.
template <class T>
void check_rotation(
  int heads, int head_dim, int rotary_dim, rotation_kind rotation, rope_op op, bool padded)
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
    CAPTURE(level);  // 1: avx2, 2: avx512, 3: avx512_bf16
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
  auto const geometry = GENERATE(std::make_pair(128, 128),
                                 std::make_pair(96, 64),
                                 std::make_pair(20, 20),
                                 std::make_pair(64, 38));
  auto const heads    = GENERATE(1, 8);
  auto const padded   = GENERATE(false, true);
  CAPTURE(sizeof(T),
          name_of(rotation),
          static_cast<int>(op),
          geometry.first,
          geometry.second,
          heads,
          padded);
  check_rotation<T>(heads, geometry.first, geometry.second, rotation, op, padded);
}

TEST_CASE("the vector host rotation of bf16 keys with subnormals, zeros and specials",
          "[rope][simd]")
{
  // The avx512_bf16 level's native rounding reads subnormal fp32 values as zero; a vector that
  // holds one must take the integer rounding. Keys of every kind, rotated so that some results are
  // subnormal (tiny keys) and some groups hold none, compared bit for bit with the scalar loop:
  // the fp32 rotation and vLLM's per-operation rounding (whose products of tiny keys are
  // subnormal too), with the thread's denormals-are-zero mode off and on (the native
  // conversion's zero-code test must find the subnormals either way; the scalar loop's
  // arithmetic then reads subnormal inputs as zero as well).
  if (!vector_path_available()) { return; }
  auto const rotation = GENERATE(rotation_kind::fp32_angles, rotation_kind::table_bf16_round);
  bool const daz      = GENERATE(false, true);
  CAPTURE(name_of(rotation), daz);
  struct mxcsr_guard {
    unsigned saved = read_mxcsr();
    ~mxcsr_guard() { write_mxcsr(saved); }
  } const guard;
  write_mxcsr(daz ? guard.saved | 0x40u : guard.saved & ~0x40u);
  std::int64_t const rows = 16 * 997 + 2;
  rotation_case const rot(128, 128, rotation, rows);
  int const heads = 4, head_dim = 128;
  std::int64_t const tokens = 16;
  std::vector<bfloat16_t> original(static_cast<std::size_t>(tokens * heads * head_dim));
  std::mt19937_64 rng(9);
  std::uniform_int_distribution<std::uint32_t> pick(0, 9);
  std::uniform_int_distribution<std::uint32_t> code(0, 0xffff);
  for (std::size_t i = 0; i < original.size(); ++i) {
    bool const quiet_group   = (i / 16) % 3 == 0;  // every third group of 16 keys: ordinary values
    std::uint32_t const kind = quiet_group ? 9 : pick(rng);
    std::uint16_t bits;
    switch (kind) {
      case 0: bits = static_cast<std::uint16_t>(1 + code(rng) % 0x7f); break;  // subnormal
      case 1: bits = static_cast<std::uint16_t>(0x8000 | (1 + code(rng) % 0x7f)); break;
      case 2: bits = static_cast<std::uint16_t>(0x0080 + code(rng) % 0x100); break;  // tiny
      case 3: bits = 0; break;
      case 4: bits = 0x7f80; break;  // infinity
      case 5: bits = 0x7fc1; break;  // NaN
      case 6: bits = 0x7f7f; break;  // largest finite
      default: bits = static_cast<std::uint16_t>(0x3f00 + code(rng) % 0x200); break;
    }
    original[i].bits = bits;
  }
  std::vector<std::int64_t> positions;
  for (std::int64_t t = 0; t < tokens; ++t) {
    positions.push_back(1 + 997 * t);
  }
  std::vector<std::vector<bfloat16_t>> results;
  int const levels = all_paths([&](detail::host_simd) {
    std::vector<bfloat16_t> data = original;
    rot.visit(rotation, rows, [&](auto const& r) {
      rope_apply_host(make_token_head_view(data.data(), tokens, heads, head_dim),
                      positions.data(),
                      tokens,
                      r,
                      rope_op::forward);
    });
    results.push_back(std::move(data));
  });
  REQUIRE(levels >= 2);
  for (std::size_t level = 1; level < results.size(); ++level) {
    CAPTURE(level);
    std::size_t differing = 0, subnormal_results = 0;
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      differing += results[level][i].bits != results[0][i].bits;
      subnormal_results += (results[0][i].bits & 0x7f80) == 0 && (results[0][i].bits & 0x7f) != 0;
    }
    CHECK(differing == 0);
    // the fallback was needed (with denormals-are-zero, only a difference of two normal
    // products can still be subnormal: a few)
    CHECK(subnormal_results > (daz ? 0u : 100u));
  }
}
