/**
 * @file detail/index/serialize.hpp
 * @brief The index file format behind `save_index` and `load_index` (declared in the public
 * `index_snapshot.hpp`): the layout, the checked parser and `snapshot_access`, which writes and
 * assembles a `graph_index` (plain C++17 plus the CUDA runtime headers that `index.hpp` already
 * needs).
 *
 * File format, version 2. Every integer and every vector element is little-endian whatever the
 * host; there is no alignment padding between fields. `E` is the element size of the vector dtype
 * (4 or 2), `W = row_elements * E` the bytes of one padded vector row, `D` the graph degree.
 *
 * | offset | bytes | field                                                                     |
 * |-------:|------:|---------------------------------------------------------------------------|
 * |      0 |     8 | magic `89 49 53 49 44 58 0D 0A` ("\x89ISIDX\r\n"; the high byte catches |
 * |        |       | a 7-bit channel, CR LF a newline translation)                             |
 * |      8 |     4 | format version, uint32 = 2                                                |
 * |     12 |     4 | byte-order mark, uint32 0x01020304 (bytes `04 03 02 01`)                  |
 * |     16 |     8 | dim, int64 (1 .. 2^20)                                                    |
 * |     24 |     1 | metric, uint8: 0 inner_product, 1 cosine, 2 squared_l2                    |
 * |     25 |     1 | vector dtype, uint8: 0 float32, 1 float16                                 |
 * |     26 |     1 | host_traversal_dtype, uint8: 0 float32, 1 float16 (float32 vectors only)  |
 * |     27 |     1 | reserved, 0                                                               |
 * |     28 |     4 | graph_degree D, uint32                                                    |
 * |     32 |     4 | intermediate_graph_degree, uint32                                         |
 * |     36 |     4 | host_entry_points, int32 (-1 = automatic, else 1 .. 2^20)                 |
 * |     40 |     8 | exact_search_threshold, int64 (-1 = the backend's default)                |
 * |     48 |     8 | row_elements, int64: dim padded to whole 16-byte chunks of the dtype      |
 * |     56 |     8 | tenant count T, uint64                                                    |
 * |     64 |     8 | total rows R, uint64 (sum of the tenants' sizes)                          |
 * |     72 |     8 | header checksum: CRC-64 of bytes [0, 72)                                  |
 * |     80 |       | T tenant records, in the order the namespaces were created:               |
 * |        |     8 |   namespace, uint64                                                       |
 * |        |     4 |   size n, uint32 (rows: live + deleted, below 2^31)                       |
 * |        |     4 |   live, uint32 (rows whose deleted flag is 0)                             |
 * |        |     4 |   entry rows, uint32: the rows the tenant had when its entry points were  |
 * |        |       |   chosen (at most n)                                                      |
 * |        |     4 |   default ef, uint32 (1 .. 65536): the fast search's calibrated list      |
 * |        |  8 n  |   fact ids, uint64 per row                                                |
 * |        |    n  |   deleted flags, uint8 per row (0 live, 1 deleted)                        |
 * |        |  W n  |   vectors, padded rows of the dtype (padding elements are +0)             |
 * |        |  4Dn  |   graph rows, uint32 node ids local to the tenant (0xFFFFFFFF = empty)    |
 * |        |  4 n  |   entry ranks, uint32 per row: the row's place in the tenant's list of    |
 * |        |       |   entry points (0 .. E-1, each once), or 0xFFFFFFFF for a row that is not |
 * |        |       |   one                                                                     |
 * |  end-8 |     8 | checksum: CRC-64 of every byte before it                                  |
 *
 * The file is therefore exactly `88 + 24 T + R (13 + W + 4 D)` bytes.
 *
 * Everything a search reads is stored, so that every search of the loaded index (exact, graph,
 * split, the fast host search with or without its float16 walk, any knob) answers as the saved
 * one did, bit for bit: namespaces, row order, fact ids, deleted flags, vectors, graph bytes, and
 * the fast host search's state, which depends on the index's history and not only on its rows
 * (the entry points and the calibrated list are chosen when a namespace is built and again only
 * when it has grown by a quarter, from the rows it had then; version 1 chose them afresh at load,
 * so a namespace grown by inserts since its last choice searched differently after a restart).
 * The entry points' packed rows and the float16 copies are derived from the stored rows. The
 * settings that change answers are stored too: `host_entry_points` (the automatic exact-search
 * threshold depends on it) and `host_traversal_dtype` (dropped to float32 when loading into device
 * memory, which has no fast host search). The memory space is not stored: `load_index` chooses it;
 * nor are the build knobs `host_knn`, `nn_descent` and `build_threads`, nor `max_row_overhead`
 * (the loaded config has their defaults; they only matter for later mutations). Erased namespaces
 * are not stored, and the loaded arena is packed (each tenant's capacity is its size), so holes,
 * spare rows and `version()` are not kept: later mutations may grow or compact the two indexes
 * at different times.
 *
 * CRC-64 is CRC-64/XZ: the ECMA-182 polynomial 0x42F0E1EBA9EA3693 bit-reflected
 * (0xC96C5795D7870F42), initial value and final XOR all ones; `crc64("123456789")` is
 * 0x995DC9BBDF1939FA. A CRC of width 64 detects every error burst of at most 64 bits, so every
 * single-byte corruption is refused. The header has its own checksum so that a damaged header is
 * named as such (and never sizes the rest of the read) before the body is examined. (A CRC is
 * affine: a range followed by its own CRC leaves the register in a state that does not depend on
 * the range, so the file checksum, which runs over the header and its checksum, depends on the
 * tenant records only; the header checksum covers the header. Both together identify a file's
 * contents, which is how the memory facade's manifest names an index file. The store snapshot's
 * file checksum skips its embedded checksums instead; see snapshot.hpp.) The CRC code is shared
 * with the store snapshot: detail/serialize.hpp.
 *
 * `load_index` checks, in this order, and refuses with `inferscale::logic_error` before any
 * `graph_index` is built: the magic, the format version, the byte-order mark, the header length
 * and checksum, the header fields, the exact file length, the file checksum, then the contents
 * (tenant sizes summing to R, distinct namespaces, deleted flags 0 or 1, live counts, live fact
 * ids distinct and not 2^64-1, graph ids below the tenant size or empty, finite vector elements,
 * zero padding, entry rows at most the size, default ef in range, entry ranks a permutation of
 * 0 .. E-1 over the rows that have one). Files of version 1 are refused (naming both versions):
 * they lack the fast search's state, so they could not be loaded as the same index.
 */
