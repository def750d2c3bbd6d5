/**
 * @file encoding_plan.hpp
 * @brief Context-window encoding planner: decides which token sequences the model runs to encode a
 * conversation's facts, each fact seeing at least the `w` conversation turns before it (paper,
 * Section 4.3). C++17, host only; pure logic (running a plan through a model adapter into a
 * kv_store is encoding.hpp).
 *
 * ## What a plan is
 *
 * An *encoding job* is one *trunk* (a token sequence at positions `first_position ..`) with
 * *branches*: each branch is one fact whose tokens continue the trunk after its first `attach`
 * tokens, at positions `first_position + attach ..`, and see only those trunk tokens (not the
 * rest of the trunk, not the other branches). Only the branches' K and V are kept; the trunk is
 * thrown away. An engine that can branch a sequence's cache (llama.cpp: `llama_memory_seq_cp`,
 * vLLM/SGLang: prefix sharing) runs a job as one trunk forward plus the branches; any other engine
 * runs each branch as its own forward over `trunk[0, attach) + fact` with the same result.
 *
 * ## The context a fact sees
 *
 * A fact extracted from turn `t` (its earliest source turn) attaches where turn `t` would start:
 * after turn `t - 1`, and after the header of `t`'s session if turn `t` opens a session. The trunk
 * starts with the conversation's `lead` tokens (a system prompt; may be empty), then turns
 * `a, a+1, ..`; a session's header (e.g. its date) is written before the trunk's first turn and
 * before every turn that opens a session. With `w = 0` a fact sees the lead only.
 *
 * ## Strategies (forward tokens counted with plan_stats)
 *
 * | strategy | jobs | every fact sees |
 * |---|---|---|
 * | per_fact | one per fact, trunk = its window `[t-w, t)` (the paper) | exactly `min(w, t)` turns
 * | | shared_window | one per source turn: its facts are sibling branches of one window | exactly
 * `min(w, t)` turns | | aligned | one per window start rounded down to `stride`: trunk `[a,
 * t_max)`, facts branch at their own turn | `[a, t)` ⊇ `[t-w, t)` | | single_pass | one causal pass
 * over the conversation, cut into segments that fit `max_sequence_tokens`, consecutive segments
 * overlapping by `w` turns | `[a, t)` ⊇ `[t-w, t)` |
 *
 * ## Which turns a fact's K/V depend on (the fact lifecycle)
 *
 * A branch sees `trunk[0, attach)`: the lead, then turns `[first_turn, source_turn)` with the
 * session headers written among them (and the header of `source_turn`'s session when that turn
 * opens a session after the window's first turn). So its K/V depend on exactly the turns
 * `[b.first_turn, b.source_turn)` of the conversation — the same rule for every strategy, which
 * only decides `first_turn`:
 *  - per_fact, shared_window: `max(0, t - w)` (`t` when `w == 0`);
 *  - aligned: `max(0, t - w)` rounded down to a multiple of the stride (`t` when `w == 0`);
 *  - single_pass: the start of the fact's segment, `max(0, t0 - w)` for the anchor `t0` of the
 *    segment's first fact (a later fact of a long segment sees every turn since then: with an
 *    unbounded budget, a fact at turn `t` of a one-segment pass sees turns `[0, t)`).
 * A fact's own source turn is not in its window (it attaches where that turn would start), and
 * neither is any later turn. Changing the tokens of turn `u` (sessions unchanged) therefore changes
 * the K/V of exactly the facts with `first_turn <= u < source_turn`, and moves no other fact's
 * attach point or position; memory::update_turns re-encodes those with plan_encoding_at().
 */
#pragma once

#include <inferscale/error.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

/// @brief One conversation turn as the model reads it (e.g. the tokens of "Caroline: Hi!\n").
struct conversation_turn {
  std::vector<std::int32_t> token_ids;
  std::int32_t session{0};  ///< session index, non-decreasing along the conversation
};

