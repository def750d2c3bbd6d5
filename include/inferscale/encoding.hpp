/**
 * @file encoding.hpp
 * @brief Context-window encoding, the executor: runs an encoding plan (encoding_plan.hpp, the
 * planner, included here) through a model adapter into a kv_store (encode_plan), or keeps the
 * facts' K/V in host memory (capture_plan). C++17, host only; pure logic apart from the adapter
 * calls.
 */
#pragma once

#include <inferscale/encoding_plan.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/error.hpp>
#include <inferscale/store.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

// ------------------------------------------------------------------------------------------------
// Executing a plan

namespace detail {
template <class, class = void>
struct has_encode_branches : std::false_type {
};
template <class M>
struct has_encode_branches<M,
                           std::void_t<decltype(std::declval<M&>().encode_branches(
                             std::declval<std::vector<std::int32_t> const&>(),
                             std::int64_t{},
                             std::declval<std::vector<encoding_branch> const&>(),
                             std::declval<kv_capture&>()))>> : std::true_type {
};
}  // namespace detail

namespace detail {
/// @brief Refuses a branch that is empty, attaches outside its trunk or sits at another position.
inline void check_branch(encoding_job const& job,
                         encoding_branch const& b,
                         std::string const& which)
{
  INFERSCALE_EXPECTS(!b.token_ids.empty(), which + " has no tokens");
  INFERSCALE_EXPECTS(b.attach >= 0 && b.attach <= static_cast<std::int64_t>(job.trunk.size()),
                     which + " attaches at " + std::to_string(b.attach) +
                       ", outside its trunk of " +
                       detail::count_of(static_cast<std::int64_t>(job.trunk.size()), "token"));
  INFERSCALE_EXPECTS(b.position == job.first_position + b.attach,
                     which + " is at position " + std::to_string(b.position) +
                       ", its attach point is position " +
                       std::to_string(job.first_position + b.attach));
}

/// @brief Tokens [begin, begin + count) of `src` as a capture of their own (all layers).
inline kv_capture copy_capture_rows(kv_capture const& src, std::int64_t begin, std::int64_t count)
{
  kv_geometry const g = src.geometry();
  kv_capture out{g, count};
  fact_kv_view<float const> const k = src.keys(begin, count);
  fact_kv_view<float const> const v = src.values(begin, count);
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    out.write_keys(
      l,
      0,
      make_token_head_view<float const>(
        &k(l, 0, 0, 0), count, g.num_kv_heads, g.head_dim, k.stride(1), k.stride(2), k.stride(3)));
    out.write_values(
      l,
      0,
      make_token_head_view<float const>(
        &v(l, 0, 0, 0), count, g.num_kv_heads, g.head_dim, v.stride(1), v.stride(2), v.stride(3)));
  }
  return out;
}
}  // namespace detail

/**
 * @brief True when model adapter M can run a trunk once and branch facts off it:
 * `void M::encode_branches(trunk, first_position, branches, kv_capture& out)` runs `trunk` at
 * positions `first_position ..` (not captured) and every branch `b` at `b.position ..` seeing only
 * `trunk[0, b.attach)`, and hands the branches' pre-RoPE K and V to `out`, rows in branch order
 * (branch 0's tokens first).
 */
template <class M>
inline constexpr bool has_encode_branches_v = detail::has_encode_branches<M>::value;

/// @brief What encode_plan() ran.
struct encode_report {
  std::int64_t jobs{0};
  std::int64_t facts{0};
  std::int64_t forward_tokens{0};  ///< tokens the model adapter ran
  bool branched{false};            ///< true: the adapter's encode_branches was used
};

/**
 * @brief Runs an encoding plan through a model adapter and stores every fact's captured K/V in
 * `store` under its id and namespace.
 *
 * Everything is checked before the first forward: fact ids new to the store and distinct, every
 * branch's attach point inside its trunk and its position equal to `first_position + attach`,
 * enough free pages for all facts. With an adapter that has encode_branches() (see
 * has_encode_branches_v) each job is one trunk forward plus its branches; otherwise each branch is
 * one encode() of `trunk[0, attach) + fact`. All or nothing: if the adapter throws part-way, the
 * facts this call stored are erased again.
 *
 * @throw logic_error naming the problem (the store is then unchanged); whatever the adapter throws.
 */
