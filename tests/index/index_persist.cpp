// Host tests of graph_index persistence (inferscale/detail/index/serialize.hpp): save_index and
// load_index. They run everywhere: no GPU is needed.
//
// Expectations are written here, never taken from the code under test:
//  - the file layout is read at the offsets documented in serialize.hpp's file comment, the file
//    length is the documented formula 88 + 24 T + R (13 + W + 4 D), and the checksums are
//    recomputed with a bit-at-a-time CRC-64/XZ written here (itself checked against the published
//    check value of "123456789");
//  - a loaded index is compared with the one that was saved through the public accessors
//    (namespaces, ids, rows, deleted flags, vector bytes, graph bytes) and by searching both;
//    then both receive the same mutations and must stay equal;
//  - corruption, truncation and forged files (checksums recomputed here, so that only the
//    consistency checks can catch them) must be refused with a logic_error naming the problem.
#include "index_persist_common.hpp"

using namespace inferscale_index_persist;

// ------------------------------------------------------------------------------------------------

TEST_CASE("persist: the checksum is CRC-64/XZ", "[index][persist]")
{
  auto const check = reinterpret_cast<unsigned char const*>("123456789");
  REQUIRE(reference_crc64(check, 9) == 0x995DC9BBDF1939FAull);  // the published check value
  REQUIRE(detail::index::crc64_of(check, 9) == 0x995DC9BBDF1939FAull);
  std::mt19937_64 rng(5);
  std::vector<unsigned char> data(1031);
  for (auto& x : data) {
    x = static_cast<unsigned char>(rng());
  }
  for (std::size_t n : {std::size_t{0},
                        std::size_t{1},
                        std::size_t{7},
                        std::size_t{8},
                        std::size_t{9},
                        std::size_t{64},
                        std::size_t{1031}}) {
    CAPTURE(n);
    REQUIRE(detail::index::crc64_of(data.data(), n) == reference_crc64(data.data(), n));
    detail::index::crc64 pieces;  // incremental updates over uneven pieces
    std::size_t const cut = n / 3;
    pieces.update(data.data(), cut);
    pieces.update(data.data() + cut, n - cut);
    REQUIRE(pieces.value() == reference_crc64(data.data(), n));
  }
}

