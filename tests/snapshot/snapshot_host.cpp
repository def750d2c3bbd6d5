// Host tests of store snapshots (inferscale/snapshot.hpp): save_store / load_store.
//
// Expectations are written here, not taken from the code under test:
//  - the file is decoded field by field from the byte table of snapshot.hpp (offsets, sizes, the
//    length formula 120 + 16 N + 24 F + 4 T + 8 P + U B), its checksums recomputed with a
//    bit-at-a-time CRC-64/XZ (snapshot_common.hpp);
//  - round trips compare the loaded store with the original through the public API (records,
//    namespace order, free pages taken by the next insert, pool bytes) and the saved bytes;
//  - conversions are checked against round-to-nearest-even references written here (a
//    nearest-code search for binary16, the two bfloat16 neighbours of an exact value);
//  - every single-byte corruption and every truncation of small files is refused; forged files
//    with recomputed checksums are refused by the consistency checks.
#include "snapshot_common.hpp"

#include <inferscale/compose.hpp>
#include <inferscale/error.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::snapshot;
using Catch::Matchers::Contains;

namespace {

std::size_t element_bytes(dtype t) { return t == dtype::float32 ? 4 : 2; }

/// B = 2 * L * page_size * H * D * E of the shard store of the tests (L = 2, H = 2, D = 4).
std::size_t page_bytes(dtype t, std::int32_t page_size = 4)
{
  return 2u * 2u * static_cast<std::size_t>(page_size) * 2u * 4u * element_bytes(t);
}

std::string load_error(std::string const& path, store_load_options const& o = {})
{
  try {
    (void)load_store(path, o);
  } catch (logic_error const& e) {
    return e.what();
  }
  return {};
}

std::string save_error(kv_store const& store, std::string const& path)
{
  try {
    save_store(store, path);
  } catch (logic_error const& e) {
    return e.what();
  }
  return {};
}

/// The loaded store equals the original through the public API: configuration (memory and
/// dtype aside), every record, every namespace's order, the free count; pages in use byte for
/// byte, free pages zero in the loaded store.
void require_same_store(kv_store const& original,
                        kv_store const& loaded,
                        std::vector<std::uint64_t> const& ids,
                        bool same_dtype = true)
{
  kv_store_config const& a = original.config();
  kv_store_config const& b = loaded.config();
  REQUIRE(a.model == b.model);
  REQUIRE(a.first_layer == b.first_layer);
  REQUIRE(a.num_layers == b.num_layers);
  REQUIRE(a.first_head == b.first_head);
  REQUIRE(a.num_heads == b.num_heads);
  REQUIRE(a.page_size == b.page_size);
  REQUIRE(a.num_pages == b.num_pages);
  REQUIRE(original.num_facts() == loaded.num_facts());
  REQUIRE(original.free_pages() == loaded.free_pages());
  for (std::uint64_t id : ids) {
    CAPTURE(id);
    REQUIRE(loaded.contains(id));
    fact_record const& x = original.at(id);
    fact_record const& y = loaded.at(id);
    CHECK(x.namespace_id == y.namespace_id);
    CHECK(x.token_ids == y.token_ids);
    CHECK(x.pages == y.pages);
  }
  for (std::uint64_t ns : scrambled_namespaces) {
    CAPTURE(ns);
    CHECK(original.namespace_fact_ids(ns) == loaded.namespace_fact_ids(ns));
    CHECK(original.namespace_pages(ns) == loaded.namespace_pages(ns));
    if (same_dtype) { CHECK(original.namespace_bytes(ns) == loaded.namespace_bytes(ns)); }
  }
  if (!same_dtype) { return; }
  std::vector<unsigned char> const pa = original.pool_to_host();
  std::vector<unsigned char> const pb = loaded.pool_to_host();
  REQUIRE(pa.size() == pb.size());
  std::size_t const B        = pa.size() / static_cast<std::size_t>(original.num_pages());
  std::vector<char> const in = used_pages(original, ids);
  for (std::size_t p = 0; p < in.size(); ++p) {
    CAPTURE(p);
    auto const first = static_cast<std::ptrdiff_t>(p * B);
    auto const last  = static_cast<std::ptrdiff_t>((p + 1) * B);
    if (in[p] != 0) {
      CHECK(std::equal(pa.begin() + first, pa.begin() + last, pb.begin() + first));
    } else {
      CHECK(
        std::all_of(pb.begin() + first, pb.begin() + last, [](unsigned char c) { return c == 0; }));
    }
  }
}

/// A small store (8 pages, 3 facts in 2 namespaces, one erasure) for the exhaustive loops.
kv_store small_store(dtype t)
{
  kv_store store{shard_config(t, 8)};
  insert_fact(store, 3, 1, 2);
  insert_fact(store, 4, 2, 5);
  insert_fact(store, 5, 1, 1);
  store.erase(5);
  insert_fact(store, 6, 1, 3);
  return store;
}

// Element formats, from their specifications.
double decode_half(std::uint16_t bits)
{
  int const e    = (bits >> 10) & 31;
  int const m    = bits & 1023;
  double const v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
  return (bits & 0x8000u) ? -v : v;
}
double decode_bf16(std::uint16_t bits)
{
  std::uint32_t const wide = std::uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}
double decode(unsigned char const* p, dtype t)
{
  if (t == dtype::float32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  return t == dtype::float16 ? decode_half(b) : decode_bf16(b);
}

// Round-to-nearest-even references (finite, in range: the tests keep |x| below 65504).
std::uint16_t rne_half(double x)
{
  static std::vector<double> const codes = [] {
    std::vector<double> c;
    for (std::uint32_t b = 0; b <= 0x7bffu; ++b) {
      c.push_back(decode_half(static_cast<std::uint16_t>(b)));
    }
    return c;
  }();
  std::uint16_t const sign = std::signbit(x) ? 0x8000u : 0u;
  double const a           = std::fabs(x);
  auto const it            = std::lower_bound(codes.begin(), codes.end(), a);
  std::size_t const hi     = static_cast<std::size_t>(it - codes.begin());
  if (hi == codes.size()) { return static_cast<std::uint16_t>(sign | 0x7bffu); }  // (65504, 65520)
  if (hi == 0 || codes[hi] == a) { return static_cast<std::uint16_t>(sign | hi); }
  std::size_t const lo = hi - 1;
  double const dlo = a - codes[lo], dhi = codes[hi] - a;
  std::size_t const pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  return static_cast<std::uint16_t>(sign | pick);
}
std::uint16_t rne_bf16(double x)
{
  // the two bf16 neighbours of x share the top bits of float(x) truncated toward zero
  float const f = static_cast<float>(x);  // exact: the tests' x are float values
  REQUIRE(static_cast<double>(f) == x);
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  std::uint16_t const down = static_cast<std::uint16_t>(bits >> 16);
  std::uint16_t const up   = static_cast<std::uint16_t>(down + 1);
  double const a = std::fabs(x), dd = a - std::fabs(decode_bf16(down)),
               du = std::fabs(decode_bf16(up)) - a;
  if (dd == 0) { return down; }
  return dd < du ? down : du < dd ? up : (down % 2 == 0 ? down : up);
}

}  // namespace

// ------------------------------------------------------------------------------------------------

TEST_CASE("snapshot: the checksum is CRC-64/XZ, folded or by tables", "[snapshot]")
{
  namespace serial = detail::serial;
  auto const check = reinterpret_cast<unsigned char const*>("123456789");
  REQUIRE(reference_crc64(check, 9) == 0x995DC9BBDF1939FAull);  // the published check value
  REQUIRE(serial::crc64_of(check, 9) == 0x995DC9BBDF1939FAull);
  std::mt19937_64 rng(17);
  std::vector<unsigned char> data(70001);
  for (auto& x : data) {
    x = static_cast<unsigned char>(rng());
  }
  // lengths around the folding's steps (64-byte loop, 16-byte blocks, the 256-byte threshold)
  for (std::size_t n : {0,   1,   15,  16,  63,  64,   65,   127,  128,   255,
                        256, 257, 271, 319, 320, 1000, 4096, 4109, 65537, 70000}) {
    for (std::size_t offset : {0, 1, 7}) {
      CAPTURE(n, offset);
      unsigned char const* p   = data.data() + offset;
      std::uint64_t const want = reference_crc64(p, n);
      REQUIRE(serial::crc64_of(p, n) == want);
      REQUIRE(serial::crc64_by_tables(p, n) == want);
      serial::crc64 pieces;  // uneven incremental updates, some folded, some by tables
      std::size_t const a = n / 5, b = n / 2;
      pieces.update(p, a);
      pieces.update(p + a, b - a);
      pieces.update(p + b, n - b);
      REQUIRE(pieces.value() == want);
    }
  }
}

TEST_CASE("snapshot: the file follows the documented byte table", "[snapshot]")
{
  scratch_dir dir;
  dtype const t = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_store const store   = scrambled_store(t);
  std::string const path = dir.file("store.iskv");
  save_store(store, path);
  std::vector<unsigned char> const f = read_bytes(path);

  // identification and header fields
  unsigned char const magic[8] = {0x89, 'I', 'S', 'K', 'V', 'S', 0x0D, 0x0A};
  REQUIRE(std::equal(magic, magic + 8, f.begin()));
  CHECK(get<std::uint32_t>(f, 8) == 2);
  CHECK(f[12] == 0x04);
  CHECK(f[13] == 0x03);
  CHECK(f[14] == 0x02);
  CHECK(f[15] == 0x01);
  CHECK(get<std::int32_t>(f, 16) == 3);
  CHECK(get<std::int32_t>(f, 20) == 4);
  CHECK(get<std::int32_t>(f, 24) == 4);
  CHECK(get<std::int32_t>(f, 28) == 1);
  CHECK(get<std::int32_t>(f, 32) == 2);
  CHECK(get<std::int32_t>(f, 36) == 1);
  CHECK(get<std::int32_t>(f, 40) == 2);
  CHECK(get<std::int32_t>(f, 44) == 4);
  CHECK(get<std::int64_t>(f, 48) == 16);
  CHECK(int(f[56]) == (t == dtype::float32 ? 0 : t == dtype::float16 ? 1 : 2));
  for (std::size_t b = 57; b < 64; ++b) {
    CHECK(int(f[b]) == 0);
  }
  // live facts 10 (3 tokens, 1 page), 12 (9, 3), 14 (4, 1), 15 (6, 2), 16 (2, 1), 0 (2, 1)
  std::uint64_t const N = 4, F = 6, T = 3 + 9 + 4 + 6 + 2 + 2, U = 1 + 3 + 1 + 2 + 1 + 1, P = 16;
  CHECK(get<std::uint64_t>(f, 64) == N);  // namespaces 0, 1, 2, 5
  CHECK(get<std::uint64_t>(f, 72) == F);
  CHECK(get<std::uint64_t>(f, 80) == T);
  CHECK(get<std::uint64_t>(f, 88) == U);
  CHECK(get<std::uint64_t>(f, 96) == reference_crc64(f.data(), 96));
  std::size_t const B = page_bytes(t);
  REQUIRE(f.size() == 120 + 16 * N + 24 * F + 4 * T + 8 * P + U * B);

  // the catalogue, decoded here: namespaces ascending, each namespace's facts in insertion order
  std::size_t at = 104;
  std::vector<std::uint64_t> namespaces;
  std::vector<std::int64_t> pages_in_file;
  std::vector<std::vector<std::int64_t>> fact_pages;  // catalogue order
  for (std::uint64_t n = 0; n < N; ++n) {
    std::uint64_t const ns    = get<std::uint64_t>(f, at);
    std::uint64_t const count = get<std::uint64_t>(f, at + 8);
    at += 16;
    namespaces.push_back(ns);
    std::vector<std::uint64_t> ids;
    for (std::uint64_t i = 0; i < count; ++i) {
      std::uint64_t const id     = get<std::uint64_t>(f, at);
      std::int32_t const tokens  = get<std::int32_t>(f, at + 8);
      std::uint32_t const npages = get<std::uint32_t>(f, at + 12);
      at += 16;
      ids.push_back(id);
      fact_record const& r = store.at(id);
      CHECK(r.namespace_id == ns);
      REQUIRE(tokens == r.length());
      CHECK(npages == static_cast<std::uint32_t>((tokens + 3) / 4));
      for (std::int32_t j = 0; j < tokens; ++j) {
        CHECK(get<std::int32_t>(f, at) == r.token_ids[static_cast<std::size_t>(j)]);
        at += 4;
      }
      for (std::uint32_t j = 0; j < npages; ++j) {
        CHECK(get<std::int64_t>(f, at) == r.pages[j]);
        pages_in_file.push_back(r.pages[j]);
        at += 8;
      }
      fact_pages.push_back(r.pages);
    }
    CHECK(ids == store.namespace_fact_ids(ns));
  }
  CHECK(namespaces == std::vector<std::uint64_t>{0, 1, 2, 5});
  // the free stack: the pages no fact holds, and the next insert takes the last one first
  std::vector<std::int64_t> free_stack;
  for (std::uint64_t i = 0; i < P - U; ++i, at += 8) {
    free_stack.push_back(get<std::int64_t>(f, at));
  }
  std::vector<std::int64_t> all = pages_in_file;
  all.insert(all.end(), free_stack.begin(), free_stack.end());
  std::sort(all.begin(), all.end());
  for (std::int64_t p = 0; p < static_cast<std::int64_t>(P); ++p) {
    CHECK(all[static_cast<std::size_t>(p)] == p);
  }
  kv_store probe = scrambled_store(t);
  insert_fact(probe, 77, 9, 4 * 2);  // two pages: the top two of the stack, top first
  CHECK(probe.at(77).pages == std::vector<std::int64_t>{free_stack[free_stack.size() - 1],
                                                        free_stack[free_stack.size() - 2]});
  // the fact table: per fact, in catalogue order, the CRC-64 of its pages ascending
  std::vector<unsigned char> const pool = store.pool_to_host();
  for (std::vector<std::int64_t> pages : fact_pages) {
    std::sort(pages.begin(), pages.end());
    std::vector<unsigned char> bytes;
    for (std::int64_t p : pages) {
      bytes.insert(
        bytes.end(),
        pool.begin() + static_cast<std::ptrdiff_t>(p * static_cast<std::int64_t>(B)),
        pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * static_cast<std::int64_t>(B)));
    }
    CHECK(get<std::uint64_t>(f, at) == reference_crc64(bytes.data(), bytes.size()));
    at += 8;
  }
  CHECK(get<std::uint64_t>(f, at) == reference_crc64(f.data() + 104, at - 104));
  at += 8;

