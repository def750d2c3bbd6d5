/**
 * @file bench/inject/inject_bench.cu
 * @brief Injection: stored pre-RoPE K/V of memory facts -> an engine's paged KV cache, keys rotated
 * to their virtual positions, all layers in one call; against the copy of the same bytes and
 * against the two-pass baseline (compose, then scatter), all measured in the same iterations.
 *
 * Setup (outside every timed region):
 *  - geometry: Llama-3.1-8B (32 layers, 8 KV heads, head_dim 128, llama3 rope, theta 5e5) or
 *    Qwen2.5-7B (28 layers, 4 KV heads, 128, theta 1e6); store bf16 (page size 16), cache bf16;
 *  - the cache: vLLM FlashAttention NHD, one tensor per layer of logical shape
 *    `(2, NB, 16, H, D)`, contiguous (make_vllm_flash_attn_cache);
 *  - a request's memory segment of exactly m tokens: n = round(m / 20) facts whose lengths cycle
 *    17, 18, .., 23, the difference to m spread as +1 over the first facts (m = 128: 6 facts of
 *    19..23 tokens; m = 1024: 51 facts of 17..24; m = 4096: 205 facts of 17..23), every fact 2
 *    store pages; composed with compose() at p0 = 37 (as given order), its tokens going to
 *    prompt positions p0 .. p0 + m - 1 of a block table of ceil((p0 + m) / 16) block ids drawn
 *    from a shuffled permutation of NB = 1.5x that many blocks (fixed seed), so consecutive blocks
 *    of the request are not adjacent in the cache;
 *  - the batch case: R requests of k = 20 distinct facts each (lengths cycle 17..23 over the whole
 *    batch: 64 x 20 facts = 25,597 tokens, 8 x 20 = 3,197), every request its own block table, one
 *    injection_batch with R add() calls, one launch;
 *  - K/V values: pseudo-random bf16 in [-1, 1) (a hash of the element index).
 *
 * What each iteration measures (same machine state for all three):
 *  - fused: the injection step's host run (host store, host cache), or the device launch
 *    (detail::inject_view_async, what the step's device run enqueues) on a staged
 *    injection_workspace (device); `Time` and `GB/s` are this;
 *  - two-pass baseline, written here: (a) gather the tokens from the store pages into a contiguous
 *    `[L, 2, N, H, D]` bf16 buffer with the keys rotated (library per-element math:
 *    rope_angle_cos_sin once per token and pair, detail::rotate_stored_pair); (b) scatter that
 *    buffer into a second cache by slot. Device: two kernels with 16-byte accesses, pass (a) tiled
 *    exactly like the fused kernel (tile_tokens tokens x tile_layers layers per block, the tile's
 *    cos/sin in shared memory), pass (b) on the same grid, each token's slot divided by the block
 *    size once; host: loops, memcpy for the rows that need no rotation.
 *    Counters `two_pass_GB/s` (same bytes over its time) and `vs_two_pass` = two-pass seconds /
 *    fused seconds (> 1: fused is faster);
 *  - the copy ceiling of the fixture: a plain copy of the same bytes (`copy_GB/s`, `vs_copy`).
 *  plan/host: the host planning of one step (compose every request, add it to a batch reused
 *  across steps), what the checked injection costs before its launch; `tokens_per_second`.
 *  On the device each of the three starts with a cold L2 (the fixture's l2_flusher).
 *  After the warm-up, the fused cache and the two-pass cache are compared with the composed buffer
 *  at every injected slot, bit for bit; a mismatch fails the benchmark (SkipWithError).
 *
 * inject_checked/device: the injection step's device run (validation of the host batch, staging
 * of its arrays through pinned memory, launch), timed on the host's wall clock from the call to
 * the end of a cudaStreamSynchronize; each iteration also times the raw launch the same way:
 * `vs_raw` = raw seconds / checked seconds (the share of the call that is the kernel).
 *
 * Bytes counted per call: the K and V of the N injected tokens read from the store plus written
 * to the cache: 2 * (2 * L * N * H * D * 2 bytes). Items: injected tokens (also the `tokens`
 * counter). The issue's target, ">= 80% of copy bandwidth at m = 1024 on an H200", is printed as
 * `target_vs_copy=0.8` beside `vs_copy` in the device m = 1024 rows.
 *
 * inject/host/llama3.1-8b/bf16-fp8e4m3/m:<m>/calibrated:<0|1>: the same segment into an fp8 e4m3
 * cache with per-tensor scales (vLLM's divide convention; 1.0, or calibrated-looking values that
 * are not powers of two); bytes = bf16 K+V read + e4m3 K+V written;
 * copy ceiling of the same bytes; checked bit for bit against a brute-force recomputation.
 *
 * inject/host/vllm_cpu/<isa>/<model>/bf16/m:<m> (isa vec or amx; SmolLM2-135M: 30 layers, 3 KV
 * heads, head_dim 64; Llama-3.1-8B; m = 128 and 1,920): vLLM's CPU cache (make_vllm_cpu_cache, one
 * `(NB, H, 128, 2 D)` tensor per layer, 64-byte aligned as torch allocates), the segment at the
 * prompt's start (positions 0 .. m - 1, as the connector loads it), vLLM's CPU rotation (its bf16
 * cos/sin table, fp32 products truncated to bf16); against memcpy of the same bytes; checked
 * element by element against the layouts' formulas after the warm-up. The "before" of the line
 * path is the same binary with INFERSCALE_BENCH_HOST_SIMD=avx512.
 *
 * Names: inject/<backend>/<model>/bf16/m:<m>, inject_checked/device/<model>/bf16/m:<m>,
 * inject_batch/<backend>/llama3.1-8b/bf16/requests:<R>/facts:20 (R = 64 on the device, 8 on the
 * host to keep the host run short).
 */
#include "../common/fixture.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/detail/inject/tuning.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/inject.cuh>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>
#include <inferscale/tier.cuh>
#include <inferscale/tier.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace ib = inferscale::bench;
namespace is = inferscale;
using is::bfloat16_t;

constexpr std::int32_t block_size      = 16;  // vLLM's default
constexpr std::int32_t store_page_size = 16;
constexpr std::int64_t first_position  = 37;  // p0: after a 37-token system prompt
constexpr std::uint64_t seed           = 20261130;
constexpr int vector_elements          = 8;  // bf16 per 16-byte access
constexpr double issue_target_vs_copy  = 0.8;
constexpr std::int64_t issue_target_m  = 1024;
using policy                           = is::detail::inject_policy_sm90;

struct model {
  char const* name;
  is::kv_geometry geometry;
  is::rope_spec (*rope)();
};

model const llama{"llama3.1-8b", {32, 8, 128}, is::rope_presets::llama_3_1_8b};
model const qwen{"qwen2.5-7b", {28, 4, 128}, is::rope_presets::qwen2_5_7b};
model const smollm2{"smollm2-135m", {30, 3, 64}, is::rope_presets::smollm2_135m};

// ------------------------------------------------------------------------------------------------
// Data

__host__ __device__ inline std::uint64_t splitmix64(std::uint64_t x)
{
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// @brief Pseudo-random bf16 in [-1, 1) from an element index (same on host and device).
__host__ __device__ inline bfloat16_t random_value(std::uint64_t index)
{
  auto const r = static_cast<float>(splitmix64(index ^ (seed << 20)) >> 40);  // 24 bits
  return is::from_float<bfloat16_t>(r * 0x1p-23f - 1.0f);
}

__global__ void fill_kernel(bfloat16_t* data, std::int64_t count)
{
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    data[i] = random_value(static_cast<std::uint64_t>(i));
  }
}

/// @brief Fact lengths of one m-token segment: round(m / 20) facts cycling 17..23, summing to m.
std::vector<std::int32_t> segment_fact_lengths(std::int64_t m)
{
  std::int64_t const n = std::max<std::int64_t>(1, (m + 10) / 20);
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(n));
  std::int64_t sum = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    lengths[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(17 + i % 7);
    sum += lengths[static_cast<std::size_t>(i)];
  }
  for (std::int64_t i = 0; sum != m; i = (i + 1) % n) {
    std::int32_t const step = sum < m ? 1 : -1;
    lengths[static_cast<std::size_t>(i)] += step;
    sum += step;
  }
  return lengths;
}

/// @brief R requests of k facts each, lengths cycling 17..23 over the whole batch.
std::vector<std::vector<std::int32_t>> batch_fact_lengths(std::int64_t requests, std::int64_t k)
{
  std::vector<std::vector<std::int32_t>> out(static_cast<std::size_t>(requests));
  for (std::int64_t r = 0; r < requests; ++r) {
    for (std::int64_t i = 0; i < k; ++i) {
      out[static_cast<std::size_t>(r)].push_back(static_cast<std::int32_t>(17 + (r * k + i) % 7));
    }
  }
  return out;
}

/// @brief The store, plans and batch of one benchmark case (host or device store).
struct scenario {
  is::kv_store store;
  std::vector<is::composition> plans;
  is::injection_batch batch;
  std::int64_t num_blocks{};  // cache blocks
  is::rope_params rotation{};
  std::int64_t tokens{};

  std::int32_t block{block_size};   // tokens per cache block
  std::int64_t p0{first_position};  // the segment's first prompt position

