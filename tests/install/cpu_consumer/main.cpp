// A CPU-only engine integration (what a llama.cpp or vLLM-CPU user builds): the memory facade with
// a host store and a host index, facts added through a model adapter and an embedder, a request
// served into a host paged cache. Compiled by a plain C++17 compiler that sees no CUDA headers
// (only CCCL's, which are header-only) and linked without libcudart (cpu_consumer.cmake checks
// both). Expected cache contents are written out here: V as stored, K rotated by RoPE (halves
// pairing, theta 10000) at the position the request gave it, computed in double.
#include <inferscale/memory.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

static_assert(
  INFERSCALE_HAS_CUDA_RUNTIME == 0,
  "this consumer must be compiled without the CUDA runtime headers on its include path");

namespace {

using namespace inferscale;

constexpr std::int32_t layers   = 2;
constexpr std::int32_t head_dim = 4;
constexpr std::int64_t slots    = 64;

/// Pre-RoPE K of a token: a function of the token, the layer and the dim; V = K + 0.5.
float key_of(std::int32_t token, std::int32_t layer, std::int32_t d)
{
  return static_cast<float>((token % 97) * (layer + 1) + d);
}

struct model {
  kv_geometry geometry() const { return {layers, 1, head_dim}; }
  rope_params rotation() const
  {
    rope_spec spec;
    spec.head_dim = head_dim;
    return make_rope_params(spec);
  }
  void encode(std::vector<std::int32_t> const& tokens, std::int64_t, kv_capture& out)
  {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      for (std::int32_t l = 0; l < layers; ++l) {
        float k[head_dim], v[head_dim];
        for (std::int32_t d = 0; d < head_dim; ++d) {
          k[d] = key_of(tokens[i], l, d);
          v[d] = k[d] + 0.5f;
        }
        auto const row = static_cast<std::int64_t>(i);
        out.write_keys(l, row, make_token_head_view<float const>(k, 1, 1, head_dim));
        out.write_values(l, row, make_token_head_view<float const>(v, 1, 1, head_dim));
      }
    }
  }
};

/// One dimension per keyword: a query naming a fact's keyword retrieves that fact first.
struct keyword_embedder {
  std::vector<std::string> words{"cello", "tea", "marathon", "paris"};
  std::int64_t dimension() const { return static_cast<std::int64_t>(words.size()); }
  std::vector<float> embed(std::string const& text) const
  {
    std::vector<float> v(words.size(), 0.05f);
    std::istringstream in{text};
    std::string w;
    while (in >> w) {
      for (std::size_t i = 0; i < words.size(); ++i) {
        if (w == words[i]) { v[i] += 1.0f; }
      }
    }
    return v;
  }
};

struct host_paged_cache {
  std::vector<float> data =
    std::vector<float>(static_cast<std::size_t>(layers * 2 * slots * head_dim), -1.0f);
  paged_kv_cache cache_ =
    make_contiguous_cache(dtype::float32,
                          data.data(),
                          {layers, 2, slots, 1, head_dim},
                          {2 * slots * head_dim, slots* head_dim, head_dim, head_dim, 1});
  std::int64_t committed{0};
  std::vector<std::int64_t> allocate(std::int64_t, std::int64_t n)
  {
    std::vector<std::int64_t> s;
    for (std::int64_t j = 0; j < n; ++j) {
      s.push_back(20 + j);
    }  // slots 20, 21, ...
    return s;
  }
  paged_kv_cache const& cache() const { return cache_; }
  void commit(std::int64_t n) { committed += n; }
  void release(std::int64_t) noexcept {}  // fixed slots 20..: nothing staged to give back
  float at(std::int32_t layer, std::int32_t kv, std::int64_t slot, std::int32_t d) const
  {
    return data[static_cast<std::size_t>(((layer * 2 + kv) * slots + slot) * head_dim + d)];
  }
};

}  // namespace

