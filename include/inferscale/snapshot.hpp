/**
 * @file snapshot.hpp
 * @brief Store snapshots: `save_store` writes a `kv_store` (configuration, catalogue, namespaces,
 * free-page order and the pages in use) to one file; `load_store` rebuilds it, in host or device
 * memory and, if asked, in another store dtype. Plain C++17 plus the CUDA runtime API (like
 * store.hpp; a host store never calls it).
 *
 * File format, version 1. Every integer and every pool element is little-endian whatever the
 * host; there is no padding between fields. `P` is the capacity (num_pages), `U` the pages in use,
 * `E` the element size of the store dtype (4 or 2), `B = 2 * L * page_size * H * head_dim * E` the
 * bytes of one page (L, H: the shard's layers and heads).
 *
 * | offset | bytes | field                                                                     |
 * |-------:|------:|---------------------------------------------------------------------------|
 * |      0 |     8 | magic `89 49 53 4B 56 53 0D 0A` ("\x89ISKVS\r\n"; the high byte catches   |
 * |        |       | a 7-bit channel, CR LF a newline translation)                             |
 * |      8 |     4 | format version, uint32 = 1                                                |
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
 * |     57 |     7 | reserved, 0                                                               |
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
 * |        |     8 | catalogue checksum: CRC-64 of the catalogue (from byte 104)               |
 * |        |   U B | the pages in use, ascending page id, each `[L][2][page_size][H][head_dim]` |
 * |        |       | of the store dtype (whole pages: the zeroed rows past a fact's end too)   |
 * |  end-8 |     8 | file checksum: CRC-64 of every byte before it except the two checksums   |
 * |        |       | above (the header's at 96 and the catalogue's)                            |
 *
 * The file is therefore exactly `120 + 16 N + 16 F + 4 T + 8 P + U B` bytes. Only the pages in
 * use are stored, so a snapshot never carries the KV of erased facts; free pages load as zeros.
 * The memory kind is not stored: `load_store` takes it from the caller. `version()` and
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
 * `load_store` checks, in this order, and refuses with `inferscale::logic_error` before the store
 * is handed out (nothing is half loaded): the magic, the format version, the byte-order mark, the
 * header length and checksum, the header fields (geometry, shard ranges inside the model, page
 * size, capacity, dtype code, reserved bytes zero, counts N <= F <= U <= P and F <= T, the pool's
 * byte count representable), the exact file length, the catalogue checksum, the catalogue
 * (namespaces ascending and non-empty, fact ids distinct, tokens >= 1, page count =
 * ceil(tokens / page_size), every page id below P and held once among all facts and the free
 * stack, the counts summing to the header's), the target (dtype, and for the overload taking a
 * target configuration: geometry, shard, page size, capacity), then the pool while it is read:
 * the file checksum first, then every element finite and, when converting, representable in the
 * target dtype. The pool is read into the new store as it goes (no second copy of a large file);
 * that store is destroyed if any check fails, and the caller only ever receives a complete one.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_kind.hpp>
#include <inferscale/store.hpp>


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

/// @brief How load_store builds the store.
struct store_load_options {
  memory_kind memory{memory_kind::host};  ///< where the loaded pool lives
  /// The loaded store's dtype (float32, float16 or bfloat16); empty: the file's. Widening is
  /// exact; narrowing rounds each element to nearest, ties to even (float16 <-> bfloat16 through
  /// float32: an exact widening, then that one rounding); a finite element that overflows the
  /// target refuses the load.
  std::optional<dtype> store_dtype{};
};

namespace detail {

namespace store_format {
inline constexpr unsigned char magic[8]      = {0x89, 'I', 'S', 'K', 'V', 'S', 0x0D, 0x0A};
inline constexpr std::uint32_t version       = 1;
inline constexpr std::uint32_t byte_order    = 0x01020304u;
inline constexpr std::size_t header_fields   = 96;   ///< bytes covered by the header checksum
inline constexpr std::size_t header_bytes    = 104;  ///< fields + header checksum
inline constexpr std::size_t namespace_bytes = 16;   ///< namespace id, fact count
inline constexpr std::size_t fact_bytes      = 16;   ///< fact id, tokens, page count
inline constexpr std::size_t checksum_bytes  = 8;
inline constexpr std::size_t minimum_bytes   = header_bytes + 2 * checksum_bytes;
/// Pool bytes read or written per piece: small enough that the checksum and the finiteness check
/// find them still in the cache after the copy, large enough to keep system calls rare.
inline constexpr std::size_t pool_chunk_bytes = std::size_t{8} << 20;

inline std::uint8_t dtype_code(dtype t) noexcept
{
  return t == dtype::float32 ? 0 : t == dtype::float16 ? 1 : 2;
}
}  // namespace store_format

/// @brief Reverses the bytes of each of `count` elements of `width` bytes (big-endian hosts).
inline void to_host_order(unsigned char* p, std::size_t count, std::size_t width) noexcept
{
  for (std::size_t e = 0; e < count; ++e) {
    std::reverse(p + e * width, p + (e + 1) * width);
  }
}

/// @brief True when one of `count` elements of `Bits` at `p` has all of `mask`'s exponent bits.
template <class Bits>
bool any_exponent_all_ones(unsigned char const* p, std::size_t count, Bits mask) noexcept
{
  // No early exit and a narrow accumulator: the loop vectorises (about 8 GB/s on one core of the
  // 2-core Xeon CI machine, against 2.5 GB/s with a bool accumulator).
  Bits acc = 0;
  for (std::size_t e = 0; e < count; ++e) {
    Bits b;
    std::memcpy(&b, p + sizeof(Bits) * e, sizeof(Bits));
    acc |= static_cast<Bits>(((b & mask) ^ mask) == 0 ? 1 : 0);
  }
  return acc != 0;
}

/// @brief Index of the first non-finite element of `count` elements of `t` at `p`, or `count`.
inline std::size_t first_non_finite(unsigned char const* p, std::size_t count, dtype t) noexcept
{
  constexpr std::size_t block = 4096;  // searched element by element only when flagged
  std::size_t const width     = size_of(t);
  std::uint32_t const mask    = t == dtype::float32   ? 0x7F800000u
                                : t == dtype::float16 ? 0x7C00u
                                                      : 0x7F80u;
  for (std::size_t begin = 0; begin < count; begin += block) {
    std::size_t const n          = std::min(block, count - begin);
    unsigned char const* const q = p + width * begin;
    bool const bad =
      width == 4 ? any_exponent_all_ones<std::uint32_t>(q, n, mask)
                 : any_exponent_all_ones<std::uint16_t>(q, n, static_cast<std::uint16_t>(mask));
    if (!bad) { continue; }
    for (std::size_t e = 0; e < n; ++e) {
      std::uint32_t b = 0;
      std::memcpy(&b, q + width * e, width);
      if ((b & mask) == mask) { return begin + e; }
    }
  }
  return count;
}

/// @brief True for the element types a store holds (float, half_t, bfloat16_t).
template <class T>
inline constexpr bool is_store_element_v =
  std::is_same_v<T, float> || std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>;

/**
 * @brief Converts `count` elements of `from` at `src` (host order) to `to` at `dst`; returns the
 * index of the first finite element that overflows `to`, or `count`.
 */