  scenario(model const& mdl,
           std::vector<std::vector<std::int32_t>> const& requests,
           is::memory_space space,
           std::int32_t cache_block_size = block_size,
           std::int64_t segment_start    = first_position)
    : store{make_store(mdl, requests, space)},
      batch{store},
      rotation{is::make_rope_params(mdl.rope())},
      block{cache_block_size},
      p0{segment_start}
  {
    INFERSCALE_EXPECTS(rotation.pairing == is::rope_pairing::halves &&
                         rotation.rotary_dim == rotation.head_dim &&
                         (rotation.rotary_dim / 2) % vector_elements == 0,
                       "inject_bench: the two-pass baseline handles full-rotary halves pairing");
    // Fact ids: 1, 2, .. in request order (make_store's).
    std::uint64_t next_id = 1;
    std::vector<std::vector<std::uint64_t>> ids(requests.size());
    for (std::size_t r = 0; r < requests.size(); ++r) {
      for (std::size_t f = 0; f < requests[r].size(); ++f) {
        ids[r].push_back(next_id++);
      }
    }
    // Plans and block tables: blocks drawn from one shuffled permutation (disjoint slots).
    std::vector<std::int64_t> blocks_needed;
    std::int64_t total_blocks = 0;
    for (auto const& request_ids : ids) {
      is::compose_options options;
      options.first_position = p0;
      options.order          = is::fact_order::as_given;
      plans.push_back(is::compose(store, request_ids, options));
      blocks_needed.push_back((p0 + plans.back().length() + block - 1) / block);
      total_blocks += blocks_needed.back();
    }
    num_blocks = total_blocks + total_blocks / 2;
    std::vector<std::int32_t> permutation(static_cast<std::size_t>(num_blocks));
    std::iota(permutation.begin(), permutation.end(), 0);
    std::mt19937_64 rng{seed};
    std::shuffle(permutation.begin(), permutation.end(), rng);
    std::size_t taken = 0;
    for (std::size_t r = 0; r < plans.size(); ++r) {
      auto const n = static_cast<std::size_t>(blocks_needed[r]);
      std::vector<std::int32_t> const table(
        permutation.begin() + static_cast<std::ptrdiff_t>(taken),
        permutation.begin() + static_cast<std::ptrdiff_t>(taken + n));
      taken += n;
      batch.add(plans[r],
                is::slots_from_block_table(
                  table.data(), static_cast<std::int64_t>(n), block, p0, plans[r].length()));
    }
    tokens = batch.num_tokens();
  }

  /// @brief A store holding every request's facts (ids 1, 2, .. in request order), its pool filled
  /// with pseudo-random values.
  static is::kv_store make_store(model const& mdl,
                                 std::vector<std::vector<std::int32_t>> const& requests,
                                 is::memory_space space)
  {
    std::int64_t pages = 0;
    for (auto const& r : requests) {
      for (std::int32_t length : r) {
        pages += (length + store_page_size - 1) / store_page_size;
      }
    }
    is::kv_store_config config;
    config.model       = mdl.geometry;
    config.store_dtype = is::dtype::bfloat16;
    config.page_size   = store_page_size;
    config.num_pages   = pages;
    config.space       = space;
    is::kv_store store{config};
    std::uint64_t next_id = 1;
    for (std::size_t r = 0; r < requests.size(); ++r) {
      for (std::int32_t length : requests[r]) {
        std::vector<std::int32_t> token_ids(static_cast<std::size_t>(length));
        std::iota(token_ids.begin(), token_ids.end(), static_cast<std::int32_t>(next_id * 100));
        store.reserve(next_id++, r, std::move(token_ids));
      }
    }
    auto* const pool         = static_cast<bfloat16_t*>(store.ref().pool);
    std::int64_t const count = static_cast<std::int64_t>(store.pool_bytes() / sizeof(bfloat16_t));
    if (space == is::memory_space::host) {
      for (std::int64_t i = 0; i < count; ++i) {
        pool[i] = random_value(static_cast<std::uint64_t>(i));
      }
    } else {
      fill_kernel<<<1024, 256>>>(pool, count);
      INFERSCALE_CHECK_LAUNCH();
      INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
    }
    return store;
  }

  is::kv_geometry geometry() const { return store.geometry(); }

  /// @brief 2 * (K + V of the injected tokens): read from the store, written to the cache.
  ib::traffic traffic() const
  {
    return ib::traffic{2 * geometry().bytes(tokens, is::dtype::bfloat16), tokens};
  }

  /// @brief Elements of one cache tensor `(2, NB, 16, H, D)` (one layer).
  std::int64_t layer_elements() const
  {
    return 2 * num_blocks * block * geometry().elements_per_token_layer();
  }

  std::int64_t cache_elements() const { return geometry().num_layers * layer_elements(); }

  /// @brief Elements of the two-pass buffer `[L, 2, N, H, D]`.
  std::int64_t composed_elements() const { return geometry().elements_per_token() * tokens; }

  /// @brief The vLLM FlashAttention NHD descriptor of a cache at `base` (L tensors back to back).
  template <class CacheT = bfloat16_t>
  is::paged_kv_cache make_cache(CacheT* base) const
  {
    std::int64_t const h = geometry().num_kv_heads;
    std::int64_t const d = geometry().head_dim;
    std::vector<void*> layers;
    for (std::int32_t l = 0; l < geometry().num_layers; ++l) {
      layers.push_back(base + l * layer_elements());
    }
    std::array<std::int64_t, 5> const shape{2, num_blocks, block, h, d};
    std::array<std::int64_t, 5> const strides{
      num_blocks * block * h * d, block * h * d, h * d, d, 1};
    auto cache = is::make_vllm_flash_attn_cache(is::dtype_of_v<CacheT>, layers, shape, strides);
    for (auto const* layout : {&cache.key_layout, &cache.value_layout}) {
      INFERSCALE_EXPECTS(layout->dim_stride == 1 && layout->dim_chunk == layout->head_dim,
                         "inject_bench: the scatter pass copies contiguous head rows");
    }
    return cache;
  }
};

void report_two_pass(benchmark::State& state,
                     ib::traffic t,
                     double fused_seconds,
                     double two_pass_seconds)
{
  if (state.error_occurred() || fused_seconds <= 0.0 || two_pass_seconds <= 0.0) { return; }
  double const bytes = static_cast<double>(t.bytes) * static_cast<double>(state.iterations());
  state.counters["two_pass_GB/s"] = benchmark::Counter(bytes / two_pass_seconds / 1e9);
  state.counters["vs_two_pass"]   = benchmark::Counter(two_pass_seconds / fused_seconds);
}

void report_common(benchmark::State& state, scenario const& s, bool device)
{
  if (state.error_occurred()) { return; }
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(s.tokens));
  if (device && s.plans.size() == 1 && s.tokens == issue_target_m) {
    state.counters["target_vs_copy"] = benchmark::Counter(issue_target_vs_copy);
  }
}

// ------------------------------------------------------------------------------------------------
// Two-pass baseline, host: (a) compose with rotation into [L, 2, N, H, D], (b) scatter by slot.

void compose_host(is::kv_store_ref const& store,
                  is::injection_batch_view const& batch,
                  is::rope_params const& rotation,
                  bfloat16_t* out)
{
  std::int32_t const pairs = rotation.num_pairs();
  std::int32_t const dim   = store.head_dim;
  std::int64_t const row   = store.row_elements();
  std::int64_t const n     = batch.num_tokens;
  auto const* const pool   = static_cast<bfloat16_t const*>(store.pool);
  std::vector<is::rope_cos_sin> cos_sin(static_cast<std::size_t>(pairs));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int32_t p = 0; p < pairs; ++p) {  // once per token, shared by layers and heads
      cos_sin[static_cast<std::size_t>(p)] =
        is::rope_angle_cos_sin(rotation, batch.position[i], p, is::rope_op::forward);
    }
    for (std::int32_t l = 0; l < store.num_layers; ++l) {
      bfloat16_t const* const krow = pool + store.row_offset(batch.store_token[i], l, 0);
      bfloat16_t const* const vrow = pool + store.row_offset(batch.store_token[i], l, 1);
      bfloat16_t* const kout       = out + ((2 * std::int64_t{l}) * n + i) * row;
      bfloat16_t* const vout       = out + ((2 * std::int64_t{l} + 1) * n + i) * row;
      for (std::int32_t h = 0; h < store.num_heads; ++h) {
        bfloat16_t const* const k = krow + std::int64_t{h} * dim;
        bfloat16_t* const o       = kout + std::int64_t{h} * dim;
        for (std::int32_t p = 0; p < pairs; ++p) {
          float x, y;
          is::detail::rotate_stored_pair(
            k[p], k[p + pairs], cos_sin[static_cast<std::size_t>(p)], false, &x, &y);
          o[p]         = is::from_float<bfloat16_t>(x);
          o[p + pairs] = is::from_float<bfloat16_t>(y);
        }
      }
      std::memcpy(vout, vrow, static_cast<std::size_t>(row) * sizeof(bfloat16_t));
    }
  }
}

void scatter_host(bfloat16_t const* in,
                  is::injection_batch_view const& batch,
                  is::paged_kv_cache const& cache)
{
  std::int32_t const heads = cache.num_heads();
  std::int32_t const dim   = cache.head_dim();
  std::int64_t const row   = std::int64_t{heads} * dim;
  std::int64_t const n     = batch.num_tokens;
  for (std::int32_t l = 0; l < cache.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      auto* const base =
        static_cast<bfloat16_t*>(kv == 0 ? cache.key_base[l] : cache.value_base[l]);
      is::paged_kv_layout const& layout = kv == 0 ? cache.key_layout : cache.value_layout;
      for (std::int64_t i = 0; i < n; ++i) {
        std::int64_t const slot = batch.slot[i];
        if (slot < 0) { continue; }
        bfloat16_t const* const src = in + ((2 * std::int64_t{l} + kv) * n + i) * row;
        for (std::int32_t h = 0; h < heads; ++h) {
          std::memcpy(base + layout.slot_offset(slot, h, 0),
                      src + std::int64_t{h} * dim,
                      static_cast<std::size_t>(dim) * sizeof(bfloat16_t));
        }
      }
    }
  }
}

