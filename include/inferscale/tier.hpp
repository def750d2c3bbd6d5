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
 *  3. `inject_tiered_host` (here, host backend) or `inject_tiered_async` (tier.cuh, device)
 *     writes the batch: the tokens of facts that were already on the device in one all-layer
 *     launch, the staged ones layer by layer, each layer as soon as its copy has landed.
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
 * With a host device tier (`memory_kind::host`, the host backend) both tiers are host memory, the
 * copies are `memcpy`, and the same plan runs: that is how the staging logic is tested without a
 * GPU. C++17 plus the CUDA runtime API (as store.hpp).
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/error.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/memory_kind.hpp>
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
  std::int64_t const layer_elements =
    2 * static_cast<std::int64_t>(store.page_size) * store.row_elements();
  v.pool = static_cast<unsigned char*>(store.pool) +
           static_cast<std::size_t>(layer) * static_cast<std::size_t>(layer_elements) *
             size_of(store.store_dtype);
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
  paged_kv_cache c  = cache;
  c.num_layers      = 1;
  c.key_base[0]     = cache.key_base[layer];
  c.value_base[0]   = cache.value_base[layer];
  c.key_scale[0]    = cache.key_scale[layer];
  c.value_scale[0]  = cache.value_scale[layer];
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
  fact_residency residency(std::uint64_t id) const
  {
    entry const& e = find(id, "tiered_store::residency");
    return e.on_device && e.on_host ? fact_residency::both
           : e.on_device            ? fact_residency::device
                                    : fact_residency::host;
  }
  /// @brief Whether a fact is pinned on the device. @throw logic_error if unknown.
  bool is_pinned(std::uint64_t id) const { return find(id, "tiered_store::is_pinned").pinned; }

  /// @brief Pages and bytes per tier.
  tier_usage usage() const
  {
    tier_usage u;
    u.device_pages = device_.num_pages() - device_.free_pages();
    u.device_free  = device_.free_pages();
    u.host_pages   = host_.num_pages() - host_.free_pages();
    u.host_free    = host_.free_pages();
    for (auto const& [id, e] : facts_) {
      std::int64_t const tokens = e.tokens;
      if (e.on_device) { u.device_bytes += device_.fact_bytes(tokens); }
      if (e.on_host) { u.host_bytes += host_.fact_bytes(tokens); }
      if (evictable(e)) { u.evictable_pages += device_.pages_for(tokens); }
    }
    return u;
  }

  /// @brief Device pages held by namespace `ns` (pinned, device-only and cached copies).
  std::int64_t namespace_device_pages(std::uint64_t ns) const { return device_.namespace_pages(ns); }
  /// @brief Host pages held by namespace `ns`.
  std::int64_t namespace_host_pages(std::uint64_t ns) const { return host_.namespace_pages(ns); }

  /// @brief The evictable facts of `ns` with a device copy, most recently used first.
  std::vector<std::uint64_t> lru_order(std::uint64_t ns) const
  {
    auto const it = namespaces_.find(ns);
    if (it == namespaces_.end()) { return {}; }
    return {it->second.lru.begin(), it->second.lru.end()};
  }

  /**
   * @brief Stores a fact's pre-RoPE K and V in the tiers `placement` names (views as
   * kv_store::insert takes them, in host memory).
   * @throw logic_error if the id is present, the views are refused by kv_store::insert, or a
   *        tier has too few free pages (device placement never evicts: call admit or evict);
   *        nothing is changed then.
   * @note Waits for the copies (as kv_store::insert).
   */
  template <class T>
  void insert(std::uint64_t id,
              std::uint64_t ns,
              std::vector<std::int32_t> token_ids,
              fact_kv_view<T const> keys,
              fact_kv_view<T const> values,
              fact_residency placement = fact_residency::host)
  {
    INFERSCALE_EXPECTS(!contains(id),
                       "tiered_store::insert: fact id " + std::to_string(id) + " already stored");
    std::int64_t const tokens = static_cast<std::int64_t>(token_ids.size());
    std::int64_t const pages  = device_.pages_for(tokens);
    bool const dev            = placement != fact_residency::host;
    bool const hst            = placement != fact_residency::device;
    if (dev) {
      INFERSCALE_EXPECTS(pages <= device_.free_pages(),
                         "tiered_store::insert: fact " + std::to_string(id) + " needs " +
                           std::to_string(pages) + " device pages, " +
                           std::to_string(device_.free_pages()) + " are free");
    }
    if (hst) {
      INFERSCALE_EXPECTS(pages <= host_.free_pages(),
                         "tiered_store::insert: fact " + std::to_string(id) + " needs " +
                           std::to_string(pages) + " host pages, " +
                           std::to_string(host_.free_pages()) + " are free");
    }
    if (hst) { host_.insert(id, ns, dev ? token_ids : std::move(token_ids), keys, values); }
    if (dev) {
      try {
        device_.insert(id, ns, hst ? host_.at(id).token_ids : std::move(token_ids), keys, values);
      } catch (...) {
        if (hst) { host_.erase(id); }
        throw;
      }
    }
    entry e;
    e.ns        = ns;
    e.tokens    = tokens;
    e.on_device = dev;
    e.on_host   = hst;
    auto& n     = namespaces_[ns];
    n.last_use  = ++clock_;
    link(id, facts_.emplace(id, e).first->second);
  }

  /// @brief Removes a fact from both tiers, zeroing its pages. @throw logic_error if unknown.
  /// @note Not for the request path: on the device the zeroing is a cudaMemset on the default
  ///       stream; erase only facts no injection in flight still reads.
  void erase(std::uint64_t id)
  {
    auto const it = facts_.find(id);
    INFERSCALE_EXPECTS(it != facts_.end(),
                       "tiered_store::erase: unknown fact id " + std::to_string(id));
    drop(it);
  }

  /// @brief Removes every fact of namespace `ns` from both tiers (pages zeroed, as erase);
  /// returns how many.
  std::int64_t erase_namespace(std::uint64_t ns)
  {
    std::vector<std::uint64_t> ids;
    for (auto const& [id, e] : facts_) {
      if (e.ns == ns) { ids.push_back(id); }
    }
    for (std::uint64_t id : ids) {
      drop(facts_.find(id));
    }
    namespaces_.erase(ns);
    return static_cast<std::int64_t>(ids.size());
  }

  /**
   * @brief Keeps a fact on the device until unpinned: copies it there now if it is host-only
   * (evicting as admit() does).
   * @throw logic_error if unknown or the device tier cannot make room (nothing changed).
   * @note Waits for the copy.
   */
  void pin(std::uint64_t id)
  {
    entry& e = find(id, "tiered_store::pin");
    if (!e.on_device) {
      tier_request r = admit({id});
      stage_now(r);
    }
    entry& f = facts_.at(id);
    if (f.pinned) { return; }
    unlink(f);
    f.pinned = true;
  }

  /// @brief Lets a pinned fact be evicted again (it joins its namespace's LRU as most recent).
  void unpin(std::uint64_t id)
  {
    entry& e = find(id, "tiered_store::unpin");
    if (!e.pinned) { return; }
    e.pinned = false;
    link(id, e);
  }

  /**
   * @brief Drops the device copy of a fact held in both tiers.
   * @throw logic_error if unknown, pinned, or held on the device only (demote it first).
   * @note Not for the request path: waits for the device first, so no injection still reads the
   *       pages.
   */
  void evict(std::uint64_t id)
  {
    entry& e = find(id, "tiered_store::evict");
    INFERSCALE_EXPECTS(e.on_device, "tiered_store::evict: fact " + std::to_string(id) +
                                      " has no device copy");
    INFERSCALE_EXPECTS(!e.pinned,
                       "tiered_store::evict: fact " + std::to_string(id) + " is pinned");
    INFERSCALE_EXPECTS(e.on_host, "tiered_store::evict: fact " + std::to_string(id) +
                                    " is held on the device only; demote it first");
    wait_device();
    drop_device_copy(id, e);
  }

  /**
   * @brief Gives a device-only fact a host copy (it becomes evictable unless pinned).
   * @throw logic_error if unknown, already in the host tier, or the host tier is full.
   * @note Waits for the copy.
   */
  void demote(std::uint64_t id)
  {
    entry& e = find(id, "tiered_store::demote");
    INFERSCALE_EXPECTS(!e.on_host, "tiered_store::demote: fact " + std::to_string(id) +
                                     " is already in the host tier");
    INFERSCALE_EXPECTS(host_.pages_for(e.tokens) <= host_.free_pages(),
                       "tiered_store::demote: fact " + std::to_string(id) + " needs " +
                         std::to_string(host_.pages_for(e.tokens)) + " host pages, " +
                         std::to_string(host_.free_pages()) + " are free");
    fact_record const& d = device_.at(id);
    fact_record const& h = host_.reserve(id, e.ns, d.token_ids);
    try {
      copy_pages(d, h, /*to_device=*/false);
    } catch (...) {
      host_.erase(id);
      throw;
    }
    e.on_host = true;
    link(id, e);
  }

  /**
   * @brief Admits a request: every listed fact ends up with a device copy, host-only ones by
   * taking device pages (evicting as the file comment says); every listed fact becomes the most
   * recent of its namespace, and each namespace involved the most recently used.
   *
   * @param ids the facts of one scheduler step (one or several requests), each at most once
   * @return the staging to perform (stage_async / stage_host, or the inject_tiered_* calls do it)
   * @throw logic_error if an id is unknown or repeated, or the device tier cannot make room:
   *        the needed, free and evictable page counts are named and nothing is changed.
   */
  tier_request admit(std::vector<std::uint64_t> const& ids)
  {
    std::unordered_set<std::uint64_t> in_request;
    std::int64_t need = 0;
    std::unordered_map<std::uint64_t, std::int64_t> need_per_ns;
    for (std::uint64_t id : ids) {
      entry const& e = find(id, "tiered_store::admit");
      INFERSCALE_EXPECTS(in_request.insert(id).second,
                         "tiered_store::admit: fact id " + std::to_string(id) +
                           " is listed twice");
      if (!e.on_device) {
        std::int64_t const p = device_.pages_for(e.tokens);
        need += p;
        need_per_ns[e.ns] += p;
      }
    }
    // Choose victims without changing anything.
    std::vector<std::uint64_t> victims;
    std::unordered_set<std::uint64_t> chosen;
    std::unordered_map<std::uint64_t, std::int64_t> freed_per_ns;
    std::int64_t freed = 0;
    auto take_from = [&](std::uint64_t ns, std::int64_t const& goal, std::int64_t const& have) {
      auto const nit = namespaces_.find(ns);
      if (nit == namespaces_.end()) { return; }
      auto const& lru = nit->second.lru;
      for (auto it = lru.rbegin(); it != lru.rend() && have < goal; ++it) {
        if (in_request.count(*it) != 0 || chosen.count(*it) != 0) { continue; }
        std::int64_t const p = device_.pages_for(facts_.at(*it).tokens);
        chosen.insert(*it);
        victims.push_back(*it);
        freed += p;
        freed_per_ns[ns] += p;
      }
    };
    if (config_.namespace_device_pages > 0) {
      for (auto const& [ns, p] : need_per_ns) {
        std::int64_t const over = device_.namespace_pages(ns) + p - config_.namespace_device_pages;
        if (over <= 0) { continue; }
        std::int64_t const goal = over;
        take_from(ns, goal, freed_per_ns[ns]);
        INFERSCALE_EXPECTS(freed_per_ns[ns] >= over,
                           "tiered_store::admit: namespace " + std::to_string(ns) + " needs " +
                             std::to_string(p) + " more device pages beyond its " +
                             std::to_string(device_.namespace_pages(ns)) + " and its quota is " +
                             std::to_string(config_.namespace_device_pages) +
                             "; only " + std::to_string(freed_per_ns[ns]) +
                             " of its pages are evictable");
      }
    }
    if (need > device_.free_pages() + freed) {
      // Namespaces by last use, oldest first.
      std::vector<std::pair<std::uint64_t, std::uint64_t>> order;
      for (auto const& [ns, n] : namespaces_) {
        order.emplace_back(n.last_use, ns);
      }
      std::sort(order.begin(), order.end());
      std::int64_t const goal = need - device_.free_pages();
      for (auto const& [use, ns] : order) {
        if (freed >= goal) { break; }
        take_from(ns, goal, freed);
      }
      INFERSCALE_EXPECTS(freed >= goal,
                         "tiered_store::admit: the request needs " + std::to_string(need) +
                           " device pages; " + std::to_string(device_.free_pages()) +
                           " are free and " + std::to_string(freed) +
                           " more can be evicted (pinned, device-only and requested facts "
                           "stay)");
    }

    // Commit: evict, then give the staged facts pages (lowest free pages first).
    tier_request r;
    for (std::uint64_t v : victims) {
      drop_device_copy(v, facts_.at(v));
      r.evicted.push_back(v);
    }
    for (std::uint64_t id : ids) {
      entry& e = facts_.at(id);
      if (!e.on_device) {
        fact_record const& h = host_.at(id);
        fact_record const& d = device_.reserve(id, e.ns, h.token_ids);
        e.on_device          = true;
        r.staged.push_back(id);
        r.staged_pages += static_cast<std::int64_t>(d.pages.size());
        append_runs(r.runs, h.pages, d.pages);
      }
      touch(id, e);
    }
    r.device_version = device_.version();
    r.store_identity = device_.identity();
    return r;
  }

  /**
   * @brief Host tiers: copies the request's runs now, all layers at once (the device copies per
   * layer). Used by pin() and inject_tiered_host, or by a caller that wants the copies first.
   */
  void stage_host(tier_request& r)
  {
    INFERSCALE_EXPECTS(config_.device.memory == memory_kind::host,
                       "tiered_store::stage_host: the device tier is in device memory; use "
                       "stage_async");
    // Whole runs: every layer of consecutive pages is one contiguous block in both pools.
    std::size_t const page_bytes = page_bytes_();
    auto* const dst              = static_cast<unsigned char*>(device_.ref().pool);
    auto const* const src        = static_cast<unsigned char const*>(host_.ref().pool);
    for (tier_copy_run const& run : r.runs) {
      std::memcpy(dst + static_cast<std::size_t>(run.device_page) * page_bytes,
                  src + static_cast<std::size_t>(run.host_page) * page_bytes,
                  static_cast<std::size_t>(run.pages) * page_bytes);
    }
    r.copies_issued = true;
  }

  /**
   * @brief Device tiers: enqueues the request's copies on `copy_stream`, layer by layer, after
   * everything already enqueued on `compute_stream`, recording one event per layer.
   * @note Never waits. Call at most once per request.
   */
  void stage_async(tier_request& r, cudaStream_t copy_stream, cudaStream_t compute_stream)
  {
    INFERSCALE_EXPECTS(config_.device.memory == memory_kind::device,
                       "tiered_store::stage_async: the tiers are in host memory; use stage_host");
    INFERSCALE_EXPECTS(!r.copies_issued, "tiered_store::stage_async: copies already issued");
    INFERSCALE_CUDA_TRY(cudaEventRecord(compute_mark_, compute_stream));
    INFERSCALE_CUDA_TRY(cudaStreamWaitEvent(copy_stream, compute_mark_, 0));
    std::size_t const page_bytes  = page_bytes_();
    std::size_t const layer_bytes = page_bytes / static_cast<std::size_t>(layers());
    auto* const dst               = static_cast<unsigned char*>(device_.ref().pool);
    auto const* const src         = static_cast<unsigned char const*>(host_.ref().pool);
    for (std::int32_t l = 0; l < layers(); ++l) {
      for (tier_copy_run const& run : r.runs) {
        INFERSCALE_CUDA_TRY(
          cudaMemcpy2DAsync(dst + static_cast<std::size_t>(run.device_page) * page_bytes +
                              static_cast<std::size_t>(l) * layer_bytes,
                            page_bytes,
                            src + static_cast<std::size_t>(run.host_page) * page_bytes +
                              static_cast<std::size_t>(l) * layer_bytes,
                            page_bytes,
                            layer_bytes,
                            static_cast<std::size_t>(run.pages),
                            cudaMemcpyHostToDevice,
                            copy_stream));
      }
      INFERSCALE_CUDA_TRY(cudaEventRecord(copy_done_[static_cast<std::size_t>(l)], copy_stream));
    }
    r.copies_issued = true;
  }

  // ---- snapshots -----------------------------------------------------------------------------

  /**
   * @brief Saves both tiers and the residency state to `directory` (which must exist): each tier
   * with save_store (`device-<crc>.iskv`, `host-<crc>.iskv`, named after their file checksums),
   * then the manifest `tiers.istr` atomically, last; only then are the previous snapshot's tier
   * files removed, so a failed or interrupted save leaves the previous snapshot loadable.
   *
   * Manifest, little-endian, version 1: magic `89 49 53 54 49 52 0D 0A` ("\x89ISTIR\r\n"),
   * version uint32 = 1, byte-order mark uint32 0x01020304, the device tier file's checksum, the
   * host tier file's checksum, the LRU clock (uint64 each), the namespace count N and the pinned
   * count P (uint64); N records in ascending namespace order — namespace, last use, LRU length n
   * (uint64 each) and n fact ids, most recent first; P pinned fact ids ascending; then the CRC-64
   * of every byte before it. Residency is not stored: it is which tier files hold a fact.
   *
   * @throw logic_error as save_store, naming the file and the system's reason
   * @note Waits for the device. Serialise saves to one directory.
   */
  void save(std::string const& directory) const
  {
    std::string const who      = "tiered_store::save('" + directory + "')";
    std::string const manifest = directory + "/" + manifest_name;
    std::optional<std::pair<std::uint64_t, std::uint64_t>> previous;
    try {
      auto const old = parse_manifest(detail::serial::read_whole_file(manifest, who), "");
      previous       = std::make_pair(old.device_checksum, old.host_checksum);
    } catch (logic_error const&) {
    }
    std::string const device_pending = directory + "/device.pending.iskv";
    std::string const host_pending   = directory + "/host.pending.iskv";
    manifest_data m;
    try {
      save_store(device_, device_pending);
      m.device_checksum = detail::serial::stored_checksum(device_pending, -8, who);
      save_store(host_, host_pending);
      m.host_checksum = detail::serial::stored_checksum(host_pending, -8, who);
      detail::serial::rename_or_fail(device_pending, directory + "/" + tier_file("device", m.device_checksum), who);
      detail::serial::rename_or_fail(host_pending, directory + "/" + tier_file("host", m.host_checksum), who);
    } catch (...) {
      (void)std::remove(device_pending.c_str());
      (void)std::remove(host_pending.c_str());
      throw;
    }
    m.clock = clock_;
    std::vector<std::uint64_t> nss;
    for (auto const& [ns, n] : namespaces_) {
      nss.push_back(ns);
    }
    std::sort(nss.begin(), nss.end());
    for (std::uint64_t ns : nss) {
      namespace_tier const& n = namespaces_.at(ns);
      m.namespaces.push_back({ns, n.last_use, {n.lru.begin(), n.lru.end()}});
    }
    for (auto const& [id, e] : facts_) {
      if (e.pinned) { m.pinned.push_back(id); }
    }
    std::sort(m.pinned.begin(), m.pinned.end());
    std::vector<unsigned char> const bytes = encode_manifest(m);
    detail::serial::sync_directory_of(manifest, who);
    (void)detail::serial::write_file_atomically(
      manifest, who, true, [&](detail::serial::checksummed_writer& out) {
        out.write(bytes.data(), bytes.size());
      });
    if (previous) {
      if (previous->first != m.device_checksum) {
        (void)std::remove((directory + "/" + tier_file("device", previous->first)).c_str());
      }
      if (previous->second != m.host_checksum) {
        (void)std::remove((directory + "/" + tier_file("host", previous->second)).c_str());
      }
    }
  }

  /**
   * @brief Restarts tiers from a snapshot written by save(): both tier files are loaded against
   * `config` (load_store(path, target): the same geometry, shard, page size and capacities; the
   * dtype converted; the memory kind and pinning from `config`), then the residency state is
   * checked against them before the tiered store is built: a fact in both tiers has the same
   * namespace and tokens in each; pinned facts have a device copy; each namespace's LRU list is
   * exactly its unpinned facts held in both tiers, once each; last uses are below the clock.
   * @throw logic_error when the manifest is missing, corrupted or names files that do not carry
   * its checksums; as load_store; or when the state is inconsistent as said (nothing is built).
   */
  static tiered_store load(std::string const& directory, tiered_store_config const& config)
  {
    std::string const who   = "tiered_store::load('" + directory + "')";
    std::string const where = who + ": ";
    tiered_store_config const c = check(config);
    manifest_data const m =
      parse_manifest(detail::serial::read_whole_file(directory + "/" + manifest_name, who), where);
    std::string const device_path = directory + "/" + tier_file("device", m.device_checksum);
    std::string const host_path   = directory + "/" + tier_file("host", m.host_checksum);
    INFERSCALE_EXPECTS(detail::serial::stored_checksum(device_path, -8, who) == m.device_checksum &&
                         detail::serial::stored_checksum(host_path, -8, who) == m.host_checksum,
                       where + "a tier file does not carry the manifest's checksum (files of "
                               "different saves are never paired)");
    kv_store device = load_store(device_path, c.device);
    kv_store host   = load_store(host_path, host_config(c));
    return tiered_store{c, std::move(device), std::move(host), m, where};
  }

  /// @brief The event recorded when layer `l` of the last staging had landed (device tiers).
  cudaEvent_t layer_ready(std::int32_t l) const noexcept
  {
    return copy_done_[static_cast<std::size_t>(l)];
  }

  /// @brief Host tiers: copies layer `l` of the request's runs (memcpy).
  void copy_layer_host(tier_request const& r, std::int32_t l)
  {
    std::size_t const page_bytes  = page_bytes_();
    std::size_t const layer_bytes = page_bytes / static_cast<std::size_t>(layers());
    auto* const dst               = static_cast<unsigned char*>(device_.ref().pool);
    auto const* const src         = static_cast<unsigned char const*>(host_.ref().pool);
    for (tier_copy_run const& run : r.runs) {
      for (std::int64_t p = 0; p < run.pages; ++p) {
        std::memcpy(dst + static_cast<std::size_t>(run.device_page + p) * page_bytes +
                      static_cast<std::size_t>(l) * layer_bytes,
                    src + static_cast<std::size_t>(run.host_page + p) * page_bytes +
                      static_cast<std::size_t>(l) * layer_bytes,
                    layer_bytes);
      }
    }
  }

  /**
   * @brief Splits a batch built against device_tier() after admit(r): tokens of staged facts
   * move to the end with their store tokens mapped to the one-layer views.
   * @throw logic_error if the request is stale (the device tier changed since admit) or the
   *        batch is for another store.
   */
  tier_split_batch split(tier_request const& r, injection_batch const& batch, char const* who) const
  {
    INFERSCALE_EXPECTS(&batch.store() == &device_,
                       std::string{who} + ": the batch was not built against device_tier()");
    batch.check_store(who);
    INFERSCALE_EXPECTS(r.store_identity == device_.identity() &&
                         r.device_version == device_.version(),
                       std::string{who} +
                         ": the device tier changed since this request was admitted; admit again");
    std::unordered_set<std::int64_t> staged_pages;
    for (tier_copy_run const& run : r.runs) {
      for (std::int64_t p = 0; p < run.pages; ++p) {
        staged_pages.insert(run.device_page + p);
      }
    }
    kv_store_ref const ref = device_.ref();
    tier_split_batch out;
    std::int64_t const n = batch.num_tokens();
    out.store_token.reserve(static_cast<std::size_t>(n));
    out.position.reserve(static_cast<std::size_t>(n));
    out.slot.reserve(static_cast<std::size_t>(n));
    for (int pass = 0; pass < 2; ++pass) {
      for (std::int64_t j = 0; j < n; ++j) {
        std::int64_t const t = batch.store_tokens()[static_cast<std::size_t>(j)];
        bool const staged    = staged_pages.count(t / ref.page_size) != 0;
        if (staged != (pass == 1)) { continue; }
        out.store_token.push_back(staged ? tier_layer_token(ref, t) : t);
        out.position.push_back(batch.positions()[static_cast<std::size_t>(j)]);
        out.slot.push_back(batch.slots()[static_cast<std::size_t>(j)]);
      }
      if (pass == 0) { out.resident = out.num_tokens(); }
    }
    return out;
  }

 private:
  struct entry {
    std::uint64_t ns{};
    std::int64_t tokens{};
    bool on_device{false};
    bool on_host{false};
    bool pinned{false};
    bool linked{false};                           ///< in its namespace's LRU list
    std::list<std::uint64_t>::iterator lru_it{};  ///< valid when linked
  };
  struct namespace_tier {
    std::list<std::uint64_t> lru;  ///< evictable facts with a device copy, most recent first
    std::uint64_t last_use{};
  };

  static constexpr char const* manifest_name   = "tiers.istr";
  static constexpr unsigned char manifest_magic[8] = {0x89, 'I', 'S', 'T', 'I', 'R', 0x0D, 0x0A};

  struct manifest_namespace {
    std::uint64_t ns{};
    std::uint64_t last_use{};
    std::vector<std::uint64_t> lru;  ///< most recent first
  };
  struct manifest_data {
    std::uint64_t device_checksum{};
    std::uint64_t host_checksum{};
    std::uint64_t clock{};
    std::vector<manifest_namespace> namespaces;
    std::vector<std::uint64_t> pinned;
  };

  static std::string tier_file(char const* tier, std::uint64_t checksum)
  {
    return std::string{tier} + "-" + detail::serial::checksum_digits(checksum) + ".iskv";
  }

  static std::vector<unsigned char> encode_manifest(manifest_data const& m)
  {
    std::vector<unsigned char> b(manifest_magic, manifest_magic + 8);
    auto put = [&](auto v) {
      unsigned char x[sizeof(v)];
      detail::serial::put_le(x, v);
      b.insert(b.end(), x, x + sizeof(v));
    };
    put(std::uint32_t{1});
    put(std::uint32_t{0x01020304u});
    put(m.device_checksum);
    put(m.host_checksum);
    put(m.clock);
    put(static_cast<std::uint64_t>(m.namespaces.size()));
    put(static_cast<std::uint64_t>(m.pinned.size()));
    for (manifest_namespace const& n : m.namespaces) {
      put(n.ns);
      put(n.last_use);
      put(static_cast<std::uint64_t>(n.lru.size()));
      for (std::uint64_t id : n.lru) {
        put(id);
      }
    }
    for (std::uint64_t id : m.pinned) {
      put(id);
    }
    put(detail::serial::crc64_of(b.data(), b.size()));
    return b;
  }

  static manifest_data parse_manifest(std::vector<unsigned char> const& b, std::string const& where)
  {
    std::string const what = where + "manifest " + manifest_name + ": ";
    INFERSCALE_EXPECTS(b.size() >= 64, what + std::to_string(b.size()) +
                                         " bytes, shorter than its 64-byte minimum");
    INFERSCALE_EXPECTS(detail::serial::get_le<std::uint64_t>(b.data() + b.size() - 8) ==
                         detail::serial::crc64_of(b.data(), b.size() - 8),
                       what + "checksum mismatch (the manifest is corrupted)");
    INFERSCALE_EXPECTS(std::memcmp(b.data(), manifest_magic, 8) == 0,
                       what + "not an InferScale tiers manifest (wrong magic bytes)");
    std::size_t at        = 8;
    std::size_t const end = b.size() - 8;
    auto get64 = [&]() {
      INFERSCALE_EXPECTS(end - at >= 8, what + "truncated at byte " + std::to_string(at));
      std::uint64_t const v = detail::serial::get_le<std::uint64_t>(b.data() + at);
      at += 8;
      return v;
    };
    std::uint64_t const version_and_bom = get64();
    INFERSCALE_EXPECTS(static_cast<std::uint32_t>(version_and_bom) == 1,
                       what + "format version " +
                         std::to_string(static_cast<std::uint32_t>(version_and_bom)) +
                         " is not supported (this build reads 1)");
    INFERSCALE_EXPECTS((version_and_bom >> 32) == 0x01020304u, what + "bad byte-order mark");
    manifest_data m;
    m.device_checksum     = get64();
    m.host_checksum       = get64();
    m.clock               = get64();
    std::uint64_t const n = get64();
    std::uint64_t const p = get64();
    INFERSCALE_EXPECTS(n <= (end - at) / 24 && p <= (end - at) / 8,
                       what + "counts " + std::to_string(n) + " and " + std::to_string(p) +
                         " run past the end");
    for (std::uint64_t i = 0; i < n; ++i) {
      manifest_namespace ns;
      ns.ns                   = get64();
      ns.last_use             = get64();
      std::uint64_t const len = get64();
      INFERSCALE_EXPECTS(len <= (end - at) / 8, what + "an LRU list runs past the end");
      for (std::uint64_t k = 0; k < len; ++k) {
        ns.lru.push_back(get64());
      }
      INFERSCALE_EXPECTS(m.namespaces.empty() || m.namespaces.back().ns < ns.ns,
                         what + "namespaces out of order");
      m.namespaces.push_back(std::move(ns));
    }
    for (std::uint64_t i = 0; i < p; ++i) {
      m.pinned.push_back(get64());
      INFERSCALE_EXPECTS(i == 0 || m.pinned[i - 1] < m.pinned[i],
                         what + "pinned ids out of order");
    }
    INFERSCALE_EXPECTS(at == end, what + std::to_string(end - at) + " bytes after the last record");
    return m;
  }

  /// Builds tiers from loaded stores and a parsed manifest, after checking they agree.
  tiered_store(tiered_store_config const& config,
               kv_store&& device,
               kv_store&& host,
               manifest_data const& m,
               std::string const& where)
    : config_{config}, device_{std::move(device)}, host_{std::move(host)}
  {
    std::unordered_map<std::uint64_t, entry> facts;
    auto collect = [&](kv_store const& tier, bool on_device) {
      for (std::uint64_t ns : tier.namespace_ids()) {
        for (std::uint64_t id : tier.namespace_fact_ids(ns)) {
          fact_record const& r = tier.at(id);
          entry& e             = facts[id];
          if (e.on_device || e.on_host) {
            fact_record const& other = (on_device ? host_ : device_).at(id);
            INFERSCALE_EXPECTS(other.namespace_id == r.namespace_id &&
                                 other.token_ids == r.token_ids,
                               where + "fact " + std::to_string(id) +
                                 " differs between the tiers (namespace or tokens)");
          }
          e.ns     = r.namespace_id;
          e.tokens = r.length();
          (on_device ? e.on_device : e.on_host) = true;
        }
      }
    };
    collect(device_, true);
    collect(host_, false);
    for (std::uint64_t id : m.pinned) {
      auto const it = facts.find(id);
      INFERSCALE_EXPECTS(it != facts.end() && it->second.on_device,
                         where + "pinned fact " + std::to_string(id) + " has no device copy");
      it->second.pinned = true;
    }
    std::unordered_map<std::uint64_t, namespace_tier> namespaces;
    std::unordered_set<std::uint64_t> listed;
    for (manifest_namespace const& n : m.namespaces) {
      INFERSCALE_EXPECTS(n.last_use <= m.clock, where + "namespace " + std::to_string(n.ns) +
                                                  " was last used after the clock");
      namespace_tier& t = namespaces[n.ns];
      t.last_use        = n.last_use;
      for (std::uint64_t id : n.lru) {
        auto const it = facts.find(id);
        INFERSCALE_EXPECTS(it != facts.end() && it->second.ns == n.ns && evictable(it->second) &&
                             listed.insert(id).second,
                           where + "LRU entry " + std::to_string(id) + " of namespace " +
                             std::to_string(n.ns) +
                             " is not an unpinned fact of it held in both tiers, once");
        it->second.lru_it = t.lru.insert(t.lru.end(), id);
        it->second.linked = true;
      }
    }
    for (auto const& [id, e] : facts) {
      INFERSCALE_EXPECTS(!evictable(e) || e.linked,
                         where + "fact " + std::to_string(id) +
                           " is held in both tiers and unpinned but in no LRU list");
      INFERSCALE_EXPECTS(namespaces.count(e.ns) != 0,
                         where + "namespace " + std::to_string(e.ns) + " of fact " +
                           std::to_string(id) + " has no record");
    }
    facts_      = std::move(facts);
    namespaces_ = std::move(namespaces);
    clock_      = m.clock;
    create_events();
  }

  static tiered_store_config check(tiered_store_config c)
  {
    INFERSCALE_EXPECTS(c.host_pages >= 0, "tiered_store: host_pages must be non-negative, got " +
                                            std::to_string(c.host_pages));
    INFERSCALE_EXPECTS(c.namespace_device_pages >= 0,
                       "tiered_store: namespace_device_pages must be non-negative, got " +
                         std::to_string(c.namespace_device_pages));
    INFERSCALE_EXPECTS(!c.device.pinned, "tiered_store: the device tier cannot be pinned host "
                                         "memory (the host tier is)");
    return c;
  }

  static kv_store_config host_config(tiered_store_config const& c)
  {
    kv_store_config h = c.device;
    h.num_pages       = c.host_pages;
    h.pinned          = c.device.memory == memory_kind::device;
    h.memory          = memory_kind::host;
    return h;
  }

  static bool evictable(entry const& e) noexcept { return e.on_device && e.on_host && !e.pinned; }

  std::int32_t layers() const noexcept { return device_.geometry().num_layers; }
  std::size_t page_bytes_() const noexcept
  {
    return device_.pool_bytes() / static_cast<std::size_t>(std::max<std::int64_t>(device_.num_pages(), 1));
  }

  entry& find(std::uint64_t id, char const* who)
  {
    auto const it = facts_.find(id);
    INFERSCALE_EXPECTS(it != facts_.end(), std::string{who} + ": unknown fact id " + std::to_string(id));
    return it->second;
  }
  entry const& find(std::uint64_t id, char const* who) const
  {
    auto const it = facts_.find(id);
    INFERSCALE_EXPECTS(it != facts_.end(), std::string{who} + ": unknown fact id " + std::to_string(id));
    return it->second;
  }

  /// Puts an evictable fact at the front (most recent) of its namespace's LRU list.
  void link(std::uint64_t id, entry& e)
  {
    if (e.linked || !evictable(e)) { return; }
    auto& n  = namespaces_[e.ns];
    e.lru_it = n.lru.insert(n.lru.begin(), id);
    e.linked = true;
  }

  void unlink(entry& e)
  {
    if (!e.linked) { return; }
    namespaces_.at(e.ns).lru.erase(e.lru_it);
    e.linked = false;
  }

  void touch(std::uint64_t id, entry& e)
  {
    auto& n    = namespaces_[e.ns];
    n.last_use = ++clock_;
    if (e.linked) {
      n.lru.splice(n.lru.begin(), n.lru, e.lru_it);
    } else {
      link(id, e);
    }
  }

  void drop_device_copy(std::uint64_t id, entry& e)
  {
    unlink(e);
    device_.erase(id);
    e.on_device = false;
  }

  /// Erasing a fact zeroes its pages in both tiers, so no erased K/V stays in either pool.
  void drop(std::unordered_map<std::uint64_t, entry>::iterator it)
  {
    entry& e = it->second;
    unlink(e);
    if (e.on_device) {
      zero_pages(device_, device_.at(it->first).pages);
      device_.erase(it->first);
    }
    if (e.on_host) {
      zero_pages(host_, host_.at(it->first).pages);
      host_.erase(it->first);
    }
    facts_.erase(it);
  }

  void zero_pages(kv_store& tier, std::vector<std::int64_t> const& pages)
  {
    std::size_t const page_bytes = page_bytes_();
    auto* const pool             = static_cast<unsigned char*>(tier.ref().pool);
    for (std::int64_t p : pages) {
      unsigned char* const at = pool + static_cast<std::size_t>(p) * page_bytes;
      if (tier.memory() == memory_kind::device) {
        INFERSCALE_CUDA_TRY(cudaMemset(at, 0, page_bytes));
      } else {
        std::memset(at, 0, page_bytes);
      }
    }
  }

  static void append_runs(std::vector<tier_copy_run>& runs,
                          std::vector<std::int64_t> const& host_pages,
                          std::vector<std::int64_t> const& device_pages)
  {
    for (std::size_t i = 0; i < host_pages.size(); ++i) {
      if (!runs.empty()) {
        tier_copy_run& last = runs.back();
        if (last.host_page + last.pages == host_pages[i] &&
            last.device_page + last.pages == device_pages[i]) {
          ++last.pages;
          continue;
        }
      }
      runs.push_back({host_pages[i], device_pages[i], 1});
    }
  }

  /// Copies a fact's pages, all layers, between the tiers (synchronous).
  void copy_pages(fact_record const& device_fact, fact_record const& host_fact, bool to_device)
  {
    std::size_t const page_bytes = page_bytes_();
    auto* const dpool            = static_cast<unsigned char*>(device_.ref().pool);
    auto* const hpool            = static_cast<unsigned char*>(host_.ref().pool);
    for (std::size_t i = 0; i < device_fact.pages.size(); ++i) {
      unsigned char* const d = dpool + static_cast<std::size_t>(device_fact.pages[i]) * page_bytes;
      unsigned char* const h = hpool + static_cast<std::size_t>(host_fact.pages[i]) * page_bytes;
      if (config_.device.memory == memory_kind::device) {
        INFERSCALE_CUDA_TRY(to_device ? cudaMemcpy(d, h, page_bytes, cudaMemcpyHostToDevice)
                                      : cudaMemcpy(h, d, page_bytes, cudaMemcpyDeviceToHost));
      } else {
        std::memcpy(to_device ? d : h, to_device ? h : d, page_bytes);
      }
    }
  }

  /// Copies a just-admitted request synchronously (pin()).
  void stage_now(tier_request& r)
  {
    if (config_.device.memory == memory_kind::host) {
      stage_host(r);
      return;
    }
    for (std::uint64_t id : r.staged) {
      copy_pages(device_.at(id), host_.at(id), /*to_device=*/true);
    }
    r.copies_issued = true;
  }

  void wait_device()
  {
    if (config_.device.memory == memory_kind::device) {
      INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
    }
  }

  /// Device tiers: one event per layer and the compute-stream mark (none for host tiers).
  void create_events()
  {
    if (config_.device.memory != memory_kind::device) { return; }
    try {
      copy_done_.assign(static_cast<std::size_t>(device_.geometry().num_layers), nullptr);
      for (auto& e : copy_done_) {
        INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
      INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
    } catch (...) {
      release_events();
      throw;
    }
  }

  void release_events() noexcept
  {
    for (auto& e : copy_done_) {
      if (e) { (void)cudaEventDestroy(e); }
    }
    copy_done_.clear();
    if (compute_mark_) { (void)cudaEventDestroy(compute_mark_); }
    compute_mark_ = nullptr;
  }

  tiered_store_config config_;
  kv_store device_;
  kv_store host_;
  std::unordered_map<std::uint64_t, entry> facts_;
  std::unordered_map<std::uint64_t, namespace_tier> namespaces_;
  std::uint64_t clock_{0};
  std::vector<cudaEvent_t> copy_done_;
  cudaEvent_t compute_mark_{};
};