TEST_CASE("persist: round trip keeps namespaces, rows, graphs and search results",
          "[index][persist]")
{
  dtype const t = GENERATE(dtype::float32, dtype::float16);
  distance_metric const m =
    GENERATE(distance_metric::inner_product, distance_metric::cosine, distance_metric::squared_l2);
  CAPTURE(to_string(t), to_string(m));
  scratch_dir dir;
  fact_source source(m, 7);
  graph_index original   = make_scenario(t, m, source);
  std::string const path = dir.file("index.isx");
  save_index(original, path);
  REQUIRE_FALSE(fs::exists(path + ".tmp"));

  // the documented layout
  std::vector<unsigned char> const bytes = read_bytes(path);
  std::size_t const es                   = size_of(t);
  std::size_t const w       = 40 * es;  // 37 padded to 16 bytes: 40 elements in either dtype
  std::size_t const tenants = 4;        // 11, 22, 33, 55 (44 was erased)
  std::size_t const rows    = 600 + 400 + 41 + 0;
  REQUIRE(bytes.size() == 88 + 24 * tenants + rows * (13 + w + 4 * 16));
  std::vector<unsigned char> const magic = {0x89, 'I', 'S', 'I', 'D', 'X', 0x0D, 0x0A};
  REQUIRE(std::equal(magic.begin(), magic.end(), bytes.begin()));
  REQUIRE(le(bytes, 8, 4) == 2);
  REQUIRE((bytes[12] == 4 && bytes[13] == 3 && bytes[14] == 2 && bytes[15] == 1));
  REQUIRE(le(bytes, 16, 8) == 37);
  REQUIRE(le(bytes, 24, 1) == (m == distance_metric::inner_product ? 0u
                               : m == distance_metric::cosine      ? 1u
                                                                   : 2u));
  REQUIRE(le(bytes, 25, 1) == (t == dtype::float32 ? 0u : 1u));
  REQUIRE(le(bytes, 26, 1) == 0);  // host_traversal_dtype float32
  REQUIRE(le(bytes, 27, 1) == 0);
  REQUIRE(le(bytes, 28, 4) == 16);
  REQUIRE(le(bytes, 32, 4) == 32);
  REQUIRE(le(bytes, 36, 4) == 0xFFFFFFFFu);  // host_entry_points -1 (automatic)
  REQUIRE(le(bytes, 40, 8) == 50);
  REQUIRE(le(bytes, 48, 8) == 40);
  REQUIRE(le(bytes, 56, 8) == tenants);
  REQUIRE(le(bytes, 64, 8) == rows);
  REQUIRE(le(bytes, 72, 8) == reference_crc64(bytes.data(), 72));
  REQUIRE(le(bytes, bytes.size() - 8, 8) == reference_crc64(bytes.data(), bytes.size() - 8));
  file_layout const layout = read_layout(bytes);
  REQUIRE(layout.tenants.size() == tenants);
  REQUIRE(layout.tenants.back().end == bytes.size() - 8);
  for (auto const& tr : layout.tenants) {
    CAPTURE(tr.ns);
    REQUIRE(tr.size == original.rows(tr.ns));
    REQUIRE(tr.live == original.size(tr.ns));
    REQUIRE(tr.entries_rows <= tr.size);
    REQUIRE(tr.default_ef == index_access::host_default_ef(original, tr.ns));
    std::size_t entry_points = 0;
    std::vector<bool> rank_seen(tr.size, false);
    for (std::size_t v = 0; v < tr.size; ++v) {
      std::uint64_t const r = le(bytes, tr.ranks + 4 * v, 4);
      if (r == 0xFFFFFFFFu) { continue; }
      REQUIRE(r < tr.size);
      REQUIRE_FALSE(rank_seen[r]);
      rank_seen[r] = true;
      ++entry_points;
    }
    REQUIRE(entry_points == index_access::host_entry_points(original, tr.ns));
    for (std::size_t v = 0; v < tr.size; ++v) {
      REQUIRE(le(bytes, tr.ids + 8 * v, 8) == index_access::id_rows(original, tr.ns)[v]);
      REQUIRE(bytes[tr.deleted + v] == index_access::deleted_rows(original, tr.ns)[v]);
      for (std::size_t e = 0; e < 16; ++e) {
        REQUIRE(le(bytes, tr.graph + 4 * (v * 16 + e), 4) ==
                index_access::graph_rows(original, tr.ns)[v * 16 + e]);
      }
    }
    if (tr.size > 0) {
      REQUIRE(std::memcmp(bytes.data() + tr.vectors,
                          index_access::vector_rows(original, tr.ns),
                          tr.size * w) == 0);
    }
  }

  // the loaded index
  graph_index loaded = load_index(path);
  REQUIRE(loaded.space() == memory_space::host);
  require_same_contents(original, loaded);
  REQUIRE(loaded.arena_rows() == static_cast<std::int64_t>(rows));  // packed
  REQUIRE_FALSE(loaded.contains(1007));                             // deleted
  REQUIRE(loaded.namespace_of(1000) == 33);                         // re-added elsewhere
  REQUIRE(loaded.namespace_of(2000) == 22);
  REQUIRE_FALSE(loaded.has_namespace(44));
  require_same_searches(original, loaded, m);

  // saving the loaded index writes the same bytes
  std::string const again = dir.file("again.isx");
  save_index(loaded, again);
  REQUIRE(read_bytes(again) == bytes);

  // both take the same mutations to the same state
  fact_source source_a(m, 31);
  fact_source source_b(m, 31);
  mutate(original, source_a);
  mutate(loaded, source_b);
  require_same_contents(original, loaded);
  require_same_searches(original, loaded, m);
}

TEST_CASE("persist: an empty index round-trips", "[index][persist]")
{
  dtype const t = GENERATE(dtype::float32, dtype::float16);
  CAPTURE(to_string(t));
  scratch_dir dir;
  index_config config           = make_config(t, distance_metric::squared_l2);
  config.exact_search_threshold = -1;
  graph_index empty{config};
  std::string const path = dir.file("empty.isx");
  save_index(empty, path);
  std::vector<unsigned char> const bytes = read_bytes(path);
  REQUIRE(bytes.size() == 88);
  REQUIRE(le(bytes, 40, 8) == ~std::uint64_t{0});  // -1
  REQUIRE(le(bytes, 56, 8) == 0);
  REQUIRE(le(bytes, 64, 8) == 0);
  graph_index loaded = load_index(path, memory_space::host);
  require_same_contents(empty, loaded);
  REQUIRE(loaded.num_namespaces() == 0);
  REQUIRE(loaded.arena_rows() == 0);
  REQUIRE(loaded.config().exact_search_threshold == -1);
  // and is usable
  fact_source source(distance_metric::squared_l2, 3);
  source.add(loaded, 1, 10, 30);
  REQUIRE(loaded.size(1) == 30);
}

