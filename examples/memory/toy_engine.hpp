// The stand-in engine of the memory examples (memory_cpu.cpp, engine/gpu_seam.cu): the three
// adapters a real engine supplies to the memory facade (engine.hpp, memory_types.hpp), kept as
// small as they can be.
//  - toy_model, the model adapter: the KV geometry, the rotation (NeoX RoPE), and a forward that
//    hands every layer's pre-RoPE K and V to the capture buffer;
//  - word_embedder, the embedder: words hashed into 64 buckets (any sentence embedder fits);
//  - paged_sequence, the paged-cache adapter of one sequence: slots from its block table (vLLM's
//    rule), the cache they address, and the commit where an engine counts the injected tokens as
//    computed prompt tokens.
// The cache is vLLM FlashAttention's layout, one float32 tensor (2, blocks, 16, heads, head_dim)
// per layer, in host or device memory (make_toy_cache).
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/kv_capture.hpp>
#include <inferscale/rope.hpp>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace toy {

using namespace inferscale;

constexpr std::int32_t num_layers = 2, num_kv_heads = 2, head_dim = 8;
constexpr std::int64_t num_blocks = 8, block_size = 16;
constexpr double rope_theta = 10000.0;
/// Elements of one layer's cache tensor.
constexpr std::int64_t layer_elements = 2 * num_blocks * block_size * num_kv_heads * head_dim;

/// FNV-1a: the same hash on every platform (the tokenizer's and the embedder's).
inline std::uint32_t fnv1a(std::string const& s)
{
  std::uint32_t h = 2166136261u;
  for (unsigned char c : s) {
    h = (h ^ c) * 16777619u;
  }
  return h;
}

/// Lower-case words, punctuation dropped.
inline std::vector<std::string> words(std::string const& text)
{
  std::vector<std::string> out(1);
  for (unsigned char c : text) {
    if (std::isalnum(c) != 0) {
      out.back() += static_cast<char>(std::tolower(c));
    } else if (!out.back().empty()) {
      out.emplace_back();
    }
  }
  if (out.back().empty()) { out.pop_back(); }
  return out;
}

/// A toy tokenizer: one token per word.
inline std::vector<std::int32_t> tokenize(std::string const& text)
{
  std::vector<std::int32_t> ids;
  for (std::string const& w : words(text)) {
    ids.push_back(static_cast<std::int32_t>(fnv1a(w) % 32000u));
  }
  return ids;
}

/// The toy model's pre-RoPE key (`kv` 0) or value (`kv` 1) element of a token, in sixteenths
/// (exact in fp32). A real model's K/V of a fact token depend on the tokens before it, which is why
/// the facade encodes each fact behind its conversation turns; these depend on the token alone, so
/// that an example can recompute what the cache must hold.
inline float toy_kv(
  int kv, std::int32_t token, std::int32_t layer, std::int32_t head, std::int32_t dim)
{
  std::int64_t const h = (std::int64_t{token} * 31 + kv * 17 + layer * 7 + head * 5 + dim) % 97;
  return static_cast<float>(h) / 16.0f - 3.0f;
}

/// The model adapter (is_model_adapter_v).
struct toy_model {
  kv_geometry geometry() const { return {num_layers, num_kv_heads, head_dim}; }
  rope_params rotation() const
  {
    rope_spec spec;  // NeoX pairing (halves), no scaling
    spec.head_dim     = head_dim;
    spec.theta        = rope_theta;
    spec.max_position = 2048;
    return make_rope_params(spec);
  }
  /// One forward over `tokens` (at positions first_position .., which these K/V do not depend on).
  void encode(std::vector<std::int32_t> const& tokens, std::int64_t, kv_capture& out)
  {
    auto const n = static_cast<std::int64_t>(tokens.size());
    std::vector<float> k(static_cast<std::size_t>(n * num_kv_heads * head_dim));
    std::vector<float> v(k.size());
    for (std::int32_t l = 0; l < num_layers; ++l) {
      for (std::int64_t t = 0; t < n; ++t) {
        for (std::int32_t h = 0; h < num_kv_heads; ++h) {
          for (std::int32_t d = 0; d < head_dim; ++d) {
            auto const i = static_cast<std::size_t>((t * num_kv_heads + h) * head_dim + d);
            k[i]         = toy_kv(0, tokens[static_cast<std::size_t>(t)], l, h, d);
            v[i]         = toy_kv(1, tokens[static_cast<std::size_t>(t)], l, h, d);
          }
        }
      }
      out.write_keys(l, 0, make_token_head_view<float const>(k.data(), n, num_kv_heads, head_dim));
      out.write_values(
        l, 0, make_token_head_view<float const>(v.data(), n, num_kv_heads, head_dim));
    }
  }
};