inline std::size_t convert_elements(
  unsigned char const* src, dtype from, unsigned char* dst, dtype to, std::size_t count)
{
  return dispatch_dtype(from, [&](auto source_tag) {
    using S = typename decltype(source_tag)::type;
    return dispatch_dtype(to, [&](auto target_tag) {
      using D              = typename decltype(target_tag)::type;
      std::size_t overflow = count;
      if constexpr (is_store_element_v<S> && is_store_element_v<D>) {
        // only float16 targets, and bfloat16 from float32, can overflow
        constexpr bool may_overflow =
          std::is_same_v<D, half_t> || (std::is_same_v<D, bfloat16_t> && std::is_same_v<S, float>);
        for (std::size_t e = 0; e < count; ++e) {
          S s;
          std::memcpy(&s, src + sizeof(S) * e, sizeof(S));
          float const x = to_float(s);
          D const d     = from_float<D>(x);
          std::memcpy(dst + sizeof(D) * e, &d, sizeof(D));
          if constexpr (may_overflow) {
            if (overflow == count && std::isfinite(x) && !std::isfinite(to_float(d))) {
              overflow = e;
            }
          }
        }
      }
      return overflow;
    });
  });
}

/// @brief What snapshots need of kv_store's private state (the class befriends it).
struct store_access {
  /// @brief The checked catalogue of a file, ready to be restored.
  struct staged_catalogue {
    std::vector<fact_record> records;       ///< namespaces ascending, insertion order within
    std::vector<std::int64_t> free_pages;   ///< bottom of the stack first
    std::vector<std::int64_t> used_pages;   ///< ascending
    std::vector<std::uint64_t> page_owner;  ///< fact id per used page (for messages)
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

  static std::size_t page_bytes(kv_store const& s)
  {
    return static_cast<std::size_t>(s.page_elements()) * size_of(s.store_dtype());
  }

  static void restore(kv_store& s, staged_catalogue&& c)
  {
    s.restore_catalogue(std::move(c.records), std::move(c.free_pages));
  }

  // -----------------------------------------------------------------------------------------------
  // Saving