TEST_CASE("persist: every single-byte corruption is refused and named", "[index][persist]")
{
  scratch_dir dir;
  fact_source source(distance_metric::cosine, 11);
  graph_index index{make_config(dtype::float16, distance_metric::cosine)};
  source.add(index, 1, 100, 200);
  source.add(index, 2, 500, 60);
  erase_ids(index, {100, 150, 510});
  std::string const path = dir.file("good.isx");
  save_index(index, path);
  std::vector<unsigned char> const good = read_bytes(path);
  file_layout const layout              = read_layout(good);
  REQUIRE(layout.tenants.size() == 2);

  // positions: the whole header and both tenant records, samples of every region, the checksum
  std::vector<std::size_t> positions;
  for (std::size_t p = 0; p < 80; ++p) {
    positions.push_back(p);
  }
  std::mt19937_64 rng(17);
  for (auto const& tr : layout.tenants) {
    for (std::size_t p = tr.record; p < tr.ids; ++p) {
      positions.push_back(p);
    }
    std::size_t const starts[] = {tr.ids, tr.deleted, tr.vectors, tr.graph, tr.ranks};
    std::size_t const ends[]   = {tr.deleted, tr.vectors, tr.graph, tr.ranks, tr.end};
    for (int region = 0; region < 5; ++region) {
      positions.push_back(starts[region]);
      positions.push_back(ends[region] - 1);
      for (int s = 0; s < 24; ++s) {
        positions.push_back(starts[region] + rng() % (ends[region] - starts[region]));
      }
    }
  }
  for (std::size_t p = good.size() - 8; p < good.size(); ++p) {
    positions.push_back(p);
  }

  std::string const bad = dir.file("bad.isx");
  for (std::size_t position : positions) {
    for (unsigned mask : {0x01u, 0x80u, 0xFFu}) {
      CAPTURE(position, mask);
      std::vector<unsigned char> corrupted = good;
      corrupted[position] ^= static_cast<unsigned char>(mask);
      write_bytes(bad, corrupted);
      std::string const error = load_error(bad);
      if (position < 8) {
        CHECK_THAT(error, Contains("not an InferScale index file"));
      } else if (position < 12) {
        CHECK_THAT(error,
                   Contains("format version " + std::to_string(le(corrupted, 8, 4)) +
                            " is not supported (this build reads 2)"));
      } else if (position < 16) {
        CHECK_THAT(error, Contains("byte-order mark"));
      } else if (position < 80) {
        CHECK_THAT(error, Contains("header checksum mismatch"));
      } else {
        CHECK_THAT(error, Contains("checksum mismatch"));
        CHECK_THAT(error, !Contains("header"));
      }
      CHECK_THAT(error, Contains(bad));  // the message names the file
    }
  }
  REQUIRE(load_error(path).empty());  // the good file still loads
}

TEST_CASE("persist: truncated files are refused", "[index][persist]")
{
  scratch_dir dir;
  fact_source source(distance_metric::squared_l2, 13);
  graph_index index{make_config(dtype::float32, distance_metric::squared_l2)};
  source.add(index, 9, 0, 300);
  std::string const path = dir.file("good.isx");
  save_index(index, path);
  std::vector<unsigned char> const good = read_bytes(path);
  std::size_t const size                = good.size();
  REQUIRE(size == 88 + 24 + 300 * (13 + 160 + 64));

  std::string const cut = dir.file("cut.isx");
  for (std::size_t length :
       {std::size_t{0},  std::size_t{1},  std::size_t{7},  std::size_t{8},  std::size_t{11},
        std::size_t{12}, std::size_t{15}, std::size_t{16}, std::size_t{79}, std::size_t{80},
        std::size_t{87}, std::size_t{88}, std::size_t{95}, std::size_t{96}, std::size_t{97},
        size / 3,        size / 2,        size - 9,        size - 8,        size - 1}) {
    CAPTURE(length);
    write_bytes(
      cut,
      std::vector<unsigned char>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(length)));
    std::string const error = load_error(cut);
    if (length < 88) {
      CHECK_THAT(
        error,
        Contains("truncated: expected at least 88 bytes, file has " + std::to_string(length)));
    } else {
      CHECK_THAT(error,
                 Contains("truncated: expected " + std::to_string(size) + " bytes, file has " +
                          std::to_string(length)));
    }
  }
  std::vector<unsigned char> longer = good;
  longer.push_back(0);
  write_bytes(cut, longer);
  CHECK_THAT(load_error(cut),
             Contains("trailing data: expected " + std::to_string(size) + " bytes, file has " +
                      std::to_string(size + 1)));
}