/// @brief A conversation to encode facts from.
struct conversation {
  std::vector<std::int32_t> lead;  ///< every encoding sequence starts with these (may be empty)
  /// Header of session `s` (e.g. its date line), written before the first turn of `s` that a
  /// sequence holds; empty vector: no headers at all, otherwise one entry per session.
  std::vector<std::vector<std::int32_t>> session_headers;
  std::vector<conversation_turn> turns;
};

/// @brief A fact to encode: its tokens and the turn(s) it was extracted from.
struct conversation_fact {
  std::uint64_t fact_id{};
  std::uint64_t namespace_id{};
  std::vector<std::int32_t> token_ids;
  std::vector<std::int64_t> source_turns;  ///< indices into conversation::turns; the earliest
                                           ///< is the turn the window precedes
};

/// @brief How the planner lays facts out in encoding sequences (see the file comment).
enum class encoding_strategy : std::uint8_t { per_fact, shared_window, aligned, single_pass };

inline char const* to_string(encoding_strategy s) noexcept
{
  switch (s) {
    case encoding_strategy::per_fact: return "per_fact";
    case encoding_strategy::shared_window: return "shared_window";
    case encoding_strategy::aligned: return "aligned";
    case encoding_strategy::single_pass: return "single_pass";
  }
  return "?";
}

/// @brief Knobs of plan_encoding().
struct encoding_options {
  std::int64_t window{20};  ///< w: conversation turns every fact sees before its source turn
  encoding_strategy strategy{encoding_strategy::single_pass};
  std::int64_t stride{0};  ///< aligned: window starts are rounded down to a multiple (0 = w)
  /// Longest sequence a job may need (trunk prefix + its longest branch): the engine's context.
  /// 0 = unbounded (then single_pass is one pass per conversation).
  std::int64_t max_sequence_tokens{0};
  std::int64_t first_position{0};  ///< position of every trunk's first token
};

/// @brief One fact of a job: continues the trunk after `attach` tokens.
struct encoding_branch {
  std::uint64_t fact_id{};
  std::uint64_t namespace_id{};
  std::vector<std::int32_t> token_ids;
  std::int64_t attach{};       ///< the fact sees trunk tokens [0, attach)
  std::int64_t position{};     ///< position of its first token (first_position + attach)
  std::int64_t first_turn{};   ///< the turns it sees: [first_turn, source_turn)
  std::int64_t source_turn{};  ///< its earliest source turn
};

/// @brief One forward's worth of work: a trunk and the facts branching off it.
struct encoding_job {
  std::int64_t first_position{};
  std::vector<std::int32_t> trunk;  ///< ends at the last branch's attach point
  std::vector<encoding_branch> branches;
  std::int64_t first_turn{};  ///< the trunk holds turns [first_turn, end_turn)
  std::int64_t end_turn{};

  /// @brief Tokens a branching engine runs: the trunk once, every branch once.
  std::int64_t forward_tokens() const noexcept
  {
    std::int64_t n = static_cast<std::int64_t>(trunk.size());
    for (encoding_branch const& b : branches) {
      n += static_cast<std::int64_t>(b.token_ids.size());
    }
    return n;
  }
  /// @brief Tokens an engine without branching runs: `attach + fact` per branch.
  std::int64_t unbranched_tokens() const noexcept
  {
    std::int64_t n = 0;
    for (encoding_branch const& b : branches) {
      n += b.attach + static_cast<std::int64_t>(b.token_ids.size());
    }
    return n;
  }
  /// @brief The longest sequence the job needs at once (trunk prefix + branch).
  std::int64_t longest_sequence() const noexcept
  {
    std::int64_t n = 0;
    for (encoding_branch const& b : branches) {
      n = std::max(n, b.attach + static_cast<std::int64_t>(b.token_ids.size()));
    }
    return n;
  }
};

/// @brief Totals of a plan.
struct encoding_stats {
  std::int64_t jobs{0};
  std::int64_t facts{0};
  std::int64_t trunk_tokens{0};       ///< context tokens run (thrown away)
  std::int64_t fact_tokens{0};        ///< kept tokens
  std::int64_t forward_tokens{0};     ///< trunk + fact tokens: a branching engine's cost
  std::int64_t unbranched_tokens{0};  ///< the cost without branching
  std::int64_t longest_sequence{0};
};

