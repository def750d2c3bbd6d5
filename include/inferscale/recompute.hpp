/**
 * @file recompute.hpp
 * @brief The recompute plan: which tokens of an injected memory segment the engine runs through
 * the model again, with the whole memory in place, so that they regain the attention to the other
 * facts that encoding each fact apart took away. C++17, host only; pure logic (an engine adapter
 * executes the plan: the llama.cpp adapter's recompute_memory).
 *
 * Facts encoded apart do not attend to each other. After injection, two training-free repairs
 * choose a few tokens to recompute in context (their new K/V replace the injected rows):
 *  - **boundary** (EPIC's LegoLink-r): the first `r` tokens of every fact, where a fact encoded
 *    alone put its own attention sink;
 *  - **selective** (CacheBlend's high-KV-deviation tokens): the tokens whose K/V change most when
 *    the memory is run in context. The engine measures that change cheaply: it runs the memory's
 *    text through its first layers only and compares one layer's K/V with the injected rows
 *    (kv_deviation below); layer 0's K/V do not depend on the context, so layer 1 is the first
 *    that tells.
 * The plan names token indices of the segment (position `c.first_position + j` for index `j`),
 * ascending, and the maximal runs of consecutive indices (an engine recomputes a run as one batch).
 *
 * ## Which tokens, exactly
 * Eligible: every token of the segment except those of `recompute_options::exact` (the instruction
 * prefix when it opens the sequence at position 0: its injected K/V are already what a prefill
 * computes) — `E` tokens. The boundary set `B` holds the first `min(r, length)` tokens of each
 * eligible fact. With `selective_fraction = ρ > 0` the plan recomputes `T = round(ρ·E)` tokens in
 * all (half away from zero): `B`, then the `max(0, T - |B|)` other eligible tokens of the largest
 * deviation (ties to the lower index). So ρ is the share of the memory recomputed, whatever `r`.
 */
#pragma once

#include <inferscale/compose.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/store.hpp>
#include <inferscale/views.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace inferscale {

/// @brief Knobs of plan_recompute() (see the file comment).
struct recompute_options {
  std::int32_t boundary_tokens{0};     ///< r: each fact's first r tokens (all of a shorter fact)
  double selective_fraction{0.0};      ///< ρ in [0, 1]: the share of eligible tokens recomputed in
                                       ///< all, the boundary tokens first, the rest by deviation
  std::optional<std::uint64_t> exact;  ///< a fact never recomputed nor counted (the prefix)
};

/// @brief Consecutive segment indices `[begin, begin + length)`, all recomputed.
struct recompute_run {
  std::int64_t begin{};
  std::int64_t length{};
};

/// @brief What plan_recompute() chose.
struct recompute_plan {
  std::vector<std::int64_t> tokens;  ///< segment indices, ascending
  std::vector<recompute_run> runs;   ///< maximal runs of `tokens`, ascending
  std::int64_t eligible{0};          ///< E: tokens that could be recomputed

  bool empty() const noexcept { return tokens.empty(); }
  /// @brief |tokens| / E (0 when nothing is eligible).
  double fraction() const noexcept
  {
    return eligible == 0 ? 0.0 : static_cast<double>(tokens.size()) / static_cast<double>(eligible);
  }
};

/**
 * @brief Chooses the tokens of `c` to recompute.
 * @param deviation one score per segment token (`c.length()` of them, finite, >= 0; the scores of
 *        ineligible tokens are ignored); needed only when ρ > 0 asks for more than the boundary
 * @throw logic_error if r < 0, ρ is not in [0, 1], `exact` is not a segment of `c`, or the
 *        deviations are needed and missing, of another length, negative or not finite.
 */
