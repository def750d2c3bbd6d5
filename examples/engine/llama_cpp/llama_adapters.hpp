/**
 * @file llama_adapters.hpp
 * @brief The two adapters of InferScale's engine seam (inferscale/engine.hpp) for llama.cpp:
 *
 *  - model_adapter: the KV geometry and rotation from the GGUF metadata, the rotation as
 *    llama.cpp forms it (make_ggml_rope_table, llama_model.hpp), and pre-RoPE capture through the
 *    context's graph callback (llama_context.hpp).
 *  - sequence_cache: the paged-cache adapter. It stages a sequence-state blob in llama.cpp's
 *    format (llama_state.hpp), describes its K and V rows as a paged_kv_cache for inject_host, and
 *    commits it with `llama_state_seq_set_data`: the injected tokens become the sequence's own
 *    prefix.
 */
#pragma once

#include "llama_context.hpp"
#include "llama_model.hpp"
#include "llama_state.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/kv_capture.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/rope_layers.hpp>
#include <inferscale/views.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

// ------------------------------------------------------------------------------------------------
// The two adapters of engine.hpp

/**
 * @brief Model adapter (engine.hpp): geometry, llama.cpp's own rotation table, and encode() —
 * one forward in the context's scratch sequence with the graph callback capturing pre-RoPE K/V.
 *
 * @note Bit-exact fidelity holds for a forward over the same tokens at the same positions in an
 *       otherwise empty context: llama.cpp's CPU attention visits the masked cells of other
 *       sequences in its unified cache and rounds differently when they are there (measured: the
 *       keys of layers >= 1 then differ from a prefill in an empty context by up to ~0.1).
 */
class model_adapter {
 public:
  /// @param table_rows positions the rotation tables cover (default: the context length)
  explicit model_adapter(context& ctx, std::int64_t table_rows = 0)
    : ctx_{&ctx}, spec_{ctx.owner().rotation_spec()}
  {
    std::int64_t const rows =
      table_rows > 0 ? table_rows : std::max<std::int64_t>(ctx.options().n_ctx, spec_.max_position);
    // One table per distinct rotation among the layers, as the engine's ROPE nodes hold them
    // (context::layer_rotations): one for most models, two for Gemma 3 (its sliding-window layers
    // at base 10,000, its global ones at 1,000,000).
    std::vector<layer_rope> distinct;
    for (layer_rope const& r : ctx.layer_rotations()) {
      auto const at = std::find(distinct.begin(), distinct.end(), r);
      layer_rotation_.push_back(static_cast<std::int32_t>(at - distinct.begin()));
      if (at == distinct.end()) { distinct.push_back(r); }
    }
    if (distinct.size() >
        static_cast<std::size_t>(per_layer_rotation<rope_params>::max_rotations)) {
      throw engine_error("model_adapter: " + std::to_string(distinct.size()) +
                         " different rotations among the layers (at most " +
                         std::to_string(per_layer_rotation<rope_params>::max_rotations) + ")");
    }
    table_values_.reserve(distinct.size());
    for (layer_rope const& r : distinct) {
      rope_spec const spec = layer_spec(r);
      table_values_.push_back(make_ggml_rope_table(spec, rows));
      rope_params const params        = make_rope_params(spec);
      rope_cos_sin_table<float> table = make_rope_cos_sin_table(
        params,
        table_values_.back().data(),
        static_cast<std::int64_t>(table_values_.back().size()) / params.rotary_dim,
        /*round_each_operation*/ false);
      // ggml's CPU rope computes x0*cos - x1*sin in fp32, which GCC contracts into FMAs in the
      // x86-64 build (FMA enabled with GGML_NATIVE=OFF): measured bit-exact only in this form.
      table.fused_multiply_add = true;
      tables_.push_back(table);
    }
  }
  model_adapter(model_adapter const&)            = delete;  // the rotation views its own arrays
  model_adapter& operator=(model_adapter const&) = delete;

