/**
 * @file detail/snapshot/directory_transaction.hpp
 * @brief Snapshot directories: the one checked, all-or-nothing way a snapshot of several files
 * (`save_tiers`, `save_memory`) replaces the previous one in a directory, and the checks a load
 * makes before anything is built. Plain C++17 and POSIX (detail/serialize.hpp, opendir); no CUDA.
 *
 * A save is a `directory_transaction`:
 *  1. `stage` writes each file of the new snapshot under a pending name (`store.pending.iskv`):
 *     the writer (save_store, save_index, write_file_atomically) makes it complete and synced;
 *  2. `place` renames each staged file to its final name, derived from its contents (its
 *     checksums), so a file the previous snapshot already holds keeps its name and is replaced by
 *     the same bytes;
 *  3. `commit` syncs the directory (the renames are durable), replaces the manifest naming the
 *     files atomically (a temporary, synced, renamed over it: the commit point), syncs the
 *     directory again, and only then removes the previous snapshot's files that the new one does
 *     not reuse, and what earlier saves killed on the way left behind (below).
 * Until the manifest's rename, the previous manifest and every file it names are untouched, so a
 * crash or a failure leaves the previous snapshot loadable; a transaction abandoned before that
 * point (an exception on the way) removes, in its destructor, every file it staged or placed that
 * the previous snapshot does not name, so the directory holds what it held before.
 *
 * A save killed outright (SIGKILL, power loss) runs no destructor: it may leave its staged files
 * and temporaries (`store.pending.iskv`, `store.pending.iskv.tmp`, `tiers.istr.tmp`), files it
 * placed but never committed, or, killed after the commit point, the previous snapshot's files.
 * None of them is read by a load (the manifest names what loads), and the next committed save
 * removes them: final names follow the pending names, `<stem>-<checksum digits>.<ext>` (one or
 * more groups of 16 lower-case hexadecimal digits joined by '-') for a staged
 * `<stem>.pending.<ext>`, so after its commit a save removes every file of the directory named
 * after one of its own stems that its manifest does not name, its stems' pending names and their
 * temporaries, and the manifest's temporary. Other files of the directory are left alone. Two
 * saves into one directory must not overlap (serialise them): they share the pending names, and
 * the commit of one would remove the other's files not yet committed.
 *
 * Why not a temporary sibling directory swapped into place: POSIX `rename` cannot replace a
 * non-empty directory, and exchanging two (`renameat2(RENAME_EXCHANGE)`) is Linux-only. A
 * manifest replaced by an atomic file rename is the same commit point on every POSIX file system;
 * it keeps the destination directory itself (its permissions, mounts and watchers) and lets an
 * unchanged file stay instead of being rewritten.
 *
 * A load reads the manifest (`read_manifest`), parses and checks it (the owner's format), then
 * checks that every file it names carries the checksum it recorded (`check_named_files`, 8 bytes
 * read per file), so files of different saves are never paired, before any file is loaded.
 */
#pragma once

#include <inferscale/detail/serialize.hpp>
#include <inferscale/error.hpp>

