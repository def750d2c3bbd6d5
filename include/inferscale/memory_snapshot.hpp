/**
 * @file memory_snapshot.hpp
 * @brief Persistence of the memory facade (memory.hpp, which includes this header): save_memory
 * and load_memory, one checked directory transaction holding the store (snapshot.hpp), the index
 * (index_snapshot.hpp), the lifecycle state and a manifest tying them. The binary formats are
 * defined in detail/memory/snapshot_format.inl, the save and load in detail/memory/snapshot.inl.
 */
#pragma once

#include <inferscale/memory.hpp>

#include <optional>
#include <string>

namespace inferscale {

/**
 * @brief Saves the deployment `mem` to `directory` (which must exist): the store (save_store), the
 * index (save_index), the lifecycle state (`lifecycle-<file crc>.islc`: the kept conversations
 * and every tracked fact's window and links, so update_fact / update_turns work after a
 * restart; format below) and a manifest `memory.ismem` naming them and the instruction prefix.
 *
 * The store and index files are named after their checksums (`store-<file crc>.iskv`,
 * `index-<header crc>-<file crc>.isx`: the index's file checksum does not cover its header,
 * whose own checksum does); each is written atomically, then the manifest (atomically, last), and
 * only then the files of the previous snapshot in the directory are removed: one directory
 * transaction (detail/snapshot/directory_transaction.hpp). A crash or a failure at any point
 * leaves the previous snapshot loadable (its manifest and files are untouched until the new
 * manifest has replaced it), or the new one whole; a failure (an exception) also leaves no file
 * of the failed save behind.
 *
 * Manifest `memory.ismem`, 72 bytes, little-endian:
 *
 * | offset | bytes | field                                                             |
 * |-------:|------:|-------------------------------------------------------------------|
 * |      0 |     8 | magic `89 49 53 4D 45 4D 0D 0A` ("\x89ISMEM\r\n")              |
 * |      8 |     4 | format version, uint32 = 1                                        |
 * |     12 |     4 | byte-order mark, uint32 0x01020304                                |
 * |     16 |     1 | 1 if an instruction prefix is set, else 0                         |
 * |     17 |     7 | reserved, 0                                                       |
 * |     24 |     8 | the prefix's fact id, uint64 (0 without a prefix)                 |
 * |     32 |     8 | the store file's checksum (its last 8 bytes)                      |
 * |     40 |     8 | the index file's header checksum (its bytes 72 .. 80)             |
 * |     48 |     8 | the index file's checksum (its last 8 bytes)                      |
 * |     56 |     8 | the lifecycle file's checksum (its last 8 bytes)                  |
 * |     64 |     8 | CRC-64 of bytes [0, 64)                                           |
 *
 * Lifecycle file, little-endian, version 1: magic `89 49 53 4C 43 59 0D 0A` ("\x89ISLCY\r\n"),
 * version uint32 = 1, byte-order mark uint32 0x01020304, the next conversation handle uint64,
 * the conversation count C uint64, the fact count F uint64; then C conversation records in
 * ascending handle order — handle, namespace (uint64 each), window, strategy (uint8 + 7 zero
 * bytes), stride, max_sequence_tokens, first_position (int64 each), the lead (count uint64 +
 * int32 tokens), the session headers (count uint64; each a count + int32 tokens), the turns
 * (count uint64; each session int32, 4 zero bytes, count uint64 + int32 tokens), the planned
 * facts (count uint64 + uint64 ids); then F fact records in ascending id order — id, namespace
 * (uint64), flags uint8 (bit 0 planned from a conversation, bit 1 supersedes, bit 2 superseded)
 * + 7 zero bytes, conversation, supersedes, superseded_by (uint64, 0 where the flag is clear),
 * first_turn, first_position (int64), source turns (count uint64 + int64), context (count uint64
 * + int32), turn map (count uint64 + int64); then the CRC-64 of every byte before it. load_memory
 * checks the checksum first, then every count against the bytes left, the flags and reserved
 * bytes, and that the state agrees with the store and index: each tracked fact is in the store
 * in its namespace and is indexed exactly when it is not superseded, each planned fact names a
 * kept conversation that lists it, with its window inside the conversation.
 *
 * @param[in] mem the deployment
 * @param[in] directory an existing directory
 * @throw logic_error as save_store and save_index, naming the file and the system's reason
 * @note Serialise saves to one directory.
 */
void save_memory(memory const& mem, std::string const& directory);

/**
 * @brief save_memory() with the caller's *application data* in the same directory transaction:
 * opaque bytes the library does not interpret (an engine integration keeps there what the facade
 * does not know: its users' names for the namespaces, the facts' texts, the model's identity).
 * They are written to `application-<file crc>.isap` — magic `89 49 53 41 50 50 0D 0A`
 * ("\x89ISAPP\r\n"), version uint32 = 1, byte-order mark uint32 0x01020304, the length uint64,
 * the bytes, then the CRC-64 of every byte before it — and the manifest becomes version 2: 80
 * bytes, the version-1 fields at the same offsets, the application file's checksum at offset 64
 * and the CRC-64 of bytes [0, 72) at offset 72. Without `application` (nullopt) the snapshot is
 * version 1, byte for byte what save_memory(mem, directory) writes. The data is saved with the
 * state it describes, or not at all: a reader never sees one without the other.
 * @throw logic_error as save_memory
 */
void save_memory(memory const& mem,
                 std::string const& directory,
                 std::optional<std::string> const& application);

/**
 * @brief Restarts a deployment from a snapshot written by save_memory: the store and the index are
 * loaded (every check of load_store and load_index), nothing is re-encoded or re-embedded.
 *
 * `config` is the deployment's configuration, as given to the constructor: the store file must
 * match `config.store` (geometry, shard, page size, capacity; the dtype is converted as
 * load_store does, the memory space is `config.store.space`); the index file must have
 * `config.index`'s dim, metric and vector dtype (its graph degrees, exact-search threshold, host
 * entry points and host traversal dtype are the file's; the memory space is
 * `config.index.space`); search parameters and fact order are `config`'s. Every retrieve and
 * serve of the restarted deployment answers as the saved one did, bit for bit (load_index keeps
 * the index's search state).
 *
 * @throw logic_error when the manifest is missing, corrupted, of another version, or names
 * files that are missing or do not carry its checksums (a store and an index of different
 * saves are never paired); as load_store / load_index; when the configuration differs as said;
 * or when the snapshot is inconsistent (an indexed fact missing from the store or in another
 * namespace there, a prefix missing from the store or indexed)
 */
memory load_memory(std::string const& directory, memory_config const& config);

/**
 * @brief load_memory() that also hands back the snapshot's application data (see the
 * three-argument save_memory): `*application` is set to the bytes (a version-2 snapshot; its
 * file checked against the manifest's checksum and its own, before anything is loaded), or to
 * nullopt (a version-1 snapshot). A null `application` reads either version and ignores the data.
 * @throw logic_error as load_memory; when the application file is missing, of another save,
 *        corrupted or of another version
 */
memory load_memory(std::string const& directory,
                   memory_config const& config,
                   std::optional<std::string>* application);

/**
 * @brief The incremental load: load_memory(directory, config, application) that reads from the
 * store file only what `previous` does not already hold. What a reader that follows a
 * directory's generations calls with the generation it serves: one fact committed into a memory
 * of N facts costs it the small files, the store's header and catalogue, and that fact's pages,
 * not the whole store.
 *
 * The manifest, the index, the lifecycle and the application files are read and checked whole,
 * as by load_memory (they are small beside the store); the store is loaded by
 * load_store(path, config.store, previous->store()) (snapshot.hpp): its header and catalogue read
 * and checked whole (their checksums, every consistency check), then each fact's pages taken
 * from `previous` when it holds the fact (same id, tokens and page count) with the bytes the
 * file's fact table checksums (CRC-64 of the fact's pages, computed over the copied bytes), else
 * read from the file with pread and checked against the same table. A reader therefore never
 * serves a byte that was not checked against the file it loads. The returned memory is the one
 * load_memory returns, in every observable (facts, pages, namespace order, free-page stack,
 * index, lifecycle; a save of it writes the same bytes), whatever `previous` holds: a fact whose
 * bytes changed under its id, or a `previous` of another memory, only costs reads.
 *
 * The whole-file checksum of the store is not recomputed (it would read every byte); every byte
 * the load uses is covered by the header's, the catalogue's or a fact's checksum, and the
 * manifest still pairs the files by their checksums. Damage in a fact's pages that `previous`
 * supplies is not seen, as those bytes are not read (load_memory, reading everything, refuses
 * such a file). A version-1 store file (no fact table) is read whole.
 *
 * @param previous a memory to take unchanged facts from (its store's dtype and memory space may
 *        differ from `config.store`'s), or null: load_memory(directory, config, application).
 *        Its mutations are held off (its serial lock) while its store is read.
 * @throw logic_error as load_memory; a corrupted fact that is read from the store file is named
 *        ("fact 12: checksum mismatch of its pages"); nothing is half loaded
 */
memory load_memory(std::string const& directory,
                   memory_config const& config,
                   std::optional<std::string>* application,
                   memory const* previous);

/**
 * @brief The application data of the snapshot in `directory` (nullopt for a version-1 snapshot),
 * read and checked — the manifest, the file's own checksum and the manifest's — without loading
 * the store or the index: what an integration reads first to learn the configuration it keeps
 * there. A save may replace the snapshot between this call and a load_memory: compare the data
 * load_memory hands back.
 * @throw logic_error as load_memory for the manifest and the application file
 */
std::optional<std::string> load_memory_application(std::string const& directory);

}  // namespace inferscale

#include <inferscale/detail/memory/snapshot.inl>  // and snapshot_format.inl