  kv_geometry geometry() const { return ctx_->geometry(); }
  /// @brief The rotation from the GGUF metadata (the global layers' where layers differ).
  rope_spec const& spec() const noexcept { return spec_; }
  /// @brief llama.cpp's rotation of each layer as tables (host memory; valid while the adapter
  /// lives); for injection's host run.
  per_layer_rotation<rope_cos_sin_table<float>> rotation() const noexcept
  {
    return {tables_.data(),
            static_cast<std::int32_t>(tables_.size()),
            layer_rotation_.data(),
            static_cast<std::int32_t>(layer_rotation_.size())};
  }
  /// @brief How many different rotations the layers use (1 for most models).
  std::int32_t distinct_rotations() const noexcept
  {
    return static_cast<std::int32_t>(tables_.size());
  }

  /// @brief One forward over `tokens` at `first_position ..` in the scratch sequence (cleared
  /// before and after); the graph callback hands every layer's pre-RoPE K and V to `out`.
  void encode(std::vector<std::int32_t> const& tokens, std::int64_t first_position, kv_capture& out)
  {
    if (static_cast<std::int64_t>(tokens.size()) != out.num_tokens()) {
      throw engine_error("model_adapter::encode: " + std::to_string(tokens.size()) +
                         " tokens for a capture of " + std::to_string(out.num_tokens()));
    }
    std::int32_t const seq = ctx_->scratch_sequence();
    ctx_->clear(seq);
    ctx_->begin_capture(out);
    try {
      ctx_->decode(seq, tokens, first_position);
    } catch (...) {
      ctx_->end_capture();
      ctx_->clear(seq);
      throw;
    }
    ctx_->end_capture();
    ctx_->clear(seq);
    if (!out.complete()) {
      throw engine_error(
        "model_adapter::encode: the graph callback did not deliver K and V of "
        "every layer and token");
    }
  }