  static void save(kv_store const& store, std::string const& path)
  {
    std::string const who                       = "save_store('" + path + "')";
    kv_store_config const& c                    = store.config();
    std::int64_t const P                        = store.num_pages();
    std::size_t const B                         = page_bytes(store);
    dtype const t                               = store.store_dtype();
    std::size_t const E                         = size_of(t);
    std::vector<std::uint64_t> const namespaces = namespace_ids(store);

    // The catalogue, in memory first (it is small beside the pool) so its checksum is at hand.
    std::vector<unsigned char> catalogue;
    std::vector<std::uint64_t> owner(static_cast<std::size_t>(P), 0);
    std::vector<char> used(static_cast<std::size_t>(P), 0);
    std::uint64_t facts = 0, tokens = 0, pages_in_use = 0;
    auto const append = [&](auto value) {
      std::size_t const at = catalogue.size();
      catalogue.resize(at + sizeof(value));
      serial::put_le(catalogue.data() + at, value);
    };
    for (std::uint64_t ns : namespaces) {
      std::vector<std::uint64_t> const ids = store.namespace_fact_ids(ns);
      append(ns);
      append(static_cast<std::uint64_t>(ids.size()));
      for (std::uint64_t id : ids) {
        fact_record const& r = store.at(id);
        append(r.fact_id);
        append(static_cast<std::int32_t>(r.token_ids.size()));
        append(static_cast<std::uint32_t>(r.pages.size()));
        for (std::int32_t token : r.token_ids) {
          append(token);
        }
        for (std::int64_t p : r.pages) {
          append(p);
          owner[static_cast<std::size_t>(p)] = id;
          used[static_cast<std::size_t>(p)]  = 1;
        }
        ++facts;
        tokens += r.token_ids.size();
        pages_in_use += r.pages.size();
      }
    }
    for (std::int64_t p : free_stack(store)) {
      append(p);
    }

    unsigned char header[store_format::header_bytes] = {};
    std::memcpy(header, store_format::magic, sizeof store_format::magic);
    serial::put_le(header + 8, store_format::version);
    serial::put_le(header + 12, store_format::byte_order);
    serial::put_le(header + 16, c.model.num_layers);
    serial::put_le(header + 20, c.model.num_kv_heads);
    serial::put_le(header + 24, c.model.head_dim);
    serial::put_le(header + 28, c.first_layer);
    serial::put_le(header + 32, c.num_layers);
    serial::put_le(header + 36, c.first_head);
    serial::put_le(header + 40, c.num_heads);
    serial::put_le(header + 44, c.page_size);
    serial::put_le(header + 48, c.num_pages);
    header[56] = store_format::dtype_code(t);
    serial::put_le(header + 64, static_cast<std::uint64_t>(namespaces.size()));
    serial::put_le(header + 72, facts);
    serial::put_le(header + 80, tokens);
    serial::put_le(header + 88, pages_in_use);
    serial::put_le(header + store_format::header_fields,
                   serial::crc64_of(header, store_format::header_fields));

    bool const device = store.memory() == memory_kind::device;
    std::size_t const pages_per_chunk =
      B == 0 ? 1 : std::max<std::size_t>(1, store_format::pool_chunk_bytes / B);
    std::vector<unsigned char> staging(
      device ? std::min(pages_per_chunk, static_cast<std::size_t>(P)) * B : 0);
    auto const* pool = static_cast<unsigned char const*>(store.ref().pool);

    (void)serial::write_file_atomically(path, who, true, [&](serial::checksummed_writer& out) {
      out.write(header, store_format::header_fields);
      out.write_excluded(header + store_format::header_fields, store_format::checksum_bytes);
      out.write(catalogue.data(), catalogue.size());
      unsigned char checksum[store_format::checksum_bytes];
      serial::put_le(checksum, serial::crc64_of(catalogue.data(), catalogue.size()));
      out.write_excluded(checksum, sizeof checksum);

      // The pages in use, ascending, in runs of consecutive pages (one write or copy per run).
      std::int64_t p = 0;
      while (p < P) {
        if (used[static_cast<std::size_t>(p)] == 0) {
          ++p;
          continue;
        }
        std::int64_t run_end = p + 1;
        while (run_end < P && used[static_cast<std::size_t>(run_end)] != 0 &&
               static_cast<std::size_t>(run_end - p) < pages_per_chunk) {
          ++run_end;
        }
        std::size_t const n       = static_cast<std::size_t>(run_end - p);
        std::size_t const bytes   = n * B;
        unsigned char const* data = pool + static_cast<std::size_t>(p) * B;
        if (device) {
          INFERSCALE_CUDA_TRY(cudaMemcpy(staging.data(), data, bytes, cudaMemcpyDeviceToHost));
          data = staging.data();
        }
        std::size_t const bad = first_non_finite(data, bytes / E, t);
        INFERSCALE_EXPECTS(bad == bytes / E,
                           who + ": fact " +
                             std::to_string(owner[static_cast<std::size_t>(p) + bad * E / B]) +
                             " holds a non-finite value (page " +
                             std::to_string(p + static_cast<std::int64_t>(bad * E / B)) +
                             "); a snapshot holds finite KV only, nothing was saved");
        out.write_elements(data, bytes / E, E);  // little-endian whatever the host
        p = run_end;
      }
      serial::put_le(checksum, out.checksum());
      out.write_excluded(checksum, sizeof checksum);
    });
  }

