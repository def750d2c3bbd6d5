/**
 * @file compression_fidelity.hpp
 * @brief What compressed fact KV (compression.hpp) costs in answers: the stores a comparison
 * builds (bfloat16, the reference; fp8_e4m3 and int4 dequantized to bfloat16; the float32 store
 * the benchmarks serve from), and per store the next-token KL to the bfloat16 store's run, top-1
 * agreement, greedy answer agreement and the stored bytes per fact, printed as a markdown table.
 * Shared by locomo_eval --compression (bench/locomo) and the demo's --compression mode.
 */
#pragma once

#include "divergence.hpp"

#include <inferscale/compression.hpp>
#include <inferscale/dtype.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace inferscale::llama_cpp {

/// @brief One store of the comparison: its name, element dtype and compression.
struct store_variant {
  std::string name;
  dtype store_dtype{dtype::bfloat16};
  kv_compression compression{kv_compression::none};
};

/// @brief The variant a --compression entry names: "bfloat16" (an uncompressed bf16 store),
/// "fp8_e4m3" or "int4" (compressed, dequantized to bfloat16).
/// @throw std::invalid_argument for any other name.
inline store_variant compression_variant(std::string const& name)
{
  if (name == "bfloat16") { return {name, dtype::bfloat16, kv_compression::none}; }
  if (name == "fp8_e4m3") { return {name, dtype::bfloat16, kv_compression::fp8_e4m3}; }
  if (name == "int4") { return {name, dtype::bfloat16, kv_compression::int4}; }
  throw std::invalid_argument("unknown entry '" + name + "' (bfloat16, fp8_e4m3 or int4)");
}

/**
 * @brief The stores a --compression list asks for: bfloat16 first (the reference every figure is
 * measured against; added when the list omits it), then the list's other entries in order.
 * @throw std::invalid_argument for an unknown or repeated entry, or an empty list.
 */
inline std::vector<store_variant> compression_variants(std::string const& list)
{
  std::vector<store_variant> out{compression_variant("bfloat16")};
  std::stringstream in{list};
  std::string x;
  bool any = false;
  while (std::getline(in, x, ',')) {
    if (x.empty()) { continue; }
    any                   = true;
    store_variant const v = compression_variant(x);
    bool const repeated   = std::any_of(
      out.begin() + 1, out.end(), [&](store_variant const& o) { return o.name == v.name; });
    if (repeated) { throw std::invalid_argument("'" + x + "' given twice"); }
    if (v.name != "bfloat16") { out.push_back(v); }
  }
  if (!any) { throw std::invalid_argument("an empty list"); }
  return out;
}

/// @brief One store's figures against the bfloat16 store's runs.
struct fidelity_row {
  fidelity_row(std::string row_name) : name{std::move(row_name)} {}  // NOLINT: {"name"} builds one

  std::string name;
  std::int64_t page_bytes{0};    ///< bytes of one store page (all layers, K and V)
  double bytes_per_fact{0};      ///< the store's bytes of the compared facts / their count
  std::vector<double> kl;        ///< KL(bf16 ‖ this) per teacher-forced position
  std::int64_t top1{0};          ///< positions whose argmax agrees with the bf16 run's
  std::int64_t answers{0};       ///< greedy answers compared
  std::int64_t same_answers{0};  ///< ... identical to the bf16 store's answer
  bool reference{false};         ///< the bfloat16 store itself

  /// Adds one answer: the reference's and this store's teacher-forced logits over the same
  /// tokens, and whether the greedy answers are identical.
  void add(std::vector<std::vector<float>> const& ref,
           std::vector<std::vector<float>> const& got,
           bool same_answer)
  {
    if (ref.size() != got.size()) {
      throw std::runtime_error("compression fidelity: " + name + ": " + std::to_string(got.size()) +
                               " teacher-forced positions, the " + "bfloat16 run has " +
                               std::to_string(ref.size()));
    }
    for (std::size_t j = 0; j < ref.size(); ++j) {
      auto const [d, same] = kl_top1(ref[j], got[j]);
      kl.push_back(d);
      top1 += same ? 1 : 0;
    }
    ++answers;
    same_answers += same_answer ? 1 : 0;
  }
  double kl_mean() const
  {
    double s = 0;
    for (double x : kl) {
      s += x;
    }
    return kl.empty() ? std::nan("") : s / double(kl.size());
  }
  /// The 95th percentile (nearest rank) of the per-position KL.
  double kl_p95() const
  {
    if (kl.empty()) { return std::nan(""); }
    std::vector<double> s = kl;
    std::sort(s.begin(), s.end());
    auto const rank = static_cast<std::size_t>(std::ceil(0.95 * double(s.size())));
    return s[std::max<std::size_t>(rank, 1) - 1];
  }
  double top1_rate() const { return kl.empty() ? std::nan("") : double(top1) / double(kl.size()); }
  double answer_rate() const
  {
    return answers == 0 ? std::nan("") : double(same_answers) / double(answers);
  }
};

/**
 * @brief Prints the rows as a markdown table (the reference row first as given) and checks every
 * figure: returns false (after printing which) when a row has no figure or a non-finite one.
 * `bf16` is the reference row (for the byte ratios).
 */
inline bool print_fidelity_table(std::vector<fidelity_row> const& rows, fidelity_row const& bf16)
{
  std::printf(
    "| store | page bytes | bytes per fact | vs bfloat16 | KL(bf16 ‖ store) mean nats | KL p95 "
    "| top-1 = bf16 | positions | greedy answer = bf16 | answers |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  bool ok = true;
  for (fidelity_row const& r : rows) {
    double const ratio = bf16.bytes_per_fact / r.bytes_per_fact;
    if (r.reference) {
      std::printf("| %s (reference) | %lld | %.0f | 1.00x | 0 | 0 | 1 | %zu | 1 | %lld |\n",
                  r.name.c_str(),
                  static_cast<long long>(r.page_bytes),
                  r.bytes_per_fact,
                  bf16.kl.size(),
                  static_cast<long long>(bf16.answers));
      ok = ok && r.page_bytes > 0 && std::isfinite(r.bytes_per_fact) && r.bytes_per_fact > 0;
      continue;
    }
    char ratio_text[32];
    std::snprintf(ratio_text,
                  sizeof ratio_text,
                  ratio >= 1 ? "%.2fx fewer" : "%.2fx more",
                  ratio >= 1 ? ratio : 1 / ratio);
    std::printf("| %s | %lld | %.0f | %s | %.5f | %.5f | %.3f | %zu | %.3f | %lld |\n",
                r.name.c_str(),
                static_cast<long long>(r.page_bytes),
                r.bytes_per_fact,
                ratio_text,
                r.kl_mean(),
                r.kl_p95(),
                r.top1_rate(),
                r.kl.size(),
                r.answer_rate(),
                static_cast<long long>(r.answers));
    bool const row_ok = r.page_bytes > 0 && r.bytes_per_fact > 0 && std::isfinite(ratio) &&
                        !r.kl.empty() && std::isfinite(r.kl_mean()) && std::isfinite(r.kl_p95()) &&
                        std::isfinite(r.top1_rate()) && r.answers > 0 &&
                        std::isfinite(r.answer_rate());
    if (!row_ok) {
      std::fprintf(
        stderr, "compression fidelity: %s has a missing or non-finite figure\n", r.name.c_str());
    }
    ok = ok && row_ok;
  }
  return ok;
}

}  // namespace inferscale::llama_cpp
