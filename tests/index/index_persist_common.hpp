// The fixtures of the index persistence tests (index_persist.cpp on the host,
// index_persist_gpu.cpp on the device): a scratch directory, the file layout read at the offsets
// documented in serialize.hpp, a bit-at-a-time CRC-64/XZ, scenarios of several namespaces and the
// comparisons of a loaded index with the saved one. Written independently of the code under test.
#pragma once

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
// graph_index's internals (raw rows, tenant segments, search plans): the detail accessor
using Catch::Contains;
using inferscale::detail::index::index_access;

namespace inferscale_index_persist {

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

inline std::vector<unsigned char> read_bytes(std::string const& path)
{
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(std::string const& path, std::vector<unsigned char> const& bytes)
{
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<char const*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

/// The message of the logic_error that loading `path` throws; "" when it loads.
inline std::string load_error(std::string const& path)
{
  try {
    (void)load_index(path);
  } catch (inferscale::logic_error const& e) {
    return e.what();
  }
  return "";
}

inline std::string save_error(graph_index const& index, std::string const& path)
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
inline std::uint64_t reference_crc64(unsigned char const* data, std::size_t bytes)
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

inline std::uint64_t le(std::vector<unsigned char> const& b, std::size_t at, int bytes)
{
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) {
    v = (v << 8) | b[at + static_cast<std::size_t>(i)];
  }
  return v;
}

inline void put(std::vector<unsigned char>& b, std::size_t at, std::uint64_t v, int bytes)
{
  for (int i = 0; i < bytes; ++i) {
    b[at + static_cast<std::size_t>(i)] = static_cast<unsigned char>(v >> (8 * i));
  }
}

/// Recomputes both checksums (bytes [72, 80) and the last 8), as a writer would.
inline void reseal(std::vector<unsigned char>& b)
{
  put(b, 72, reference_crc64(b.data(), 72), 8);
  put(b, b.size() - 8, reference_crc64(b.data(), b.size() - 8), 8);
}

/// Offsets of one tenant record, from the documented layout.
struct tenant_layout {
  std::uint64_t ns{0};
  std::size_t size{0};
  std::size_t live{0};
  std::size_t entries_rows{0};
  std::size_t default_ef{0};
  std::size_t record{0};  ///< namespace, size, live, entry rows, default ef
  std::size_t ids{0};
  std::size_t deleted{0};
  std::size_t vectors{0};
  std::size_t graph{0};
  std::size_t ranks{0};  ///< entry ranks, uint32 per row
  std::size_t end{0};
};

struct file_layout {
  std::size_t element_size{0};
  std::size_t row_elements{0};
  std::size_t degree{0};
  std::vector<tenant_layout> tenants;
};

inline file_layout read_layout(std::vector<unsigned char> const& b)
{
  file_layout f;
  f.element_size              = le(b, 25, 1) == 0 ? 4 : 2;
  f.degree                    = le(b, 28, 4);
  f.row_elements              = le(b, 48, 8);
  std::size_t at              = 80;
  std::uint64_t const tenants = le(b, 56, 8);
  for (std::uint64_t t = 0; t < tenants; ++t) {
    tenant_layout r;
    r.record       = at;
    r.ns           = le(b, at, 8);
    r.size         = le(b, at + 8, 4);
    r.live         = le(b, at + 12, 4);
    r.entries_rows = le(b, at + 16, 4);
    r.default_ef   = le(b, at + 20, 4);
    r.ids          = at + 24;
    r.deleted      = r.ids + 8 * r.size;
    r.vectors      = r.deleted + r.size;
    r.graph        = r.vectors + r.size * f.row_elements * f.element_size;
    r.ranks        = r.graph + 4 * r.size * f.degree;
    r.end          = r.ranks + 4 * r.size;
    at             = r.end;
    f.tenants.push_back(r);
  }
  return f;
}

// ------------------------------------------------------------------------------------------------
// Indexes

inline constexpr std::int64_t dim =
  37;  // padded to 40 elements in both dtypes: padding is exercised

inline index_config make_config(dtype t, distance_metric m)
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

inline void erase_ids(graph_index& index, std::vector<std::uint64_t> const& ids)
{
  index.erase(cuda::std::span<std::uint64_t const>(ids.data(), ids.size()));
}

/**
 * Namespaces 11 (600 rows, every 7th deleted), 22 (300 rows, then 100 more inserted after 33 was
 * created, so it moved and left a hole; a few deleted), 33 (40 rows, 10 deleted, then fact 1000,
 * deleted from 11, added again here), 44 (erased) and 55 (emptied by an empty build: alive, no
 * rows).
 */
inline graph_index make_scenario(dtype t, distance_metric m, fact_source& source)
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
  REQUIRE(index_access::arena_rows_in_use(index) > 600 + 400 + 41);  // holes
  return index;
}

inline std::size_t vector_row_bytes(graph_index const& index)
{
  return static_cast<std::size_t>(index_access::row_elements(index)) *
         size_of(index.config().vector_dtype);
}

/// Everything persistence promises to keep, compared through the public accessors.
inline void require_same_contents(graph_index const& a, graph_index const& b)
{
  REQUIRE(b.config().dim == a.config().dim);
  REQUIRE(b.config().metric == a.config().metric);
  REQUIRE(b.config().vector_dtype == a.config().vector_dtype);
  REQUIRE(b.config().graph_degree == a.config().graph_degree);
  REQUIRE(b.config().intermediate_graph_degree == a.config().intermediate_graph_degree);
  REQUIRE(b.config().exact_search_threshold == a.config().exact_search_threshold);
  REQUIRE(index_access::row_elements(b) == index_access::row_elements(a));
  REQUIRE(b.namespaces() == a.namespaces());
  REQUIRE(b.num_namespaces() == a.num_namespaces());
  REQUIRE(b.total_size() == a.total_size());
  std::size_t const row_bytes = vector_row_bytes(a);
  std::size_t const degree    = index_access::graph_degree(a);
  for (std::uint64_t ns : a.namespaces()) {
    CAPTURE(ns);
    std::size_t const rows = a.rows(ns);
    REQUIRE(b.rows(ns) == rows);
    REQUIRE(b.size(ns) == a.size(ns));
    REQUIRE(b.ids(ns) == a.ids(ns));
    if (rows == 0) { continue; }
    REQUIRE(std::equal(index_access::id_rows(a, ns),
                       index_access::id_rows(a, ns) + rows,
                       index_access::id_rows(b, ns)));
    REQUIRE(std::equal(index_access::deleted_rows(a, ns),
                       index_access::deleted_rows(a, ns) + rows,
                       index_access::deleted_rows(b, ns)));
    REQUIRE(std::memcmp(index_access::vector_rows(a, ns),
                        index_access::vector_rows(b, ns),
                        rows * row_bytes) == 0);
    REQUIRE(std::equal(index_access::graph_rows(a, ns),
                       index_access::graph_rows(a, ns) + rows * degree,
                       index_access::graph_rows(b, ns)));
    for (std::uint64_t id : a.ids(ns)) {
      REQUIRE(b.namespace_of(id) == ns);
    }
  }
}

/// Searches both indexes with the same queries under every algorithm; results must be identical.
inline void require_same_searches(graph_index const& a, graph_index const& b, distance_metric m)
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
inline void mutate(graph_index& index, fact_source& source)
{
  source.add(index, 22, 6000, 30);  // incremental insert; the loaded tenant has no spare capacity
  source.add(index, 66, 6600, 25);  // a new namespace
  source.add(index, 55, 5500, 5);   // the emptied namespace again
  erase_ids(index, {1001, 2002, 6001});
  index.compact();
}

}  // namespace inferscale_index_persist
