/**
 * @file fact_source.hpp
 * @brief The level below the host tier: a `fact_source` holds facts outside the process's memory
 * (a snapshot directory on disk, directory_source.hpp; a shared Redis store, redis_source.hpp) and
 * hands out a fact's pages when a request needs it. `tiered_store::admit(keys, source)` pulls the
 * facts it lacks from a source into the host tier (and from there into the device tier) under the
 * tiers' LRU.
 *
 * A source hands out pages as bytes: `ceil(tokens / page_size)` pages of the store's
 * `kv_store::page_bytes()` each, in token order, exactly as a kv_store's pool holds them. Nothing
 * is converted: a tier takes facts only from a source with the same page layout (`fact_layout`:
 * model geometry, shard, store dtype, compression, page size and page bytes), so whatever a page
 * holds (plain elements, or a compressed dtype's scales inside the page) travels unchanged.
 *
 * Every fetch is checked by the source before it returns (a checksum per fact), all or nothing:
 * a fact is returned whole or the fetch throws. Plain C++17 (POSIX for the file and socket I/O
 * of the implementations).
 */
#pragma once

#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/store.hpp>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace inferscale {

/// @brief A fact named by its namespace and its id (shared stores keep a user's facts together).
struct fact_key {
  std::uint64_t namespace_id{};  ///< the fact's namespace (user / conversation)
  std::uint64_t fact_id{};       ///< the fact's id
};

/**
 * @brief The page layout of stored facts: what must agree, byte for byte, between a source and a
 * tier for pages to be copied as they are.
 */
struct fact_layout {
  kv_geometry model{};                               ///< the whole model's KV geometry
  std::int32_t first_layer{};                        ///< first layer held
  std::int32_t num_layers{};                         ///< layers held (resolved: never 0)
  std::int32_t first_head{};                         ///< first KV head held
  std::int32_t num_heads{};                          ///< KV heads held (resolved: never 0)
  dtype store_dtype{dtype::bfloat16};                ///< the store dtype
  std::int32_t page_size{};                          ///< tokens per page
  std::uint64_t page_bytes{};                        ///< bytes of one page (kv_store::page_bytes())
  kv_compression compression{kv_compression::none};  ///< how the pages hold K/V (compression.hpp)

  /// @brief The layout of pages of a resolved configuration `c` (layer and head counts never 0)
  /// taking `page_bytes` bytes each (a store's page_bytes(), a snapshot header's).
  static fact_layout of(kv_store_config const& c, std::uint64_t page_bytes)
  {
    return {c.model,
            c.first_layer,
            c.num_layers,
            c.first_head,
            c.num_heads,
            c.store_dtype,
            c.page_size,
            page_bytes,
            c.compression};
  }

  /// @brief The layout of a store's pages (its resolved configuration and page_bytes()).
  static fact_layout of(kv_store const& store)
  {
    return of(store.config(), static_cast<std::uint64_t>(store.page_bytes()));
  }

  /// @brief The layout of the stores `config` describes (its capacity and memory are ignored).
  /// @throw logic_error if the configuration is invalid (as kv_store's constructor)
  static fact_layout of(kv_store_config config)
  {
    config.num_pages = 0;  // an empty host store: only its resolved layout is wanted
    config.space     = memory_space::host;
    config.pinned    = false;
    config.resource  = nullptr;
    return of(kv_store{config});
  }

  /// @brief Pages a fact of `tokens` tokens takes.
  std::int64_t pages_for(std::int64_t tokens) const noexcept
  {
    return (tokens + page_size - 1) / page_size;
  }

  /// @brief "30 layers x 3 KV heads x head_dim 64, layers [0, 30), heads [0, 3), bfloat16, pages
  /// of 16 tokens (92160 bytes)", for messages.
  std::string describe() const
  {
    auto const range = [](std::int32_t first, std::int32_t count) {
      return "[" + std::to_string(first) + ", " + std::to_string(first + count) + ")";
    };
    return std::to_string(model.num_layers) + " layers x " + std::to_string(model.num_kv_heads) +
           " KV heads x head_dim " + std::to_string(model.head_dim) + ", layers " +
           range(first_layer, num_layers) + ", heads " + range(first_head, num_heads) + ", " +
           to_string(store_dtype) +
           (compression == kv_compression::none ? std::string{}
                                                : std::string{" "} + to_string(compression)) +
           ", pages of " + std::to_string(page_size) + " tokens (" + std::to_string(page_bytes) +
           " bytes)";
  }

