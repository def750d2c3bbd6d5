/**
 * @file tier.hpp
 * @brief Two tiers of fact KV: a device tier (the store injection reads) and a pinned host tier
 * (room for many more users), with a least-recently-used policy per namespace deciding which
 * facts keep a device copy, pinning for hot facts, and per-layer staging of host-resident facts
 * on the request path.
 *
 * A fact lives on the device, in the host tier, or both (`fact_residency`). The device tier is a
 * cache: a fact held in both tiers may lose its device copy to make room (it stays in the host
 * tier); a fact held only on the device, or pinned, is never evicted. A request:
 *
 *  1. `tiered_store::admit(ids)` gives every listed host-only fact pages in the device tier,
 *     evicting device copies that are not pinned, not device-only and not in the request — first
 *     from the requesting namespace if it is over its quota, then from the namespace used least
 *     recently, each from the tail of its LRU list — and returns the `tier_request` naming the page
 *     runs to copy. Everything is checked before anything changes; a request that cannot fit
 *     (too few free plus evictable device pages) is refused and changes nothing.
 *  2. The caller composes against `device_tier()` (every fact of the request is there now) and
 *     builds its `injection_batch` as usual.
 *  3. `tiered_store::run(request, step, cache, rotation)` (host backend,
 * detail/tier/inject_host.inl) or the same call with a `device_context` last (tier.cuh, device)
 * writes the step: the tokens of facts that were already on the device in one all-layer launch, the
 * staged ones layer by layer, each layer as soon as its copy has landed.
 *
 * On the device, `stage_async` issues one `cudaMemcpy2DAsync` per layer and page run on a copy
 * stream and records one event per layer; injection of layer `l` waits for event `l` on the
 * compute stream (`cudaStreamWaitEvent`), so copying layer `l + 1` overlaps injecting layer `l`
 * and the host never waits. Pages a request evicted may still be read by injections enqueued
 * earlier on the compute stream: the copy stream first waits for everything already enqueued on
 * the compute stream (one event), so a staged copy never overwrites a page in use.
 *
 * Staging needs no kernel of its own: layer `l` of the device pool seen alone is a one-layer
 * store whose page `p * L` is page `p`'s layer `l` (`tier_layer_view`), and layer `l` of the
 * engine's cache is a one-layer cache (`tier_cache_layer`), so the ordinary injection runs on
 * each layer.
 *
 * With a host device tier (`memory_space::host`, the host backend) both tiers are host memory, the
 * copies are `memcpy`, and the same plan runs: that is how the staging logic is tested without a
 * GPU. C++17 plus the CUDA runtime API (as store.hpp).
 *
 * Threads: the standard library's rule, as kv_store and graph_index — any number of concurrent
 * const calls (residency, usage, lru_order, the tiers' reads); any other call needs exclusive
 * access. A request is not a read: `admit` moves facts between the tiers and updates the LRU
 * lists, and a later admit may evict pages an earlier request's injection still reads, so an engine
 * serving from several threads holds one lock from `admit` until that request's injection is done
 * (on the device: enqueued; the copy stream orders later staging after it).
 *
 * Below the host tier, a `fact_source` (fact_source.hpp: a directory of snapshot files on disk,
 * directory_source.hpp; a Redis store shared by replicas, redis_source.hpp) holds facts the tiers
 * lack: `admit(keys, source, policy)` fetches only those facts' pages (checked by their
 * checksums), copies them as bytes into the host tier, which is an LRU cache of the source for
 * them (fetched facts are dropped least recently used first; facts inserted here never), and
 * admits the request as above; each namespace's generation in the source is checked on every
 * request, and a changed one drops the namespace's fetched copies before anything is served
 * (detail/tier/source.inl).
 *
 * The parts, in detail/tier/: the policy (policy.inl: residency, admission, LRU, pinning,
 * quotas), staging (staging.inl: copy runs, per-layer copies, the split batch, events), the
 * snapshot of the tiers (snapshot.inl: the free `save_tiers` / `load_tiers`, declared at the end
 * of this header, over detail/snapshot/directory_transaction.hpp) and the host backend of tiered
 * injection
 * (inject_host.inl); the device backend is tier.cuh.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/device_context.hpp>
#include <inferscale/error.hpp>
#include <inferscale/fact_source.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <list>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

/// @brief Which tiers hold a fact.
enum class fact_residency : std::uint8_t {
  device,  ///< the device tier only (never evicted)
  host,    ///< the host tier only (staged to the device when a request needs it)
  both,    ///< both: the device copy may be evicted
};

/// @brief Name of a residency.
inline char const* to_string(fact_residency r) noexcept
{
  return r == fact_residency::device ? "device" : r == fact_residency::host ? "host" : "both";
}

/**
 * @brief What admit(keys, source, policy) does when the source cannot be reached
 * (source_unavailable): never serve what may be stale.
 */
