/**
 * @file detail/snapshot/load.inl
 * @brief Definitions for detail/snapshot/store_access.hpp: loading a store snapshot (load_store)
 * and the checks of snapshot.hpp's file comment, in their order: the header, the catalogue, the
 * target, then the pool while it is read.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/cuda_error.hpp>  // the CUDA runtime, or its CPU-only stand-in
#include <inferscale/detail/math.hpp>
#include <inferscale/detail/serialize.hpp>
#include <inferscale/detail/snapshot/format.hpp>
#include <inferscale/detail/snapshot/store_access.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale::detail {

inline store_access::parsed_header store_access::parse_header(unsigned char const* h,
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
  INFERSCALE_EXPECTS(version >= store_format::oldest_version && version <= store_format::version,
                     where + "format version " + std::to_string(version) +
                       " is not supported (this build reads " +
                       std::to_string(store_format::oldest_version) + " to " +
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
  r.version                      = version;
  kv_store_config& c             = r.config;
  c.model.num_layers             = serial::get_le<std::int32_t>(h + 16);
  c.model.num_kv_heads           = serial::get_le<std::int32_t>(h + 20);
  c.model.head_dim               = serial::get_le<std::int32_t>(h + 24);
  c.first_layer                  = serial::get_le<std::int32_t>(h + 28);
  c.num_layers                   = serial::get_le<std::int32_t>(h + 32);
  c.first_head                   = serial::get_le<std::int32_t>(h + 36);
  c.num_heads                    = serial::get_le<std::int32_t>(h + 40);
  c.page_size                    = serial::get_le<std::int32_t>(h + 44);
  c.num_pages                    = serial::get_le<std::int64_t>(h + 48);
  std::uint8_t const code        = h[56];
  r.namespaces                   = serial::get_le<std::uint64_t>(h + 64);
  r.facts                        = serial::get_le<std::uint64_t>(h + 72);
  r.tokens                       = serial::get_le<std::uint64_t>(h + 80);
  r.pages_in_use                 = serial::get_le<std::uint64_t>(h + 88);
  bool reserved_zero             = true;
  std::uint8_t const compression = h[57];
  for (std::size_t b = 58; b < 64; ++b) {
    reserved_zero = reserved_zero && h[b] == 0;
  }
  INFERSCALE_EXPECTS(reserved_zero, where + "header: reserved bytes are not zero");
  INFERSCALE_EXPECTS(code <= 2, where + "header: unknown store dtype code " + std::to_string(code));
  c.store_dtype = code == 0 ? dtype::float32 : code == 1 ? dtype::float16 : dtype::bfloat16;
  INFERSCALE_EXPECTS(compression <= 2,
                     where + "header: unknown compression code " + std::to_string(compression));
  c.compression = static_cast<kv_compression>(compression);
  INFERSCALE_EXPECTS(c.compression == kv_compression::none || serial::host_is_little_endian(),
                     where + "compressed snapshots are read on little-endian hosts only");

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
  // page bytes = 2 * L * page_size * H * D * E (compressed: L * the layer's blocks,
  // compression.hpp); the pool P * page bytes must fit in an int64
  std::uint64_t page = 0;
  bool ok            = false;
  if (c.compression == kv_compression::none) {
    ok = serial::multiply_add(2u * static_cast<std::uint64_t>(c.num_layers),
                              static_cast<std::uint64_t>(c.page_size),
                              0,
                              page) &&
         serial::multiply_add(page, static_cast<std::uint64_t>(c.num_heads), 0, page) &&
         serial::multiply_add(page, static_cast<std::uint64_t>(c.model.head_dim), 0, page) &&
         serial::multiply_add(page, size_of(c.store_dtype), 0, page);
  } else {
    // Each factor below is an int32 read from the header: bound them before the layout's
    // arithmetic (int64), then multiply by the layer count with the overflow check.
    ok = c.page_size > 0 && c.num_heads > 0 && c.model.head_dim > 0 &&
         c.model.head_dim <= compressed_max_head_dim && c.page_size <= (1 << 20) &&
         c.num_heads <= (1 << 16) &&
         serial::multiply_add(static_cast<std::uint64_t>(compressed_block_layout{
                                c.page_size, c.num_heads, c.model.head_dim, c.compression}
                                                           .layer_bytes()),
                              static_cast<std::uint64_t>(std::max(c.num_layers, 0)),
                              0,
                              page);
  }
  std::uint64_t pool = 0;
  ok = ok && serial::multiply_add(page, static_cast<std::uint64_t>(c.num_pages), 0, pool) &&
       pool <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  INFERSCALE_EXPECTS(ok,
                     where + "header: a pool of " + std::to_string(c.num_pages) +
                       " pages of this geometry overflows a 64-bit byte count");
  r.page_bytes          = page;
  std::uint64_t const P = static_cast<std::uint64_t>(c.num_pages);
  INFERSCALE_EXPECTS(r.namespaces <= r.facts && r.facts <= r.pages_in_use && r.pages_in_use <= P &&
                       r.facts <= r.tokens,
                     where +
                       "header: counts break namespaces <= facts <= pages in use <= "
                       "capacity and facts <= tokens (" +
                       std::to_string(r.namespaces) + ", " + std::to_string(r.facts) + ", " +
                       std::to_string(r.pages_in_use) + ", " + std::to_string(P) + "; " +
                       std::to_string(r.tokens) + " tokens)");
  // catalogue = 16 N + 16 F + 4 T + 8 P (+ 8 F, version 2); file = 104 + catalogue + 8 + U B + 8
  std::uint64_t const fact_record_bytes =
    store_format::fact_bytes + (version >= 2 ? store_format::fact_checksum_bytes : 0);
  std::uint64_t catalogue = 0, file = 0;
  ok = serial::multiply_add(r.namespaces, store_format::namespace_bytes, 0, catalogue) &&
       serial::multiply_add(r.facts, fact_record_bytes, catalogue, catalogue) &&
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

inline store_access::staged_catalogue store_access::parse_catalogue(
  std::vector<unsigned char> const& bytes, parsed_header const& h, std::string const& where)
{
  staged_catalogue s;
  std::int64_t const P   = h.config.num_pages;
  std::int32_t const ps  = h.config.page_size;
  unsigned char const* p = bytes.data();
  std::vector<char> seen(static_cast<std::size_t>(P), 0);    // held by a fact or free
  std::vector<char> in_use(static_cast<std::size_t>(P), 0);  // held by a fact
  s.page_owner.assign(static_cast<std::size_t>(P), 0);
  s.page_record.assign(static_cast<std::size_t>(P), 0);
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
      std::uint64_t const expected_pages = detail::ceil_div(static_cast<std::uint64_t>(length), ps);
      INFERSCALE_EXPECTS(npages == expected_pages,
                         where + fact + ": " + std::to_string(npages) + " pages for " +
                           std::to_string(length) + " tokens, expected ceil(" +
                           std::to_string(length) + " / " + std::to_string(ps) +
                           ") = " + std::to_string(expected_pages));
      INFERSCALE_EXPECTS(
        static_cast<std::uint64_t>(length) <= h.tokens - tokens && npages <= h.pages_in_use - pages,
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
        s.page_owner[static_cast<std::size_t>(page)]  = r.fact_id;
        s.page_record[static_cast<std::size_t>(page)] = s.records.size();
        in_use[static_cast<std::size_t>(page)]        = 1;
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
  if (h.version >= 2) {  // the fact table: one checksum per fact, in catalogue order
    s.fact_checksums.resize(static_cast<std::size_t>(facts));
    serial::copy_little_endian(s.fact_checksums.data(), p, s.fact_checksums.size(), 8);
    p += store_format::fact_checksum_bytes * s.fact_checksums.size();
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

inline bool store_access::incremental_source(kv_store const* previous,
                                             kv_store_config const& file,
                                             staged_catalogue const& staged)
{
  if (previous == nullptr || staged.fact_checksums.size() != staged.records.size() ||
      !serial::host_is_little_endian()) {
    return false;
  }
  kv_store_config const& p = previous->config();
  // the same page layout [L][2][page_size][H][head_dim]; the dtype may differ (not when compressed)
  return p.compression == file.compression &&
         (file.compression == kv_compression::none || p.store_dtype == file.store_dtype) &&
         p.model == file.model && p.first_layer == file.first_layer &&
         p.num_layers == file.num_layers && p.first_head == file.first_head &&
         p.num_heads == file.num_heads && p.page_size == file.page_size;
}

inline kv_store store_access::load(std::string const& path,
                                   memory_space space,
                                   std::optional<dtype> store_dtype,
                                   kv_store_config const* expect,
                                   kv_store const* previous)
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
  target.space           = space;
  target.pinned          = expect != nullptr && expect->pinned;  // placement, not content
  target.resource        = expect != nullptr ? expect->resource : nullptr;  // placement too
  target.store_dtype     = store_dtype.value_or(fc.store_dtype);
  INFERSCALE_EXPECTS(fc.compression == kv_compression::none || target.store_dtype == fc.store_dtype,
                     where + "the snapshot is compressed (" + to_string(fc.compression) +
                       ", dequantized to " + to_string(fc.store_dtype) +
                       "); it loads in its own dtype, not " + to_string(target.store_dtype));
  INFERSCALE_EXPECTS(target.store_dtype == dtype::float32 || target.store_dtype == dtype::float16 ||
                       target.store_dtype == dtype::bfloat16,
                     where + "the target dtype must be float32, float16 or bfloat16, got " +
                       to_string(target.store_dtype));
  if (expect != nullptr) { check_target(fc, *expect, where); }

  // The zeroed pool, handed out only once every check below has passed. The file's capacity
  // sizes it: a capacity the host cannot hold is refused as the file's, naming the bytes (a
  // bare bad_alloc, or length_error from the free-page stack, would name nothing).
  kv_store store = [&] {
    try {
      return kv_store{target};
    } catch (std::bad_alloc const&) {
    } catch (std::length_error const&) {
    }
    INFERSCALE_FAIL(where + "the store the file describes (" + std::to_string(fc.num_pages) +
                    " pages of " + std::to_string(header.page_bytes) +
                    " bytes, before any conversion) cannot be allocated");
  }();
  dtype const from      = fc.store_dtype;
  dtype const to        = target.store_dtype;
  std::size_t const B   = static_cast<std::size_t>(header.page_bytes);
  bool const compressed = fc.compression != kv_compression::none;
  // A compressed pool is bytes (codes and scales, little-endian), checked page by page.
  std::size_t const Ef  = compressed ? 1 : size_of(from);
  std::size_t const Eto = compressed ? 1 : size_of(to);
  std::size_t const Bto = B / Ef * Eto;
  std::size_t const per_chunk =
    B == 0 ? 1 : std::max<std::size_t>(1, store_format::pool_chunk_bytes / B);
  bool const device = space == memory_space::device;
  bool const direct = !device && from == to && serial::host_is_little_endian();
  auto* const pool  = static_cast<unsigned char*>(store.ref().pool);
  std::vector<unsigned char> raw(direct ? 0 : std::min(staged.used_pages.size(), per_chunk) * B);
  std::vector<unsigned char> converted(device && from != to ? raw.size() / Ef * Eto : 0);
  std::vector<std::int64_t> const& used = staged.used_pages;

  // Takes n consecutive pages from `first`, `source` holding their bytes in the file's dtype and
  // host order (the destination itself when `direct`), into the pool: the finiteness check, the
  // conversion (and its overflow check), the copy to the device. Returns the first problem found,
  // or "": problems in the pool are reported after the checksums, which name corruption first.
  auto const accept =
    [&](unsigned char const* source, std::size_t first, std::size_t n) -> std::string {
    std::string problem;
    std::size_t const elements = n * B / Ef;
    std::size_t const bad      = compressed ? first_bad_compressed_page(source, n, fc) * B
                                            : first_non_finite(source, elements, from);
    if (compressed && bad != elements) {
      std::size_t const page = first + bad / B;
      problem                = "fact " + std::to_string(staged.page_owner[page]) +
                " holds a code or a scale this library never writes (page " + std::to_string(page) +
                ": a NaN code, the int4 code -8, or a non-finite scale)";
    } else if (bad != elements) {
      std::size_t const page = first + bad * Ef / B;
      problem                = "fact " + std::to_string(staged.page_owner[page]) +
                " holds a non-finite value (page " + std::to_string(page) + ")";
    }
    unsigned char* const dst   = pool + first * Bto;
    unsigned char const* ready = source;
    if (from != to) {
      unsigned char* const out   = device ? converted.data() : dst;
      std::size_t const overflow = convert_elements(source, from, out, to, elements);
      if (overflow != elements && problem.empty()) {
        std::size_t const page = first + overflow * Ef / B;
        problem                = "fact " + std::to_string(staged.page_owner[page]) + " (page " +
                  std::to_string(page) + ") holds a value that overflows " + to_string(to) +
                  " (largest finite " + (to == dtype::float16 ? "65504" : "3.39e38") +
                  "); load it into a wider dtype";
      }
      ready = out;
    }
    if (device) { INFERSCALE_CUDA_TRY(cudaMemcpy(dst, ready, n * Bto, cudaMemcpyHostToDevice)); }
    return problem;
  };
  auto const fact_mismatch = [&](std::size_t record, std::uint64_t actual) {
    return where + "fact " + std::to_string(staged.records[record].fact_id) +
           ": checksum mismatch of its pages: stored " +
           serial::hex(staged.fact_checksums[record]) + ", computed " + serial::hex(actual) +
           " (the file is corrupted)";
  };

  std::string pool_problem;
  if (incremental_source(previous, fc, staged)) {
    // Only what changed is read. Each fact's pages come from `previous` (same id, tokens and page
    // count: its pages' bytes, in the file's dtype, checked against the fact table), else from
    // the file (pread of the fact's pages, checked against the fact table); the file checksum,
    // which would need every byte, is not recomputed.
    std::uint64_t const pool_offset =
      store_format::header_bytes + header.catalogue_bytes + store_format::checksum_bytes;
    kv_store const& prev    = *previous;
    dtype const prev_dtype  = prev.store_dtype();
    std::size_t const Bprev = compressed ? B : B / Ef * size_of(prev_dtype);
    bool const prev_device  = prev.space() == memory_space::device;
    auto const* const ppool = static_cast<unsigned char const*>(prev.ref().pool);
    // one page of each, only when a fact needs it (a file without facts may state any page size)
    bool const any_fact = !staged.records.empty();
    std::vector<unsigned char> page_buffer(any_fact && !direct ? B : 0);
    std::vector<unsigned char> prev_staging(any_fact && prev_device ? Bprev : 0);
    std::vector<std::pair<std::int64_t, std::size_t>> order;  // (page, token-order index)
    for (std::size_t i = 0; i < staged.records.size(); ++i) {
      fact_record const& r = staged.records[i];
      order.clear();
      for (std::size_t j = 0; j < r.pages.size(); ++j) {
        order.emplace_back(r.pages[j], j);
      }
      std::sort(order.begin(), order.end());  // the file's order: ascending page id
      if (prev.contains(r.fact_id)) {
        fact_record const& pr = prev.at(r.fact_id);
        if (pr.token_ids == r.token_ids && pr.pages.size() == r.pages.size()) {
          serial::crc64 crc;
          std::string problem;
          for (auto const& [page, j] : order) {
            std::size_t const first        = static_cast<std::size_t>(page);
            unsigned char const* from_prev = ppool + static_cast<std::size_t>(pr.pages[j]) * Bprev;
            if (prev_device) {
              INFERSCALE_CUDA_TRY(
                cudaMemcpy(prev_staging.data(), from_prev, Bprev, cudaMemcpyDeviceToHost));
              from_prev = prev_staging.data();
            }
            unsigned char* const into = direct ? pool + first * Bto : page_buffer.data();
            if (prev_dtype == from) {
              std::memcpy(into, from_prev, B);
            } else {  // back to the file's dtype; the fact table decides whether that is its bytes
              (void)convert_elements(from_prev, prev_dtype, into, from, B / Ef);
            }
            crc.update(into, B);
            std::string p = accept(into, first, 1);
            if (problem.empty()) { problem = std::move(p); }
          }
          if (crc.value() == staged.fact_checksums[i]) {
            if (pool_problem.empty()) { pool_problem = std::move(problem); }
            continue;
          }
          // previous holds other bytes under this id: read the file's
        }
      }
      serial::crc64 crc;
      std::size_t k = 0;
      while (k < order.size()) {
        // a run: consecutive in the file (rank) and in the pool (page id), at most per_chunk
        std::size_t run_end = k + 1;
        while (run_end < order.size() && order[run_end].first == order[run_end - 1].first + 1 &&
               run_end - k < per_chunk) {
          ++run_end;
        }
        std::size_t const n     = run_end - k;
        std::size_t const first = static_cast<std::size_t>(order[k].first);
        std::size_t const rank  = static_cast<std::size_t>(
          std::lower_bound(used.begin(), used.end(), order[k].first) - used.begin());
        // consecutive page ids in use are consecutive ranks too
        unsigned char* const into = direct ? pool + first * Bto : raw.data();
        in.read_at(into, n * B, pool_offset + static_cast<std::uint64_t>(rank) * B);
        crc.update(into, n * B);
        std::string p = accept(into, first, n);
        if (pool_problem.empty()) { pool_problem = std::move(p); }
        k = run_end;
      }
      INFERSCALE_EXPECTS(crc.value() == staged.fact_checksums[i], fact_mismatch(i, crc.value()));
    }
  } else {
    // The whole pool, front to back, in runs of consecutive pages.
    std::vector<serial::crc64> fact_crc(staged.fact_checksums.size());  // version 2
    std::size_t i = 0;
    while (i < used.size()) {
      std::size_t run_end = i + 1;
      while (run_end < used.size() && used[run_end] == used[run_end - 1] + 1 &&
             run_end - i < per_chunk) {
        ++run_end;
      }
      std::size_t const n     = run_end - i;
      std::size_t const first = static_cast<std::size_t>(used[i]);
      unsigned char* source   = direct ? pool + first * Bto : raw.data();
      in.read(source, n * B);
      for (std::size_t k = 0; k < n && !fact_crc.empty(); ++k) {  // little-endian bytes
        fact_crc[staged.page_record[first + k]].update(source + k * B, B);
      }
      if (!serial::host_is_little_endian()) { to_host_order(source, n * B / Ef, Ef); }
      std::string p = accept(source, first, n);
      if (pool_problem.empty()) { pool_problem = std::move(p); }
      i = run_end;
    }
    std::uint64_t const file_actual = in.checksum();
    in.read_excluded(checksum, sizeof checksum);
    std::uint64_t const file_stored = serial::get_le<std::uint64_t>(checksum);
    INFERSCALE_EXPECTS(file_stored == file_actual,
                       where + "checksum mismatch: stored " + serial::hex(file_stored) +
                         ", computed " + serial::hex(file_actual) + " (the file is corrupted)");
    for (std::size_t r = 0; r < fact_crc.size(); ++r) {
      // the file checksum holds, so only a writer could have put a wrong fact checksum here
      INFERSCALE_EXPECTS(fact_crc[r].value() == staged.fact_checksums[r],
                         fact_mismatch(r, fact_crc[r].value()));
    }
  }
  INFERSCALE_EXPECTS(pool_problem.empty(), where + pool_problem);

  restore(store, std::move(staged));
  return store;
}

inline void store_access::check_target(kv_store_config const& file,
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
  INFERSCALE_EXPECTS(file.compression == want.compression,
                     where + "the snapshot's compression is " + to_string(file.compression) +
                       ", the target store's " + to_string(want.compression));
  INFERSCALE_EXPECTS(file.page_size == want.page_size,
                     where + "the snapshot has pages of " + std::to_string(file.page_size) +
                       " tokens, the target store " + std::to_string(want.page_size));
  INFERSCALE_EXPECTS(file.num_pages == want.num_pages,
                     where + "the snapshot has a capacity of " + std::to_string(file.num_pages) +
                       " pages, the target store " + std::to_string(want.num_pages));
}

}  // namespace inferscale::detail
