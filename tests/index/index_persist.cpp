// Host tests of graph_index persistence (inferscale/detail/index/serialize.hpp): save_index and
// load_index. They run everywhere: no GPU is needed.
//
// Expectations are written here, never taken from the code under test:
//  - the file layout is read at the offsets documented in serialize.hpp's file comment, the file
//    length is the documented formula 88 + 16 T + R (9 + W + 4 D), and the checksums are
//    recomputed with a bit-at-a-time CRC-64/XZ written here (itself checked against the published
//    check value of "123456789");
//  - a loaded index is compared with the one that was saved through the public accessors
//    (namespaces, ids, rows, deleted flags, vector bytes, graph bytes) and by searching both;
//    then both receive the same mutations and must stay equal;
//  - corruption, truncation and forged files (checksums recomputed here, so that only the
//    consistency checks can catch them) must be refused with a logic_error naming the problem.
#include "gaussian_mixture.hpp"

#include <inferscale/error.hpp>
#include <inferscale/index.hpp>
#include <inferscale/index_snapshot.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace inferscale;
using Catch::Contains;

namespace {

namespace fs = std::filesystem;

// ------------------------------------------------------------------------------------------------
// Files

/// A fresh directory under the system's temporary directory, removed with its contents.
class scratch_dir {
 public:
  scratch_dir()
  {
    std::random_device entropy;
    auto const stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_            = fs::temp_directory_path() /
            ("inferscale_persist_" + std::to_string(stamp) + "_" + std::to_string(entropy()));
    fs::create_directories(path_);
  }
  scratch_dir(scratch_dir const&)            = delete;
  scratch_dir& operator=(scratch_dir const&) = delete;
  ~scratch_dir()
  {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  std::string file(std::string const& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::vector<unsigned char> read_bytes(std::string const& path)
{
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(std::string const& path, std::vector<unsigned char> const& bytes)
{
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

/// The message of the logic_error that loading `path` throws; "" when it loads.
std::string load_error(std::string const& path)
{
  try {
    (void)load_index(path);
  } catch (inferscale::logic_error const& e) {
    return e.what();
  }
  return "";
}

std::string save_error(graph_index const& index, std::string const& path)
{
  try {
    save_index(index, path);
  } catch (inferscale::logic_error const& e) {
    return e.what();
  }
  return "";
}

// ------------------------------------------------------------------------------------------------
// The documented format, read independently

/// CRC-64/XZ one bit at a time: reflected ECMA-182 polynomial, all-ones initial value and final
/// XOR.
std::uint64_t reference_crc64(unsigned char const* data, std::size_t bytes)
{
  std::uint64_t r = ~std::uint64_t{0};
  for (std::size_t i = 0; i < bytes; ++i) {
    r ^= data[i];
    for (int bit = 0; bit < 8; ++bit) {
      r = (r & 1u) != 0 ? (r >> 1) ^ 0xC96C5795D7870F42ull : r >> 1;
    }
  }
  return ~r;
}

std::uint64_t le(std::vector<unsigned char> const& b, std::size_t at, int bytes)
{
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) {
    v = (v << 8) | b[at + static_cast<std::size_t>(i)];
  }
  return v;
}

void put(std::vector<unsigned char>& b, std::size_t at, std::uint64_t v, int bytes)
{
  for (int i = 0; i < bytes; ++i) {
    b[at + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
  }
}

/// Recomputes both checksums (bytes [72, 80) and the last 8), as a writer would.
void reseal(std::vector<unsigned char>& b)
{
  put(b, 72, reference_crc64(b.data(), 72), 8);
  put(b, b.size() - 8, reference_crc64(b.data(), b.size() - 8), 8);
}

/// Offsets of one tenant record, from the documented layout.
struct tenant_layout {
  std::uint64_t ns{0};
  std::size_t size{0};
  std::size_t live{0};
  std::size_t record{0};  ///< namespace, size, live
  std::size_t ids{0};
  std::size_t deleted{0};
  std::size_t vectors{0};
  std::size_t graph{0};
  std::size_t end{0};
};

struct file_layout {
  std::size_t element_size{0};
  std::size_t row_elements{0};
  std::size_t degree{0};
  std::vector<tenant_layout> tenants;
};

file_layout read_layout(std::vector<unsigned char> const& b)
{
  file_layout f;
  f.element_size              = le(b, 25, 1) == 0 ? 4 : 2;
  f.degree                    = le(b, 28, 4);
  f.row_elements              = le(b, 48, 8);
  std::size_t at              = 80;
  std::uint64_t const tenants = le(b, 56, 8);
  for (std::uint64_t t = 0; t < tenants; ++t) {
    tenant_layout r;
    r.record  = at;
    r.ns      = le(b, at, 8);
    r.size    = le(b, at + 8, 4);
    r.live    = le(b, at + 12, 4);
    r.ids     = at + 16;
    r.deleted = r.ids + 8 * r.size;
    r.vectors = r.deleted + r.size;
    r.graph   = r.vectors + r.size * f.row_elements * f.element_size;
    r.end     = r.graph + 4 * r.size * f.degree;
    at        = r.end;
    f.tenants.push_back(r);
  }
  return f;
}

// ------------------------------------------------------------------------------------------------
// Indexes

constexpr std::int64_t dim = 37;  // padded to 40 elements in both dtypes: padding is exercised

index_config make_config(dtype t, distance_metric m)
{
  index_config c;
  c.dim                       = dim;
  c.metric                    = m;
  c.vector_dtype              = t;
  c.graph_degree              = 16;
  c.intermediate_graph_degree = 32;
  c.exact_search_threshold    = 50;  // the 41-row namespace is searched exactly under automatic
  return c;
}

struct fact_source {
  test::gaussian_mixture mixture;
  explicit fact_source(distance_metric m, std::uint64_t seed)
    : mixture(test::mixture_spec{dim, 12, m != distance_metric::squared_l2, seed})
  {
  }

  void add(graph_index& index, std::uint64_t ns, std::uint64_t first_id, std::int64_t n)
  {
    std::vector<float> const v = mixture.draw(n);
    std::vector<std::uint64_t> ids(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ids[i] = first_id + i;
    }
    index.add(ns,
              make_matrix_view<float const>(v.data(), n, dim),
              cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
  }
};

void erase_ids(graph_index& index, std::vector<std::uint64_t> const& ids)
{
  index.erase(cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
}

/**
 * Namespaces 11 (600 rows, every 7th deleted), 22 (300 rows, then 100 more inserted after 33 was
 * created, so it moved and left a hole; a few deleted), 33 (40 rows, 10 deleted, then fact 1000,
 * deleted from 11, added again here), 44 (erased) and 55 (emptied by an empty build: alive, no
 * rows).
 */
graph_index make_scenario(dtype t, distance_metric m, fact_source& source)
{
  graph_index index{make_config(t, m)};
  source.add(index, 11, 1000, 600);
  source.add(index, 22, 2000, 300);
  source.add(index, 33, 3000, 40);
  source.add(index, 22, 2300, 100);
  source.add(index, 44, 4000, 50);
  source.add(index, 55, 5000, 20);
  std::vector<std::uint64_t> erased;
  for (std::uint64_t id = 1000; id < 1600; id += 7) {
    erased.push_back(id);
  }
  for (std::uint64_t id : {2001, 2150, 2299, 2300, 2399}) {
    erased.push_back(id);
  }
  for (std::uint64_t id = 3000; id < 3010; ++id) {
    erased.push_back(id);
  }
  erase_ids(index, erased);
  REQUIRE(index.erase_namespace(44) == 50);
  std::vector<float> const none;
  std::vector<std::uint64_t> const no_ids;
  index.build(55,
              make_matrix_view<float const>(none.data(), 0, dim),
              cuda::std::span<std::uint64_t const>(no_ids.data(), 0));
  source.add(index, 33, 1000, 1);
  // the scenario is what it claims to be
  REQUIRE(index.namespaces() == std::vector<std::uint64_t>{11, 22, 33, 55});
  REQUIRE(index.rows(11) == 600);
  REQUIRE(index.size(11) == 600 - 86);
  REQUIRE(index.rows(22) == 400);
  REQUIRE(index.size(22) == 395);
  REQUIRE(index.rows(33) == 41);
  REQUIRE(index.size(33) == 31);
  REQUIRE(index.rows(55) == 0);
  REQUIRE(index.has_namespace(55));
  REQUIRE(index.arena_rows_in_use() > 600 + 400 + 41);  // holes
  return index;
}

std::size_t vector_row_bytes(graph_index const& index)
{
  return static_cast<std::size_t>(index.row_elements()) * size_of(index.config().vector_dtype);
}

/// Everything persistence promises to keep, compared through the public accessors.
void require_same_contents(graph_index const& a, graph_index const& b)
{
  REQUIRE(b.config().dim == a.config().dim);
  REQUIRE(b.config().metric == a.config().metric);
  REQUIRE(b.config().vector_dtype == a.config().vector_dtype);
  REQUIRE(b.config().graph_degree == a.config().graph_degree);
  REQUIRE(b.config().intermediate_graph_degree == a.config().intermediate_graph_degree);
  REQUIRE(b.config().exact_search_threshold == a.config().exact_search_threshold);
  REQUIRE(b.row_elements() == a.row_elements());
  REQUIRE(b.namespaces() == a.namespaces());
  REQUIRE(b.num_namespaces() == a.num_namespaces());
  REQUIRE(b.total_size() == a.total_size());
  std::size_t const row_bytes = vector_row_bytes(a);
  std::size_t const degree    = a.graph_degree();
  for (std::uint64_t ns : a.namespaces()) {
    CAPTURE(ns);
    std::size_t const rows = a.rows(ns);
    REQUIRE(b.rows(ns) == rows);
    REQUIRE(b.size(ns) == a.size(ns));
    REQUIRE(b.ids(ns) == a.ids(ns));
    if (rows == 0) { continue; }
    REQUIRE(std::equal(a.id_rows(ns), a.id_rows(ns) + rows, b.id_rows(ns)));
    REQUIRE(std::equal(a.deleted_rows(ns), a.deleted_rows(ns) + rows, b.deleted_rows(ns)));
    REQUIRE(std::memcmp(a.vector_rows(ns), b.vector_rows(ns), rows * row_bytes) == 0);
    REQUIRE(std::equal(a.graph_rows(ns), a.graph_rows(ns) + rows * degree, b.graph_rows(ns)));
    for (std::uint64_t id : a.ids(ns)) {
      REQUIRE(b.namespace_of(id) == ns);
    }
  }
}

/// Searches both indexes with the same queries under every algorithm; results must be identical.
void require_same_searches(graph_index const& a, graph_index const& b, distance_metric m)
{
  test::gaussian_mixture queries_source(
    test::mixture_spec{dim, 12, m != distance_metric::squared_l2, 99});
  std::int64_t const nq      = 24;
  std::uint32_t const k      = 10;
  std::vector<float> const q = queries_source.draw(nq);
  std::vector<std::uint64_t> namespaces;
  std::vector<std::uint64_t> const cycle = a.namespaces();
  for (std::int64_t i = 0; i < nq; ++i) {
    namespaces.push_back(cycle[static_cast<std::size_t>(i) % cycle.size()]);
  }
  std::size_t valid = 0;
  for (auto algo : {search_algo::automatic, search_algo::graph, search_algo::exact}) {
    CAPTURE(static_cast<int>(algo));
    search_params p;
    p.algo = algo;
    std::vector<std::uint64_t> ids_a(nq * k), ids_b(nq * k);
    std::vector<float> dist_a(nq * k), dist_b(nq * k);
    auto const run = [&](graph_index const& index,
                         std::vector<std::uint64_t>& ids,
                         std::vector<float>& dist) {
      inferscale::search(index,
                         make_matrix_view<float const>(q.data(), nq, dim),
                         cuda::std::span<std::uint64_t const>(namespaces.data(), namespaces.size()),
                         k,
                         p,
                         make_matrix_view<std::uint64_t>(ids.data(), nq, k),
                         make_matrix_view<float>(dist.data(), nq, k));
    };
    run(a, ids_a, dist_a);
    run(b, ids_b, dist_b);
    REQUIRE(ids_a == ids_b);
    REQUIRE(std::memcmp(dist_a.data(), dist_b.data(), dist_a.size() * sizeof(float)) == 0);
    valid += static_cast<std::size_t>(std::count_if(
      ids_a.begin(), ids_a.end(), [](std::uint64_t id) { return id != invalid_fact_id; }));
  }
  // not vacuous: at least a third of all result slots hold a fact (one namespace in four or five
  // is empty or nearly so)
  REQUIRE(valid >= 3 * static_cast<std::size_t>(nq) * k / 3);
}

/// The same mutations, applied to both: they must stay equal (the loaded index is fully usable).
void mutate(graph_index& index, fact_source& source)
{
  source.add(index, 22, 6000, 30);  // incremental insert; the loaded tenant has no spare capacity
  source.add(index, 66, 6600, 25);  // a new namespace
  source.add(index, 55, 5500, 5);   // the emptied namespace again
  erase_ids(index, {1001, 2002, 6001});
  index.compact();
}

}  // namespace

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
  REQUIRE(bytes.size() == 88 + 16 * tenants + rows * (9 + w + 4 * 16));
  std::vector<unsigned char> const magic = {0x89, 'I', 'S', 'I', 'D', 'X', 0x0D, 0x0A};
  REQUIRE(std::equal(magic.begin(), magic.end(), bytes.begin()));
  REQUIRE(le(bytes, 8, 4) == 1);
  REQUIRE((bytes[12] == 4 && bytes[13] == 3 && bytes[14] == 2 && bytes[15] == 1));
  REQUIRE(le(bytes, 16, 8) == 37);
  REQUIRE(le(bytes, 24, 1) == (m == distance_metric::inner_product ? 0u
                               : m == distance_metric::cosine      ? 1u
                                                                   : 2u));
  REQUIRE(le(bytes, 25, 1) == (t == dtype::float32 ? 0u : 1u));
  REQUIRE(le(bytes, 26, 2) == 0);
  REQUIRE(le(bytes, 28, 4) == 16);
  REQUIRE(le(bytes, 32, 4) == 32);
  REQUIRE(le(bytes, 36, 4) == 0);
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
    for (std::size_t v = 0; v < tr.size; ++v) {
      REQUIRE(le(bytes, tr.ids + 8 * v, 8) == original.id_rows(tr.ns)[v]);
      REQUIRE(bytes[tr.deleted + v] == original.deleted_rows(tr.ns)[v]);
      for (std::size_t e = 0; e < 16; ++e) {
        REQUIRE(le(bytes, tr.graph + 4 * (v * 16 + e), 4) ==
                original.graph_rows(tr.ns)[v * 16 + e]);
      }
    }
    if (tr.size > 0) {
      REQUIRE(std::memcmp(bytes.data() + tr.vectors, original.vector_rows(tr.ns), tr.size * w) ==
              0);
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
    std::size_t const starts[] = {tr.ids, tr.deleted, tr.vectors, tr.graph};
    std::size_t const ends[]   = {tr.deleted, tr.vectors, tr.graph, tr.end};
    for (int region = 0; region < 4; ++region) {
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
                            " is not supported (this build reads 1)"));
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
  REQUIRE(size == 88 + 16 + 300 * (9 + 160 + 64));

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
  CHECK_THAT(load_error(other), Contains("format version 7 is not supported (this build reads 1)"));

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
     "truncated: expected " + std::to_string(good.size() + 16) + " bytes"},
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

TEST_CASE("persist: load into device memory puts the same arena on the device", "[index][persist][gpu]")
{
  // the device copy is what the device search reads: read it back through ref() and compare it
  // row by row with the host mirror of the saved index
  scratch_dir dir;
  auto const t = GENERATE(dtype::float32, dtype::float16);
  fact_source source{distance_metric::cosine, 5};
  graph_index const original = make_scenario(t, distance_metric::cosine, source);
  std::string const path     = dir.file("device.isidx");
  save_index(original, path);
  graph_index const loaded = load_index(path, memory_space::device);
  REQUIRE(loaded.space() == memory_space::device);
  require_same_contents(original, loaded);

  graph_index_ref const ref = loaded.ref();
  REQUIRE(ref.vectors != nullptr);
  std::size_t const row_bytes = vector_row_bytes(loaded);
  std::size_t const degree    = loaded.graph_degree();
  for (std::uint64_t ns : loaded.namespaces()) {
    auto const seg = loaded.tenant_segment(ns);
    CAPTURE(ns);
    std::vector<unsigned char> vectors(seg.size * row_bytes);
    std::vector<std::uint32_t> graph(seg.size * degree);
    std::vector<std::uint64_t> ids(seg.size);
    std::vector<std::uint8_t> deleted(seg.size);
    if (seg.size == 0) { continue; }
    INFERSCALE_CUDA_TRY(cudaMemcpy(vectors.data(),
                                   static_cast<unsigned char const*>(ref.vectors) +
                                     static_cast<std::size_t>(seg.row_begin) * row_bytes,
                                   vectors.size(), cudaMemcpyDeviceToHost));
    INFERSCALE_CUDA_TRY(cudaMemcpy(graph.data(), ref.graph + seg.row_begin * std::int64_t(degree),
                                   graph.size() * 4, cudaMemcpyDeviceToHost));
    INFERSCALE_CUDA_TRY(cudaMemcpy(ids.data(), ref.ids + seg.row_begin, ids.size() * 8,
                                   cudaMemcpyDeviceToHost));
    INFERSCALE_CUDA_TRY(cudaMemcpy(deleted.data(), ref.deleted + seg.row_begin, deleted.size(),
                                   cudaMemcpyDeviceToHost));
    REQUIRE(std::memcmp(vectors.data(), original.vector_rows(ns), vectors.size()) == 0);
    REQUIRE(std::memcmp(graph.data(), original.graph_rows(ns), graph.size() * 4) == 0);
    REQUIRE(std::memcmp(ids.data(), original.id_rows(ns), ids.size() * 8) == 0);
    REQUIRE(std::memcmp(deleted.data(), original.deleted_rows(ns), deleted.size()) == 0);
  }
}
