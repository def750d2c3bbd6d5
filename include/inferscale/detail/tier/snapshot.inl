/**
 * @file detail/tier/snapshot.inl
 * @brief Definitions for tier.hpp, snapshots of the tiers: save_tiers and load_tiers (over
 * detail/snapshot/directory_transaction.hpp; the members save and load wrap them), the manifest
 * `tiers.istr` (layout at save_tiers) and the checked rebuild of the residency state from loaded
 * tiers.
 */
#pragma once

#include <inferscale/detail/snapshot/directory_transaction.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

struct tiered_store::manifest_namespace {
  std::uint64_t ns{};
  std::uint64_t last_use{};
  std::vector<std::uint64_t> lru;  ///< most recent first
};

struct tiered_store::manifest_data {
  std::uint64_t device_checksum{};
  std::uint64_t host_checksum{};
  std::uint64_t clock{};
  std::vector<manifest_namespace> namespaces;
  std::vector<std::uint64_t> pinned;
};

inline void save_tiers(tiered_store const& tiers, std::string const& directory)
{
  using manifest_data = tiered_store::manifest_data;
  auto const file     = [](char const* tier, std::uint64_t checksum) {
    return tiered_store::tier_file(tier, checksum);
  };
  std::optional<manifest_data> const previous = detail::snapshot::previous_manifest(
    directory, tiered_store::manifest_name, [](std::vector<unsigned char> const& b) {
      return tiered_store::parse_manifest(b, "");
    });
  std::vector<std::string> previous_files;
  if (previous) {
    previous_files = {file("device", previous->device_checksum),
                      file("host", previous->host_checksum)};
  }
  detail::snapshot::directory_transaction tx{
    directory, "save_tiers('" + directory + "')", std::move(previous_files)};

  // Each tier with save_store, then renamed after its file checksum.
  manifest_data m;
  std::string const device_pending = tx.stage(
    "device.pending.iskv", [&](std::string const& path) { save_store(tiers.device_, path); });
  m.device_checksum = detail::serial::stored_checksum(device_pending, -8, tx.who());
  std::string const host_pending =
    tx.stage("host.pending.iskv", [&](std::string const& path) { save_store(tiers.host_, path); });
  m.host_checksum = detail::serial::stored_checksum(host_pending, -8, tx.who());
  tx.place(device_pending, file("device", m.device_checksum));
  tx.place(host_pending, file("host", m.host_checksum));

  m.clock = tiers.clock_;
  std::vector<std::uint64_t> nss;
  for (auto const& [ns, n] : tiers.namespaces_) {
    nss.push_back(ns);
  }
  std::sort(nss.begin(), nss.end());
  for (std::uint64_t ns : nss) {
    tiered_store::namespace_tier const& n = tiers.namespaces_.at(ns);
    m.namespaces.push_back({ns, n.last_use, {n.lru.begin(), n.lru.end()}});
  }
  for (auto const& [id, e] : tiers.facts_) {
    if (e.pinned) { m.pinned.push_back(id); }
  }
  std::sort(m.pinned.begin(), m.pinned.end());
  tx.commit(tiered_store::manifest_name, tiered_store::encode_manifest(m));
}

inline tiered_store load_tiers(std::string const& directory, tiered_store_config const& config)
{
  std::string const who               = "load_tiers('" + directory + "')";
  std::string const where             = who + ": ";
  tiered_store_config const c         = tiered_store::check(config);
  tiered_store::manifest_data const m = tiered_store::parse_manifest(
    detail::snapshot::read_manifest(directory, tiered_store::manifest_name, who), where);
  std::string const device_path =
    directory + "/" + tiered_store::tier_file("device", m.device_checksum);
  std::string const host_path = directory + "/" + tiered_store::tier_file("host", m.host_checksum);
  detail::snapshot::check_named_files(
    {{device_path, -8, m.device_checksum}, {host_path, -8, m.host_checksum}},
    who,
    "a tier file does not carry the manifest's checksum (files "
    "of different saves are never paired)");
  kv_store device = load_store(device_path, c.device);
  kv_store host   = load_store(host_path, tiered_store::host_config(c));
  return tiered_store{c, std::move(device), std::move(host), m, where};
}

inline void tiered_store::save(std::string const& directory) const { save_tiers(*this, directory); }

inline tiered_store tiered_store::load(std::string const& directory,
                                       tiered_store_config const& config)
{
  return load_tiers(directory, config);
}

inline std::string tiered_store::tier_file(char const* tier, std::uint64_t checksum)
{
  return std::string{tier} + "-" + detail::serial::checksum_digits(checksum) + ".iskv";
}

inline std::vector<unsigned char> tiered_store::encode_manifest(manifest_data const& m)
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

inline tiered_store::manifest_data tiered_store::parse_manifest(std::vector<unsigned char> const& b,
                                                                std::string const& where)
{
  std::string const what = where + "manifest " + manifest_name + ": ";
  INFERSCALE_EXPECTS(b.size() >= 64,
                     what + std::to_string(b.size()) + " bytes, shorter than its 64-byte minimum");
  INFERSCALE_EXPECTS(detail::serial::get_le<std::uint64_t>(b.data() + b.size() - 8) ==
                       detail::serial::crc64_of(b.data(), b.size() - 8),
                     what + "checksum mismatch (the manifest is corrupted)");
  INFERSCALE_EXPECTS(std::memcmp(b.data(), manifest_magic, 8) == 0,
                     what + "not an InferScale tiers manifest (wrong magic bytes)");
  std::size_t at        = 8;
  std::size_t const end = b.size() - 8;
  auto get64            = [&]() {
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
  INFERSCALE_EXPECTS(
    n <= (end - at) / 24 && p <= (end - at) / 8,
    what + "counts " + std::to_string(n) + " and " + std::to_string(p) + " run past the end");
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
    INFERSCALE_EXPECTS(i == 0 || m.pinned[i - 1] < m.pinned[i], what + "pinned ids out of order");
  }
  INFERSCALE_EXPECTS(at == end, what + std::to_string(end - at) + " bytes after the last record");
  return m;
}

inline tiered_store::tiered_store(tiered_store_config const& config,
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
          INFERSCALE_EXPECTS(other.namespace_id == r.namespace_id && other.token_ids == r.token_ids,
                             where + "fact " + std::to_string(id) +
                               " differs between the tiers (namespace or tokens)");
        }
        e.ns                                  = r.namespace_id;
        e.tokens                              = r.length();
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
    INFERSCALE_EXPECTS(
      n.last_use <= m.clock,
      where + "namespace " + std::to_string(n.ns) + " was last used after the clock");
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

}  // namespace inferscale