/// The embedder (is_embedder_v): words hashed into 64 buckets, L2-normalised.
struct word_embedder {
  std::int64_t dimension() const { return 64; }
  std::vector<float> embed(std::string const& text) const
  {
    std::vector<float> e(64, 0.0f);
    for (std::string const& w : words(text)) {
      e[fnv1a(w) % 64u] += 1.0f;
    }
    double norm = 0;
    for (float x : e) {
      norm += double{x} * x;
    }
    for (float& x : e) {
      x = static_cast<float>(x / std::sqrt(norm));
    }
    return e;
  }
};

/// The engine's cache over one float32 tensor (2, blocks, block_size, heads, head_dim) per layer
/// (`layer_elements` each, host or device memory), as vLLM's FlashAttention backend holds it.
inline paged_kv_cache make_toy_cache(std::vector<void*> const& layer_tensors)
{
  std::int64_t const token = num_kv_heads * head_dim;
  return make_vllm_flash_attn_cache(
    dtype::float32,
    layer_tensors,
    {2, num_blocks, block_size, num_kv_heads, head_dim},
    {num_blocks * block_size * token, block_size * token, token, head_dim, 1});
}

/// Offset of element (kv, slot, head, dim) in a layer's tensor of make_toy_cache.
inline std::size_t cache_offset(int kv, std::int64_t slot, std::int32_t head, std::int32_t dim)
{
  return static_cast<std::size_t>(
    ((kv * num_blocks * block_size + slot) * num_kv_heads + head) * head_dim + dim);
}

/// The paged-cache adapter of one sequence (is_cache_adapter_v).
struct paged_sequence {
  paged_kv_cache const* cache_;
  std::vector<std::int32_t> block_table;
  std::int64_t computed_tokens{0};

  paged_sequence(paged_kv_cache const& cache, std::vector<std::int32_t> blocks)
    : cache_{&cache}, block_table{std::move(blocks)}
  {
  }
  /// Slots of the sequence's tokens at positions first_position .. (block_table[p / 16] * 16 +
  /// p % 16), staged: the engine sees them at commit.
  std::vector<std::int64_t> allocate(std::int64_t first_position, std::int64_t tokens)
  {
    return slots_from_block_table(block_table.data(),
                                  static_cast<std::int64_t>(block_table.size()),
                                  static_cast<std::int32_t>(block_size),
                                  first_position,
                                  tokens);
  }
  paged_kv_cache const& cache() const { return *cache_; }
  void commit(std::int64_t tokens) { computed_tokens += tokens; }
  /// A failed step: the slots were the sequence's own blocks and nothing was staged, so there is
  /// nothing to give back (an engine that reserves blocks per step frees them here).
  void release(std::int64_t) noexcept {}
};

/// An example's own checks: each failed one counted, the first ten printed under the example's
/// name; `passed()` says whether the program may exit 0.
struct checks {
  char const* program;
  int failures{0};

  void expect(bool ok, std::string const& what)
  {
    if (ok) { return; }
    if (++failures <= 10) { std::fprintf(stderr, "%s: FAILED: %s\n", program, what.c_str()); }
  }
  bool passed() const
  {
    if (failures > 0) { std::fprintf(stderr, "%s: %d checks failed\n", program, failures); }
    return failures == 0;
  }
};

}  // namespace toy