enum class source_policy : std::uint8_t {
  refuse,          ///< rethrow source_unavailable: the request is refused
  without_memory,  ///< return a request marked `without_memory`: answer it without its facts
};

/// @brief How to build a tiered_store.
struct tiered_store_config {
  /// The device tier: model geometry, shard, dtype, page size and its capacity (`num_pages`).
  /// `memory == device` puts it in device memory and the host tier in pinned host memory;
  /// `memory == host` keeps both tiers in ordinary host memory (host backend, tests).
  kv_store_config device{};
  std::int64_t host_pages{0};  ///< capacity of the host tier, in pages
  /// Most device pages one namespace may hold through admission (0 = no quota). Pinned and
  /// device-only facts count toward it but are never evicted for it.
  std::int64_t namespace_device_pages{0};
};

/// @brief Pages in use and free in each tier.
struct tier_usage {
  std::int64_t device_pages{};     ///< device-tier pages holding facts
  std::int64_t device_free{};      ///< device-tier pages free
  std::int64_t evictable_pages{};  ///< device pages held by unpinned facts also in the host tier
  std::int64_t host_pages{};       ///< host-tier pages holding facts
  std::int64_t host_free{};        ///< host-tier pages free
  std::int64_t device_bytes{};     ///< K and V bytes of the facts with a device copy
  std::int64_t host_bytes{};       ///< K and V bytes of the facts with a host copy
};

/// @brief A run of consecutive pages copied from the host tier to the device tier.
struct tier_copy_run {
  std::int64_t host_page{};    ///< first page in the host tier
  std::int64_t device_page{};  ///< first page in the device tier
  std::int64_t pages{};        ///< run length
};

/**
 * @brief What one admit() decided: the facts staged, the page runs to copy (the same runs for
 * every layer), and the device copies evicted.
 */
struct tier_request {
  std::vector<std::uint64_t> staged;   ///< host-only facts given device pages, in request order
  std::vector<std::uint64_t> evicted;  ///< facts whose device copy was dropped, in eviction order
  std::vector<tier_copy_run> runs;     ///< host → device page runs
  std::int64_t staged_pages{};         ///< device pages the staged facts took
  std::uint64_t device_version{};      ///< device tier version right after admission
  std::uint64_t store_identity{};      ///< the tiered store's device tier
  bool copies_issued{false};           ///< set by stage_async / stage_host
  /// admit(keys, source): facts read from the source into the host tier, in request order
  std::vector<std::uint64_t> fetched;
  /// admit(keys, source): fetched facts dropped from the tiers (to make room in the host tier, or
  /// because their namespace's generation changed in the source)
  std::vector<std::uint64_t> forgotten;
  /// admit(keys, source, source_policy::without_memory) found the source unreachable: nothing was
  /// admitted; answer the request without its facts
  bool without_memory{false};

  /// @brief Whether anything has to be copied.
  bool empty() const noexcept { return runs.empty(); }
};

