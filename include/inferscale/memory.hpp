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
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
                       "memory::add_conversation: " + std::to_string(facts.size()) +
                         " facts but " + std::to_string(texts.size()) + " texts");
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

  memory_config config_;
  kv_store store_;
  graph_index index_;
  std::optional<std::uint64_t> prefix_;
};

}  // namespace inferscale
