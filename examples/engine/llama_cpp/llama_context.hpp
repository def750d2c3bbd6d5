/**
 * @file llama_context.hpp
 * @brief The context of the reference engine adapter: a llama_context with the few calls the
 * examples, tests and benchmarks need (decode at explicit positions, greedy generation, sequence
 * states), and pre-RoPE capture through llama.cpp's graph callback (`cb_eval`): each layer's
 * `Kcur-<l>` node that feeds the ROPE node (its input, checked against the ROPE node's `src[0]`)
 * and the `Vcur-<l>` node that feeds the cache write (the SET_ROWS node whose rows come from it,
 * through views and reshapes). Nodes are told apart by op and source, never by shape alone:
 * llama.cpp also names the 2-D V projection `Vcur-<l>`, and with one KV head and one token it has
 * the 3-D node's shape.
 *
 * Only architectures check_architecture() accepts are served (the constructor refuses the others,
 * naming them). The blob format the context expects (streams, V transposition, layer count, cell
 * types and row sizes) is read from the engine itself when the context is made (a one-token probe
 * in a scratch sequence), and every blob read or written is checked against it.
 */
#pragma once

#include "llama_model.hpp"
#include "llama_state.hpp"

#include <inferscale/dtype.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/kv_capture.hpp>
#include <inferscale/views.hpp>

#include <ggml-backend.h>
#include <ggml.h>
#include <llama.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

// ------------------------------------------------------------------------------------------------
// Context

/// @brief One layer's rotation as the engine's ROPE node of its keys holds it (ggml_rope_ext's
/// parameters, read by the context's probe).
struct layer_rope {
  std::int32_t n_dims{};  ///< rotated dims
  std::int32_t mode{};    ///< LLAMA_ROPE_TYPE_NORM (adjacent pairs) or _NEOX (halves)
  float freq_base{};      ///< the layer's rope base (Gemma 3: 10,000 sliding, 1e6 global)
  float freq_scale{};     ///< 1 / linear scaling factor
  float ext_factor{};     ///< YaRN's extrapolation mix (0: none)
  float attn_factor{};    ///< cos/sin multiplier

  bool operator==(layer_rope const& o) const noexcept
  {
    return n_dims == o.n_dims && mode == o.mode && freq_base == o.freq_base &&
           freq_scale == o.freq_scale && ext_factor == o.ext_factor && attn_factor == o.attn_factor;
  }
};

/// @brief How a context is made.
struct context_options {
  std::uint32_t n_ctx{2048};
  std::uint32_t n_batch{512};
  std::int32_t n_threads{1};   ///< one thread: 2 OpenMP threads on shared cores can collapse
  bool flash_attention{true};  ///< on: V rows as tokens; off: V stored transposed
  std::uint32_t n_seq_max{2};  ///< the last sequence is the adapter's scratch sequence
  /// Extra sequences (ids n_seq_max .. n_seq_max + n_branch_seq - 1) for model_adapter's
  /// encode_branches: that many facts branch off a trunk per forward; 0 = no branching.
  std::uint32_t n_branch_seq{0};
};

/**
 * @brief A llama_context with capture support (owner; not movable, the graph callback holds its
 * address).
 */
