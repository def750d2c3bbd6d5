/**
 * @file memory_types.hpp
 * @brief The memory facade's vocabulary (memory.hpp): its configuration, the embedder requirement,
 * what the fact lifecycle takes (direct_fact, fact_update, turn_change, fact_context) and what the
 * facade's calls report (memory_add_report, fact_state, lifecycle_report, memory_request), and a
 * request of a scheduler step (memory_step_request).
 */
#pragma once

#include <inferscale/compose.hpp>
#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/index.hpp>
#include <inferscale/store.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace inferscale {

namespace detail {
template <class, class = void>
struct is_embedder : std::false_type {
};
template <class E>
struct is_embedder<
  E,
  std::void_t<decltype(std::declval<E const&>().dimension()),
              decltype(std::declval<E&>().embed(std::declval<std::string const&>()))>>
  : std::conjunction<
      std::is_integral<decltype(std::declval<E const&>().dimension())>,
      std::is_convertible<decltype(std::declval<E&>().embed(std::declval<std::string const&>())),
                          std::vector<float>>> {
};
template <class, class = void>
struct embeds_batches : std::false_type {
};
template <class E>
struct embeds_batches<
  E,
  std::void_t<decltype(std::declval<E&>().embed(std::declval<std::vector<std::string> const&>()))>>
  : std::is_convertible<decltype(std::declval<E&>().embed(
                          std::declval<std::vector<std::string> const&>())),
                        std::vector<std::vector<float>>> {
};
}  // namespace detail

/// @brief True when E provides `dimension()` and `embed(text) -> std::vector<float>`.
template <class E>
inline constexpr bool is_embedder_v = detail::is_embedder<E>::value;

/**
 * @brief True when E also embeds a batch at once: `embed(texts) -> std::vector<std::vector<float>>`
 * (one vector per text, in order). memory::serve_step() then embeds a step's queries with one
 * call, so the embedder can run them as one forward (one launch on a GPU instead of one per
 * query); otherwise one `embed(text)` per request. (On a CPU thread MiniLM's forward is
 * compute-bound: measured 6.6 ms per question batched against 6.1-6.5 alone,
 * bench/results/2026-12-05-tenants-step.md.)
 */
template <class E>
inline constexpr bool embeds_batches_v = detail::embeds_batches<E>::value;

/// @brief How a memory is built.
struct memory_config {
  kv_store_config store{};  ///< geometry, dtype, capacity and placement of the fact KV
  index_config index{};     ///< dim must be the embedder's dimension
  search_params search{};   ///< used by retrieve() and serve()
  /// Layout of retrieved facts in the segment; best_last, the library's one default (as
  /// compose_options::order).
  fact_order order{fact_order::best_last};
};

/// @brief What add_conversation() (or add_facts()) did.
struct memory_add_report {
  encoding_stats plan{};     ///< the encoding plan's token counts
  encode_report encode{};    ///< what the model adapter ran
  std::int64_t embedded{0};  ///< fact texts embedded
  /// The handle of the conversation kept for the fact lifecycle (update_turns, conversation_of);
  /// 0 from add_facts(), which has no conversation, and for a conversation without facts.
  std::uint64_t conversation{0};
};

// ------------------------------------------------------------------------------------------------
// Fact lifecycle: types (memory::update_fact, update_turns, reencode_facts, erase_fact)

/**
 * @brief What the memory knows of one fact's life: where its K/V came from, which turns they saw,
 * and which fact supersedes which.
 *
 * A *superseded* fact (`superseded_by` set) is kept in the store for audit — `store().at(id)` and
 * its pool bytes are as they were — but is no longer in the index, so retrieve() and serve() never
 * return it and prepare() refuses it; erase_fact() removes it. `supersedes` / `superseded_by` are
 * history: they may name a fact erased since (tracks() tells).
 */