/// @brief How inject_tiered_host orders its copies and writes.
enum class tier_host_order : std::uint8_t {
  /// Copy every staged page, then inject the whole batch in one all-layer pass (the fastest on
  /// the host: one cos/sin per token and pair, as inject_host).
  whole,
  /// The device's order: the resident tokens in one all-layer pass, then per layer the layer's
  /// copies and a one-layer pass over the staged tokens through tier_layer_view (what
  /// inject_tiered_async enqueues; the host tests check it here).
  per_layer,
};

/**
 * @brief Host backend of tiered injection: copies the request's staged facts into the device
 * tier and writes the batch (in the order `order` names). The cache bytes equal those of
 * inject_host from one store holding every fact, in either order.
 *
 * @param tiers    host tiers (`config().device.memory == host`)
 * @param request  what admit() returned for the facts of `batch`
 * @param batch    built against `tiers.device_tier()` after admit()
 * @throw logic_error as inject_host, or if the request is stale; nothing is written then.
 */
template <class Rotation>
void inject_tiered_host(tiered_store& tiers,
                        tier_request& request,
                        injection_batch const& batch,
                        paged_kv_cache const& cache,
                        Rotation const& rotation,
                        tier_host_order order = tier_host_order::whole)
{
  char const* const who = "inject_tiered_host";
  kv_store const& store = tiers.device_tier();
  detail::check_injection(store, batch, cache, rotation, memory_kind::host, who);
  tier_split_batch const split = tiers.split(request, batch, who);
  kv_store_ref const ref       = store.ref();
  detail::dispatch_store_cache(store.store_dtype(), cache.cache_dtype, [&](auto s, auto c) {
    using S = typename decltype(s)::type;
    using C = typename decltype(c)::type;
    if (order == tier_host_order::whole) {
      if (!request.copies_issued) { tiers.stage_host(request); }
      detail::dispatch_host_inject<S, C>(ref, batch.host_view(), cache, rotation);
      return;
    }
    if (split.resident > 0) {
      detail::dispatch_host_inject<S, C>(ref, split.resident_view(), cache, rotation);
    }
    injection_batch_view const staged = split.staged_view();
    for (std::int32_t l = 0; l < ref.num_layers; ++l) {
      if (!request.copies_issued) { tiers.copy_layer_host(request, l); }
      if (staged.num_tokens > 0) {
        detail::dispatch_host_inject<S, C>(
          tier_layer_view(ref, l), staged, tier_cache_layer(cache, l), rotation);
      }
    }
  });
  request.copies_issued = true;
}

}  // namespace inferscale
