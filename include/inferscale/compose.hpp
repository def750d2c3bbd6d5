/**
 * @file compose.hpp
 * @brief Composition (chunked RoPE): the plan laying an instruction prefix and retrieved facts out
 * as one memory segment at virtual positions `p0 .. p0 + m - 1`. Pure host logic.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

namespace inferscale {

/**
 * @brief Order of the retrieved facts in the memory segment.
 *
 * The default everywhere (compose_options::order, memory_config::order) is best_last: retrieval
 * ranks the most relevant fact first, and the layout puts it last, next to the query, as the
 * paper's prototype does. Pass as_given to keep a list's own order.
 */
enum class fact_order : std::uint8_t {
  as_given,   ///< the order of the list
  best_last,  ///< the list is ranked most relevant first; it is laid out reversed, so the most
              ///< relevant fact sits next to the query (the paper's prototype)
};

/// @brief Knobs of compose().
struct compose_options {
  std::int64_t first_position{0};  ///< p0: virtual position of the segment's first token (after
                                   ///< any system prompt the engine already holds)
  fact_order order{fact_order::best_last};          ///< the one default (see fact_order)
  std::optional<std::uint64_t> instruction_prefix;  ///< a stored fact laid out first, if any
};

/// @brief One fact's run of tokens in the segment.
struct composed_segment {
  std::uint64_t fact_id{};
  std::int64_t begin{};   ///< index of its first token within the segment
  std::int32_t length{};  ///< tokens
};

/// @brief Where a segment token comes from.
struct token_source {
  std::uint64_t fact_id{};
  std::int32_t offset{};  ///< token index within the fact
};

/**
 * @brief The plan for one request's memory segment: what the engine's prompt starts with (token
 * ids), where each token's KV comes from, and at which virtual position it goes.
 */
struct composition {
  std::int64_t first_position{};
  std::vector<composed_segment> segments;  ///< in layout order (prefix first)
  std::vector<std::int32_t> token_ids;     ///< the segment's prompt token ids, `m` of them
  std::vector<token_source> sources;       ///< per token

  /// @brief m, the segment's length in tokens.
  std::int64_t length() const noexcept { return static_cast<std::int64_t>(token_ids.size()); }
  /// @brief Virtual position of segment token `j`.
  std::int64_t position(std::int64_t j) const noexcept { return first_position + j; }
};

/**
 * @brief Plans one request's memory segment from facts held by `store`.
 *
 * @param store   holds the prefix and every fact
 * @param facts   fact ids, in the order `options.order` reads them
 * @param options p0, order and the optional instruction prefix
 * @return the plan: prefix (if any), then the facts, each fact's tokens in order
 * @throw logic_error if p0 is negative, a fact (or the prefix) is unknown, a fact appears twice
 *        (or is also the prefix), or the segment's last position p0 + m - 1 is at or beyond
 *        rope_position_limit (2^53, whatever the model: no overflow, exact angles).
 * @note The model's range (rope_params::max_position) is checked where the rotation is known:
 *       injection (injection_batch::run, memory::inject) or rope_check_positions.
 */
inline composition compose(kv_store const& store,
                           std::vector<std::uint64_t> const& facts,
                           compose_options const& options = {})
{
  INFERSCALE_EXPECTS(options.first_position >= 0 && options.first_position < rope_position_limit,
                     "compose: first position p0 must be non-negative and below " +
                       detail::rope_position_limit_text() + "), got " +
                       std::to_string(options.first_position));
  std::vector<std::uint64_t> order;
  order.reserve(facts.size() + 1);
  if (options.instruction_prefix) { order.push_back(*options.instruction_prefix); }
  if (options.order == fact_order::best_last) {
    order.insert(order.end(), facts.rbegin(), facts.rend());
  } else {
    order.insert(order.end(), facts.begin(), facts.end());
  }

  // Validate everything before building.
  std::unordered_set<std::uint64_t> seen;
  std::int64_t total = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    std::uint64_t const id = order[i];
    bool const is_prefix   = options.instruction_prefix && i == 0;
    INFERSCALE_EXPECTS(store.contains(id),
                       std::string{"compose: unknown "} +
                         (is_prefix ? "instruction prefix" : "fact") + " id " + std::to_string(id));
    INFERSCALE_EXPECTS(seen.insert(id).second,
                       "compose: fact id " + std::to_string(id) +
                         " appears twice (a fact, or a fact equal to the instruction prefix)");
    total += store.at(id).length();
  }
  INFERSCALE_EXPECTS(
    total == 0 || total - 1 < rope_position_limit - options.first_position,
    "compose: the last position p0 + m - 1 = " + std::to_string(options.first_position) + " + " +
      std::to_string(total - 1) + " reaches " + detail::rope_position_limit_text() + ")");

  composition plan;
  plan.first_position = options.first_position;
  plan.segments.reserve(order.size());
  plan.token_ids.resize(static_cast<std::size_t>(total));
  plan.sources.resize(static_cast<std::size_t>(total));
  std::size_t next = 0;
  for (std::uint64_t id : order) {
    fact_record const& fact = store.at(id);
    plan.segments.push_back({id, static_cast<std::int64_t>(next), fact.length()});
    std::copy(fact.token_ids.begin(), fact.token_ids.end(), plan.token_ids.begin() + next);
    for (std::int32_t j = 0; j < fact.length(); ++j) {
      plan.sources[next + static_cast<std::size_t>(j)] = {id, j};
    }
    next += static_cast<std::size_t>(fact.length());
  }
  return plan;
}

}  // namespace inferscale