class context {
 public:
  context(model const& m, context_options const& options = {})
    : model_{supported(m)},
      architecture_{m.architecture().name},
      options_{options},
      geometry_{m.geometry()}
  {
    if (options.n_seq_max < 2) {
      throw engine_error("llama_cpp::context: n_seq_max must be at least 2 (one scratch sequence)");
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx                = options.n_ctx;
    params.n_batch              = options.n_batch;
    params.n_ubatch             = options.n_batch;
    if (options.n_seq_max + options.n_branch_seq > 256) {  // LLAMA_MAX_SEQ in llama-cparams.h
      throw engine_error("llama_cpp::context: n_seq_max + n_branch_seq = " +
                         std::to_string(options.n_seq_max + options.n_branch_seq) +
                         " exceeds llama.cpp's 256 sequences");
    }
    params.n_seq_max       = options.n_seq_max + options.n_branch_seq;
    params.n_threads       = options.n_threads;
    params.n_threads_batch = options.n_threads;
    params.flash_attn_type =
      options.flash_attention ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    params.kv_unified = true;
    // Sliding-window layers: a full-size second cache, so injected cells (and a branch's trunk)
    // are never evicted for room; attention still masks by position, as in a prefill.
    params.swa_full          = llama_model_n_swa(m.get()) > 0;
    params.cb_eval           = &context::eval_callback;
    params.cb_eval_user_data = this;
    params.no_perf           = true;
    ctx_.reset(llama_init_from_model(m.get(), params));
    if (!ctx_) { throw engine_error("llama_cpp::context: llama_init_from_model failed"); }
    probe_format();
  }
  context(context const&)            = delete;
  context& operator=(context const&) = delete;

  llama_context* get() const noexcept { return ctx_.get(); }
  model const& owner() const noexcept { return *model_; }
  kv_geometry geometry() const noexcept { return geometry_; }
  state_format const& format() const noexcept { return format_; }
  /// @brief Each layer's rotation, read from the engine's ROPE nodes when the context was made.
  std::vector<layer_rope> const& layer_rotations() const noexcept { return layer_rope_; }
  context_options const& options() const noexcept { return options_; }
  std::int32_t scratch_sequence() const noexcept
  {
    return static_cast<std::int32_t>(options_.n_seq_max) - 1;
  }

  /// @brief First of the options().n_branch_seq branch sequences.
  std::int32_t first_branch_sequence() const noexcept
  {
    return static_cast<std::int32_t>(options_.n_seq_max);
  }

  /// @brief Sequence `to` gets the cells of `from` at positions [p0, p1) (shared, not copied: the
  /// cache is unified).
  void copy_sequence(std::int32_t from, std::int32_t to, std::int64_t p0, std::int64_t p1)
  {
    llama_memory_seq_cp(llama_get_memory(ctx_.get()),
                        from,
                        to,
                        static_cast<llama_pos>(p0),
                        static_cast<llama_pos>(p1));
  }

  /**
   * @brief One llama_decode of tokens of several sequences: token i of `seqs[i]` at
   * `positions[i]` (at most n_batch tokens); logits for the last token only.
   * @throw engine_error if llama.cpp refuses the batch or the capture hook failed.
   */
  void decode_tokens(std::vector<std::int32_t> const& tokens,
                     std::vector<std::int64_t> const& positions,
                     std::vector<std::int32_t> const& seqs)
  {
    std::size_t const n = tokens.size();
    if (n == 0 || positions.size() != n || seqs.size() != n || n > options_.n_batch) {
      throw engine_error("llama_cpp::context::decode_tokens: " + std::to_string(n) +
                         " tokens (at most n_batch = " + std::to_string(options_.n_batch) +
                         ", one position and sequence each)");
    }
    llama_batch batch = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
    batch.n_tokens    = static_cast<std::int32_t>(n);
    for (std::size_t i = 0; i < n; ++i) {
      batch.token[i]     = tokens[i];
      batch.pos[i]       = static_cast<llama_pos>(positions[i]);
      batch.n_seq_id[i]  = 1;
      batch.seq_id[i][0] = seqs[i];
      batch.logits[i]    = i + 1 == n ? 1 : 0;
    }
    run_batch(batch, "a batch of " + std::to_string(n) + " tokens of several sequences");
  }

  /**
   * @brief One scheduler step's prefill: sequence `seqs[i]` takes `tokens[i]` from position
   * `positions[i]`, the sequences packed whole into as few llama_decode calls as n_batch allows,
   * with logits for each sequence's last token. Returns each sequence's greedy next token (lowest
   * id on ties): the step's first tokens.
   * @throw engine_error for mismatched lengths, an empty or over-n_batch sequence, or a failed
   *        decode.
   */
  std::vector<std::int32_t> decode_step(std::vector<std::vector<std::int32_t>> const& tokens,
                                        std::vector<std::int64_t> const& positions,
                                        std::vector<std::int32_t> const& seqs)
  {
    std::size_t const m = tokens.size();
    if (positions.size() != m || seqs.size() != m) {
      throw engine_error("llama_cpp::context::decode_step: " + std::to_string(m) +
                         " token lists, " + std::to_string(positions.size()) + " positions, " +
                         std::to_string(seqs.size()) + " sequences");
    }
    for (std::size_t i = 0; i < m; ++i) {
      if (tokens[i].empty() || tokens[i].size() > options_.n_batch) {
        throw engine_error("llama_cpp::context::decode_step: sequence " + std::to_string(seqs[i]) +
                           " has " + std::to_string(tokens[i].size()) +
                           " tokens (1 to n_batch = " + std::to_string(options_.n_batch) + ")");
      }
    }
    std::vector<std::int32_t> first(m);
    std::int32_t const vocab = model_->vocab_size();
    std::size_t i            = 0;
    while (i < m) {
      std::size_t end = i, n = 0;  // the sequences [i, end) fit one batch
      while (end < m && n + tokens[end].size() <= options_.n_batch) {
        n += tokens[end++].size();
      }
      llama_batch batch = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
      batch.n_tokens    = static_cast<std::int32_t>(n);
      std::vector<std::int32_t> last;  // the batch index of each sequence's last token
      std::size_t t = 0;
      for (std::size_t s = i; s < end; ++s) {
        for (std::size_t j = 0; j < tokens[s].size(); ++j, ++t) {
          batch.token[t]     = tokens[s][j];
          batch.pos[t]       = static_cast<llama_pos>(positions[s] + static_cast<std::int64_t>(j));
          batch.n_seq_id[t]  = 1;
          batch.seq_id[t][0] = seqs[s];
          batch.logits[t]    = j + 1 == tokens[s].size() ? 1 : 0;
        }
        last.push_back(static_cast<std::int32_t>(t - 1));
      }
      run_batch(
        batch,
        "a step of " + std::to_string(end - i) + " sequences (" + std::to_string(n) + " tokens)");
      for (std::size_t s = i; s < end; ++s) {
        float const* l = llama_get_logits_ith(ctx_.get(), last[s - i]);
        if (!l) { throw engine_error("llama_cpp::context::decode_step: no logits"); }
        first[s] = static_cast<std::int32_t>(std::max_element(l, l + vocab) - l);
      }
      i = end;
    }
    return first;
  }

  /// @brief Removes the cells of `seq` at positions [p0, p1).
  void remove(std::int32_t seq, std::int64_t p0, std::int64_t p1)
  {
    if (!llama_memory_seq_rm(llama_get_memory(ctx_.get()),
                             seq,
                             static_cast<llama_pos>(p0),
                             static_cast<llama_pos>(p1))) {
      throw engine_error("llama_memory_seq_rm refused positions [" + std::to_string(p0) + ", " +
                         std::to_string(p1) + ") of sequence " + std::to_string(seq));
    }
  }

  /// @brief Removes every cell of sequence `seq`.
  void clear(std::int32_t seq) { llama_memory_seq_rm(llama_get_memory(ctx_.get()), seq, -1, -1); }

  /// @brief Highest position held by `seq` (-1 when empty).
  std::int32_t max_position(std::int32_t seq) const
  {
    return llama_memory_seq_pos_max(llama_get_memory(ctx_.get()), seq);
  }

  /**
   * @brief Runs `tokens` of sequence `seq` at positions `first_position ..` (one llama_decode,
   * split into ubatches by llama.cpp); logits are kept for the last token.
   * @throw engine_error if llama.cpp refuses the batch or the capture hook failed.
   */
  void decode(std::int32_t seq,
              std::vector<std::int32_t> const& tokens,
              std::int64_t first_position)
  {
    if (tokens.empty()) { throw engine_error("llama_cpp::context::decode: no tokens"); }
    std::size_t done = 0;
    while (done < tokens.size()) {
      std::size_t const n = std::min<std::size_t>(tokens.size() - done, options_.n_batch);
      llama_batch batch   = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
      batch.n_tokens      = static_cast<std::int32_t>(n);
      for (std::size_t i = 0; i < n; ++i) {
        batch.token[i] = tokens[done + i];
        batch.pos[i] = static_cast<llama_pos>(first_position + static_cast<std::int64_t>(done + i));
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i]    = (done + i + 1 == tokens.size()) ? 1 : 0;
      }
      run_batch(batch,
                std::to_string(n) + " tokens of sequence " + std::to_string(seq) + " at position " +
                  std::to_string(first_position + static_cast<std::int64_t>(done)));
      done += n;
    }
  }

