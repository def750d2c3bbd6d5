/**
 * @file directory_source.hpp
 * @brief Facts paged from disk: `directory_fact_source` serves the facts of store snapshot files
 * (save_store, format version 2, snapshot.hpp) from where they lie, for tiered_store::admit(keys,
 * source). The embedded default for one machine: a directory of snapshot files.
 *
 * Opening reads the header and the catalogue of each file only (checked by their checksums, as
 * load_store checks them); no page is read. A fetch reads only the asked facts' pages with pread
 * (consecutive pages in one call) and checks each fact against the file's fact table (the CRC-64
 * of its pages' bytes as the file stores them) before returning it; damage in other facts' pages
 * is never seen, and a damaged fact is refused by name. Pages are handed out as the file's bytes
 * (the store's pool bytes on a little-endian host), never converted: the tier must have the
 * file's page layout.
 *
 * Each file is kept open from the constructor on (one descriptor per file): a file replaced by a
 * later save (save_store renames over it) keeps serving the snapshot it held when opened, so a
 * source never mixes two saves; its generation is therefore constant (0). To serve a newer save,
 * open a new source. POSIX (open, pread, fstat); a little-endian host.
 */
#pragma once

#include <inferscale/detail/serialize.hpp>
#include <inferscale/detail/snapshot/format.hpp>
#include <inferscale/detail/snapshot/store_access.hpp>
#include <inferscale/error.hpp>
#include <inferscale/fact_source.hpp>
#include <inferscale/store.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief Serves the facts of the store snapshot files in a directory (every regular file whose
 * name ends in `.iskv`, in name order), or of one snapshot file, paging them from disk on fetch.
 *
 * A fact id may appear in several files (the two tier files of save_tiers hold a fact that has
 * both copies) only with the same namespace, tokens and fact checksum; it is then read from the
 * first file in name order.
 */
class directory_fact_source final : public fact_source {
 public:
  /**
   * @brief Opens `path`: a directory (its `.iskv` files) or one snapshot file; reads and checks
   * each file's header and catalogue, nothing else.
   * @throw logic_error naming the path when it cannot be opened, holds no snapshot file, a file
   *        is not a version-2 store snapshot (version 1 has no fact table: save it again), a
   *        header or catalogue is damaged, the files' page layouts differ, or a fact id appears
   *        twice with different contents
   */
  explicit directory_fact_source(std::string path) : path_{std::move(path)}
  {
    namespace fs = std::filesystem;
    std::error_code error;
    bool const is_directory = fs::is_directory(path_, error);
    std::vector<std::string> names;
    if (is_directory) {
      for (fs::directory_iterator it{path_, error}, end; !error && it != end; it.increment(error)) {
        if (it->path().extension() == ".iskv" && it->is_regular_file()) {
          names.push_back(it->path().string());
        }
      }
      INFERSCALE_EXPECTS(!error,
                         "directory_fact_source: cannot list '" + path_ + "': " + error.message());
      std::sort(names.begin(), names.end());
      INFERSCALE_EXPECTS(!names.empty(),
                         "directory_fact_source: '" + path_ + "' holds no store snapshot (.iskv)");
    } else {
      names.push_back(path_);
    }
    for (std::string const& name : names) {
      open_file(name);
    }
  }

  directory_fact_source(directory_fact_source const&)            = delete;
  directory_fact_source& operator=(directory_fact_source const&) = delete;

  /// @brief The files' page layout.
  fact_layout const& layout() const override { return layout_; }

  /// @brief "directory '<path>'" (or "snapshot file '<path>'").
  std::string name() const override
  {
    return (files_.size() == 1 && files_.front().path == path_ ? "snapshot file '"
                                                               : "directory '") +
           path_ + "'";
  }

  /// @brief The snapshot files served, in name order.
  std::vector<std::string> files() const
  {
    std::vector<std::string> out;
    for (file const& f : files_) {
      out.push_back(f.path);
    }
    return out;
  }

  /// @brief Facts served (distinct ids).
  std::int64_t num_facts() const noexcept { return static_cast<std::int64_t>(facts_.size()); }

  /// @brief Whether fact `id` is served.
  bool contains(std::uint64_t id) const { return facts_.count(id) != 0; }

  /// @brief The ids of namespace `ns`, in catalogue order (first file first).
  std::vector<std::uint64_t> namespace_fact_ids(std::uint64_t ns) const
  {
    auto const it = namespaces_.find(ns);
    return it == namespaces_.end() ? std::vector<std::uint64_t>{} : it->second;
  }