  // the pool: pages in use, ascending, whole pages as the pool holds them
  std::sort(pages_in_file.begin(), pages_in_file.end());
  for (std::int64_t p : pages_in_file) {
    CAPTURE(p);
    CHECK(
      std::equal(pool.begin() + static_cast<std::ptrdiff_t>(p * static_cast<std::int64_t>(B)),
                 pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * static_cast<std::int64_t>(B)),
                 f.begin() + static_cast<std::ptrdiff_t>(at)));
    at += B;
  }
  CHECK(at + 8 == f.size());
  CHECK(get<std::uint64_t>(f, at) == reference_file_checksum(f));
  // it covers the header fields and the catalogue too: change a token id and a namespace id
  // (updating their own checksums) and it changes
  std::vector<unsigned char> edited = f;
  set(edited, 104, get<std::uint64_t>(edited, 104) + 1);
  set(edited, 96, reference_crc64(edited.data(), 96));
  layout const l = layout_of(edited);
  set(edited, l.catalogue_end(), reference_crc64(edited.data() + 104, l.catalogue_end() - 104));
  CHECK(reference_file_checksum(edited) != reference_file_checksum(f));
}

TEST_CASE("snapshot: a round trip is byte-identical and keeps the catalogue and the free order",
          "[snapshot]")
{
  scratch_dir dir;
  dtype const t = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_store store          = scrambled_store(t);
  std::string const first = dir.file("first.iskv");
  save_store(store, first);
  kv_store loaded = load_store(first);
  CHECK(loaded.space() == memory_space::host);
  CHECK(loaded.store_dtype() == t);
  require_same_store(store, loaded, scrambled_ids);

  std::string const second = dir.file("second.iskv");
  save_store(loaded, second);
  CHECK(read_bytes(first) == read_bytes(second));
  CHECK_FALSE(fs::exists(first + ".tmp"));
  CHECK_FALSE(fs::exists(second + ".tmp"));

  // the next inserts and erasures behave the same on both
  for (kv_store* s : {&store, &loaded}) {
    insert_fact(*s, 40, 1, 7);
    insert_fact(*s, 41, 6, 1);
    s->erase_namespace(2);
    insert_fact(*s, 42, 2, 5);
  }
  std::vector<std::uint64_t> ids = scrambled_ids;
  ids.erase(std::find(ids.begin(), ids.end(), 14));
  ids.insert(ids.end(), {40, 41, 42});
  require_same_store(store, loaded, ids);

  // a store saved with no erasures has all-zero free pages: the pools are equal as a whole
  kv_store fresh{shard_config(t, 16)};
  insert_fact(fresh, 1, 1, 6);
  insert_fact(fresh, 2, 3, 4);
  save_store(fresh, dir.file("fresh.iskv"));
  CHECK(load_store(dir.file("fresh.iskv")).pool_to_host() == fresh.pool_to_host());
}