/**
 * @brief Layer `layer` of a store pool seen as a one-layer store: page `p * L` of the view is
 * page `p`'s layer `layer` (store token `t` maps to `tier_layer_token(store, t)`).
 */
inline kv_store_ref tier_layer_view(kv_store_ref store, std::int32_t layer) noexcept
{
  kv_store_ref v = store;
  v.pool         = static_cast<unsigned char*>(store.pool) +
           static_cast<std::size_t>(layer) * static_cast<std::size_t>(store.layer_bytes());
  v.num_layers = 1;
  v.num_pages  = store.num_pages * store.num_layers;
  return v;
}

/// @brief Store token of the one-layer view (tier_layer_view) for store token `token`.
inline std::int64_t tier_layer_token(kv_store_ref const& store, std::int64_t token) noexcept
{
  std::int64_t const page = token / store.page_size;
  return (page * store.num_layers) * store.page_size + token % store.page_size;
}

/// @brief Layer `layer` of an engine cache as a one-layer cache (its bases and scales).
inline paged_kv_cache tier_cache_layer(paged_kv_cache const& cache, std::int32_t layer) noexcept
{
  paged_kv_cache c = cache;
  c.num_layers     = 1;
  c.key_base[0]    = cache.key_base[layer];
  c.value_base[0]  = cache.value_base[layer];
  c.key_scale[0]   = cache.key_scale[layer];
  c.value_scale[0] = cache.value_scale[layer];
  for (std::int32_t l = 1; l < paged_kv_cache::max_layers; ++l) {
    c.key_base[l]    = nullptr;
    c.value_base[l]  = nullptr;
    c.key_scale[l]   = nullptr;
    c.value_scale[l] = nullptr;
  }
  return c;
}

/**
 * @brief A batch split for tiered injection: the tokens of resident facts (store tokens of the
 * device tier) first, then those of staged facts (store tokens of the one-layer views).
 */
struct tier_split_batch {
  std::vector<std::int64_t> store_token;
  std::vector<std::int64_t> position;
  std::vector<std::int64_t> slot;
  std::int64_t resident{};  ///< tokens [0, resident) are resident, [resident, size) staged

  std::int64_t num_tokens() const noexcept { return static_cast<std::int64_t>(slot.size()); }
  injection_batch_view resident_view() const noexcept
  {
    return {store_token.data(), position.data(), slot.data(), resident};
  }
  injection_batch_view staged_view() const noexcept
  {
    return {store_token.data() + resident,
            position.data() + resident,
            slot.data() + resident,
            num_tokens() - resident};
  }
};

/// @brief How the host run of a tiered step (tiered_store::run) orders its copies and writes.
enum class tier_host_order : std::uint8_t {
  /// Copy every staged page, then inject the whole batch in one all-layer pass (the fastest on
  /// the host: one cos/sin per token and pair, as the host run).
  whole,
  /// The device's order: the resident tokens in one all-layer pass, then per layer the layer's
  /// copies and a one-layer pass over the staged tokens through tier_layer_view (what
  /// the device run enqueues; the host tests check it here).
  per_layer,
};

/**
 * @brief Move-only owner of the two tiers and the residency catalogue.
 *
 * Every mutating call validates first and either completes or throws leaving both tiers, the
 * residency catalogue and the LRU lists unchanged. The device tier is an ordinary kv_store:
 * compose and build injection batches against `device_tier()` after admit().
 */
class tiered_store {
 public:
  /**
   * @brief Allocates both tiers once.
   * @throw logic_error if the configuration is invalid; cuda_error if an allocation fails.
   */
  explicit tiered_store(tiered_store_config const& config)
    : config_{check(config)}, device_{config_.device}, host_{host_config(config_)}
  {
    create_events();
  }

  ~tiered_store() { release_events(); }

