/**
 * @file llama_model.hpp
 * @brief The model of the reference engine adapter: a loaded GGUF (model) with the KV geometry and
 * rotation from its metadata, and the rotation as llama.cpp forms it (make_ggml_rope_table); also
 * the adapter's error type (engine_error) and quiet_logs.
 */
#pragma once

#include <inferscale/geometry.hpp>
#include <inferscale/gguf_config.hpp>
#include <inferscale/rope.hpp>

#include <ggml.h>
#include <llama.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

/// @brief llama.cpp refused or failed a call (the message says which and why).
struct engine_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// @brief Silences llama.cpp's log (errors still print to stderr).
inline void quiet_logs()
{
  llama_log_set(
    [](ggml_log_level level, char const* text, void*) {
      if (level == GGML_LOG_LEVEL_ERROR) { std::fputs(text, stderr); }
    },
    nullptr);
}

// ------------------------------------------------------------------------------------------------
// Which architectures the adapter serves

/// @brief What decides whether the adapter can serve a generative model (llama.cpp's own answers
/// and the GGUF metadata; see check_architecture).
struct architecture_facts {
  std::string name;                ///< general.architecture
  bool recurrent{false};           ///< llama_model_is_recurrent or llama_model_is_hybrid
  std::int32_t rope_type{0};       ///< llama_model_rope_type
  std::int32_t sliding_window{0};  ///< llama_model_n_swa (0: none)
  std::int64_t kv_lora_rank{0};    ///< `<arch>.attention.kv_lora_rank` (MLA; 0: none)
};

/**
 * @brief Refuses, naming the architecture, a model whose keys the adapter cannot capture before
 * RoPE and inject: a recurrent state instead of a per-token cache, keys compressed into a latent
 * (MLA), no rotary embedding or a multi-section one. Served: every architecture whose keys pass
 * through a ROPE node, with or without a per-head K norm before it (captured after the norm),
 * a rope base per layer (read from the engine's ROPE nodes) and sliding-window layers (llama.cpp
 * keeps them in a second cache, the blob's second section; the context keeps it full-size).
 * @throw engine_error with the reason.
 */
inline void check_architecture(architecture_facts const& f)
{
  std::string const who = "llama_cpp: architecture '" + f.name + "' ";
  if (f.recurrent) {
    throw engine_error(who +
                       "keeps a recurrent state instead of a per-token KV cache (llama.cpp: "
                       "recurrent or hybrid): there are no keys to inject; refused");
  }
  if (f.kv_lora_rank > 0) {
    throw engine_error(who + "compresses keys and values into a latent (MLA, kv_lora_rank " +
                       std::to_string(f.kv_lora_rank) +
                       "): its cache holds no per-head keys to rotate; refused");
  }
  if (f.rope_type == LLAMA_ROPE_TYPE_NONE) {
    throw engine_error(who +
                       "has no rotary embedding: its keys pass through no ROPE node; refused");
  }
  if (f.rope_type != LLAMA_ROPE_TYPE_NORM && f.rope_type != LLAMA_ROPE_TYPE_NEOX) {
    throw engine_error(who + "rotates with rope type " + std::to_string(f.rope_type) +
                       " (multi-section or vision RoPE): not supported; refused");
  }
}

// ------------------------------------------------------------------------------------------------
// Model