TEST_CASE("snapshot: composition and host injection from a reloaded store give identical caches",
          "[snapshot]")
{
  scratch_dir dir;
  dtype const t = GENERATE(dtype::float32, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_store const store = scrambled_store(t);
  save_store(store, dir.file("s.iskv"));
  kv_store const loaded = load_store(dir.file("s.iskv"));

  rope_spec spec;
  spec.head_dim              = 4;
  rope_params const rotation = make_rope_params(spec);
  compose_options o;
  o.first_position     = 37;
  o.order              = fact_order::best_last;
  o.instruction_prefix = 16;
  std::vector<std::uint64_t> const facts{12, 0, 15, 10};

  auto run = [&](kv_store const& s) {
    composition const plan = compose(s, facts, o);
    // a contiguous float32 cache (layers 2, K/V, 64 slots, heads 2, head_dim 4), filled with -7
    std::vector<float> data(2 * 2 * 64 * 2 * 4, -7.0f);
    paged_kv_cache const cache = make_contiguous_cache(
      dtype::float32, data.data(), {2, 2, 64, 2, 4}, {2 * 64 * 2 * 4, 64 * 2 * 4, 2 * 4, 4, 1});
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < plan.length(); ++j) {
      slots.push_back(63 - 2 * j);  // scattered, descending
    }
    injection_batch batch{s};
    batch.add(plan, slots);
    batch.run(cache, rotation);
    return std::make_pair(plan.token_ids, data);
  };
  auto const [tokens_a, cache_a] = run(store);
  auto const [tokens_b, cache_b] = run(loaded);
  CHECK(tokens_a == tokens_b);
  CHECK(tokens_a.size() == 2 + 9 + 2 + 6 + 3);
  std::size_t const written = static_cast<std::size_t>(
    std::count_if(cache_a.begin(), cache_a.end(), [](float x) { return x != -7.0f; }));
  CHECK(written > 0);  // the comparison below is of real injected bytes
  REQUIRE(cache_a.size() == cache_b.size());
  CHECK(std::memcmp(cache_a.data(), cache_b.data(), cache_a.size() * sizeof(float)) == 0);
}