/// @brief The output of plan_encoding(): jobs in conversation order.
struct encoding_plan {
  encoding_options options{};
  std::vector<encoding_job> jobs;

  encoding_stats stats() const noexcept
  {
    encoding_stats s;
    s.jobs = static_cast<std::int64_t>(jobs.size());
    for (encoding_job const& j : jobs) {
      s.facts += static_cast<std::int64_t>(j.branches.size());
      s.trunk_tokens += static_cast<std::int64_t>(j.trunk.size());
      s.forward_tokens += j.forward_tokens();
      s.unbranched_tokens += j.unbranched_tokens();
      s.longest_sequence = std::max(s.longest_sequence, j.longest_sequence());
    }
    s.fact_tokens = s.forward_tokens - s.trunk_tokens;
    return s;
  }
};

namespace detail::encoding {

/// @brief Builds trunks over a validated conversation.
class trunk_builder {
 public:
  explicit trunk_builder(conversation const& c) : c_{&c} {}

  std::int64_t turns() const noexcept { return static_cast<std::int64_t>(c_->turns.size()); }

  /// @brief True when a header goes before turn `u` of a trunk starting at `a`.
  bool header_before(std::int64_t a, std::int64_t u) const noexcept
  {
    if (c_->session_headers.empty() || u >= turns()) { return false; }
    return u == a || c_->turns[static_cast<std::size_t>(u)].session !=
                       c_->turns[static_cast<std::size_t>(u - 1)].session;
  }
  std::vector<std::int32_t> const& header_of(std::int64_t u) const
  {
    return c_
      ->session_headers[static_cast<std::size_t>(c_->turns[static_cast<std::size_t>(u)].session)];
  }

  /// @brief Tokens of a trunk starting at turn `a` up to the attach point of turn `t` (a <= t).
  std::int64_t attach_length(std::int64_t a, std::int64_t t) const
  {
    std::int64_t n = static_cast<std::int64_t>(c_->lead.size());
    for (std::int64_t u = a; u < t; ++u) {
      if (header_before(a, u)) { n += static_cast<std::int64_t>(header_of(u).size()); }
      n += static_cast<std::int64_t>(c_->turns[static_cast<std::size_t>(u)].token_ids.size());
    }
    if (t > a && header_before(a, t)) { n += static_cast<std::int64_t>(header_of(t).size()); }
    return n;
  }

  /// @brief The trunk from turn `a` to the attach point of turn `b` (a <= b), and the attach
  /// point of every turn t in [a, b] (index t - a). Turn t attaches after turn t - 1 and after the
  /// header of t when t opens a session; t == a attaches after the lead (an empty window).
  std::vector<std::int32_t> build(std::int64_t a,
                                  std::int64_t b,
                                  std::vector<std::int64_t>& attach) const
  {
    std::vector<std::int32_t> out(c_->lead.begin(), c_->lead.end());
    attach.assign(static_cast<std::size_t>(b - a + 1), 0);
    attach[0] = static_cast<std::int64_t>(out.size());
    for (std::int64_t u = a; u < b; ++u) {
      if (u == a && header_before(a, u)) {
        auto const& h = header_of(u);
        out.insert(out.end(), h.begin(), h.end());
      }
      auto const& tok = c_->turns[static_cast<std::size_t>(u)].token_ids;
      out.insert(out.end(), tok.begin(), tok.end());
      std::int64_t const t = u + 1;
      if (header_before(a, t)) {
        auto const& h = header_of(t);
        out.insert(out.end(), h.begin(), h.end());
      }
      attach[static_cast<std::size_t>(t - a)] = static_cast<std::int64_t>(out.size());
    }
    return out;
  }