  tiered_store(tiered_store&& o) noexcept
    : config_{o.config_},
      device_{std::move(o.device_)},
      host_{std::move(o.host_)},
      facts_{std::move(o.facts_)},
      namespaces_{std::move(o.namespaces_)},
      fetched_lru_{std::move(o.fetched_lru_)},
      source_generation_{std::move(o.source_generation_)},
      clock_{o.clock_},
      copy_done_{std::move(o.copy_done_)},
      compute_mark_{std::exchange(o.compute_mark_, nullptr)}
  {
    o.copy_done_.clear();
  }
  tiered_store& operator=(tiered_store&&)      = delete;
  tiered_store(tiered_store const&)            = delete;
  tiered_store& operator=(tiered_store const&) = delete;

  tiered_store_config const& config() const noexcept { return config_; }
  /// @brief The device tier: compose and build injection batches against it after admit().
  kv_store const& device_tier() const noexcept { return device_; }
  /// @brief The host tier.
  kv_store const& host_tier() const noexcept { return host_; }

  std::int64_t num_facts() const noexcept { return static_cast<std::int64_t>(facts_.size()); }
  bool contains(std::uint64_t id) const { return facts_.count(id) != 0; }

  /// @brief Which tiers hold a fact. @throw logic_error if unknown.
  fact_residency residency(std::uint64_t id) const;
  /// @brief Whether a fact is pinned on the device. @throw logic_error if unknown.
  bool is_pinned(std::uint64_t id) const { return find(id, "tiered_store::is_pinned").pinned; }

  /// @brief Pages and bytes per tier.
  tier_usage usage() const;

  /// @brief Device pages held by namespace `ns` (pinned, device-only and cached copies).
  std::int64_t namespace_device_pages(std::uint64_t ns) const
  {
    return device_.namespace_pages(ns);
  }
  /// @brief Host pages held by namespace `ns`.
  std::int64_t namespace_host_pages(std::uint64_t ns) const { return host_.namespace_pages(ns); }

  /// @brief The evictable facts of `ns` with a device copy, most recently used first.
  std::vector<std::uint64_t> lru_order(std::uint64_t ns) const;

  /**
   * @brief Stores a fact's pre-RoPE K and V in the tiers `placement` names (views as
   * kv_store::insert takes them, in host memory).
   * @throw logic_error if the id is present, the views are refused by kv_store::insert, or a
   *        tier has too few free pages (device placement never evicts: call admit or evict);
   *        nothing is changed then.
   * @param stream the stream the device tier is written on (kv_store::insert: host views are
   *        staged through pinned memory, copied on `stream`, and `stream`, not the device, is
   *        waited for); default: the legacy default stream
   * @note Waits for the copies (as kv_store::insert with host views): the fact is in both tiers
   *       on return.
   */
  template <class T>
  void insert(std::uint64_t id,
              std::uint64_t ns,
              std::vector<std::int32_t> token_ids,
              fact_kv_view<T const> keys,
              fact_kv_view<T const> values,
              fact_residency placement = fact_residency::host,
              cudaStream_t stream      = cudaStream_t{});

  /// @brief Removes a fact from both tiers, zeroing its pages. @throw logic_error if unknown.
  /// @note Not for the request path: on the device the zeroing is a cudaMemset on the default
  ///       stream; erase only facts no injection in flight still reads.
  void erase(std::uint64_t id);

  /// @brief Removes every fact of namespace `ns` from both tiers (pages zeroed, as erase);
  /// returns how many.
  std::int64_t erase_namespace(std::uint64_t ns);

  /**
   * @brief Keeps a fact on the device until unpinned: copies it there now if it is host-only
   * (evicting as admit() does).
   * @throw logic_error if unknown or the device tier cannot make room (nothing changed).
   * @note Waits for the copy.
   */
  void pin(std::uint64_t id);

  /// @brief Lets a pinned fact be evicted again (it joins its namespace's LRU as most recent).
  void unpin(std::uint64_t id);

