/**
 * @file detail/snapshot/store_access.hpp
 * @brief What store snapshots (snapshot.hpp) need of kv_store's private state: store_access, the
 * class kv_store befriends; saving is defined in detail/snapshot/save.inl, loading and its checks
 * in detail/snapshot/load.inl.
 */
#pragma once

#include <inferscale/detail/serialize.hpp>
#include <inferscale/detail/snapshot/format.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace inferscale::detail {

/// @brief What snapshots need of kv_store's private state (the class befriends it).
struct store_access {
  /// @brief The checked catalogue of a file, ready to be restored.
  struct staged_catalogue {
    std::vector<fact_record> records;       ///< namespaces ascending, insertion order within
    std::vector<std::int64_t> free_pages;   ///< bottom of the stack first
    std::vector<std::int64_t> used_pages;   ///< ascending
    std::vector<std::uint64_t> page_owner;  ///< fact id per used page (for messages)
    std::vector<std::size_t> page_record;   ///< index in `records` per used page
    /// Version 2: CRC-64 of each record's pages (ascending page id, as the file stores them);
    /// empty for a version-1 file.
    std::vector<std::uint64_t> fact_checksums;
  };

  /// @brief Namespace ids, ascending.
  static std::vector<std::uint64_t> namespace_ids(kv_store const& s)
  {
    std::vector<std::uint64_t> ids;
    ids.reserve(s.namespaces_.size());
    for (auto const& entry : s.namespaces_) {
      ids.push_back(entry.first);
    }
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  static std::vector<std::int64_t> const& free_stack(kv_store const& s) { return s.free_pages_; }

  static std::size_t page_bytes(kv_store const& s) { return s.page_bytes(); }

  static void restore(kv_store& s, staged_catalogue&& c)
  {
    s.restore_catalogue(std::move(c.records), std::move(c.free_pages));
  }

  // -----------------------------------------------------------------------------------------------
  // Saving

  static void save(kv_store const& store, std::string const& path);

  // -----------------------------------------------------------------------------------------------
  // Loading

  struct parsed_header {
    std::uint32_t version{};
    kv_store_config config{};
    std::uint64_t namespaces{}, facts{}, tokens{}, pages_in_use{};
    std::uint64_t page_bytes{};
    std::uint64_t catalogue_bytes{};
    std::uint64_t file_bytes{};
  };

  /// @brief Checks the identification and the header (`h`: the first `available` bytes).
  static parsed_header parse_header(unsigned char const* h,
                                    std::uint64_t file_size,
                                    std::string const& where);

  /// @brief Checks the catalogue (its checksum already verified) against the header.
  static staged_catalogue parse_catalogue(std::vector<unsigned char> const& bytes,
                                          parsed_header const& h,
                                          std::string const& where);

  /// `previous` (may be null): a store whose facts' pages are taken instead of read when they
  /// carry the file's bytes (snapshot.hpp, the incremental load).
  static kv_store load(std::string const& path,
                       memory_space space,
                       std::optional<dtype> store_dtype,
                       kv_store_config const* expect,
                       kv_store const* previous = nullptr);

  /// @brief True when `previous` can lend pages to a load of `file`: a version-2 file (its fact
  /// table), the same page layout (model, shard, page size), a little-endian host.
  static bool incremental_source(kv_store const* previous,
                                 kv_store_config const& file,
                                 staged_catalogue const& staged);

  /// @brief Refuses a file whose geometry, shard, page size or capacity differ from `want`'s.
  static void check_target(kv_store_config const& file,
                           kv_store_config want,
                           std::string const& where);
};

}  // namespace inferscale::detail

#include <inferscale/detail/snapshot/load.inl>
#include <inferscale/detail/snapshot/save.inl>
