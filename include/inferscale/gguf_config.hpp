/**
 * @file gguf_config.hpp
 * @brief kv_geometry and rope_spec from GGUF metadata (the sibling of hf_config.hpp, which reads a
 * Hugging Face `config.json`). C++17, host only; metadata is read through a caller's lookup
 * callable (llama.cpp: `llama_model_meta_val_str`), so no GGUF parser is included.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/rope.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

namespace inferscale {

namespace detail {
inline double gguf_number(std::string const& key, std::string const& text)
{
  char* end             = nullptr;
  double const value    = std::strtod(text.c_str(), &end);
  bool const parsed_all = end != text.c_str() && *end == '\0';
  INFERSCALE_EXPECTS(parsed_all && std::isfinite(value),
                     "GGUF metadata " + key + " = '" + text + "' is not a finite number");
  return value;
}

template <class Lookup>
std::optional<double> gguf_optional_number(Lookup const& lookup, std::string const& key)
{
  std::optional<std::string> v = lookup(key);
  if (!v) { return std::nullopt; }
  return gguf_number(key, *v);
}

template <class Lookup>
double gguf_required_number(Lookup const& lookup, std::string const& key)
{
  std::optional<double> v = gguf_optional_number(lookup, key);
  INFERSCALE_EXPECTS(v.has_value(), "GGUF metadata " + key + " is missing");
  return *v;
}

template <class Lookup>
std::string gguf_architecture(Lookup const& lookup)
{
  std::optional<std::string> arch = lookup(std::string{"general.architecture"});
  INFERSCALE_EXPECTS(arch && !arch->empty(),
                     std::string{"GGUF metadata general.architecture is missing"});
  return *arch;
}

inline std::int32_t gguf_positive_int(std::string const& key, double v)
{
  INFERSCALE_EXPECTS(
    v >= 1 && v <= std::numeric_limits<std::int32_t>::max() && v == std::floor(v),
    "GGUF metadata " + key + " = " + std::to_string(v) + " is not a positive integer");
  return static_cast<std::int32_t>(v);
}
}  // namespace detail

/**
 * @brief The KV geometry of a GGUF model from its metadata (`<arch>.block_count`,
 * `<arch>.attention.head_count_kv` (default: head_count), `<arch>.attention.key_length` (default:
 * embedding_length / head_count)).
 *
 * @param lookup callable `std::optional<std::string>(std::string const& key)` returning a metadata
 *        value as text (llama.cpp: `llama_model_meta_val_str`), or nullopt when absent
 * @throw logic_error naming a missing or malformed key, or when K and V head sizes differ.
 */
template <class Lookup>
kv_geometry kv_geometry_from_gguf(Lookup const& lookup)
{
  using namespace detail;
  std::string const arch = gguf_architecture(lookup);
  auto const key         = [&](char const* k) { return arch + "." + k; };
  std::int32_t const layers =
    gguf_positive_int(key("block_count"), gguf_required_number(lookup, key("block_count")));
  std::int32_t const heads = gguf_positive_int(
    key("attention.head_count"), gguf_required_number(lookup, key("attention.head_count")));
  std::optional<double> const kv = gguf_optional_number(lookup, key("attention.head_count_kv"));
  std::int32_t const kv_heads = kv ? gguf_positive_int(key("attention.head_count_kv"), *kv) : heads;
  std::optional<double> const key_length =
    gguf_optional_number(lookup, key("attention.key_length"));
  std::int32_t head_dim{};
  if (key_length) {
    head_dim = gguf_positive_int(key("attention.key_length"), *key_length);
  } else {
    std::int32_t const embd = gguf_positive_int(
      key("embedding_length"), gguf_required_number(lookup, key("embedding_length")));
    INFERSCALE_EXPECTS(embd % heads == 0,
                       "GGUF metadata: embedding_length " + std::to_string(embd) +
                         " is not a multiple of head_count " + std::to_string(heads));
    head_dim = embd / heads;
  }
  if (std::optional<double> const value_length =
        gguf_optional_number(lookup, key("attention.value_length"))) {
    INFERSCALE_EXPECTS(*value_length == head_dim,
                       "GGUF metadata: value_length " + std::to_string(*value_length) +
                         " differs from key_length " + std::to_string(head_dim) +
                         " (K and V heads of different sizes are not supported)");
  }
  kv_geometry g{layers, kv_heads, head_dim};
  g.validate();
  return g;
}

