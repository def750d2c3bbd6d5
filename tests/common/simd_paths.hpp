// Shared by the vector-versus-scalar tests of the host backend (tests/inject/inject_simd_host.cpp,
// tests/rope/rope_simd_host.cpp): running a case with the vector level capped to scalar, then
// uncapped, and the rotations those tests cover.
#pragma once

#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/rope.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace inferscale_test {

using namespace inferscale;

/// Restores the default vector level when a test ends, even by an exception.
struct simd_cap_guard {
  ~simd_cap_guard() { detail::set_host_simd_cap(detail::host_simd::avx512_bf16); }
};

inline bool vector_path_available()
{
  if (detail::detected_host_simd() != detail::host_simd::scalar) { return true; }
  WARN("this CPU (or build) has no AVX2/F16C/FMA: only the scalar path exists, nothing to compare");
  return false;
}

/// Runs `f(level)` with the vector level capped to scalar, then to each vector level the CPU has
/// (avx2, then avx512 and avx512_bf16 where present); returns how many levels ran.
template <class F>
int all_paths(F&& f)
{
  simd_cap_guard const guard;
  int runs = 0;
  for (auto level : {detail::host_simd::scalar,
                     detail::host_simd::avx2,
                     detail::host_simd::avx512,
                     detail::host_simd::avx512_bf16}) {
    if (static_cast<int>(level) > static_cast<int>(detail::detected_host_simd())) { break; }
    detail::set_host_simd_cap(level);
    REQUIRE(detail::active_host_simd() == level);
    f(level);
    ++runs;
  }
  return runs;
}

enum class rotation_kind { fp32_angles, exact_angles, table_fp32, table_bf16_round, table_fused };

inline std::string name_of(rotation_kind r)
{
  switch (r) {
    case rotation_kind::fp32_angles: return "fp32 angles";
    case rotation_kind::exact_angles: return "exact angles";
    case rotation_kind::table_fp32: return "fp32 table";
    case rotation_kind::table_bf16_round: return "bf16 table, per-operation rounding";
    default: return "fp32 table, fused multiply-add";
  }
}

/// The rotation of one case and the table data it points into.
struct rotation_case {
  rope_params params{};
  std::vector<float> table_fp32;
  std::vector<bfloat16_t> table_bf16;

  rotation_case(int head_dim,
                int rotary_dim,
                rotation_kind kind,
                std::int64_t rows,
                rope_pairing pairing = rope_pairing::halves)
  {
    rope_spec spec  = rope_presets::llama_3_1_8b();
    spec.head_dim   = head_dim;
    spec.rotary_dim = rotary_dim;
    spec.pairing    = pairing;
    spec.angle_mode =
      kind == rotation_kind::exact_angles ? rope_angle_mode::exact : rope_angle_mode::fp32;
    params = make_rope_params(spec);
    if (kind == rotation_kind::table_bf16_round) {
      table_bf16 = make_rope_cos_sin_values<bfloat16_t>(params, rows);
    } else {
      table_fp32 = make_rope_cos_sin_values<float>(params, rows);
    }
  }

  template <class F>
  void visit(rotation_kind kind, std::int64_t rows, F&& f) const
  {
    switch (kind) {
      case rotation_kind::fp32_angles:
      case rotation_kind::exact_angles: f(params); return;
      case rotation_kind::table_bf16_round:
        f(make_rope_cos_sin_table(params, table_bf16.data(), rows, true));
        return;
      case rotation_kind::table_fp32:
        f(make_rope_cos_sin_table(params, table_fp32.data(), rows, false));
        return;
      default: {
        auto table               = make_rope_cos_sin_table(params, table_fp32.data(), rows, false);
        table.fused_multiply_add = true;
        f(table);
      }
    }
  }
};

}  // namespace inferscale_test