/// @brief Elements of the cache at the batch's slots that differ from the composed buffer.
std::int64_t mismatches_host(bfloat16_t const* composed,
                             is::injection_batch_view const& batch,
                             is::paged_kv_cache const& cache)
{
  std::int32_t const heads = cache.num_heads();
  std::int32_t const dim   = cache.head_dim();
  std::int64_t const row   = std::int64_t{heads} * dim;
  std::int64_t const n     = batch.num_tokens;
  std::int64_t bad         = 0;
  for (std::int32_t l = 0; l < cache.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      auto const* const base =
        static_cast<bfloat16_t const*>(kv == 0 ? cache.key_base[l] : cache.value_base[l]);
      is::paged_kv_layout const& layout = kv == 0 ? cache.key_layout : cache.value_layout;
      for (std::int64_t i = 0; i < n; ++i) {
        if (batch.slot[i] < 0) { continue; }
        bfloat16_t const* const src = composed + ((2 * std::int64_t{l} + kv) * n + i) * row;
        for (std::int32_t h = 0; h < heads; ++h) {
          for (std::int32_t d = 0; d < dim; ++d) {
            bad += base[layout.slot_offset(batch.slot[i], h, d)].bits !=
                   src[std::int64_t{h} * dim + d].bits;
          }
        }
      }
    }
  }
  return bad;
}

// ------------------------------------------------------------------------------------------------
// Two-pass baseline, device.

struct alignas(16) bf16x8 {
  bfloat16_t v[vector_elements];
};

struct compose_args {
  is::kv_store_ref store;
  is::injection_batch_view batch;  // device arrays (the workspace's)
  is::rope_params rotation;
  bfloat16_t* out;  // [L, 2, N, H, D]
  std::int32_t tile_layers;
};

/// @brief Pass (a): block (x, y) = tile_tokens tokens x tile_layers layers, as inject_kernel; its
/// cos/sin computed once per token and pair into shared memory; a unit = 8 rotary pairs of a key
/// (two 16-byte loads and stores) or 8 value elements (one).
__global__ void __launch_bounds__(policy::block_threads)
  compose_kernel(__grid_constant__ compose_args const args)
{
  extern __shared__ is::rope_cos_sin shared_cos_sin[];
  __shared__ std::int64_t tile_source[policy::tile_tokens];
  std::int32_t const pairs = args.rotation.num_pairs();
  std::int32_t const dim   = args.store.head_dim;
  std::int32_t const heads = args.store.num_heads;
  std::int64_t const n     = args.batch.num_tokens;
  std::int64_t const row   = args.store.row_elements();
  std::int64_t const first = static_cast<std::int64_t>(blockIdx.x) * policy::tile_tokens;
  auto const tokens =
    static_cast<std::int32_t>(n - first < policy::tile_tokens ? n - first : policy::tile_tokens);
  std::int32_t const first_layer = static_cast<std::int32_t>(blockIdx.y) * args.tile_layers;
  std::int32_t const layers      = args.store.num_layers - first_layer < args.tile_layers
                                     ? args.store.num_layers - first_layer
                                     : args.tile_layers;
  for (std::int32_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    tile_source[t] = args.batch.store_token[first + t];
  }
  for (std::int32_t i = threadIdx.x; i < tokens * pairs; i += blockDim.x) {
    std::int32_t const t = i / pairs;
    shared_cos_sin[i]    = is::rope_angle_cos_sin(
      args.rotation, args.batch.position[first + t], i - t * pairs, is::rope_op::forward);
  }
  __syncthreads();

  std::int32_t const key_units      = pairs / vector_elements;
  std::int32_t const units_per_head = key_units + dim / vector_elements;
  std::int32_t const units_per_row  = heads * units_per_head;
  std::int32_t const total          = tokens * layers * units_per_row;
  auto const* const pool            = static_cast<bfloat16_t const*>(args.store.pool);
  for (std::int32_t w = threadIdx.x; w < total; w += blockDim.x) {
    std::int32_t const r    = w / units_per_row;
    std::int32_t const unit = w - r * units_per_row;
    std::int32_t const t    = r % tokens;
    std::int32_t const l    = first_layer + r / tokens;
    std::int32_t const h    = unit / units_per_head;
    std::int32_t const u    = unit - h * units_per_head;
    std::int64_t const i    = first + t;
    if (u < key_units) {
      std::int32_t const p0 = u * vector_elements;
      bfloat16_t const* src =
        pool + args.store.row_offset(tile_source[t], l, 0) + std::int64_t{h} * dim + p0;
      bf16x8 const x = *reinterpret_cast<bf16x8 const*>(src);
      bf16x8 const y = *reinterpret_cast<bf16x8 const*>(src + pairs);
      bf16x8 ox, oy;
#pragma unroll
      for (int e = 0; e < vector_elements; ++e) {
        float rx, ry;
        is::detail::rotate_stored_pair(
          x.v[e], y.v[e], shared_cos_sin[t * pairs + p0 + e], false, &rx, &ry);
        ox.v[e] = is::from_float<bfloat16_t>(rx);
        oy.v[e] = is::from_float<bfloat16_t>(ry);
      }
      bfloat16_t* const dst =
        args.out + ((2 * std::int64_t{l}) * n + i) * row + std::int64_t{h} * dim + p0;
      *reinterpret_cast<bf16x8*>(dst)         = ox;
      *reinterpret_cast<bf16x8*>(dst + pairs) = oy;
    } else {
      std::int32_t const d0 = (u - key_units) * vector_elements;
      bfloat16_t const* src =
        pool + args.store.row_offset(tile_source[t], l, 1) + std::int64_t{h} * dim + d0;
      bfloat16_t* const dst =
        args.out + ((2 * std::int64_t{l} + 1) * n + i) * row + std::int64_t{h} * dim + d0;
      *reinterpret_cast<bf16x8*>(dst) = *reinterpret_cast<bf16x8 const*>(src);
    }
  }
}

struct scatter_args {
  bfloat16_t const* in;  // [L, 2, N, H, D]
  is::paged_kv_cache cache;
  std::int64_t const* slot;  // device
  std::int64_t num_tokens;
  std::int32_t tile_layers;
  unsigned long long* mismatches;  // null: scatter; else compare the cache with `in`
};

/// @brief Pass (b): block (x, y) = tile_tokens tokens x tile_layers layers, each token's slot
/// divided by the block size once (shared memory); one 16-byte vector per work item, to its slot
/// (or, with `mismatches`, compared with what the cache holds there).
__global__ void __launch_bounds__(policy::block_threads)
  scatter_kernel(__grid_constant__ scatter_args const args)
{
  // Offsets of (slot, head 0, dim 0) in each layer's K and V; tile_key -1: skip the token.
  __shared__ std::int64_t tile_key[policy::tile_tokens];
  __shared__ std::int64_t tile_value[policy::tile_tokens];
  is::paged_kv_layout const& kl = args.cache.key_layout;
  is::paged_kv_layout const& vl = args.cache.value_layout;
  std::int64_t const n          = args.num_tokens;
  std::int64_t const first      = static_cast<std::int64_t>(blockIdx.x) * policy::tile_tokens;
  auto const tokens =
    static_cast<std::int32_t>(n - first < policy::tile_tokens ? n - first : policy::tile_tokens);
  std::int32_t const first_layer = static_cast<std::int32_t>(blockIdx.y) * args.tile_layers;
  std::int32_t const layers      = args.cache.num_layers - first_layer < args.tile_layers
                                     ? args.cache.num_layers - first_layer
                                     : args.tile_layers;
  for (std::int32_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    std::int64_t const slot  = args.slot[first + t];
    bool const ok            = is::detail::slot_in_cache(slot, args.cache.num_slots());
    std::int64_t const block = ok ? slot / kl.block_size : 0;
    auto const in_block      = static_cast<std::int32_t>(ok ? slot % kl.block_size : 0);
    tile_key[t]              = ok ? kl.offset(block, in_block, 0, 0) : -1;
    tile_value[t]            = vl.offset(block, in_block, 0, 0);
  }
  __syncthreads();

  std::int32_t const dim              = kl.head_dim;
  std::int32_t const vectors_per_head = dim / vector_elements;
  std::int32_t const row_vectors      = kl.num_heads * vectors_per_head;
  std::int64_t const row              = std::int64_t{kl.num_heads} * dim;
  std::int32_t const units_per_row    = 2 * row_vectors;  // K, then V
  std::int32_t const total            = tokens * layers * units_per_row;
  for (std::int32_t w = threadIdx.x; w < total; w += blockDim.x) {
    std::int32_t const r    = w / units_per_row;
    std::int32_t const unit = w - r * units_per_row;
    std::int32_t const t    = r % tokens;
    std::int32_t const l    = first_layer + r / tokens;
    if (tile_key[t] < 0) { continue; }
    std::int32_t const kv = unit >= row_vectors ? 1 : 0;
    std::int32_t const v  = unit - kv * row_vectors;
    std::int32_t const h  = v / vectors_per_head;
    std::int32_t const d  = (v - h * vectors_per_head) * vector_elements;
    // Dims contiguous (make_cache checks it): (h, d) lies h * head_stride + d past the slot.
    auto* const base =
      static_cast<bfloat16_t*>(kv == 0 ? args.cache.key_base[l] : args.cache.value_base[l]);
    auto* const dst = reinterpret_cast<bf16x8*>(
      base + (kv == 0 ? tile_key[t] + h * kl.head_stride : tile_value[t] + h * vl.head_stride) + d);
    bf16x8 const x = *reinterpret_cast<bf16x8 const*>(
      args.in + ((2 * std::int64_t{l} + kv) * n + first + t) * row + std::int64_t{h} * dim + d);
    if (args.mismatches == nullptr) {
      *dst = x;
      continue;
    }
    bf16x8 const y         = *dst;
    unsigned long long bad = 0;
#pragma unroll
    for (int k = 0; k < vector_elements; ++k) {
      bad += x.v[k].bits != y.v[k].bits;
    }
    if (bad != 0) { atomicAdd(args.mismatches, bad); }
  }
}

/// @brief The two-pass baseline's launches (buffers and launch shapes prepared once).
struct device_two_pass {
  compose_args compose{};
  dim3 grid{};
  std::size_t compose_shared{};
  scatter_args scatter{};