  /**
   * @brief Runs `tokens` of `seq` at `first_position ..` (at most n_batch tokens, one
   * llama_decode) and returns the logits after each of the last `last_n` of them (oldest first):
   * row i predicts the token after `tokens[size - last_n + i]`.
   */
  std::vector<std::vector<float>> decode_logits(std::int32_t seq,
                                                std::vector<std::int32_t> const& tokens,
                                                std::int64_t first_position,
                                                std::size_t last_n)
  {
    std::size_t const n = tokens.size();
    if (n == 0 || n > options_.n_batch || last_n == 0 || last_n > n) {
      throw engine_error("llama_cpp::context::decode_logits: " + std::to_string(n) +
                         " tokens (1 .. n_batch = " + std::to_string(options_.n_batch) +
                         "), logits for the last " + std::to_string(last_n));
    }
    llama_batch batch = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
    batch.n_tokens    = static_cast<std::int32_t>(n);
    for (std::size_t i = 0; i < n; ++i) {
      batch.token[i]     = tokens[i];
      batch.pos[i]       = static_cast<llama_pos>(first_position + static_cast<std::int64_t>(i));
      batch.n_seq_id[i]  = 1;
      batch.seq_id[i][0] = seq;
      batch.logits[i]    = i + last_n >= n ? 1 : 0;
    }
    run_batch(batch, std::to_string(n) + " tokens of sequence " + std::to_string(seq));
    std::vector<std::vector<float>> out;
    for (std::size_t i = n - last_n; i < n; ++i) {
      float const* l = llama_get_logits_ith(ctx_.get(), static_cast<std::int32_t>(i));
      if (!l) { throw engine_error("llama_cpp::context::decode_logits: no logits"); }
      out.emplace_back(l, l + model_->vocab_size());
    }
    return out;
  }