  /**
   * @brief Context-window encoding with branching (encoding.hpp's has_encode_branches_v): the
   * trunk runs once in the scratch sequence (not captured); then up to `n_branch_seq` facts per
   * forward, each in its own branch sequence that shares the trunk's cells at positions
   * `[first_position, first_position + attach)` (llama_memory_seq_cp), so it sees those and
   * itself only. The branches' pre-RoPE K/V go to `out`, branch 0's tokens first.
   * With `n_branch_seq == 0` every branch is its own forward over `trunk[0, attach) + fact`.
   *
   * @note K/V agree with a separate forward per fact to llama.cpp's rounding, not bit for bit:
   *       its CPU attention rounds differently when other sequences' cells are present.
   */
  void encode_branches(std::vector<std::int32_t> const& trunk,
                       std::int64_t first_position,
                       std::vector<encoding_branch> const& branches,
                       kv_capture& out)
  {
    std::int64_t rows    = 0;
    std::int64_t longest = 0;
    for (encoding_branch const& b : branches) {
      if (b.attach < 0 || b.attach > static_cast<std::int64_t>(trunk.size()) ||
          b.token_ids.empty() || b.position != first_position + b.attach) {
        throw engine_error("model_adapter::encode_branches: fact " + std::to_string(b.fact_id) +
                           " does not attach inside the trunk at its position");
      }
      rows += static_cast<std::int64_t>(b.token_ids.size());
      longest = std::max(longest, static_cast<std::int64_t>(b.token_ids.size()));
    }
    if (rows != out.num_tokens()) {
      throw engine_error("model_adapter::encode_branches: " + std::to_string(rows) +
                         " branch tokens for a capture of " + std::to_string(out.num_tokens()));
    }
    context_options const& o = ctx_->options();
    if (o.n_branch_seq == 0) {
      std::int64_t row = 0;
      for (encoding_branch const& b : branches) {
        std::vector<std::int32_t> tokens(trunk.begin(), trunk.begin() + b.attach);
        tokens.insert(tokens.end(), b.token_ids.begin(), b.token_ids.end());
        kv_capture one{geometry(), static_cast<std::int64_t>(tokens.size())};
        encode(tokens, first_position, one);
        std::int64_t const n = static_cast<std::int64_t>(b.token_ids.size());
        for (std::int32_t l = 0; l < geometry().num_layers; ++l) {
          out.write_keys(l, row, layer_rows(one.keys(b.attach, n), l));
          out.write_values(l, row, layer_rows(one.values(b.attach, n), l));
        }
        row += n;
      }
      return;
    }
    if (static_cast<std::int64_t>(trunk.size()) + static_cast<std::int64_t>(o.n_batch) >
        static_cast<std::int64_t>(o.n_ctx)) {
      throw engine_error("model_adapter::encode_branches: a trunk of " +
                         std::to_string(trunk.size()) + " tokens and a batch of " +
                         std::to_string(o.n_batch) + " branch tokens exceed the context's " +
                         std::to_string(o.n_ctx) + " cells");
    }
    if (longest > static_cast<std::int64_t>(o.n_batch)) {
      throw engine_error("model_adapter::encode_branches: a fact of " + std::to_string(longest) +
                         " tokens exceeds n_batch = " + std::to_string(o.n_batch));
    }
    std::int32_t const scratch = ctx_->scratch_sequence();
    std::int32_t const first   = ctx_->first_branch_sequence();
    auto clear_all             = [&] {
      ctx_->clear(scratch);
      for (std::uint32_t i = 0; i < o.n_branch_seq; ++i) {
        ctx_->clear(first + static_cast<std::int32_t>(i));
      }
    };
    clear_all();
    try {
      if (!trunk.empty()) { ctx_->decode(scratch, trunk, first_position); }
      std::int64_t row = 0;
      std::size_t next = 0;
      while (next < branches.size()) {
        std::vector<std::int32_t> tokens, seqs;
        std::vector<std::int64_t> positions;
        std::uint32_t used = 0;
        while (next < branches.size() && used < o.n_branch_seq &&
               tokens.size() + branches[next].token_ids.size() <= o.n_batch) {
          encoding_branch const& b = branches[next];
          std::int32_t const seq   = first + static_cast<std::int32_t>(used);
          if (b.attach > 0) {
            ctx_->copy_sequence(scratch, seq, first_position, first_position + b.attach);
          }
          for (std::size_t j = 0; j < b.token_ids.size(); ++j) {
            tokens.push_back(b.token_ids[j]);
            positions.push_back(b.position + static_cast<std::int64_t>(j));
            seqs.push_back(seq);
          }
          ++used;
          ++next;
        }
        ctx_->begin_capture(out, row);
        ctx_->decode_tokens(tokens, positions, seqs);
        ctx_->end_capture();
        row += static_cast<std::int64_t>(tokens.size());
        for (std::uint32_t i = 0; i < used; ++i) {
          ctx_->clear(first + static_cast<std::int32_t>(i));
        }
      }
    } catch (...) {
      ctx_->end_capture();
      clear_all();
      throw;
    }
    clear_all();
    if (!out.complete()) {
      throw engine_error(
        "model_adapter::encode_branches: the graph callback did not deliver K and V of every "
        "layer and branch token");
    }
  }

 private:
  static token_head_view<float const> layer_rows(fact_kv_view<float const> v, std::int32_t l)
  {
    return make_token_head_view<float const>(v.data_handle() + v.mapping()(l, 0, 0, 0),
                                             v.extent(1),
                                             v.extent(2),
                                             v.extent(3),
                                             v.stride(1),
                                             v.stride(2),
                                             v.stride(3));
  }

  context* ctx_;
  /// @brief The GGUF rotation with a layer's base, scaling and dims from its ROPE node.
  rope_spec layer_spec(layer_rope const& r) const
  {
    std::string const who =
      "model_adapter: architecture '" + ctx_->owner().architecture().name + "': a ROPE node with ";
    if (r.ext_factor != 0.0f || r.attn_factor != 1.0f) {
      throw engine_error(who + "YaRN's extrapolation mix or an attention factor (ext_factor " +
                         std::to_string(r.ext_factor) + ", attn_factor " +
                         std::to_string(r.attn_factor) + ") is not reproduced; refused");
    }
    if ((r.mode != LLAMA_ROPE_TYPE_NORM && r.mode != LLAMA_ROPE_TYPE_NEOX) || r.n_dims <= 0 ||
        r.n_dims % 2 != 0 || r.n_dims > spec_.head_dim || !(r.freq_base > 0.0f) ||
        !(r.freq_scale > 0.0f)) {
      throw engine_error(who + "mode " + std::to_string(r.mode) + ", " + std::to_string(r.n_dims) +
                         " dims, base " + std::to_string(r.freq_base) + ", scale " +
                         std::to_string(r.freq_scale) + " is not supported; refused");
    }
    rope_spec spec  = spec_;
    spec.theta      = r.freq_base;
    spec.rotary_dim = r.n_dims;
    spec.pairing =
      r.mode == LLAMA_ROPE_TYPE_NORM ? rope_pairing::interleaved : rope_pairing::halves;
    if (r.freq_scale == 1.0f) {
      spec.scaling = rope_scaling::none;
      spec.factor  = 1.0;
    } else {
      spec.scaling = rope_scaling::linear;
      spec.factor  = 1.0 / static_cast<double>(r.freq_scale);
    }
    return spec;
  }

