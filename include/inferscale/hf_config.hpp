/**
 * @file hf_config.hpp
 * @brief rope_spec and kv_geometry from a Hugging Face `config.json`. Needs nlohmann-json (Debian
 * `nlohmann-json3-dev`, header-only); kept out of the core headers so the core needs no JSON
 * parser.
 *
 * Reads the fields transformers' `ROPE_INIT_FUNCTIONS` read: `rope_theta`, `head_dim` (or
 * `hidden_size / num_attention_heads`), `partial_rotary_factor`, `max_position_embeddings`, and
 * `rope_scaling` (`rope_type`, or the older `type`) with its parameters; transformers v5's
 * `rope_parameters` dict (holding `rope_theta` too) is read the same way. HF rotates halves
 * (`rotate_half`); pass `rope_pairing::interleaved` for a model whose config says
 * `rope_interleaved: true` or whose K rows were permuted (GGUF).
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/rope.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace inferscale {

namespace detail {
inline double hf_number(nlohmann::json const& j, char const* key)
{
  INFERSCALE_EXPECTS(j.contains(key) && j.at(key).is_number(),
                     std::string{"config.json: "} + key + " must be a number");
  double const v = j.at(key).get<double>();
  INFERSCALE_EXPECTS(std::isfinite(v), std::string{"config.json: "} + key + " is not finite");
  return v;
}
inline std::optional<double> hf_optional_number(nlohmann::json const& j, char const* key)
{
  if (!j.contains(key) || j.at(key).is_null()) { return std::nullopt; }
  return hf_number(j, key);
}
/// A position count (`max_position_embeddings`, `original_max_position_embeddings`), absent or
/// null: nullopt; otherwise a non-negative integer up to 2^53 (refused rather than converted: a
/// fraction would be truncated and 1e300 does not fit an int64).
inline std::optional<std::int64_t> hf_optional_position(nlohmann::json const& j, char const* key)
{
  std::optional<double> const v = hf_optional_number(j, key);
  if (!v) { return std::nullopt; }
  char text[32];
  std::snprintf(text, sizeof text, "%.17g", *v);
  INFERSCALE_EXPECTS(*v >= 0 && *v == std::floor(*v) && *v <= 9007199254740992.0,
                     std::string{"config.json: "} + key +
                       " must be a non-negative integer (at most 2^53), got " + text);
  return static_cast<std::int64_t>(*v);
}
inline std::int32_t hf_int(nlohmann::json const& j, char const* key)
{
  double const v = hf_number(j, key);
  INFERSCALE_EXPECTS(
    v >= 1 && v == std::floor(v) && v <= 1 << 30,
    std::string{"config.json: "} + key + " must be a positive integer, got " + std::to_string(v));
  return static_cast<std::int32_t>(v);
}
inline std::vector<double> hf_list(nlohmann::json const& j, char const* key)
{
  INFERSCALE_EXPECTS(j.contains(key) && j.at(key).is_array(),
                     std::string{"config.json: rope_scaling."} + key + " must be a list");
  std::vector<double> out;
  for (auto const& v : j.at(key)) {
    INFERSCALE_EXPECTS(v.is_number(),
                       std::string{"config.json: rope_scaling."} + key + " holds a non-number");
    out.push_back(v.get<double>());
  }
  return out;
}
inline std::int32_t hf_head_dim(nlohmann::json const& config)
{
  if (config.contains("head_dim") && !config.at("head_dim").is_null()) {
    return hf_int(config, "head_dim");
  }
  std::int32_t const hidden = hf_int(config, "hidden_size");
  std::int32_t const heads  = hf_int(config, "num_attention_heads");
  INFERSCALE_EXPECTS(hidden % heads == 0,
                     "config.json: hidden_size " + std::to_string(hidden) +
                       " is not a multiple of num_attention_heads " + std::to_string(heads));
  return hidden / heads;
}
}  // namespace detail

/**
 * @brief The KV geometry from a config: `num_hidden_layers`, `num_key_value_heads` (default
 * `num_attention_heads`), `head_dim` (default `hidden_size / num_attention_heads`).
 * @throw logic_error naming a missing or malformed field.
 */