  device_two_pass(scenario const& s,
                  is::injection_batch_view device_batch,
                  bfloat16_t* composed,
                  is::paged_kv_cache const& cache)
  {
    int device = 0, sm_count = 0;
    INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
    INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    std::int32_t const layers = s.geometry().num_layers;
    std::int64_t const tiles  = (s.tokens + policy::tile_tokens - 1) / policy::tile_tokens;
    // The fused kernel's rule: fewer layers per block until the grid has min_blocks_per_sm.
    std::int32_t tile_layers = std::min(policy::max_tile_layers, layers);
    while (tile_layers > 1 && tiles * ((layers + tile_layers - 1) / tile_layers) <
                                std::int64_t{sm_count} * policy::min_blocks_per_sm) {
      tile_layers /= 2;
    }
    compose.store       = s.store.ref();
    compose.batch       = device_batch;
    compose.rotation    = s.rotation;
    compose.out         = composed;
    compose.tile_layers = tile_layers;
    grid                = dim3{static_cast<unsigned>(tiles),
                static_cast<unsigned>((layers + tile_layers - 1) / tile_layers)};
    compose_shared      = static_cast<std::size_t>(policy::tile_tokens) *
                     static_cast<std::size_t>(s.rotation.num_pairs()) * sizeof(is::rope_cos_sin);
    scatter.in          = composed;
    scatter.cache       = cache;
    scatter.slot        = device_batch.slot;
    scatter.num_tokens  = s.tokens;
    scatter.tile_layers = tile_layers;
  }

  void compose_pass(cudaStream_t stream) const
  {
    compose_kernel<<<grid, policy::block_threads, compose_shared, stream>>>(compose);
    INFERSCALE_CHECK_LAUNCH();
  }

  void scatter_pass(cudaStream_t stream) const
  {
    scatter_kernel<<<grid, policy::block_threads, 0, stream>>>(scatter);
    INFERSCALE_CHECK_LAUNCH();
  }

  void operator()(cudaStream_t stream) const
  {
    compose_pass(stream);
    scatter_pass(stream);
  }

  /// @brief Elements of `cache` at the batch's slots that differ from the composed buffer.
  std::uint64_t mismatches(is::paged_kv_cache const& cache) const
  {
    ib::device_buffer<unsigned long long> count(1);
    INFERSCALE_CUDA_TRY(cudaMemset(count.data(), 0, sizeof(unsigned long long)));
    scatter_args args = scatter;
    args.cache        = cache;
    args.mismatches   = count.data();
    scatter_kernel<<<grid, policy::block_threads>>>(args);
    INFERSCALE_CHECK_LAUNCH();
    unsigned long long host = 0;
    INFERSCALE_CUDA_TRY(cudaMemcpy(&host, count.data(), sizeof(host), cudaMemcpyDeviceToHost));
    return host;
  }
};

// ------------------------------------------------------------------------------------------------
// Benchmarks

std::vector<std::vector<std::int32_t>> requests_of(benchmark::State const& state, bool batch)
{
  if (batch) { return batch_fact_lengths(state.range(0), state.range(1)); }
  return {segment_fact_lengths(state.range(0))};
}

/**
 * @brief Each iteration times `fused` (the benchmark's time), then `other` (a baseline of the same
 * work) and `copy` of the same bytes (the ceiling), in the same iterations: their total seconds.
 */
template <class Fused, class Other, class Copy>
std::array<double, 3> timed_against_other_and_copy(benchmark::State& state,
                                                   Fused&& fused,
                                                   Other&& other,
                                                   Copy&& copy)
{
  using clock = std::chrono::steady_clock;
  std::array<double, 3> total{};
  for (auto _ : state) {
    auto const f0 = clock::now();
    fused();
    benchmark::ClobberMemory();
    auto const f1 = clock::now();
    other();
    benchmark::ClobberMemory();
    auto const p1 = clock::now();
    copy();
    auto const c1  = clock::now();
    double const f = std::chrono::duration<double>(f1 - f0).count();
    state.SetIterationTime(f);
    total[0] += f;
    total[1] += std::chrono::duration<double>(p1 - f1).count();
    total[2] += std::chrono::duration<double>(c1 - p1).count();
  }
  return total;
}

void inject_host_bench(benchmark::State& state, model mdl, bool batch)
{
  ib::run_guarded(state, [&] {
    scenario s{mdl, requests_of(state, batch), is::memory_space::host};
    std::vector<bfloat16_t> fused_cache(static_cast<std::size_t>(s.cache_elements()));
    std::vector<bfloat16_t> two_pass_cache(static_cast<std::size_t>(s.cache_elements()));
    std::vector<bfloat16_t> composed(static_cast<std::size_t>(s.composed_elements()));
    auto const fused_desc        = s.make_cache(fused_cache.data());
    auto const two_pass_desc     = s.make_cache(two_pass_cache.data());
    auto const view              = s.batch.host_view();
    ib::traffic const t          = s.traffic();
    std::size_t const copy_bytes = static_cast<std::size_t>(t.bytes / 2);
    std::vector<std::byte> copy_destination(copy_bytes);
    void const* const copy_source = s.store.ref().pool;  // pool_bytes >= copy_bytes

    auto const fused    = [&] { s.batch.run(fused_desc, s.rotation); };
    auto const two_pass = [&] {
      compose_host(s.store.ref(), view, s.rotation, composed.data());
      scatter_host(composed.data(), view, two_pass_desc);
    };
    auto const copy = [&] {
      std::memcpy(copy_destination.data(), copy_source, copy_bytes);
      benchmark::DoNotOptimize(copy_destination.data());
      benchmark::ClobberMemory();
    };

    fused();
    two_pass();
    copy();
    std::int64_t const bad = mismatches_host(composed.data(), view, fused_desc) +
                             mismatches_host(composed.data(), view, two_pass_desc);
    INFERSCALE_EXPECTS(
      bad == 0,
      "inject_bench: fused and two-pass results differ in " + std::to_string(bad) + " elements");

    auto const [seconds, two_pass_seconds, copy_seconds] =
      timed_against_other_and_copy(state, fused, two_pass, copy);
    ib::report_throughput(state, t, seconds, copy_seconds);
    report_two_pass(state, t, seconds, two_pass_seconds);
    report_common(state, s, false);
  });
}

/// @brief Each iteration times `fused` (the benchmark's time) and then `copy` of the same bytes
/// (the ceiling, measured in the same iterations): their total seconds.
template <class Fused, class Copy>
std::pair<double, double> timed_against_copy(benchmark::State& state, Fused&& fused, Copy&& copy)
{
  using clock    = std::chrono::steady_clock;
  double seconds = 0.0, copy_seconds = 0.0;
  for (auto _ : state) {
    auto const f0 = clock::now();
    fused();
    benchmark::ClobberMemory();
    auto const f1 = clock::now();
    copy();
    auto const c1  = clock::now();
    double const f = std::chrono::duration<double>(f1 - f0).count();
    state.SetIterationTime(f);
    seconds += f;
    copy_seconds += std::chrono::duration<double>(c1 - f1).count();
  }
  return {seconds, copy_seconds};
}

/**
 * @brief Elements of an fp8 e4m3 cache with per-tensor scales (vLLM's divide convention) at the
 * batch's slots that differ from a brute-force recomputation: key pairs rotated in fp32
 * (rope_angle_cos_sin, detail::rotate_fp32), every element divided by its scale and rounded to
 * e4m3 (from_float: nearest even, saturating).
 */
std::int64_t mismatches_fp8_host(is::kv_store_ref const& store,
                                 is::injection_batch_view const& batch,
                                 is::paged_kv_cache const& cache,
                                 is::rope_params const& rotation,
                                 float key_scale,
                                 float value_scale)
{
  using is::float8_e4m3_t;
  std::int32_t const pairs = rotation.num_pairs();
  std::int32_t const dim   = store.head_dim;
  auto const* const pool   = static_cast<bfloat16_t const*>(store.pool);
  std::int64_t bad         = 0;
  for (std::int64_t i = 0; i < batch.num_tokens; ++i) {
    std::int64_t const slot = batch.slot[i];
    if (slot < 0) { continue; }
    for (std::int32_t l = 0; l < store.num_layers; ++l) {
      auto const* const kbase = static_cast<float8_e4m3_t const*>(cache.key_base[l]);
      auto const* const vbase = static_cast<float8_e4m3_t const*>(cache.value_base[l]);
      for (std::int32_t h = 0; h < store.num_heads; ++h) {
        bfloat16_t const* const k = pool + store.row_offset(batch.store_token[i], l, 0) + h * dim;
        bfloat16_t const* const v = pool + store.row_offset(batch.store_token[i], l, 1) + h * dim;
        for (std::int32_t p = 0; p < pairs; ++p) {
          float x, y;
          is::detail::rotate_fp32(
            is::to_float(k[p]),
            is::to_float(k[p + pairs]),
            is::rope_angle_cos_sin(rotation, batch.position[i], p, is::rope_op::forward),
            &x,
            &y);
          bad += kbase[cache.key_layout.slot_offset(slot, h, p)].bits !=
                 is::from_float<float8_e4m3_t>(x / key_scale).bits;
          bad += kbase[cache.key_layout.slot_offset(slot, h, p + pairs)].bits !=
                 is::from_float<float8_e4m3_t>(y / key_scale).bits;
        }
        for (std::int32_t d = 0; d < dim; ++d) {
          bad += vbase[cache.value_layout.slot_offset(slot, h, d)].bits !=
                 is::from_float<float8_e4m3_t>(is::to_float(v[d]) / value_scale).bits;
        }
      }
    }
  }
  return bad;
}

/**
 * @brief The host run of a bf16 store into an fp8 e4m3 cache with per-tensor scales (vLLM's
 * `kv_cache_dtype="fp8"`, divide convention): `calibrated:0` vLLM's default scales (1.0, 1.0),
 * `calibrated:1` calibrated-looking ones (k 0.0537, v 0.0213), against memcpy of the same bytes
 * (bf16 K+V read, e4m3 K+V written) in the same iterations; checked bit for bit against a
 * brute-force recomputation after the warm-up.
 */