  /**
   * @brief Reads the pages of facts `ids` of namespace `ns` (pread) and checks each against the
   * fact table.
   * @return generation 0 and the facts, in the order asked (no embedding: snapshot files keep
   * none)
   * @throw logic_error naming the file when a fact is not served, is in another namespace, is
   *        listed twice, cannot be read, or fails its checksum (nothing is returned then)
   */
  fetched_namespace fetch(std::uint64_t ns, std::vector<std::uint64_t> const& ids) override
  {
    fetched_namespace out;
    out.facts.reserve(ids.size());
    std::unordered_map<std::uint64_t, char> asked;
    for (std::uint64_t id : ids) {
      INFERSCALE_EXPECTS(
        asked.emplace(id, 0).second,
        "directory_fact_source: fact " + std::to_string(id) + " is asked for twice");
      auto const it = facts_.find(id);
      INFERSCALE_EXPECTS(
        it != facts_.end(),
        "directory_fact_source: fact " + std::to_string(id) + " is not in " + name());
      located const& at = it->second;
      INFERSCALE_EXPECTS(at.record.namespace_id == ns,
                         "directory_fact_source: fact " + std::to_string(id) + " of '" +
                           files_[at.file].path + "' is in namespace " +
                           std::to_string(at.record.namespace_id) + ", asked for in namespace " +
                           std::to_string(ns));
      out.facts.push_back(read_fact(at));
    }
    return out;
  }

  /**
   * @brief Whether `f` is this directory's fact: held in `f`'s namespace, the same token ids, and
   * pages whose CRC-64 (in the file's page order) is the fact table's. Reads nothing from disk.
   */
  std::optional<bool> matches(fetched_fact const& f) const override
  {
    auto const it = facts_.find(f.fact_id);
    if (it == facts_.end()) { return false; }
    fact_record const& r = it->second.record;
    std::size_t const B  = static_cast<std::size_t>(layout_.page_bytes);
    if (r.namespace_id != f.namespace_id || r.token_ids != f.token_ids ||
        f.pages.size() != r.pages.size() * B) {
      return false;
    }
    return pages_checksum(file_order(r), f.pages.data(), B) == it->second.checksum;
  }

 private:
  /// (page id, token-order index) of a fact's pages, ascending page id: the file's order and the
  /// fact table checksum's.
  static std::vector<std::pair<std::int64_t, std::size_t>> file_order(fact_record const& r)
  {
    std::vector<std::pair<std::int64_t, std::size_t>> order;
    order.reserve(r.pages.size());
    for (std::size_t j = 0; j < r.pages.size(); ++j) {
      order.emplace_back(r.pages[j], j);
    }
    std::sort(order.begin(), order.end());
    return order;
  }

  /// CRC-64 of pages held in token order at `pages` (`page_bytes` each), taken in `order`.
  static std::uint64_t pages_checksum(
    std::vector<std::pair<std::int64_t, std::size_t>> const& order,
    unsigned char const* pages,
    std::size_t page_bytes)
  {
    detail::serial::crc64 crc;
    for (auto const& [page, j] : order) {
      crc.update(pages + j * page_bytes, page_bytes);
    }
    return crc.value();
  }

  /// An open descriptor, closed on destruction.
  struct descriptor {
    int fd{-1};
    descriptor() = default;
    explicit descriptor(int f) : fd{f} {}
    descriptor(descriptor&& o) noexcept : fd{std::exchange(o.fd, -1)} {}
    descriptor& operator=(descriptor&& o) noexcept
    {
      std::swap(fd, o.fd);
      return *this;
    }
    descriptor(descriptor const&)            = delete;
    descriptor& operator=(descriptor const&) = delete;
    ~descriptor()
    {
      if (fd >= 0) { (void)::close(fd); }
    }
  };

  struct file {
    std::string path;
    descriptor fd;
    std::uint64_t pool_offset{};           ///< byte offset of the first page in use
    std::vector<std::int64_t> used_pages;  ///< ascending: page id -> rank in the file
  };

  struct located {
    std::size_t file{};      ///< index in files_
    fact_record record;      ///< id, namespace, token ids, page ids (token order)
    std::uint64_t checksum;  ///< the fact table's CRC-64 of its pages, ascending page id
  };

  void pread_exact(file const& f, void* data, std::size_t bytes, std::uint64_t offset) const
  {
    auto* p         = static_cast<unsigned char*>(data);
    std::size_t got = 0;
    while (got < bytes) {
      ssize_t const n = ::pread(f.fd.fd, p + got, bytes - got, static_cast<off_t>(offset + got));
      if (n < 0 && errno == EINTR) { continue; }
      int const error = errno;
      INFERSCALE_EXPECTS(
        n > 0,
        "directory_fact_source: cannot read '" + f.path + "' at byte " +
          std::to_string(offset + got) + ": " +
          (n < 0 ? detail::serial::errno_text(error) : std::string{"the file became shorter"}));
      got += static_cast<std::size_t>(n);
    }
  }

