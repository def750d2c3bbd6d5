/**
 * @file memory.hpp
 * @brief The memory facade: one object per deployment holding the KV store and the fact index,
 * with one namespace per user, tying the pipeline together for an engine integrator.
 *
 * Offline, per conversation: `add_conversation` plans the context-window encoding
 * (encoding.hpp), runs it through the model adapter into the store, and adds each fact's text
 * embedding (from an *embedder adapter*) to the index under the same fact id.
 * Online, per request: `serve` embeds the query, searches the user's namespace for the top k,
 * composes the instruction prefix and those facts at positions `p0 ..` (chunked RoPE) and injects
 * them through the paged-cache adapter; the engine then prefills only the query. `retrieve`,
 * `prepare` and `inject` are the same steps one at a time (a GPU engine calls `prepare` and
 * inject.cuh's `inject_async` itself).
 * Over time (the fact lifecycle): `update_fact` re-encodes and re-embeds a changed fact, in place
 * or under a superseding id that keeps the old version for audit; `update_turns` re-encodes exactly
 * the facts whose encoding window held a changed conversation turn (the memory keeps each added
 * conversation and every fact's window for it); `add_facts` / `reencode_facts` do the same for
 * facts encoded without the planner, from the caller's fact -> turns map; `erase_fact` and
 * `erase_namespace` leave no K/V behind in the store.
 *
 * The library holds no model: an embedder adapter `E` provides
 *  - `std::int64_t E::dimension() const` (any integer type) and
 *  - `std::vector<float> E::embed(std::string const& text)` — one embedding of `dimension()`
 *    values (normalised or not: the index's metric decides how they compare).
 *
 * C++17, host only (the store and the index may still live in device memory; `serve`/`inject`
 * use the host injection path and need a host store).
 */
#pragma once

#include <inferscale/compose.hpp>
#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

namespace detail {
template <class, class = void>
struct is_embedder : std::false_type {
};
template <class E>
struct is_embedder<E,
                   std::void_t<decltype(std::declval<E const&>().dimension()),
                               decltype(std::declval<E&>().embed(std::declval<std::string const&>()))>>
  : std::conjunction<
      std::is_integral<decltype(std::declval<E const&>().dimension())>,
      std::is_convertible<decltype(std::declval<E&>().embed(std::declval<std::string const&>())),
                          std::vector<float>>> {
};
}  // namespace detail

/// @brief True when E provides `dimension()` and `embed(text) -> std::vector<float>`.
template <class E>
inline constexpr bool is_embedder_v = detail::is_embedder<E>::value;

/// @brief How a memory is built.
struct memory_config {
  kv_store_config store{};  ///< geometry, dtype, capacity and placement of the fact KV
  index_config index{};     ///< dim must be the embedder's dimension
  search_params search{};   ///< used by retrieve() and serve()
  fact_order order{fact_order::best_last};  ///< layout of retrieved facts in the segment
};

/// @brief What add_conversation() (or add_facts()) did.
struct memory_add_report {
  encoding_stats plan{};    ///< the encoding plan's token counts
  encode_report encode{};   ///< what the model adapter ran
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

/// @brief What serve() did for one request.
struct memory_request {
  std::vector<std::uint64_t> fact_ids;  ///< retrieved, most relevant first
  composition plan;                     ///< what was injected (prefix first)
};

/**
 * @brief Store + index for many users' memories (see the file comment).
 *
 * Every mutating call validates its input first and leaves the store and the index unchanged when
 * it throws (adapter failures included: facts stored by a failed call are erased again).
 */
class memory {
 public:
  explicit memory(memory_config const& config)
    : config_{config}, store_{config.store}, index_{config.index}
  {
  }

  kv_store& store() noexcept { return store_; }
  kv_store const& store() const noexcept { return store_; }
  graph_index& index() noexcept { return index_; }
  graph_index const& index() const noexcept { return index_; }
  memory_config const& config() const noexcept { return config_; }
  std::optional<std::uint64_t> instruction_prefix() const noexcept { return prefix_; }

  /**
   * @brief Encodes the instruction prefix every request's memory segment starts with (one forward
   * at position 0) and stores it under `fact_id` in namespace `ns` (not indexed: never retrieved).
   * @throw logic_error if a prefix is already set, the id is taken, or as encode_facts.
   */
  template <class ModelAdapter>
  void set_instruction_prefix(ModelAdapter& model,
                              std::vector<std::int32_t> const& tokens,
                              std::uint64_t fact_id,
                              std::uint64_t ns)
  {
    INFERSCALE_EXPECTS(!prefix_.has_value(),
                       "memory::set_instruction_prefix: the prefix is already fact " +
                         std::to_string(prefix_.value_or(0)));
    INFERSCALE_EXPECTS(!index_.contains(fact_id),
                       "memory::set_instruction_prefix: fact id " + std::to_string(fact_id) +
                         " is an indexed fact");
    encode_facts(model, store_, tokens, 0, {{fact_id, ns, 0, tokens}});
    prefix_ = fact_id;
  }

  /**
   * @brief Adds a conversation's facts to namespace `ns`: embeds `texts[i]` (the text of
   * `facts[i]`), plans the context-window encoding with `options`, encodes the facts through the
   * model adapter into the store, and indexes the embeddings under the facts' ids.
   *
   * @throw logic_error (store and index unchanged) if `texts` and `facts` differ in length, a
   *        fact's namespace is not `ns`, an id is already stored or indexed, an embedding has the
   *        wrong dimension or a non-finite value, or as plan_encoding / encode_plan /
   *        graph_index::add; whatever the adapters throw (the store is then restored too).
   */
  template <class ModelAdapter, class Embedder>
  memory_add_report add_conversation(ModelAdapter& model,
                                     Embedder& embedder,
                                     std::uint64_t ns,
                                     conversation const& c,
                                     std::vector<conversation_fact> const& facts,
                                     std::vector<std::string> const& texts,
                                     encoding_options const& options = {})
  {
    static_assert(is_embedder_v<Embedder>,
                  "memory::add_conversation: Embedder needs dimension() and "
                  "embed(std::string const&) -> std::vector<float> (see memory.hpp)");
    INFERSCALE_EXPECTS(texts.size() == facts.size(),
                       "memory::add_conversation: " +
                         detail::count_of(static_cast<std::int64_t>(facts.size()), "fact") + " but " +
                         detail::count_of(static_cast<std::int64_t>(texts.size()), "text"));
    std::vector<std::uint64_t> ids;
    ids.reserve(facts.size());
    for (conversation_fact const& f : facts) {
      std::string const which = "memory::add_conversation: fact " + std::to_string(f.fact_id);
      INFERSCALE_EXPECTS(f.namespace_id == ns,
                         which + " is in namespace " + std::to_string(f.namespace_id) +
                           ", the conversation is added to namespace " + std::to_string(ns));
      INFERSCALE_EXPECTS(!index_.contains(f.fact_id), which + " is already indexed");
      INFERSCALE_EXPECTS(!prefix_ || *prefix_ != f.fact_id, which + " is the instruction prefix");
      ids.push_back(f.fact_id);
    }
    // Everything that can be refused without writing: the plan, then the embeddings.
    encoding_plan const plan = plan_encoding(c, facts, options);
    std::vector<float> vectors = embed_all(embedder, texts, "memory::add_conversation");

    memory_add_report report;
    report.plan     = plan.stats();
    report.embedded = static_cast<std::int64_t>(texts.size());
    report.encode   = encode_plan(model, store_, plan);  // all or nothing
    try {
      index_.add<float>(ns,
                        make_matrix_view<float const>(vectors.data(),
                                                      static_cast<std::int64_t>(ids.size()),
                                                      index_.dim()),
                        cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    } catch (...) {
      for (std::uint64_t id : ids) {
        erase_and_scrub(id);
      }
      throw;
    }
    report.conversation = remember_conversation(ns, c, options, plan);
    return report;
  }

  /**
   * @brief The `k` facts of namespace `ns` nearest to `query` (an embedding), most relevant first
   * (fewer when the namespace holds fewer).
   * @throw logic_error as graph_index::search (unknown namespace, wrong dimension, NaN, k == 0).
   */
  std::vector<std::uint64_t> retrieve(std::uint64_t ns,
                                      std::vector<float> const& query,
                                      std::uint32_t k) const
  {
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(query.size()) == index_.dim(),
                       "memory::retrieve: the query has " + std::to_string(query.size()) +
                         " values, the index " + std::to_string(index_.dim()));
    INFERSCALE_EXPECTS(k > 0, std::string{"memory::retrieve: k must be positive"});
    std::vector<std::uint64_t> ids(k);
    std::vector<float> distances(k);
    index_.search<float>(make_matrix_view<float const>(query.data(), 1, index_.dim()),
                         cuda::std::span<std::uint64_t const>{&ns, 1},
                         k,
                         config_.search,
                         make_matrix_view<std::uint64_t>(ids.data(), 1, k),
                         make_matrix_view<float>(distances.data(), 1, k));
    std::vector<std::uint64_t> out;
    for (std::uint64_t id : ids) {
      if (id != invalid_fact_id) { out.push_back(id); }
    }
    return out;
  }

