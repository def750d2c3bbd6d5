/**
 * @file detail/memory/snapshot.inl
 * @brief Definitions for memory.hpp, snapshots of a deployment: memory::save (store, index,
 * lifecycle file, then the manifest, atomically) and memory::load (everything checked).
 */
#pragma once

#include <inferscale/detail/memory/snapshot_format.inl>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace inferscale {

inline void memory::save(std::string const& directory) const
{
  std::string const who                           = "memory::save('" + directory + "')";
  std::string const manifest_path                 = directory + "/" + manifest_name;
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
    detail::serial::rename_or_fail(
      lifecycle_pending, directory + "/" + lifecycle_file_name(m), who);
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

inline memory memory::load(std::string const& directory, memory_config const& config)
{
  std::string const who   = "memory::load('" + directory + "')";
  std::string const where = who + ": ";
  snapshot_manifest const m =
    parse_manifest(detail::serial::read_whole_file(directory + "/" + manifest_name, who), where);
  std::string const store_path     = directory + "/" + store_file_name(m);
  std::string const index_path     = directory + "/" + index_file_name(m);
  std::string const lifecycle_path = directory + "/" + lifecycle_file_name(m);
  INFERSCALE_EXPECTS(
    detail::serial::stored_checksum(store_path, -8, who) == m.store_checksum &&
      detail::serial::stored_checksum(index_path, 72, who) == m.index_header_checksum &&
      detail::serial::stored_checksum(index_path, -8, who) == m.index_checksum &&
      detail::serial::stored_checksum(lifecycle_path, -8, who) == m.lifecycle_checksum,
    where +
      "the store or index file does not carry the manifest's checksum "
      "(files of different saves are never paired)");

  kv_store store         = load_store(store_path, config.store);
  graph_index index      = load_index(index_path, config.index.memory);
  index_config const& ic = index.config();
  INFERSCALE_EXPECTS(
    ic.dim == config.index.dim && ic.metric == config.index.metric &&
      ic.vector_dtype == config.index.vector_dtype,
    where + "the index holds " + std::to_string(ic.dim) + "-d " + to_string(ic.vector_dtype) +
      " vectors (metric " + std::to_string(static_cast<int>(ic.metric)) + "), the configuration " +
      std::to_string(config.index.dim) + "-d " + to_string(config.index.vector_dtype) +
      " (metric " + std::to_string(static_cast<int>(config.index.metric)) + ")");
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

}  // namespace inferscale