void inject_host_fp8_bench(benchmark::State& state, model mdl)
{
  ib::run_guarded(state, [&] {
    scenario s{mdl, requests_of(state, false), is::memory_space::host};
    std::vector<is::float8_e4m3_t> cache_data(static_cast<std::size_t>(s.cache_elements()));
    auto desc               = s.make_cache(cache_data.data());
    bool const calibrated   = state.range(1) != 0;
    float const key_scale   = calibrated ? 0.0537f : 1.0f;
    float const value_scale = calibrated ? 0.0213f : 1.0f;
    auto const layers       = static_cast<std::size_t>(s.geometry().num_layers);
    std::vector<float const*> const key_scales(layers, &key_scale);
    std::vector<float const*> const value_scales(layers, &value_scale);
    desc.set_fp8_scales(is::kv_scale_convention::divide,
                        is::kv_scale_granularity::per_tensor,
                        key_scales,
                        value_scales);
    ib::traffic const t{s.geometry().bytes(s.tokens, is::dtype::bfloat16) +
                          s.geometry().bytes(s.tokens, is::dtype::float8_e4m3),
                        s.tokens};
    std::size_t const copy_bytes = static_cast<std::size_t>(t.bytes / 2);
    std::vector<std::byte> copy_destination(copy_bytes);
    void const* const copy_source = s.store.ref().pool;  // pool_bytes >= copy_bytes

    auto const fused = [&] { s.batch.run(desc, s.rotation); };
    auto const copy  = [&] {
      std::memcpy(copy_destination.data(), copy_source, copy_bytes);
      benchmark::DoNotOptimize(copy_destination.data());
      benchmark::ClobberMemory();
    };
    fused();
    copy();
    std::int64_t const bad = mismatches_fp8_host(
      s.store.ref(), s.batch.host_view(), desc, s.rotation, key_scale, value_scale);
    INFERSCALE_EXPECTS(bad == 0,
                       "inject_bench: the fp8 cache differs from the recomputation in " +
                         std::to_string(bad) + " elements");

    auto const [seconds, copy_seconds] = timed_against_copy(state, fused, copy);
    ib::report_throughput(state, t, seconds, copy_seconds);
    report_common(state, s, false);
  });
}

// ------------------------------------------------------------------------------------------------
// Compressed facts (compression.hpp): the same tokens injected from a bf16 store and from its fp8 /
// int4 copy, in the same iterations.

/**
 * @brief The host run from a compressed copy of the scenario's bf16 store (`compression` 1: fp8
 * e4m3, 2: int4; each fact's bf16 rows inserted, kv_store::insert quantizing them) into a bf16
 * cache, against the bf16 store's run of the same plans and slots in the same iterations
 * (`bf16_GB/s`, `vs_bf16`: GB/s of cache written, the figure issue 52 compares) and memcpy of the
 * cache's bytes (`copy_GB/s`). `store_bytes_ratio`: bytes of a bf16 page over a compressed page
 * (both pools hold whole pages). Checked before timing: every element the compressed run writes
 * lies within amax / 8 of the bf16 run's (a coarse bound on the quantization error; the exact
 * equivalence with an uncompressed store of the dequantized values is tests/inject's).
 */
void inject_host_compressed_bench(benchmark::State& state, model mdl)
{
  ib::run_guarded(state, [&] {
    scenario s{mdl, requests_of(state, false), is::memory_space::host};
    auto const compression  = static_cast<is::kv_compression>(state.range(1));
    is::kv_store_config cfg = s.store.config();
    cfg.compression         = compression;
    is::kv_store compressed{cfg};
    is::kv_geometry const g = s.geometry();
    std::int64_t const row  = g.elements_per_token_layer();
    auto const* const pool  = static_cast<bfloat16_t const*>(s.store.ref().pool);
    for (std::uint64_t id = 1; s.store.contains(id); ++id) {  // make_store's ids 1, 2, ..
      is::fact_record const& f = s.store.at(id);
      std::int64_t const c     = f.length();
      std::vector<float> k(static_cast<std::size_t>(g.num_layers * c * row)), v(k.size());
      for (std::int32_t l = 0; l < g.num_layers; ++l) {
        for (std::int64_t j = 0; j < c; ++j) {
          std::int64_t const t = s.store.store_token(f, static_cast<std::int32_t>(j));
          for (std::int64_t e = 0; e < row; ++e) {
            std::size_t const at = static_cast<std::size_t>((l * c + j) * row + e);
            k[at]                = is::to_float(pool[s.store.ref().row_offset(t, l, 0) + e]);
            v[at]                = is::to_float(pool[s.store.ref().row_offset(t, l, 1) + e]);
          }
        }
      }
      compressed.insert<float>(
        id,
        f.namespace_id,
        f.token_ids,
        is::make_fact_kv_view<float const>(k.data(), g.num_layers, c, g.num_kv_heads, g.head_dim),
        is::make_fact_kv_view<float const>(v.data(), g.num_layers, c, g.num_kv_heads, g.head_dim));
    }
    // The same plans and slots as the scenario's batch.
    is::injection_batch cbatch{compressed};
    auto const view    = s.batch.host_view();
    auto const offsets = s.batch.request_offsets();
    for (std::size_t r = 0; r < s.plans.size(); ++r) {
      std::vector<std::uint64_t> ids;
      for (is::composed_segment const& seg : s.plans[r].segments) {
        ids.push_back(seg.fact_id);
      }
      is::compose_options options;
      options.first_position = s.p0;
      options.order          = is::fact_order::as_given;
      cbatch.add(is::compose(compressed, ids, options),
                 std::vector<std::int64_t>(view.slot + offsets[r], view.slot + offsets[r + 1]));
    }
    std::vector<bfloat16_t> plain_cache(static_cast<std::size_t>(s.cache_elements()));
    std::vector<bfloat16_t> compressed_cache(plain_cache.size());
    auto const plain_desc      = s.make_cache(plain_cache.data());
    auto const compressed_desc = s.make_cache(compressed_cache.data());
    std::size_t const cache_bytes =
      static_cast<std::size_t>(g.bytes(s.tokens, is::dtype::bfloat16));  // written by one run
    std::vector<std::byte> copy_source(cache_bytes), copy_destination(cache_bytes);

    auto const plain = [&] { s.batch.run(plain_desc, s.rotation); };
    auto const fused = [&] { cbatch.run(compressed_desc, s.rotation); };
    auto const copy  = [&] {
      std::memcpy(copy_destination.data(), copy_source.data(), cache_bytes);
      benchmark::DoNotOptimize(copy_destination.data());
      benchmark::ClobberMemory();
    };
    plain();
    fused();
    // The quantization error bound: every written element within 1/8 of the largest magnitude
    // of the bf16 cache (int4: half a step of amax / 7 per group, rotated; e4m3: 2^-4 relative).
    float amax = 0.0f, worst = 0.0f;
    for (std::size_t i = 0; i < plain_cache.size(); ++i) {
      amax  = std::max(amax, std::fabs(is::to_float(plain_cache[i])));
      worst = std::max(worst,
                       std::fabs(is::to_float(plain_cache[i]) - is::to_float(compressed_cache[i])));
    }
    INFERSCALE_EXPECTS(worst <= amax / 8,
                       "inject_bench: the compressed run differs from the bf16 run by " +
                         std::to_string(worst) + " (largest magnitude " + std::to_string(amax) +
                         ")");

    auto const [seconds, plain_seconds, copy_seconds] =
      timed_against_other_and_copy(state, fused, plain, copy);
    auto const n = static_cast<double>(state.iterations());
    if (seconds > 0 && plain_seconds > 0 && copy_seconds > 0) {
      double const written        = static_cast<double>(cache_bytes) * n;
      state.counters["GB/s"]      = benchmark::Counter(written / seconds / 1e9);
      state.counters["bf16_GB/s"] = benchmark::Counter(written / plain_seconds / 1e9);
      state.counters["vs_bf16"]   = benchmark::Counter(plain_seconds / seconds);
      state.counters["copy_GB/s"] = benchmark::Counter(written / copy_seconds / 1e9);
      state.counters["vs_copy"]   = benchmark::Counter(copy_seconds / seconds);
      // Both pools hold whole pages: the bytes per page are the bytes per fact's page.
      state.counters["store_bytes_ratio"] = benchmark::Counter(
        static_cast<double>(s.store.page_bytes()) / static_cast<double>(compressed.page_bytes()));
    }
    state.SetLabel(std::string{is::to_string(compression)} + ", page " +
                   std::to_string(cfg.page_size) + " tokens");
  });
}

// ------------------------------------------------------------------------------------------------
// vLLM's CPU cache (make_vllm_cpu_cache): the layouts its `vec` and `amx` kernels read.

constexpr std::int32_t vllm_cpu_block_size = 128;  // the block size of vLLM's CPU backend

/// @brief A zeroed host buffer aligned to 64 bytes, as torch's CPU allocator aligns a tensor.
template <class T>
struct aligned_host_buffer {
  T* data{};
  explicit aligned_host_buffer(std::size_t count)
  {
    std::size_t const bytes = (count * sizeof(T) + 63) / 64 * 64;
    data                    = static_cast<T*>(std::aligned_alloc(64, bytes));
    INFERSCALE_EXPECTS(data != nullptr, "inject_bench: out of host memory");
    std::memset(static_cast<void*>(data), 0, bytes);
  }
  aligned_host_buffer(aligned_host_buffer const&)            = delete;
  aligned_host_buffer& operator=(aligned_host_buffer const&) = delete;
  ~aligned_host_buffer() { std::free(data); }
};

/// @brief Elements of one layer's vLLM CPU tensor `(NB, H, B, 2 D)`.
std::int64_t vllm_cpu_layer_elements(scenario const& s)
{
  return s.num_blocks * s.geometry().num_kv_heads * s.block * 2 * s.geometry().head_dim;
}

