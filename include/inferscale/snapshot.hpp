/**
 * @file snapshot.hpp
 * @brief Store snapshots: `save_store` writes a `kv_store` (configuration, catalogue, namespaces,
 * free-page order and the pages in use) to one file; `load_store` rebuilds it, in host or device
 * memory and, if asked, in another store dtype; the incremental `load_store(path, target,
 * previous)` reads only the facts `previous` does not hold with the file's bytes. Plain C++17 plus
 * the CUDA runtime API (like store.hpp; a host store never calls it). The format's constants and
 * element helpers are in detail/snapshot/format.hpp; saving and loading are defined in
 * detail/snapshot/ (store_access.hpp, save.inl, load.inl).
 *
 * File format, version 2 (version 1, read as well, is the same without the fact table). Every
 * integer and every pool element is little-endian whatever the
 * host; there is no padding between fields. `P` is the capacity (num_pages), `U` the pages in use,
 * `E` the element size of the store dtype (4 or 2), `B = 2 * L * page_size * H * head_dim * E` the
 * bytes of one page (L, H: the shard's layers and heads); a compressed store's page is `L` times
 * its layer's K and V blocks (compression.hpp), stored as bytes: codes, and scales little-endian.
 *
 * | offset | bytes | field                                                                     |
 * |-------:|------:|---------------------------------------------------------------------------|
 * |      0 |     8 | magic `89 49 53 4B 56 53 0D 0A` ("\x89ISKVS\r\n"; the high byte catches   |
 * |        |       | a 7-bit channel, CR LF a newline translation)                             |
 * |      8 |     4 | format version, uint32 = 2 (1: no fact table)                             |
 * |     12 |     4 | byte-order mark, uint32 0x01020304 (bytes `04 03 02 01`)                  |
 * |     16 |     4 | model num_layers, int32 (> 0)                                             |
 * |     20 |     4 | model num_kv_heads, int32 (> 0)                                           |
 * |     24 |     4 | model head_dim, int32 (> 0, even)                                         |
 * |     28 |     4 | first_layer, int32                                                        |
 * |     32 |     4 | num_layers held, int32 (resolved: never 0)                                |
 * |     36 |     4 | first_head, int32                                                         |
 * |     40 |     4 | num_heads held, int32 (resolved: never 0)                                 |
 * |     44 |     4 | page_size, int32 (> 0)                                                    |
 * |     48 |     8 | num_pages P, int64 (>= 0)                                                 |
 * |     56 |     1 | store dtype, uint8: 0 float32, 1 float16, 2 bfloat16                      |
 * |     57 |     1 | compression, uint8: 0 none, 1 fp8_e4m3, 2 int4 (compression.hpp; 0 in    |
 * |        |       | files written before it, where it was reserved)                           |
 * |     58 |     6 | reserved, 0                                                               |
 * |     64 |     8 | namespace count N, uint64                                                 |
 * |     72 |     8 | fact count F, uint64                                                      |
 * |     80 |     8 | token count T, uint64 (sum of the facts' lengths)                         |
 * |     88 |     8 | pages in use U, uint64 (sum of the facts' page counts)                    |
 * |     96 |     8 | header checksum: CRC-64 of bytes [0, 96)                                  |
 * |    104 |       | catalogue: N namespace records, namespace ids ascending, each            |
 * |        |     8 |   namespace id, uint64                                                    |
 * |        |     8 |   fact count n (>= 1), uint64                                             |
 * |        |       |   n fact records, in the namespace's insertion order, each               |
 * |        |     8 |     fact id, uint64                                                       |
 * |        |     4 |     tokens c, int32 (>= 1)                                                |
 * |        |     4 |     page count, uint32 = ceil(c / page_size)                              |
 * |        |  4 c  |     token ids, int32                                                      |
 * |        |  8 pc |     pages, int64, in token order                                          |
 * |        | 8(P-U)|   the free-page stack, int64 page ids, bottom first (the next fact takes  |
 * |        |       |   its pages from the end)                                                 |
 * |        |   8 F | the fact table (version 2): per fact, in catalogue order, the CRC-64 of   |
 * |        |       |   its pages' bytes as the file stores them (ascending page id, whole     |
 * |        |       |   pages, little-endian, the file's dtype)                                 |
 * |        |     8 | catalogue checksum: CRC-64 of the catalogue (from byte 104, fact table    |
 * |        |       | included)                                                                 |
 * |        |   U B | the pages in use, ascending page id, each `[L][2][page_size][H][head_dim]` |
 * |        |       | of the store dtype (whole pages: the zeroed rows past a fact's end too)   |
 * |  end-8 |     8 | file checksum: CRC-64 of every byte before it except the two checksums   |
 * |        |       | above (the header's at 96 and the catalogue's)                            |
 *
 * The file is therefore exactly `120 + 16 N + 24 F + 4 T + 8 P + U B` bytes (version 1:
 * `16 F`). Only the pages in
 * use are stored, so a snapshot never carries the KV of erased facts; free pages load as zeros.
 * The memory space is not stored: `load_store` takes it from the caller. `version()` and
 * `identity()` are not kept (the loaded store is a new object; plans made against the old one
 * are refused by injection). Everything else observable is: configuration, every fact's id,
 * namespace, token ids and pages, each namespace's fact order (erase_namespace and composition
 * see the same order) and the free-page stack (the next inserts take the same pages), so a save
 * of a loaded store gives the same bytes and a composition + injection from it the same cache
 * bytes.
 *
 * CRC-64 is CRC-64/XZ (detail/serialize.hpp). The header and the catalogue have their own
 * checksums, so that damage there is named as such before it can size or steer the rest of the
 * read. The file checksum skips those two fields: a CRC is affine, so a range followed by its
 * own CRC drives the register to a state independent of the range's contents, and a file CRC
 * over the embedded checksums would not see the header or the catalogue. Skipping them, it
 * covers every field and every pool byte, so it also identifies the file's contents (the memory
 * facade's manifest uses it).
 *
 * The fact table (version 2) lets a reader check one fact's pages without the rest of the file:
 * the incremental load below. It sits after the free-page stack so that the fact records keep
 * version 1's layout; it is per fact rather than per page (8 bytes per fact, and a fact is the
 * unit that changes between two saves); its CRC runs over the pages in the order the file stores
 * them, so a full load computes it in its one front-to-back pass, while the saving takes one pass
 * over the pool before writing (the catalogue precedes the pages).
 *
 * `load_store` checks, in this order, and refuses with `inferscale::logic_error` before the store
 * is handed out (nothing is half loaded): the magic, the format version, the byte-order mark, the
 * header length and checksum, the header fields (geometry, shard ranges inside the model, page
 * size, capacity, dtype code, reserved bytes zero, counts N <= F <= U <= P and F <= T, the pool's
 * byte count representable), the exact file length, the catalogue checksum, the catalogue
 * (namespaces ascending and non-empty, fact ids distinct, tokens >= 1, page count =
 * ceil(tokens / page_size), every page id below P and held once among all facts and the free
 * stack, the counts summing to the header's), the target (dtype, and for the overload taking a
 * target configuration: geometry, shard, page size, capacity), then the pool while it is read:
 * the file checksum first, then (version 2) every fact's checksum, then every element finite
 * and, when converting, representable in the target dtype. The pool is read into the new store
 * as it goes (no second copy of a large file);
 * that store is destroyed if any check fails, and the caller only ever receives a complete one.
 *
 * Incremental load (`load_store(path, target, previous)`, version 2): the header and the
 * catalogue are read and checked as above; then each fact's pages are taken from `previous` when
 * it holds the fact (same id, tokens and page count) and its pages' bytes, brought to the file's
 * dtype, have the fact table's CRC (computed over the bytes copied into the new store, so a fact
 * that changed under its id, or a `previous` of another memory, is simply read instead); every
 * other fact's pages are read with pread (consecutive pages in one call) and checked against the
 * table before the load goes on. Each page then goes through the same finiteness check and
 * conversion as in a full load, so the result is the full load's, byte for byte. The file
 * checksum is not recomputed (it needs every byte): every byte used is covered by the header's,
 * the catalogue's or a fact's checksum, and the file checksum still names the file in the memory
 * facade's manifest. Damage in pages that `previous` supplies is not seen (they are not read).
 * Erased facts are simply absent from the catalogue. A version-1 file, a `previous` of another
 * page layout, or a big-endian host: the full load.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/detail/snapshot/format.hpp>
#include <inferscale/detail/snapshot/store_access.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/store.hpp>

#include <optional>
#include <string>

namespace inferscale {

/// @brief How load_store builds the store.
struct store_load_options {
  memory_space space{memory_space::host};  ///< where the loaded pool lives
  /// The loaded store's dtype (float32, float16 or bfloat16); empty: the file's. Widening is
  /// exact; narrowing rounds each element to nearest, ties to even (float16 <-> bfloat16 through
  /// float32: an exact widening, then that one rounding); a finite element that overflows the
  /// target refuses the load.
  std::optional<dtype> store_dtype{};
};

/**
 * @brief Saves the store (configuration, catalogue, namespaces, free-page order, the pages in
 * use) to `path` in the format of the file comment.
 *
 * Atomic: the file is written to `path + ".tmp"` in the same directory, synced to the storage
 * device, renamed over `path`, and the directory synced; a crash or a failure leaves `path` as it
 * was (the old file whole, or no file) and no temporary behind.
 *
 * @param[in] store a host or device store (a device pool is copied to the host in 8 MiB pieces)
 * @param[in] path destination file
 * @throw logic_error naming the path and the system's reason when the file cannot be created,
 * written, synced, closed or renamed, or the directory synced; or when a page in use holds a NaN
 * or an infinity (a snapshot holds finite KV only, as the index holds finite vectors)
 * @throw cuda_error if reading a device pool fails
 * @note Two concurrent saves to the same path share the temporary name; serialise them. Waits
 * for the device copies.
 */