TEST_CASE("persist: foreign files and other versions are refused", "[index][persist]")
{
  scratch_dir dir;
  std::string const other = dir.file("other.bin");
  std::string const text =
    "this is a text file, not an index; it is long enough to hold a header "
    "and a checksum and some more bytes after them.";
  write_bytes(other, std::vector<unsigned char>(text.begin(), text.end()));
  CHECK_THAT(load_error(other), Contains("not an InferScale index file"));
  write_bytes(other, {'I', 'S'});
  CHECK_THAT(load_error(other), Contains("not an InferScale index file"));

  graph_index index{make_config(dtype::float32, distance_metric::cosine)};
  fact_source source(distance_metric::cosine, 2);
  source.add(index, 4, 0, 20);
  std::string const path = dir.file("good.isx");
  save_index(index, path);
  std::vector<unsigned char> bytes = read_bytes(path);
  put(bytes, 8, 7, 4);
  reseal(bytes);  // a well-formed file of another version
  write_bytes(other, bytes);
  CHECK_THAT(load_error(other), Contains("format version 7 is not supported (this build reads 2)"));
  put(bytes, 8, 1, 4);
  reseal(bytes);  // a version 1 file: it lacks the fast search's state
  write_bytes(other, bytes);
  CHECK_THAT(load_error(other), Contains("format version 1 is not supported (this build reads 2)"));

  CHECK_THAT(load_error(dir.file("missing.isx")),
             Contains(dir.file("missing.isx")) && Contains(std::strerror(ENOENT)));
  fs::create_directory(dir.file("a_directory"));
  CHECK_THAT(load_error(dir.file("a_directory")),
             Contains(dir.file("a_directory")) && Contains(std::strerror(EISDIR)));
}

TEST_CASE("persist: forged files with valid checksums are refused by the consistency checks",
          "[index][persist]")
{
  scratch_dir dir;
  fact_source source(distance_metric::inner_product, 23);
  graph_index index{make_config(dtype::float32, distance_metric::inner_product)};
  source.add(index, 1, 100, 120);
  source.add(index, 2, 500, 40);
  erase_ids(index, {101});
  std::string const path = dir.file("good.isx");
  save_index(index, path);
  std::vector<unsigned char> const good = read_bytes(path);
  file_layout const layout              = read_layout(good);
  auto const& t0                        = layout.tenants[0];
  auto const& t1                        = layout.tenants[1];
  REQUIRE(good[t0.deleted + 0] == 0);
  REQUIRE(good[t0.deleted + 1] == 1);  // fact 101
  REQUIRE(good[t0.deleted + 2] == 0);

  struct forgery {
    char const* what;
    std::function<void(std::vector<unsigned char>&)> edit;
    std::string expected;
  };
  std::size_t const row_bytes          = layout.row_elements * 4;
  std::vector<forgery> const forgeries = {
    {"graph id equal to the tenant size",
     [&](auto& b) { put(b, t0.graph, 120, 4); },
     "graph id 120 is neither below the tenant size 120"},
    {"graph id 0xFFFFFFFE",
     [&](auto& b) { put(b, t1.graph + 4 * 5, 0xFFFFFFFEu, 4); },
     "graph id 4294967294"},
    {"deleted flag 2", [&](auto& b) { b[t0.deleted + 3] = 2; }, "deleted flag 2 is not 0 or 1"},
    {"live count one too high",
     [&](auto& b) { put(b, t0.record + 12, 120, 4); },
     "live count 120 but 119 rows are not deleted"},
    {"a deleted row marked live",
     [&](auto& b) { b[t0.deleted + 1] = 0; },
     "live count 119 but 120 rows are not deleted"},
    {"live count above size",
     [&](auto& b) { put(b, t1.record + 12, 41, 4); },
     "live 41 exceeds size 40"},
    {"a live fact id repeated in another tenant",
     [&](auto& b) { put(b, t1.ids, 100, 8); },
     "live fact id 100 appears twice"},
    {"the reserved fact id",
     [&](auto& b) { put(b, t0.ids + 8 * 2, ~std::uint64_t{0}, 8); },
     "live fact id 2^64-1 is reserved"},
    {"a namespace repeated",
     [&](auto& b) { put(b, t1.record, 1, 8); },
     "namespace 1 appears twice"},
    {"a NaN element",
     [&](auto& b) { put(b, t1.vectors + row_bytes * 3 + 4 * 5, 0x7FC00000u, 4); },
     "row 3: vector element 5 is NaN or infinite"},
    {"non-zero padding",
     [&](auto& b) { put(b, t0.vectors + 4 * 38, 0x3F800000u, 4); },
     "row 0: padding element 38 is not zero"},
    {"tenant sizes shifted between tenants",
     [&](auto& b) {
       put(b, t0.record + 8, 121, 4);
       put(b, t0.record + 12, 120, 4);
     },
     ""},  // the rows no longer line up: any named refusal will do
    {"unknown dtype code", [&](auto& b) { b[25] = 5; }, "unknown vector dtype code 5"},
    {"unknown metric code", [&](auto& b) { b[24] = 9; }, "unknown metric code 9"},
    {"graph degree 0", [&](auto& b) { put(b, 28, 0, 4); }, "header: degrees graph 0"},
    {"row_elements not the padded dim",
     [&](auto& b) { put(b, 48, 37, 8); },
     "row_elements 37 is not dim 37 padded"},
    {"reserved bytes set", [&](auto& b) { b[27] = 1; }, "reserved fields are not zero"},
    {"a tenant more than the file holds",
     [&](auto& b) { put(b, 56, 3, 8); },
     "truncated: expected " + std::to_string(good.size() + 24) + " bytes"},
    {"an entry rank repeated",
     [&](auto& b) {
       std::size_t first = t0.size;  // the first two entry points of tenant 0 get rank 0
       for (std::size_t v = 0; v < t0.size; ++v) {
         if (le(b, t0.ranks + 4 * v, 4) == 1) { first = v; }
       }
       REQUIRE(first < t0.size);
       put(b, t0.ranks + 4 * first, 0, 4);
     },
     "is repeated or not below the"},
    {"an entry rank beyond the entry points",
     [&](auto& b) {
       std::size_t none = t1.size;
       for (std::size_t v = 0; v < t1.size && none == t1.size; ++v) {
         if (le(b, t1.ranks + 4 * v, 4) == 0xFFFFFFFFu) { none = v; }
       }
       if (none == t1.size) { none = 0; }  // every row is one: row 0's rank, out of range
       put(b, t1.ranks + 4 * none, 5000, 4);
     },
     "entry rank"},
    {"entry points chosen at more rows than the tenant has",
     [&](auto& b) { put(b, t1.record + 16, 41, 4); },
     "entry points chosen at 41 rows, more than its 40"},
    {"default ef 0", [&](auto& b) { put(b, t0.record + 20, 0, 4); }, "default ef 0 outside"},
    {"unknown traversal dtype code", [&](auto& b) { b[26] = 2; }, "host traversal dtype code 2"},
    {"host_entry_points 0",
     [&](auto& b) { put(b, 36, 0, 4); },
     "host_entry_points 0 is neither -1"},
    {"rows beyond the file",
     [&](auto& b) { put(b, 64, ~std::uint64_t{0} / 2, 8); },
     "do not fit in a file"},
  };
  std::string const bad = dir.file("forged.isx");
  for (auto const& f : forgeries) {
    CAPTURE(f.what);
    std::vector<unsigned char> forged = good;
    f.edit(forged);
    reseal(forged);
    write_bytes(bad, forged);
    std::string const error = load_error(bad);
    CHECK_THAT(error, Contains(bad));
    CHECK_THAT(error, !Contains("checksum mismatch"));
    CHECK_THAT(error, Contains(f.expected));
  }
  write_bytes(bad, good);
  REQUIRE(load_error(bad).empty());
}

