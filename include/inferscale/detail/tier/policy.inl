/**
 * @file detail/tier/policy.inl
 * @brief Definitions for tier.hpp, the tier policy of tiered_store: residency and usage, insert
 * and erase, admission (quota first, then the least recently used namespaces, each from the tail
 * of its LRU list), pinning, eviction and demotion, and the LRU bookkeeping.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <list>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

inline fact_residency tiered_store::residency(std::uint64_t id) const
{
  entry const& e = find(id, "tiered_store::residency");
  return e.on_device && e.on_host ? fact_residency::both
         : e.on_device            ? fact_residency::device
                                  : fact_residency::host;
}

inline tier_usage tiered_store::usage() const
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

inline std::vector<std::uint64_t> tiered_store::lru_order(std::uint64_t ns) const
{
  auto const it = namespaces_.find(ns);
  if (it == namespaces_.end()) { return {}; }
  return {it->second.lru.begin(), it->second.lru.end()};
}

template <class T>
void tiered_store::insert(std::uint64_t id,
                          std::uint64_t ns,
                          std::vector<std::int32_t> token_ids,
                          fact_kv_view<T const> keys,
                          fact_kv_view<T const> values,
                          fact_residency placement,
                          cudaStream_t stream)
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
      device_.insert(id,
                     ns,
                     hst ? host_.at(id).token_ids : std::move(token_ids),
                     keys,
                     values,
                     memory_space::host,
                     stream);
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

inline void tiered_store::erase(std::uint64_t id)
{
  auto const it = facts_.find(id);
  INFERSCALE_EXPECTS(it != facts_.end(),
                     "tiered_store::erase: unknown fact id " + std::to_string(id));
  drop(it);
}

inline std::int64_t tiered_store::erase_namespace(std::uint64_t ns)
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

inline void tiered_store::pin(std::uint64_t id)
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

inline void tiered_store::unpin(std::uint64_t id)
{
  entry& e = find(id, "tiered_store::unpin");
  if (!e.pinned) { return; }
  e.pinned = false;
  link(id, e);
}

inline void tiered_store::evict(std::uint64_t id)
{
  entry& e = find(id, "tiered_store::evict");
  INFERSCALE_EXPECTS(e.on_device,
                     "tiered_store::evict: fact " + std::to_string(id) + " has no device copy");
  INFERSCALE_EXPECTS(!e.pinned, "tiered_store::evict: fact " + std::to_string(id) + " is pinned");
  INFERSCALE_EXPECTS(e.on_host,
                     "tiered_store::evict: fact " + std::to_string(id) +
                       " is held on the device only; demote it first");
  wait_device();
  drop_device_copy(id, e);
}

inline void tiered_store::demote(std::uint64_t id)
{
  entry& e = find(id, "tiered_store::demote");
  INFERSCALE_EXPECTS(
    !e.on_host,
    "tiered_store::demote: fact " + std::to_string(id) + " is already in the host tier");
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

inline tier_request tiered_store::admit(std::vector<std::uint64_t> const& ids)
{
  std::vector<std::uint64_t> const victims = plan_admission(ids, nullptr, nullptr);
  return commit_admission(ids, victims);
}

inline std::vector<std::uint64_t> tiered_store::plan_admission(
  std::vector<std::uint64_t> const& ids,
  incoming_facts const* incoming,
  std::unordered_set<std::uint64_t> const* forgetting) const
{
  // Facts about to be dropped from both tiers free their device pages and are no victims.
  std::int64_t free_pages = device_.free_pages();
  std::unordered_map<std::uint64_t, std::int64_t> dropped_per_ns;
  if (forgetting != nullptr) {
    for (std::uint64_t id : *forgetting) {
      entry const& e = facts_.at(id);
      if (!e.on_device) { continue; }
      std::int64_t const p = device_.pages_for(e.tokens);
      free_pages += p;
      dropped_per_ns[e.ns] += p;
    }
  }
  auto const namespace_pages = [&](std::uint64_t ns) {
    auto const d = dropped_per_ns.find(ns);
    return device_.namespace_pages(ns) - (d == dropped_per_ns.end() ? 0 : d->second);
  };
  std::unordered_set<std::uint64_t> in_request;
  std::int64_t need = 0;
  std::unordered_map<std::uint64_t, std::int64_t> need_per_ns;
  for (std::uint64_t id : ids) {
    // A fact about to be fetched into the host tier counts as host-only.
    entry e;
    if (incoming != nullptr && facts_.count(id) == 0 && incoming->count(id) != 0) {
      e.ns      = incoming->at(id).first;
      e.tokens  = incoming->at(id).second;
      e.on_host = true;
    } else {
      e = find(id, "tiered_store::admit");
    }
    INFERSCALE_EXPECTS(in_request.insert(id).second,
                       "tiered_store::admit: fact id " + std::to_string(id) + " is listed twice");
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
  auto take_from     = [&](std::uint64_t ns, std::int64_t const& goal, std::int64_t const& have) {
    auto const nit = namespaces_.find(ns);
    if (nit == namespaces_.end()) { return; }
    auto const& lru = nit->second.lru;
    for (auto it = lru.rbegin(); it != lru.rend() && have < goal; ++it) {
      if (in_request.count(*it) != 0 || chosen.count(*it) != 0 ||
          (forgetting != nullptr && forgetting->count(*it) != 0)) {
        continue;
      }
      std::int64_t const p = device_.pages_for(facts_.at(*it).tokens);
      chosen.insert(*it);
      victims.push_back(*it);
      freed += p;
      freed_per_ns[ns] += p;
    }
  };
  if (config_.namespace_device_pages > 0) {
    for (auto const& [ns, p] : need_per_ns) {
      std::int64_t const over = namespace_pages(ns) + p - config_.namespace_device_pages;
      if (over <= 0) { continue; }
      std::int64_t const goal = over;
      take_from(ns, goal, freed_per_ns[ns]);
      INFERSCALE_EXPECTS(freed_per_ns[ns] >= over,
                         "tiered_store::admit: namespace " + std::to_string(ns) + " needs " +
                           std::to_string(p) + " more device pages beyond its " +
                           std::to_string(namespace_pages(ns)) + " and its quota is " +
                           std::to_string(config_.namespace_device_pages) + "; only " +
                           std::to_string(freed_per_ns[ns]) + " of its pages are evictable");
    }
  }
  if (need > free_pages + freed) {
    // Namespaces by last use, oldest first.
    std::vector<std::pair<std::uint64_t, std::uint64_t>> order;
    for (auto const& [ns, n] : namespaces_) {
      order.emplace_back(n.last_use, ns);
    }
    std::sort(order.begin(), order.end());
    std::int64_t const goal = need - free_pages;
    for (auto const& [use, ns] : order) {
      if (freed >= goal) { break; }
      take_from(ns, goal, freed);
    }
    INFERSCALE_EXPECTS(freed >= goal,
                       "tiered_store::admit: the request needs " + std::to_string(need) +
                         " device pages; " + std::to_string(free_pages) + " are free and " +
                         std::to_string(freed) +
                         " more can be evicted (pinned, device-only and requested facts "
                         "stay)");
  }
  return victims;
}

inline tier_request tiered_store::commit_admission(std::vector<std::uint64_t> const& ids,
                                                   std::vector<std::uint64_t> const& victims)
{
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

inline tiered_store_config tiered_store::check(tiered_store_config c)
{
  INFERSCALE_EXPECTS(
    c.host_pages >= 0,
    "tiered_store: host_pages must be non-negative, got " + std::to_string(c.host_pages));
  INFERSCALE_EXPECTS(c.namespace_device_pages >= 0,
                     "tiered_store: namespace_device_pages must be non-negative, got " +
                       std::to_string(c.namespace_device_pages));
  INFERSCALE_EXPECTS(!c.device.pinned,
                     "tiered_store: the device tier cannot be pinned host "
                     "memory (the host tier is)");
  return c;
}

inline kv_store_config tiered_store::host_config(tiered_store_config const& c)
{
  kv_store_config h = c.device;
  h.num_pages       = c.host_pages;
  h.pinned          = c.device.space == memory_space::device;
  h.space           = memory_space::host;
  h.resource        = nullptr;  // the device tier's resource gives device memory; pinned default
  return h;
}

inline tiered_store::entry& tiered_store::find(std::uint64_t id, char const* who)
{
  auto const it = facts_.find(id);
  INFERSCALE_EXPECTS(it != facts_.end(),
                     std::string{who} + ": unknown fact id " + std::to_string(id));
  return it->second;
}

inline tiered_store::entry const& tiered_store::find(std::uint64_t id, char const* who) const
{
  auto const it = facts_.find(id);
  INFERSCALE_EXPECTS(it != facts_.end(),
                     std::string{who} + ": unknown fact id " + std::to_string(id));
  return it->second;
}

inline void tiered_store::link(std::uint64_t id, entry& e)
{
  if (e.linked || !evictable(e)) { return; }
  auto& n  = namespaces_[e.ns];
  e.lru_it = n.lru.insert(n.lru.begin(), id);
  e.linked = true;
}

inline void tiered_store::unlink(entry& e)
{
  if (!e.linked) { return; }
  namespaces_.at(e.ns).lru.erase(e.lru_it);
  e.linked = false;
}

inline void tiered_store::touch(std::uint64_t id, entry& e)
{
  auto& n    = namespaces_[e.ns];
  n.last_use = ++clock_;
  if (e.fetched) { fetched_lru_.splice(fetched_lru_.begin(), fetched_lru_, e.fetched_it); }
  if (e.linked) {
    n.lru.splice(n.lru.begin(), n.lru, e.lru_it);
  } else {
    link(id, e);
  }
}

inline void tiered_store::drop_device_copy(std::uint64_t id, entry& e)
{
  unlink(e);
  device_.erase(id);
  e.on_device = false;
}

inline void tiered_store::drop(std::unordered_map<std::uint64_t, entry>::iterator it)
{
  entry& e = it->second;
  unlink(e);
  if (e.fetched) { fetched_lru_.erase(e.fetched_it); }
  if (e.on_device) {
    device_.scrub_pages(device_.at(it->first).pages);
    device_.erase(it->first);
  }
  if (e.on_host) {
    host_.scrub_pages(host_.at(it->first).pages);
    host_.erase(it->first);
  }
  facts_.erase(it);
}

}  // namespace inferscale