  /// @brief Equal layouts: pages copy between them as bytes.
  friend bool operator==(fact_layout const& a, fact_layout const& b) noexcept
  {
    return a.model == b.model && a.first_layer == b.first_layer && a.num_layers == b.num_layers &&
           a.first_head == b.first_head && a.num_heads == b.num_heads &&
           a.store_dtype == b.store_dtype && a.page_size == b.page_size &&
           a.page_bytes == b.page_bytes && a.compression == b.compression;
  }
  /// @brief Different layouts.
  friend bool operator!=(fact_layout const& a, fact_layout const& b) noexcept { return !(a == b); }
};

/// @brief One fact as a source hands it out, checked against its checksum.
struct fetched_fact {
  std::uint64_t fact_id{};              ///< the fact's id
  std::uint64_t namespace_id{};         ///< its namespace
  std::vector<std::int32_t> token_ids;  ///< its prompt tokens (at least one)
  std::vector<float> embedding;         ///< its text embedding; empty where the source keeps none
  /// `ceil(tokens / page_size)` pages of `page_bytes` bytes each, in token order (the bytes a
  /// kv_store's pool holds for the fact, rows past its last token included).
  std::vector<unsigned char> pages;
};

/// @brief What one fetch of a namespace returned: its generation and the facts asked for.
struct fetched_namespace {
  /// The namespace's generation when the facts were read (read atomically with them): it
  /// changes whenever a fact of the namespace is erased or replaced in the source, so a copy
  /// held under an older generation may be stale.
  std::uint64_t generation{};
  std::vector<fetched_fact> facts;  ///< the facts asked for, in the order asked
};

/**
 * @brief A source could not be reached or did not answer (connection refused, timeout, I/O
 * error): the request is refused or answered without memory, per its policy
 * (tiered_store::admit's `source_policy`); it is never answered from what may be stale.
 */
struct source_unavailable : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/**
 * @brief The interface of a level below the host tier.
 *
 * Implementations: directory_fact_source (directory_source.hpp, the snapshot files of a
 * directory), redis_fact_store (redis_source.hpp, a Redis server or cluster shared by replicas).
 * @note Not thread-safe unless an implementation says so: one source per thread (as a tiered_store
 * needs exclusive access for admit).
 */
class fact_source {
 public:
  virtual ~fact_source() = default;

  /// @brief The page layout of every fact this source hands out.
  virtual fact_layout const& layout() const = 0;

  /// @brief What the source is, for messages ("directory '/data/memory'", "redis 127.0.0.1:6379").
  virtual std::string name() const = 0;

  /**
   * @brief Reads facts of namespace `ns` and the namespace's generation, atomically: the facts
   * are those of that generation.
   * @param ns the namespace
   * @param ids the facts wanted, each at most once (may be empty: the generation only)
   * @return the generation and each fact, whole and checked against its checksum
   * @throw logic_error when a fact is absent, belongs to another namespace, or fails its
   *        checksum or a format check (the message names the file or key); source_unavailable
   *        when the source cannot be reached. Nothing is returned then.
   */
  virtual fetched_namespace fetch(std::uint64_t ns, std::vector<std::uint64_t> const& ids) = 0;

  /**
   * @brief Whether `f` is the fact this source holds under its namespace and id (same tokens, the
   * same page bytes), told from what the source keeps in memory without reading the fact: a copy
   * held elsewhere (a cache in front of this source) is checked with it. nullopt: this source
   * cannot tell without reading (the default); false also for a fact it does not hold.
   */
  virtual std::optional<bool> matches(fetched_fact const& f) const
  {
    (void)f;
    return std::nullopt;
  }

 protected:
  fact_source()                              = default;
  fact_source(fact_source const&)            = default;
  fact_source& operator=(fact_source const&) = default;
};

}  // namespace inferscale