inline recompute_plan plan_recompute(composition const& c,
                                     recompute_options const& options,
                                     std::vector<float> const& deviation = {})
{
  INFERSCALE_EXPECTS(
    options.boundary_tokens >= 0,
    "plan_recompute: boundary_tokens must be >= 0, got " + std::to_string(options.boundary_tokens));
  INFERSCALE_EXPECTS(options.selective_fraction >= 0.0 && options.selective_fraction <= 1.0,
                     "plan_recompute: selective_fraction must be in [0, 1], got " +
                       std::to_string(options.selective_fraction));
  if (options.exact) {
    INFERSCALE_EXPECTS(
      std::any_of(c.segments.begin(),
                  c.segments.end(),
                  [&](composed_segment const& s) { return s.fact_id == *options.exact; }),
      "plan_recompute: the exact fact " + std::to_string(*options.exact) +
        " is not in the composition");
  }
  std::vector<char> chosen(static_cast<std::size_t>(c.length()), 0);
  std::vector<char> eligible(static_cast<std::size_t>(c.length()), 0);
  recompute_plan plan;
  std::int64_t boundary = 0;
  for (composed_segment const& s : c.segments) {
    if (options.exact && s.fact_id == *options.exact) { continue; }
    plan.eligible += s.length;
    for (std::int64_t j = 0; j < s.length; ++j) {
      eligible[static_cast<std::size_t>(s.begin + j)] = 1;
    }
    std::int64_t const r = std::min<std::int64_t>(options.boundary_tokens, s.length);
    for (std::int64_t j = 0; j < r; ++j) {
      chosen[static_cast<std::size_t>(s.begin + j)] = 1;
    }
    boundary += r;
  }
  auto const total = static_cast<std::int64_t>(
    std::llround(options.selective_fraction * static_cast<double>(plan.eligible)));
  std::int64_t const more = std::max<std::int64_t>(0, total - boundary);
  if (more > 0) {
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(deviation.size()) == c.length(),
                       "plan_recompute: selective recompute needs one deviation per segment "
                       "token (" +
                         std::to_string(c.length()) + "), got " + std::to_string(deviation.size()));
    for (std::size_t j = 0; j < deviation.size(); ++j) {
      INFERSCALE_EXPECTS(std::isfinite(deviation[j]) && deviation[j] >= 0.0f,
                         "plan_recompute: deviation of segment token " + std::to_string(j) +
                           " is " + std::to_string(deviation[j]) + " (must be finite and >= 0)");
    }
    std::vector<std::int64_t> candidates;
    for (std::int64_t j = 0; j < c.length(); ++j) {
      if (eligible[static_cast<std::size_t>(j)] && !chosen[static_cast<std::size_t>(j)]) {
        candidates.push_back(j);
      }
    }
    auto const by_deviation = [&](std::int64_t a, std::int64_t b) {
      float const da = deviation[static_cast<std::size_t>(a)];
      float const db = deviation[static_cast<std::size_t>(b)];
      return da != db ? da > db : a < b;
    };
    auto const take = std::min<std::int64_t>(more, static_cast<std::int64_t>(candidates.size()));
    std::partial_sort(
      candidates.begin(), candidates.begin() + take, candidates.end(), by_deviation);
    for (std::int64_t i = 0; i < take; ++i) {
      chosen[static_cast<std::size_t>(candidates[static_cast<std::size_t>(i)])] = 1;
    }
  }
  for (std::int64_t j = 0; j < c.length(); ++j) {
    if (!chosen[static_cast<std::size_t>(j)]) { continue; }
    plan.tokens.push_back(j);
    if (!plan.runs.empty() && plan.runs.back().begin + plan.runs.back().length == j) {
      ++plan.runs.back().length;
    } else {
      plan.runs.push_back({j, 1});
    }
  }
  return plan;
}

/**
 * @brief Per segment token, how far the injected K/V of layer `layer` are from those computed in
 * context: `‖K_store − K_ctx‖² + ‖V_store − V_ctx‖²` over every head (pre-RoPE keys both: the
 * rotation by the same position preserves the distance).
 * @param layer the store's layer index (a shard's own numbering)
 * @param keys, values `[c.length(), heads, head_dim]`: row `j` is segment token `j` run in
 *        context (pre-RoPE keys; the engine may stop its forward after this layer)
 * @throw logic_error if the store is not in host memory, `layer` is outside it, the views' shapes
 *        differ from `[c.length(), store heads, head_dim]`, or a fact of `c` is not in the store
 *        with the segment's length.
 */