  // -----------------------------------------------------------------------------------------------
  // Loading

  struct parsed_header {
    kv_store_config config{};
    std::uint64_t namespaces{}, facts{}, tokens{}, pages_in_use{};
    std::uint64_t page_bytes{};
    std::uint64_t catalogue_bytes{};
    std::uint64_t file_bytes{};
  };

  /// @brief Checks the identification and the header (`h`: the first `available` bytes).
  static parsed_header parse_header(unsigned char const* h,
                                    std::uint64_t file_size,
                                    std::string const& where)
  {
    auto const truncated_min = [&] {
      return where + "truncated: expected at least " + std::to_string(store_format::minimum_bytes) +
             " bytes, file has " + std::to_string(file_size);
    };
    std::size_t const magic_seen =
      static_cast<std::size_t>(std::min<std::uint64_t>(file_size, sizeof store_format::magic));
    INFERSCALE_EXPECTS(magic_seen == 0 || std::memcmp(h, store_format::magic, magic_seen) == 0,
                       where + "not an InferScale store snapshot (wrong magic bytes)");
    INFERSCALE_EXPECTS(file_size >= 12, truncated_min());
    std::uint32_t const version = serial::get_le<std::uint32_t>(h + 8);
    INFERSCALE_EXPECTS(version == store_format::version,
                       where + "format version " + std::to_string(version) +
                         " is not supported (this build reads " +
                         std::to_string(store_format::version) + ")");
    INFERSCALE_EXPECTS(file_size >= 16, truncated_min());
    std::uint32_t const byte_order = serial::get_le<std::uint32_t>(h + 12);
    INFERSCALE_EXPECTS(byte_order == store_format::byte_order,
                       where + "bad byte-order mark " + serial::hex(byte_order, 8) +
                         " (files are little-endian, mark 0x01020304)");
    INFERSCALE_EXPECTS(file_size >= store_format::minimum_bytes, truncated_min());
    std::uint64_t const header_stored =
      serial::get_le<std::uint64_t>(h + store_format::header_fields);
    std::uint64_t const header_actual = serial::crc64_of(h, store_format::header_fields);
    INFERSCALE_EXPECTS(header_stored == header_actual,
                       where + "header checksum mismatch: stored " + serial::hex(header_stored) +
                         ", computed " + serial::hex(header_actual) + " (the header is corrupted)");

    parsed_header r;
    kv_store_config& c      = r.config;
    c.model.num_layers      = serial::get_le<std::int32_t>(h + 16);
    c.model.num_kv_heads    = serial::get_le<std::int32_t>(h + 20);
    c.model.head_dim        = serial::get_le<std::int32_t>(h + 24);
    c.first_layer           = serial::get_le<std::int32_t>(h + 28);
    c.num_layers            = serial::get_le<std::int32_t>(h + 32);
    c.first_head            = serial::get_le<std::int32_t>(h + 36);
    c.num_heads             = serial::get_le<std::int32_t>(h + 40);
    c.page_size             = serial::get_le<std::int32_t>(h + 44);
    c.num_pages             = serial::get_le<std::int64_t>(h + 48);
    std::uint8_t const code = h[56];
    r.namespaces            = serial::get_le<std::uint64_t>(h + 64);
    r.facts                 = serial::get_le<std::uint64_t>(h + 72);
    r.tokens                = serial::get_le<std::uint64_t>(h + 80);
    r.pages_in_use          = serial::get_le<std::uint64_t>(h + 88);
    bool reserved_zero      = true;
    for (std::size_t b = 57; b < 64; ++b) {
      reserved_zero = reserved_zero && h[b] == 0;
    }
    INFERSCALE_EXPECTS(reserved_zero, where + "header: reserved bytes are not zero");
    INFERSCALE_EXPECTS(code <= 2,
                       where + "header: unknown store dtype code " + std::to_string(code));
    c.store_dtype = code == 0 ? dtype::float32 : code == 1 ? dtype::float16 : dtype::bfloat16;

    std::string const model = std::to_string(c.model.num_layers) + " layers x " +
                              std::to_string(c.model.num_kv_heads) + " KV heads x head_dim " +
                              std::to_string(c.model.head_dim);
    INFERSCALE_EXPECTS(
      c.model.num_layers > 0 && c.model.num_kv_heads > 0 && c.model.head_dim > 0 &&
        c.model.head_dim % 2 == 0,
      where + "header: model geometry " + model + " is invalid (positive, head_dim even)");
    INFERSCALE_EXPECTS(
      c.first_layer >= 0 && c.num_layers > 0 && c.num_layers <= c.model.num_layers - c.first_layer,
      where + "header: layer range from " + std::to_string(c.first_layer) + ", " +
        std::to_string(c.num_layers) + " layers, outside the model's " +
        std::to_string(c.model.num_layers));
    INFERSCALE_EXPECTS(
      c.first_head >= 0 && c.num_heads > 0 && c.num_heads <= c.model.num_kv_heads - c.first_head,
      where + "header: head range from " + std::to_string(c.first_head) + ", " +
        std::to_string(c.num_heads) + " heads, outside the model's " +
        std::to_string(c.model.num_kv_heads));
    INFERSCALE_EXPECTS(
      c.page_size > 0,
      where + "header: page_size " + std::to_string(c.page_size) + " is not positive");
    INFERSCALE_EXPECTS(c.num_pages >= 0,
                       where + "header: num_pages " + std::to_string(c.num_pages) + " is negative");
    // page bytes = 2 * L * page_size * H * D * E; the pool P * page bytes must fit in an int64
    std::uint64_t page = 0;
    bool ok            = serial::multiply_add(2u * static_cast<std::uint64_t>(c.num_layers),
                                   static_cast<std::uint64_t>(c.page_size),
                                   0,
                                   page) &&
              serial::multiply_add(page, static_cast<std::uint64_t>(c.num_heads), 0, page) &&
              serial::multiply_add(page, static_cast<std::uint64_t>(c.model.head_dim), 0, page) &&
              serial::multiply_add(page, size_of(c.store_dtype), 0, page);
    std::uint64_t pool = 0;
    ok = ok && serial::multiply_add(page, static_cast<std::uint64_t>(c.num_pages), 0, pool) &&
         pool <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    INFERSCALE_EXPECTS(ok,
                       where + "header: a pool of " + std::to_string(c.num_pages) +
                         " pages of this geometry overflows a 64-bit byte count");
    r.page_bytes          = page;
    std::uint64_t const P = static_cast<std::uint64_t>(c.num_pages);
    INFERSCALE_EXPECTS(r.namespaces <= r.facts && r.facts <= r.pages_in_use &&
                         r.pages_in_use <= P && r.facts <= r.tokens,
                       where +
                         "header: counts break namespaces <= facts <= pages in use <= "
                         "capacity and facts <= tokens (" +
                         std::to_string(r.namespaces) + ", " + std::to_string(r.facts) + ", " +
                         std::to_string(r.pages_in_use) + ", " + std::to_string(P) + "; " +
                         std::to_string(r.tokens) + " tokens)");
    // catalogue = 16 N + 16 F + 4 T + 8 P; file = 104 + catalogue + 8 + U B + 8
    std::uint64_t catalogue = 0, file = 0;
    ok = serial::multiply_add(r.namespaces, store_format::namespace_bytes, 0, catalogue) &&
         serial::multiply_add(r.facts, store_format::fact_bytes, catalogue, catalogue) &&
         serial::multiply_add(r.tokens, 4, catalogue, catalogue) &&
         serial::multiply_add(P, 8, catalogue, catalogue) &&
         serial::multiply_add(r.pages_in_use, page, catalogue, file) &&
         serial::multiply_add(1, store_format::minimum_bytes, file, file);
    INFERSCALE_EXPECTS(ok, where + "header: the counts do not fit in a file");
    r.catalogue_bytes = catalogue;
    r.file_bytes      = file;
    INFERSCALE_EXPECTS(file_size >= file,
                       where + "truncated: expected " + std::to_string(file) + " bytes, file has " +
                         std::to_string(file_size));
    INFERSCALE_EXPECTS(file_size == file,
                       where + "trailing data: expected " + std::to_string(file) +
                         " bytes, file has " + std::to_string(file_size));
    return r;
  }