  /**
   * @brief Drops the device copy of a fact held in both tiers.
   * @throw logic_error if unknown, pinned, or held on the device only (demote it first).
   * @note Not for the request path: first waits (on the host) for the tier's events, not the
   *       whole device: the last staging's copies and the last device run (mark_injected), so no
   *       injection enqueued through them still reads the pages. Injections the caller enqueued
   *       by other means against device_tier() (injection_batch::run) are not tracked: the caller
   * orders them before evict (a cudaStreamSynchronize of their stream, or mark_injected on it).
   */
  void evict(std::uint64_t id);

  /**
   * @brief Gives a device-only fact a host copy (it becomes evictable unless pinned).
   * @throw logic_error if unknown, already in the host tier, or the host tier is full.
   * @note Waits for the copy.
   */
  void demote(std::uint64_t id);

  /**
   * @brief Admits a request: every listed fact ends up with a device copy, host-only ones by
   * taking device pages (evicting as the file comment says); every listed fact becomes the most
   * recent of its namespace, and each namespace involved the most recently used.
   *
   * @param ids the facts of one scheduler step (one or several requests), each at most once
   * @return the staging to perform (stage_async / stage_host, or run() does it)
   * @throw logic_error if an id is unknown or repeated, or the device tier cannot make room:
   *        the needed, free and evictable page counts are named and nothing is changed.
   */
  tier_request admit(std::vector<std::uint64_t> const& ids);

  /**
   * @brief Admits a request whose facts may lie only in `source` (the level below the host tier,
   * fact_source.hpp): the facts held by neither tier are fetched (only their pages), copied as
   * bytes into the host tier, and then admitted as admit(ids) does.
   *
   * Per namespace of the request, in order of first appearance: one `source.fetch(ns, missing)`
   * reads the facts held by neither tier and the namespace's generation atomically. When the
   * generation differs from the one the held copies were fetched under, a fact of the namespace
   * was erased or replaced in the source: every fetched copy of the namespace is dropped from
   * both tiers at once (listed in `forgotten`, kept dropped even if the request is then refused:
   * stale copies are never kept) and the request's facts of the namespace are fetched again.
   *
   * Fetched facts go to the host tier, which is a cache of the source for them: when it has too
   * few free pages, fetched facts that are not pinned and not in the request are dropped from
   * both tiers, least recently used first (`fetched_order()`; they can be fetched again); facts
   * inserted here are never dropped.
   * Then admission to the device tier is planned as admit(ids) plans it. Everything is checked
   * (source layout, ids, namespaces, fetched facts' sizes, room in both tiers) before the tiers
   * change; a refused call changes nothing but the stale copies dropped.
   *
   * @param keys the facts of one scheduler step with their namespaces, each id at most once
   * @param source the facts' source; its layout() must be the tiers' page layout
   * @param policy what to do when the source is unreachable
   * @return the staging to perform, with `fetched` and `forgotten` (or, unreachable under
   *         source_policy::without_memory, a request with `without_memory` set and nothing staged)
   * @throw logic_error if the source's layout differs from the tiers', an id is repeated or held
   *        here under another namespace, the source refuses a fact (absent, another namespace,
   *        checksum mismatch), a fetched fact's size disagrees with its tokens, or a tier cannot
   *        make room; source_unavailable (source_policy::refuse) if the source cannot be reached.
   * @note Device tiers: dropping a stale fact's device copy first waits for the tier's device
   *       work (as evict). The fetched pages are copied into the host tier with memcpy (pinned
   *       host memory for device tiers); staging to the device is then as for admit(ids).
   */
  tier_request admit(std::vector<fact_key> const& keys,
                     fact_source& source,
                     source_policy policy = source_policy::refuse);

  /// @brief Whether a fact was fetched from a source (its host copy may be dropped to make room).
  /// @throw logic_error if unknown.
  bool is_fetched(std::uint64_t id) const { return find(id, "tiered_store::is_fetched").fetched; }

  /// @brief The fetched facts held, most recently used first (dropped from the end first).
  std::vector<std::uint64_t> fetched_order() const
  {
    return {fetched_lru_.begin(), fetched_lru_.end()};
  }

