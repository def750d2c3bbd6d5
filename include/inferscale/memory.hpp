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

#include <cmath>
#include <cstdint>
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

/// @brief What add_conversation() did.
struct memory_add_report {
  encoding_stats plan{};    ///< the encoding plan's token counts
  encode_report encode{};   ///< what the model adapter ran
  std::int64_t embedded{0};  ///< fact texts embedded
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
        store_.erase(id);
      }
      throw;
    }
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
   * @throw logic_error as compose().
   */
  composition prepare(std::vector<std::uint64_t> const& fact_ids, std::int64_t first_position) const
  {
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

  /// @brief Forgets a user: every fact of namespace `ns` leaves the store and the index.
  /// @return facts removed from the store.
  std::int64_t erase_namespace(std::uint64_t ns)
  {
    INFERSCALE_EXPECTS(!prefix_ || store_.at(*prefix_).namespace_id != ns,
                       "memory::erase_namespace: namespace " + std::to_string(ns) +
                         " holds the instruction prefix");
    index_.erase_namespace(ns);
    return store_.erase_namespace(ns);
  }

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

  memory_config config_;
  kv_store store_;
  graph_index index_;
  std::optional<std::uint64_t> prefix_;
};

}  // namespace inferscale