  /// @brief Checks the catalogue (its checksum already verified) against the header.
  static staged_catalogue parse_catalogue(std::vector<unsigned char> const& bytes,
                                          parsed_header const& h,
                                          std::string const& where)
  {
    staged_catalogue s;
    std::int64_t const P   = h.config.num_pages;
    std::int32_t const ps  = h.config.page_size;
    unsigned char const* p = bytes.data();
    std::vector<char> seen(static_cast<std::size_t>(P), 0);    // held by a fact or free
    std::vector<char> in_use(static_cast<std::size_t>(P), 0);  // held by a fact
    s.page_owner.assign(static_cast<std::size_t>(P), 0);
    std::unordered_set<std::uint64_t> ids;
    ids.reserve(static_cast<std::size_t>(h.facts));
    s.records.reserve(static_cast<std::size_t>(h.facts));
    std::uint64_t facts = 0, tokens = 0, pages = 0;
    auto const take_page = [&](std::int64_t page, std::string const& holder) {
      INFERSCALE_EXPECTS(page >= 0 && page < P,
                         where + holder + ": page " + std::to_string(page) +
                           " outside the capacity of " + std::to_string(P) + " pages");
      INFERSCALE_EXPECTS(seen[static_cast<std::size_t>(page)] == 0,
                         where + holder + ": page " + std::to_string(page) +
                           " is held twice (pages are never shared)");
      seen[static_cast<std::size_t>(page)] = 1;
    };
    bool first                = true;
    std::uint64_t previous_ns = 0;
    for (std::uint64_t n = 0; n < h.namespaces; ++n) {
      std::uint64_t const ns    = serial::get_le<std::uint64_t>(p);
      std::uint64_t const count = serial::get_le<std::uint64_t>(p + 8);
      p += store_format::namespace_bytes;
      std::string const space = "namespace " + std::to_string(ns);
      INFERSCALE_EXPECTS(first || ns > previous_ns,
                         where + space + " follows namespace " + std::to_string(previous_ns) +
                           ": namespaces are stored once each, ascending");
      first       = false;
      previous_ns = ns;
      INFERSCALE_EXPECTS(count >= 1, where + space + " holds no facts");
      INFERSCALE_EXPECTS(count <= h.facts - facts,
                         where + space + ": " + std::to_string(count) +
                           " facts exceed the header's " + std::to_string(h.facts));
      for (std::uint64_t f = 0; f < count; ++f) {
        fact_record r;
        r.fact_id                  = serial::get_le<std::uint64_t>(p);
        std::int32_t const length  = serial::get_le<std::int32_t>(p + 8);
        std::uint32_t const npages = serial::get_le<std::uint32_t>(p + 12);
        p += store_format::fact_bytes;
        std::string const fact = "fact " + std::to_string(r.fact_id);
        INFERSCALE_EXPECTS(ids.insert(r.fact_id).second,
                           where + fact + " appears twice (fact ids are unique)");
        INFERSCALE_EXPECTS(
          length >= 1,
          where + fact + " has " + std::to_string(length) + " tokens, at least 1 expected");
        std::uint64_t const expected_pages = (static_cast<std::uint64_t>(length) + ps - 1) / ps;
        INFERSCALE_EXPECTS(npages == expected_pages,
                           where + fact + ": " + std::to_string(npages) + " pages for " +
                             std::to_string(length) + " tokens, expected ceil(" +
                             std::to_string(length) + " / " + std::to_string(ps) +
                             ") = " + std::to_string(expected_pages));
        INFERSCALE_EXPECTS(static_cast<std::uint64_t>(length) <= h.tokens - tokens &&
                             npages <= h.pages_in_use - pages,
                           where + fact +
                             ": the facts hold more tokens or pages than the "
                             "header's " +
                             std::to_string(h.tokens) + " and " + std::to_string(h.pages_in_use));
        r.namespace_id = ns;
        r.token_ids.resize(static_cast<std::size_t>(length));
        serial::copy_little_endian(r.token_ids.data(), p, r.token_ids.size(), 4);
        p += 4 * r.token_ids.size();
        r.pages.resize(npages);
        serial::copy_little_endian(r.pages.data(), p, npages, 8);
        p += 8 * std::size_t{npages};
        for (std::int64_t page : r.pages) {
          take_page(page, fact);
          s.page_owner[static_cast<std::size_t>(page)] = r.fact_id;
          in_use[static_cast<std::size_t>(page)]       = 1;
        }
        ++facts;
        tokens += static_cast<std::uint64_t>(length);
        pages += npages;
        s.records.push_back(std::move(r));
      }
    }
    INFERSCALE_EXPECTS(facts == h.facts && tokens == h.tokens && pages == h.pages_in_use,
                       where + "the namespaces hold " + std::to_string(facts) + " facts, " +
                         std::to_string(tokens) + " tokens, " + std::to_string(pages) +
                         " pages; the header says " + std::to_string(h.facts) + ", " +
                         std::to_string(h.tokens) + ", " + std::to_string(h.pages_in_use));
    std::size_t const free_count = static_cast<std::size_t>(P) - static_cast<std::size_t>(pages);
    s.free_pages.resize(free_count);
    serial::copy_little_endian(s.free_pages.data(), p, free_count, 8);
    p += 8 * free_count;
    for (std::int64_t page : s.free_pages) {
      take_page(page, "the free-page stack");
    }
    // P distinct pages in [0, P): every page exactly once.
    INFERSCALE_EXPECTS(p == bytes.data() + bytes.size(),
                       where + "the catalogue's length disagrees with its contents");
    s.used_pages.reserve(static_cast<std::size_t>(pages));
    for (std::int64_t page = 0; page < P; ++page) {
      if (in_use[static_cast<std::size_t>(page)] != 0) { s.used_pages.push_back(page); }
    }
    return s;
  }