#if defined(__unix__) || defined(__APPLE__)
#include <dirent.h>    // opendir: the leftovers of killed saves
#include <sys/stat.h>  // lstat
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace inferscale::detail::snapshot {

/**
 * @brief One save of a snapshot directory, committed by its manifest (see the file comment).
 * Move-less and copy-less: it lives on the stack of the save it serves.
 */
class directory_transaction {
 public:
  /**
   * @param directory the snapshot directory (must exist; nothing is created here)
   * @param who the operation, first in every message ("save_memory('dir')")
   * @param previous_files the file names (not paths) the directory's current manifest names,
   *        empty when it has none: kept on failure, removed after a commit unless reused
   */
  directory_transaction(std::string directory,
                        std::string who,
                        std::vector<std::string> previous_files)
    : directory_(std::move(directory)), who_(std::move(who)), previous_(std::move(previous_files))
  {
  }
  directory_transaction(directory_transaction const&)            = delete;
  directory_transaction& operator=(directory_transaction const&) = delete;

  /// Rolls an uncommitted transaction back (see the file comment); never throws.
  ~directory_transaction() { abandon(); }

  /// @brief `directory/name`.
  std::string path(std::string const& name) const { return directory_ + "/" + name; }

  /// @brief The operation named in messages.
  std::string const& who() const noexcept { return who_; }

  /**
   * @brief Stages one file: `write(path)` must create `path` complete and synced, or throw
   * leaving no file (save_store, save_index and write_file_atomically do both).
   * @return the staged file's path (for its checksums, then `place`)
   * @throw whatever `write` throws; logic_error after a commit
   */
  template <class Write>
  std::string stage(std::string const& pending_name, Write&& write)
  {
    INFERSCALE_EXPECTS(!committed_, who_ + ": the snapshot is already committed");
    std::string pending = path(pending_name);
    pending_.push_back(pending);  // before writing: a failed write leaves nothing, or this
    std::size_t const mark = pending_name.find(".pending");
    if (mark != std::string::npos) {
      stems_.emplace_back(pending_name.substr(0, mark), pending_name.substr(mark + 8));
    }
    std::forward<Write>(write)(pending);
    return pending;
  }

  /**
   * @brief Renames a staged file to its final name (a file of that name is replaced: final names
   * follow contents, so it holds the same bytes).
   * @throw logic_error naming both paths and the system's reason (the staged file is removed),
   *        for a path this transaction did not stage, or after a commit
   */
  void place(std::string const& staged_path, std::string const& final_name)
  {
    INFERSCALE_EXPECTS(!committed_, who_ + ": the snapshot is already committed");
    auto const it = std::find(pending_.begin(), pending_.end(), staged_path);
    INFERSCALE_EXPECTS(it != pending_.end(),
                       who_ + ": '" + staged_path + "' was not staged by this snapshot");
    pending_.erase(it);  // renamed, or removed by rename_or_fail
    serial::rename_or_fail(staged_path, path(final_name), who_);
    placed_.push_back(final_name);
  }

  /**
   * @brief Commits: syncs the directory, replaces the manifest `manifest_name` with `bytes`
   * atomically, syncs the directory, then removes the previous files the new snapshot does not
   * name (those it placed) and the leftovers of killed saves (see the file comment; removals are
   * best effort: a file that cannot be removed stays, unreferenced).
   * @throw logic_error naming the path and the system's reason. Before the manifest's rename the
   *        transaction is still rolled back as described; a failure of the last directory sync
   *        comes after the commit point (the new snapshot is in place, the previous files are
   *        kept, unreferenced, rather than removed before the rename is durable).
   */
  void commit(std::string const& manifest_name, std::vector<unsigned char> const& bytes)
  {
    INFERSCALE_EXPECTS(!committed_, who_ + ": the snapshot is already committed");
    INFERSCALE_EXPECTS(pending_.empty(),
                       who_ + ": '" + pending_.front() + "' was staged but never placed");
    std::string const manifest = path(manifest_name);
    serial::sync_directory_of(manifest, who_);
    (void)serial::write_file_atomically(
      manifest, who_, false, [&](serial::checksummed_writer& out) {
        out.write(bytes.data(), bytes.size());
      });
    committed_ = true;  // the manifest now names the new files: never roll them back
    serial::sync_directory_of(manifest, who_);
    for (std::string const& name : previous_) {
      if (!placed(name)) { (void)std::remove(path(name).c_str()); }
    }
    remove_leftovers(manifest_name);
  }

  /// @brief Whether `commit` got past the manifest's rename.
  bool committed() const noexcept { return committed_; }

 private:
  bool placed(std::string const& name) const
  {
    return std::find(placed_.begin(), placed_.end(), name) != placed_.end();
  }

  bool previous(std::string const& name) const
  {
    return std::find(previous_.begin(), previous_.end(), name) != previous_.end();
  }

  /// Whether `digits` is one or more groups of 16 lower-case hexadecimal digits joined by '-'.
  static bool checksum_groups(std::string const& digits) noexcept
  {
    if (digits.empty() || (digits.size() + 1) % 17 != 0) { return false; }
    for (std::size_t i = 0; i < digits.size(); ++i) {
      char const c  = digits[i];
      bool const ok = i % 17 == 16 ? c == '-' : ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
      if (!ok) { return false; }
    }
    return true;
  }

  /// Whether `name` is a killed save's leftover (see the file comment); never a placed file.
  bool leftover(std::string const& name, std::string const& manifest_name) const
  {
    if (placed(name)) { return false; }
    if (name == manifest_name + ".tmp") { return true; }
    for (auto const& [stem, extension] : stems_) {
      std::string const pending = stem + ".pending" + extension;
      if (name == pending || name == pending + ".tmp") { return true; }
      std::string const head = stem + "-";
      if (name.size() > head.size() + extension.size() && name.compare(0, head.size(), head) == 0 &&
          name.compare(name.size() - extension.size(), extension.size(), extension) == 0 &&
          checksum_groups(name.substr(head.size(), name.size() - head.size() - extension.size()))) {
        return true;
      }
    }
    return false;
  }

  /// Removes the leftovers of killed saves after a commit (best effort, never throws).
  void remove_leftovers(std::string const& manifest_name) noexcept
  {
#if defined(__unix__) || defined(__APPLE__)
    try {
      std::vector<std::string> names;
      if (DIR* const d = ::opendir(directory_.c_str())) {
        while (dirent const* entry = ::readdir(d)) {
          names.emplace_back(entry->d_name);
        }
        (void)::closedir(d);
      }
      for (std::string const& name : names) {
        struct stat info {};
        if (leftover(name, manifest_name) && ::lstat(path(name).c_str(), &info) == 0 &&
            S_ISREG(info.st_mode)) {  // a killed save leaves regular files only
          (void)std::remove(path(name).c_str());
        }
      }
    } catch (...) {  // a string allocation; the files then stay, unreferenced
    }
#else
    (void)manifest_name;
#endif
  }

  void abandon() noexcept
  {
    if (committed_) { return; }
    try {
      for (std::string const& p : pending_) {
        (void)std::remove(p.c_str());
      }
      for (std::string const& name : placed_) {
        if (!previous(name)) { (void)std::remove(path(name).c_str()); }
      }
    } catch (...) {  // a string allocation; the files then stay, unreferenced
    }
  }

  std::string directory_;
  std::string who_;
  std::vector<std::string> previous_;
  std::vector<std::string> pending_;  ///< staged, not yet placed (paths)
  std::vector<std::string> placed_;   ///< final names, placed by this transaction
  /// (stem, extension with its dot or empty) of every staged `<stem>.pending<extension>`
  std::vector<std::pair<std::string, std::string>> stems_;
  bool committed_{false};
};

/**
 * @brief The manifest `name` of `directory`, read whole.
 * @throw logic_error naming `who`, the path and the system's reason (a missing directory or
 *        manifest: "cannot open")
 */
inline std::vector<unsigned char> read_manifest(std::string const& directory,
                                                std::string const& name,
                                                std::string const& who)
{
  return serial::read_whole_file(directory + "/" + name, who);
}

/**
 * @brief The parsed manifest `name` of `directory` if it has a valid one (what a save replaces),
 * else nothing: a missing, unreadable or malformed manifest (whatever `parse` refuses with
 * logic_error) means no previous snapshot to keep or remove.
 */
template <class Parse>
auto previous_manifest(std::string const& directory, std::string const& name, Parse&& parse)
  -> std::optional<decltype(parse(std::vector<unsigned char>{}))>
{
  std::string const path = directory + "/" + name;
  std::FILE* file        = std::fopen(path.c_str(), "rb");
  if (file == nullptr) { return std::nullopt; }
  (void)std::fclose(file);
  try {
    return std::forward<Parse>(parse)(serial::read_whole_file(path, "previous manifest"));
  } catch (logic_error const&) {
    return std::nullopt;
  }
}

/// @brief A file a manifest names, and the checksum it recorded for it at byte `offset` (negative
/// from the end, as serial::stored_checksum).
struct named_file {
  std::string path;
  long offset{-8};
  std::uint64_t checksum{};
};

/**
 * @brief Checks that every named file carries the checksum its manifest recorded (8 bytes read
 * per file), before any of them is loaded.
 * @throw logic_error naming `who` and the path for a file that is missing or too short, and
 *        `where + mismatch` when a checksum differs
 */
inline void check_named_files(std::vector<named_file> const& files,
                              std::string const& who,
                              std::string const& mismatch)
{
  bool all_match = true;
  for (named_file const& f : files) {
    all_match = serial::stored_checksum(f.path, f.offset, who) == f.checksum && all_match;
  }
  INFERSCALE_EXPECTS(all_match, who + ": " + mismatch);
}

}  // namespace inferscale::detail::snapshot