  /**
   * @brief Host run of a tiered step: copies the request's staged facts into the device tier and
   * writes `step` (in the order `order` names) into `cache`. The cache bytes equal those of the
   * step's own host run (injection_batch::run) from one store holding every fact, in either order.
   *
   * @param request what admit() returned for the facts of `step`
   * @param step    built against device_tier() after admit()
   * @throw logic_error as the host run (injection_batch::run), if the step holds cache adapters
   *        (they commit only through injection_batch::run), or if the request is stale; nothing is
   *        written then.
   * @note Host tiers (`config().device.space == host`). Defined in detail/tier/inject_host.inl.
   */
  template <class Rotation>
  void run(tier_request& request,
           injection_batch const& step,
           paged_kv_cache const& cache,
           Rotation const& rotation,
           tier_host_order order = tier_host_order::whole);

  /**
   * @brief Device run of a tiered step: writes `step` (built against device_tier() after admit()
   * returned `request`) into `cache` (device memory).
   *
   * Enqueues, without waiting: (if not done yet) the request's copies on `device.copy_stream()`
   * after everything already on `device.stream()` (stage_async); the split step's arrays into
   * `device.workspace()` on `device.stream()`; one all-layer launch for the tokens of resident
   * facts; then per layer `l` a wait on the copy event of layer `l` and a one-layer launch for
   * the staged tokens. Work enqueued on `device.stream()` afterwards sees every staged fact (its
   * copies are ordered before the last launch); work on another stream must wait on an event
   * recorded there. Last, the tier's compute-stream event is recorded (mark_injected), which
   * evict waits for before it frees the pages.
   *
   * @throw logic_error as the device run (injection_batch::run), if the step holds cache adapters
   *        (they commit only through injection_batch::run), if the context has no workspace or
   *        the request is stale (nothing is enqueued then); cuda_error on a CUDA failure.
   * @note The workspace holds the split arrays: at least `step.num_tokens()` tokens; its device
   *       error counters (injection_workspace::read_errors) count what the launches skipped.
   *       Defined in tier.cuh (include it; nvcc).
   */
  template <class Rotation>
  void run(tier_request& request,
           injection_batch const& step,
           paged_kv_cache const& cache,
           Rotation const& rotation,
           device_context const& device);

  /**
   * @brief Host tiers: copies the request's runs now, all layers at once (the device copies per
   * layer). Used by pin() and the host run, or by a caller that wants the copies first.
   */
  void stage_host(tier_request& r);

  /**
   * @brief Device tiers: enqueues the request's copies on `copy_stream`, layer by layer, after
   * everything already enqueued on `compute_stream`, recording one event per layer.
   * @note Never waits. Call at most once per request.
   */
  void stage_async(tier_request& r, cudaStream_t copy_stream, cudaStream_t compute_stream);

  // ---- snapshots -----------------------------------------------------------------------------

  /// @brief Same as `save_tiers(*this, directory)` (a thin wrapper kept for existing callers).
  /// @throw logic_error as save_tiers
  void save(std::string const& directory) const;

  /// @brief Same as `load_tiers(directory, config)` (a thin wrapper kept for existing callers).
  /// @throw logic_error as load_tiers
  static tiered_store load(std::string const& directory, tiered_store_config const& config);

  /// @brief The event recorded when layer `l` of the last staging had landed (device tiers).
  cudaEvent_t layer_ready(std::int32_t l) const noexcept;

  /**
   * @brief Device tiers: records the tier's compute-stream event on `compute_stream`, marking
   * the end of injections enqueued there that read the device tier (the device run calls it
   * after its last launch). evict() waits for this event, not for the device. Host tiers: nothing.
   * @throw cuda_error if recording fails.
   */
  void mark_injected(cudaStream_t compute_stream);