int main()
{
  int failures = 0;
  auto expect  = [&](bool ok, std::string const& what) {
    if (!ok) {
      std::fprintf(stderr, "FAILED: %s\n", what.c_str());
      ++failures;
    }
  };

  memory_config c;
  c.store.model       = {layers, 1, head_dim};
  c.store.store_dtype = dtype::float32;
  c.store.page_size   = 4;
  c.store.num_pages   = 16;
  c.store.space       = memory_space::host;
  c.index.dim         = 4;
  c.index.metric      = distance_metric::cosine;
  memory m{c};

  model engine;
  keyword_embedder embedder;
  std::vector<direct_fact> facts(3);
  std::vector<std::string> const texts{
    "alice plays the cello", "bob drinks tea", "carol ran a marathon"};
  for (std::size_t i = 0; i < facts.size(); ++i) {
    facts[i].fact_id   = 100 + i;
    facts[i].token_ids = {static_cast<std::int32_t>(10 + 3 * i),
                          static_cast<std::int32_t>(11 + 3 * i)};
  }
  memory_add_report const added = m.add_facts(engine, embedder, 7, facts, texts);
  expect(added.embedded == 3, "three facts embedded");
  expect(m.store().num_facts() == 3, "three facts stored");

  host_paged_cache cache;
  std::int64_t const p0 = 10;
  memory_request const r =
    m.serve(embedder, 7, "who plays the cello", 1, p0, cache, engine.rotation());
  expect(r.fact_ids.size() == 1 && r.fact_ids[0] == 100, "the cello fact is retrieved");
  expect(cache.committed == 2, "two tokens committed");

  // Expected: token j of fact 100 (tokens 10, 11) at position p0 + j in slot 20 + j.
  for (std::int32_t l = 0; l < layers; ++l) {
    for (std::int64_t j = 0; j < 2; ++j) {
      std::int32_t const token = static_cast<std::int32_t>(10 + j);
      double const position    = static_cast<double>(p0 + j);
      for (std::int32_t i = 0; i < head_dim / 2; ++i) {
        double const angle = position * std::pow(10000.0, -2.0 * i / head_dim);
        double const x = key_of(token, l, i), y = key_of(token, l, i + head_dim / 2);
        double const k0         = x * std::cos(angle) - y * std::sin(angle);
        double const k1         = y * std::cos(angle) + x * std::sin(angle);
        std::int64_t const slot = 20 + j;
        expect(std::fabs(cache.at(l, 0, slot, i) - k0) <= 2e-3 &&
                 std::fabs(cache.at(l, 0, slot, i + head_dim / 2) - k1) <= 2e-3,
               "K rotated to its position (layer " + std::to_string(l) + ", token " +
                 std::to_string(j) + ", pair " + std::to_string(i) + ")");
      }
      for (std::int32_t d = 0; d < head_dim; ++d) {
        expect(cache.at(l, 1, 20 + j, d) == key_of(token, l, d) + 0.5f, "V as stored");
      }
    }
  }
  expect(cache.at(0, 0, 19, 0) == -1.0f && cache.at(0, 0, 22, 0) == -1.0f,
         "slots outside the request untouched");

  // Without the CUDA runtime: no devices, and device memory is refused with a clear error.
  expect(visible_device_count() == 0, "no CUDA device visible in a CPU-only build");
  kv_store_config dc = c.store;
  dc.space           = memory_space::device;
  bool refused       = false;
  try {
    kv_store device_store{dc};
  } catch (cuda_error const& e) {
    refused = std::string{e.what()}.find("without the CUDA runtime") != std::string::npos;
  }
  expect(refused, "a device store is refused: compiled without the CUDA runtime");

  if (failures != 0) { return 1; }
  std::printf("inferscale CPU-only consumer: OK (served fact %llu into a host cache, no CUDA)\n",
              static_cast<unsigned long long>(r.fact_ids[0]));
  return 0;
}