TEST_CASE("persist: a failed save throws and leaves an existing file as it was", "[index][persist]")
{
  scratch_dir dir;
  fact_source source(distance_metric::cosine, 29);
  graph_index first{make_config(dtype::float32, distance_metric::cosine)};
  source.add(first, 1, 0, 50);
  graph_index second{make_config(dtype::float32, distance_metric::cosine)};
  source.add(second, 2, 1000, 70);

  // a directory that does not exist
  std::string const nowhere = dir.file("no_such_directory") + "/index.isx";
  CHECK_THAT(save_error(first, nowhere),
             Contains(nowhere + ".tmp") && Contains(std::strerror(ENOENT)));
  CHECK_FALSE(fs::exists(nowhere));

  // the temporary cannot be created: the good file stays
  std::string const path = dir.file("index.isx");
  save_index(first, path);
  std::vector<unsigned char> const good = read_bytes(path);
  fs::create_directory(path + ".tmp");
  CHECK_THAT(save_error(second, path), Contains(path + ".tmp"));
  REQUIRE(read_bytes(path) == good);
  require_same_contents(first, load_index(path));
  fs::remove(path + ".tmp");

  // the rename fails (the destination is a non-empty directory): the temporary is removed
  std::string const occupied = dir.file("occupied");
  fs::create_directories(occupied + "/inside");
  CHECK_THAT(save_error(first, occupied), Contains("cannot rename") && Contains(occupied));
  CHECK_FALSE(fs::exists(occupied + ".tmp"));
  CHECK(fs::is_directory(occupied));

  // and a successful save replaces the file
  save_index(second, path);
  require_same_contents(second, load_index(path));
}