TEST_CASE("snapshot: every single-byte corruption is refused and named", "[snapshot]")
{
  scratch_dir dir;
  dtype const t = GENERATE(dtype::float32, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_store const store   = small_store(t);
  std::string const path = dir.file("small.iskv");
  save_store(store, path);
  std::vector<unsigned char> const good = read_bytes(path);
  layout const l                        = layout_of(good);
  REQUIRE(load_error(path).empty());

  std::string const bad = dir.file("bad.iskv");
  std::size_t refused   = 0;
  for (std::size_t at = 0; at < good.size(); ++at) {
    for (unsigned char flip :
         {static_cast<unsigned char>(0xFF), static_cast<unsigned char>(0x01)}) {
      std::vector<unsigned char> corrupted = good;
      corrupted[at] ^= flip;
      write_bytes(bad, corrupted);
      std::string const e = load_error(bad);
      CAPTURE(at, int(flip), e);
      REQUIRE_FALSE(e.empty());
      ++refused;
      // a damaged header is named as such; a damaged catalogue or pool by its checksum
      if (at >= 16 && at < 104) {
        CHECK_THAT(e, Contains("header checksum mismatch"));
      } else if (at >= l.catalogue_begin && at < l.catalogue_end() + 8) {
        CHECK_THAT(e, Contains("catalogue checksum mismatch"));
      } else if (at >= l.pool_begin()) {
        CHECK_THAT(e, Contains("checksum mismatch") && Contains("the file is corrupted"));
      }
    }
  }
  CHECK(refused == 2 * good.size());
  write_bytes(bad, good);
  CHECK(load_error(bad).empty());
}

TEST_CASE("snapshot: every truncation and any trailing data is refused", "[snapshot]")
{
  scratch_dir dir;
  kv_store const store   = small_store(dtype::float16);
  std::string const path = dir.file("small.iskv");
  save_store(store, path);
  std::vector<unsigned char> const good = read_bytes(path);
  std::string const cut                 = dir.file("cut.iskv");
  for (std::size_t n = 0; n < good.size(); ++n) {
    write_bytes(
      cut, std::vector<unsigned char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)));
    std::string const e = load_error(cut);
    CAPTURE(n, e);
    REQUIRE_THAT(e, Contains("truncated"));
    if (n >= 120) {
      CHECK_THAT(e,
                 Contains("expected " + std::to_string(good.size()) + " bytes, file has " +
                          std::to_string(n)));
    }
  }
  std::vector<unsigned char> longer = good;
  longer.push_back(0);
  write_bytes(cut, longer);
  CHECK_THAT(load_error(cut), Contains("trailing data"));
  CHECK_THAT(load_error(dir.file("missing.iskv")),
             Contains("cannot open") && Contains(std::strerror(ENOENT)));
}