  /// @brief retrieve() for a query text embedded by `embedder`.
  template <class Embedder>
  std::vector<std::uint64_t> retrieve(Embedder& embedder,
                                      std::uint64_t ns,
                                      std::string const& query,
                                      std::uint32_t k) const
  {
    static_assert(is_embedder_v<Embedder>, "memory::retrieve: Embedder requirements (memory.hpp)");
    return retrieve(ns, embed_all(embedder, {query}, "memory::retrieve"), k);
  }

  /**
   * @brief The request's memory segment: the instruction prefix (if set) and `fact_ids` (most
   * relevant first; laid out in `config().order`) at positions `first_position ..`.
   * @throw logic_error as compose(), and for a superseded fact (an audit record, see fact_state).
   */
  composition prepare(std::vector<std::uint64_t> const& fact_ids, std::int64_t first_position) const
  {
    for (std::uint64_t id : fact_ids) {
      auto const it = facts_.find(id);
      INFERSCALE_EXPECTS(
        it == facts_.end() || !it->second.superseded_by,
        "memory::prepare: fact " + std::to_string(id) + " is superseded by fact " +
          std::to_string(it == facts_.end() ? 0 : it->second.superseded_by.value_or(0)) +
          " (kept for audit, not for requests)");
    }
    compose_options o;
    o.first_position     = first_position;
    o.order              = config_.order;
    o.instruction_prefix = prefix_;
    return compose(store_, fact_ids, o);
  }

  /// @brief Injects a prepared segment through a paged-cache adapter (host backend).
  template <class CacheAdapter, class Rotation>
  void inject(composition const& plan, CacheAdapter& cache, Rotation const& rotation) const
  {
    inject_memory_host(store_, plan, cache, rotation);
  }

  /**
   * @brief One request: embed `query`, retrieve the top `k` of namespace `ns`, compose them behind
   * the prefix at `first_position ..`, inject through `cache`. The engine then prefills the query
   * at `first_position + result.plan.length()`.
   * @throw logic_error as retrieve, prepare and inject_memory_host (nothing committed then).
   */
  template <class Embedder, class CacheAdapter, class Rotation>
  memory_request serve(Embedder& embedder,
                       std::uint64_t ns,
                       std::string const& query,
                       std::uint32_t k,
                       std::int64_t first_position,
                       CacheAdapter& cache,
                       Rotation const& rotation) const
  {
    memory_request r;
    r.fact_ids = retrieve(embedder, ns, query, k);
    r.plan     = prepare(r.fact_ids, first_position);
    inject(r.plan, cache, rotation);
    return r;
  }

  // ==============================================================================================
  // Fact lifecycle (update, re-encode after a turn changed, erase). Every call validates first,
  // then embeds and runs the model into host buffers (capture_plan), and only then changes the
  // store and the index: a refusal, or a model, embedder or index failure, leaves both unchanged.
  // The commit itself (erase + insert of validated K/V, index erase/add of validated vectors) is
  // refused by nothing; on a device store or index only a CUDA error can interrupt it (then it
  // propagates as cuda_error and a fact may be half updated). Pages a fact gives up are zeroed,
  // so an erased fact's K/V is not left in the pool.
  //
  // What is kept for this (host memory): per add_conversation(), a copy of the conversation (4
  // bytes per token of lead, headers and turns) and its encoding_options; per fact, its window
  // (two turn indices and its source turns) and links, and for a direct fact its context (4 bytes
  // per token) and turn map. The K/V of a fact is far larger (2·L·h·d·b per token).

  /// @brief True when the memory tracks fact `id` (added by add_conversation/add_facts or an
  /// update, not erased since; the instruction prefix is not tracked).
  bool tracks(std::uint64_t id) const noexcept { return facts_.count(id) != 0; }

  /// @brief The lifecycle state of a tracked fact. @throw logic_error for an untracked id.
  fact_state fact(std::uint64_t id) const
  {
    fact_entry const& e = entry(id, "memory::fact");
    fact_state s;
    s.fact_id       = id;
    s.namespace_id  = e.ns;
    s.conversation  = e.conversation;
    s.supersedes    = e.supersedes;
    s.superseded_by = e.superseded_by;
    if (e.conversation) {
      s.first_turn  = e.first_turn;
      s.source_turn = anchor(e.source_turns);
      for (std::int64_t u = s.first_turn; u < s.source_turn; ++u) {
        s.turns.push_back(u);
      }
    } else {
      s.turns = e.turns;
    }
    return s;
  }

  /// @brief Handles of the conversations kept for namespace `ns`, in the order they were added.
  std::vector<std::uint64_t> conversations(std::uint64_t ns) const
  {
    std::vector<std::uint64_t> out;
    for (auto const& [id, c] : conversation_entries_) {
      if (c.ns == ns) { out.push_back(id); }
    }
    std::sort(out.begin(), out.end());  // handles increase with every add
    return out;
  }

  /// @brief The conversation as kept (with every update_turns() applied).
  /// @throw logic_error for an unknown handle (never added, or all its facts erased).
  conversation const& conversation_of(std::uint64_t handle) const
  {
    return conversation_entry_of(handle, "memory::conversation_of").c;
  }

  /**
   * @brief The retrievable facts of conversation `handle` whose K/V saw turn `turn` (window
   * `[first_turn, source_turn)` holds it), in plan order: what update_turns() re-encodes.
   * @throw logic_error for an unknown handle or a turn outside the conversation.
   */
  std::vector<std::uint64_t> facts_seeing_turn(std::uint64_t handle, std::int64_t turn) const
  {
    conversation_entry const& ce = conversation_entry_of(handle, "memory::facts_seeing_turn");
    INFERSCALE_EXPECTS(turn >= 0 && turn < static_cast<std::int64_t>(ce.c.turns.size()),
                       "memory::facts_seeing_turn: turn " + std::to_string(turn) +
                         " is not one of the conversation's " + std::to_string(ce.c.turns.size()) +
                         " turns");
    std::vector<std::uint64_t> out;
    for (std::uint64_t id : ce.facts) {
      fact_entry const& e = facts_.at(id);
      if (!e.superseded_by && e.first_turn <= turn && turn < anchor(e.source_turns)) {
        out.push_back(id);
      }
    }
    return out;
  }

