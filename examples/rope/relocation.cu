// Example: a memory fact's keys are stored before RoPE and rotated on the fly to whatever
// position a request puts them at. This program stores the pre-RoPE keys of a 20-token "fact"
// with Llama-3.1-8B's rotary embedding, places it at two different virtual positions, and shows
// that a query's attention scores depend only on the distance between query and key (the
// relocation identity the whole library rests on). Where a GPU is visible it also runs the device
// backend and compares it with the host backend.
#include <inferscale/cuda_error.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/rope.cuh>
#include <inferscale/rope.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

using namespace inferscale;

namespace {
double score(std::vector<float> const& q, float const* k, int d)
{
  double s = 0;
  for (int j = 0; j < d; ++j) {
    s += double(q[j]) * k[j];
  }
  return s / std::sqrt(double(d));
}
}  // namespace

int main()
{
  rope_spec spec       = rope_presets::llama_3_1_8b();
  spec.angle_mode      = rope_angle_mode::exact;  // relocation to fp32 rounding
  rope_params const rp = make_rope_params(spec);
  int const d = 128, fact_tokens = 20;

  std::mt19937_64 rng(2026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> pre_rope_keys(fact_tokens * d), query(d);
  for (auto& x : pre_rope_keys) {
    x = normal(rng);
  }
  for (auto& x : query) {
    x = normal(rng);
  }

  // Place the fact at virtual positions 100.. and 90000.., the query 7 tokens after the fact.
  double max_difference = 0;
  std::vector<double> scores[2];
  std::int64_t const starts[2] = {100, 90000};
  for (int placement = 0; placement < 2; ++placement) {
    std::vector<float> keys = pre_rope_keys;
    std::vector<std::int64_t> positions(fact_tokens);
    for (int t = 0; t < fact_tokens; ++t) {
      positions[t] = starts[placement] + t;
    }
    rope_apply_host(make_token_head_view(keys.data(), fact_tokens, 1, d),
                    positions.data(),
                    fact_tokens,
                    rp,
                    rope_op::forward);
    std::vector<float> q              = query;
    std::int64_t const query_position = starts[placement] + fact_tokens + 7;
    rope_apply_host(
      make_token_head_view(q.data(), 1, 1, d), &query_position, 1, rp, rope_op::forward);
    for (int t = 0; t < fact_tokens; ++t) {
      scores[placement].push_back(score(q, &keys[t * d], d));
    }
  }
  for (int t = 0; t < fact_tokens; ++t) {
    max_difference = std::max(max_difference, std::fabs(scores[0][t] - scores[1][t]));
  }
  std::printf("Llama-3.1-8B rope (llama3 scaling, theta 5e5), one head of dim %d, %d-token fact\n",
              d,
              fact_tokens);
  std::printf("scores with the fact at position %lld: %.6f %.6f %.6f ...\n",
              static_cast<long long>(starts[0]),
              scores[0][0],
              scores[0][1],
              scores[0][2]);
  std::printf("scores with the fact at position %lld: %.6f %.6f %.6f ...\n",
              static_cast<long long>(starts[1]),
              scores[1][0],
              scores[1][1],
              scores[1][2]);
  std::printf(
    "largest difference over %d scores: %.3g (fp32 rounding)\n", fact_tokens, max_difference);
  int status = max_difference < 1e-4 ? 0 : 1;

  if (visible_device_count() == 0) {
    std::printf("no CUDA device visible: device backend not run\n");
    return status;
  }
  // The device backend on the same keys: 8 KV heads, bf16, as an engine's cache holds them.
  int const heads = 8, tokens = 4096;
  std::vector<bfloat16_t> host(std::size_t(tokens) * heads * d);
  for (auto& x : host) {
    x = from_float<bfloat16_t>(normal(rng));
  }
  std::vector<std::int64_t> positions(tokens);
  for (int t = 0; t < tokens; ++t) {
    positions[t] = 1000 + t;
  }
  device_buffer<bfloat16_t> device_keys(host);  // copied to the device
  device_buffer<std::int64_t> const device_positions(positions);
  rope_apply_async(make_token_head_view(device_keys.data(), tokens, heads, d),
                   device_positions.data(),
                   tokens,
                   rp,
                   rope_op::forward,
                   cuda::stream_ref{cudaStream_t{}});
  rope_apply_host(make_token_head_view(host.data(), tokens, heads, d),
                  positions.data(),
                  tokens,
                  rp,
                  rope_op::forward);
  std::vector<bfloat16_t> const back = device_keys.to_host();  // waits for the device
  std::size_t differing              = 0;
  for (std::size_t i = 0; i < host.size(); ++i) {
    differing += back[i].bits != host[i].bits;
  }
  std::printf("device vs host, %d tokens x %d heads bf16: %zu of %zu elements differ in bits\n",
              tokens,
              heads,
              differing,
              host.size());
  return status;
}