TEST_CASE("snapshot: forged files with valid checksums are refused by the consistency checks",
          "[snapshot]")
{
  scratch_dir dir;
  kv_store const store   = small_store(dtype::float32);
  std::string const path = dir.file("small.iskv");
  save_store(store, path);
  std::vector<unsigned char> const good = read_bytes(path);
  std::string const bad                 = dir.file("forged.iskv");
  // catalogue of small_store: namespace 1 {3 (2 tokens, 1 page), 6 (3, 1)}, namespace 2 {4 (5, 2)}
  std::size_t const ns1        = 104;
  std::size_t const fact3      = ns1 + 16;
  std::size_t const fact3_page = fact3 + 16 + 4 * 2;
  std::size_t const fact6      = fact3_page + 8;
  std::size_t const fact6_page = fact6 + 16 + 4 * 3;
  std::size_t const ns2        = fact6_page + 8;
  REQUIRE(get<std::uint64_t>(good, ns1) == 1);
  REQUIRE(get<std::uint64_t>(good, fact3) == 3);
  REQUIRE(get<std::uint64_t>(good, fact6) == 6);
  REQUIRE(get<std::uint64_t>(good, ns2) == 2);

  auto forged = [&](auto&& edit, char const* message) {
    std::vector<unsigned char> f = good;
    edit(f);
    refresh_checksums(f);
    write_bytes(bad, f);
    CAPTURE(message);
    CHECK_THAT(load_error(bad), Contains(message));
  };
  forged([&](auto& f) { set(f, 8, std::uint32_t{3}); },
         "format version 3 is not supported (this build reads 1 to 2)");
  forged([&](auto& f) { set(f, 8, std::uint32_t{0}); }, "format version 0 is not supported");
  forged([&](auto& f) { set(f, 12, std::uint32_t{0x04030201u}); }, "bad byte-order mark");
  forged([&](auto& f) { f[0] = 'X'; }, "not an InferScale store snapshot");
  forged([&](auto& f) { f[56] = 3; }, "unknown store dtype code 3");
  forged([&](auto& f) { f[60] = 1; }, "reserved bytes are not zero");
  forged([&](auto& f) { set(f, 24, std::int32_t{3}); }, "model geometry");
  forged([&](auto& f) { set(f, 28, std::int32_t{2}); }, "layer range");
  forged([&](auto& f) { set(f, 40, std::int32_t{4}); }, "head range");
  forged([&](auto& f) { set(f, 44, std::int32_t{0}); }, "page_size 0 is not positive");
  forged([&](auto& f) { set(f, 48, std::int64_t{-1}); }, "num_pages -1 is negative");
  forged([&](auto& f) { set(f, 48, std::int64_t{3}); }, "counts break");  // 4 pages in use
  forged([&](auto& f) { set(f, 72, std::uint64_t{2}); },
         "trailing data");  // sizes follow the header
  forged([&](auto& f) { set(f, fact6_page, get<std::int64_t>(f, fact3_page)); }, "is held twice");
  forged([&](auto& f) { set(f, fact6_page, std::int64_t{8}); }, "outside the capacity of 8 pages");
  forged([&](auto& f) { set(f, fact6_page, std::int64_t{-1}); }, "outside the capacity");
  forged([&](auto& f) { set(f, fact6, std::uint64_t{3}); }, "fact 3 appears twice");
  forged([&](auto& f) { set(f, ns2, std::uint64_t{1}); },
         "namespaces are stored once each, ascending");
  forged([&](auto& f) { set(f, ns2, std::uint64_t{0}); },
         "namespaces are stored once each, ascending");
  forged([&](auto& f) { set(f, fact3 + 12, std::uint32_t{2}); }, "2 pages for 2 tokens");
  forged([&](auto& f) { set(f, fact3 + 8, std::int32_t{0}); }, "has 0 tokens");
  forged([&](auto& f) { set(f, ns1 + 8, std::uint64_t{0}); }, "holds no facts");
  // a free page replaced by a page in use
  layout const l = layout_of(good);
  std::size_t const free_first =
    l.catalogue_end() - 8 * static_cast<std::size_t>(l.capacity - l.pages_in_use);
  forged([&](auto& f) { set(f, free_first, get<std::int64_t>(f, fact3_page)); }, "free-page stack");
  // non-finite elements in the pool (first element of the first page in use)
  forged([&](auto& f) { set(f, l.pool_begin(), std::uint32_t{0x7FC00000u}); }, "non-finite value");
  forged([&](auto& f) { set(f, l.pool_begin() + 12, std::uint32_t{0xFF800000u}); }, "non-finite");
  write_bytes(bad, good);
  CHECK(load_error(bad).empty());
}