  static kv_store load(std::string const& path,
                       memory_kind memory,
                       std::optional<dtype> store_dtype,
                       kv_store_config const* expect)
  {
    std::string const where = "load_store('" + path + "'): ";
    std::string const who   = "load_store";
    serial::checksummed_reader in{path, who};
    std::uint64_t const size = in.size();

    unsigned char h[store_format::header_bytes] = {};
    std::size_t const available = static_cast<std::size_t>(std::min<std::uint64_t>(size, sizeof h));
    std::size_t const fields    = std::min(available, store_format::header_fields);
    in.read(h, fields);
    in.read_excluded(h + fields, available - fields);
    parsed_header const header = parse_header(h, size, where);
    kv_store_config const& fc  = header.config;

    std::vector<unsigned char> catalogue(static_cast<std::size_t>(header.catalogue_bytes));
    in.read(catalogue.data(), catalogue.size());
    unsigned char checksum[store_format::checksum_bytes];
    in.read_excluded(checksum, sizeof checksum);
    std::uint64_t const catalogue_stored = serial::get_le<std::uint64_t>(checksum);
    std::uint64_t const catalogue_actual = serial::crc64_of(catalogue.data(), catalogue.size());
    INFERSCALE_EXPECTS(catalogue_stored == catalogue_actual,
                       where + "catalogue checksum mismatch: stored " +
                         serial::hex(catalogue_stored) + ", computed " +
                         serial::hex(catalogue_actual) + " (the catalogue is corrupted)");

    staged_catalogue staged = parse_catalogue(catalogue, header, where);
    catalogue               = {};

    // the target
    kv_store_config target = fc;
    target.memory          = memory;
    target.pinned          = expect != nullptr && expect->pinned;  // placement, not content
    target.store_dtype     = store_dtype.value_or(fc.store_dtype);
    INFERSCALE_EXPECTS(target.store_dtype == dtype::float32 ||
                         target.store_dtype == dtype::float16 ||
                         target.store_dtype == dtype::bfloat16,
                       where + "the target dtype must be float32, float16 or bfloat16, got " +
                         to_string(target.store_dtype));
    if (expect != nullptr) { check_target(fc, *expect, where); }

    kv_store store{target};  // zeroed pool; handed out only once every check below has passed
    dtype const from      = fc.store_dtype;
    dtype const to        = target.store_dtype;
    std::size_t const B   = static_cast<std::size_t>(header.page_bytes);
    std::size_t const Eto = size_of(to);
    std::size_t const Bto = B / size_of(from) * Eto;
    std::size_t const per_chunk =
      B == 0 ? 1 : std::max<std::size_t>(1, store_format::pool_chunk_bytes / B);
    bool const device = memory == memory_kind::device;
    bool const direct = !device && from == to && serial::host_is_little_endian();
    auto* const pool  = static_cast<unsigned char*>(store.ref().pool);
    std::vector<unsigned char> raw(direct ? 0 : std::min(staged.used_pages.size(), per_chunk) * B);
    std::vector<unsigned char> converted(device && from != to ? raw.size() / size_of(from) * Eto
                                                              : 0);

    // Problems in the pool are reported after the file checksum, which names corruption first.
    std::string pool_problem;
    std::vector<std::int64_t> const& used = staged.used_pages;
    std::size_t i                         = 0;
    while (i < used.size()) {
      std::size_t run_end = i + 1;
      while (run_end < used.size() && used[run_end] == used[run_end - 1] + 1 &&
             run_end - i < per_chunk) {
        ++run_end;
      }
      std::size_t const n      = run_end - i;
      std::size_t const first  = static_cast<std::size_t>(used[i]);
      unsigned char* const dst = pool + first * Bto;
      unsigned char* source    = direct ? dst : raw.data();
      in.read(source, n * B);
      if (!serial::host_is_little_endian()) {
        to_host_order(source, n * B / size_of(from), size_of(from));
      }
      if (pool_problem.empty()) {
        std::size_t const elements = n * B / size_of(from);
        std::size_t const bad      = first_non_finite(source, elements, from);
        if (bad != elements) {
          std::size_t const page = first + bad * size_of(from) / B;
          pool_problem           = "fact " + std::to_string(staged.page_owner[page]) +
                         " holds a non-finite value (page " + std::to_string(page) + ")";
        }
      }
      unsigned char const* ready = source;
      if (from != to) {
        unsigned char* const out   = device ? converted.data() : dst;
        std::size_t const elements = n * B / size_of(from);
        std::size_t const overflow = convert_elements(source, from, out, to, elements);
        if (overflow != elements && pool_problem.empty()) {
          std::size_t const page = first + overflow * size_of(from) / B;
          pool_problem           = "fact " + std::to_string(staged.page_owner[page]) + " (page " +
                         std::to_string(page) + ") holds a value that overflows " + to_string(to) +
                         " (largest finite " + (to == dtype::float16 ? "65504" : "3.39e38") +
                         "); load it into a wider dtype";
        }
        ready = out;
      }
      if (device) { INFERSCALE_CUDA_TRY(cudaMemcpy(dst, ready, n * Bto, cudaMemcpyHostToDevice)); }
      i = run_end;
    }
    std::uint64_t const file_actual = in.checksum();
    in.read_excluded(checksum, sizeof checksum);
    std::uint64_t const file_stored = serial::get_le<std::uint64_t>(checksum);
    INFERSCALE_EXPECTS(file_stored == file_actual,
                       where + "checksum mismatch: stored " + serial::hex(file_stored) +
                         ", computed " + serial::hex(file_actual) + " (the file is corrupted)");
    INFERSCALE_EXPECTS(pool_problem.empty(), where + pool_problem);

    restore(store, std::move(staged));
    return store;
  }