/// @brief The descriptor of L contiguous vLLM CPU tensors back to back from `base`.
is::paged_kv_cache make_vllm_cpu_desc(scenario const& s, bfloat16_t* base, is::vllm_cpu_isa isa)
{
  std::int64_t const h = s.geometry().num_kv_heads, d = s.geometry().head_dim;
  std::vector<void*> layers;
  for (std::int32_t l = 0; l < s.geometry().num_layers; ++l) {
    layers.push_back(base + l * vllm_cpu_layer_elements(s));
  }
  std::array<std::int64_t, 4> const shape{s.num_blocks, h, s.block, 2 * d};
  std::array<std::int64_t, 4> const strides{h * s.block * 2 * d, s.block * 2 * d, 2 * d, 1};
  return is::make_vllm_cpu_cache(is::dtype::bfloat16, layers, shape, strides, isa);
}

/**
 * @brief Elements of a vLLM CPU cache at the batch's slots that differ from a brute-force
 * recomputation through the layouts' formulas written out (make_vllm_cpu_cache's comment): keys
 * `x c - y s`, `y c + x s` in fp32 from the bf16 table (each product and the sum rounded once),
 * truncated to bf16 (the upper 16 bits); values copied.
 */
std::int64_t mismatches_vllm_cpu(scenario const& s,
                                 bfloat16_t const* base,
                                 is::vllm_cpu_isa isa,
                                 std::vector<bfloat16_t> const& table)
{
  is::kv_store_ref const store = s.store.ref();
  auto const view              = s.batch.host_view();
  std::int64_t const B = s.block, H = store.num_heads, D = store.head_dim, half = D / 2;
  auto const* const pool = static_cast<bfloat16_t const*>(store.pool);
  auto const bits        = [](bfloat16_t v) {
    std::uint16_t b;
    std::memcpy(&b, &v, sizeof b);
    return b;
  };
  auto const upper = [](float f) {
    std::uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return static_cast<std::uint16_t>(b >> 16);
  };
  bool const amx    = isa == is::vllm_cpu_isa::amx;
  auto const key_at = [&](std::int64_t t, std::int64_t d) {
    return amx ? (t / 16) * 16 * D + (d / 2) * 32 + (t % 16) * 2 + d % 2 : d * B + t;
  };
  auto const value_at = [&](std::int64_t t, std::int64_t d) {
    return B * D + (amx ? (d / 16) * 16 * B + (t / 2) * 32 + (d % 16) * 2 + t % 2 : t * D + d);
  };
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < view.num_tokens; ++i) {
    std::int64_t const slot = view.slot[i];
    if (slot < 0) { continue; }
    std::int64_t const b = slot / B, t = slot % B, p = view.position[i];
    for (std::int32_t l = 0; l < store.num_layers; ++l) {
      for (std::int64_t h = 0; h < H; ++h) {
        bfloat16_t const* const cell =
          base + l * vllm_cpu_layer_elements(s) + (b * H + h) * 2 * B * D;
        bfloat16_t const* const k = pool + store.row_offset(view.store_token[i], l, 0) + h * D;
        bfloat16_t const* const v = pool + store.row_offset(view.store_token[i], l, 1) + h * D;
        for (std::int64_t j = 0; j < half; ++j) {
          float const volatile x = is::to_float(k[j]), y = is::to_float(k[j + half]);
          float const volatile c  = is::to_float(table[static_cast<std::size_t>(p * D + j)]);
          float const volatile sn = is::to_float(table[static_cast<std::size_t>(p * D + half + j)]);
          float const volatile xc = x * c, ys = y * sn, yc = y * c, xs = x * sn;
          float const volatile first = xc - ys, second = yc + xs;
          bad += bits(cell[key_at(t, j)]) != upper(first);
          bad += bits(cell[key_at(t, j + half)]) != upper(second);
        }
        for (std::int64_t d = 0; d < D; ++d) {
          bad += bits(cell[value_at(t, d)]) != bits(v[d]);
        }
      }
    }
  }
  return bad;
}

/**
 * @brief The host run into vLLM's CPU cache (what the connector does on vLLM's CPU build): an
 * m-token segment at the prompt's start (vLLM takes external KV as a leading run of the prompt),
 * block size 128, cache tensors 64-byte aligned, the rotation vLLM's CPU kernel computes (its bf16
 * cos/sin table, fp32 products truncated to bf16: the connector's `fp32_truncate` mode), layout
 * `vec` or `amx`; against memcpy of the same bytes in the same iterations; checked element by
 * element after the warm-up (mismatches_vllm_cpu).
 */
void inject_host_vllm_cpu_bench(benchmark::State& state, model mdl, is::vllm_cpu_isa isa)
{
  ib::run_guarded(state, [&] {
    scenario s{mdl, requests_of(state, false), is::memory_space::host, vllm_cpu_block_size, 0};
    aligned_host_buffer<bfloat16_t> cache_data(
      static_cast<std::size_t>(s.geometry().num_layers * vllm_cpu_layer_elements(s)));
    auto const desc         = make_vllm_cpu_desc(s, cache_data.data, isa);
    std::int64_t const rows = s.p0 + s.tokens;
    std::vector<bfloat16_t> const table =
      is::make_rope_cos_sin_values<bfloat16_t>(s.rotation, rows);
    auto rotation = is::make_rope_cos_sin_table(s.rotation, table.data(), rows, false);
    rotation.truncate_to_bfloat16 = true;
    ib::traffic const t           = s.traffic();
    std::size_t const copy_bytes  = static_cast<std::size_t>(t.bytes / 2);
    std::vector<std::byte> copy_destination(copy_bytes);
    void const* const copy_source = s.store.ref().pool;  // pool_bytes >= copy_bytes

    auto const fused = [&] { s.batch.run(desc, rotation); };
    auto const copy  = [&] {
      std::memcpy(copy_destination.data(), copy_source, copy_bytes);
      benchmark::DoNotOptimize(copy_destination.data());
      benchmark::ClobberMemory();
    };
    fused();
    copy();
    std::int64_t const bad = mismatches_vllm_cpu(s, cache_data.data, isa, table);
    INFERSCALE_EXPECTS(bad == 0,
                       "inject_bench: the vLLM CPU cache differs from the recomputation in " +
                         std::to_string(bad) + " elements");

    auto const [seconds, copy_seconds] = timed_against_copy(state, fused, copy);
    ib::report_throughput(state, t, seconds, copy_seconds);
    report_common(state, s, false);
  });
}

/// @brief Device state shared by the raw and checked benchmarks.
struct device_case {
  scenario s;
  ib::device_buffer<bfloat16_t> fused_cache;
  ib::device_buffer<bfloat16_t> two_pass_cache;
  ib::device_buffer<bfloat16_t> composed;
  is::paged_kv_cache fused_desc;
  is::paged_kv_cache two_pass_desc;
  is::injection_workspace workspace;

  device_case(model const& mdl, std::vector<std::vector<std::int32_t>> const& requests)
    : s{mdl, requests, is::memory_space::device},
      fused_cache(static_cast<std::size_t>(s.cache_elements())),
      two_pass_cache(static_cast<std::size_t>(s.cache_elements())),
      composed(static_cast<std::size_t>(s.composed_elements())),
      fused_desc{s.make_cache(fused_cache.data())},
      two_pass_desc{s.make_cache(two_pass_cache.data())},
      workspace{s.tokens}
  {
    INFERSCALE_CUDA_TRY(cudaMemset(fused_cache.data(), 0, fused_cache.bytes()));
    INFERSCALE_CUDA_TRY(cudaMemset(two_pass_cache.data(), 0, two_pass_cache.bytes()));
    workspace.stage(s.batch, cuda::stream_ref{cudaStream_t{}});
    INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
  }

  void raw(cudaStream_t stream) const
  {
    is::detail::inject_view_async(
      s.store.ref(), workspace.view(), fused_desc, s.rotation, nullptr, cuda::stream_ref{stream});
  }
};

void inject_device_bench(benchmark::State& state, model mdl, bool batch)
{
  if (!ib::require_device(state)) { return; }
  ib::run_guarded(state, [&] {
    device_case c{mdl, requests_of(state, batch)};
    device_two_pass const two_pass{c.s, c.workspace.view(), c.composed.data(), c.two_pass_desc};
    ib::traffic const t = c.s.traffic();

    ib::cuda_stream stream;
    ib::cuda_event f0, f1, p0, p1, c0, c1;
    ib::l2_flusher flusher;
    std::size_t const copy_bytes = static_cast<std::size_t>(t.bytes / 2);
    ib::device_buffer<std::byte> copy_destination(copy_bytes);
    void const* const copy_source = c.s.store.ref().pool;  // pool_bytes >= copy_bytes
    auto const copy               = [&] {
      INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
        copy_destination.data(), copy_source, copy_bytes, cudaMemcpyDeviceToDevice, stream.get()));
    };

    c.raw(stream.get());
    two_pass(stream.get());
    copy();
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    std::uint64_t const bad =
      two_pass.mismatches(c.fused_desc) + two_pass.mismatches(c.two_pass_desc);
    INFERSCALE_EXPECTS(
      bad == 0,
      "inject_bench: fused and two-pass results differ in " + std::to_string(bad) + " elements");

    double seconds = 0.0, two_pass_seconds = 0.0, copy_seconds = 0.0;
    for (auto _ : state) {
      flusher.flush(stream.get());
      INFERSCALE_CUDA_TRY(cudaEventRecord(f0.get(), stream.get()));
      c.raw(stream.get());
      INFERSCALE_CUDA_TRY(cudaEventRecord(f1.get(), stream.get()));
      flusher.flush(stream.get());
      INFERSCALE_CUDA_TRY(cudaEventRecord(p0.get(), stream.get()));
      two_pass(stream.get());
      INFERSCALE_CUDA_TRY(cudaEventRecord(p1.get(), stream.get()));
      flusher.flush(stream.get());
      INFERSCALE_CUDA_TRY(cudaEventRecord(c0.get(), stream.get()));
      copy();
      INFERSCALE_CUDA_TRY(cudaEventRecord(c1.get(), stream.get()));
      INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
      double const f = ib::elapsed_seconds(f0, f1);
      state.SetIterationTime(f);
      seconds += f;
      two_pass_seconds += ib::elapsed_seconds(p0, p1);
      copy_seconds += ib::elapsed_seconds(c0, c1);
    }
    ib::report_throughput(state, t, seconds, copy_seconds);
    report_two_pass(state, t, seconds, two_pass_seconds);
    report_common(state, c.s, true);
  });
}

