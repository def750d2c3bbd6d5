// Example: one request, end to end. A KV store holds the pre-RoPE keys and values of eight
// "memory facts" (an instruction prefix and seven facts) of a tiny model; a request retrieves five
// of them, compose() lays the prefix and the facts out as one memory segment at virtual positions
// p0 .. p0 + m - 1, and the injection writes that segment into a vLLM FlashAttention paged KV cache
// through the request's block table, each key rotated to its virtual position. The program then
// checks one head of one layer against its own rotation formula.
//
// Runs everywhere: the device backend (the step's device run) where a CUDA device is visible, the
// host backend (inject_host) otherwise. Exit status 0 when the check passes, 1 when it fails.
#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/inject.cuh>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

using namespace inferscale;

namespace {

// The model: 4 layers x 2 KV heads x head_dim 64, bf16 KV, NeoX-style RoPE with theta 10000.
constexpr int num_layers = 4, num_heads = 2, head_dim = 64;
constexpr double rope_theta = 10000.0;
// The engine's cache: vLLM FlashAttention, per layer one tensor (2, blocks, block_size, heads, d).
constexpr int block_size = 16, num_blocks = 32;

/// splitmix64: the same pseudo-random numbers on every platform.
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next()
  {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z               = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z               = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (2.0f / 16777216.0f) - 1.0f; }
};

/// A fact as the model would have produced it: token ids and pre-RoPE K/V of every layer,
/// `[layers, tokens, heads, head_dim]` (fp32 here; the store keeps bf16).
struct fact {
  std::uint64_t id;
  char const* text;
  std::vector<std::int32_t> token_ids;
  std::vector<float> keys;
  std::vector<float> values;
};

fact make_fact(std::uint64_t id, char const* text, int tokens)
{
  splitmix64 rng{id * 7919};
  fact f{id, text, {}, {}, {}};
  for (int t = 0; t < tokens; ++t) {
    f.token_ids.push_back(static_cast<std::int32_t>(rng.next() % 32000));  // fake vocabulary ids
  }
  std::size_t const n = std::size_t(num_layers) * tokens * num_heads * head_dim;
  for (std::size_t i = 0; i < n; ++i) {
    f.keys.push_back(rng.uniform());
  }
  for (std::size_t i = 0; i < n; ++i) {
    f.values.push_back(rng.uniform());
  }
  return f;
}

/// Element (kv, block, token, head, dim) of one layer's (2, NB, BS, H, D) tensor, contiguous.
std::size_t cache_index(int kv, std::int64_t block, std::int64_t token, int head, int dim)
{
  return static_cast<std::size_t>(
    (((kv * std::int64_t{num_blocks} + block) * block_size + token) * num_heads + head) * head_dim +
    dim);
}

/// Prints a list of slots as runs `a..b`.
void print_runs(std::vector<std::int64_t> const& slots)
{
  for (std::size_t i = 0; i < slots.size();) {
    std::size_t j = i;
    while (j + 1 < slots.size() && slots[j + 1] == slots[j] + 1) {
      ++j;
    }
    std::printf("%s%lld..%lld",
                i == 0 ? "" : ", ",
                static_cast<long long>(slots[i]),
                static_cast<long long>(slots[j]));
    i = j + 1;
  }
  std::printf("\n");
}

}  // namespace