inline void save_store(kv_store const& store, std::string const& path)
{
  detail::store_access::save(store, path);
}

/**
 * @brief Loads a store saved by save_store, in the memory and dtype `options` say.
 *
 * Everything is checked (see the file comment) before the store is handed out; a corrupted,
 * truncated or foreign file is refused and nothing is half loaded.
 *
 * @param[in] path a file written by save_store
 * @param[in] options memory space of the pool; the store dtype (default: the file's; conversion
 * as store_load_options::store_dtype says)
 * @return the store: the file's configuration (memory and dtype as asked), every fact with its id,
 * namespace, token ids and pages, the namespaces' fact order, the free-page stack; pages in use
 * hold the file's bytes (converted if asked), free pages zeros
 * @throw logic_error naming the problem ("not an InferScale store snapshot", "format version 7 is
 * not supported (this build reads 1 to 2)", "truncated: expected N bytes, file has M", "checksum
 * mismatch", "page 3 is held twice", an I/O error with the path and the system's reason, "the
 * store the file describes (P pages of B bytes, ...) cannot be allocated", ...)
 * @throw cuda_error when a device pool cannot be allocated or written
 * @note Peak host memory is the pool (host store) plus the catalogue and 8 MiB of staging.
 * @note The pool is allocated at the capacity and page size the file's header states (free
 * pages' bytes are not stored, so a file of a few hundred bytes may state gigabytes); to read
 * files from a source you do not trust, use the overload taking the target configuration, which
 * refuses another geometry, page size or capacity before allocating anything.
 */