inline kv_geometry kv_geometry_from_hf_config(nlohmann::json const& config)
{
  using namespace detail;
  std::int32_t const layers = hf_int(config, "num_hidden_layers");
  std::int32_t const kv =
    config.contains("num_key_value_heads") && !config.at("num_key_value_heads").is_null()
      ? hf_int(config, "num_key_value_heads")
      : hf_int(config, "num_attention_heads");
  kv_geometry g{layers, kv, hf_head_dim(config)};
  g.validate();
  return g;
}

/**
 * @brief The rotation a config describes, as transformers computes it. Where HF reads a field
 * unlike a plain reading of the JSON, this follows HF: YaRN without `factor` takes
 * `max_position_embeddings / original_max_position_embeddings`; YaRN `mscale` or `mscale_all_dim`
 * of 0 means absent, and `beta_fast` / `beta_slow` of 0 take their defaults 32 and 1 (Python's
 * `or`); LongRoPE's explicit `factor` gives the attention factor `sqrt(1 + ln f / ln L0)`.
 * @param pairing halves for HF models (rotate_half); interleaved where the weights pair adjacent
 *        elements
 * @throw logic_error for a missing or malformed field, an unknown `rope_type`, or a spec that fails
 *        rope_spec::validate().
 */
inline rope_spec rope_spec_from_hf_config(nlohmann::json const& config,
                                          rope_pairing pairing = rope_pairing::halves)
{
  using namespace detail;
  INFERSCALE_EXPECTS(config.is_object(), std::string{"config.json: not a JSON object"});
  // transformers v5: everything in rope_parameters; before: rope_theta + rope_scaling.
  nlohmann::json const* params = nullptr;
  if (config.contains("rope_parameters") && config.at("rope_parameters").is_object()) {
    params = &config.at("rope_parameters");
  } else if (config.contains("rope_scaling") && config.at("rope_scaling").is_object()) {
    params = &config.at("rope_scaling");
  }
  rope_spec spec{};
  spec.head_dim = hf_head_dim(config);
  spec.pairing  = pairing;
  if (std::optional<double> theta = hf_optional_number(config, "rope_theta")) {
    spec.theta = *theta;
  } else if (params && params->contains("rope_theta")) {
    spec.theta = hf_number(*params, "rope_theta");
  }
  if (std::optional<double> partial = hf_optional_number(config, "partial_rotary_factor")) {
    INFERSCALE_EXPECTS(
      *partial > 0 && *partial <= 1,
      "config.json: partial_rotary_factor must be in (0, 1], got " + std::to_string(*partial));
    spec.rotary_dim = static_cast<std::int32_t>(spec.head_dim * *partial);
    if (spec.rotary_dim == spec.head_dim) { spec.rotary_dim = 0; }
  }
  if (std::optional<std::int64_t> max_pos =
        hf_optional_position(config, "max_position_embeddings")) {
    spec.max_position = *max_pos;
  }
  std::string type = "default";
  if (params) {
    if (params->contains("rope_type") && params->at("rope_type").is_string()) {
      type = params->at("rope_type").get<std::string>();
    } else if (params->contains("type") && params->at("type").is_string()) {
      type = params->at("type").get<std::string>();
    }
  }
  auto const optional = [&](char const* key) {
    return params ? hf_optional_number(*params, key) : std::nullopt;
  };
  if (std::optional<std::int64_t> l0 =
        params ? hf_optional_position(*params, "original_max_position_embeddings") : std::nullopt) {
    spec.original_max_position = *l0;
  }
  if (type == "default") {
    spec.scaling = rope_scaling::none;
  } else if (type == "linear") {
    spec.scaling = rope_scaling::linear;
    spec.factor  = hf_number(*params, "factor");
  } else if (type == "dynamic") {
    spec.scaling = rope_scaling::dynamic_ntk;
    spec.factor  = hf_number(*params, "factor");
  } else if (type == "llama3") {
    spec.scaling          = rope_scaling::llama3;
    spec.factor           = hf_number(*params, "factor");
    spec.low_freq_factor  = hf_number(*params, "low_freq_factor");
    spec.high_freq_factor = hf_number(*params, "high_freq_factor");
  } else if (type == "yarn") {
    spec.scaling = rope_scaling::yarn;
    if (spec.original_max_position == 0) { spec.original_max_position = spec.max_position; }
    // HF: factor absent -> max_position_embeddings / original_max_position_embeddings.
    std::optional<double> factor = optional("factor");
    if (!factor) {
      INFERSCALE_EXPECTS(spec.original_max_position > 0 && spec.max_position > 0,
                         std::string{"config.json: YaRN without factor needs "
                                     "max_position_embeddings and "
                                     "original_max_position_embeddings"});
      factor =
        static_cast<double>(spec.max_position) / static_cast<double>(spec.original_max_position);
    }
    spec.factor = *factor;
    // HF: `beta_fast or 32`, `beta_slow or 1`: 0 (or absent) takes the default.
    spec.beta_fast = optional("beta_fast").value_or(0.0);
    spec.beta_slow = optional("beta_slow").value_or(0.0);
    if (spec.beta_fast == 0.0) { spec.beta_fast = 32.0; }
    if (spec.beta_slow == 0.0) { spec.beta_slow = 1.0; }
    if (std::optional<double> a = optional("attention_factor")) { spec.attention_factor = *a; }
    // mscale 0 (or absent) means "not given" in HF's YaRN.
    std::optional<double> const mscale     = optional("mscale");
    std::optional<double> const mscale_all = optional("mscale_all_dim");
    if (mscale && *mscale != 0) { spec.mscale = *mscale; }
    if (mscale_all && *mscale_all != 0) { spec.mscale_all_dim = *mscale_all; }
    if (params->contains("truncate") && params->at("truncate").is_boolean()) {
      spec.truncate = params->at("truncate").get<bool>();
    }
  } else if (type == "longrope") {
    spec.scaling      = rope_scaling::longrope;
    spec.short_factor = hf_list(*params, "short_factor");
    spec.long_factor  = hf_list(*params, "long_factor");
    if (std::optional<double> a = optional("attention_factor")) { spec.attention_factor = *a; }
    if (spec.original_max_position == 0) {
      // Phi-3 keeps it at the top level.
      if (std::optional<std::int64_t> l0 =
            hf_optional_position(config, "original_max_position_embeddings")) {
        spec.original_max_position = *l0;
      }
    }
    // HF: an explicit `factor` sets the attention factor sqrt(1 + ln f / ln L0) (1 for f <= 1);
    // without one, f = max_position_embeddings / L0 (rope_spec's own rule). An older config
    // without L0 takes L0 = max_position_embeddings.
    if (spec.original_max_position == 0) { spec.original_max_position = spec.max_position; }
    std::optional<double> const factor = optional("factor");
    if (factor && !spec.attention_factor) {
      INFERSCALE_EXPECTS(*factor > 0,
                         "config.json: rope_scaling.factor of LongRoPE must be positive, got " +
                           std::to_string(*factor));
      spec.attention_factor =
        *factor <= 1.0
          ? 1.0
          : std::sqrt(1.0 + std::log(*factor) / std::log(static_cast<double>(std::max<std::int64_t>(
                                                  spec.original_max_position, 2))));
    }
  } else {
    INFERSCALE_FAIL("config.json: rope type '" + type +
                    "' is not supported (default, linear, dynamic, llama3, yarn, longrope are)");
  }
  spec.validate();
  return spec;
}

/**
 * @brief Reads and parses a `config.json` file.
 * @throw logic_error if the file cannot be read or is not JSON.
 */
inline nlohmann::json read_hf_config(std::string const& path)
{
  std::ifstream in{path};
  INFERSCALE_EXPECTS(in.good(), "read_hf_config: cannot open '" + path + "'");
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions*/ false);
  INFERSCALE_EXPECTS(!j.is_discarded(), "read_hf_config: '" + path + "' is not valid JSON");
  return j;
}

}  // namespace inferscale
