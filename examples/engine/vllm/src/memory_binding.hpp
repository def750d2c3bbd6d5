// inferscale_vllm._inferscale.Memory: the library's memory facade (memory.hpp) bound once, for the
// package's memory layer (memory.py) and the server. Included by bindings.cpp (one module).
//
// The facade holds the store, the index, the fact lifecycle and the crash-safe snapshot; what it
// needs from an engine comes through two adapters, and here both replay what the caller measured:
//  - replay_model: the K/V of each sequence were captured by the engine itself (the connector's
//    save path read them back from vLLM's paged cache, de-rotated) and are handed in as float32
//    arrays [layers, tokens, kv_heads, head_dim]; the facade's encode call finds the sequence by
//    its tokens and first position and copies its rows, and refuses a sequence it was not given.
//  - replay_embedder: each text's embedding, computed by the caller's embedder, looked up by text.
// Arrays cross as nb::ndarray (DLPack: numpy arrays or CPU torch tensors), C-contiguous float32
// on the CPU, their shapes checked against the memory before anything is written; never raw
// addresses. Every refusal is the library's logic_error, raised as ValueError.
#pragma once

#include <inferscale/memory.hpp>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace inferscale_vllm {

namespace nb = nanobind;
using namespace inferscale;

using kv_array     = nb::ndarray<float const, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using matrix_array = nb::ndarray<float const, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using vector_array = nb::ndarray<float const, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

/// One sequence's pre-RoPE K/V as the engine computed it.
struct captured_sequence {
  std::vector<std::int32_t> tokens;
  std::int64_t first_position{};
  float const* keys{};  ///< [layers, tokens, heads, head_dim], contiguous
  float const* values{};
  bool used{false};
};

/// A model adapter (engine.hpp) whose forwards were run by the engine already.
class replay_model {
 public:
  replay_model(kv_geometry g, std::vector<captured_sequence> sequences)
    : geometry_{g}, sequences_{std::move(sequences)}
  {
  }
  kv_geometry geometry() const { return geometry_; }
  rope_params rotation() const { return {}; }  // the facade's write path does not rotate

  void encode(std::vector<std::int32_t> const& tokens, std::int64_t first_position, kv_capture& out)
  {
    for (captured_sequence& s : sequences_) {
      if (s.used || s.first_position != first_position || s.tokens != tokens) { continue; }
      s.used               = true;
      std::int64_t const n = static_cast<std::int64_t>(tokens.size());
      std::int64_t const row =
        static_cast<std::int64_t>(geometry_.num_kv_heads) * geometry_.head_dim;
      for (std::int32_t l = 0; l < geometry_.num_layers; ++l) {
        std::int64_t const at = static_cast<std::int64_t>(l) * n * row;
        out.write_keys(
          l, 0, make_token_head_view(s.keys + at, n, geometry_.num_kv_heads, geometry_.head_dim));
        out.write_values(
          l, 0, make_token_head_view(s.values + at, n, geometry_.num_kv_heads, geometry_.head_dim));
      }
      return;
    }
    INFERSCALE_FAIL("Memory: no captured K/V were given for a sequence of " +
                    std::to_string(tokens.size()) + " tokens at position " +
                    std::to_string(first_position) +
                    " (each fact's keys and values cover its context and its tokens)");
  }

 private:
  kv_geometry geometry_;
  std::vector<captured_sequence> sequences_;
};

/// An embedder adapter (memory_types.hpp) answering from the caller's embeddings.
class replay_embedder {
 public:
  replay_embedder(std::int64_t dim, std::unordered_map<std::string, std::vector<float>> vectors)
    : dim_{dim}, vectors_{std::move(vectors)}
  {
  }
  std::int64_t dimension() const { return dim_; }
  std::vector<float> embed(std::string const& text) const
  {
    auto const it = vectors_.find(text);
    INFERSCALE_EXPECTS(it != vectors_.end(),
                       "Memory: no embedding was given for the text '" + text.substr(0, 80) + "'");
    return it->second;
  }

 private:
  std::int64_t dim_;
  std::unordered_map<std::string, std::vector<float>> vectors_;
};

inline memory_config make_memory_config(std::int32_t layers,
                                        std::int32_t heads,
                                        std::int32_t head_dim,
                                        dtype store_dtype,
                                        std::int64_t num_pages,
                                        std::int32_t page_size,
                                        std::int64_t embedding_dim,
                                        kv_compression compression = kv_compression::none)
{
  memory_config c;
  c.store.model        = kv_geometry{layers, heads, head_dim};
  c.store.store_dtype  = store_dtype;
  c.store.compression  = compression;  // none, or codes dequantized to store_dtype on injection
  c.store.space        = memory_space::host;  // the CPU engine's; a GPU worker copies its shard
  c.store.num_pages    = num_pages;
  c.store.page_size    = page_size;
  c.index.dim          = embedding_dim;
  c.index.metric       = distance_metric::cosine;
  c.index.vector_dtype = dtype::float32;
  c.index.space        = memory_space::host;
  return c;
}

/// The facade, owned; `store` hands out a view of its store for the injection path.
class memory_handle {
 public:
  explicit memory_handle(memory m) : memory_{std::move(m)} {}

  memory& get() { return memory_; }
  memory const& get() const { return memory_; }

