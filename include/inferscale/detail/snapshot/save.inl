/**
 * @file detail/snapshot/save.inl
 * @brief Definitions for detail/snapshot/store_access.hpp: saving a store snapshot (save_store) in
 * the format of snapshot.hpp's file comment, atomically.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/cuda_error.hpp>  // the CUDA runtime, or its CPU-only stand-in
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
#include <string>
#include <vector>

namespace inferscale::detail {

inline void store_access::save(kv_store const& store, std::string const& path)
{
  std::string const who    = "save_store('" + path + "')";
  kv_store_config const& c = store.config();
  std::int64_t const P     = store.num_pages();
  std::size_t const B      = page_bytes(store);
  dtype const t            = store.store_dtype();
  // A compressed pool is written as bytes (codes, and scales in little-endian order).
  bool const compressed = c.compression != kv_compression::none;
  INFERSCALE_EXPECTS(!compressed || serial::host_is_little_endian(),
                     who + ": compressed stores are saved on little-endian hosts only");
  std::size_t const E                         = compressed ? 1 : size_of(t);
  std::vector<std::uint64_t> const namespaces = namespace_ids(store);

  // The catalogue, in memory first (it is small beside the pool) so its checksum is at hand.
  std::vector<unsigned char> catalogue;
  std::vector<std::uint64_t> owner(static_cast<std::size_t>(P), 0);
  std::vector<std::size_t> record_of(static_cast<std::size_t>(P), 0);  // catalogue order
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
        owner[static_cast<std::size_t>(p)]     = id;
        record_of[static_cast<std::size_t>(p)] = static_cast<std::size_t>(facts);
        used[static_cast<std::size_t>(p)]      = 1;
      }
      ++facts;
      tokens += r.token_ids.size();
      pages_in_use += r.pages.size();
    }
  }
  for (std::int64_t p : free_stack(store)) {
    append(p);
  }

  bool const device = store.space() == memory_space::device;
  std::size_t const pages_per_chunk =
    B == 0 ? 1 : std::max<std::size_t>(1, store_format::pool_chunk_bytes / B);
  std::vector<unsigned char> staging(
    device ? std::min(pages_per_chunk, static_cast<std::size_t>(P)) * B : 0);
  auto const* pool = static_cast<unsigned char const*>(store.ref().pool);
  // Calls visit(first page, page count, host bytes) for the pages in use, ascending, in runs of
  // consecutive pages (one copy from a device pool per run).
  auto const for_each_run = [&](auto&& visit) {
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
      unsigned char const* data = pool + static_cast<std::size_t>(p) * B;
      if (device) {
        INFERSCALE_CUDA_TRY(cudaMemcpy(staging.data(), data, n * B, cudaMemcpyDeviceToHost));
        data = staging.data();
      }
      visit(p, n, data);
      p = run_end;
    }
  };

  // The fact table (version 2): each fact's CRC-64 over its pages' little-endian bytes, ascending
  // page id (the order the file stores them), and the finiteness check: a pass over the pool
  // before the file is created (the catalogue, which holds the table, precedes the pages).
  std::vector<serial::crc64> fact_crc(static_cast<std::size_t>(facts));
  std::vector<unsigned char> little(serial::host_is_little_endian() ? 0 : B);
  for_each_run([&](std::int64_t first, std::size_t n, unsigned char const* data) {
    // A compressed page: codes and scales the store writes (first_bad_compressed_page).
    std::size_t const bad = compressed ? first_bad_compressed_page(data, n, c) * B / E
                                       : first_non_finite(data, n * B / E, t);
    INFERSCALE_EXPECTS(bad == n * B / E,
                       who + ": fact " +
                         std::to_string(owner[static_cast<std::size_t>(first) + bad * E / B]) +
                         (compressed ? " holds a code or a scale the store never writes (page "
                                     : " holds a non-finite value (page ") +
                         std::to_string(first + static_cast<std::int64_t>(bad * E / B)) +
                         "); a snapshot holds finite KV only, nothing was saved");
    for (std::size_t k = 0; k < n; ++k) {
      unsigned char const* page = data + k * B;
      if (!little.empty()) {
        serial::copy_little_endian(little.data(), page, B / E, E);
        page = little.data();
      }
      fact_crc[record_of[static_cast<std::size_t>(first) + k]].update(page, B);
    }
  });
  for (serial::crc64 const& c : fact_crc) {
    append(c.value());
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
  header[57] = static_cast<unsigned char>(c.compression);
  serial::put_le(header + 64, static_cast<std::uint64_t>(namespaces.size()));
  serial::put_le(header + 72, facts);
  serial::put_le(header + 80, tokens);
  serial::put_le(header + 88, pages_in_use);
  serial::put_le(header + store_format::header_fields,
                 serial::crc64_of(header, store_format::header_fields));

  (void)serial::write_file_atomically(path, who, true, [&](serial::checksummed_writer& out) {
    out.write(header, store_format::header_fields);
    out.write_excluded(header + store_format::header_fields, store_format::checksum_bytes);
    out.write(catalogue.data(), catalogue.size());
    unsigned char checksum[store_format::checksum_bytes];
    serial::put_le(checksum, serial::crc64_of(catalogue.data(), catalogue.size()));
    out.write_excluded(checksum, sizeof checksum);

    // The pages in use, ascending, in runs of consecutive pages (one write or copy per run).
    for_each_run([&](std::int64_t, std::size_t n, unsigned char const* data) {
      out.write_elements(data, n * B / E, E);  // little-endian whatever the host
    });
    serial::put_le(checksum, out.checksum());
    out.write_excluded(checksum, sizeof checksum);
  });
}

}  // namespace inferscale::detail