/// @brief A loaded GGUF model (move-only owner of a llama_model).
class model {
 public:
  /// @throw engine_error if the file cannot be opened or loaded.
  explicit model(std::string const& path)
  {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::fclose(f);
    } else {
      throw engine_error("llama_cpp::model: cannot open the model file '" + path + "'");
    }
    llama_model_params params = llama_model_default_params();
    params.n_gpu_layers       = 0;
    model_.reset(llama_model_load_from_file(path.c_str(), params));
    if (!model_) {
      throw engine_error("llama_cpp::model: llama.cpp could not load '" + path + "'");
    }
  }

  llama_model* get() const noexcept { return model_.get(); }
  llama_vocab const* vocab() const noexcept { return llama_model_get_vocab(model_.get()); }
  std::int32_t vocab_size() const noexcept { return llama_vocab_n_tokens(vocab()); }

  /// @brief A metadata value as text, or nullopt.
  std::optional<std::string> meta(std::string const& key) const
  {
    std::int32_t const n = llama_model_meta_val_str(model_.get(), key.c_str(), nullptr, 0);
    if (n < 0) { return std::nullopt; }
    std::string out(static_cast<std::size_t>(n) + 1, '\0');
    llama_model_meta_val_str(model_.get(), key.c_str(), out.data(), out.size());
    out.resize(static_cast<std::size_t>(n));
    return out;
  }

  /// @brief What check_architecture() decides on, read from llama.cpp and the metadata.
  architecture_facts architecture() const
  {
    architecture_facts f;
    f.name      = meta("general.architecture").value_or("?");
    f.recurrent = llama_model_is_recurrent(model_.get()) || llama_model_is_hybrid(model_.get());
    f.rope_type = static_cast<std::int32_t>(llama_model_rope_type(model_.get()));
    f.sliding_window = llama_model_n_swa(model_.get());
    if (auto const r = meta(f.name + ".attention.kv_lora_rank")) {
      try {
        f.kv_lora_rank = std::stoll(*r);
      } catch (std::exception const&) {
        throw engine_error("llama_cpp::model: " + f.name + ".attention.kv_lora_rank is '" + *r +
                           "', not a number");
      }
    }
    return f;
  }

  /// @brief The KV geometry from the GGUF metadata, cross-checked against llama.cpp's own counts.
  kv_geometry geometry() const
  {
    kv_geometry const g = kv_geometry_from_gguf([this](std::string const& k) { return meta(k); });
    if (g.num_layers != llama_model_n_layer(model_.get()) ||
        g.num_kv_heads != llama_model_n_head_kv(model_.get())) {
      throw engine_error(
        "llama_cpp::model: GGUF metadata and llama.cpp disagree on layers or "
        "KV heads");
    }
    return g;
  }

  /// @brief The rotation from the GGUF metadata, paired as llama.cpp pairs this architecture.
  rope_spec rotation_spec() const
  {
    llama_rope_type const type = llama_model_rope_type(model_.get());
    rope_pairing pairing{};
    if (type == LLAMA_ROPE_TYPE_NORM) {
      pairing = rope_pairing::interleaved;  // adjacent pairs (2i, 2i+1)
    } else if (type == LLAMA_ROPE_TYPE_NEOX) {
      pairing = rope_pairing::halves;
    } else {
      throw engine_error("llama_cpp::model: rope type " + std::to_string(type) +
                         " (M-RoPE, vision or none) is not supported");
    }
    return rope_spec_from_gguf([this](std::string const& k) { return meta(k); }, pairing);
  }

  /// @brief Token ids of `text` (special tokens such as `<|im_start|>` parsed; no BOS added).
  std::vector<std::int32_t> tokenize(std::string const& text) const
  {
    std::int32_t n = -llama_tokenize(vocab(),
                                     text.data(),
                                     static_cast<std::int32_t>(text.size()),
                                     nullptr,
                                     0,
                                     /*add_special*/ false,
                                     /*parse_special*/ true);
    std::vector<llama_token> out(static_cast<std::size_t>(std::max(n, 0)));
    if (n > 0 && llama_tokenize(vocab(),
                                text.data(),
                                static_cast<std::int32_t>(text.size()),
                                out.data(),
                                n,
                                false,
                                true) != n) {
      throw engine_error("llama_cpp::model: tokenization failed");
    }
    return {out.begin(), out.end()};
  }

  /// @brief The text of `tokens` (special tokens rendered).
  std::string detokenize(std::vector<std::int32_t> const& tokens) const
  {
    std::string out;
    char buf[256];
    for (std::int32_t t : tokens) {
      std::int32_t const n = llama_token_to_piece(vocab(), t, buf, sizeof(buf), 0, true);
      if (n > 0) { out.append(buf, static_cast<std::size_t>(n)); }
    }
    return out;
  }

  bool is_end_of_generation(std::int32_t token) const noexcept
  {
    return llama_vocab_is_eog(vocab(), token);
  }

 private:
  struct deleter {
    void operator()(llama_model* m) const noexcept { llama_model_free(m); }
  };
  std::unique_ptr<llama_model, deleter> model_;
};

/**
 * @brief The cos/sin table llama.cpp's CPU rope forms (`ggml_rope_cache_init`, `rope_yarn`):
 * the angle of pair i at position p is a running fp32 product starting at `float(p)` and
 * multiplied by `theta_scale = powf(base, -2/n_dims)` once per pair, scaled by `freq_scale`, then
 * `cosf`/`sinf` in fp32. Rows `0 .. rows-1` in rope_cos_sin_table layout
 * (`[cos_0 .. cos_{n-1} | sin_0 .. sin_{n-1}]`).
 *
 * @throw engine_error for YaRN (its extrapolation mix is not reproduced here) or non-positive rows.
 */
inline std::vector<float> make_ggml_rope_table(rope_spec const& spec, std::int64_t rows)
{
  spec.validate();
  if (spec.scaling != rope_scaling::none && spec.scaling != rope_scaling::linear) {
    throw engine_error("make_ggml_rope_table: only unscaled and linear rope are reproduced");
  }
  if (rows <= 0) { throw engine_error("make_ggml_rope_table: rows must be positive"); }
  std::int32_t const n_dims = spec.effective_rotary_dim();
  std::int32_t const pairs  = n_dims / 2;
  float const freq_base     = static_cast<float>(spec.theta);
  float const freq_scale    = static_cast<float>(1.0 / spec.factor);
  float const theta_scale   = std::pow(freq_base, -2.0f / static_cast<float>(n_dims));
  std::vector<float> table(static_cast<std::size_t>(rows) * static_cast<std::size_t>(n_dims));
  for (std::int64_t p = 0; p < rows; ++p) {
    float theta = static_cast<float>(p);
    float* row  = table.data() + p * n_dims;
    for (std::int32_t i = 0; i < pairs; ++i) {
      float const angle = freq_scale * theta;
      row[i]            = std::cos(angle);
      row[pairs + i]    = std::sin(angle);
      theta *= theta_scale;
    }
  }
  return table;
}

}  // namespace inferscale::llama_cpp
