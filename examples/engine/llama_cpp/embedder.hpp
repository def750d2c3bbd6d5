/**
 * @file embedder.hpp
 * @brief A sentence embedder on llama.cpp: a BERT-architecture GGUF (all-MiniLM-L6-v2 as
 * converted by minilm_gguf.py) run with `embeddings = true` and mean pooling, each result
 * L2-normalised — what sentence-transformers' Transformer → Pooling(mean) → Normalize computes.
 *
 * Text is tokenized by llama.cpp's WordPiece with the special tokens added ([CLS] ... [SEP]). A
 * BERT encoder attends over the whole sequence at once, so a text must fit in one batch of the
 * context: a longer one is refused, never truncated.
 */
#pragma once

#include "llama_adapter.hpp"

#include <llama.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

/// @brief Knobs of an embedder's llama.cpp context.
struct embedder_options {
  std::uint32_t n_ctx{512};   ///< tokens per text, [CLS] and [SEP] included (at most n_ctx_train)
  std::int32_t n_threads{1};  ///< one thread: 2 OpenMP threads on shared cores can collapse
  /// Tokens one forward of embed(texts) holds (its texts packed whole, each its own sequence):
  /// at least n_ctx, so any accepted text fits a forward alone.
  std::uint32_t n_batch{2048};
  /// Texts one forward of embed(texts) holds (llama.cpp sequences, at most 256).
  std::uint32_t n_seq_max{64};
};

/**
 * @brief Mean-pooled, L2-normalised sentence embeddings from a BERT GGUF (owner of one
 * llama_context; move-only). The model must outlive the embedder.
 */
class embedder {
 public:
  /**
   * @brief Makes the embedding context for `m`.
   * @param[in] m a loaded BERT-architecture GGUF (`general.architecture = bert`)
   * @param[in] options context size and threads
   * @throw engine_error if the model is not a BERT embedding model, its GGUF asks for a pooling
   * other than mean, n_ctx is 0 or beyond the model's trained context, or llama.cpp refuses the
   * context.
   */
  explicit embedder(model const& m, embedder_options const& options = {})
    : model_{&m}, options_{options}
  {
    std::string const arch = m.meta("general.architecture").value_or("");
    if (arch != "bert") {
      throw engine_error("llama_cpp::embedder: the model's architecture is '" + arch +
                         "', not a BERT embedding model (general.architecture = bert, e.g. "
                         "all-MiniLM-L6-v2 from minilm_gguf.py)");
    }
    if (auto const pooling = m.meta("bert.pooling_type"); pooling && *pooling != "1") {
      throw engine_error("llama_cpp::embedder: the GGUF's bert.pooling_type is " + *pooling +
                         "; this embedder mean-pools (1)");
    }
    std::int32_t const n_ctx_train = llama_model_n_ctx_train(m.get());
    if (options.n_ctx == 0 || options.n_ctx > static_cast<std::uint32_t>(n_ctx_train)) {
      throw engine_error("llama_cpp::embedder: n_ctx " + std::to_string(options.n_ctx) +
                         " must be in 1.." + std::to_string(n_ctx_train) +
                         " (the model's position embeddings)");
    }
    if (options.n_batch < options.n_ctx || options.n_seq_max < 1 || options.n_seq_max > 256) {
      throw engine_error("llama_cpp::embedder: n_batch " + std::to_string(options.n_batch) +
                         " must be at least n_ctx " + std::to_string(options.n_ctx) +
                         ", and n_seq_max " + std::to_string(options.n_seq_max) + " in 1..256");
    }
    if (options.n_threads < 1) {
      throw engine_error("llama_cpp::embedder: n_threads must be at least 1");
    }
    dimension_ = llama_model_n_embd_out(m.get());

    llama_context_params params = llama_context_default_params();
    // the encoder sees each forward's texts whole, in one micro-batch (non-causal attention)
    params.n_ctx           = options.n_batch;
    params.n_batch         = options.n_batch;
    params.n_ubatch        = options.n_batch;
    params.n_seq_max       = options.n_seq_max;
    params.kv_unified      = true;  // a text may use the whole context, not n_ctx / n_seq_max
    params.n_threads       = options.n_threads;
    params.n_threads_batch = options.n_threads;
    params.embeddings      = true;
    params.pooling_type    = LLAMA_POOLING_TYPE_MEAN;
    ctx_.reset(llama_init_from_model(m.get(), params));
    if (!ctx_) { throw engine_error("llama_cpp::embedder: llama_init_from_model failed"); }
    if (llama_pooling_type(ctx_.get()) != LLAMA_POOLING_TYPE_MEAN) {
      throw engine_error("llama_cpp::embedder: llama.cpp did not take mean pooling");
    }
  }

  /// @brief Values per embedding (384 for all-MiniLM-L6-v2).
  std::int32_t dimension() const noexcept { return dimension_; }

  /// @brief The most tokens one text may have, [CLS] and [SEP] included.
  std::int32_t max_tokens() const noexcept { return static_cast<std::int32_t>(options_.n_ctx); }

  /**
   * @brief Token ids of `text` as the embedder feeds them: [CLS], the WordPiece tokens (lower-cased
   * and accents stripped when the GGUF says so), [SEP]. Special tokens written in the text, such
   * as "[SEP]", are parsed as such (as Hugging Face's tokenizer does).
   * @throw engine_error if llama.cpp's tokenizer fails.
   */
  std::vector<std::int32_t> tokenize(std::string const& text) const
  {
    auto const length = static_cast<std::int32_t>(text.size());
    std::int32_t const n =
      -llama_tokenize(model_->vocab(), text.data(), length, nullptr, 0, true, true);
    std::vector<llama_token> out(static_cast<std::size_t>(n > 0 ? n : 0));
    if (n <= 0 ||
        llama_tokenize(model_->vocab(), text.data(), length, out.data(), n, true, true) != n) {
      throw engine_error("llama_cpp::embedder: tokenization failed");
    }
    return {out.begin(), out.end()};
  }