/**
 * @brief The rotation of a GGUF model from its metadata: `<arch>.rope.freq_base` (default 10000,
 * llama.cpp's), `<arch>.rope.dimension_count` (default: head_dim), `<arch>.rope.scaling.type`
 * (none / linear / yarn), `<arch>.rope.scaling.factor` (or the older `rope.scale_linear`),
 * `<arch>.rope.scaling.original_context_length`, `yarn_beta_fast` / `yarn_beta_slow`,
 * `<arch>.context_length`.
 *
 * GGUF does not say which elements pair up: llama.cpp decides by architecture
 * (`llama_model_rope_type`: NORM = adjacent pairs for llama-family GGUFs, whose Q/K rows the
 * converter permuted; NEOX = halves), so the caller passes `pairing`.
 *
 * @note llama3-type scaling is stored by the converter as a `rope_freqs` tensor, not as metadata,
 *       and LongRoPE's factors likewise: those models need the engine's own cos/sin table
 *       (rope_cos_sin_table) — they are refused here rather than rotated wrongly.
 * @throw logic_error on a missing or malformed key, an unsupported scaling type, or a spec that
 *        fails rope_spec::validate().
 */
template <class Lookup>
rope_spec rope_spec_from_gguf(Lookup const& lookup, rope_pairing pairing)
{
  using namespace detail;
  std::string const arch     = gguf_architecture(lookup);
  auto const key             = [&](char const* k) { return arch + "." + k; };
  kv_geometry const geometry = kv_geometry_from_gguf(lookup);
  rope_spec spec{};
  spec.head_dim = geometry.head_dim;
  spec.pairing  = pairing;
  spec.theta    = gguf_optional_number(lookup, key("rope.freq_base")).value_or(10000.0);
  if (std::optional<double> dims = gguf_optional_number(lookup, key("rope.dimension_count"))) {
    spec.rotary_dim = gguf_positive_int(key("rope.dimension_count"), *dims);
    if (spec.rotary_dim == spec.head_dim) { spec.rotary_dim = 0; }
  }
  if (std::optional<double> ctx = gguf_optional_number(lookup, key("context_length"))) {
    spec.max_position = gguf_positive_int(key("context_length"), *ctx);
  }
  INFERSCALE_EXPECTS(!lookup(key("rope.scaling.alpha")),
                     "GGUF metadata " + key("rope.scaling.alpha") +
                       ": NTK-alpha scaling is not supported; pass the engine's cos/sin table");
  std::string type             = lookup(key("rope.scaling.type")).value_or("");
  std::optional<double> factor = gguf_optional_number(lookup, key("rope.scaling.factor"));
  if (!factor) { factor = gguf_optional_number(lookup, key("rope.scale_linear")); }
  if (type.empty()) { type = (factor && *factor != 1.0) ? "linear" : "none"; }
  if (type == "none") {
    spec.scaling = rope_scaling::none;
  } else if (type == "linear") {
    spec.scaling = rope_scaling::linear;
    spec.factor  = factor.value_or(1.0);
  } else if (type == "yarn") {
    spec.scaling = rope_scaling::yarn;
    spec.factor  = factor.value_or(1.0);
    spec.original_max_position =
      gguf_positive_int(key("rope.scaling.original_context_length"),
                        gguf_required_number(lookup, key("rope.scaling.original_context_length")));
    spec.beta_fast =
      gguf_optional_number(lookup, key("rope.scaling.yarn_beta_fast")).value_or(32.0);
    spec.beta_slow = gguf_optional_number(lookup, key("rope.scaling.yarn_beta_slow")).value_or(1.0);
    INFERSCALE_EXPECTS(!lookup(key("rope.scaling.attn_factor")),
                       "GGUF metadata " + key("rope.scaling.attn_factor") +
                         ": a YaRN attention factor from metadata is not supported; pass the "
                         "engine's cos/sin table");
  } else {
    INFERSCALE_FAIL("GGUF metadata " + key("rope.scaling.type") + " = '" + type +
                    "' is not supported from metadata (llama3 and LongRoPE factors live in "
                    "tensors): pass the engine's cos/sin table");
  }
  spec.validate();
  return spec;
}

}  // namespace inferscale
