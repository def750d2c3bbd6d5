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
#include <inferscale/store.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
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
    if (config_.device.memory == memory_kind::device) {
      copy_done_.resize(static_cast<std::size_t>(device_.geometry().num_layers));
      for (auto& e : copy_done_) {
        INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      }
      INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
    }
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

  /// @brief Removes a fact from both tiers. @throw logic_error if unknown.
  void erase(std::uint64_t id)
  {
    auto const it = facts_.find(id);
    INFERSCALE_EXPECTS(it != facts_.end(),
                       "tiered_store::erase: unknown fact id " + std::to_string(id));
    drop(it);
  }

  /// @brief Removes every fact of namespace `ns` from both tiers; returns how many.
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

  void drop(std::unordered_map<std::uint64_t, entry>::iterator it)
  {
    entry& e = it->second;
    unlink(e);
    if (e.on_device) { device_.erase(it->first); }
    if (e.on_host) { host_.erase(it->first); }
    facts_.erase(it);
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