template <class ModelAdapter>
encode_report encode_plan(ModelAdapter& model, kv_store& store, encoding_plan const& plan)
{
  static_assert(is_model_adapter_v<ModelAdapter>,
                "encode_plan: ModelAdapter needs geometry(), rotation() and "
                "encode(tokens, first_position, kv_capture&) (see engine.hpp)");
  INFERSCALE_EXPECTS(model.geometry() == store.geometry(),
                     std::string{"encode_plan: the model's KV geometry differs from the store's"});
  std::unordered_set<std::uint64_t> ids;
  std::int64_t pages = 0;
  for (encoding_job const& job : plan.jobs) {
    for (encoding_branch const& b : job.branches) {
      std::string const which = "encode_plan: fact " + std::to_string(b.fact_id);
      detail::check_branch(job, b, which);
      INFERSCALE_EXPECTS(!store.contains(b.fact_id), which + " is already stored");
      INFERSCALE_EXPECTS(ids.insert(b.fact_id).second, which + " appears twice in the plan");
      pages += store.pages_for(static_cast<std::int64_t>(b.token_ids.size()));
    }
  }
  INFERSCALE_EXPECTS(pages <= store.free_pages(),
                     "encode_plan: the facts need " + detail::count_of(pages, "page") + ", " +
                       std::to_string(store.free_pages()) + " free (capacity exhausted)");

  encode_report report;
  report.branched = has_encode_branches_v<ModelAdapter>;
  std::vector<std::uint64_t> stored;
  try {
    for (encoding_job const& job : plan.jobs) {
      if (job.branches.empty()) { continue; }
      ++report.jobs;
      if constexpr (has_encode_branches_v<ModelAdapter>) {
        std::int64_t rows = 0;
        std::vector<captured_fact> keep;
        for (encoding_branch const& b : job.branches) {
          keep.push_back({b.fact_id, b.namespace_id, rows, b.token_ids});
          rows += static_cast<std::int64_t>(b.token_ids.size());
        }
        kv_capture capture{model.geometry(), rows};
        model.encode_branches(job.trunk, job.first_position, job.branches, capture);
        store_captured_facts(store, capture, keep);
        report.forward_tokens += job.forward_tokens();
        for (captured_fact const& f : keep) {
          stored.push_back(f.fact_id);
        }
      } else {
        for (encoding_branch const& b : job.branches) {
          std::vector<std::int32_t> tokens(job.trunk.begin(), job.trunk.begin() + b.attach);
          tokens.insert(tokens.end(), b.token_ids.begin(), b.token_ids.end());
          kv_capture capture{model.geometry(), static_cast<std::int64_t>(tokens.size())};
          model.encode(tokens, job.first_position, capture);
          store_captured_facts(
            store, capture, {{b.fact_id, b.namespace_id, b.attach, b.token_ids}});
          report.forward_tokens += static_cast<std::int64_t>(tokens.size());
          stored.push_back(b.fact_id);
        }
      }
      report.facts += static_cast<std::int64_t>(job.branches.size());
    }
  } catch (...) {
    for (std::uint64_t id : stored) {
      store.erase(id);
    }
    throw;
  }
  return report;
}

/**
 * @brief A plan's facts encoded but not stored: fact `i` is `facts[i]` (its id, namespace and
 * token ids; `begin == 0`) and its pre-RoPE K/V are the whole of `captures[i]` (fp32, only the
 * fact's own rows: the context rows of the forward are dropped).
 */
struct captured_plan {
  std::vector<captured_fact> facts;  ///< in plan order: job by job, branch by branch
  std::vector<kv_capture> captures;  ///< one per fact, `facts[i].token_ids.size()` tokens
  encode_report report{};            ///< what the adapter ran
};

/**
 * @brief Runs a plan through a model adapter, as encode_plan() does, but keeps every fact's K/V
 * in host memory instead of storing it, so a caller can validate everything, run the model, and
 * only then change the store (the fact lifecycle in memory.hpp replaces stored facts this way).
 *
 * Host memory held: `2 * L * h * d * 4` bytes per fact token (fp32), for the whole plan at once,
 * plus one forward's capture at a time.
 *
 * @throw logic_error (before the first forward) if a branch is empty, attaches outside its trunk
 *        or sits at another position than `first_position + attach`, or ids repeat; after a
 *        forward, if the adapter did not deliver K and V of every layer for a fact's tokens.
 *        Whatever the adapter throws. Nothing outside the returned value is changed.
 */
template <class ModelAdapter>
captured_plan capture_plan(ModelAdapter& model, encoding_plan const& plan)
{
  static_assert(is_model_adapter_v<ModelAdapter>,
                "capture_plan: ModelAdapter needs geometry(), rotation() and "
                "encode(tokens, first_position, kv_capture&) (see engine.hpp)");
  std::unordered_set<std::uint64_t> ids;
  for (encoding_job const& job : plan.jobs) {
    for (encoding_branch const& b : job.branches) {
      std::string const which = "capture_plan: fact " + std::to_string(b.fact_id);
      detail::check_branch(job, b, which);
      INFERSCALE_EXPECTS(ids.insert(b.fact_id).second, which + " appears twice in the plan");
    }
  }
  captured_plan out;
  out.report.branched = has_encode_branches_v<ModelAdapter>;
  auto keep = [&](kv_capture const& capture, encoding_branch const& b, std::int64_t begin) {
    std::int64_t const count = static_cast<std::int64_t>(b.token_ids.size());
    INFERSCALE_EXPECTS(capture.complete(begin, count),
                       "capture_plan: fact " + std::to_string(b.fact_id) +
                         ": the model adapter did not deliver K and V of every layer for its "
                         "tokens");
    out.captures.push_back(detail::copy_capture_rows(capture, begin, count));
    out.facts.push_back({b.fact_id, b.namespace_id, 0, b.token_ids});
  };
  for (encoding_job const& job : plan.jobs) {
    if (job.branches.empty()) { continue; }
    ++out.report.jobs;
    if constexpr (has_encode_branches_v<ModelAdapter>) {
      std::int64_t rows = 0;
      for (encoding_branch const& b : job.branches) {
        rows += static_cast<std::int64_t>(b.token_ids.size());
      }
      kv_capture capture{model.geometry(), rows};
      model.encode_branches(job.trunk, job.first_position, job.branches, capture);
      std::int64_t begin = 0;
      for (encoding_branch const& b : job.branches) {
        keep(capture, b, begin);
        begin += static_cast<std::int64_t>(b.token_ids.size());
      }
      out.report.forward_tokens += job.forward_tokens();
    } else {
      for (encoding_branch const& b : job.branches) {
        std::vector<std::int32_t> tokens(job.trunk.begin(), job.trunk.begin() + b.attach);
        tokens.insert(tokens.end(), b.token_ids.begin(), b.token_ids.end());
        kv_capture capture{model.geometry(), static_cast<std::int64_t>(tokens.size())};
        model.encode(tokens, job.first_position, capture);
        keep(capture, b, b.attach);
        out.report.forward_tokens += static_cast<std::int64_t>(tokens.size());
      }
    }
    out.report.facts += static_cast<std::int64_t>(job.branches.size());
  }
  return out;
}

}  // namespace inferscale