void inject_checked_device_bench(benchmark::State& state, model mdl, bool batch)
{
  if (!ib::require_device(state)) { return; }
  ib::run_guarded(state, [&] {
    using clock = std::chrono::steady_clock;
    device_case c{mdl, requests_of(state, batch)};
    ib::traffic const t = c.s.traffic();

    ib::cuda_stream stream;
    ib::cuda_event c0, c1;
    ib::l2_flusher flusher;
    std::size_t const copy_bytes = static_cast<std::size_t>(t.bytes / 2);
    ib::device_buffer<std::byte> copy_destination(copy_bytes);
    void const* const copy_source = c.s.store.ref().pool;
    auto const checked            = [&] {
      c.s.batch.run(c.fused_desc,
                    c.s.rotation,
                    is::device_context{c.workspace, cuda::stream_ref{stream.get()}});
    };
    // Host wall time of `work` up to the end of the stream's work, from a cold L2 and idle stream.
    auto const wall = [&](auto&& work) {
      flusher.flush(stream.get());
      INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
      auto const w0 = clock::now();
      work();
      INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
      return std::chrono::duration<double>(clock::now() - w0).count();
    };

    checked();
    c.raw(stream.get());
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
      copy_destination.data(), copy_source, copy_bytes, cudaMemcpyDeviceToDevice, stream.get()));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));

    double seconds = 0.0, raw_seconds = 0.0, copy_seconds = 0.0;
    for (auto _ : state) {
      double const s = wall(checked);
      state.SetIterationTime(s);
      seconds += s;
      raw_seconds += wall([&] { c.raw(stream.get()); });
      flusher.flush(stream.get());
      INFERSCALE_CUDA_TRY(cudaEventRecord(c0.get(), stream.get()));
      INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
        copy_destination.data(), copy_source, copy_bytes, cudaMemcpyDeviceToDevice, stream.get()));
      INFERSCALE_CUDA_TRY(cudaEventRecord(c1.get(), stream.get()));
      INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
      copy_seconds += ib::elapsed_seconds(c0, c1);
    }
    ib::report_throughput(state, t, seconds, copy_seconds);
    if (!state.error_occurred() && seconds > 0.0) {
      state.counters["vs_raw"] = benchmark::Counter(raw_seconds / seconds);
    }
    report_common(state, c.s, true);
  });
}

/**
 * @brief Host planning of one scheduler step, the work the checked injection needs before the
 * launch: compose every request (k facts of 20 tokens) and add it with its block table to a batch
 * reused across steps (reserve once, clear every step). Only the catalogue matters, so the store
 * holds a tiny geometry. Reported per step; `tokens_per_second` is memory tokens planned.
 */
void plan_host_bench(benchmark::State& state)
{
  std::int64_t const requests        = state.range(0);
  std::int64_t const facts           = state.range(1);
  constexpr std::int32_t fact_tokens = 20;
  is::kv_store_config config{};
  config.model       = is::kv_geometry{1, 1, 8};
  config.store_dtype = is::dtype::bfloat16;
  config.page_size   = store_page_size;
  config.num_pages   = requests * facts * 2;
  config.space       = is::memory_space::host;
  is::kv_store store{config};
  std::vector<bfloat16_t> const kv(fact_tokens * 8);
  auto const view = is::make_fact_kv_view<bfloat16_t const>(kv.data(), 1, fact_tokens, 1, 8);
  for (std::int64_t f = 0; f < requests * facts; ++f) {
    store.insert<bfloat16_t>(static_cast<std::uint64_t>(f),
                             static_cast<std::uint64_t>(f / facts),
                             std::vector<std::int32_t>(fact_tokens, static_cast<std::int32_t>(f)),
                             view,
                             view);
  }
  std::int64_t const tokens_per_request = facts * fact_tokens;
  std::int64_t const blocks_per_request = (tokens_per_request + block_size - 1) / block_size;
  std::vector<std::vector<std::uint64_t>> retrieved(static_cast<std::size_t>(requests));
  std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(requests));
  for (std::int64_t r = 0; r < requests; ++r) {
    for (std::int64_t i = 0; i < facts; ++i) {
      retrieved[static_cast<std::size_t>(r)].push_back(static_cast<std::uint64_t>(r * facts + i));
    }
    for (std::int64_t b = 0; b < blocks_per_request; ++b) {
      tables[static_cast<std::size_t>(r)].push_back(
        static_cast<std::int32_t>(r * blocks_per_request + b));
    }
  }
  is::compose_options options{};
  options.first_position = first_position;
  options.order          = is::fact_order::best_last;
  is::injection_batch batch{store};
  batch.reserve(requests * tokens_per_request);
  for (auto _ : state) {
    batch.clear();
    for (std::int64_t r = 0; r < requests; ++r) {
      is::composition const plan =
        is::compose(store, retrieved[static_cast<std::size_t>(r)], options);
      auto const& table = tables[static_cast<std::size_t>(r)];
      batch.add(
        plan,
        is::slots_from_block_table(
          table.data(), static_cast<std::int64_t>(table.size()), block_size, 0, plan.length()));
    }
    benchmark::DoNotOptimize(batch.slots().data());
  }
  state.counters["tokens"]            = static_cast<double>(batch.num_tokens());
  state.counters["tokens_per_second"] = benchmark::Counter(
    static_cast<double>(batch.num_tokens()), benchmark::Counter::kIsIterationInvariantRate);
}

// ------------------------------------------------------------------------------------------------
// Tiers: the cost per request of a host-resident fact set against a device-resident one.

/**
 * @brief One m-token request (segment_fact_lengths(m) facts, Llama-3.1-8B geometry, bf16) in a
 * tiered store whose device tier holds exactly the request and whose host tier holds it too.
 * `resident`: every iteration finds the facts on the device (admit only touches them);
 * otherwise their device copies are evicted before each iteration (outside the timing), so the
 * timed call admits them (catalogue), stages them layer by layer and injects: the request path of
 * a user whose memory lives in the host tier.
 */
struct tier_case {
  is::tiered_store tiers;
  std::vector<std::uint64_t> ids;
  is::rope_params rotation;
  std::int64_t tokens{};
  std::vector<std::int64_t> slots;

  tier_case(model const& mdl, std::int64_t m, is::memory_space space)
    : tiers{make_config(mdl, m, space)}, rotation{is::make_rope_params(mdl.rope())}
  {
    std::vector<std::int32_t> const lengths = segment_fact_lengths(m);
    is::kv_geometry const g                 = mdl.geometry;
    std::uint64_t next                      = 1;
    for (std::int32_t length : lengths) {
      std::size_t const n =
        static_cast<std::size_t>(g.num_layers) * length * g.num_kv_heads * g.head_dim;
      std::vector<bfloat16_t> k(n), v(n);
      for (std::size_t i = 0; i < n; ++i) {
        k[i] = random_value(next * 1000003 + i);
        v[i] = random_value(next * 1000033 + i + n);
      }
      auto const kv = is::make_fact_kv_view<bfloat16_t const>(
        k.data(), g.num_layers, length, g.num_kv_heads, g.head_dim);
      auto const vv = is::make_fact_kv_view<bfloat16_t const>(
        v.data(), g.num_layers, length, g.num_kv_heads, g.head_dim);
      std::vector<std::int32_t> token_ids(static_cast<std::size_t>(length));
      std::iota(token_ids.begin(), token_ids.end(), static_cast<std::int32_t>(next * 100));
      tiers.insert<bfloat16_t>(next, 0, std::move(token_ids), kv, vv, is::fact_residency::host);
      ids.push_back(next++);
      tokens += length;
    }
    slots.resize(static_cast<std::size_t>(tokens));
    std::iota(slots.begin(), slots.end(), first_position);
  }

  static is::tiered_store_config make_config(model const& mdl,
                                             std::int64_t m,
                                             is::memory_space space)
  {
    std::int64_t pages = 0;
    for (std::int32_t length : segment_fact_lengths(m)) {
      pages += (length + store_page_size - 1) / store_page_size;
    }
    is::tiered_store_config c;
    c.device.model       = mdl.geometry;
    c.device.store_dtype = is::dtype::bfloat16;
    c.device.page_size   = store_page_size;
    c.device.num_pages   = pages;
    c.device.space       = space;
    c.host_pages         = pages;
    return c;
  }

  /// Drops every device copy (the facts stay in the host tier).
  void evict_all()
  {
    for (std::uint64_t id : ids) {
      if (tiers.residency(id) == is::fact_residency::both) { tiers.evict(id); }
    }
  }

  /// Cache slots: p0 .. p0 + m - 1 of a contiguous cache.
  std::int64_t cache_slots() const { return first_position + tokens; }

  is::paged_kv_cache make_cache(bfloat16_t* base) const
  {
    is::kv_geometry const g = tiers.device_tier().geometry();
    std::int64_t const h = g.num_kv_heads, d = g.head_dim, n = cache_slots();
    return is::make_contiguous_cache(is::dtype::bfloat16,
                                     base,
                                     {g.num_layers, 2, n, h, d},
                                     {2 * n * h * d, n * h * d, h * d, d, 1});
  }

  /// Bytes staged by a host-resident request: K and V of its tokens, all layers.
  std::int64_t staged_bytes() const
  {
    return tiers.device_tier().geometry().bytes(tokens, is::dtype::bfloat16);
  }