  /**
   * @brief The unit-length, mean-pooled embedding of `text`.
   * @return dimension() values with L2 norm 1
   * @throw engine_error for empty text, a text of more than max_tokens() tokens (the message
   * gives both counts), a failed decode, or an output that is not finite or is zero.
   */
  std::vector<float> embed(std::string const& text)
  {
    std::vector<std::vector<std::int32_t>> tokens{checked_tokens(text)};
    return std::move(forward(tokens, 0, 1).front());
  }

  /**
   * @brief embed() of each text, in order, the texts packed whole into forwards of at most
   * n_batch tokens and n_seq_max texts (each text its own sequence: attention and the mean stay
   * within it): a scheduler step's queries in one forward. (On one CPU thread that costs what one
   * forward per text costs: the forward is compute-bound.) Every text is checked before any
   * forward runs.
   * @throw engine_error as embed(), naming the index of the text refused.
   */
  std::vector<std::vector<float>> embed(std::vector<std::string> const& texts)
  {
    std::vector<std::vector<std::int32_t>> tokens;
    tokens.reserve(texts.size());
    for (std::size_t i = 0; i < texts.size(); ++i) {
      try {
        tokens.push_back(checked_tokens(texts[i]));
      } catch (engine_error const& e) {
        throw engine_error("text " + std::to_string(i) + ": " + e.what());
      }
    }
    std::vector<std::vector<float>> out;
    out.reserve(texts.size());
    std::size_t first = 0;
    while (first < tokens.size()) {
      std::size_t end = first, n = 0;  // texts [first, end) fill one forward
      while (end < tokens.size() && end - first < options_.n_seq_max &&
             n + tokens[end].size() <= options_.n_batch) {
        n += tokens[end++].size();
      }
      try {
        for (auto& v : forward(tokens, first, end)) {
          out.push_back(std::move(v));
        }
      } catch (engine_error const& e) {
        throw engine_error("texts " + std::to_string(first) + ".." + std::to_string(end - 1) +
                           ": " + e.what());
      }
      first = end;
    }
    return out;
  }

 private:
  /// The tokens of `text`, refused when empty or longer than n_ctx.
  std::vector<std::int32_t> checked_tokens(std::string const& text) const
  {
    if (text.empty()) { throw engine_error("llama_cpp::embedder: cannot embed an empty text"); }
    std::vector<std::int32_t> tokens = tokenize(text);
    if (tokens.size() > options_.n_ctx) {
      throw engine_error("llama_cpp::embedder: the text has " + std::to_string(tokens.size()) +
                         " tokens ([CLS] and [SEP] included), more than the " +
                         std::to_string(options_.n_ctx) +
                         " the context holds; split it (texts are never truncated)");
    }
    return tokens;
  }

  /// One forward of texts [first, end) of `tokens` (sequence s - first each, positions from 0):
  /// their mean-pooled, L2-normalised embeddings.
  std::vector<std::vector<float>> forward(std::vector<std::vector<std::int32_t>> const& tokens,
                                          std::size_t first,
                                          std::size_t end)
  {
    if (llama_memory_t memory = llama_get_memory(ctx_.get())) { llama_memory_clear(memory, true); }
    std::size_t n = 0;
    for (std::size_t t = first; t < end; ++t) {
      n += tokens[t].size();
    }
    llama_batch batch = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
    std::size_t j     = 0;
    for (std::size_t t = first; t < end; ++t) {
      for (std::size_t i = 0; i < tokens[t].size(); ++i, ++j) {
        batch.token[j]     = tokens[t][i];
        batch.pos[j]       = static_cast<llama_pos>(i);
        batch.n_seq_id[j]  = 1;
        batch.seq_id[j][0] = static_cast<llama_seq_id>(t - first);
        batch.logits[j]    = 1;  // every token's output enters its text's mean
      }
    }
    batch.n_tokens        = static_cast<std::int32_t>(n);
    std::int32_t const rc = llama_decode(ctx_.get(), batch);
    llama_batch_free(batch);
    if (rc != 0) {
      throw engine_error("llama_cpp::embedder: llama_decode failed (" + std::to_string(rc) +
                         ") on " + std::to_string(end - first) + " text(s) of " +
                         std::to_string(n) + " tokens");
    }
    std::vector<std::vector<float>> out;
    for (std::size_t t = first; t < end; ++t) {
      float const* pooled =
        llama_get_embeddings_seq(ctx_.get(), static_cast<llama_seq_id>(t - first));
      if (!pooled) { throw engine_error("llama_cpp::embedder: llama.cpp returned no embedding"); }
      std::vector<float> v(pooled, pooled + dimension_);
      double squares = 0.0;
      for (float x : v) {
        if (!std::isfinite(x)) {
          throw engine_error("llama_cpp::embedder: the embedding has a non-finite value");
        }
        squares += static_cast<double>(x) * x;
      }
      if (!(squares > 0.0)) { throw engine_error("llama_cpp::embedder: the embedding is zero"); }
      auto const scale = static_cast<float>(1.0 / std::sqrt(squares));
      for (float& x : v) {
        x *= scale;
      }
      out.push_back(std::move(v));
    }
    return out;
  }

  struct deleter {
    void operator()(llama_context* c) const noexcept { llama_free(c); }
  };
  model const* model_;
  embedder_options options_;
  std::int32_t dimension_{};
  std::unique_ptr<llama_context, deleter> ctx_;
};

}  // namespace inferscale::llama_cpp