TEST_CASE("snapshot: a capacity the host cannot allocate is refused as the file's", "[snapshot]")
{
  // Found by tests/fuzz: a 136-byte file with a valid header claiming 2 pages of 2^30 tokens of
  // head_dim 2^20 (2^56 bytes of pool: more than any host maps) made load_store throw a bare
  // std::bad_alloc. It is refused with logic_error, naming the pages and their size.
  scratch_dir dir;
  std::string const path = dir.file("huge.iskv");
  save_store(kv_store{shard_config(dtype::float32, 2)}, path);
  std::vector<unsigned char> f = read_bytes(path);
  REQUIRE(f.size() == 120 + 8 * 2);   // no facts: the header, two free pages, three checksums
  set(f, 24, std::int32_t{1} << 20);  // head_dim
  set(f, 44, std::int32_t{1} << 30);  // page_size
  refresh_checksums(f);
  write_bytes(path, f);
  // page bytes: K and V, 2 layers, 2^30 tokens, 2 heads, head_dim 2^20, 4-byte elements
  std::uint64_t const page_bytes = 2ull * 2 * (1ull << 30) * 2 * (1ull << 20) * 4;
  REQUIRE(page_bytes == (1ull << 55));
  CHECK_THAT(load_error(path),
             Contains("(2 pages of " + std::to_string(page_bytes) + " bytes") &&
               Contains("cannot be allocated"));
}