  /// @brief Host tiers: copies layer `l` of the request's runs (memcpy).
  void copy_layer_host(tier_request const& r, std::int32_t l);

  /**
   * @brief Splits a batch built against device_tier() after admit(r): tokens of staged facts
   * move to the end with their store tokens mapped to the one-layer views.
   * @throw logic_error if the request is stale (the device tier changed since admit) or the
   *        batch is for another store.
   */
  tier_split_batch split(tier_request const& r,
                         injection_batch const& batch,
                         char const* who) const;

 private:
  friend void save_tiers(tiered_store const& tiers, std::string const& directory);
  friend tiered_store load_tiers(std::string const& directory, tiered_store_config const& config);

  struct entry {
    std::uint64_t ns{};
    std::int64_t tokens{};
    bool on_device{false};
    bool on_host{false};
    bool pinned{false};
    bool linked{false};                               ///< in its namespace's LRU list
    std::list<std::uint64_t>::iterator lru_it{};      ///< valid when linked
    bool fetched{false};                              ///< read from a fact_source (in fetched_lru_)
    std::list<std::uint64_t>::iterator fetched_it{};  ///< valid when fetched
  };
  /// Facts about to be fetched: id -> (namespace, tokens).
  using incoming_facts = std::unordered_map<std::uint64_t, std::pair<std::uint64_t, std::int64_t>>;
  struct namespace_tier {
    std::list<std::uint64_t> lru;  ///< evictable facts with a device copy, most recent first
    std::uint64_t last_use{};
  };

  static constexpr char const* manifest_name       = "tiers.istr";
  static constexpr unsigned char manifest_magic[8] = {0x89, 'I', 'S', 'T', 'I', 'R', 0x0D, 0x0A};

  struct manifest_namespace;
  struct manifest_data;

  static std::string tier_file(char const* tier, std::uint64_t checksum);

  static std::vector<unsigned char> encode_manifest(manifest_data const& m);

  static manifest_data parse_manifest(std::vector<unsigned char> const& b,
                                      std::string const& where);

  /// Builds tiers from loaded stores and a parsed manifest, after checking they agree.
  tiered_store(tiered_store_config const& config,
               kv_store&& device,
               kv_store&& host,
               manifest_data const& m,
               std::string const& where);

  static tiered_store_config check(tiered_store_config c);

  static kv_store_config host_config(tiered_store_config const& c);

  static bool evictable(entry const& e) noexcept { return e.on_device && e.on_host && !e.pinned; }

  std::int32_t layers() const noexcept { return device_.geometry().num_layers; }
  std::size_t page_bytes_() const noexcept;

  entry& find(std::uint64_t id, char const* who);
  entry const& find(std::uint64_t id, char const* who) const;

  /// Puts an evictable fact at the front (most recent) of its namespace's LRU list.
  void link(std::uint64_t id, entry& e);

  void unlink(entry& e);

  void touch(std::uint64_t id, entry& e);

  /// The device copies to evict for `ids` (facts in `incoming` count as host-only, facts in
  /// `forgetting` as already gone from both tiers); throws when they cannot fit. Changes nothing.
  std::vector<std::uint64_t> plan_admission(
    std::vector<std::uint64_t> const& ids,
    incoming_facts const* incoming,
    std::unordered_set<std::uint64_t> const* forgetting) const;

  /// Evicts `victims` and gives the host-only facts of `ids` device pages (admit's commit).
  tier_request commit_admission(std::vector<std::uint64_t> const& ids,
                                std::vector<std::uint64_t> const& victims);

  /// Drops every fetched fact of `ns` from both tiers, appending their ids to `out`.
  void forget_fetched(std::uint64_t ns, std::vector<std::uint64_t>& out);

  void drop_device_copy(std::uint64_t id, entry& e);

  /// Erasing a fact zeroes its pages in both tiers, so no erased K/V stays in either pool.
  void drop(std::unordered_map<std::uint64_t, entry>::iterator it);

