/**
 * @file detail/memory/snapshot.inl
 * @brief Definitions for memory.hpp, snapshots of a deployment: save_memory (store, index,
 * lifecycle file, then the manifest, as one detail/snapshot/directory_transaction.hpp) and
 * load_memory (everything checked); the members memory::save / load wrap them.
 */
#pragma once

#include <inferscale/detail/memory/snapshot_format.inl>
#include <inferscale/detail/snapshot/directory_transaction.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace inferscale {

inline void save_memory(memory const& mem, std::string const& directory)
{
  save_memory(mem, directory, std::nullopt);
}

inline void save_memory(memory const& mem,
                        std::string const& directory,
                        std::optional<std::string> const& application)
{
  auto const serial = mem.locks_.serial();  // between two mutations; reads go on
  using manifest    = memory::snapshot_manifest;
  std::optional<manifest> const previous = detail::snapshot::previous_manifest(
    directory, memory::manifest_name, [](std::vector<unsigned char> const& b) {
      return memory::parse_manifest(b, "");
    });
  std::vector<std::string> previous_files;
  if (previous) {
    previous_files = {memory::store_file_name(*previous),
                      memory::index_file_name(*previous),
                      memory::lifecycle_file_name(*previous)};
    if (previous->application_checksum) {
      previous_files.push_back(memory::application_file_name(*previous));
    }
  }
  detail::snapshot::directory_transaction tx{
    directory, "save_memory('" + directory + "')", std::move(previous_files)};
  std::string const& who = tx.who();

  // The store, the index and the lifecycle file, each written atomically, then renamed after
  // their checksums.
  manifest m;
  m.prefix = mem.prefix_;
  std::string const store_pending =
    tx.stage("store.pending.iskv", [&](std::string const& path) { save_store(mem.store_, path); });
  m.store_checksum = detail::serial::stored_checksum(store_pending, -8, who);
  std::string const index_pending =
    tx.stage("index.pending.isx", [&](std::string const& path) { save_index(mem.index_, path); });
  m.index_header_checksum = detail::serial::stored_checksum(index_pending, 72, who);
  m.index_checksum        = detail::serial::stored_checksum(index_pending, -8, who);
  std::vector<unsigned char> const lifecycle = mem.encode_lifecycle();
  std::string const lifecycle_pending =
    tx.stage("lifecycle.pending.islc", [&](std::string const& path) {
      (void)detail::serial::write_file_atomically(
        path, who, false, [&](detail::serial::checksummed_writer& out) {
          out.write(lifecycle.data(), lifecycle.size());
        });
    });
  m.lifecycle_checksum = detail::serial::stored_checksum(lifecycle_pending, -8, who);
  tx.place(store_pending, memory::store_file_name(m));
  tx.place(index_pending, memory::index_file_name(m));
  tx.place(lifecycle_pending, memory::lifecycle_file_name(m));
  if (application) {
    std::string const application_pending =
      tx.stage("application.pending.isap", [&](std::string const& path) {
        (void)detail::serial::write_file_atomically(
          path, who, false, [&](detail::serial::checksummed_writer& out) {
            unsigned char header[24] = {};
            std::memcpy(header, memory::application_magic, 8);
            detail::serial::put_le(header + 8, std::uint32_t{1});
            detail::serial::put_le(header + 12, std::uint32_t{0x01020304u});
            detail::serial::put_le(header + 16, static_cast<std::uint64_t>(application->size()));
            out.write(header, sizeof header);
            out.write(application->data(), application->size());
            unsigned char crc[8];
            detail::serial::put_le(crc, out.checksum());
            out.write(crc, sizeof crc);
          });
      });
    m.application_checksum = detail::serial::stored_checksum(application_pending, -8, who);
    tx.place(application_pending, memory::application_file_name(m));
  }

  std::vector<unsigned char> bytes(m.application_checksum ? memory::manifest_v2_bytes
                                                          : memory::manifest_bytes);
  memory::encode_manifest(m, bytes.data());
  tx.commit(memory::manifest_name, bytes);
}

inline memory load_memory(std::string const& directory, memory_config const& config)
{
  return load_memory(directory, config, nullptr);
}

inline memory load_memory(std::string const& directory,
                          memory_config const& config,
                          std::optional<std::string>* application)
{
  return load_memory(directory, config, application, nullptr);
}

inline memory load_memory(std::string const& directory,
                          memory_config const& config,
                          std::optional<std::string>* application,
                          memory const* previous)
{
  std::string const who             = "load_memory('" + directory + "')";
  std::string const where           = who + ": ";
  memory::snapshot_manifest const m = memory::parse_manifest(
    detail::snapshot::read_manifest(directory, memory::manifest_name, who), where);
  std::string const store_path     = directory + "/" + memory::store_file_name(m);
  std::string const index_path     = directory + "/" + memory::index_file_name(m);
  std::string const lifecycle_path = directory + "/" + memory::lifecycle_file_name(m);
  std::vector<detail::snapshot::named_file> named{{store_path, -8, m.store_checksum},
                                                  {index_path, 72, m.index_header_checksum},
                                                  {index_path, -8, m.index_checksum},
                                                  {lifecycle_path, -8, m.lifecycle_checksum}};
  std::string const application_path = directory + "/" + memory::application_file_name(m);
  if (m.application_checksum) { named.push_back({application_path, -8, *m.application_checksum}); }
  detail::snapshot::check_named_files(named,
                                      who,
                                      "the store, index, lifecycle or application file does not "
                                      "carry the manifest's checksum (files of different saves "
                                      "are never paired)");

  std::optional<std::string> data;
  if (m.application_checksum && application != nullptr) {
    data = memory::decode_application(detail::serial::read_whole_file(application_path, who),
                                      where + "application file '" + application_path + "': ");
  }

  kv_store store = [&] {
    if (previous == nullptr) { return load_store(store_path, config.store); }
    auto const serial = previous->locks_.serial();  // no mutation of `previous` meanwhile
    return load_store(store_path, config.store, previous->store_);
  }();
  graph_index index      = load_index(index_path, config.index.space);
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
  if (application != nullptr) { *application = std::move(data); }
  return loaded;
}

inline std::optional<std::string> load_memory_application(std::string const& directory)
{
  std::string const who             = "load_memory_application('" + directory + "')";
  memory::snapshot_manifest const m = memory::parse_manifest(
    detail::snapshot::read_manifest(directory, memory::manifest_name, who), who + ": ");
  if (!m.application_checksum) { return std::nullopt; }
  std::string const path = directory + "/" + memory::application_file_name(m);
  detail::snapshot::check_named_files({{path, -8, *m.application_checksum}},
                                      who,
                                      "the application file does not carry the manifest's "
                                      "checksum (files of different saves are never paired)");
  return memory::decode_application(detail::serial::read_whole_file(path, who),
                                    who + ": application file '" + path + "': ");
}

inline void memory::save(std::string const& directory) const { save_memory(*this, directory); }

inline memory memory::load(std::string const& directory, memory_config const& config)
{
  return load_memory(directory, config);
}

}  // namespace inferscale