inline std::vector<float> kv_deviation(kv_store const& store,
                                       composition const& c,
                                       std::int32_t layer,
                                       token_head_view<float const> keys,
                                       token_head_view<float const> values)
{
  kv_geometry const g = store.geometry();
  INFERSCALE_EXPECTS(store.space() == memory_space::host,
                     "kv_deviation: the store must be in host memory");
  INFERSCALE_EXPECTS(layer >= 0 && layer < g.num_layers,
                     "kv_deviation: layer " + std::to_string(layer) + " outside the store's " +
                       std::to_string(g.num_layers));
  for (token_head_view<float const> const* v : {&keys, &values}) {
    INFERSCALE_EXPECTS(
      v->extent(0) == c.length() && v->extent(1) == g.num_kv_heads && v->extent(2) == g.head_dim,
      "kv_deviation: in-context rows of shape [" + std::to_string(v->extent(0)) + ", " +
        std::to_string(v->extent(1)) + ", " + std::to_string(v->extent(2)) + "], expected [" +
        std::to_string(c.length()) + ", " + std::to_string(g.num_kv_heads) + ", " +
        std::to_string(g.head_dim) + "]");
  }
  for (composed_segment const& s : c.segments) {
    INFERSCALE_EXPECTS(store.contains(s.fact_id) && store.at(s.fact_id).length() == s.length &&
                         s.begin >= 0 && s.begin + s.length <= c.length(),
                       "kv_deviation: fact " + std::to_string(s.fact_id) +
                         " is not in the store as the composition laid it out");
  }
  kv_store_ref const ref = store.ref();
  std::vector<float> out(static_cast<std::size_t>(c.length()), 0.0f);
  dispatch_dtype(store.store_dtype(), [&](auto tag) {
    using S          = typename decltype(tag)::type;
    auto const* pool = static_cast<S const*>(ref.pool);
    std::vector<S> k_rows(static_cast<std::size_t>(ref.row_elements()));
    std::vector<S> v_rows(k_rows.size());
    for (composed_segment const& s : c.segments) {
      fact_record const& fact = store.at(s.fact_id);
      for (std::int32_t j = 0; j < s.length; ++j) {
        std::int64_t const t   = store.store_token(fact, j);
        std::int64_t const row = s.begin + j;
        S const* k_row         = nullptr;
        S const* v_row         = nullptr;
        if (ref.compression == kv_compression::none) {
          k_row = pool + ref.row_offset(t, layer, 0);
          v_row = pool + ref.row_offset(t, layer, 1);
        } else {  // the rows as injection reads them: dequantized to the store dtype
          std::int64_t const page = t / ref.page_size;
          auto const in_page      = static_cast<std::int32_t>(t % ref.page_size);
          for (std::int32_t kv = 0; kv < 2; ++kv) {
            auto const* block =
              static_cast<unsigned char const*>(ref.pool) + ref.block_offset(page, layer, kv);
            for (std::int32_t h = 0; h < g.num_kv_heads; ++h) {
              detail::dequantize_run(ref.blocks(),
                                     block,
                                     kv,
                                     in_page,
                                     h,
                                     0,
                                     g.head_dim,
                                     (kv == 0 ? k_rows : v_rows).data() + h * g.head_dim);
            }
          }
          k_row = k_rows.data();
          v_row = v_rows.data();
        }
        double sum = 0.0;
        for (std::int32_t h = 0; h < g.num_kv_heads; ++h) {
          for (std::int32_t d = 0; d < g.head_dim; ++d) {
            double const dk = double(to_float(k_row[h * g.head_dim + d])) - keys(row, h, d);
            double const dv = double(to_float(v_row[h * g.head_dim + d])) - values(row, h, d);
            sum += dk * dk + dv * dv;
          }
        }
        out[static_cast<std::size_t>(row)] = static_cast<float>(sum);
      }
    }
  });
  return out;
}

}  // namespace inferscale