  /// @brief Removes the cells of `seq` at positions >= `from`.
  void truncate(std::int32_t seq, std::int64_t from)
  {
    llama_memory_seq_rm(llama_get_memory(ctx_.get()), seq, static_cast<llama_pos>(from), -1);
  }

  /// @brief Logits of the last decoded token (a copy).
  std::vector<float> last_logits() const
  {
    float const* l = llama_get_logits_ith(ctx_.get(), -1);
    if (!l) { throw engine_error("llama_cpp::context: no logits"); }
    return {l, l + model_->vocab_size()};
  }

  /// @brief The highest-scoring token of the last decoded token's logits (lowest id on ties).
  std::int32_t greedy_token() const
  {
    float const* l = llama_get_logits_ith(ctx_.get(), -1);
    if (!l) { throw engine_error("llama_cpp::context: no logits"); }
    std::int32_t const n = model_->vocab_size();
    return static_cast<std::int32_t>(std::max_element(l, l + n) - l);
  }

  /**
   * @brief Greedy generation after a prefill: takes the token the last logits choose, decodes it at
   * `next_position`, and so on, `max_tokens` tokens or (with `stop_at_end`) until an
   * end-of-generation token.
   * @param logits_out if given, receives each step's logits (before choosing).
   */
  std::vector<std::int32_t> generate(std::int32_t seq,
                                     std::int64_t next_position,
                                     std::int32_t max_tokens,
                                     std::vector<std::vector<float>>* logits_out = nullptr,
                                     bool stop_at_end                            = true)
  {
    std::vector<std::int32_t> out;
    for (std::int32_t i = 0; i < max_tokens; ++i) {
      if (logits_out) { logits_out->push_back(last_logits()); }
      std::int32_t const token = greedy_token();
      out.push_back(token);
      if (stop_at_end && model_->is_end_of_generation(token)) { break; }
      decode(seq, {token}, next_position + i);
    }
    return out;
  }

  /// @brief The sequence-state blob of `seq` (llama_state_seq_get_data).
  std::vector<std::uint8_t> state(std::int32_t seq) const
  {
    std::size_t const n = llama_state_seq_get_size(ctx_.get(), seq);
    std::vector<std::uint8_t> out(n);
    if (n == 0 || llama_state_seq_get_data(ctx_.get(), out.data(), n, seq) != n) {
      throw engine_error("llama_state_seq_get_data failed for sequence " + std::to_string(seq));
    }
    return out;
  }

  /**
   * @brief Replaces sequence `seq` with a blob after checking it against the context's format;
   * a refused blob leaves the context unchanged.
   * @throw engine_error if the blob is malformed, of another format, or llama.cpp refuses it.
   */
  void set_state(std::int32_t seq, std::vector<std::uint8_t> const& blob)
  {
    (void)parse_state(blob.data(), blob.size(), geometry_, &format_);
    if (llama_state_seq_set_data(ctx_.get(), blob.data(), blob.size(), seq) != blob.size()) {
      throw engine_error("llama_state_seq_set_data refused the blob for sequence " +
                         std::to_string(seq));
    }
  }

  /// @brief While set, the graph callback copies pre-RoPE K and V of every forward into it, the
  /// first token of the next forward to row `first_row`, the following ones after it.
  void begin_capture(kv_capture& capture, std::int64_t first_row = 0)
  {
    if (!(capture.geometry() == geometry_)) {
      throw engine_error("llama_cpp capture: the buffer's geometry differs from the model's");
    }
    capture_ = &capture;
    key_tokens_.assign(static_cast<std::size_t>(geometry_.num_layers), first_row);
    value_tokens_.assign(static_cast<std::size_t>(geometry_.num_layers), first_row);
    last_key_.assign(static_cast<std::size_t>(geometry_.num_layers), nullptr);
    pending_keys_.assign(static_cast<std::size_t>(geometry_.num_layers), 0);
    last_value_.assign(static_cast<std::size_t>(geometry_.num_layers), nullptr);
    pending_values_.assign(static_cast<std::size_t>(geometry_.num_layers), 0);
    capture_error_.clear();
  }
  void end_capture() noexcept { capture_ = nullptr; }