 private:
  conversation const* c_;
};

inline std::int64_t anchor_of(conversation_fact const& f)
{
  return *std::min_element(f.source_turns.begin(), f.source_turns.end());
}

inline void validate(conversation const& c,
                     std::vector<conversation_fact> const& facts,
                     encoding_options const& o)
{
  INFERSCALE_EXPECTS(
    o.window >= 0,
    "plan_encoding: the window w must be non-negative, got " + std::to_string(o.window));
  INFERSCALE_EXPECTS(
    o.stride >= 0,
    "plan_encoding: the stride must be non-negative, got " + std::to_string(o.stride));
  INFERSCALE_EXPECTS(o.max_sequence_tokens >= 0,
                     "plan_encoding: max_sequence_tokens must be non-negative, got " +
                       std::to_string(o.max_sequence_tokens));
  INFERSCALE_EXPECTS(o.first_position >= 0,
                     "plan_encoding: the first position must be non-negative, got " +
                       std::to_string(o.first_position));
  std::int32_t previous = 0;
  for (std::size_t u = 0; u < c.turns.size(); ++u) {
    conversation_turn const& turn = c.turns[u];
    INFERSCALE_EXPECTS(!turn.token_ids.empty(),
                       "plan_encoding: turn " + std::to_string(u) + " has no tokens");
    INFERSCALE_EXPECTS(turn.session >= previous,
                       "plan_encoding: turn " + std::to_string(u) + " is in session " +
                         std::to_string(turn.session) + " after a turn of session " +
                         std::to_string(previous) + " (sessions must not decrease)");
    INFERSCALE_EXPECTS(c.session_headers.empty() ||
                         turn.session < static_cast<std::int32_t>(c.session_headers.size()),
                       "plan_encoding: turn " + std::to_string(u) + " is in session " +
                         std::to_string(turn.session) + " but only " +
                         std::to_string(c.session_headers.size()) + " session headers are given");
    previous = turn.session;
  }
  std::unordered_set<std::uint64_t> ids;
  for (conversation_fact const& f : facts) {
    std::string const which = "plan_encoding: fact " + std::to_string(f.fact_id);
    INFERSCALE_EXPECTS(!f.token_ids.empty(), which + " has no tokens");
    INFERSCALE_EXPECTS(!f.source_turns.empty(), which + " names no source turn");
    for (std::int64_t t : f.source_turns) {
      INFERSCALE_EXPECTS(t >= 0 && t < static_cast<std::int64_t>(c.turns.size()),
                         which + ": source turn " + std::to_string(t) + " is not one of the " +
                           std::to_string(c.turns.size()) + " turns");
    }
    INFERSCALE_EXPECTS(ids.insert(f.fact_id).second, which + " appears twice");
  }
}

inline void check_fits(encoding_job const& job, encoding_options const& o)
{
  if (o.max_sequence_tokens == 0) { return; }
  for (encoding_branch const& b : job.branches) {
    std::int64_t const n = b.attach + static_cast<std::int64_t>(b.token_ids.size());
    INFERSCALE_EXPECTS(n <= o.max_sequence_tokens,
                       "plan_encoding: fact " + std::to_string(b.fact_id) + " needs " +
                         detail::count_of(n, "token") + " (its " + std::to_string(o.window) +
                         "-turn window and itself), more than max_sequence_tokens = " +
                         std::to_string(o.max_sequence_tokens));
  }
}

/// @brief A job over turns [a, ..) for `facts[members]` (anchors >= a), trunk to the largest
/// anchor; every branch attaches at its anchor's attach point. Refuses a branch over the budget.
inline encoding_job make_job(trunk_builder const& builder,
                             std::vector<conversation_fact> const& facts,
                             std::int64_t a,
                             std::vector<std::size_t> const& members,
                             encoding_options const& options)
{
  std::int64_t b = a;
  for (std::size_t i : members) {
    b = std::max(b, anchor_of(facts[i]));
  }
  encoding_job job;
  job.first_position = options.first_position;
  job.first_turn     = a;
  job.end_turn       = b;
  std::vector<std::int64_t> attach;
  job.trunk = builder.build(a, b, attach);
  for (std::size_t i : members) {
    conversation_fact const& f = facts[i];
    std::int64_t const t       = anchor_of(f);
    encoding_branch br;
    br.fact_id      = f.fact_id;
    br.namespace_id = f.namespace_id;
    br.token_ids    = f.token_ids;
    br.attach       = attach[static_cast<std::size_t>(t - a)];
    br.position     = options.first_position + br.attach;
    br.first_turn   = a;
    br.source_turn  = t;
    job.branches.push_back(std::move(br));
  }
  check_fits(job, options);
  return job;
}

}  // namespace detail::encoding

