/**
 * @file detail/tier/source.inl
 * @brief Definitions for tier.hpp, the level below the host tier: admit(keys, source, policy)
 * fetches the facts neither tier holds from a fact_source (fact_source.hpp), checks them, makes
 * room in the host tier by dropping fetched facts least recently used first, copies their pages
 * into the host tier as bytes and admits the request; a namespace whose generation changed in the
 * source has its fetched copies dropped first.
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/fact_source.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

inline void tiered_store::forget_fetched(std::uint64_t ns, std::vector<std::uint64_t>& out)
{
  std::vector<std::uint64_t> ids;
  bool device_copy = false;
  for (std::uint64_t id : fetched_lru_) {
    entry const& e = facts_.at(id);
    if (e.ns == ns) {
      ids.push_back(id);
      device_copy = device_copy || e.on_device;
    }
  }
  if (device_copy) { wait_device(); }  // no injection enqueued through the tier still reads them
  for (std::uint64_t id : ids) {
    drop(facts_.find(id));
    out.push_back(id);
  }
}

inline tier_request tiered_store::admit(std::vector<fact_key> const& keys,
                                        fact_source& source,
                                        source_policy policy)
{
  fact_layout const tiers_layout = fact_layout::of(host_);
  INFERSCALE_EXPECTS(source.layout() == tiers_layout,
                     "tiered_store::admit: " + source.name() + " holds pages of " +
                       source.layout().describe() + "; the tiers hold pages of " +
                       tiers_layout.describe());
  // The request: ids once each, grouped by namespace in order of first appearance.
  std::vector<std::uint64_t> ids;
  ids.reserve(keys.size());
  std::vector<std::uint64_t> namespaces;
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> per_namespace;
  std::unordered_set<std::uint64_t> in_request;
  for (fact_key const& k : keys) {
    INFERSCALE_EXPECTS(
      in_request.insert(k.fact_id).second,
      "tiered_store::admit: fact id " + std::to_string(k.fact_id) + " is listed twice");
    auto const held = facts_.find(k.fact_id);
    INFERSCALE_EXPECTS(held == facts_.end() || held->second.ns == k.namespace_id,
                       "tiered_store::admit: fact " + std::to_string(k.fact_id) +
                         " is held in namespace " +
                         std::to_string(held == facts_.end() ? 0 : held->second.ns) +
                         ", requested in namespace " + std::to_string(k.namespace_id));
    auto& list = per_namespace[k.namespace_id];
    if (list.empty()) { namespaces.push_back(k.namespace_id); }
    list.push_back(k.fact_id);
    ids.push_back(k.fact_id);
  }

  // Fetch what neither tier holds, with each namespace's generation.
  std::vector<std::uint64_t> forgotten;
  std::vector<fetched_fact> fetched;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> generations;  // (namespace, generation)
  std::size_t const page_bytes = host_.page_bytes();
  auto const missing_of        = [&](std::uint64_t ns) {
    std::vector<std::uint64_t> missing;
    for (std::uint64_t id : per_namespace.at(ns)) {
      if (!contains(id)) { missing.push_back(id); }
    }
    return missing;
  };
  try {
    for (std::uint64_t ns : namespaces) {
      std::vector<std::uint64_t> missing = missing_of(ns);
      fetched_namespace got              = source.fetch(ns, missing);
      auto const known                   = source_generation_.find(ns);
      if (known != source_generation_.end() && known->second != got.generation) {
        // Erased or replaced in the source since our copies were fetched: forget them all, then
        // read the request's facts again under the generation just read (atomically with them).
        forget_fetched(ns, forgotten);
        source_generation_.erase(ns);
        missing = missing_of(ns);
        got     = source.fetch(ns, missing);
      }
      INFERSCALE_EXPECTS(got.facts.size() == missing.size(),
                         "tiered_store::admit: " + source.name() + " returned " +
                           std::to_string(got.facts.size()) + " facts of namespace " +
                           std::to_string(ns) + " for " + std::to_string(missing.size()) +
                           " asked");
      for (std::size_t i = 0; i < missing.size(); ++i) {
        fetched_fact& f = got.facts[i];
        INFERSCALE_EXPECTS(f.fact_id == missing[i] && f.namespace_id == ns,
                           "tiered_store::admit: " + source.name() + " returned fact " +
                             std::to_string(f.fact_id) + " of namespace " +
                             std::to_string(f.namespace_id) + " for fact " +
                             std::to_string(missing[i]) + " of namespace " + std::to_string(ns));
        std::int64_t const tokens = static_cast<std::int64_t>(f.token_ids.size());
        INFERSCALE_EXPECTS(
          tokens > 0 &&
            f.pages.size() == static_cast<std::size_t>(host_.pages_for(tokens)) * page_bytes,
          "tiered_store::admit: " + source.name() + " returned fact " + std::to_string(f.fact_id) +
            " with " + detail::count_of(tokens, "token") + " and " +
            std::to_string(f.pages.size()) + " bytes of pages, expected " +
            std::to_string(host_.pages_for(tokens)) + " pages of " + std::to_string(page_bytes) +
            " bytes");
        fetched.push_back(std::move(f));
      }
      generations.emplace_back(ns, got.generation);
    }
  } catch (source_unavailable const&) {
    if (policy == source_policy::refuse) { throw; }
    tier_request none;
    none.forgotten      = std::move(forgotten);
    none.without_memory = true;
    none.device_version = device_.version();
    none.store_identity = device_.identity();
    return none;
  }

  // Room in the host tier: drop fetched facts held there only, least recently used first.
  std::int64_t host_need = 0;
  incoming_facts incoming;
  for (fetched_fact const& f : fetched) {
    std::int64_t const tokens = static_cast<std::int64_t>(f.token_ids.size());
    host_need += host_.pages_for(tokens);
    incoming.emplace(f.fact_id, std::make_pair(f.namespace_id, tokens));
  }
  std::vector<std::uint64_t> host_victims;
  std::int64_t host_freed = 0;
  for (auto it = fetched_lru_.rbegin();
       it != fetched_lru_.rend() && host_.free_pages() + host_freed < host_need;
       ++it) {
    entry const& e = facts_.at(*it);
    if (e.pinned || in_request.count(*it) != 0) { continue; }
    host_victims.push_back(*it);
    host_freed += host_.pages_for(e.tokens);
  }
  INFERSCALE_EXPECTS(host_.free_pages() + host_freed >= host_need,
                     "tiered_store::admit: the request fetches " +
                       detail::count_of(static_cast<std::int64_t>(fetched.size()), "fact") +
                       " of " + std::to_string(host_need) + " host pages from " + source.name() +
                       "; " + std::to_string(host_.free_pages()) + " host pages are free and " +
                       std::to_string(host_freed) +
                       " more hold fetched facts that can be dropped (facts inserted here, "
                       "pinned or in the request stay)");
  std::unordered_set<std::uint64_t> const forgetting(host_victims.begin(), host_victims.end());
  std::vector<std::uint64_t> const device_victims = plan_admission(ids, &incoming, &forgetting);

  // Everything checked: drop, copy the fetched pages into the host tier, admit.
  bool device_copy = false;
  for (std::uint64_t v : host_victims) {
    device_copy = device_copy || facts_.at(v).on_device;
  }
  if (device_copy) { wait_device(); }  // as evict: no injection through the tier reads them
  for (std::uint64_t v : host_victims) {
    drop(facts_.find(v));
    forgotten.push_back(v);
  }
  std::vector<std::uint64_t> fetched_ids;
  auto* const pool = static_cast<unsigned char*>(host_.ref().pool);
  for (fetched_fact& f : fetched) {
    std::int64_t const tokens = static_cast<std::int64_t>(f.token_ids.size());
    fact_record const& h      = host_.reserve(f.fact_id, f.namespace_id, std::move(f.token_ids));
    for (std::size_t j = 0; j < h.pages.size(); ++j) {
      std::memcpy(pool + static_cast<std::size_t>(h.pages[j]) * page_bytes,
                  f.pages.data() + j * page_bytes,
                  page_bytes);
    }
    entry e;
    e.ns             = f.namespace_id;
    e.tokens         = tokens;
    e.on_host        = true;
    e.fetched        = true;
    entry& added     = facts_.emplace(f.fact_id, e).first->second;
    added.fetched_it = fetched_lru_.insert(fetched_lru_.begin(), f.fact_id);
    fetched_ids.push_back(f.fact_id);
  }
  for (auto const& [ns, generation] : generations) {
    source_generation_[ns] = generation;
  }
  tier_request r = commit_admission(ids, device_victims);
  r.fetched      = std::move(fetched_ids);
  r.forgotten    = std::move(forgotten);
  return r;
}

}  // namespace inferscale