  /// @brief Refuses a file whose geometry, shard, page size or capacity differ from `want`'s.
  static void check_target(kv_store_config const& file,
                           kv_store_config want,
                           std::string const& where)
  {
    if (want.num_layers == 0) { want.num_layers = want.model.num_layers - want.first_layer; }
    if (want.num_heads == 0) { want.num_heads = want.model.num_kv_heads - want.first_head; }
    auto const geometry = [](kv_geometry const& g) {
      return std::to_string(g.num_layers) + " layers x " + std::to_string(g.num_kv_heads) +
             " KV heads x head_dim " + std::to_string(g.head_dim);
    };
    auto const range = [](std::int32_t first, std::int32_t count) {
      return "[" + std::to_string(first) + ", " + std::to_string(first + count) + ")";
    };
    INFERSCALE_EXPECTS(file.model == want.model,
                       where + "the snapshot is of a model with " + geometry(file.model) +
                         ", the target store's model has " + geometry(want.model));
    INFERSCALE_EXPECTS(
      file.first_layer == want.first_layer && file.num_layers == want.num_layers &&
        file.first_head == want.first_head && file.num_heads == want.num_heads,
      where + "the snapshot holds layers " + range(file.first_layer, file.num_layers) +
        " and KV heads " + range(file.first_head, file.num_heads) +
        ", the target store's shard is layers " + range(want.first_layer, want.num_layers) +
        " and KV heads " + range(want.first_head, want.num_heads));
    INFERSCALE_EXPECTS(file.page_size == want.page_size,
                       where + "the snapshot has pages of " + std::to_string(file.page_size) +
                         " tokens, the target store " + std::to_string(want.page_size));
    INFERSCALE_EXPECTS(file.num_pages == want.num_pages,
                       where + "the snapshot has a capacity of " + std::to_string(file.num_pages) +
                         " pages, the target store " + std::to_string(want.num_pages));
  }
};

}  // namespace detail

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
 * @param[in] options memory kind of the pool; the store dtype (default: the file's; conversion
 * as store_load_options::store_dtype says)
 * @return the store: the file's configuration (memory and dtype as asked), every fact with its id,
 * namespace, token ids and pages, the namespaces' fact order, the free-page stack; pages in use
 * hold the file's bytes (converted if asked), free pages zeros
 * @throw logic_error naming the problem ("not an InferScale store snapshot", "format version 7 is
 * not supported (this build reads 1)", "truncated: expected N bytes, file has M", "checksum
 * mismatch", "page 3 is held twice", an I/O error with the path and the system's reason, ...)
 * @throw cuda_error when a device pool cannot be allocated or written
 * @note Peak host memory is the pool (host store) plus the catalogue and 8 MiB of staging.
 */
inline kv_store load_store(std::string const& path, store_load_options const& options = {})
{
  return detail::store_access::load(path, options.memory, options.store_dtype, nullptr);
}

/**
 * @brief Loads a store saved by save_store into a store configured as `target`: the file must
 * hold the same model geometry, the same shard (layer and head ranges, 0 counts resolved as
 * kv_store does), the same page size and capacity; the pool is converted to
 * `target.store_dtype` (as store_load_options::store_dtype) and placed in `target.memory`
 * (page-locked if `target.pinned`).
 *
 * @throw logic_error as the other overload, and naming both sides when the geometry, the shard,
 * the page size or the capacity differ (a snapshot of another shard is never re-sliced)
 */
inline kv_store load_store(std::string const& path, kv_store_config const& target)
{
  return detail::store_access::load(path, target.memory, target.store_dtype, &target);
}

}  // namespace inferscale