TEST_CASE("snapshot: loading into another dtype rounds to nearest even", "[snapshot]")
{
  scratch_dir dir;
  // fp32 values with known roundings: binary16 and bfloat16 ties (to even, both ways), values
  // between codes, a binary16 subnormal, an fp32 subnormal, the largest finite binary16, and
  // 65519 (just below the binary16 overflow threshold 65520: rounds to 65504)
  std::vector<float> const special{1.0f + 0x1p-11f,
                                   1.0f + 0x3p-11f,
                                   1.0f + 0x1p-8f,
                                   1.0f + 0x3p-8f,
                                   -2.5f + 0x1p-10f,
                                   0x1p-20f,
                                   0x1p-130f,
                                   65504.0f,
                                   -65519.0f,
                                   0.1f,
                                   -1.0f / 3.0f,
                                   3.14159265f};
  kv_store source{shard_config(dtype::float32, 8)};
  insert_fact(source, 1, 1, 3, &special);
  insert_fact(source, 2, 2, 6);
  save_store(source, dir.file("f32.iskv"));
  std::vector<unsigned char> const from = source.pool_to_host();

  for (dtype to : {dtype::float16, dtype::bfloat16}) {
    CAPTURE(to_string(to));
    store_load_options o;
    o.store_dtype            = to;
    kv_store const converted = load_store(dir.file("f32.iskv"), o);
    CHECK(converted.store_dtype() == to);
    require_same_store(source, converted, {1, 2}, false);
    std::vector<unsigned char> const got = converted.pool_to_host();
    std::size_t const elements           = from.size() / 4;
    REQUIRE(got.size() == elements * 2);
    for (std::size_t e = 0; e < elements; ++e) {
      float x;
      std::memcpy(&x, from.data() + 4 * e, 4);
      std::uint16_t bits;
      std::memcpy(&bits, got.data() + 2 * e, 2);
      std::uint16_t const want = to == dtype::float16 ? rne_half(x) : rne_bf16(x);
      if (bits != want) {
        CAPTURE(e, x, bits, want);
        FAIL("conversion differs from round-to-nearest-even");
      }
    }
    // and back to float32: the widening is exact
    save_store(converted, dir.file("narrow.iskv"));
    store_load_options wide;
    wide.store_dtype = dtype::float32;
    std::vector<unsigned char> const widened =
      load_store(dir.file("narrow.iskv"), wide).pool_to_host();
    for (std::size_t e = 0; e < elements; ++e) {
      float y;
      std::memcpy(&y, widened.data() + 4 * e, 4);
      if (static_cast<double>(y) != decode(got.data() + 2 * e, to)) {
        CAPTURE(e, y);
        FAIL("widening is not exact");
      }
    }
  }

  // float16 <-> bfloat16: through the exact value, one rounding
  store_load_options to_half;
  to_half.store_dtype = dtype::float16;
  save_store(load_store(dir.file("f32.iskv"), to_half), dir.file("f16.iskv"));
  store_load_options to_bf16;
  to_bf16.store_dtype                = dtype::bfloat16;
  kv_store const half_store          = load_store(dir.file("f16.iskv"));
  std::vector<unsigned char> const h = half_store.pool_to_host();
  std::vector<unsigned char> const b = load_store(dir.file("f16.iskv"), to_bf16).pool_to_host();
  for (std::size_t e = 0; e < h.size() / 2; ++e) {
    std::uint16_t bits;
    std::memcpy(&bits, b.data() + 2 * e, 2);
    if (bits != rne_bf16(decode(h.data() + 2 * e, dtype::float16))) {
      CAPTURE(e);
      FAIL("float16 -> bfloat16 differs from round-to-nearest-even");
    }
  }

  // a finite value beyond binary16's range refuses the load (bfloat16 holds it)
  std::vector<float> const large{70000.0f, 1.0f};
  kv_store big{shard_config(dtype::float32, 4)};
  insert_fact(big, 9, 1, 2, &large);
  save_store(big, dir.file("big.iskv"));
  CHECK_THAT(load_error(dir.file("big.iskv"), to_half),
             Contains("fact 9") && Contains("overflows float16"));
  CHECK(load_store(dir.file("big.iskv"), to_bf16).num_facts() == 1);
  store_load_options fp8;
  fp8.store_dtype = dtype::float8_e4m3;
  CHECK_THAT(load_error(dir.file("big.iskv"), fp8), Contains("float32, float16 or bfloat16"));
}