  /// Composition and batch of the request against the device tier (after admit).
  is::injection_batch plan() const
  {
    is::compose_options o;
    o.first_position        = first_position;
    o.order                 = is::fact_order::as_given;
    is::composition const c = is::compose(tiers.device_tier(), ids, o);
    is::injection_batch batch{tiers.device_tier()};
    batch.add(c, slots);
    return batch;
  }
};

void report_tier(benchmark::State& state,
                 double seconds,
                 double resident_seconds,
                 double copy_seconds,
                 std::int64_t staged_bytes,
                 bool resident,
                 std::int64_t tokens,
                 bool device)
{
  if (state.error_occurred() || seconds <= 0.0) { return; }
  double const it          = static_cast<double>(state.iterations());
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(tokens));
  if (!resident) {
    state.counters["resident_us"] = benchmark::Counter(resident_seconds / it * 1e6);
    state.counters["copy_us"]     = benchmark::Counter(copy_seconds / it * 1e6);
    state.counters["copy_GB/s"] =
      benchmark::Counter(static_cast<double>(staged_bytes) * it / copy_seconds / 1e9);
    state.counters["vs_resident"] = benchmark::Counter(resident_seconds / seconds);
    // Device: perfect overlap costs max(copy, resident); 1.0 = staging added nothing beyond
    // that. The host copies and writes in turn: its bound is copy + resident.
    double const bound =
      device ? std::max(copy_seconds, resident_seconds) : copy_seconds + resident_seconds;
    state.counters[device ? "vs_overlap" : "vs_copy_plus_resident"] =
      benchmark::Counter(bound / seconds);
  }
}

/**
 * The measurement loop of both backends: `request()` runs one whole request (and waits for it),
 * `copy()` returns the seconds of one bare copy of the staged bytes. Host-resident iterations evict
 * first (untimed), then time the request, the same request again (resident now) and the copy.
 */
template <class Request, class Copy>
void tier_loop(
  benchmark::State& state, tier_case& c, bool resident, bool device, Request&& request, Copy&& copy)
{
  using clock      = std::chrono::steady_clock;
  auto const timed = [&] {
    auto const t0 = clock::now();
    request();
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  request();  // warm: the facts are on the device now
  double seconds = 0.0, resident_seconds = 0.0, copy_seconds = 0.0;
  for (auto _ : state) {
    if (!resident) { c.evict_all(); }
    double const s = timed();
    state.SetIterationTime(s);
    seconds += s;
    if (!resident) {
      resident_seconds += timed();
      copy_seconds += copy();
    }
  }
  report_tier(
    state, seconds, resident_seconds, copy_seconds, c.staged_bytes(), resident, c.tokens, device);
}

/// Host tiers: staging is memcpy of whole page runs, then one all-layer host injection pass.
void tier_host_bench(benchmark::State& state, model mdl, bool resident)
{
  ib::run_guarded(state, [&] {
    tier_case c{mdl, state.range(0), is::memory_space::host};
    std::vector<bfloat16_t> cache(static_cast<std::size_t>(
      c.tiers.device_tier().geometry().elements_per_token() * c.cache_slots()));
    is::paged_kv_cache const desc = c.make_cache(cache.data());
    std::size_t const bytes       = static_cast<std::size_t>(c.staged_bytes());
    std::vector<std::byte> copy_from(bytes), copy_to(bytes);
    tier_loop(
      state,
      c,
      resident,
      false,
      [&] {
        is::tier_request r          = c.tiers.admit(c.ids);
        is::injection_batch const b = c.plan();
        c.tiers.run(r, b, desc, c.rotation);
      },
      [&] {
        auto const c0 = std::chrono::steady_clock::now();
        std::memcpy(copy_to.data(), copy_from.data(), bytes);
        benchmark::DoNotOptimize(copy_to.data());
        benchmark::ClobberMemory();
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
      });
  });
}

/// Device tier + pinned host tier: host wall time from the call to the end of the stream's work;
/// ceiling: a pinned host-to-device copy of the staged bytes and the resident request, same run.
void tier_device_bench(benchmark::State& state, model mdl, bool resident)
{
  if (!ib::require_device(state)) { return; }
  ib::run_guarded(state, [&] {
    tier_case c{mdl, state.range(0), is::memory_space::device};
    ib::device_buffer<bfloat16_t> cache(static_cast<std::size_t>(
      c.tiers.device_tier().geometry().elements_per_token() * c.cache_slots()));
    is::paged_kv_cache const desc = c.make_cache(cache.data());
    is::injection_workspace workspace{c.tokens};
    ib::cuda_stream compute, copy;
    ib::cuda_event c0, c1;
    std::size_t const bytes = static_cast<std::size_t>(c.staged_bytes());
    ib::device_buffer<std::byte> copy_to(bytes);
    void const* const copy_from = c.tiers.host_tier().ref().pool;  // pinned, >= bytes
    tier_loop(
      state,
      c,
      resident,
      true,
      [&] {
        is::tier_request r          = c.tiers.admit(c.ids);
        is::injection_batch const b = c.plan();
        c.tiers.run(r,
                    b,
                    desc,
                    c.rotation,
                    is::device_context{workspace, cuda::stream_ref{compute.get()}}.with_copy_stream(
                      cuda::stream_ref{copy.get()}));
        INFERSCALE_CUDA_TRY(cudaStreamSynchronize(compute.get()));
      },
      [&] {
        INFERSCALE_CUDA_TRY(cudaEventRecord(c0.get(), copy.get()));
        INFERSCALE_CUDA_TRY(
          cudaMemcpyAsync(copy_to.data(), copy_from, bytes, cudaMemcpyHostToDevice, copy.get()));
        INFERSCALE_CUDA_TRY(cudaEventRecord(c1.get(), copy.get()));
        INFERSCALE_CUDA_TRY(cudaStreamSynchronize(copy.get()));
        return ib::elapsed_seconds(c0, c1);
      });
  });
}

void register_inject_benchmarks()
{
  for (model const* m : {&llama, &qwen}) {
    std::string const suffix = std::string{"/"} + m->name + "/bf16";
    benchmark::RegisterBenchmark(("inject/host" + suffix).c_str(), inject_host_bench, *m, false)
      ->Apply(ib::host_benchmark)
      ->MinTime(0.1)
      ->ArgNames({"m"})
      ->ArgsProduct({{128, 1024}});
    benchmark::RegisterBenchmark(("inject/device" + suffix).c_str(), inject_device_bench, *m, false)
      ->Apply(ib::device_benchmark)
      ->ArgNames({"m"})
      ->ArgsProduct({{128, 1024, 4096}});
    benchmark::RegisterBenchmark(
      ("inject_checked/device" + suffix).c_str(), inject_checked_device_bench, *m, false)
      ->Apply(ib::device_benchmark)
      ->ArgNames({"m"})
      ->ArgsProduct({{128, 1024, 4096}});
  }
  std::string const suffix = std::string{"/"} + llama.name + "/bf16";
  benchmark::RegisterBenchmark(("inject/host/" + std::string{llama.name} + "/bf16-fp8e4m3").c_str(),
                               inject_host_fp8_bench,
                               llama)
    ->Apply(ib::host_benchmark)
    ->MinTime(0.1)
    ->ArgNames({"m", "calibrated"})
    ->ArgsProduct({{128, 1024}, {0, 1}});
  for (model const* m : {&smollm2, &llama}) {
    benchmark::RegisterBenchmark(("inject/host/" + std::string{m->name} + "/compressed").c_str(),
                                 inject_host_compressed_bench,
                                 *m)
      ->Apply(ib::host_benchmark)
      ->MinTime(0.1)
      ->ArgNames({"m", "compression"})
      ->ArgsProduct({{128, 1024}, {1, 2}});
  }
  for (auto const isa : {is::vllm_cpu_isa::vec, is::vllm_cpu_isa::amx}) {
    for (model const* m : {&smollm2, &llama}) {
      std::string const name =
        std::string{"inject/host/vllm_cpu/"} + is::to_string(isa) + "/" + m->name + "/bf16";
      benchmark::RegisterBenchmark(name.c_str(), inject_host_vllm_cpu_bench, *m, isa)
        ->Apply(ib::host_benchmark)
        ->MinTime(0.1)
        ->ArgNames({"m"})
        ->ArgsProduct({{128, 1920}});
    }
  }
  benchmark::RegisterBenchmark(
    ("inject_batch/host" + suffix).c_str(), inject_host_bench, llama, true)
    ->Apply(ib::host_benchmark)
    ->MinTime(0.1)
    ->ArgNames({"requests", "facts"})
    ->ArgsProduct({{8}, {20}});
  benchmark::RegisterBenchmark(
    ("inject_batch/device" + suffix).c_str(), inject_device_bench, llama, true)
    ->Apply(ib::device_benchmark)
    ->ArgNames({"requests", "facts"})
    ->ArgsProduct({{64}, {20}});
  benchmark::RegisterBenchmark(
    ("inject_batch_checked/device" + suffix).c_str(), inject_checked_device_bench, llama, true)
    ->Apply(ib::device_benchmark)
    ->ArgNames({"requests", "facts"})
    ->ArgsProduct({{64}, {20}});
  for (bool resident : {true, false}) {
    std::string const where = resident ? "/device_resident" : "/host_resident";
    benchmark::RegisterBenchmark(
      ("tier/host" + suffix + where).c_str(), tier_host_bench, llama, resident)
      ->Apply(ib::host_benchmark)
      ->ArgNames({"m"})
      ->ArgsProduct({{1024}});
    benchmark::RegisterBenchmark(
      ("tier/device" + suffix + where).c_str(), tier_device_bench, llama, resident)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->MinTime(0.1)
      ->ArgNames({"m"})
      ->ArgsProduct({{128, 1024, 4096}});
  }
  benchmark::RegisterBenchmark("plan/host", plan_host_bench)
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2)
    ->ArgNames({"requests", "facts"})
    ->ArgsProduct({{1, 64}, {20}});
}

}  // namespace

int main(int argc, char** argv)
{
  register_inject_benchmarks();
  return inferscale::bench::benchmark_main(argc, argv);
}