TEST_CASE(
  "persist: a namespace grown by inserts since its entry points were chosen answers the same",
  "[index][persist]")
{
  // The fast host search starts from entry points chosen when a namespace is built and again only
  // once it has grown by a quarter; version 1 files did not carry them and the loader chose them
  // afresh from all the rows, so such a namespace searched differently after a restart.
  scratch_dir dir;
  fact_source source(distance_metric::cosine, 41);
  index_config config           = make_config(dtype::float32, distance_metric::cosine);
  config.exact_search_threshold = -1;
  graph_index original{config};
  for (std::uint64_t ns = 1; ns <= 3; ++ns) {
    source.add(original, ns, ns * 10000, 300);  // built: entry points chosen at 300 rows
    for (int step = 0; step < 3; ++step) {      // inserted: 360 rows, less than a quarter more
      source.add(original, ns, ns * 10000 + 300 + 20 * static_cast<std::uint64_t>(step), 20);
    }
  }
  erase_ids(original, {10001, 10302, 20005, 30350});
  std::string const path = dir.file("grown.isx");
  save_index(original, path);
  std::vector<unsigned char> const bytes = read_bytes(path);
  for (auto const& tr : read_layout(bytes).tenants) {
    CAPTURE(tr.ns);
    REQUIRE(tr.size == 360);
    REQUIRE(tr.entries_rows == 300);  // the scenario: entry points older than the last rows
  }
  graph_index loaded = load_index(path);
  require_same_contents(original, loaded);
  for (std::uint64_t ns = 1; ns <= 3; ++ns) {
    REQUIRE(index_access::host_entry_points(loaded, ns) ==
            index_access::host_entry_points(original, ns));
    REQUIRE(index_access::host_default_ef(loaded, ns) ==
            index_access::host_default_ef(original, ns));
  }
  require_same_searches(original, loaded, distance_metric::cosine);
  // many queries of the fast search at small lists, where a different start shows
  std::int64_t const nq = 600;
  std::uint32_t const k = 10;
  test::gaussian_mixture queries_source(test::mixture_spec{dim, 12, true, 43});
  std::vector<float> const q = queries_source.draw(nq);
  std::vector<std::uint64_t> namespaces;
  for (std::int64_t i = 0; i < nq; ++i) {
    namespaces.push_back(1 + static_cast<std::uint64_t>(i % 3));
  }
  for (std::uint32_t itopk : {0u, 10u, 16u}) {
    search_params p;
    p.algo       = search_algo::graph;
    p.itopk_size = itopk;
    std::vector<std::uint64_t> ids_a(nq * k), ids_b(nq * k);
    std::vector<float> dist_a(nq * k), dist_b(nq * k);
    inferscale::search(original,
                       make_matrix_view<float const>(q.data(), nq, dim),
                       cuda::std::span<std::uint64_t const>(namespaces.data(), namespaces.size()),
                       k,
                       p,
                       make_matrix_view<std::uint64_t>(ids_a.data(), nq, k),
                       make_matrix_view<float>(dist_a.data(), nq, k));
    inferscale::search(loaded,
                       make_matrix_view<float const>(q.data(), nq, dim),
                       cuda::std::span<std::uint64_t const>(namespaces.data(), namespaces.size()),
                       k,
                       p,
                       make_matrix_view<std::uint64_t>(ids_b.data(), nq, k),
                       make_matrix_view<float>(dist_b.data(), nq, k));
    CAPTURE(itopk);
    REQUIRE(ids_a == ids_b);
    REQUIRE(std::memcmp(dist_a.data(), dist_b.data(), dist_a.size() * sizeof(float)) == 0);
  }
  save_index(loaded, dir.file("again.isx"));
  REQUIRE(read_bytes(dir.file("again.isx")) == bytes);
}