TEST_CASE("snapshot: another geometry, shard, page size or capacity is refused", "[snapshot]")
{
  scratch_dir dir;
  kv_store const store = small_store(dtype::bfloat16);
  save_store(store, dir.file("s.iskv"));
  auto refused = [&](kv_store_config const& target) -> std::string {
    try {
      (void)load_store(dir.file("s.iskv"), target);
    } catch (logic_error const& e) {
      return e.what();
    }
    return {};
  };
  kv_store_config const same = shard_config(dtype::bfloat16, 8);
  CHECK(refused(same).empty());
  kv_store_config c = same;
  c.model.head_dim  = 8;
  CHECK_THAT(refused(c),
             Contains("model with 3 layers x 4 KV heads x head_dim 4") && Contains("head_dim 8"));
  c            = same;
  c.first_head = 0;
  CHECK_THAT(refused(c), Contains("KV heads [1, 3)") && Contains("KV heads [0, 2)"));
  c            = same;
  c.num_layers = 0;  // through the last layer: [1, 3), the same shard
  CHECK(refused(c).empty());
  c.first_layer = 0;
  c.num_layers  = 0;  // [0, 3)
  CHECK_THAT(refused(c), Contains("layers [1, 3)") && Contains("layers [0, 3)"));
  c           = same;
  c.page_size = 8;
  CHECK_THAT(refused(c), Contains("pages of 4 tokens, the target store 8"));
  c           = same;
  c.num_pages = 9;
  CHECK_THAT(refused(c), Contains("capacity of 8 pages, the target store 9"));
  // another dtype converts
  c                   = same;
  c.store_dtype       = dtype::float32;
  kv_store const wide = load_store(dir.file("s.iskv"), c);
  CHECK(wide.store_dtype() == dtype::float32);
  std::vector<unsigned char> const narrow  = store.pool_to_host();
  std::vector<unsigned char> const widened = wide.pool_to_host();
  for (std::size_t e = 0; e < narrow.size() / 2; ++e) {
    float y;
    std::memcpy(&y, widened.data() + 4 * e, 4);
    if (static_cast<double>(y) != decode(narrow.data() + 2 * e, dtype::bfloat16)) {
      FAIL("bfloat16 -> float32 is not exact at element " << e);
    }
  }
}

TEST_CASE("snapshot: a failed save throws, leaves no temporary and the old file intact",
          "[snapshot]")
{
  scratch_dir dir;
  kv_store const first  = small_store(dtype::float32);
  kv_store const second = scrambled_store(dtype::float32);

  // a directory that does not exist
  std::string const nowhere = dir.file("no_such_directory") + "/s.iskv";
  CHECK_THAT(save_error(first, nowhere),
             Contains(nowhere + ".tmp") && Contains(std::strerror(ENOENT)));
  CHECK_FALSE(fs::exists(nowhere));
  CHECK_FALSE(fs::exists(nowhere + ".tmp"));

  // the temporary cannot be created: the good file stays
  std::string const path = dir.file("s.iskv");
  save_store(first, path);
  std::vector<unsigned char> const good = read_bytes(path);
  fs::create_directory(path + ".tmp");
  CHECK_THAT(save_error(second, path), Contains(path + ".tmp"));
  CHECK(read_bytes(path) == good);
  fs::remove(path + ".tmp");

  // the rename fails (the destination is a non-empty directory): the temporary is removed
  std::string const occupied = dir.file("occupied");
  fs::create_directories(occupied + "/inside");
  CHECK_THAT(save_error(first, occupied), Contains("cannot rename") && Contains(occupied));
  CHECK_FALSE(fs::exists(occupied + ".tmp"));
  CHECK(fs::is_directory(occupied + "/inside"));

  // a page holding NaN: refused, nothing replaced, no temporary
  kv_store poisoned{shard_config(dtype::float32, 8)};
  insert_fact(poisoned, 21, 1, 3);
  fact_record const& r = poisoned.reserve(22, 1, std::vector<std::int32_t>{1, 2, 3, 4, 5});
  float const nan      = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(static_cast<unsigned char*>(poisoned.ref().pool) +
                static_cast<std::size_t>(r.pages[1]) * page_bytes(dtype::float32) + 20,
              &nan,
              4);
  CHECK_THAT(
    save_error(poisoned, path),
    Contains("fact 22 holds a non-finite value") && Contains("page " + std::to_string(r.pages[1])));
  CHECK(read_bytes(path) == good);
  CHECK_FALSE(fs::exists(path + ".tmp"));

  // and a successful save replaces the file
  save_store(second, path);
  require_same_store(second, load_store(path), scrambled_ids);
}

TEST_CASE("snapshot: empty stores round-trip", "[snapshot]")
{
  scratch_dir dir;
  for (std::int64_t pages : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}}) {
    CAPTURE(pages);
    kv_store const empty{shard_config(dtype::float16, pages)};
    std::string const path = dir.file("empty.iskv");
    save_store(empty, path);
    CHECK(fs::file_size(path) == static_cast<std::uintmax_t>(120 + 8 * pages));
    kv_store loaded = load_store(path);
    CHECK(loaded.num_facts() == 0);
    CHECK(loaded.free_pages() == pages);
    CHECK(loaded.num_pages() == pages);
    save_store(loaded, dir.file("again.iskv"));
    CHECK(read_bytes(path) == read_bytes(dir.file("again.iskv")));
    if (pages == 5) {  // a fresh store fills pages in order after a reload too
      insert_fact(loaded, 1, 1, 9);
      CHECK(loaded.at(1).pages == std::vector<std::int64_t>{0, 1, 2});
    }
  }
}