#pragma once

#include <inferscale/detail/host_memory.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/index.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {
namespace detail::index {

// The generic pieces (CRC-64, little-endian fields, the checksumming writer) are shared with the
// store snapshot: detail/serialize.hpp.
using serial::checksummed_writer;
using serial::copy_little_endian;
using serial::crc64;
using serial::crc64_of;
using serial::get_le;
using serial::hex;
using serial::host_is_little_endian;
using serial::multiply_add;
using serial::put_le;

// -------------------------------------------------------------------------------------------------
// Format constants and little-endian helpers.

namespace format {
inline constexpr unsigned char magic[8]       = {0x89, 'I', 'S', 'I', 'D', 'X', 0x0D, 0x0A};
inline constexpr std::uint32_t version        = 2;
inline constexpr std::uint32_t byte_order     = 0x01020304u;
inline constexpr std::size_t header_fields    = 72;  ///< bytes covered by the header checksum
inline constexpr std::size_t header_bytes     = 80;  ///< fields + header checksum
inline constexpr std::size_t tenant_bytes     = 24;  ///< namespace, size, live, entry rows, ef
inline constexpr std::size_t row_extra_bytes  = 13;  ///< per row beside W + 4 D: id, flag, rank
inline constexpr std::uint32_t no_rank        = 0xFFFFFFFFu;  ///< a row that is not an entry point
inline constexpr std::uint32_t max_default_ef = 65536;
inline constexpr std::size_t checksum_bytes   = 8;
inline constexpr std::size_t minimum_bytes    = header_bytes + checksum_bytes;
inline constexpr std::uint8_t dtype_float32   = 0;
inline constexpr std::uint8_t dtype_float16   = 1;

inline std::uint8_t metric_code(distance_metric m) noexcept
{
  switch (m) {
    case distance_metric::inner_product: return 0;
    case distance_metric::cosine: return 1;
    case distance_metric::squared_l2: return 2;
  }
  return 0xFF;
}
}  // namespace format

// -------------------------------------------------------------------------------------------------
// Reading.

/// @brief The contents of a checked file, in the arena layout of `graph_index` (packed).
struct staged_index {
  index_config config{};
  std::vector<std::uint64_t> namespaces;
  std::vector<tenant_ref> tenants;
  huge_page_vector<unsigned char> vectors;
  huge_page_vector<std::uint32_t> graph;
  std::vector<std::uint64_t> ids;
  std::vector<std::uint8_t> deleted;
  /// Per tenant: the fast host search's entry points (local ids, in order), the rows the tenant
  /// had when they were chosen, and its calibrated list size.
  std::vector<std::vector<std::uint32_t>> entries;
  std::vector<std::uint32_t> entries_rows;
  std::vector<std::uint32_t> default_ef;
};

/// @brief Checks everything the file format promises and returns the contents; throws
/// logic_error naming the first problem found. `where` prefixes every message.
inline staged_index parse_index_file(std::vector<unsigned char> const& file,
                                     std::string const& where)
{
  std::uint64_t const file_size = file.size();
  auto const truncated_min      = [&] {
    return where + "truncated: expected at least " + std::to_string(format::minimum_bytes) +
           " bytes, file has " + std::to_string(file_size);
  };

  // identification: magic, version, byte order (each as soon as its bytes are there)
  std::size_t const magic_seen = std::min<std::size_t>(file.size(), sizeof format::magic);
  INFERSCALE_EXPECTS(magic_seen == 0 || std::memcmp(file.data(), format::magic, magic_seen) == 0,
                     where + "not an InferScale index file (wrong magic bytes)");
  INFERSCALE_EXPECTS(file_size >= 12, truncated_min());
  std::uint32_t const version = get_le<std::uint32_t>(file.data() + 8);
  INFERSCALE_EXPECTS(version == format::version,
                     where + "format version " + std::to_string(version) +
                       " is not supported (this build reads " + std::to_string(format::version) +
                       ")");
  INFERSCALE_EXPECTS(file_size >= 16, truncated_min());
  std::uint32_t const byte_order = get_le<std::uint32_t>(file.data() + 12);
  INFERSCALE_EXPECTS(byte_order == format::byte_order,
                     where + "bad byte-order mark " + hex(byte_order, 8) +
                       " (files are little-endian, mark 0x01020304)");
  INFERSCALE_EXPECTS(file_size >= format::minimum_bytes, truncated_min());

  // the header: its own checksum first, then its fields
  unsigned char const* h            = file.data();
  std::uint64_t const header_stored = get_le<std::uint64_t>(h + format::header_fields);
  std::uint64_t const header_actual = crc64_of(h, format::header_fields);
  INFERSCALE_EXPECTS(header_stored == header_actual,
                     where + "header checksum mismatch: stored " + hex(header_stored) +
                       ", computed " + hex(header_actual) + " (the header is corrupted)");

  staged_index s;
  auto& c                          = s.config;
  c.dim                            = get_le<std::int64_t>(h + 16);
  std::uint8_t const metric        = h[24];
  std::uint8_t const vector_type   = h[25];
  c.graph_degree                   = get_le<std::uint32_t>(h + 28);
  c.intermediate_graph_degree      = get_le<std::uint32_t>(h + 32);
  c.exact_search_threshold         = get_le<std::int64_t>(h + 40);
  std::int64_t const row_elements  = get_le<std::int64_t>(h + 48);
  std::uint64_t const tenant_count = get_le<std::uint64_t>(h + 56);
  std::uint64_t const total_rows   = get_le<std::uint64_t>(h + 64);
  std::uint8_t const traversal     = h[26];
  std::int32_t const entry_points  = get_le<std::int32_t>(h + 36);

  INFERSCALE_EXPECTS(h[27] == 0, where + "header: reserved fields are not zero");
  INFERSCALE_EXPECTS(c.dim >= 1 && c.dim <= (std::int64_t{1} << 20),
                     where + "header: dim " + std::to_string(c.dim) + " outside [1, 2^20]");
  INFERSCALE_EXPECTS(metric <= 2, where + "header: unknown metric code " + std::to_string(metric));
  c.metric = metric == 0   ? distance_metric::inner_product
             : metric == 1 ? distance_metric::cosine
                           : distance_metric::squared_l2;
  INFERSCALE_EXPECTS(vector_type == format::dtype_float32 || vector_type == format::dtype_float16,
                     where + "header: unknown vector dtype code " + std::to_string(vector_type));
  c.vector_dtype = vector_type == format::dtype_float32 ? dtype::float32 : dtype::float16;
  INFERSCALE_EXPECTS(traversal == format::dtype_float32 ||
                       (traversal == format::dtype_float16 && vector_type == format::dtype_float32),
                     where + "header: host traversal dtype code " + std::to_string(traversal) +
                       " is neither 0 (float32) nor 1 (float16, over float32 vectors only)");
  c.host_traversal_dtype = traversal == format::dtype_float32 ? dtype::float32 : dtype::float16;
  INFERSCALE_EXPECTS(entry_points == -1 || (entry_points >= 1 && entry_points <= (1 << 20)),
                     where + "header: host_entry_points " + std::to_string(entry_points) +
                       " is neither -1 (automatic) nor in [1, 2^20]");
  c.host_entry_points = entry_points;
  INFERSCALE_EXPECTS(c.graph_degree >= 1 && c.graph_degree <= c.intermediate_graph_degree &&
                       c.intermediate_graph_degree <= 1024,
                     where + "header: degrees graph " + std::to_string(c.graph_degree) +
                       ", intermediate " + std::to_string(c.intermediate_graph_degree) +
                       " break 1 <= graph <= intermediate <= 1024");
  INFERSCALE_EXPECTS(c.exact_search_threshold >= -1,
                     where + "header: exact_search_threshold " +
                       std::to_string(c.exact_search_threshold) + " below -1");
  std::size_t const element_size = size_of(c.vector_dtype);
  INFERSCALE_EXPECTS(row_elements == padded_dim(c.dim, element_size),
                     where + "header: row_elements " + std::to_string(row_elements) +
                       " is not dim " + std::to_string(c.dim) + " padded to 16 bytes");

  // the exact length the header implies
  std::uint64_t const row_bytes = format::row_extra_bytes +
                                  static_cast<std::uint64_t>(row_elements) * element_size +
                                  std::uint64_t{4} * c.graph_degree;
  std::uint64_t tenant_table = 0;
  std::uint64_t expected     = 0;
  bool const representable =
    multiply_add(tenant_count, format::tenant_bytes, format::minimum_bytes, tenant_table) &&
    multiply_add(total_rows, row_bytes, tenant_table, expected);
  INFERSCALE_EXPECTS(representable,
                     where + "header: " + std::to_string(tenant_count) + " tenants and " +
                       std::to_string(total_rows) + " rows do not fit in a file");
  INFERSCALE_EXPECTS(file_size >= expected,
                     where + "truncated: expected " + std::to_string(expected) +
                       " bytes, file has " + std::to_string(file_size));
  INFERSCALE_EXPECTS(file_size == expected,
                     where + "trailing data: expected " + std::to_string(expected) +
                       " bytes, file has " + std::to_string(file_size));

  // the whole file
  std::size_t const body_end = file.size() - format::checksum_bytes;
  std::uint64_t const stored = get_le<std::uint64_t>(file.data() + body_end);
  std::uint64_t const actual = crc64_of(file.data(), body_end);
  INFERSCALE_EXPECTS(stored == actual,
                     where + "checksum mismatch: stored " + hex(stored) + ", computed " +
                       hex(actual) + " (the file is corrupted)");

  // the contents
  std::size_t const vector_row_bytes = static_cast<std::size_t>(row_elements) * element_size;
  std::size_t const degree           = c.graph_degree;
  std::size_t const rows             = static_cast<std::size_t>(total_rows);
  s.vectors.resize(rows * vector_row_bytes);
  s.graph.resize(rows * degree);
  s.ids.resize(rows);
  s.deleted.resize(rows);
  s.namespaces.reserve(static_cast<std::size_t>(tenant_count));
  s.tenants.reserve(static_cast<std::size_t>(tenant_count));
  s.entries.reserve(static_cast<std::size_t>(tenant_count));
  s.entries_rows.reserve(static_cast<std::size_t>(tenant_count));
  s.default_ef.reserve(static_cast<std::size_t>(tenant_count));
  std::vector<std::uint32_t> ranks;

  std::unordered_set<std::uint64_t> seen_namespaces;
  std::unordered_set<std::uint64_t> live_ids;
  std::size_t at          = format::header_bytes;
  std::uint64_t row_begin = 0;
  for (std::uint64_t t = 0; t < tenant_count; ++t) {
    std::string const tenant_name = "tenant " + std::to_string(t);
    std::uint64_t const ns        = get_le<std::uint64_t>(file.data() + at);
    std::uint32_t const size      = get_le<std::uint32_t>(file.data() + at + 8);
    std::uint32_t const live      = get_le<std::uint32_t>(file.data() + at + 12);
    std::uint32_t const chosen_at = get_le<std::uint32_t>(file.data() + at + 16);
    std::uint32_t const ef        = get_le<std::uint32_t>(file.data() + at + 20);
    at += format::tenant_bytes;
    INFERSCALE_EXPECTS(seen_namespaces.insert(ns).second,
                       where + "namespace " + std::to_string(ns) + " appears twice");
    INFERSCALE_EXPECTS(size < (std::uint32_t{1} << 31),
                       where + tenant_name + " (namespace " + std::to_string(ns) + ") has " +
                         std::to_string(size) + " rows, at most 2^31-1 allowed");
    INFERSCALE_EXPECTS(
      size <= total_rows - row_begin,
      where + "tenants hold more rows than the header's " + std::to_string(total_rows));
    INFERSCALE_EXPECTS(live <= size,
                       where + tenant_name + " (namespace " + std::to_string(ns) + "): live " +
                         std::to_string(live) + " exceeds size " + std::to_string(size));
    std::size_t const first = static_cast<std::size_t>(row_begin);
    std::size_t const n     = size;

    copy_little_endian(s.ids.data() + first, file.data() + at, n, 8);
    at += 8 * n;
    std::memcpy(s.deleted.data() + first, file.data() + at, n);
    at += n;
    copy_little_endian(s.vectors.data() + first * vector_row_bytes,
                       file.data() + at,
                       n * static_cast<std::size_t>(row_elements),
                       element_size);
    at += n * vector_row_bytes;
    copy_little_endian(s.graph.data() + first * degree, file.data() + at, n * degree, 4);
    at += 4 * n * degree;
    ranks.resize(n);
    copy_little_endian(ranks.data(), file.data() + at, n, 4);
    at += 4 * n;

    std::uint32_t counted_live = 0;
    for (std::size_t v = 0; v < n; ++v) {
      std::uint8_t const flag = s.deleted[first + v];
      INFERSCALE_EXPECTS(flag <= 1,
                         where + tenant_name + " row " + std::to_string(v) + ": deleted flag " +
                           std::to_string(flag) + " is not 0 or 1");
      if (flag != 0) { continue; }
      ++counted_live;
      std::uint64_t const id = s.ids[first + v];
      INFERSCALE_EXPECTS(
        id != invalid_fact_id,
        where + tenant_name + " row " + std::to_string(v) + ": live fact id 2^64-1 is reserved");
      INFERSCALE_EXPECTS(live_ids.insert(id).second,
                         where + "live fact id " + std::to_string(id) + " appears twice");
    }
    INFERSCALE_EXPECTS(counted_live == live,
                       where + tenant_name + " (namespace " + std::to_string(ns) +
                         "): live count " + std::to_string(live) + " but " +
                         std::to_string(counted_live) + " rows are not deleted");
    std::uint32_t const* graph = s.graph.data() + first * degree;
    for (std::size_t e = 0; e < n * degree; ++e) {
      INFERSCALE_EXPECTS(graph[e] < size || graph[e] == invalid_node,
                         where + tenant_name + " row " + std::to_string(e / degree) +
                           ": graph id " + std::to_string(graph[e]) +
                           " is neither below the tenant size " + std::to_string(size) +
                           " nor empty (0xFFFFFFFF)");
    }
    // the fast search's state: entry rows, list size, and entry ranks forming 0 .. E-1
    INFERSCALE_EXPECTS(chosen_at <= size,
                       where + tenant_name + " (namespace " + std::to_string(ns) +
                         "): entry points chosen at " + std::to_string(chosen_at) +
                         " rows, more than its " + std::to_string(size));
    INFERSCALE_EXPECTS(ef >= 1 && ef <= format::max_default_ef,
                       where + tenant_name + " (namespace " + std::to_string(ns) +
                         "): default ef " + std::to_string(ef) + " outside [1, " +
                         std::to_string(format::max_default_ef) + "]");
    std::size_t const entry_count = static_cast<std::size_t>(std::count_if(
      ranks.begin(), ranks.end(), [](std::uint32_t r) { return r != format::no_rank; }));
    std::vector<std::uint32_t> entries(entry_count, format::no_rank);
    for (std::size_t v = 0; v < n; ++v) {
      std::uint32_t const r = ranks[v];
      if (r == format::no_rank) { continue; }
      INFERSCALE_EXPECTS(r < entry_count && entries[r] == format::no_rank,
                         where + tenant_name + " row " + std::to_string(v) + ": entry rank " +
                           std::to_string(r) + " is repeated or not below the " +
                           std::to_string(entry_count) + " entry points");
      entries[r] = static_cast<std::uint32_t>(v);
    }
    // vectors: finite elements (exponent not all ones) and +0 padding, checked on the bits
    unsigned char const* vectors = s.vectors.data() + first * vector_row_bytes;
    for (std::size_t v = 0; v < n; ++v) {
      for (std::int64_t e = 0; e < row_elements; ++e) {
        unsigned char const* x =
          vectors + v * vector_row_bytes + static_cast<std::size_t>(e) * element_size;
        std::uint32_t bits = 0;
        if (element_size == 4) {
          std::memcpy(&bits, x, 4);
        } else {
          std::uint16_t half_bits = 0;
          std::memcpy(&half_bits, x, 2);
          bits = half_bits;
        }
        bool const finite =
          element_size == 4 ? (bits & 0x7F800000u) != 0x7F800000u : (bits & 0x7C00u) != 0x7C00u;
        INFERSCALE_EXPECTS(finite,
                           where + tenant_name + " row " + std::to_string(v) + ": vector element " +
                             std::to_string(e) + " is NaN or infinite");
        INFERSCALE_EXPECTS(e < c.dim || bits == 0,
                           where + tenant_name + " row " + std::to_string(v) +
                             ": padding element " + std::to_string(e) + " is not zero");
      }
    }
    s.namespaces.push_back(ns);
    s.tenants.push_back(tenant_ref{static_cast<std::int64_t>(row_begin), size, live});
    s.entries.push_back(std::move(entries));
    s.entries_rows.push_back(chosen_at);
    s.default_ef.push_back(ef);
    row_begin += size;
  }
  INFERSCALE_EXPECTS(row_begin == total_rows,
                     where + "tenants hold " + std::to_string(row_begin) +
                       " rows, the header says " + std::to_string(total_rows));
  return s;
}

// -------------------------------------------------------------------------------------------------

/// @brief What persistence needs of graph_index's private state (the class befriends it).
struct snapshot_access {
  /// @brief Writes `index` in the format of the file comment (header through tenant records).
  static void write(graph_index const& index, checksummed_writer& out)
  {
    auto const& c = index.config_;
    std::vector<graph_index::tenant const*> live;
    std::uint64_t total_rows = 0;
    for (auto const& t : index.tenants_) {
      if (t.alive) {
        live.push_back(&t);
        total_rows += t.ref.size;
      }
    }
    unsigned char header[format::header_bytes] = {};
    std::memcpy(header, format::magic, sizeof format::magic);
    put_le(header + 8, format::version);
    put_le(header + 12, format::byte_order);
    put_le(header + 16, c.dim);
    header[24] = format::metric_code(c.metric);
    header[25] = c.vector_dtype == dtype::float32 ? format::dtype_float32 : format::dtype_float16;
    header[26] =
      c.host_traversal_dtype == dtype::float16 ? format::dtype_float16 : format::dtype_float32;
    put_le(header + 28, c.graph_degree);
    put_le(header + 32, c.intermediate_graph_degree);
    put_le(header + 36, static_cast<std::int32_t>(c.host_entry_points));  // -1 or 1 .. 2^20
    put_le(header + 40, c.exact_search_threshold);
    put_le(header + 48, index.row_elements_);
    put_le(header + 56, static_cast<std::uint64_t>(live.size()));
    put_le(header + 64, total_rows);
    put_le(header + format::header_fields, crc64_of(header, format::header_fields));
    out.write(header, sizeof header);

    std::size_t const vector_row_bytes =
      static_cast<std::size_t>(index.row_elements_) * index.element_size_;
    std::size_t const degree = c.graph_degree;
    for (auto const* t : live) {
      unsigned char record[format::tenant_bytes];
      put_le(record, t->ns);
      put_le(record + 8, t->ref.size);
      put_le(record + 12, t->ref.live);
      put_le(record + 16, t->entries_rows);
      put_le(record + 20, t->default_ef);
      out.write(record, sizeof record);
      std::size_t const first = static_cast<std::size_t>(t->ref.row_begin);
      std::size_t const n     = t->ref.size;
      out.write_elements(index.ids_.data() + first, n, 8);
      out.write(index.deleted_.data() + first, n);
      out.write_elements(index.vectors_.data() + first * vector_row_bytes,
                         n * static_cast<std::size_t>(index.row_elements_),
                         index.element_size_);
      out.write_elements(index.graph_.data() + first * degree, n * degree, 4);
      std::vector<std::uint32_t> ranks(n, format::no_rank);
      for (std::size_t r = 0; r < t->entries.size(); ++r) {
        std::uint32_t const v = t->entries[r];
        INFERSCALE_EXPECTS(v < n && ranks[v] == format::no_rank,
                           "save_index: namespace " + std::to_string(t->ns) + ": entry point " +
                             std::to_string(v) + " is repeated or beyond its rows (a bug)");
        ranks[v] = static_cast<std::uint32_t>(r);
      }
      out.write_elements(ranks.data(), n, 4);
    }
  }