  static void append_runs(std::vector<tier_copy_run>& runs,
                          std::vector<std::int64_t> const& host_pages,
                          std::vector<std::int64_t> const& device_pages);

  /// Copies a fact's pages, all layers, between the tiers (synchronous).
  void copy_pages(fact_record const& device_fact, fact_record const& host_fact, bool to_device);

  /// Copies a just-admitted request synchronously (pin()).
  void stage_now(tier_request& r);

  /// Waits for the tier's device work (its events), not the device: see evict().
  void wait_device();

  /// Device tiers: one event per layer and the compute-stream mark (none for host tiers).
  void create_events();

  void release_events() noexcept;

  tiered_store_config config_;
  kv_store device_;
  kv_store host_;
  std::unordered_map<std::uint64_t, entry> facts_;
  std::unordered_map<std::uint64_t, namespace_tier> namespaces_;
  std::list<std::uint64_t> fetched_lru_;  ///< fetched facts, most recently used first
  std::unordered_map<std::uint64_t, std::uint64_t> source_generation_;  ///< per namespace
  std::uint64_t clock_{0};
  std::vector<cudaEvent_t> copy_done_;
  cudaEvent_t compute_mark_{};
};

/**
 * @brief Saves both tiers and the residency state to `directory` (which must exist), as one
 * directory transaction (detail/snapshot/directory_transaction.hpp): each tier with save_store
 * (`device-<crc>.iskv`, `host-<crc>.iskv`, named after their file checksums), then the manifest
 * `tiers.istr` atomically, last; only then are the previous snapshot's tier files removed, so a
 * failed or interrupted save leaves the previous snapshot loadable, and a failed one (an
 * exception) no file of its own behind; what a save killed outright leaves (its temporaries, tier
 * files it never committed) the next save removes.
 *
 * Manifest, little-endian, version 1: magic `89 49 53 54 49 52 0D 0A` ("\x89ISTIR\r\n"),
 * version uint32 = 1, byte-order mark uint32 0x01020304, the device tier file's checksum, the
 * host tier file's checksum, the LRU clock (uint64 each), the namespace count N and the pinned
 * count P (uint64); N records in ascending namespace order — namespace, last use, LRU length n
 * (uint64 each) and n fact ids, most recent first; P pinned fact ids ascending; then the CRC-64
 * of every byte before it. Residency is not stored: it is which tier files hold a fact.
 *
 * @param[in] tiers the tiered store
 * @param[in] directory an existing directory
 * @throw logic_error as save_store, naming the file and the system's reason
 * @note Waits for the device. Serialise saves to one directory.
 */
void save_tiers(tiered_store const& tiers, std::string const& directory);

/**
 * @brief Restarts tiers from a snapshot written by save_tiers: the manifest is read and checked,
 * then each tier file it names must carry the checksum it recorded (files of different saves are
 * never paired); both tier files are loaded against `config` (load_store(path, target): the same
 * geometry, shard, page size and capacities; the dtype converted; the memory space and pinning
 * from `config`), then the residency state is checked against them before the tiered store is
 * built: a fact in both tiers has the same namespace and tokens in each; pinned facts have a
 * device copy; each namespace's LRU list is exactly its unpinned facts held in both tiers, once
 * each; last uses are below the clock.
 *
 * @param[in] directory a directory written by save_tiers
 * @param[in] config the tiers' configuration
 * @return the tiers, their residency, pins and LRU state as saved
 * @throw logic_error when the manifest is missing, corrupted or names files that do not carry
 * its checksums; as load_store; or when the state is inconsistent as said (nothing is built).
 */
tiered_store load_tiers(std::string const& directory, tiered_store_config const& config);

}  // namespace inferscale

#include <inferscale/detail/tier/inject_host.inl>
#include <inferscale/detail/tier/policy.inl>
#include <inferscale/detail/tier/snapshot.inl>
#include <inferscale/detail/tier/source.inl>
#include <inferscale/detail/tier/staging.inl>