struct fact_state {
  std::uint64_t fact_id{};
  std::uint64_t namespace_id{};
  /// The conversation it was planned from (memory_add_report::conversation); empty for a fact
  /// added directly (add_facts), whose window is the caller's.
  std::optional<std::uint64_t> conversation;
  std::int64_t first_turn{0};   ///< planned: its window is turns [first_turn, source_turn)
  std::int64_t source_turn{0};  ///< planned: its earliest source turn (where it attaches)
  /// The turns its K/V saw: planned, `first_turn .. source_turn - 1`; direct, as the caller said.
  std::vector<std::int64_t> turns;
  std::optional<std::uint64_t> supersedes;     ///< the older fact this one replaced
  std::optional<std::uint64_t> superseded_by;  ///< set: kept for audit only

  /// @brief True unless superseded: the fact is in the index.
  bool retrievable() const noexcept { return !superseded_by.has_value(); }
};

/**
 * @brief A fact encoded by the caller's own sequence, where no planner is involved: one forward
 * over `context + token_ids` at positions `first_position ..`, of which the fact's rows are kept.
 */
struct direct_fact {
  std::uint64_t fact_id{};
  std::vector<std::int32_t> context;    ///< what the fact sees before itself (may be empty)
  std::vector<std::int32_t> token_ids;  ///< the fact's tokens
  std::int64_t first_position{0};       ///< position of the sequence's first token
  /// The caller's turns that `context` holds: the map fact -> turns that
  /// direct_facts_seeing_turn() answers from (the memory cannot derive it without a planner).
  std::vector<std::int64_t> turns;
};

/**
 * @brief A new version of a fact: new tokens re-encoded (behind the window its conversation
 * gives, or its direct context) and a new text re-embedded.
 *
 * `new_id == fact_id` replaces the fact in place (store and index, same id); another `new_id`
 * stores the new version under that id and keeps the old one for audit (see fact_state).
 */
struct fact_update {
  std::uint64_t fact_id{};              ///< the fact to update (tracked, not superseded)
  std::uint64_t new_id{};               ///< == fact_id: in place; otherwise the superseding id
  std::vector<std::int32_t> token_ids;  ///< the new tokens
  std::string text;                     ///< the new text (embedded into the index)
  /// Planned facts: the new version's source turns; empty keeps the old ones. With the same
  /// earliest turn the window is kept exactly; with another, it is planned_window_start()'s.
  std::vector<std::int64_t> source_turns;
  /// Direct facts: a new context (empty optional keeps the old one).
  std::optional<std::vector<std::int32_t>> context;
  /// Direct facts: the turns the new context holds (empty optional keeps the old map).
  std::optional<std::vector<std::int64_t>> turns;
};

/// @brief New tokens for one turn of a kept conversation (its session is unchanged).
struct turn_change {
  std::int64_t turn{};
  std::vector<std::int32_t> token_ids;
};

/// @brief A directly added fact's new context, after the caller's conversation changed.
struct fact_context {
  std::uint64_t fact_id{};
  std::vector<std::int32_t> context;
  std::int64_t first_position{0};
  std::optional<std::vector<std::int64_t>> turns;  ///< the new map; empty optional keeps the old
};

/// @brief What a lifecycle call re-encoded.
struct lifecycle_report {
  std::vector<std::uint64_t> reencoded;  ///< ids whose K/V were recomputed, in plan order
  encode_report encode{};                ///< what the model adapter ran
  std::int64_t embedded{0};              ///< texts embedded
};

/// @brief What serve() (or serve_step(), per request) did for one request.
struct memory_request {
  std::vector<std::uint64_t> fact_ids;  ///< retrieved, most relevant first
  composition plan;                     ///< what was injected (prefix first)
};

/**
 * @brief One request of a scheduler step (memory::serve_step): the arguments serve() takes for
 * one request, less the step's embedder, `k` and rotation.
 */
template <class CacheAdapter>
struct memory_step_request {
  std::uint64_t ns{};              ///< the user's namespace
  std::string query;               ///< the question, embedded by the step's embedder
  std::int64_t first_position{0};  ///< position of the memory segment's first token (p0)
  CacheAdapter* cache{nullptr};    ///< the request's sequence (allocate, cache(), commit)
};

}  // namespace inferscale
