/**
 * @file index_snapshot.hpp
 * @brief Index snapshots: `save_index` writes a `graph_index` (configuration and every live
 * namespace's rows: fact ids, deleted flags, vectors, graph, and the fast host search's entry
 * points and calibrated list) to one CRC-checked file; `load_index` checks all of it and rebuilds
 * the index in host or device memory, one that answers every search as the saved one did. The free
 * `save_*` / `load_*` of the library, one per owner: `save_store` / `load_store` (snapshot.hpp),
 * `save_index` / `load_index` (here), `save_tiers` / `load_tiers` (tier.hpp), `save_memory` /
 * `load_memory` (memory.hpp). The file format and its checked parser are in
 * `detail/index/serialize.hpp`.
 */
#pragma once

#include <inferscale/detail/index/serialize.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/index.hpp>
#include <inferscale/memory_space.hpp>

#include <string>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief Saves the index (config, every live namespace's rows: vectors, graph, fact ids, deleted
 * flags; its fast-search state: entry points, the rows they were chosen at, the calibrated list)
 * to `path`, in the format described in `detail/index/serialize.hpp`.
 *
 * The file is written to `path + ".tmp"`, flushed to the storage device, then renamed over
 * `path`, so a crash or a failed save never leaves a half-written file under `path` (an existing
 * file there stays as it was until the rename).
 *
 * @param[in] index the index (its host mirror, which is always current, is what gets written)
 * @param[in] path destination file
 * @throw logic_error naming the path and the system's reason when the file cannot be created,
 * written, synced, closed or renamed; the temporary file is removed
 * @note Two concurrent saves to the same path share the temporary name; serialise them. The
 * replacement relies on POSIX `rename` (atomic, replaces an existing file), and the directory is
 * synced after it, so after a crash `path` holds either the old file or the new one, whole.
 */
inline void save_index(graph_index const& index, std::string const& path)
{
  (void)detail::serial::write_file_atomically(
    path, "save_index", true, [&](detail::serial::checksummed_writer& out) {
      detail::index::snapshot_access::write(index, out);
      unsigned char checksum[detail::index::format::checksum_bytes];
      detail::index::put_le(checksum, out.checksum());
      out.write(checksum, sizeof checksum);
    });
}

/**
 * @brief Loads an index saved by `save_index` into host or device memory.
 *
 * The whole file is read and checked (magic, format version, byte order, sizes, checksums,
 * internal consistency: graph ids below the tenant size or 0xFFFFFFFF, distinct live fact ids,
 * live counts, deleted flags, finite vectors) before any graph_index is built, so a corrupted or
 * truncated file is refused and nothing is half loaded.
 *
 * @param[in] path a file written by `save_index`
 * @param[in] memory where the loaded index lives (`memory_space::device` uploads the arena)
 * @return the index: the same index as far as any search can tell. Same config where it
 * changes answers (`host_entry_points`, `host_traversal_dtype`: float32 when loaded into device
 * memory), namespaces in the same order, and per namespace the same rows (fact ids, deleted
 * flags, vectors, graph) and the same fast-search state (entry points, calibrated list size), so
 * every search (exact, graph, split, the fast host search and its float16 walk, any knob) gives
 * the saved index's ids and distances bit for bit, whatever sequence of add / build / erase /
 * erase_namespace / compact made it. Not kept: the memory space (the argument), the build knobs
 * and `max_row_overhead` (defaults), `version()`, and the arena's holes and spare rows (the arena
 * is packed), so later mutations may grow or compact the two at different times
 * @throw logic_error naming the problem ("not an InferScale index file", "format version 1 is not
 * supported (this build reads 2)", "truncated: expected N bytes, file has M", "checksum
 * mismatch", an I/O error with the path and the system's reason, ...)
 * @throw cuda_error when a device index cannot be allocated or uploaded
 * @note Peak host memory is about twice the file size (the file, then the arena).
 */
inline graph_index load_index(std::string const& path, memory_space space = memory_space::host)
{
  detail::index::staged_index staged;
  {
    std::vector<unsigned char> const file = detail::serial::read_whole_file(path, "load_index");
    staged = detail::index::parse_index_file(file, "load_index('" + path + "'): ");
  }
  return detail::index::snapshot_access::assemble(std::move(staged), space);
}

}  // namespace inferscale