namespace {

/// One random index for the property test: small rows, small graphs, every knob that changes a
/// search drawn at random.
index_config random_config(std::mt19937_64& rng)
{
  index_config c;
  c.dim          = 5 + static_cast<std::int64_t>(rng() % 8);  // padded: 8 or 16 elements
  c.metric       = rng() % 3 == 0   ? distance_metric::inner_product
                   : rng() % 2 == 0 ? distance_metric::cosine
                                    : distance_metric::squared_l2;
  c.vector_dtype = rng() % 4 == 0 ? dtype::float16 : dtype::float32;
  c.graph_degree = rng() % 2 == 0 ? 4 : 8;
  c.intermediate_graph_degree = 2 * c.graph_degree;
  c.exact_search_threshold    = rng() % 4 == 0 ? static_cast<std::int64_t>(rng() % 30) : -1;
  c.host_entry_points         = rng() % 4 == 0 ? 1 + static_cast<std::int64_t>(rng() % 9) : -1;
  c.max_row_overhead          = rng() % 3 == 0 ? 0.0 : 1.5;
  c.host_traversal_dtype =
    c.vector_dtype == dtype::float32 && rng() % 4 == 0 ? dtype::float16 : dtype::float32;
  return c;
}

/// Clustered rows (a few centres, small spread), so that graphs and entry points matter.
std::vector<float> random_rows(std::mt19937_64& rng, std::int64_t n, std::int64_t d)
{
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> centres(4 * static_cast<std::size_t>(d));
  std::mt19937_64 fixed(static_cast<std::uint64_t>(d));  // the same centres for every namespace
  for (auto& x : centres) {
    x = 3.0f * normal(fixed);
  }
  std::vector<float> v(static_cast<std::size_t>(n * d));
  for (std::int64_t r = 0; r < n; ++r) {
    std::size_t const c = rng() % 4;
    for (std::int64_t e = 0; e < d; ++e) {
      v[static_cast<std::size_t>(r * d + e)] =
        centres[c * static_cast<std::size_t>(d) + static_cast<std::size_t>(e)] + normal(rng);
    }
  }
  return v;
}

/// Every search mode, bit for bit: ids and distances, or the same refusal.
struct search_mode {
  char const* name;
  search_params params;
};

std::vector<search_mode> every_search_mode()
{
  std::vector<search_mode> modes;
  auto add = [&](char const* name, auto&& set) {
    search_params p;
    set(p);
    modes.push_back({name, p});
  };
  add("fast automatic", [](search_params&) {});
  add("fast graph", [](search_params& p) { p.algo = search_algo::graph; });
  add("fast graph itopk 12, 3 expansions", [](search_params& p) {
    p.algo           = search_algo::graph;
    p.itopk_size     = 12;
    p.max_iterations = 3;
  });
  add("exact", [](search_params& p) { p.algo = search_algo::exact; });
  add("reference automatic", [](search_params& p) { p.host_mode = host_search_mode::reference; });
  add("reference graph", [](search_params& p) {
    p.host_mode = host_search_mode::reference;
    p.algo      = search_algo::graph;
  });
  add("reference graph width 2, itopk 24, 2 samplings", [](search_params& p) {
    p.host_mode            = host_search_mode::reference;
    p.algo                 = search_algo::graph;
    p.search_width         = 2;
    p.itopk_size           = 24;
    p.num_random_samplings = 2;
  });
  add("reference split 3", [](search_params& p) {
    p.host_mode      = host_search_mode::reference;
    p.algo           = search_algo::graph;
    p.ctas_per_query = 3;
  });
  add("reference split automatic", [](search_params& p) {
    p.host_mode      = host_search_mode::reference;
    p.algo           = search_algo::graph;
    p.ctas_per_query = 0;
  });
  return modes;
}

}  // namespace

