/**
 * @file bench/rope/rope_bench.cu
 * @brief Rotary embedding: forward rotation in place of `[tokens, heads, 128]` keys in
 * Llama-3.1-8B's rope (llama3 scaling, theta 5e5), bf16 and fp32, host and device backends, the
 * rotation resolved from rope_params or read from an engine cos/sin table (vLLM layout, fp32).
 *
 * Bytes counted per call: read + write of the rotated data, 2 * tokens * heads * head_dim *
 * sizeof(T) (positions, and the table rows, are not counted: 8 bytes and at most 512 bytes per
 * token). Items: rotated head vectors (tokens * heads). Every benchmark also reports the plain copy
 * of the same bytes measured in the same run (`copy_GB/s`) and the ratio (`vs_copy`); see
 * bench/common/fixture.hpp.
 *
 * Names: rope_forward/<backend>/<dtype>/<rotation>/tokens:<T>/heads:<H>.
 * Positions are those of a prefill, 0 .. tokens - 1. Host shapes: 256, 1,024 (issue 12's m) and
 * 4,096 tokens of 8 (Llama-3.1-8B's KV heads) or 32 heads. At 256 x 8 (512 KB of bf16 keys) the
 * keys and the copy's source and destination all stay in a 2 MiB L2; at 1,024 x 8 the in-place
 * rotation's 2 MiB fit it while the copy's 4 MiB do not, which favours the rotation; at 4,096 both
 * stream from beyond the L2.
 */
#include "../common/fixture.hpp"

#include <inferscale/dtype.hpp>
#include <inferscale/rope.cuh>
#include <inferscale/rope.hpp>
#include <inferscale/views.hpp>

#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace {

namespace ib = inferscale::bench;
using inferscale::bfloat16_t;

constexpr std::int64_t head_dim = 128;  // Llama-3.1-8B
constexpr std::uint64_t seed    = 20240723;

enum class rotation_source { params, table };

template <class T>
char const* dtype_name()
{
  return std::is_same_v<T, float> ? "fp32" : "bf16";
}

char const* source_name(rotation_source s)
{
  return s == rotation_source::params ? "params" : "table";
}

inferscale::rope_params llama_params()
{
  return inferscale::make_rope_params(inferscale::rope_presets::llama_3_1_8b());
}

std::vector<std::int64_t> prefill_positions(std::int64_t tokens)
{
  std::vector<std::int64_t> positions(static_cast<std::size_t>(tokens));
  std::iota(positions.begin(), positions.end(), std::int64_t{0});
  return positions;
}

template <class T>
ib::traffic rope_traffic(std::int64_t tokens, std::int64_t heads)
{
  std::int64_t const bytes = tokens * heads * head_dim * static_cast<std::int64_t>(sizeof(T));
  return ib::traffic{2 * bytes, tokens * heads};
}

template <class T, rotation_source Source>
void rope_forward_host(benchmark::State& state)
{
  ib::run_guarded(state, [&] {
    std::int64_t const tokens = state.range(0);
    std::int64_t const heads  = state.range(1);
    auto const params         = llama_params();
    auto data = ib::uniform_values<T>(static_cast<std::size_t>(tokens * heads * head_dim), seed);
    auto const positions = prefill_positions(tokens);
    auto const x         = inferscale::make_token_head_view(data.data(), tokens, heads, head_dim);
    auto const t         = rope_traffic<T>(tokens, heads);

    if constexpr (Source == rotation_source::params) {
      ib::run_host(state, t, data.data(), [&] {
        inferscale::rope_apply_host(
          x, positions.data(), tokens, params, inferscale::rope_op::forward);
      });
    } else {
      auto const table_values = inferscale::make_rope_cos_sin_values<float>(params, tokens);
      auto const table = inferscale::make_rope_cos_sin_table(params, table_values.data(), tokens);
      ib::run_host(state, t, data.data(), [&] {
        inferscale::rope_apply_host(
          x, positions.data(), tokens, table, inferscale::rope_op::forward);
      });
    }
  });
}

template <class T, rotation_source Source>
void rope_forward_device(benchmark::State& state)
{
  if (!ib::require_device(state)) { return; }
  ib::run_guarded(state, [&] {
    std::int64_t const tokens = state.range(0);
    std::int64_t const heads  = state.range(1);
    auto const params         = llama_params();
    ib::device_buffer<T> data(
      ib::uniform_values<T>(static_cast<std::size_t>(tokens * heads * head_dim), seed));
    ib::device_buffer<std::int64_t> positions(prefill_positions(tokens));
    auto const x = inferscale::make_token_head_view(data.data(), tokens, heads, head_dim);
    auto const t = rope_traffic<T>(tokens, heads);

    if constexpr (Source == rotation_source::params) {
      ib::run_device(state, t, data.data(), [&](cudaStream_t stream) {
        inferscale::rope_apply_async(
          x, positions.data(), tokens, params, inferscale::rope_op::forward, stream);
      });
    } else {
      ib::device_buffer<float> table_values(
        inferscale::make_rope_cos_sin_values<float>(params, tokens));
      auto const table = inferscale::make_rope_cos_sin_table(params, table_values.data(), tokens);
      ib::run_device(state, t, data.data(), [&](cudaStream_t stream) {
        inferscale::rope_apply_async(
          x, positions.data(), tokens, table, inferscale::rope_op::forward, stream);
      });
    }
  });
}

template <class T, rotation_source Source>
void register_host()
{
  std::string const name =
    std::string{"rope_forward/host/"} + dtype_name<T>() + "/" + source_name(Source);
  benchmark::RegisterBenchmark(name.c_str(), rope_forward_host<T, Source>)
    ->Apply(ib::host_benchmark)
    ->ArgNames({"tokens", "heads"})
    ->ArgsProduct({{256, 1024, 4096}, {8, 32}});
}

template <class T, rotation_source Source>
void register_device()
{
  std::string const name =
    std::string{"rope_forward/device/"} + dtype_name<T>() + "/" + source_name(Source);
  benchmark::RegisterBenchmark(name.c_str(), rope_forward_device<T, Source>)
    ->Apply(ib::device_benchmark)
    ->ArgNames({"tokens", "heads"})
    ->ArgsProduct({{1024, 16384, 131072}, {8, 32}});
}

void register_rope_benchmarks()
{
  register_host<bfloat16_t, rotation_source::params>();
  register_host<float, rotation_source::params>();
  register_host<bfloat16_t, rotation_source::table>();
  register_device<bfloat16_t, rotation_source::params>();
  register_device<float, rotation_source::params>();
  register_device<bfloat16_t, rotation_source::table>();
}

}  // namespace

int main(int argc, char** argv)
{
  register_rope_benchmarks();
  return inferscale::bench::benchmark_main(argc, argv);
}