  /**
   * @brief The pre-RoPE K and V of layer `layer` for `tokens` run in sequence `seq` at positions
   * `first_position ..` (they see the cells `seq` holds below them), from a forward stopped as
   * soon as that layer's K and V are computed: the cost of `layer + 1` of the model's layers.
   * Rows are `[tokens, kv heads, head_dim]`, token-major. The cells the stopped forwards leave
   * hold layers 0 .. layer only: `seq` must be a scratch sequence the caller clears afterwards.
   * @throw engine_error if a capture is active, `layer` is outside the model, or as decode().
   */
  void probe_layer(std::int32_t seq,
                   std::vector<std::int32_t> const& tokens,
                   std::int64_t first_position,
                   std::int32_t layer,
                   std::vector<float>& keys,
                   std::vector<float>& values)
  {
    if (capture_) { throw engine_error("llama_cpp::context::probe_layer: a capture is active"); }
    if (layer < 0 || layer >= geometry_.num_layers) {
      throw engine_error("llama_cpp::context::probe_layer: layer " + std::to_string(layer) +
                         " outside the model's " + std::to_string(geometry_.num_layers));
    }
    std::size_t const row = static_cast<std::size_t>(geometry_.elements_per_token_layer());
    keys.assign(tokens.size() * row, 0.0f);
    values.assign(tokens.size() * row, 0.0f);
    probe_ = probe_state{layer, &keys, &values, 0, 0, nullptr};
    capture_error_.clear();
    try {
      decode(seq, tokens, first_position);
    } catch (...) {
      probe_.reset();
      throw;
    }
    bool const whole = probe_->key_rows == static_cast<std::int64_t>(tokens.size()) &&
                       probe_->value_rows == static_cast<std::int64_t>(tokens.size());
    probe_.reset();
    if (!whole) {
      throw engine_error("llama_cpp::context::probe_layer: the graph did not yield Kcur-" +
                         std::to_string(layer) + " and Vcur-" + std::to_string(layer) +
                         " for every token");
    }
  }

 private:
  /// @brief What probe_format reads off the ROPE nodes: per layer its parameters and its output
  /// for the probe token (empty where the node was not seen).
  struct rope_probe {
    std::vector<layer_rope> rope;
    std::vector<std::vector<float>> keys;
  };

  /// @brief `m`, once check_architecture accepts it (before anything else reads the model).
  static model const* supported(model const& m)
  {
    check_architecture(m.architecture());
    return &m;
  }

  /// @brief llama_decode of `batch` (freed here).
  /// @throw engine_error if the capture hook failed or llama.cpp refused `what`.
  void run_batch(llama_batch batch, std::string const& what)
  {
    std::int32_t const rc = llama_decode(ctx_.get(), batch);
    llama_batch_free(batch);
    if (!capture_error_.empty()) {
      std::string const e = capture_error_;
      capture_error_.clear();
      throw engine_error("llama_cpp capture: " + e);
    }
    if (rc != 0) {
      throw engine_error("llama_decode returned " + std::to_string(rc) + " for " + what);
    }
  }

  /**
   * @brief One token at position 0 in the scratch sequence, to read off the engine: the blob's
   * format; each layer's ROPE parameters (ggml_rope_ext's op_params); and, for a blob of several
   * sections (sliding-window layers), which model layer each of its layer records holds: at
   * position 0 the rotation is the identity, so the record whose K row equals layer l's ROPE
   * output (to the cell type's rounding) is layer l's.
   */
  void probe_format()
  {
    std::int32_t const seq   = scratch_sequence();
    std::int32_t const bos   = llama_vocab_bos(model_->vocab());
    std::size_t const layers = static_cast<std::size_t>(geometry_.num_layers);
    rope_probe_.emplace();
    rope_probe_->rope.assign(layers, layer_rope{});
    rope_probe_->keys.assign(layers, {});
    try {
      decode(seq, {bos >= 0 ? bos : 0}, 0);
    } catch (...) {
      rope_probe_.reset();
      throw;
    }
    rope_probe probe = std::move(*rope_probe_);
    rope_probe_.reset();
    std::vector<std::uint8_t> const blob = state(seq);
    clear(seq);
    state_layout const layout = parse_state(blob.data(), blob.size(), geometry_);
    format_                   = layout.format;
    if (format_.k_type != format_.v_type) {
      throw engine_error("llama_cpp::context: K and V cells of different types");
    }
    for (std::size_t l = 0; l < layers; ++l) {
      if (probe.keys[l].empty()) {
        throw engine_error("llama_cpp::context: architecture '" + architecture_ + "', layer " +
                           std::to_string(l) + ": no ROPE node named Kcur-" + std::to_string(l) +
                           " rotates its keys; refused");
      }
    }
    layer_rope_ = probe.rope;
    if (format_.section_layers.size() > 1) {
      format_.layer_order =
        match_state_layers(blob.data(),
                           layout,
                           geometry_,
                           probe.keys,
                           "llama_cpp::context: architecture '" + architecture_ + "'");
    }
  }