  /// @brief Builds an index from checked contents (packed arena: capacity = size per tenant).
  static graph_index assemble(staged_index&& s, memory_space space)
  {
    index_config config = s.config;
    config.space        = space;
    if (space == memory_space::device) {  // no fast host search there: no float16 walk
      config.host_traversal_dtype = dtype::float32;
    }
    graph_index index{config};
    std::int64_t const rows = static_cast<std::int64_t>(s.ids.size());
    index.vectors_          = std::move(s.vectors);
    index.graph_            = std::move(s.graph);
    index.ids_              = std::move(s.ids);
    index.deleted_          = std::move(s.deleted);
    index.arena_capacity_   = rows;
    index.arena_used_       = rows;
    std::size_t live_total  = 0;
    for (auto const& t : s.tenants) {
      live_total += t.live;
    }
    index.id_to_row_.reserve(live_total);
    index.tenants_.reserve(s.tenants.size());
    for (std::size_t i = 0; i < s.tenants.size(); ++i) {
      graph_index::tenant t;
      t.ns                   = s.namespaces[i];
      t.ref                  = s.tenants[i];
      t.capacity             = t.ref.size;
      index.tenant_of_[t.ns] = i;
      for (std::uint32_t v = 0; v < t.ref.size; ++v) {
        std::int64_t const row = t.ref.row_begin + v;
        if (index.deleted_[static_cast<std::size_t>(row)] == 0) {
          index.id_to_row_[index.ids_[static_cast<std::size_t>(row)]] = {i, v};
        }
      }
      // the fast search's state as it was saved (not chosen afresh: it depends on history);
      // the packed entry rows and the float16 copies are the stored rows'
      t.entries      = std::move(s.entries[i]);
      t.entries_rows = s.entries_rows[i];
      t.default_ef   = s.default_ef[i];
      index.tenants_.push_back(std::move(t));
      index.pack_entry_rows(i);    // where the namespace is large enough to keep them packed
      index.rebuild_traversal(i);  // float16 copies, under float16 traversal
    }
    index.reallocate_device();  // no-op for a host index
    return index;
  }
};

}  // namespace detail::index

}  // namespace inferscale