inline kv_store load_store(std::string const& path, store_load_options const& options = {})
{
  return detail::store_access::load(path, options.space, options.store_dtype, nullptr);
}

/**
 * @brief Loads a store saved by save_store into a store configured as `target`: the file must
 * hold the same model geometry, the same shard (layer and head ranges, 0 counts resolved as
 * kv_store does), the same page size and capacity; the pool is converted to
 * `target.store_dtype` (as store_load_options::store_dtype) and placed in `target.space`
 * (page-locked if `target.pinned`).
 *
 * @throw logic_error as the other overload, and naming both sides when the geometry, the shard,
 * the page size or the capacity differ (a snapshot of another shard is never re-sliced)
 */
inline kv_store load_store(std::string const& path, kv_store_config const& target)
{
  return detail::store_access::load(path, target.space, target.store_dtype, &target);
}

/**
 * @brief The incremental load: load_store(path, target) that takes from `previous` (typically
 * the store this file's previous version loaded into) every fact it holds with the file's bytes,
 * and reads from the file only the other facts' pages (see "Incremental load" in the file
 * comment). The result is the store load_store(path, target) returns, byte for byte.
 *
 * `previous` lends pages only when the file is of version 2, the host little-endian and
 * `previous` has the file's page layout (model, shard, page size; any dtype, host or device
 * memory); otherwise this is load_store(path, target). `previous` is only read; it must not be
 * modified during the call.
 *
 * @throw logic_error as load_store(path, target), except that damage in the pages of a fact
 * taken from `previous` is not seen (those bytes are not read); damage in a fact read from the
 * file is named with the fact ("fact 12: checksum mismatch of its pages")
 */
inline kv_store load_store(std::string const& path,
                           kv_store_config const& target,
                           kv_store const& previous)
{
  return detail::store_access::load(path, target.space, target.store_dtype, &target, &previous);
}

}  // namespace inferscale