  /// @brief Layer number of a node named `<prefix>-<l>`, or -1.
  static int layer_of(char const* name, char const* prefix)
  {
    std::size_t const n = std::strlen(prefix);
    if (std::strncmp(name, prefix, n) != 0 || name[n] != '-') { return -1; }
    char* end    = nullptr;
    long const l = std::strtol(name + n + 1, &end, 10);
    return (end && *end == '\0' && end != name + n + 1) ? static_cast<int>(l) : -1;
  }

  /// @brief A node whose data may be a layer's K or V rows, `[head_dim, kv heads, tokens]` in
  /// fp32. Shape only: which such node holds the rows the cache stores is decided by source (the
  /// ROPE node's input for K, the cache write's for V).
  bool is_head_view(ggml_tensor const* t) const noexcept
  {
    return t->type == GGML_TYPE_F32 && t->ne[0] == geometry_.head_dim &&
           t->ne[1] == geometry_.num_kv_heads && t->ne[3] == 1;
  }

  /// @brief The ops that move or pad data without computing (between a V node and the cache).
  static bool moves_data(ggml_op op) noexcept
  {
    return op == GGML_OP_VIEW || op == GGML_OP_RESHAPE || op == GGML_OP_CONT ||
           op == GGML_OP_PERMUTE || op == GGML_OP_TRANSPOSE || op == GGML_OP_PAD ||
           op == GGML_OP_CPY;
  }

  /// @brief What a cache write stores, for a SET_ROWS node: the first named node its rows come
  /// from through data moves (`src[0]` is SET_ROWS's rows, `src[2]` its destination).
  struct stored_node {
    ggml_tensor const* node{nullptr};  ///< the `Vcur-<l>` node, or the node the rows came from
    int layer{-1};                     ///< l of `Vcur-<l>`; -1 when the rows are not V's
    bool unsupported{false};           ///< V rows from an op other than `Vcur-<l>` (a V norm)
  };

  static stored_node stored_rows(ggml_tensor const* t) noexcept
  {
    if (t->op != GGML_OP_SET_ROWS) { return {}; }
    ggml_tensor const* s = t->src[0];
    for (int depth = 0; s != nullptr && depth < 8; ++depth) {
      int const l = layer_of(s->name, "Vcur");
      if (l >= 0) { return {s, l, false}; }
      if (!moves_data(s->op)) {
        // llama.cpp names a V norm's output `Vcur_normed-<l>` (gemma3n): not the V captured
        return {s, -1, std::strncmp(s->name, "Vcur", 4) == 0};
      }
      s = s->src[0];
    }
    return {};
  }

  static bool eval_callback(ggml_tensor* t, bool ask, void* user)
  {
    auto* self = static_cast<context*>(user);
    if (self->rope_probe_) { return self->on_rope_probe(t, ask); }
    if (self->probe_) { return self->on_probe(t, ask); }
    if (!self->capture_) { return ask ? false : true; }
    return self->on_tensor(t, ask);
  }