  /// @brief The retrievable directly added facts of namespace `ns` whose caller-given turn map
  /// holds `turn` (ascending ids): the ones to pass to reencode_facts() when that turn changed.
  std::vector<std::uint64_t> direct_facts_seeing_turn(std::uint64_t ns, std::int64_t turn) const
  {
    std::vector<std::uint64_t> out;
    for (auto const& [id, e] : facts_) {
      if (e.ns == ns && !e.conversation && !e.superseded_by &&
          std::find(e.turns.begin(), e.turns.end(), turn) != e.turns.end()) {
        out.push_back(id);
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  /**
   * @brief Adds facts encoded by the caller's own sequences (no planner): fact `i` is one forward
   * of `facts[i].context + facts[i].token_ids` at `first_position ..` (through encode_branches
   * when the adapter has it), its text `texts[i]` is embedded and indexed. The caller's turn map
   * (`direct_fact::turns`) is kept for direct_facts_seeing_turn().
   * @throw logic_error (store and index unchanged) if lengths differ, an id is taken (stored,
   *        indexed, tracked, the prefix) or repeated, a fact has no tokens, a position is
   *        negative, capacity is short, the model's geometry is not the store's, or an embedding
   *        is refused by the index's rules; whatever the adapters throw (nothing changed then).
   */
  template <class ModelAdapter, class Embedder>
  memory_add_report add_facts(ModelAdapter& model,
                              Embedder& embedder,
                              std::uint64_t ns,
                              std::vector<direct_fact> const& facts,
                              std::vector<std::string> const& texts)
  {
    static_assert(is_embedder_v<Embedder>, "memory::add_facts: Embedder requirements (memory.hpp)");
    char const* const who = "memory::add_facts";
    INFERSCALE_EXPECTS(texts.size() == facts.size(),
                       std::string{who} + ": " + std::to_string(facts.size()) + " facts but " +
                         std::to_string(texts.size()) + " texts");
    check_model(model, who);
    encoding_plan plan;
    std::vector<std::uint64_t> ids;
    std::int64_t pages = 0;
    for (direct_fact const& f : facts) {
      check_new_id(f.fact_id, who);
      INFERSCALE_EXPECTS(
        std::find(ids.begin(), ids.end(), f.fact_id) == ids.end(),
        std::string{who} + ": fact " + std::to_string(f.fact_id) + " appears twice");
      plan.jobs.push_back(direct_job(f.fact_id, ns, f.context, f.token_ids, f.first_position, who));
      ids.push_back(f.fact_id);
      pages += store_.pages_for(static_cast<std::int64_t>(f.token_ids.size()));
    }
    check_pages(pages, 0, who);
    std::vector<float> vectors = embed_all(embedder, texts, who);
    probe(vectors, ids);
    captured_plan const captured = capture_plan(model, plan);

    for (std::size_t i = 0; i < ids.size(); ++i) {
      store_.insert<float>(ids[i],
                           ns,
                           captured.facts[i].token_ids,
                           captured.captures[i].keys(),
                           captured.captures[i].values());
    }
    try {
      index_.add<float>(ns,
                        matrix_of(vectors, ids.size()),
                        cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
    } catch (...) {
      for (std::uint64_t id : ids) {
        erase_and_scrub(id);
      }
      throw;
    }
    for (direct_fact const& f : facts) {
      fact_entry e;
      e.ns              = ns;
      e.context         = f.context;
      e.first_position  = f.first_position;
      e.turns           = f.turns;
      facts_[f.fact_id] = std::move(e);
    }
    memory_add_report report;
    report.plan     = plan.stats();
    report.encode   = captured.report;
    report.embedded = static_cast<std::int64_t>(texts.size());
    return report;
  }

  /**
   * @brief A new version of a fact (see fact_update): its tokens re-encoded — a planned fact
   * behind its window of the kept conversation (the same window when its earliest source turn is
   * unchanged, planned_window_start()'s otherwise), a direct fact behind its (new) context — and
   * its text re-embedded. In place, the store and index entries of `fact_id` are replaced;
   * superseding, `new_id` is stored and indexed, and `fact_id` leaves the index but stays in the
   * store for audit until erase_fact().
   * @return the re-encoded id (`new_id`) and what the adapters ran.
   * @throw logic_error (store and index unchanged) if `fact_id` is not tracked or is superseded,
   *        `new_id` is taken, the tokens are empty, a source turn is outside the conversation,
   *        the window and tokens exceed max_sequence_tokens, capacity is short, the model's
   *        geometry differs, the embedding is refused by the index's rules (wrong dimension,
   *        non-finite, zero under cosine); whatever the adapters throw (nothing changed then).
   */
  template <class ModelAdapter, class Embedder>
  lifecycle_report update_fact(ModelAdapter& model, Embedder& embedder, fact_update const& u)
  {
    static_assert(is_embedder_v<Embedder>,
                  "memory::update_fact: Embedder requirements (memory.hpp)");
    char const* const who = "memory::update_fact";
    fact_entry const& old = retrievable_entry(u.fact_id, who);
    bool const in_place   = u.new_id == u.fact_id;
    if (!in_place) { check_new_id(u.new_id, who); }
    check_model(model, who);
    INFERSCALE_EXPECTS(!u.token_ids.empty(),
                       std::string{who} + ": the new version of fact " + std::to_string(u.fact_id) +
                         " has no tokens");
    fact_entry next    = old;
    next.supersedes    = in_place ? old.supersedes : std::optional<std::uint64_t>{u.fact_id};
    next.superseded_by = std::nullopt;
    encoding_plan plan;
    if (old.conversation) {
      INFERSCALE_EXPECTS(!u.context && !u.turns,
                         std::string{who} + ": fact " + std::to_string(u.fact_id) +
                           " was planned from conversation " + std::to_string(*old.conversation) +
                           ": its window comes from there, not from a context or turn map");
      conversation_entry const& ce = conversation_entries_.at(*old.conversation);
      if (!u.source_turns.empty()) {
        std::int64_t const t = anchor(u.source_turns);
        INFERSCALE_EXPECTS(
          t >= 0, std::string{who} + ": source turn " + std::to_string(t) + " is negative");
        if (t != anchor(old.source_turns)) {
          next.first_turn = planned_window_start(ce.options, t);
        }
        next.source_turns = u.source_turns;
      }
      conversation_fact const f{u.new_id, old.ns, u.token_ids, next.source_turns};
      plan = plan_encoding_at(ce.c, {f}, {next.first_turn}, ce.options);
    } else {
      INFERSCALE_EXPECTS(u.source_turns.empty(),
                         std::string{who} + ": fact " + std::to_string(u.fact_id) +
                           " was added directly: source turns mean nothing without a conversation "
                           "(give a context and a turn map)");
      if (u.context) { next.context = *u.context; }
      if (u.turns) { next.turns = *u.turns; }
      plan.jobs.push_back(
        direct_job(u.new_id, old.ns, next.context, u.token_ids, next.first_position, who));
    }
    std::int64_t const pages = store_.pages_for(static_cast<std::int64_t>(u.token_ids.size()));
    check_pages(
      pages, in_place ? static_cast<std::int64_t>(store_.at(u.fact_id).pages.size()) : 0, who);
    std::vector<float> const vector = embed_all(embedder, {u.text}, who);
    probe(vector, {u.new_id});
    captured_plan const captured = capture_plan(model, plan);

    // Commit: nothing below is refused (all of it was validated above).
    std::uint64_t const ns                  = old.ns;
    std::optional<std::uint64_t> const conv = old.conversation;
    if (in_place) {
      replace_stored(u.fact_id, ns, captured.facts[0].token_ids, captured.captures[0]);
      index_.erase(cuda::std::span<std::uint64_t const>{&u.fact_id, 1});
      index_.add<float>(
        ns, matrix_of(vector, 1), cuda::std::span<std::uint64_t const>{&u.new_id, 1});
      facts_[u.fact_id] = std::move(next);
    } else {
      store_.insert<float>(u.new_id,
                           ns,
                           captured.facts[0].token_ids,
                           captured.captures[0].keys(),
                           captured.captures[0].values());
      try {
        index_.add<float>(
          ns, matrix_of(vector, 1), cuda::std::span<std::uint64_t const>{&u.new_id, 1});
      } catch (...) {
        erase_and_scrub(u.new_id);
        throw;
      }
      index_.erase(cuda::std::span<std::uint64_t const>{&u.fact_id, 1});
      facts_[u.fact_id].superseded_by = u.new_id;
      facts_[u.new_id]                = std::move(next);
      if (conv) { conversation_entries_.at(*conv).facts.push_back(u.new_id); }
    }
    lifecycle_report r;
    r.reencoded = {u.new_id};
    r.encode    = captured.report;
    r.embedded  = 1;
    return r;
  }

  /**
   * @brief Changes turns of a kept conversation and re-encodes exactly the retrievable facts
   * whose window held a changed turn (facts_seeing_turn), each behind the window it was planned
   * with, over the updated conversation (plan_encoding_at): their K/V then equal a fresh encoding
   * of the updated conversation with those windows. Every other fact keeps its bytes; superseded
   * facts are audit records and keep theirs too. Texts and the index are unchanged (a fact's text
   * is its own), so nothing is embedded.
   * @throw logic_error (store, index and kept conversation unchanged) for an unknown handle, a
   *        turn outside the conversation or given twice, an empty turn, a window that no longer
   *        fits max_sequence_tokens, a model geometry other than the store's; whatever the model
   *        adapter throws (nothing changed then).
   */
  template <class ModelAdapter>
  lifecycle_report update_turns(ModelAdapter& model,
                                std::uint64_t handle,
                                std::vector<turn_change> const& changes)
  {
    char const* const who  = "memory::update_turns";
    conversation_entry& ce = conversation_entry_of(handle, who);
    check_model(model, who);
    conversation updated = ce.c;
    std::vector<std::int64_t> turns;
    for (turn_change const& ch : changes) {
      INFERSCALE_EXPECTS(ch.turn >= 0 && ch.turn < static_cast<std::int64_t>(updated.turns.size()),
                         std::string{who} + ": turn " + std::to_string(ch.turn) +
                           " is not one of the conversation's " +
                           std::to_string(updated.turns.size()) + " turns");
      INFERSCALE_EXPECTS(std::find(turns.begin(), turns.end(), ch.turn) == turns.end(),
                         std::string{who} + ": turn " + std::to_string(ch.turn) + " changes twice");
      INFERSCALE_EXPECTS(
        !ch.token_ids.empty(),
        std::string{who} + ": turn " + std::to_string(ch.turn) + " would have no tokens");
      turns.push_back(ch.turn);
      updated.turns[static_cast<std::size_t>(ch.turn)].token_ids = ch.token_ids;
    }
    std::vector<conversation_fact> facts;
    std::vector<std::int64_t> first_turns;
    for (std::uint64_t id : ce.facts) {
      fact_entry const& e = facts_.at(id);
      if (e.superseded_by) { continue; }
      std::int64_t const t = anchor(e.source_turns);
      bool const saw       = std::any_of(
        turns.begin(), turns.end(), [&](std::int64_t u) { return e.first_turn <= u && u < t; });
      if (!saw) { continue; }
      facts.push_back({id, e.ns, store_.at(id).token_ids, e.source_turns});
      first_turns.push_back(e.first_turn);
    }
    lifecycle_report r;
    if (!facts.empty()) {
      encoding_plan const plan     = plan_encoding_at(updated, facts, first_turns, ce.options);
      captured_plan const captured = capture_plan(model, plan);
      for (std::size_t i = 0; i < captured.facts.size(); ++i) {
        replace_stored(captured.facts[i].fact_id,
                       captured.facts[i].namespace_id,
                       captured.facts[i].token_ids,
                       captured.captures[i]);
        r.reencoded.push_back(captured.facts[i].fact_id);
      }
      r.encode = captured.report;
    }
    ce.c = std::move(updated);
    return r;
  }

  /**
   * @brief Re-encodes directly added facts behind new contexts (after a turn of the caller's
   * conversation changed: direct_facts_seeing_turn() names them), keeping their tokens, texts and
   * index entries. All or nothing over the whole list.
   * @throw logic_error (nothing changed) if an id is not a tracked, retrievable, directly added
   *        fact or repeats, a position is negative, the model's geometry differs; whatever the
   *        model adapter throws.
   */
  template <class ModelAdapter>
  lifecycle_report reencode_facts(ModelAdapter& model, std::vector<fact_context> const& contexts)
  {
    char const* const who = "memory::reencode_facts";
    check_model(model, who);
    encoding_plan plan;
    std::vector<std::uint64_t> ids;
    for (fact_context const& fc : contexts) {
      fact_entry const& e = retrievable_entry(fc.fact_id, who);
      INFERSCALE_EXPECTS(!e.conversation,
                         std::string{who} + ": fact " + std::to_string(fc.fact_id) +
                           " was planned from conversation " + std::to_string(*e.conversation) +
                           ": change its turns with update_turns()");
      INFERSCALE_EXPECTS(
        std::find(ids.begin(), ids.end(), fc.fact_id) == ids.end(),
        std::string{who} + ": fact " + std::to_string(fc.fact_id) + " appears twice");
      ids.push_back(fc.fact_id);
      plan.jobs.push_back(direct_job(
        fc.fact_id, e.ns, fc.context, store_.at(fc.fact_id).token_ids, fc.first_position, who));
    }
    captured_plan const captured = capture_plan(model, plan);
    lifecycle_report r;
    for (std::size_t i = 0; i < captured.facts.size(); ++i) {
      replace_stored(captured.facts[i].fact_id,
                     captured.facts[i].namespace_id,
                     captured.facts[i].token_ids,
                     captured.captures[i]);
      fact_entry& e    = facts_.at(captured.facts[i].fact_id);
      e.context        = contexts[i].context;
      e.first_position = contexts[i].first_position;
      if (contexts[i].turns) { e.turns = *contexts[i].turns; }
      r.reencoded.push_back(captured.facts[i].fact_id);
    }
    r.encode = captured.report;
    return r;
  }

  /**
   * @brief Erases one tracked fact — retrievable or superseded (an audit record) — from the store
   * (its pages zeroed and returned) and the index, and forgets its lifecycle record; a
   * conversation left without facts is forgotten too. Its index row stays flagged deleted (never
   * returned) until compact_index().
   * @throw logic_error (nothing changed) if the id is not tracked (the prefix is not).
   */
  void erase_fact(std::uint64_t id)
  {
    fact_entry const& e                     = entry(id, "memory::erase_fact");
    std::optional<std::uint64_t> const conv = e.conversation;
    if (index_.contains(id)) { index_.erase(cuda::std::span<std::uint64_t const>{&id, 1}); }
    erase_and_scrub(id);
    facts_.erase(id);
    if (conv) {
      auto const it = conversation_entries_.find(*conv);
      auto& ids     = it->second.facts;
      ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
      if (ids.empty()) { conversation_entries_.erase(it); }
    }
  }

  /**
   * @brief Forgets a user: every fact of namespace `ns` leaves the store (pages zeroed and
   * returned) and the index, with the namespace's kept conversations and lifecycle records. The
   * index keeps the namespace's old rows as a hole until compact_index().
   * @return facts removed from the store (superseded audit records included).
   * @throw logic_error (nothing changed) if the namespace holds the instruction prefix.
   */
  std::int64_t erase_namespace(std::uint64_t ns)
  {
    INFERSCALE_EXPECTS(!prefix_ || store_.at(*prefix_).namespace_id != ns,
                       "memory::erase_namespace: namespace " + std::to_string(ns) +
                         " holds the instruction prefix");
    std::vector<std::int64_t> pages;
    for (std::uint64_t id : store_.namespace_fact_ids(ns)) {
      auto const& p = store_.at(id).pages;
      pages.insert(pages.end(), p.begin(), p.end());
    }
    index_.erase_namespace(ns);
    std::int64_t const n = store_.erase_namespace(ns);
    for (auto it = facts_.begin(); it != facts_.end();) {
      it = it->second.ns == ns ? facts_.erase(it) : std::next(it);
    }
    for (auto it = conversation_entries_.begin(); it != conversation_entries_.end();) {
      it = it->second.ns == ns ? conversation_entries_.erase(it) : std::next(it);
    }
    scrub_pages(pages);
    return n;
  }

  /// @brief Reclaims the index rows of erased and superseded facts and of erased namespaces
  /// (graph_index::compact): afterwards the index holds no vector of them at all.
  void compact_index() { index_.compact(); }

  // ---- snapshots: restart a deployment without re-encoding ------------------------------------

  /**
   * @brief Saves the deployment to `directory` (which must exist): the store (save_store), the
   * index (save_index), the lifecycle state (`lifecycle-<file crc>.islc`: the kept conversations
   * and every tracked fact's window and links, so update_fact / update_turns work after a
   * restart; format below) and a manifest `memory.ismem` naming them and the instruction prefix.
   *
   * The store and index files are named after their checksums (`store-<file crc>.iskv`,
   * `index-<header crc>-<file crc>.isx`: the index's file checksum does not cover its header,
   * whose own checksum does); each is written atomically, then the manifest (atomically, last), and
   * only then the files of the previous snapshot in the directory are removed. A crash or a
   * failure at any point leaves the previous snapshot loadable (its manifest and files are
   * untouched until the new manifest has replaced it), or the new one whole.
   *
   * Manifest `memory.ismem`, 72 bytes, little-endian:
   *
   * | offset | bytes | field                                                             |
   * |-------:|------:|-------------------------------------------------------------------|
   * |      0 |     8 | magic `89 49 53 4D 45 4D 0D 0A` ("\x89ISMEM\r\n")              |
   * |      8 |     4 | format version, uint32 = 1                                        |
   * |     12 |     4 | byte-order mark, uint32 0x01020304                                |
   * |     16 |     1 | 1 if an instruction prefix is set, else 0                         |
   * |     17 |     7 | reserved, 0                                                       |
   * |     24 |     8 | the prefix's fact id, uint64 (0 without a prefix)                 |
   * |     32 |     8 | the store file's checksum (its last 8 bytes)                      |
   * |     40 |     8 | the index file's header checksum (its bytes 72 .. 80)             |
   * |     48 |     8 | the index file's checksum (its last 8 bytes)                      |
   * |     56 |     8 | the lifecycle file's checksum (its last 8 bytes)                  |
   * |     64 |     8 | CRC-64 of bytes [0, 64)                                           |
   *
   * Lifecycle file, little-endian, version 1: magic `89 49 53 4C 43 59 0D 0A` ("\x89ISLCY\r\n"),
   * version uint32 = 1, byte-order mark uint32 0x01020304, the next conversation handle uint64,
   * the conversation count C uint64, the fact count F uint64; then C conversation records in
   * ascending handle order — handle, namespace (uint64 each), window, strategy (uint8 + 7 zero
   * bytes), stride, max_sequence_tokens, first_position (int64 each), the lead (count uint64 +
   * int32 tokens), the session headers (count uint64; each a count + int32 tokens), the turns
   * (count uint64; each session int32, 4 zero bytes, count uint64 + int32 tokens), the planned
   * facts (count uint64 + uint64 ids); then F fact records in ascending id order — id, namespace
   * (uint64), flags uint8 (bit 0 planned from a conversation, bit 1 supersedes, bit 2 superseded)
   * + 7 zero bytes, conversation, supersedes, superseded_by (uint64, 0 where the flag is clear),
   * first_turn, first_position (int64), source turns (count uint64 + int64), context (count uint64
   * + int32), turn map (count uint64 + int64); then the CRC-64 of every byte before it. load()
   * checks the checksum first, then every count against the bytes left, the flags and reserved
   * bytes, and that the state agrees with the store and index: each tracked fact is in the store
   * in its namespace and is indexed exactly when it is not superseded, each planned fact names a
   * kept conversation that lists it, with its window inside the conversation.
   *
   * @throw logic_error as save_store and save_index, naming the file and the system's reason
   * @note Serialise saves to one directory.
   */
  void save(std::string const& directory) const
  {
    std::string const who = "memory::save('" + directory + "')";
    std::string const manifest_path = directory + "/" + manifest_name;
    std::optional<snapshot_manifest> const previous = try_read_manifest(manifest_path);

    // The store and the index, each atomically, then renamed after their checksums.
    std::string const store_pending     = directory + "/store.pending.iskv";
    std::string const index_pending     = directory + "/index.pending.isx";
    std::string const lifecycle_pending = directory + "/lifecycle.pending.islc";
    snapshot_manifest m;
    m.prefix = prefix_;
    try {
      save_store(store_, store_pending);
      m.store_checksum = detail::serial::stored_checksum(store_pending, -8, who);
      save_index(index_, index_pending);
      m.index_header_checksum = detail::serial::stored_checksum(index_pending, 72, who);
      m.index_checksum        = detail::serial::stored_checksum(index_pending, -8, who);
      std::vector<unsigned char> const lifecycle = encode_lifecycle();
      (void)detail::serial::write_file_atomically(
        lifecycle_pending, who, false, [&](detail::serial::checksummed_writer& out) {
          out.write(lifecycle.data(), lifecycle.size());
        });
      m.lifecycle_checksum = detail::serial::stored_checksum(lifecycle_pending, -8, who);
      detail::serial::rename_or_fail(store_pending, directory + "/" + store_file_name(m), who);
      detail::serial::rename_or_fail(index_pending, directory + "/" + index_file_name(m), who);
      detail::serial::rename_or_fail(lifecycle_pending, directory + "/" + lifecycle_file_name(m), who);
    } catch (...) {
      (void)std::remove(store_pending.c_str());
      (void)std::remove(index_pending.c_str());
      (void)std::remove(lifecycle_pending.c_str());
      throw;
    }
    detail::serial::sync_directory_of(manifest_path, who);

    unsigned char bytes[manifest_bytes];
    encode_manifest(m, bytes);
    (void)detail::serial::write_file_atomically(
      manifest_path, who, true, [&](detail::serial::checksummed_writer& out) {
        out.write(bytes, sizeof bytes);
      });

    // The previous snapshot's files, unless the new one reuses them (same contents, same name).
    if (previous) {
      if (store_file_name(*previous) != store_file_name(m)) {
        (void)std::remove((directory + "/" + store_file_name(*previous)).c_str());
      }
      if (index_file_name(*previous) != index_file_name(m)) {
        (void)std::remove((directory + "/" + index_file_name(*previous)).c_str());
      }
      if (lifecycle_file_name(*previous) != lifecycle_file_name(m)) {
        (void)std::remove((directory + "/" + lifecycle_file_name(*previous)).c_str());
      }
    }
  }

  /**
   * @brief Restarts a deployment from a snapshot written by save(): the store and the index are
   * loaded (every check of load_store and load_index), nothing is re-encoded or re-embedded.
   *
   * `config` is the deployment's configuration, as given to the constructor: the store file must
   * match `config.store` (geometry, shard, page size, capacity; the dtype is converted as
   * load_store does, the memory kind is `config.store.memory`); the index file must have
   * `config.index`'s dim, metric and vector dtype (its graph degrees and exact-search threshold
   * are the file's; the memory kind is `config.index.memory`); search parameters and fact order
   * are `config`'s.
   *
   * @throw logic_error when the manifest is missing, corrupted, of another version, or names
   * files that are missing or do not carry its checksums (a store and an index of different
   * saves are never paired); as load_store / load_index; when the configuration differs as said;
   * or when the snapshot is inconsistent (an indexed fact missing from the store or in another
   * namespace there, a prefix missing from the store or indexed)
   */
  static memory load(std::string const& directory, memory_config const& config)
  {
    std::string const who = "memory::load('" + directory + "')";
    std::string const where = who + ": ";
    snapshot_manifest const m =
      parse_manifest(detail::serial::read_whole_file(directory + "/" + manifest_name, who), where);
    std::string const store_path = directory + "/" + store_file_name(m);
    std::string const index_path = directory + "/" + index_file_name(m);
    std::string const lifecycle_path = directory + "/" + lifecycle_file_name(m);
    INFERSCALE_EXPECTS(detail::serial::stored_checksum(store_path, -8, who) == m.store_checksum &&
                         detail::serial::stored_checksum(index_path, 72, who) == m.index_header_checksum &&
                         detail::serial::stored_checksum(index_path, -8, who) == m.index_checksum &&
                         detail::serial::stored_checksum(lifecycle_path, -8, who) == m.lifecycle_checksum,
                       where + "the store or index file does not carry the manifest's checksum "
                               "(files of different saves are never paired)");

    kv_store store    = load_store(store_path, config.store);
    graph_index index = load_index(index_path, config.index.memory);
    index_config const& ic = index.config();
    INFERSCALE_EXPECTS(ic.dim == config.index.dim && ic.metric == config.index.metric &&
                         ic.vector_dtype == config.index.vector_dtype,
                       where + "the index holds " + std::to_string(ic.dim) + "-d " +
                         to_string(ic.vector_dtype) + " vectors (metric " +
                         std::to_string(static_cast<int>(ic.metric)) + "), the configuration " +
                         std::to_string(config.index.dim) + "-d " +
                         to_string(config.index.vector_dtype) + " (metric " +
                         std::to_string(static_cast<int>(config.index.metric)) + ")");
    for (std::uint64_t ns : index.namespaces()) {
      for (std::uint64_t id : index.ids(ns)) {
        INFERSCALE_EXPECTS(store.contains(id) && store.at(id).namespace_id == ns,
                           where + "indexed fact " + std::to_string(id) + " of namespace " +
                             std::to_string(ns) + " is not in the store's namespace " +
                             std::to_string(ns));
      }
    }
    if (m.prefix) {
      INFERSCALE_EXPECTS(store.contains(*m.prefix) && !index.contains(*m.prefix),
                         where + "the instruction prefix, fact " + std::to_string(*m.prefix) +
                           ", is missing from the store or indexed");
    }
    memory_config resolved = config;
    resolved.store         = store.config();
    resolved.index         = ic;
    memory loaded{resolved, std::move(store), std::move(index), m.prefix};
    loaded.decode_lifecycle(detail::serial::read_whole_file(lifecycle_path, who),
                            where + "lifecycle file '" + lifecycle_path + "': ");
    return loaded;
  }
  // ---- end of snapshots -----------------------------------------------------------------------

 private:
  template <class Embedder>
  std::vector<float> embed_all(Embedder& embedder,
                               std::vector<std::string> const& texts,
                               char const* who) const
  {
    std::int64_t const dim = index_.dim();
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(embedder.dimension()) == dim,
                       std::string{who} + ": the embedder gives " +
                         std::to_string(embedder.dimension()) + "-d vectors, the index holds " +
                         std::to_string(dim) + "-d");
    std::vector<float> out;
    out.reserve(texts.size() * static_cast<std::size_t>(dim));
    for (std::size_t i = 0; i < texts.size(); ++i) {
      std::vector<float> const v = embedder.embed(texts[i]);
      INFERSCALE_EXPECTS(static_cast<std::int64_t>(v.size()) == dim,
                         std::string{who} + ": text " + std::to_string(i) + " embedded to " +
                           std::to_string(v.size()) + " values, expected " + std::to_string(dim));
      for (float x : v) {
        INFERSCALE_EXPECTS(std::isfinite(x), std::string{who} + ": text " + std::to_string(i) +
                                               " has a non-finite embedding");
      }
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  // ==============================================================================================
  // Fact lifecycle: private state and helpers

  /// What the memory keeps of a fact (see fact_state; the tokens live in the store's record).
  struct fact_entry {
    std::uint64_t ns{};
    std::optional<std::uint64_t> conversation;  ///< set: planned from it
    std::vector<std::int64_t> source_turns;     ///< planned
    std::int64_t first_turn{0};                 ///< planned: window start
    std::vector<std::int32_t> context;          ///< direct: what it sees before itself
    std::int64_t first_position{0};             ///< direct: position of context[0]
    std::vector<std::int64_t> turns;            ///< direct: the caller's map
    std::optional<std::uint64_t> supersedes;
    std::optional<std::uint64_t> superseded_by;
  };

  /// What the memory keeps of an added conversation, to re-encode its facts.
  struct conversation_entry {
    std::uint64_t ns{};
    conversation c;
    encoding_options options;
    std::vector<std::uint64_t> facts;  ///< tracked facts planned from it, in plan order
  };

  static std::int64_t anchor(std::vector<std::int64_t> const& source_turns)
  {
    return *std::min_element(source_turns.begin(), source_turns.end());
  }

  fact_entry const& entry(std::uint64_t id, char const* who) const
  {
    auto const it = facts_.find(id);
    INFERSCALE_EXPECTS(it != facts_.end(),
                       std::string{who} + ": fact " + std::to_string(id) +
                         " is not a fact of "
                         "this memory" +
                         (prefix_ && *prefix_ == id ? " (it is the instruction prefix)" : ""));
    return it->second;
  }

  fact_entry const& retrievable_entry(std::uint64_t id, char const* who) const
  {
    fact_entry const& e = entry(id, who);
    INFERSCALE_EXPECTS(!e.superseded_by,
                       std::string{who} + ": fact " + std::to_string(id) +
                         " is superseded by fact " + std::to_string(e.superseded_by.value_or(0)) +
                         " (an audit record: update the newer version)");
    return e;
  }

  conversation_entry const& conversation_entry_of(std::uint64_t handle, char const* who) const
  {
    auto const it = conversation_entries_.find(handle);
    INFERSCALE_EXPECTS(it != conversation_entries_.end(),
                       std::string{who} + ": no conversation " + std::to_string(handle) +
                         " is kept (never added, or its facts were all erased)");
    return it->second;
  }
  conversation_entry& conversation_entry_of(std::uint64_t handle, char const* who)
  {
    return const_cast<conversation_entry&>(std::as_const(*this).conversation_entry_of(handle, who));
  }

  template <class ModelAdapter>
  void check_model(ModelAdapter const& model, char const* who) const
  {
    static_assert(is_model_adapter_v<ModelAdapter>,
                  "memory: ModelAdapter needs geometry(), rotation() and "
                  "encode(tokens, first_position, kv_capture&) (see engine.hpp)");
    INFERSCALE_EXPECTS(model.geometry() == store_.geometry(),
                       std::string{who} + ": the model's KV geometry differs from the store's");
  }

  /// Refuses an id a new fact cannot take: stored (audit records too), indexed, tracked, the
  /// prefix, or the index's reserved id.
  void check_new_id(std::uint64_t id, char const* who) const
  {
    std::string const which = std::string{who} + ": fact id " + std::to_string(id);
    INFERSCALE_EXPECTS(id != invalid_fact_id, which + " is reserved (invalid_fact_id)");
    INFERSCALE_EXPECTS(!prefix_ || *prefix_ != id, which + " is the instruction prefix");
    INFERSCALE_EXPECTS(!store_.contains(id) && !index_.contains(id) && !tracks(id),
                       which + " is already taken");
  }

  /// Refuses `pages` new pages when fewer are free (`released` pages are given back first).
  void check_pages(std::int64_t pages, std::int64_t released, char const* who) const
  {
    INFERSCALE_EXPECTS(pages <= store_.free_pages() + released,
                       std::string{who} + ": the facts need " + std::to_string(pages) + " pages, " +
                         std::to_string(store_.free_pages() + released) +
                         " free (capacity exhausted)");
  }

  /// A one-branch job: `context` as the trunk, the fact attached after all of it.
  static encoding_job direct_job(std::uint64_t id,
                                 std::uint64_t ns,
                                 std::vector<std::int32_t> const& context,
                                 std::vector<std::int32_t> const& tokens,
                                 std::int64_t first_position,
                                 char const* who)
  {
    INFERSCALE_EXPECTS(!tokens.empty(),
                       std::string{who} + ": fact " + std::to_string(id) + " has no tokens");
    INFERSCALE_EXPECTS(first_position >= 0,
                       std::string{who} + ": fact " + std::to_string(id) + "'s first position " +
                         std::to_string(first_position) + " is negative");
    encoding_job job;
    job.first_position = first_position;
    job.trunk          = context;
    encoding_branch b;
    b.fact_id      = id;
    b.namespace_id = ns;
    b.token_ids    = tokens;
    b.attach       = static_cast<std::int64_t>(context.size());
    b.position     = first_position + b.attach;
    job.branches.push_back(std::move(b));
    return job;
  }

  matrix_view<float const> matrix_of(std::vector<float> const& vectors, std::size_t rows) const
  {
    return make_matrix_view<float const>(
      vectors.data(), static_cast<std::int64_t>(rows), index_.dim());
  }

  /// Applies the index's own checks (dimension, finite, non-zero under cosine, norm, fp16 range)
  /// to vectors before anything changes, by adding them to a scratch host index.
  void probe(std::vector<float> const& vectors, std::vector<std::uint64_t> const& ids) const
  {
    index_config c = index_.config();
    c.memory       = memory_kind::host;
    graph_index scratch{c};
    scratch.add<float>(0,
                       matrix_of(vectors, ids.size()),
                       cuda::std::span<std::uint64_t const>{ids.data(), ids.size()});
  }

  /// Zeroes pool pages that no fact holds any more (an erased fact's K/V is not left behind).
  void scrub_pages(std::vector<std::int64_t> const& pages)
  {
    if (pages.empty()) { return; }
    std::size_t const page_bytes =
      store_.pool_bytes() / static_cast<std::size_t>(store_.num_pages());
    auto* const pool = static_cast<unsigned char*>(store_.ref().pool);
    for (std::int64_t p : pages) {
      unsigned char* const at = pool + static_cast<std::size_t>(p) * page_bytes;
      if (store_.memory() == memory_kind::device) {
        INFERSCALE_CUDA_TRY(cudaMemset(at, 0, page_bytes));
      } else {
        std::memset(at, 0, page_bytes);
      }
    }
    if (store_.memory() == memory_kind::device) { INFERSCALE_CUDA_TRY(cudaDeviceSynchronize()); }
  }

  void erase_and_scrub(std::uint64_t id)
  {
    std::vector<std::int64_t> const pages = store_.at(id).pages;
    store_.erase(id);
    scrub_pages(pages);
  }

  /// Replaces a stored fact's K/V (validated: the capture is complete and the pages fit). The
  /// pages it gives back are taken again first, so a fact of the same length keeps its pages.
  void replace_stored(std::uint64_t id,
                      std::uint64_t ns,
                      std::vector<std::int32_t> const& tokens,
                      kv_capture const& capture)
  {
    std::vector<std::int64_t> const old = store_.at(id).pages;
    store_.erase(id);
    store_.insert<float>(id, ns, tokens, capture.keys(), capture.values());
    std::vector<std::int64_t> const& now = store_.at(id).pages;
    std::vector<std::int64_t> freed;
    for (std::int64_t p : old) {
      if (std::find(now.begin(), now.end(), p) == now.end()) { freed.push_back(p); }
    }
    scrub_pages(freed);
  }

  /// Records an added conversation and its facts' windows; returns its handle.
  std::uint64_t remember_conversation(std::uint64_t ns,
                                      conversation const& c,
                                      encoding_options const& options,
                                      encoding_plan const& plan)
  {
    if (plan.stats().facts == 0) { return 0; }  // nothing to re-encode: keep nothing
    std::uint64_t const handle = next_conversation_++;
    conversation_entry ce{ns, c, options, {}};
    for (encoding_job const& job : plan.jobs) {
      for (encoding_branch const& b : job.branches) {
        fact_entry e;
        e.ns              = b.namespace_id;
        e.conversation    = handle;
        e.first_turn      = b.first_turn;
        e.source_turns    = std::vector<std::int64_t>{b.source_turn};
        facts_[b.fact_id] = std::move(e);
        ce.facts.push_back(b.fact_id);
      }
    }
    conversation_entries_.emplace(handle, std::move(ce));
    return handle;
  }

  std::unordered_map<std::uint64_t, fact_entry> facts_;
  std::unordered_map<std::uint64_t, conversation_entry> conversation_entries_;
  std::uint64_t next_conversation_{1};

  // ---- snapshots (see save / load) -------------------------------------------------------------
  static constexpr char const* manifest_name  = "memory.ismem";
  static constexpr std::size_t manifest_bytes = 72;

  struct snapshot_manifest {
    std::optional<std::uint64_t> prefix;
    std::uint64_t store_checksum{};
    std::uint64_t index_header_checksum{};
    std::uint64_t index_checksum{};
    std::uint64_t lifecycle_checksum{};
  };

  memory(memory_config const& config,
         kv_store&& store,
         graph_index&& index,
         std::optional<std::uint64_t> prefix)
    : config_{config}, store_{std::move(store)}, index_{std::move(index)}, prefix_{prefix}
  {
  }

  static std::string store_file_name(snapshot_manifest const& m)
  {
    return "store-" + detail::serial::checksum_digits(m.store_checksum) + ".iskv";
  }
  static std::string index_file_name(snapshot_manifest const& m)
  {
    return "index-" + detail::serial::checksum_digits(m.index_header_checksum) + "-" +
           detail::serial::checksum_digits(m.index_checksum) + ".isx";
  }

  static std::string lifecycle_file_name(snapshot_manifest const& m)
  {
    return "lifecycle-" + detail::serial::checksum_digits(m.lifecycle_checksum) + ".islc";
  }

  static void encode_manifest(snapshot_manifest const& m, unsigned char* bytes)
  {
    namespace s = detail::serial;
    std::memset(bytes, 0, manifest_bytes);
    std::memcpy(bytes, manifest_magic, 8);
    s::put_le(bytes + 8, std::uint32_t{1});
    s::put_le(bytes + 12, std::uint32_t{0x01020304u});
    bytes[16] = m.prefix ? 1 : 0;
    s::put_le(bytes + 24, m.prefix.value_or(0));
    s::put_le(bytes + 32, m.store_checksum);
    s::put_le(bytes + 40, m.index_header_checksum);
    s::put_le(bytes + 48, m.index_checksum);
    s::put_le(bytes + 56, m.lifecycle_checksum);
    s::put_le(bytes + 64, s::crc64_of(bytes, 64));
  }

  static snapshot_manifest parse_manifest(std::vector<unsigned char> const& b,
                                          std::string const& where)
  {
    namespace s = detail::serial;
    std::string const what = where + "manifest " + manifest_name + ": ";
    INFERSCALE_EXPECTS(b.size() == manifest_bytes,
                       what + std::to_string(b.size()) + " bytes, expected " +
                         std::to_string(manifest_bytes));
    INFERSCALE_EXPECTS(std::memcmp(b.data(), manifest_magic, 8) == 0,
                       what + "not an InferScale memory manifest (wrong magic bytes)");
    std::uint32_t const version = s::get_le<std::uint32_t>(b.data() + 8);
    INFERSCALE_EXPECTS(version == 1, what + "format version " + std::to_string(version) +
                                       " is not supported (this build reads 1)");
    INFERSCALE_EXPECTS(s::get_le<std::uint32_t>(b.data() + 12) == 0x01020304u,
                       what + "bad byte-order mark");
    INFERSCALE_EXPECTS(s::get_le<std::uint64_t>(b.data() + 64) == s::crc64_of(b.data(), 64),
                       what + "checksum mismatch (the manifest is corrupted)");
    bool reserved_zero = true;
    for (std::size_t i = 17; i < 24; ++i) {
      reserved_zero = reserved_zero && b[i] == 0;
    }
    std::uint64_t const prefix = s::get_le<std::uint64_t>(b.data() + 24);
    INFERSCALE_EXPECTS(reserved_zero && b[16] <= 1 && (b[16] == 1 || prefix == 0),
                       what + "bad prefix flag or reserved bytes");
    snapshot_manifest m;
    if (b[16] == 1) { m.prefix = prefix; }
    m.store_checksum        = s::get_le<std::uint64_t>(b.data() + 32);
    m.index_header_checksum = s::get_le<std::uint64_t>(b.data() + 40);
    m.index_checksum        = s::get_le<std::uint64_t>(b.data() + 48);
    m.lifecycle_checksum    = s::get_le<std::uint64_t>(b.data() + 56);
    return m;
  }

  /// The manifest at `path` if there is a valid one (what a save replaces), else nothing.
  static std::optional<snapshot_manifest> try_read_manifest(std::string const& path)
  {
    std::FILE* file = std::fopen(path.c_str(), "rb");
    if (file == nullptr) { return std::nullopt; }
    (void)std::fclose(file);
    try {
      return parse_manifest(detail::serial::read_whole_file(path, "memory::save"), "");
    } catch (logic_error const&) {
      return std::nullopt;
    }
  }

  static constexpr unsigned char manifest_magic[8] = {0x89, 'I', 'S', 'M', 'E', 'M', 0x0D, 0x0A};
  static constexpr unsigned char lifecycle_magic[8] = {0x89, 'I', 'S', 'L', 'C', 'Y', 0x0D, 0x0A};

  /// Little-endian appends for the lifecycle file.
  struct lifecycle_out {
    std::vector<unsigned char> bytes;
    template <class T>
    void put(T v)
    {
      unsigned char b[sizeof(T)];
      detail::serial::put_le(b, v);
      bytes.insert(bytes.end(), b, b + sizeof(T));
    }
    template <class T>
    void put_list(std::vector<T> const& v)
    {
      put(static_cast<std::uint64_t>(v.size()));
      for (T x : v) {
        put(x);
      }
    }
  };

  /// Bounds-checked little-endian reads of the lifecycle file (every count against what is left).
  struct lifecycle_in {
    std::vector<unsigned char> const& bytes;
    std::size_t at;
    std::size_t end;
    std::string const& what;
    template <class T>
    T get()
    {
      INFERSCALE_EXPECTS(end - at >= sizeof(T), what + "truncated record at byte " +
                                                   std::to_string(at));
      T const v = detail::serial::get_le<T>(bytes.data() + at);
      at += sizeof(T);
      return v;
    }
    template <class T>
    std::vector<T> get_list()
    {
      std::uint64_t const n = get<std::uint64_t>();
      INFERSCALE_EXPECTS(n <= (end - at) / sizeof(T),
                         what + "a list of " + std::to_string(n) + " entries at byte " +
                           std::to_string(at) + " runs past the end");
      std::vector<T> v(static_cast<std::size_t>(n));
      for (auto& x : v) {
        x = get<T>();
      }
      return v;
    }
    void zeros(std::size_t n)
    {
      for (std::size_t i = 0; i < n; ++i) {
        INFERSCALE_EXPECTS(get<std::uint8_t>() == 0, what + "reserved byte " +
                                                       std::to_string(at - 1) + " is not zero");
      }
    }
  };

  std::vector<unsigned char> encode_lifecycle() const
  {
    lifecycle_out o;
    o.bytes.insert(o.bytes.end(), lifecycle_magic, lifecycle_magic + 8);
    o.put(std::uint32_t{1});
    o.put(std::uint32_t{0x01020304u});
    o.put(next_conversation_);
    o.put(static_cast<std::uint64_t>(conversation_entries_.size()));
    o.put(static_cast<std::uint64_t>(facts_.size()));
    std::vector<std::uint64_t> handles;
    for (auto const& [h, c] : conversation_entries_) {
      handles.push_back(h);
    }
    std::sort(handles.begin(), handles.end());
    for (std::uint64_t h : handles) {
      conversation_entry const& ce = conversation_entries_.at(h);
      o.put(h);
      o.put(ce.ns);
      o.put(ce.options.window);
      o.put(static_cast<std::uint8_t>(ce.options.strategy));
      for (int i = 0; i < 7; ++i) {
        o.put(std::uint8_t{0});
      }
      o.put(ce.options.stride);
      o.put(ce.options.max_sequence_tokens);
      o.put(ce.options.first_position);
      o.put_list(ce.c.lead);
      o.put(static_cast<std::uint64_t>(ce.c.session_headers.size()));
      for (auto const& header : ce.c.session_headers) {
        o.put_list(header);
      }
      o.put(static_cast<std::uint64_t>(ce.c.turns.size()));
      for (auto const& turn : ce.c.turns) {
        o.put(turn.session);
        o.put(std::uint32_t{0});
        o.put_list(turn.token_ids);
      }
      o.put_list(ce.facts);
    }
    std::vector<std::uint64_t> ids;
    for (auto const& [id, e] : facts_) {
      ids.push_back(id);
    }
    std::sort(ids.begin(), ids.end());
    for (std::uint64_t id : ids) {
      fact_entry const& e = facts_.at(id);
      o.put(id);
      o.put(e.ns);
      o.put(static_cast<std::uint8_t>((e.conversation ? 1 : 0) | (e.supersedes ? 2 : 0) |
                                      (e.superseded_by ? 4 : 0)));
      for (int i = 0; i < 7; ++i) {
        o.put(std::uint8_t{0});
      }
      o.put(e.conversation.value_or(0));
      o.put(e.supersedes.value_or(0));
      o.put(e.superseded_by.value_or(0));
      o.put(e.first_turn);
      o.put(e.first_position);
      o.put_list(e.source_turns);
      o.put_list(e.context);
      o.put_list(e.turns);
    }
    o.put(detail::serial::crc64_of(o.bytes.data(), o.bytes.size()));
    return std::move(o.bytes);
  }

  /// Rebuilds the lifecycle state of a freshly loaded memory (store and index already checked);
  /// everything is parsed and checked into locals first, then moved in.
  void decode_lifecycle(std::vector<unsigned char> const& b, std::string const& what)
  {
    INFERSCALE_EXPECTS(b.size() >= 48, what + std::to_string(b.size()) +
                                         " bytes, shorter than the 48-byte header and checksum");
    INFERSCALE_EXPECTS(detail::serial::get_le<std::uint64_t>(b.data() + b.size() - 8) ==
                         detail::serial::crc64_of(b.data(), b.size() - 8),
                       what + "checksum mismatch (the file is corrupted)");
    INFERSCALE_EXPECTS(std::memcmp(b.data(), lifecycle_magic, 8) == 0,
                       what + "not an InferScale lifecycle file (wrong magic bytes)");
    lifecycle_in in{b, 8, b.size() - 8, what};
    std::uint32_t const version = in.get<std::uint32_t>();
    INFERSCALE_EXPECTS(version == 1, what + "format version " + std::to_string(version) +
                                       " is not supported (this build reads 1)");
    INFERSCALE_EXPECTS(in.get<std::uint32_t>() == 0x01020304u, what + "bad byte-order mark");
    std::uint64_t const next = in.get<std::uint64_t>();
    std::uint64_t const nc   = in.get<std::uint64_t>();
    std::uint64_t const nf   = in.get<std::uint64_t>();
    INFERSCALE_EXPECTS(next >= 1 && nc < next && nc <= b.size() && nf <= b.size(),
                       what + "bad counts (next handle " + std::to_string(next) + ", " +
                         std::to_string(nc) + " conversations, " + std::to_string(nf) + " facts)");
    std::unordered_map<std::uint64_t, conversation_entry> conversations;
    std::uint64_t previous = 0;
    for (std::uint64_t i = 0; i < nc; ++i) {
      std::uint64_t const h = in.get<std::uint64_t>();
      INFERSCALE_EXPECTS(h > previous && h < next,
                         what + "conversation handle " + std::to_string(h) +
                           " out of order or not below the next handle " + std::to_string(next));
      previous = h;
      conversation_entry ce;
      ce.ns               = in.get<std::uint64_t>();
      ce.options.window   = in.get<std::int64_t>();
      std::uint8_t const strategy = in.get<std::uint8_t>();
      INFERSCALE_EXPECTS(strategy <= static_cast<std::uint8_t>(encoding_strategy::single_pass),
                         what + "bad encoding strategy " + std::to_string(strategy));
      ce.options.strategy = static_cast<encoding_strategy>(strategy);
      in.zeros(7);
      ce.options.stride              = in.get<std::int64_t>();
      ce.options.max_sequence_tokens = in.get<std::int64_t>();
      ce.options.first_position      = in.get<std::int64_t>();
      ce.c.lead                      = in.get_list<std::int32_t>();
      std::uint64_t const headers    = in.get<std::uint64_t>();
      INFERSCALE_EXPECTS(headers <= (in.end - in.at) / 8, what + "too many session headers");
      for (std::uint64_t k = 0; k < headers; ++k) {
        ce.c.session_headers.push_back(in.get_list<std::int32_t>());
      }
      std::uint64_t const turns = in.get<std::uint64_t>();
      INFERSCALE_EXPECTS(turns <= (in.end - in.at) / 16, what + "too many turns");
      for (std::uint64_t k = 0; k < turns; ++k) {
        conversation_turn t;
        t.session = in.get<std::int32_t>();
        in.zeros(4);
        t.token_ids = in.get_list<std::int32_t>();
        ce.c.turns.push_back(std::move(t));
      }
      ce.facts = in.get_list<std::uint64_t>();
      conversations.emplace(h, std::move(ce));
    }
    std::unordered_map<std::uint64_t, fact_entry> facts;
    bool first = true;
    std::uint64_t last_id = 0;
    for (std::uint64_t i = 0; i < nf; ++i) {
      std::uint64_t const id = in.get<std::uint64_t>();
      INFERSCALE_EXPECTS(first || id > last_id, what + "fact ids out of order at " +
                                                  std::to_string(id));
      first   = false;
      last_id = id;
      fact_entry e;
      e.ns                     = in.get<std::uint64_t>();
      std::uint8_t const flags = in.get<std::uint8_t>();
      INFERSCALE_EXPECTS(flags <= 7, what + "bad flags " + std::to_string(flags) + " of fact " +
                                       std::to_string(id));
      in.zeros(7);
      std::uint64_t const conversation  = in.get<std::uint64_t>();
      std::uint64_t const supersedes    = in.get<std::uint64_t>();
      std::uint64_t const superseded_by = in.get<std::uint64_t>();
      INFERSCALE_EXPECTS(((flags & 1) || conversation == 0) && ((flags & 2) || supersedes == 0) &&
                           ((flags & 4) || superseded_by == 0),
                         what + "fact " + std::to_string(id) + " has a link without its flag");
      if (flags & 1) { e.conversation = conversation; }
      if (flags & 2) { e.supersedes = supersedes; }
      if (flags & 4) { e.superseded_by = superseded_by; }
      e.first_turn     = in.get<std::int64_t>();
      e.first_position = in.get<std::int64_t>();
      e.source_turns   = in.get_list<std::int64_t>();
      e.context        = in.get_list<std::int32_t>();
      e.turns          = in.get_list<std::int64_t>();
      facts.emplace(id, std::move(e));
    }
    INFERSCALE_EXPECTS(in.at == in.end, what + std::to_string(in.end - in.at) +
                                          " bytes after the last record");

    // Agreement with the store, the index and itself.
    for (auto const& [id, e] : facts) {
      std::string const f = what + "fact " + std::to_string(id) + ": ";
      INFERSCALE_EXPECTS(store_.contains(id) && store_.at(id).namespace_id == e.ns,
                         f + "not in the store's namespace " + std::to_string(e.ns));
      INFERSCALE_EXPECTS(!prefix_ || *prefix_ != id, f + "is the instruction prefix");
      INFERSCALE_EXPECTS(index_.contains(id) == !e.superseded_by,
                         f + (e.superseded_by ? "superseded but still indexed"
                                              : "retrievable but not indexed"));
      if (e.superseded_by) {
        INFERSCALE_EXPECTS(facts.count(*e.superseded_by) != 0,
                           f + "superseded by untracked fact " + std::to_string(*e.superseded_by));
      }
      if (e.conversation) {
        auto const cit = conversations.find(*e.conversation);
        INFERSCALE_EXPECTS(cit != conversations.end() && cit->second.ns == e.ns,
                           f + "planned from conversation " + std::to_string(*e.conversation) +
                             ", which is not kept for its namespace");
        auto const& listed = cit->second.facts;
        INFERSCALE_EXPECTS(std::find(listed.begin(), listed.end(), id) != listed.end(),
                           f + "not listed by its conversation");
        std::int64_t const turns = static_cast<std::int64_t>(cit->second.c.turns.size());
        INFERSCALE_EXPECTS(!e.source_turns.empty(), f + "no source turn");
        for (std::int64_t t : e.source_turns) {
          INFERSCALE_EXPECTS(t >= 0 && t < turns, f + "source turn " + std::to_string(t) +
                                                    " outside the conversation's " +
                                                    std::to_string(turns) + " turns");
        }
        INFERSCALE_EXPECTS(e.first_turn >= 0 && e.first_turn <= anchor(e.source_turns),
                           f + "window start " + std::to_string(e.first_turn) +
                             " after its source turn");
      }
    }
    for (auto const& [h, ce] : conversations) {
      for (std::uint64_t id : ce.facts) {
        auto const fit = facts.find(id);
        INFERSCALE_EXPECTS(fit != facts.end() && fit->second.conversation == h,
                           what + "conversation " + std::to_string(h) + " lists fact " +
                             std::to_string(id) + ", which is not planned from it");
      }
    }
    facts_                = std::move(facts);
    conversation_entries_ = std::move(conversations);
    next_conversation_    = next;
  }
  // ---- end of snapshots -----------------------------------------------------------------------

  memory_config config_;
  kv_store store_;
  graph_index index_;
  std::optional<std::uint64_t> prefix_;
};

}  // namespace inferscale