  /// Facts added directly (memory::add_facts): fact i is `contexts[i] + tokens[i]` at
  /// `first_positions[i]`, whose captured rows are `keys[i]` / `values[i]`.
  void add_facts(std::uint64_t ns,
                 std::vector<std::uint64_t> const& ids,
                 std::vector<std::vector<std::int32_t>> const& contexts,
                 std::vector<std::vector<std::int32_t>> const& tokens,
                 std::vector<std::int64_t> const& first_positions,
                 std::vector<kv_array> const& keys,
                 std::vector<kv_array> const& values,
                 std::vector<std::string> const& texts,
                 matrix_array const& embeddings)
  {
    std::size_t const n = ids.size();
    INFERSCALE_EXPECTS(contexts.size() == n && tokens.size() == n && first_positions.size() == n &&
                         keys.size() == n && values.size() == n && texts.size() == n,
                       "Memory.add_facts: ids, contexts, tokens, first_positions, keys, values and "
                       "texts must have one entry per fact (" +
                         std::to_string(n) + " ids)");
    std::int64_t const dim = memory_.config().index.dim;
    INFERSCALE_EXPECTS(
      embeddings.shape(0) == n && static_cast<std::int64_t>(embeddings.shape(1)) == dim,
      "Memory.add_facts: embeddings are [" + std::to_string(embeddings.shape(0)) + ", " +
        std::to_string(embeddings.shape(1)) + "], expected [" + std::to_string(n) + ", " +
        std::to_string(dim) + "]");
    std::vector<captured_sequence> sequences;
    std::vector<direct_fact> facts;
    std::unordered_map<std::string, std::vector<float>> vectors;
    for (std::size_t i = 0; i < n; ++i) {
      captured_sequence s;
      s.tokens = contexts[i];
      s.tokens.insert(s.tokens.end(), tokens[i].begin(), tokens[i].end());
      s.first_position = first_positions[i];
      check_rows(keys[i], s.tokens.size(), "keys", ids[i]);
      check_rows(values[i], s.tokens.size(), "values", ids[i]);
      s.keys   = keys[i].data();
      s.values = values[i].data();
      sequences.push_back(std::move(s));
      direct_fact f;
      f.fact_id        = ids[i];
      f.context        = contexts[i];
      f.token_ids      = tokens[i];
      f.first_position = first_positions[i];
      facts.push_back(std::move(f));
      std::vector<float> v(embeddings.data() + i * dim, embeddings.data() + (i + 1) * dim);
      auto const [it, fresh] = vectors.emplace(texts[i], v);
      INFERSCALE_EXPECTS(fresh || it->second == v,
                         "Memory.add_facts: the text of fact " + std::to_string(ids[i]) +
                           " is given twice with different embeddings");
    }
    replay_model model{memory_.store().geometry(), std::move(sequences)};
    replay_embedder embedder{dim, std::move(vectors)};
    nb::gil_scoped_release release;
    (void)memory_.add_facts(model, embedder, ns, facts, texts);
  }

  void set_instruction_prefix(std::vector<std::int32_t> const& tokens,
                              std::uint64_t fact_id,
                              std::uint64_t ns,
                              kv_array const& keys,
                              kv_array const& values)
  {
    check_rows(keys, tokens.size(), "keys", fact_id);
    check_rows(values, tokens.size(), "values", fact_id);
    captured_sequence s;
    s.tokens         = tokens;
    s.first_position = 0;
    s.keys           = keys.data();
    s.values         = values.data();
    replay_model model{memory_.store().geometry(), {std::move(s)}};
    nb::gil_scoped_release release;
    memory_.set_instruction_prefix(model, tokens, fact_id, ns);
  }

  std::vector<std::uint64_t> retrieve(std::uint64_t ns,
                                      vector_array const& query,
                                      std::uint32_t k) const
  {
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(query.shape(0)) == memory_.config().index.dim,
                       "Memory.retrieve: the query has " + std::to_string(query.shape(0)) +
                         " values, the index takes " + std::to_string(memory_.config().index.dim));
    std::vector<float> q(query.data(), query.data() + query.shape(0));
    nb::gil_scoped_release release;
    return memory_.retrieve(ns, q, k);
  }

  /// The segment's token ids and its facts in layout order (prefix first), for `fact_ids` most
  /// relevant first laid out at `first_position ..` (memory::prepare).
  std::pair<std::vector<std::int32_t>, std::vector<std::uint64_t>> prepare(
    std::vector<std::uint64_t> const& fact_ids, std::int64_t first_position) const
  {
    composition const c = memory_.prepare(fact_ids, first_position);
    std::vector<std::uint64_t> order;
    for (composed_segment const& s : c.segments) {
      order.push_back(s.fact_id);
    }
    return {c.token_ids, order};
  }

  void save(std::string const& directory, nb::bytes const& application) const
  {
    std::optional<std::string> data{std::string(application.c_str(), application.size())};
    nb::gil_scoped_release release;
    save_memory(memory_, directory, data);
  }

 private:
  void check_rows(kv_array const& a, std::size_t tokens, char const* what, std::uint64_t id) const
  {
    kv_geometry const g = memory_.store().geometry();
    bool const ok = static_cast<std::int64_t>(a.shape(0)) == g.num_layers && a.shape(1) == tokens &&
                    static_cast<std::int64_t>(a.shape(2)) == g.num_kv_heads &&
                    static_cast<std::int64_t>(a.shape(3)) == g.head_dim;
    INFERSCALE_EXPECTS(ok,
                       "Memory: the " + std::string{what} + " of fact " + std::to_string(id) +
                         " are [" + std::to_string(a.shape(0)) + ", " + std::to_string(a.shape(1)) +
                         ", " + std::to_string(a.shape(2)) + ", " + std::to_string(a.shape(3)) +
                         "], expected [" + std::to_string(g.num_layers) + ", " +
                         std::to_string(tokens) + ", " + std::to_string(g.num_kv_heads) + ", " +
                         std::to_string(g.head_dim) +
                         "] (layers, context + fact tokens, KV heads, head_dim)");
  }

  memory memory_;
};

}  // namespace inferscale_vllm