/**
 * @brief Plans the encoding of `facts` of conversation `c` (see the file comment).
 *
 * Deterministic; facts keep their relative order within a job's branches. Every fact appears in
 * exactly one job; its branch's `token_ids` are the fact's tokens.
 *
 * @throw logic_error for a negative window, stride, budget or position, a turn without tokens,
 *        decreasing sessions, a session without a header (when headers are given), a fact without
 *        tokens or source turn, a source turn outside the conversation, a repeated fact id, or a
 *        fact whose window and tokens do not fit `max_sequence_tokens`.
 */
inline encoding_plan plan_encoding(conversation const& c,
                                   std::vector<conversation_fact> const& facts,
                                   encoding_options const& options = {})
{
  detail::encoding::validate(c, facts, options);
  using detail::encoding::anchor_of;
  detail::encoding::trunk_builder const builder{c};
  std::int64_t const w = options.window;

  // Facts in conversation order of their anchor (stable: given order within a turn).
  std::vector<std::size_t> order(facts.size());
  for (std::size_t i = 0; i < order.size(); ++i) {
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    return anchor_of(facts[x]) < anchor_of(facts[y]);
  });

  encoding_plan plan;
  plan.options = options;

  // Builds a job over turns [a, ..) for the facts `members` (anchors >= a), trunk to the largest.
  auto make_job = [&](std::int64_t a, std::vector<std::size_t> const& members) {
    plan.jobs.push_back(detail::encoding::make_job(builder, facts, a, members, options));
  };
  auto window_start = [&](std::int64_t t) { return std::max<std::int64_t>(0, t - w); };

  switch (options.strategy) {
    case encoding_strategy::per_fact:
      for (std::size_t i : order) {
        make_job(w == 0 ? anchor_of(facts[i]) : window_start(anchor_of(facts[i])), {i});
      }
      break;
    case encoding_strategy::shared_window: {
      std::size_t i = 0;
      while (i < order.size()) {
        std::int64_t const t = anchor_of(facts[order[i]]);
        std::vector<std::size_t> members;
        while (i < order.size() && anchor_of(facts[order[i]]) == t) {
          members.push_back(order[i++]);
        }
        make_job(w == 0 ? t : window_start(t), members);
      }
      break;
    }
    case encoding_strategy::aligned: {
      std::int64_t const stride =
        options.stride > 0 ? options.stride : std::max<std::int64_t>(1, w);
      std::map<std::int64_t, std::vector<std::size_t>> groups;
      for (std::size_t i : order) {
        std::int64_t const t = anchor_of(facts[i]);
        std::int64_t const a = w == 0 ? t : window_start(t) / stride * stride;
        groups[a].push_back(i);
      }
      for (auto const& [a, members] : groups) {
        make_job(a, members);
      }
      break;
    }
    case encoding_strategy::single_pass: {
      std::int64_t const budget = options.max_sequence_tokens;
      std::size_t i             = 0;
      while (i < order.size()) {
        std::int64_t const a = window_start(anchor_of(facts[order[i]]));
        std::vector<std::size_t> members;
        while (i < order.size()) {
          conversation_fact const& f = facts[order[i]];
          std::int64_t const t       = anchor_of(f);
          std::int64_t const need =
            builder.attach_length(a, t) + static_cast<std::int64_t>(f.token_ids.size());
          if (!members.empty() && budget > 0 && need > budget) { break; }
          members.push_back(order[i++]);
        }
        make_job(a, members);  // check_fits refuses a lone fact that does not fit
      }
      break;
    }
  }
  return plan;
}