TEST_CASE("persist: random operation sequences round-trip to bit-identical answers",
          "[index][persist][property]")
{
  constexpr int sequences = 1000;
  std::mt19937_64 rng(0x5EED2026);
  scratch_dir dir;
  std::string const path   = dir.file("sequence.isx");
  std::string const again  = dir.file("again.isx");
  auto const modes         = every_search_mode();
  std::uint64_t operations = 0, slots = 0, filled = 0, stale = 0, emptied = 0, searches = 0;
  std::uint64_t const pool[] = {1, 2, 3, 4, 5};
  for (int sequence = 0; sequence < sequences; ++sequence) {
    CAPTURE(sequence);
    index_config const config = random_config(rng);
    graph_index original{config};
    std::uint64_t next_id = 1;
    std::int64_t const d  = config.dim;
    // every eighth sequence grows a namespace past the rebuild limit (256 rows), so that later
    // adds insert into its graph instead of rebuilding it
    bool const large = sequence % 8 == 0;
    int const steps  = 3 + static_cast<int>(rng() % 4);
    std::vector<std::uint64_t> gone_namespaces;
    for (int step = 0; step < steps; ++step, ++operations) {
      std::uint64_t const ns = pool[rng() % 5];
      unsigned const what    = static_cast<unsigned>(rng() % 10);
      if (step == 0 && large) {
        std::int64_t const n       = 257 + static_cast<std::int64_t>(rng() % 24);
        std::vector<float> const v = random_rows(rng, n, d);
        std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
        for (auto& id : ids) {
          id = next_id++;
        }
        original.add(ns,
                     make_matrix_view<float const>(v.data(), n, d),
                     cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
      } else if (what < 4) {  // add
        std::int64_t const n       = 1 + static_cast<std::int64_t>(rng() % (large ? 12 : 24));
        std::vector<float> const v = random_rows(rng, n, d);
        std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
        for (auto& id : ids) {
          id = next_id++;
        }
        original.add(ns,
                     make_matrix_view<float const>(v.data(), n, d),
                     cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
      } else if (what < 6) {  // erase some facts of a namespace, sometimes all of them
        std::vector<std::uint64_t> live = original.ids(ns);
        std::shuffle(live.begin(), live.end(), rng);
        std::size_t const m =
          rng() % 5 == 0 ? live.size() : std::min<std::size_t>(live.size(), 1 + rng() % 6);
        live.resize(m);
        erase_ids(original, live);
      } else if (what == 6) {  // update: facts erased and added again under their ids, new rows
        std::vector<std::uint64_t> live = original.ids(ns);
        std::shuffle(live.begin(), live.end(), rng);
        live.resize(std::min<std::size_t>(live.size(), 1 + rng() % 4));
        erase_ids(original, live);
        std::int64_t const n       = static_cast<std::int64_t>(live.size());
        std::vector<float> const v = random_rows(rng, n, d);
        original.add(ns,
                     make_matrix_view<float const>(v.data(), n, d),
                     cuda::std::span<std::uint64_t const>(live.data(), live.size()));
      } else if (what == 7) {
        original.compact();
      } else if (what == 8) {  // replace a namespace: new rows, or none (alive and empty)
        std::int64_t const n       = rng() % 3 == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % 20);
        std::vector<float> const v = random_rows(rng, n, d);
        std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
        for (auto& id : ids) {
          id = next_id++;
        }
        original.build(ns,
                       make_matrix_view<float const>(v.data(), n, d),
                       cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
      } else {
        (void)original.erase_namespace(ns);
      }
    }
    save_index(original, path);
    std::vector<unsigned char> const bytes = read_bytes(path);
    for (auto const& tr : read_layout(bytes).tenants) {
      stale += tr.entries_rows < tr.size ? 1 : 0;
      emptied += tr.live == 0 ? 1 : 0;
    }
    graph_index loaded = load_index(path);
    require_same_contents(original, loaded);
    REQUIRE(loaded.config().host_entry_points == config.host_entry_points);
    REQUIRE(loaded.config().host_traversal_dtype == config.host_traversal_dtype);
    for (std::uint64_t ns : original.namespaces()) {
      REQUIRE(index_access::host_entry_points(loaded, ns) ==
              index_access::host_entry_points(original, ns));
      REQUIRE(index_access::host_default_ef(loaded, ns) ==
              index_access::host_default_ef(original, ns));
    }
    if (sequence % 10 == 0) {  // saving the loaded index writes the same bytes
      save_index(loaded, again);
      REQUIRE(read_bytes(again) == bytes);
    }

    // queries in every namespace of the pool: live, emptied, erased and never created ones
    std::int64_t const per     = 2;
    std::int64_t const nq      = per * 5;
    std::uint32_t const k      = 1 + static_cast<std::uint32_t>(rng() % 8);
    std::vector<float> const q = random_rows(rng, nq, d);
    for (auto const& mode : modes) {
      CAPTURE(mode.name, k);
      for (std::uint64_t ns : pool) {
        CAPTURE(ns);
        std::vector<std::uint64_t> const one(1, ns);
        std::vector<std::uint64_t> ids_a(per * k), ids_b(per * k);
        std::vector<float> dist_a(per * k), dist_b(per * k);
        auto run =
          [&](graph_index const& index, std::vector<std::uint64_t>& ids, std::vector<float>& dist) {
            inferscale::search(index,
                               make_matrix_view<float const>(q.data() + (ns - 1) * per * d, per, d),
                               cuda::std::span<std::uint64_t const>(one.data(), 1),
                               k,
                               mode.params,
                               make_matrix_view<std::uint64_t>(ids.data(), per, k),
                               make_matrix_view<float>(dist.data(), per, k));
          };
        if (!original.has_namespace(ns)) {  // both refuse it
          REQUIRE_FALSE(loaded.has_namespace(ns));
          REQUIRE_THROWS_AS(run(original, ids_a, dist_a), inferscale::logic_error);
          REQUIRE_THROWS_AS(run(loaded, ids_b, dist_b), inferscale::logic_error);
          continue;
        }
        run(original, ids_a, dist_a);
        run(loaded, ids_b, dist_b);
        ++searches;
        REQUIRE(ids_a == ids_b);
        REQUIRE(std::memcmp(dist_a.data(), dist_b.data(), dist_a.size() * sizeof(float)) == 0);
        slots += ids_a.size();
        filled += static_cast<std::uint64_t>(std::count_if(
          ids_a.begin(), ids_a.end(), [](std::uint64_t id) { return id != invalid_fact_id; }));
      }
    }
  }
  WARN("index save/load property: " << sequences << " random operation sequences (" << operations
                                    << " operations), " << searches << " searches in "
                                    << modes.size() << " modes, " << slots << " result slots ("
                                    << filled << " filled) bit-identical after the round trip; "
                                    << stale << " saved namespaces had entry points older "
                                    << "than their last rows, " << emptied << " had no live fact");
  // not vacuous: most slots hold facts, and the history-dependent state was exercised
  REQUIRE(filled * 2 > slots);
  REQUIRE(stale >= sequences / 40);
  REQUIRE(emptied >= sequences / 20);
}
