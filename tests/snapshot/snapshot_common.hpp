// Test-side helpers of the snapshot tests: a scratch directory, file bytes, little-endian field
// access and a bit-at-a-time CRC-64/XZ written here from the format's definition (independent of
// detail/serialize.hpp), and a store built through the public API with a history that scrambles
// the free-page stack (erasures, a reuse, a reservation, an emptied namespace). Free of Catch
// macros.
#pragma once

#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

namespace inferscale_test::snapshot {

namespace fs = std::filesystem;

/// @brief A fresh directory under the system's temporary directory, removed on destruction.
class scratch_dir {
 public:
  scratch_dir()
  {
    std::random_device seed;
    path_ = fs::temp_directory_path() /
            ("inferscale-snapshot-" + std::to_string(seed()) + "-" + std::to_string(seed()));
    fs::create_directories(path_);
  }
  ~scratch_dir()
  {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  scratch_dir(scratch_dir const&)            = delete;
  scratch_dir& operator=(scratch_dir const&) = delete;
  std::string file(std::string const& name) const { return (path_ / name).string(); }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
};

inline std::vector<unsigned char> read_bytes(std::string const& path)
{
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(std::string const& path, std::vector<unsigned char> const& bytes)
{
  // a new file each time: rewriting a truncated one makes ext4 flush it on close (auto_da_alloc),
  // which turns the exhaustive corruption loops into thousands of synchronous writes
  std::error_code ignored;
  fs::remove(path, ignored);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

/// @brief CRC-64/XZ one bit at a time: reflected polynomial 0xC96C5795D7870F42, init and final
/// XOR all ones (check value of "123456789": 0x995DC9BBDF1939FA).
inline std::uint64_t reference_crc64(unsigned char const* p, std::size_t n)
{
  std::uint64_t r = ~std::uint64_t{0};
  for (std::size_t i = 0; i < n; ++i) {
    r ^= p[i];
    for (int b = 0; b < 8; ++b) {
      r = (r & 1u) != 0 ? (r >> 1) ^ 0xC96C5795D7870F42ull : r >> 1;
    }
  }
  return ~r;
}

template <class T>
T get(std::vector<unsigned char> const& b, std::size_t at)
{
  std::uint64_t v = 0;
  for (std::size_t i = sizeof(T); i-- > 0;) {
    v = (v << 8) | b.at(at + i);
  }
  return static_cast<T>(v);
}

template <class T>
void set(std::vector<unsigned char>& b, std::size_t at, T value)
{
  auto const v = static_cast<std::uint64_t>(value);
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    b.at(at + i) = static_cast<unsigned char>(v >> (8 * i));
  }
}

/// @brief Where the documented format puts things, from the header's fields (offsets of the
/// byte table in snapshot.hpp): catalogue = 16 N + 16 F + 4 T + 8 P from byte 104, then in
/// version 2 the fact table, 8 F.
struct layout {
  std::uint64_t namespaces, facts, tokens, pages_in_use, capacity;
  std::uint32_t version;
  std::size_t catalogue_begin{104};
  std::size_t fact_table_begin() const
  {
    return catalogue_begin +
           static_cast<std::size_t>(16 * namespaces + 16 * facts + 4 * tokens + 8 * capacity);
  }
  std::size_t catalogue_end() const
  {
    return fact_table_begin() + (version >= 2 ? static_cast<std::size_t>(8 * facts) : 0);
  }
  std::size_t pool_begin() const { return catalogue_end() + 8; }
};

inline layout layout_of(std::vector<unsigned char> const& file)
{
  return layout{get<std::uint64_t>(file, 64),
                get<std::uint64_t>(file, 72),
                get<std::uint64_t>(file, 80),
                get<std::uint64_t>(file, 88),
                static_cast<std::uint64_t>(get<std::int64_t>(file, 48)),
                get<std::uint32_t>(file, 8)};
}

/// @brief The file checksum as documented: CRC-64 of every byte before it except the header
/// checksum (bytes 96 .. 104) and the catalogue checksum (8 bytes after the catalogue).
inline std::uint64_t reference_file_checksum(std::vector<unsigned char> const& file)
{
  layout const l = layout_of(file);
  std::vector<unsigned char> covered(file.begin(), file.begin() + 96);
  covered.insert(covered.end(),
                 file.begin() + 104,
                 file.begin() + static_cast<std::ptrdiff_t>(l.catalogue_end()));
  covered.insert(covered.end(),
                 file.begin() + static_cast<std::ptrdiff_t>(l.catalogue_end() + 8),
                 file.end() - 8);
  return reference_crc64(covered.data(), covered.size());
}

/// @brief The fact table as documented (version 2), from the catalogue and the pool of `file`:
/// per fact in catalogue order, the CRC-64 of its pages' bytes in ascending page id; empty when
/// the catalogue does not describe a consistent file (a forged edit the loader must refuse).
inline std::vector<std::uint64_t> reference_fact_table(std::vector<unsigned char> const& file)
{
  try {
    layout const l = layout_of(file);
    std::vector<std::vector<std::int64_t>> facts;
    std::vector<std::int64_t> used;
    std::size_t at = l.catalogue_begin;
    for (std::uint64_t n = 0; n < l.namespaces; ++n) {
      std::uint64_t const count = get<std::uint64_t>(file, at + 8);
      at += 16;
      for (std::uint64_t f = 0; f < count && facts.size() <= l.facts; ++f) {
        std::int32_t const tokens  = get<std::int32_t>(file, at + 8);
        std::uint32_t const npages = get<std::uint32_t>(file, at + 12);
        if (tokens < 0) { return {}; }
        at += 16 + 4 * static_cast<std::size_t>(tokens);
        std::vector<std::int64_t> pages;
        for (std::uint32_t j = 0; j < npages; ++j, at += 8) {
          pages.push_back(get<std::int64_t>(file, at));
        }
        used.insert(used.end(), pages.begin(), pages.end());
        facts.push_back(std::move(pages));
      }
    }
    if (facts.size() != l.facts || used.size() != l.pages_in_use || used.empty()) { return {}; }
    std::sort(used.begin(), used.end());
    std::size_t const pool = l.pool_begin();
    if (file.size() < pool + 8) { return {}; }
    std::size_t const B = (file.size() - pool - 8) / used.size();
    std::vector<std::uint64_t> table;
    for (std::vector<std::int64_t> pages : facts) {
      std::sort(pages.begin(), pages.end());
      std::vector<unsigned char> bytes;
      for (std::int64_t p : pages) {
        std::size_t const rank =
          static_cast<std::size_t>(std::lower_bound(used.begin(), used.end(), p) - used.begin());
        std::size_t const from = pool + rank * B;
        if (from + B > file.size()) { return {}; }
        bytes.insert(bytes.end(),
                     file.begin() + static_cast<std::ptrdiff_t>(from),
                     file.begin() + static_cast<std::ptrdiff_t>(from + B));
      }
      table.push_back(reference_crc64(bytes.data(), bytes.size()));
    }
    return table;
  } catch (std::exception const&) {
    return {};
  }
}

/// @brief Recomputes the checksums after a deliberate edit (a forged but valid file): the fact
/// table (version 2, when the catalogue is consistent), the header's, the catalogue's, the file's.
inline void refresh_checksums(std::vector<unsigned char>& file)
{
  layout const l = layout_of(file);
  if (l.version >= 2) {
    std::vector<std::uint64_t> const table = reference_fact_table(file);
    for (std::size_t i = 0; i < table.size(); ++i) {
      set(file, l.fact_table_begin() + 8 * i, table[i]);
    }
  }
  set(file, 96, reference_crc64(file.data(), 96));
  set(file,
      l.catalogue_end(),
      reference_crc64(file.data() + l.catalogue_begin, l.catalogue_end() - l.catalogue_begin));
  set(file, file.size() - 8, reference_file_checksum(file));
}

/// @brief A version-1 file of the same store: the fact table removed, the version set to 1, the
/// checksums recomputed (what a build before version 2 wrote).
inline std::vector<unsigned char> to_version_1(std::vector<unsigned char> file)
{
  layout const l = layout_of(file);
  file.erase(file.begin() + static_cast<std::ptrdiff_t>(l.fact_table_begin()),
             file.begin() + static_cast<std::ptrdiff_t>(l.catalogue_end()));
  set(file, 8, std::uint32_t{1});
  refresh_checksums(file);
  return file;
}

/// @brief The model of the tests: 3 layers, 4 KV heads, head_dim 4; the store holds the shard
/// layers [1, 3), heads [1, 3), so the shard fields are exercised.
inline inferscale::kv_store_config shard_config(
  inferscale::dtype t,
  std::int64_t pages,
  inferscale::memory_space space = inferscale::memory_space::host)
{
  inferscale::kv_store_config c;
  c.model       = inferscale::kv_geometry{3, 4, 4};
  c.first_layer = 1;
  c.num_layers  = 2;
  c.first_head  = 1;
  c.num_heads   = 2;
  c.store_dtype = t;
  c.page_size   = 4;
  c.num_pages   = pages;
  c.space       = space;
  return c;
}

/// @brief Inserts fact `id` of `tokens` tokens: whole-model views (3 layers, 4 heads) of values
/// drawn from a generator seeded with the id, in [-3, 3); token ids 100 id + t.
inline void insert_fact(inferscale::kv_store& store,
                        std::uint64_t id,
                        std::uint64_t ns,
                        std::int64_t tokens,
                        std::vector<float> const* values_override = nullptr)
{
  std::int64_t const n = 3 * tokens * 4 * 4;
  std::vector<float> k(static_cast<std::size_t>(n)), v(static_cast<std::size_t>(n));
  std::mt19937_64 rng(id * 7919 + 13);
  std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = values_override ? (*values_override)[i % values_override->size()] : dist(rng);
    v[i] = values_override ? -(*values_override)[(i + 1) % values_override->size()] : dist(rng);
  }
  std::vector<std::int32_t> token_ids;
  for (std::int64_t t = 0; t < tokens; ++t) {
    token_ids.push_back(static_cast<std::int32_t>(100 * id + static_cast<std::uint64_t>(t)));
  }
  store.insert<float>(id,
                      ns,
                      token_ids,
                      inferscale::make_fact_kv_view<float const>(k.data(), 3, tokens, 4, 4),
                      inferscale::make_fact_kv_view<float const>(v.data(), 3, tokens, 4, 4));
}

/// @brief The ids the scrambled history leaves, and its namespaces (plus ones it emptied).
inline std::vector<std::uint64_t> const scrambled_ids{10, 12, 14, 15, 16, 0};
inline std::vector<std::uint64_t> const scrambled_namespaces{0, 1, 2, 3, 5, 99};

/// @brief A store whose history scrambles the free-page stack: inserts, erasures (one page
/// reused, stale bytes left in free pages), a namespace emptied, a reservation (its pages keep
/// whatever they held), fact id 0.
inline inferscale::kv_store scrambled_store(
  inferscale::dtype t, inferscale::memory_space space = inferscale::memory_space::host)
{
  inferscale::kv_store store{shard_config(t, 16, space)};
  insert_fact(store, 10, 1, 5);  // 2 pages
  insert_fact(store, 11, 2, 3);  // 1
  insert_fact(store, 12, 1, 9);  // 3
  insert_fact(store, 13, 3, 1);  // 1
  insert_fact(store, 14, 2, 4);  // 1
  store.erase(11);
  insert_fact(store, 15, 1, 6);  // 2: takes 11's page, then a fresh one
  store.erase(13);               // namespace 3 is empty now; its page keeps stale bytes
  (void)store.reserve(16, 0, std::vector<std::int32_t>{7, 8});  // takes 13's page
  insert_fact(store, 0, 5, 2);                                  // 1
  store.erase(10);               // two stale free pages on top of the stack
  insert_fact(store, 10, 1, 3);  // id 10 again, now 1 page: one stale page stays free
  return store;
}

/// @brief Pages of every fact of `ids` (the pages in use).
inline std::vector<char> used_pages(inferscale::kv_store const& store,
                                    std::vector<std::uint64_t> const& ids)
{
  std::vector<char> used(static_cast<std::size_t>(store.num_pages()), 0);
  for (std::uint64_t id : ids) {
    for (std::int64_t p : store.at(id).pages) {
      used[static_cast<std::size_t>(p)] = 1;
    }
  }
  return used;
}

}  // namespace inferscale_test::snapshot