int main()
{
  bool const gpu = visible_device_count() > 0;
  std::printf("InferScale example: inject one request's memory segment into a paged KV cache\n");
  if (gpu) {
    cudaDeviceProp prop{};
    INFERSCALE_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
    std::printf("backend: device (injection_batch::run on %s)\n", prop.name);
  } else {
    std::printf("backend: host (inject_host; no CUDA device visible)\n");
  }
  std::printf("model: %d layers x %d KV heads x head_dim %d, bf16; RoPE theta %.0f, NeoX pairs\n",
              num_layers,
              num_heads,
              head_dim,
              rope_theta);

  // ---- The store: eight facts, pre-RoPE, in pages of 16 tokens.
  std::vector<fact> const facts{
    make_fact(1, "instruction: answer from the facts below", 9),
    make_fact(101, "the Loire is the longest river in France", 12),
    make_fact(102, "Ada Lovelace wrote the first program", 7),
    make_fact(103, "the H200 has 141 GB of HBM3e", 19),
    make_fact(104, "the user's name is Camille", 5),
    make_fact(105, "RoPE rotates pairs of dimensions", 23),
    make_fact(106, "Camille lives in Nantes", 10),
    make_fact(107, "Nantes lies on the Loire", 16),
  };
  kv_store_config config{};
  config.model       = kv_geometry{num_layers, num_heads, head_dim};
  config.store_dtype = dtype::bfloat16;
  config.page_size   = 16;
  config.num_pages   = 16;
  config.space       = gpu ? memory_space::device : memory_space::host;
  kv_store store(config);
  for (fact const& f : facts) {
    auto const tokens = static_cast<std::int64_t>(f.token_ids.size());
    store.insert(
      f.id,
      /*namespace_id=*/1,
      f.token_ids,
      make_fact_kv_view<float const>(f.keys.data(), num_layers, tokens, num_heads, head_dim),
      make_fact_kv_view<float const>(f.values.data(), num_layers, tokens, num_heads, head_dim));
  }
  std::printf("store (%s memory): %lld facts, %lld bytes of K/V in %lld of %lld pages\n",
              to_string(store.space()),
              static_cast<long long>(store.num_facts()),
              static_cast<long long>(store.namespace_bytes(1)),
              static_cast<long long>(store.num_pages() - store.free_pages()),
              static_cast<long long>(store.num_pages()));
  for (fact const& f : facts) {
    fact_record const& r = store.at(f.id);
    std::printf(
      "  fact %3llu: %2d tokens, pages", static_cast<unsigned long long>(f.id), r.length());
    for (std::int64_t p : r.pages) {
      std::printf(" %lld", static_cast<long long>(p));
    }
    std::printf("  \"%s\"\n", f.text);
  }

  // ---- The request: the prefix and five retrieved facts, ranked best first, laid out best last
  // (the most relevant next to the query), after a 12-token system prompt the engine already holds.
  std::vector<std::uint64_t> const retrieved{104, 106, 107, 101, 103};
  compose_options options{};
  options.first_position     = 12;
  options.order              = fact_order::best_last;
  options.instruction_prefix = 1;
  composition const plan     = compose(store, retrieved, options);
  std::int64_t const m       = plan.length();
  std::printf(
    "request: prefix 1 + facts {104, 106, 107, 101, 103} (ranked best first), order "
    "best_last, p0 = %lld\n",
    static_cast<long long>(plan.first_position));
  std::printf("memory segment: m = %lld tokens at virtual positions %lld..%lld\n",
              static_cast<long long>(m),
              static_cast<long long>(plan.position(0)),
              static_cast<long long>(plan.position(m - 1)));
  for (composed_segment const& seg : plan.segments) {
    std::printf("  fact %3llu: segment tokens %2lld..%2lld, positions %lld..%lld\n",
                static_cast<unsigned long long>(seg.fact_id),
                static_cast<long long>(seg.begin),
                static_cast<long long>(seg.begin + seg.length - 1),
                static_cast<long long>(plan.position(seg.begin)),
                static_cast<long long>(plan.position(seg.begin + seg.length - 1)));
  }

  // ---- The engine's cache and the request's block table (blocks are not consecutive). The
  // segment is prompt tokens 12 .. 12 + m - 1 (after the system prompt).
  std::vector<std::int32_t> const block_table{21, 4, 17, 9, 30, 2, 25};
  std::int64_t const start_position = 12;
  std::size_t const layer_elements  = cache_index(2, 0, 0, 0, 0);  // (2, NB, BS, H, D)
  std::vector<bfloat16_t> host_cache(num_layers * layer_elements, bfloat16_t{0});
  device_buffer<bfloat16_t> device_cache;
  if (gpu) { device_cache = device_buffer<bfloat16_t>(host_cache); }  // zeroed, on the device
  bfloat16_t* const cache_data = gpu ? device_cache.data() : host_cache.data();
  std::vector<void*> layer_tensors;
  for (int l = 0; l < num_layers; ++l) {
    layer_tensors.push_back(cache_data + l * layer_elements);
  }
  std::int64_t const bs = block_size, h = num_heads, d = head_dim;
  paged_kv_cache const cache =
    make_vllm_flash_attn_cache(dtype::bfloat16,
                               layer_tensors,
                               {2, num_blocks, bs, h, d},
                               {num_blocks * bs * h * d, bs * h * d, h * d, d, 1});

  injection_batch batch(store);
  batch.add(plan, cache, block_table, start_position);  // the cache's own block size
  std::printf("block table:");
  for (std::int32_t b : block_table) {
    std::printf(" %d", b);
  }
  std::printf(" (block size %d); slots: ", block_size);
  print_runs(batch.slots());

  // ---- Inject: every layer, keys rotated to positions p0 .. p0 + m - 1.
  rope_spec spec{};
  spec.head_dim              = head_dim;
  spec.theta                 = rope_theta;
  spec.pairing               = rope_pairing::halves;
  rope_params const rotation = make_rope_params(spec);
  if (gpu) {
    injection_workspace workspace(batch.num_tokens());
    cuda::stream_ref const stream{cudaStream_t{}};
    batch.run(cache, rotation, device_context{workspace, stream});
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    host_cache = device_cache.to_host();
  } else {
    batch.run(cache, rotation);
  }
  std::int64_t const moved = store.geometry().bytes(m, dtype::bfloat16);
  std::printf(
    "injected %lld tokens: read %lld bytes of pre-RoPE K/V from the store, wrote %lld "
    "bytes to the cache (%lld x 2 x %d layers x %d heads x %d dims x 2 B)\n",
    static_cast<long long>(m),
    static_cast<long long>(moved),
    static_cast<long long>(moved),
    static_cast<long long>(m),
    num_layers,
    num_heads,
    head_dim);

  // ---- Check layer 2, head 1 with this program's own rotation: pair (i, i + 32) of the stored
  // (bf16) key turns by angle (p0 + j) * theta^(-2i/64), computed in double precision.
  int const layer = 2, head = 1;
  double max_error = 0.0, worst_ratio = 0.0;
  bool values_equal = true;
  std::set<std::int64_t> written;
  for (std::int64_t j = 0; j < m; ++j) {
    token_source const& src = plan.sources[static_cast<std::size_t>(j)];
    fact const& f =
      *std::find_if(facts.begin(), facts.end(), [&](fact const& x) { return x.id == src.fact_id; });
    std::int64_t const tokens = static_cast<std::int64_t>(f.token_ids.size());
    std::size_t const row =
      static_cast<std::size_t>(((layer * tokens + src.offset) * num_heads + head) * head_dim);
    auto const stored       = [](float x) { return double(to_float(from_float<bfloat16_t>(x))); };
    std::int64_t const slot = batch.slots()[static_cast<std::size_t>(j)];
    written.insert(slot);
    bfloat16_t const* const tensor = host_cache.data() + layer * layer_elements;
    auto const at                  = [&](int kv, int dim) {
      return tensor[cache_index(kv, slot / block_size, slot % block_size, head, dim)];
    };
    double const position = double(plan.position(j));
    for (int i = 0; i < head_dim / 2; ++i) {
      double const angle = position * std::pow(rope_theta, -2.0 * i / head_dim);
      double const x = stored(f.keys[row + i]), y = stored(f.keys[row + i + head_dim / 2]);
      double const expected[2] = {x * std::cos(angle) - y * std::sin(angle),
                                  y * std::cos(angle) + x * std::sin(angle)};
      int const dims[2]        = {i, i + head_dim / 2};
      for (int e = 0; e < 2; ++e) {
        double const error = std::fabs(double(to_float(at(0, dims[e]))) - expected[e]);
        max_error          = std::max(max_error, error);
        // bf16 keeps 8 significant bits: rounding moves a value by at most 2^-8 of it; the
        // library's fp32 angles and products add about 1e-5 at these positions (allow 1e-4).
        worst_ratio =
          std::max(worst_ratio, error / (std::ldexp(std::fabs(expected[e]), -8) + 1e-4));
      }
    }
    for (int dim = 0; dim < head_dim; ++dim) {
      values_equal =
        values_equal && at(1, dim).bits == from_float<bfloat16_t>(f.values[row + dim]).bits;
    }
  }
  // Every other slot of the layer still holds zeros.
  bool others_untouched = true;
  for (std::int64_t slot = 0; slot < std::int64_t{num_blocks} * block_size; ++slot) {
    if (written.count(slot)) { continue; }
    for (int kv = 0; kv < 2; ++kv) {
      for (int hh = 0; hh < num_heads; ++hh) {
        for (int dim = 0; dim < head_dim; ++dim) {
          std::size_t const i =
            layer * layer_elements + cache_index(kv, slot / block_size, slot % block_size, hh, dim);
          others_untouched = others_untouched && host_cache[i].bits == 0;
        }
      }
    }
  }
  bool const ok = worst_ratio <= 1.0 && values_equal && others_untouched;
  std::printf(
    "check (layer %d, head %d, %lld tokens): keys vs this program's rotation: max abs "
    "error %.3g (%.2f of the bf16 rounding bound); values bit-identical: %s; other "
    "slots untouched: %s\n",
    layer,
    head,
    static_cast<long long>(m),
    max_error,
    worst_ratio,
    values_equal ? "yes" : "no",
    others_untouched ? "yes" : "no");
  std::printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