  rope_spec spec_;
  std::vector<std::vector<float>> table_values_;  // reserved: the tables view their data
  std::vector<rope_cos_sin_table<float>> tables_;
  std::vector<std::int32_t> layer_rotation_;
};

/**
 * @brief Paged-cache adapter (engine.hpp) for one llama.cpp sequence: allocate() stages a blob of
 * the context's format with cells at the requested positions (slots 0 .. n-1), cache() describes
 * its rows, commit() hands it to llama_state_seq_set_data, replacing the sequence.
 */
class sequence_cache {
 public:
  sequence_cache(context& ctx, std::int32_t seq) : ctx_{&ctx}, seq_{seq}
  {
    if (seq < 0 || seq >= ctx.scratch_sequence()) {
      throw engine_error("sequence_cache: sequence " + std::to_string(seq) +
                         " is not a serving sequence of this context (0 .. " +
                         std::to_string(ctx.scratch_sequence() - 1) + ")");
    }
  }

  std::vector<std::int64_t> allocate(std::int64_t first_position, std::int64_t tokens)
  {
    if (tokens <= 0 || first_position < 0 ||
        first_position > std::numeric_limits<std::int32_t>::max() - tokens ||
        tokens > static_cast<std::int64_t>(ctx_->options().n_ctx)) {
      throw engine_error("sequence_cache::allocate: " + std::to_string(tokens) +
                         " tokens at position " + std::to_string(first_position) +
                         " do not fit the context (" + std::to_string(ctx_->options().n_ctx) +
                         " cells)");
    }
    std::vector<std::int32_t> positions(static_cast<std::size_t>(tokens));
    for (std::int64_t j = 0; j < tokens; ++j) {
      positions[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(first_position + j);
    }
    make_state(ctx_->format(), ctx_->geometry(), seq_, positions, layout_, blob_);
    cache_ = describe_state(blob_.data(), layout_, ctx_->geometry());
    std::vector<std::int64_t> slots(static_cast<std::size_t>(tokens));
    for (std::int64_t j = 0; j < tokens; ++j) {
      slots[static_cast<std::size_t>(j)] = j;
    }
    staged_ = tokens;
    return slots;
  }

  paged_kv_cache const& cache() const noexcept { return cache_; }

  void commit(std::int64_t tokens)
  {
    if (tokens != staged_ || staged_ == 0) {
      throw engine_error("sequence_cache::commit: " + std::to_string(tokens) + " tokens, " +
                         std::to_string(staged_) + " staged");
    }
    ctx_->set_state(seq_, blob_);
    staged_ = 0;
  }

  /// A failed step: the staged blob is dropped (commit refuses it; the next allocate builds a
  /// new one); the sequence in llama.cpp was never touched.
  void release(std::int64_t) noexcept { staged_ = 0; }

  /// @brief The staged blob (for tests).
  std::vector<std::uint8_t> const& blob() const noexcept { return blob_; }

 private:
  context* ctx_;
  std::int32_t seq_;
  std::vector<std::uint8_t> blob_;
  state_layout layout_;
  paged_kv_cache cache_{};
  std::int64_t staged_{0};
};

static_assert(is_model_adapter_v<model_adapter>);
static_assert(has_encode_branches_v<model_adapter>);
static_assert(is_cache_adapter_v<sequence_cache>);

}  // namespace inferscale::llama_cpp