  /// @brief probe_format's hook: each layer's ROPE node of its keys, its parameters and output.
  bool on_rope_probe(ggml_tensor* t, bool ask)
  {
    int const l = layer_of(ggml_get_name(t), "Kcur");
    if (l < 0 || l >= geometry_.num_layers || t->op != GGML_OP_ROPE) { return ask ? false : true; }
    if (ask) { return true; }
    std::size_t const layer = static_cast<std::size_t>(l);
    layer_rope r;
    std::memcpy(&r.n_dims, reinterpret_cast<char const*>(t->op_params) + 4, 4);
    std::memcpy(&r.mode, reinterpret_cast<char const*>(t->op_params) + 8, 4);
    std::memcpy(&r.freq_base, reinterpret_cast<char const*>(t->op_params) + 20, 4);
    std::memcpy(&r.freq_scale, reinterpret_cast<char const*>(t->op_params) + 24, 4);
    std::memcpy(&r.ext_factor, reinterpret_cast<char const*>(t->op_params) + 28, 4);
    std::memcpy(&r.attn_factor, reinterpret_cast<char const*>(t->op_params) + 32, 4);
    rope_probe_->rope[layer] = r;
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) &&
        ggml_nelements(t) == geometry_.elements_per_token_layer()) {
      rope_probe_->keys[layer].resize(static_cast<std::size_t>(ggml_nelements(t)));
      ggml_backend_tensor_get(t, rope_probe_->keys[layer].data(), 0, ggml_nbytes(t));
    }
    return true;
  }

  /// @brief probe_layer's hook: takes the layer's K and V, then stops the graph.
  bool on_probe(ggml_tensor* t, bool ask)
  {
    if (t->op == GGML_OP_SET_ROWS) {
      if (!ask) { return false; }  // observed only to stop the graph (or on an error)
      stored_node const v = stored_rows(t);
      if (v.unsupported) {
        capture_error_ = std::string{"the cache stores "} + v.node->name + ", not a Vcur node";
        return true;
      }
      if (v.layer != probe_->layer) { return false; }
      if (v.node != probe_->last_value) {
        capture_error_ =
          "layer " + std::to_string(probe_->layer) + ": the V probed is not the V the cache stores";
        return true;
      }
      probe_->value_rows += probe_->pending_value_rows;  // the V taken is the one stored
      probe_->pending_value_rows = 0;
      // Observed only to stop the graph once this forward's K and V are both taken.
      return probe_->key_rows == probe_->value_rows;
    }
    char const* name = ggml_get_name(t);
    bool const k     = key_layer(name) == probe_->layer;
    bool const v     = layer_of(name, "Vcur") == probe_->layer;
    if (!k && !v) { return ask ? false : true; }
    if (ask) {
      if (k && t->op == GGML_OP_ROPE) {
        if (t->src[0] != probe_->last_key) {
          capture_error_ = "layer " + std::to_string(probe_->layer) +
                           ": the K probed is not the input of the ROPE node";
          return true;
        }
        probe_->key_rows += probe_->pending_key_rows;  // the K taken is the ROPE node's input
        probe_->pending_key_rows = 0;
        // Observed only to stop the graph once this forward's K and V are both taken.
        return probe_->key_rows == probe_->value_rows;
      }
      return t->op != GGML_OP_ROPE && is_head_view(t);
    }
    if (!capture_error_.empty()) { return false; }
    if (k && t->op == GGML_OP_ROPE) { return false; }  // K and V taken: stop the graph
    if (!ggml_is_contiguous(t)) {
      capture_error_ = std::string{name} + " is not contiguous";
      return false;
    }
    std::int64_t const rows = k ? probe_->key_rows : probe_->value_rows;
    std::vector<float>& to  = k ? *probe_->keys : *probe_->values;
    std::size_t const row   = static_cast<std::size_t>(geometry_.elements_per_token_layer());
    std::size_t const n     = static_cast<std::size_t>(t->ne[2]);
    if ((static_cast<std::size_t>(rows) + n) * row > to.size()) {
      capture_error_ = std::string{name} + ": more rows than tokens probed";
      return false;
    }
    // A later node of the same name (K norm's output; the 3-D V after the 2-D projection)
    // overwrites the rows; they count once the ROPE node (K) or the cache write (V) shows which
    // node it takes.
    ggml_backend_tensor_get(t, to.data() + static_cast<std::size_t>(rows) * row, 0, ggml_nbytes(t));
    if (k) {
      probe_->last_key         = t;
      probe_->pending_key_rows = static_cast<std::int64_t>(n);
    } else {
      probe_->last_value         = t;
      probe_->pending_value_rows = static_cast<std::int64_t>(n);
    }
    return true;
  }

  /// @brief The layer of a pre-RoPE key node: `Kcur-<l>`, or `Kcur_normed-<l>` (a per-head K norm
  /// before the ROPE node: gemma3, qwen3, olmo2), or -1.
  static int key_layer(char const* name)
  {
    int const normed = layer_of(name, "Kcur_normed");
    return normed >= 0 ? normed : layer_of(name, "Kcur");
  }

  bool on_tensor(ggml_tensor* t, bool ask)
  {
    if (t->op == GGML_OP_SET_ROWS) {
      if (!ask) { return capture_error_.empty(); }  // observed only on an error: stop
      confirm_values(t);
      return !capture_error_.empty();
    }
    char const* name = ggml_get_name(t);
    int const k      = key_layer(name);
    int const v      = layer_of(name, "Vcur");
    int const layer  = k >= 0 ? k : v;
    if (layer < 0 || layer >= geometry_.num_layers) { return ask ? false : true; }
    if (ask) {
      if (k >= 0 && t->op == GGML_OP_ROPE) {
        // The ROPE node's input must be the K we took for this layer (after its norm, if any):
        // only then do its rows count.
        std::size_t const kl = static_cast<std::size_t>(k);
        if (t->src[0] != last_key_[kl]) {
          capture_error_ = "architecture '" + architecture_ + "', layer " + std::to_string(k) +
                           ": the K captured is not the input of the ROPE node (an op other "
                           "than a K norm named Kcur_normed sits between them): not supported";
          return true;  // asked, so the callback below can stop the graph
        }
        key_tokens_[kl] += pending_keys_[kl];
        pending_keys_[kl] = 0;
        return false;
      }
      return t->op != GGML_OP_ROPE && is_head_view(t);
    }
    if (!capture_error_.empty()) { return false; }  // stop the graph
    try {
      if (!ggml_is_contiguous(t)) {
        capture_error_ = std::string{name} + " is not contiguous";
        return false;
      }
      std::int64_t const tokens = t->ne[2];
      std::vector<float> buf(static_cast<std::size_t>(ggml_nelements(t)));
      ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
      auto const rows = make_token_head_view<float const>(
        buf.data(), tokens, geometry_.num_kv_heads, geometry_.head_dim);
      std::size_t const at = static_cast<std::size_t>(layer);
      if (k >= 0) {
        // A K norm's output overwrites the un-normed rows; they count at the ROPE node.
        capture_->write_keys(layer, key_tokens_[at], rows);
        last_key_[at]     = t;
        pending_keys_[at] = tokens;
      } else {
        // The 3-D V overwrites the 2-D projection's rows (both Vcur-<l>, and of one shape for one
        // token and one KV head); they count at the cache write (confirm_values).
        capture_->write_values(layer, value_tokens_[at], rows);
        last_value_[at]     = t;
        pending_values_[at] = tokens;
      }
    } catch (std::exception const& e) {
      capture_error_ = e.what();
      return false;
    }
    return true;
  }

  /// @brief At a cache write of layer l's V: the V rows taken count if the node written is the
  /// last `Vcur-<l>` taken (the same rule as the keys' at the ROPE node).
  void confirm_values(ggml_tensor const* t)
  {
    stored_node const v = stored_rows(t);
    if (v.unsupported) {
      capture_error_ = "architecture '" + architecture_ + "': the cache stores " + v.node->name +
                       ", not a Vcur node (an op such as a V norm after it): not supported";
      return;
    }
    if (v.layer < 0 || v.layer >= geometry_.num_layers) { return; }  // K, or no layer of ours
    std::size_t const l = static_cast<std::size_t>(v.layer);
    if (v.node != last_value_[l]) {
      capture_error_ = "architecture '" + architecture_ + "', layer " + std::to_string(v.layer) +
                       ": the V the cache stores is not the Vcur node captured: not supported";
      return;
    }
    value_tokens_[l] += pending_values_[l];
    pending_values_[l] = 0;
  }

  struct deleter {
    void operator()(llama_context* c) const noexcept { llama_free(c); }
  };
  model const* model_;
  std::string architecture_;
  context_options options_;
  kv_geometry geometry_;
  state_format format_{};
  std::unique_ptr<llama_context, deleter> ctx_;
  kv_capture* capture_{nullptr};
  struct probe_state {
    std::int32_t layer;
    std::vector<float>* keys;
    std::vector<float>* values;
    std::int64_t key_rows;
    std::int64_t value_rows;
    ggml_tensor const* last_key;
    std::int64_t pending_key_rows{0};
    ggml_tensor const* last_value{nullptr};
    std::int64_t pending_value_rows{0};
  };
  std::optional<probe_state> probe_;
  std::optional<rope_probe> rope_probe_;
  std::vector<layer_rope> layer_rope_;
  std::vector<std::int64_t> key_tokens_;
  std::vector<std::int64_t> value_tokens_;
  std::vector<std::int64_t> pending_keys_;  ///< rows taken, counted once the ROPE node confirms
  std::vector<ggml_tensor const*> last_key_;
  std::vector<std::int64_t> pending_values_;  ///< rows taken, counted once the cache write confirms
  std::vector<ggml_tensor const*> last_value_;
  std::string capture_error_;
};

}  // namespace inferscale::llama_cpp