  void open_file(std::string const& path)
  {
    using detail::store_access;
    namespace format        = detail::store_format;
    std::string const where = "directory_fact_source('" + path + "'): ";
    INFERSCALE_EXPECTS(detail::serial::host_is_little_endian(),
                       where +
                         "pages are served as the file's little-endian bytes: this host is "
                         "big-endian");
    file f;
    f.path               = path;
    f.fd                 = descriptor{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    int const open_error = errno;
    INFERSCALE_EXPECTS(f.fd.fd >= 0,
                       where + "cannot open: " + detail::serial::errno_text(open_error));
    struct stat info {};
    int const stat_result = ::fstat(f.fd.fd, &info);
    int const stat_error  = errno;
    INFERSCALE_EXPECTS(stat_result == 0,
                       where + "cannot stat: " + detail::serial::errno_text(stat_error));
    auto const size = static_cast<std::uint64_t>(info.st_size);

    unsigned char h[format::header_bytes] = {};
    std::size_t const available = static_cast<std::size_t>(std::min<std::uint64_t>(size, sizeof h));
    pread_exact(f, h, available, 0);
    store_access::parsed_header const header = store_access::parse_header(h, size, where);
    INFERSCALE_EXPECTS(header.version >= 2,
                       where + "format version " + std::to_string(header.version) +
                         " has no fact table (per-fact checksums); load and save it again");
    std::vector<unsigned char> catalogue(static_cast<std::size_t>(header.catalogue_bytes));
    pread_exact(f, catalogue.data(), catalogue.size(), format::header_bytes);
    unsigned char stored[format::checksum_bytes];
    pread_exact(f, stored, sizeof stored, format::header_bytes + header.catalogue_bytes);
    std::uint64_t const catalogue_stored = detail::serial::get_le<std::uint64_t>(stored);
    std::uint64_t const catalogue_actual =
      detail::serial::crc64_of(catalogue.data(), catalogue.size());
    INFERSCALE_EXPECTS(catalogue_stored == catalogue_actual,
                       where + "catalogue checksum mismatch: stored " +
                         detail::serial::hex(catalogue_stored) + ", computed " +
                         detail::serial::hex(catalogue_actual) + " (the catalogue is corrupted)");
    store_access::staged_catalogue staged = store_access::parse_catalogue(catalogue, header, where);

    fact_layout const file_layout = fact_layout::of(header.config, header.page_bytes);
    if (files_.empty()) {
      layout_ = file_layout;
    } else {
      INFERSCALE_EXPECTS(file_layout == layout_,
                         where + "its page layout (" + file_layout.describe() + ") differs from '" +
                           files_.front().path + "' (" + layout_.describe() + ")");
    }
    f.pool_offset = format::header_bytes + header.catalogue_bytes + format::checksum_bytes;
    f.used_pages  = std::move(staged.used_pages);

    // Check every duplicate before recording anything of this file.
    std::size_t const index = files_.size();
    for (std::size_t i = 0; i < staged.records.size(); ++i) {
      fact_record const& r = staged.records[i];
      auto const it        = facts_.find(r.fact_id);
      if (it == facts_.end()) { continue; }
      located const& first = it->second;
      INFERSCALE_EXPECTS(
        first.record.namespace_id == r.namespace_id && first.record.token_ids == r.token_ids &&
          first.checksum == staged.fact_checksums[i],
        where + "fact " + std::to_string(r.fact_id) + " is also in '" + files_[first.file].path +
          "' with other contents (namespace, tokens or pages)");
    }
    files_.push_back(std::move(f));
    for (std::size_t i = 0; i < staged.records.size(); ++i) {
      fact_record& r = staged.records[i];
      if (facts_.count(r.fact_id) != 0) { continue; }
      namespaces_[r.namespace_id].push_back(r.fact_id);
      std::uint64_t const id = r.fact_id;
      facts_.emplace(id, located{index, std::move(r), staged.fact_checksums[i]});
    }
  }

  fetched_fact read_fact(located const& at) const
  {
    file const& f        = files_[at.file];
    std::size_t const B  = static_cast<std::size_t>(layout_.page_bytes);
    fact_record const& r = at.record;
    std::size_t const n  = r.pages.size();
    fetched_fact out;
    out.fact_id      = r.fact_id;
    out.namespace_id = r.namespace_id;
    out.token_ids    = r.token_ids;
    out.pages.resize(n * B);
    std::vector<std::pair<std::int64_t, std::size_t>> const order = file_order(r);
    std::size_t k                                                 = 0;
    while (k < n) {
      // One pread per run of pages consecutive in the file and in token order.
      std::size_t end = k + 1;
      while (end < n && order[end].first == order[end - 1].first + 1 &&
             order[end].second == order[end - 1].second + 1) {
        ++end;
      }
      auto const rank = static_cast<std::uint64_t>(
        std::lower_bound(f.used_pages.begin(), f.used_pages.end(), order[k].first) -
        f.used_pages.begin());
      pread_exact(
        f, out.pages.data() + order[k].second * B, (end - k) * B, f.pool_offset + rank * B);
      k = end;
    }
    std::uint64_t const checksum = pages_checksum(order, out.pages.data(), B);
    INFERSCALE_EXPECTS(checksum == at.checksum,
                       "directory_fact_source('" + f.path + "'): fact " +
                         std::to_string(r.fact_id) + ": checksum mismatch of its pages: stored " +
                         detail::serial::hex(at.checksum) + ", computed " +
                         detail::serial::hex(checksum) + " (the file is corrupted)");
    return out;
  }

  std::string path_;
  fact_layout layout_{};
  std::vector<file> files_;
  std::unordered_map<std::uint64_t, located> facts_;
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> namespaces_;
};

}  // namespace inferscale