// ------------------------------------------------------------------------------------------------
// Re-planning facts with known windows (the fact lifecycle, memory.hpp)

/**
 * @brief The first turn of the window plan_encoding() gives a fact anchored at turn `anchor` when
 * it is planned alone: `max(0, anchor - w)`, rounded down to the stride for `aligned`, and
 * `anchor` itself when `w == 0`.
 *
 * For per_fact, shared_window and aligned this is also the window the fact gets among other
 * facts (their window starts depend on the anchor only). For single_pass it is a lower bound on
 * the fact's context only when the fact opens its segment: a later fact of a segment keeps the
 * segment's start, `max(0, t0 - w)` for the anchor `t0` of the segment's first fact, and so sees
 * more turns. The branch a plan made (encoding_branch::first_turn) is therefore the record to
 * keep; this function is for a fact that was never planned with others (e.g. a superseding fact
 * from a new source turn).
 * @throw logic_error for a negative anchor or invalid options (as plan_encoding).
 */
inline std::int64_t planned_window_start(encoding_options const& options, std::int64_t anchor)
{
  INFERSCALE_EXPECTS(
    anchor >= 0,
    "planned_window_start: the anchor turn must be non-negative, got " + std::to_string(anchor));
  INFERSCALE_EXPECTS(options.window >= 0 && options.stride >= 0,
                     "planned_window_start: the window and the stride must be non-negative, got " +
                       std::to_string(options.window) + " and " + std::to_string(options.stride));
  std::int64_t const w = options.window;
  if (w == 0) { return anchor; }
  std::int64_t const a = std::max<std::int64_t>(0, anchor - w);
  if (options.strategy != encoding_strategy::aligned) { return a; }
  std::int64_t const stride = options.stride > 0 ? options.stride : std::max<std::int64_t>(1, w);
  return a / stride * stride;
}

/**
 * @brief Plans `facts` of conversation `c` behind windows that are already decided: fact `i`
 * attaches at its anchor (earliest source turn) `t` behind turns `[first_turns[i], t)`, exactly
 * as a branch of plan_encoding() with `first_turn == first_turns[i]` attaches (same trunk
 * prefix, same attach point, same position), whatever the strategy in `options`.
 *
 * This is how a fact is re-encoded with the window it was first planned with after the
 * conversation changed (memory::update_turns) or its text changed (memory::update_fact): a fresh
 * plan_encoding() of only the affected facts would regroup single_pass segments and give them
 * other windows. One job per distinct first turn, in increasing order; within a job the facts
 * keep their given order.
 *
 * @throw logic_error as plan_encoding, and if `first_turns` differs in length from `facts` or a
 *        first turn is negative or after its fact's anchor.
 */
inline encoding_plan plan_encoding_at(conversation const& c,
                                      std::vector<conversation_fact> const& facts,
                                      std::vector<std::int64_t> const& first_turns,
                                      encoding_options const& options = {})
{
  detail::encoding::validate(c, facts, options);
  INFERSCALE_EXPECTS(first_turns.size() == facts.size(),
                     "plan_encoding_at: " + std::to_string(facts.size()) + " facts but " +
                       std::to_string(first_turns.size()) + " first turns");
  std::map<std::int64_t, std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < facts.size(); ++i) {
    std::int64_t const t = detail::encoding::anchor_of(facts[i]);
    INFERSCALE_EXPECTS(first_turns[i] >= 0 && first_turns[i] <= t,
                       "plan_encoding_at: fact " + std::to_string(facts[i].fact_id) +
                         "'s window starts at turn " + std::to_string(first_turns[i]) +
                         ", outside [0, " + std::to_string(t) + "] (its anchor turn)");
    groups[first_turns[i]].push_back(i);
  }
  detail::encoding::trunk_builder const builder{c};
  encoding_plan plan;
  plan.options = options;
  for (auto const& [a, members] : groups) {
    plan.jobs.push_back(detail::encoding::make_job(builder, facts, a, members, options));
  }
  return plan;
}

}  // namespace inferscale
