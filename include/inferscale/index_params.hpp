/**
 * @file index_params.hpp
 * @brief The fact index's parameters: what an index is built with (`index_config`, `knn_build`,
 * `graph_builder`), what a search is run with (`search_params`, `search_algo`,
 * `host_search_mode`) and the constexpr rules that resolve their automatic values (top list,
 * split search, entry points), plus `matrix_view`, the view embeddings and results cross the API
 * in. Shared by the host backend (`index.hpp`) and the device backend (`index.cuh`); plain C++17.
 */
#pragma once

#include <inferscale/detail/index/graph_build.hpp>
#include <inferscale/detail/index/math.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/memory_space.hpp>
#include <inferscale/views.hpp>

#include <cuda/std/array>
#include <cuda/std/mdspan>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace inferscale {

/// @brief A `[rows, cols]` matrix view with a row stride (in elements): embeddings and results.
template <class T>
using matrix_view = cuda::std::mdspan<T, extents_t<2>, cuda::std::layout_stride>;

/// @brief Makes a matrix_view; `row_stride` defaults to `cols` (contiguous rows).
template <class T>
matrix_view<T> make_matrix_view(T* data,
                                std::int64_t rows,
                                std::int64_t cols,
                                std::int64_t row_stride = -1)
{
  using mapping = cuda::std::layout_stride::mapping<extents_t<2>>;
  return matrix_view<T>{data,
                        mapping{extents_t<2>{rows, cols},
                                cuda::std::array<std::int64_t, 2>{
                                  row_stride < 0 ? cols : row_stride, std::int64_t{1}}}};
}

/// @brief How the host builds the kNN graph a namespace's graph is pruned from (a
/// `graph_builder` with a `knn` callback, such as the device one, replaces it).
enum class knn_build : std::uint8_t {
  /// exact up to `exact_knn_max_rows` rows, NN-descent above
  automatic,
  exact,      ///< brute force, O(n^2 dim); the device builder's kNN graph, up to near-ties
  nn_descent  ///< approximate, `detail::index::nn_descent_knn_host`; host-only graphs
};

/// @brief Name of a kNN build ("automatic", "exact", "nn_descent").
inline char const* to_string(knn_build b) noexcept
{
  switch (b) {
    case knn_build::automatic: return "automatic";
    case knn_build::exact: return "exact";
    case knn_build::nn_descent: return "nn_descent";
  }
  return "unknown";
}

/**
 * @brief Under `knn_build::automatic`, namespaces of at most this many rows get the exact kNN
 * graph. Measured on 2026-12-01 (the whole `graph_index::add`, CPU seconds, NN-descent on one
 * thread with the block dot products, the exact kNN on both cores, Gaussian mixture, k 64), exact
 * / NN-descent: 3,000 rows 0.43 / 0.48 (384-d) and 0.74 / 0.68 (768-d); 5,000 rows 0.99 / 0.89
 * and 2.12 / 1.26; 10,000 rows 3.98 / 1.91 and 8.18 / 2.73. So exact up to 4,000 rows, where it
 * costs about the same and is also the best graph.
 */
inline constexpr std::uint32_t exact_knn_max_rows = 4000;

/**
 * @brief The automatic compaction's allowance for small indexes: the arena may always hold this
 * many rows beyond the live facts (see `index_config::max_row_overhead`), so that an index of a
 * few dozen facts is not repacked on every change.
 */
inline constexpr std::int64_t compaction_floor_rows = 256;

/// @brief NN-descent's knobs (`rho`, `delta`, `max_iterations`, `seed`): see
/// `detail::index::nn_descent_knobs`.
using nn_descent_params = detail::index::nn_descent_knobs;

class memory_resource;  // memory_resource.hpp

/// @brief Fixed properties of an index, chosen at construction.
struct index_config {
  std::int64_t dim{0};                              ///< embedding dimension
  distance_metric metric{distance_metric::cosine};  ///< how embeddings compare
  dtype vector_dtype{dtype::float32};               ///< stored as float32 or float16
  std::uint32_t graph_degree{32};                   ///< CAGRA `graph_degree` (final out-degree)
  std::uint32_t intermediate_graph_degree{64};      ///< CAGRA `intermediate_graph_degree`
  memory_space space{memory_space::host};           ///< where searches run
  /// Where a device index allocates its device arrays (on the null stream); null: cudaMalloc.
  /// Not owned: it must outlive the index. Not stored by `save_index` (like `space`).
  memory_resource* resource{nullptr};
  /// Tenants with at most this many live facts are searched exactly (brute force); -1 = chosen
  /// automatically per search (see `graph_index::exact_search_threshold`).
  std::int64_t exact_search_threshold{-1};
  /// How the host builds a namespace's kNN graph. Not stored by `save_index` (like `memory`):
  /// a loaded index has the defaults.
  knn_build host_knn{knn_build::automatic};
  nn_descent_params nn_descent{};  ///< used when the host builds with NN-descent
  /// Entry points per namespace of the host's fast search (`host_search_mode::fast`): -1 =
  /// automatic (`default_host_entry_points`), else that many (at least 1). Stored by
  /// `save_index` with each namespace's chosen entry points.
  std::int64_t host_entry_points{-1};
  /// Threads a host graph build (exact kNN, pruning, reverse edges and merge) uses at most, the
  /// calling thread included; 0 = one per hardware thread. Any value is valid, and the graph does
  /// not depend on it (NN-descent, inserts and the reachability repair run on the calling thread
  /// alone). Not stored by `save_index`: a loaded index has the default.
  std::uint32_t build_threads{0};
  /**
   * Automatic compaction: after every mutation the arena may hold at most
   * `max(floor(max_row_overhead * total_size()), total_size() + compaction_floor_rows)` rows
   * (`arena_rows()`); a mutation that leaves more repacks the arena before it returns. 0 = never
   * automatically (segments then grow by doubling, and holes and deleted rows stay until
   * `compact()`); otherwise at least 1. Not stored by `save_index` (a loaded index has the
   * default).
   *
   * What a repack does and costs: the namespaces' segments are moved together in creation order
   * (holes vanish; graph node ids are local to a namespace, so a moved namespace keeps its rows,
   * graph and answers bit for bit), and namespaces whose deleted rows must go to reach the target
   * are rebuilt from their live facts (a fresh graph build, most deleted share first, only as many
   * as needed). The target is half way between the live facts and the bound:
   * `max(floor((1 + (max_row_overhead - 1) / 2) * total_size()), total_size() +
   * compaction_floor_rows / 2)` rows, spare rows included (each segment gets up to a quarter of
   * its size spare, within the target). So between two repacks the arena gains at least a
   * quarter of the live facts in holes and growth (at the default 1.5), or a sixth of the live
   * facts are erased: a repack's copy of the arena is paid for by the moves and erasures that
   * made it necessary. Growth itself stays below the bound: with automatic compaction a new
   * namespace takes exactly its rows, a growing one 1.25x what it needs, clipped half way between
   * what is needed and the bound for the facts after the change, and the arena holds what its
   * namespaces take (its vectors reserve up to 1.25x ahead).
   */
  double max_row_overhead{1.5};
  /**
   * What the host's fast graph search (`host_search_mode::fast`) walks the graph on:
   * `float32` (the default) = the stored rows; `float16` (float32 host indexes only) = a float16
   * copy of the rows kept beside them, half the bytes per distance, after which the best
   * entries of the walk are measured again on the float32 rows, so results and distances are
   * the float32 rows' (`detail::index::rerank_exact`). Measured at 100,000 x 384 and x 768 it
   * takes 0.68-0.80 of the float32 walk's time at equal recall (1.03-1.31x hnswlib's speed
   * where the float32 walk gave 0.82-1.00x), and 0.78-0.97 at 8,000-10,000 rows
   * (bench/results/2026-12-02-host-search-traversal.md). It costs 2 bytes per element more
   * (+50 % of the vectors). Vectors must then also fit float16
   * (as for `vector_dtype` float16; cosine rows always do). Under cosine the fast exact search
   * of a small namespace scans the copy too and measures again, on the float32 rows, every row
   * within the copy's error bound of the k-th (`detail::index::exact_search_rounded`): the same
   * exact top k from half the bytes. The reference mode and the builds use the float32 rows. Stored
   * by `save_index`: a host index loaded by `load_index` walks as the saved one did (a device one
   * gets float32).
   */
  dtype host_traversal_dtype{dtype::float32};
};

/**
 * @brief Entry points of a namespace of `rows` rows for the fast host search: 4 sqrt(rows),
 * between 64 and 2,048 (all rows below 64). A pruned kNN graph hardly links clusters, so the
 * entry points must reach every cluster: measured on Gaussian mixtures (fast mode, ef 16-24),
 * 20,000 x 384 with 100 clusters reached recall@10 0.68 with 64 entry points, 0.92 with 128 and
 * 0.99 with 256; with 200 clusters, 283 entry points gave 0.93 at ef 64 (a tenth of the clusters
 * had none); 4 sqrt(20,000) = 566 covers both (bench/results/2026-12-01-index-search-host.md).
 * Scanning them is one stream over packed rows, 4 sqrt(n) row reads against the ~n / 100 a
 * search reads at random.
 */
constexpr std::uint32_t default_host_entry_points(std::uint32_t rows) noexcept
{
  std::uint32_t e = 64;
  while (e < 2048 && std::uint64_t{e} * e < std::uint64_t{16} * rows) {
    ++e;
  }
  return std::min(e, rows);
}

/// @brief Which algorithm a search uses.
enum class search_algo : std::uint8_t {
  automatic,  ///< exact for tenants at or below the exact-search threshold, graph otherwise
  graph,      ///< always the graph beam search (a tenant of one fact is still answered)
  exact       ///< always brute force
};

/**
 * @brief How the host backend runs a search (the device backend ignores it).
 *
 * `fast` (the default) is the host's own algorithm: best-first search from the tenant's entry
 * points (`index_config::host_entry_points`) with vectorised distances summed in the host's
 * order (fused multiply-adds, AVX2/AVX-512 chosen at run time); `reference` runs the sequential
 * spec of `detail/index/search_host.hpp` in the device's summation order, so a host index and a
 * device index built from the same graph give bit-identical answers (the tests' mode).
 */
enum class host_search_mode : std::uint8_t {
  fast,      ///< best-first from the entry points, host-order SIMD distances
  reference  ///< the device's algorithm and distance order, bit for bit
};

/// @brief The top list `search_params::itopk_size` 0 stands for on the device and in the
/// reference mode (CAGRA's default).
inline constexpr std::uint32_t default_itopk = 64;

/// @brief `itopk_size` resolved: 0 -> `default_itopk`, then at least `k`.
constexpr std::uint32_t resolved_itopk(std::uint32_t itopk_size, std::uint32_t k) noexcept
{
  std::uint32_t const t = itopk_size == 0 ? default_itopk : itopk_size;
  return t < k ? k : t;
}

/// @brief The top list of each part of a split search (`search_params::ctas_per_query`).
constexpr std::uint32_t split_itopk(std::uint32_t itopk,
                                    std::uint32_t k,
                                    std::uint32_t parts) noexcept
{
  std::uint32_t const t = detail::ceil_div(itopk, parts);
  return t < k ? k : t;
}

/// @brief The CTAs an automatic split aims to fill: queries x parts stays at or below this (the
/// 132 SMs of an H100 / H200, rounded down to a power of two).
inline constexpr std::int64_t split_auto_ctas = 128;
/// @brief The most parts an automatic split takes (measured on the host, one part's work falls
/// from 1 to about 0.44 of the whole search's at 4 parts and only to 0.37 at 8, while the
/// parts' total work keeps growing: bench/results/2026-12-02-split-search-host.md).
inline constexpr std::uint32_t split_auto_max_parts = 4;
/// @brief The shortest top list an automatic split gives a part (parts of 10 entries were the
/// only ones that lost recall against the whole search in that record).
inline constexpr std::uint32_t split_auto_min_part_itopk = 16;

/**
 * @brief The parts `search_params::ctas_per_query = 0` (automatic) splits each graph search of a
 * batch of `queries` into, for a resolved top list `itopk` (resolved_itopk) and `k`: the largest
 * P in {1, 2, 4} with `queries * P <= split_auto_ctas` whose parts keep
 * `ceil(itopk / P) >= max(k, split_auto_min_part_itopk)` entries each (a part's list is never
 * raised to k, so the parts' lists together hold at most itopk + P - 1 entries).
 * At the defaults (itopk 64, k 10): 4 parts up to 32 queries, 2 up to 64, then 1.
 */
constexpr std::uint32_t auto_ctas_per_query(std::int64_t queries,
                                            std::uint32_t itopk,
                                            std::uint32_t k) noexcept
{
  std::uint32_t const floor_list = k > split_auto_min_part_itopk ? k : split_auto_min_part_itopk;
  std::uint32_t parts            = 1;
  while (parts < split_auto_max_parts && queries * (2 * parts) <= split_auto_ctas &&
         detail::ceil_div(itopk, 2 * parts) >= floor_list) {
    parts *= 2;
  }
  return parts;
}

/// @brief What part `c` of a split search XORs into `rand_xor_mask` (0 for part 0).
constexpr std::uint64_t split_seed_mix(std::uint32_t c) noexcept
{
  return std::uint64_t{c} * 0x9E3779B97F4A7C15ull;
}

/// @brief Knobs of the graph search (CAGRA's names and meanings).
struct search_params {
  /// Internal top list, raised to k when smaller; 0 (the default) = automatic: CAGRA's 64 on
  /// the device and in `host_search_mode::reference`; in the fast host search the namespace's
  /// calibrated list size, the smallest of a grid (10 .. 256) that reached recall@10 0.99 on its
  /// own rows when its entry points were chosen.
  std::uint32_t itopk_size{0};
  std::uint32_t search_width{1};  ///< parents per iteration (1..64)
  /// 0 = CAGRA's automatic bound. (CAGRA's `min_iterations` has no counterpart: here a step
  /// with no new parent changes nothing, so the search simply ends.)
  std::uint32_t max_iterations{0};
  /// Draws per seed slot (the closest is kept). cuVS defaults to 1, which leaves whole clusters
  /// unseeded on clustered embeddings (cuVS issue #2102: ~60 % recall at N >= 100k); measured
  /// here on a 200-cluster mixture (20k x 384): 1 -> 0.43, 4 -> 0.90, 8 -> 0.995 recall@10.
  std::uint32_t num_random_samplings{8};
  std::uint64_t rand_xor_mask{0x128394};  ///< seed generator mask
  search_algo algo{search_algo::automatic};
  /// Host backend only. Under `host_search_mode::fast` the search keeps `itopk_size` (at least
  /// k) results (hnswlib's `ef`), expands one node at a time, and `search_width`,
  /// `num_random_samplings` and `rand_xor_mask` do not apply; `max_iterations`, when not 0,
  /// bounds the nodes expanded (`max_iterations * search_width`).
  host_search_mode host_mode{host_search_mode::fast};
  /// Host fast search only: the neighbours read of each node the walk expands, the first
  /// `host_neighbors` of its adjacency list (0, the default: all `graph_degree`; a larger value
  /// reads all). Fewer is cheaper per expansion and costs recall: one namespace of 1,000 x 384
  /// mixture rows, 8 of 32 answered at recall@10 0.972 and 12-16 at 0.99 with the list at k,
  /// 1.31-1.57x hnswlib's speed with float16 rows (bench/results/2026-12-06-tenants-quiet.md). A
  /// small namespace's cheapest setting for a recall target, but data-dependent: on 4,096 x 16
  /// mixture rows, 16 of 32 levelled off at recall 0.94-0.96 (ef 10-32; all 32: 0.99), and the
  /// namespace's own rows used as probes (as `host_default_ef` is calibrated) still reached 0.99,
  /// so it is not chosen automatically; measure held-out queries before lowering it
  /// (bench/results/2026-12-06-tenants-overhead.md). Exact searches, the reference mode and the
  /// device backend ignore it.
  std::uint32_t host_neighbors{0};
  /**
   * Graph searches split into this many independent parts: 1..16 (1, the default: one search per
   * query), or 0: automatic, auto_ctas_per_query of the call's batch size (4 parts for up to 32
   * queries at the default top list, 2 up to 64, 1 above). The device runs a query's parts on that
   * many CTAs at once: for a small batch, more of the GPU works on each query (CAGRA's multi-CTA
   * idea, without its shared visited set, so that the answer stays deterministic). Part `c`
   * searches with the top list `split_itopk(itopk, k, parts)` = max(k, ceil(itopk / parts)) and the
   * seed mask `rand_xor_mask ^ split_seed_mix(c)` (part 0 keeps the mask); the answer is the best
   * `k` distinct live facts of all parts, in (distance, node) order. The host reference search
   * (`host_search_mode::reference`) runs the same parts one after another, so the two backends
   * still agree bit for bit, automatic choice included (it depends on the batch size only); the
   * fast host search and exact searches ignore it. The automatic choice is not the default, for
   * three reasons: a query's answer then depends on the size of the batch it is searched in (as
   * under CAGRA's automatic algorithm); a split search allocates its parts' workspace and adds a
   * merge launch, so it is neither one launch nor capturable in a CUDA graph; and its rule comes
   * from the work per part measured on the host, as no split has been timed on a GPU yet
   * (`bench_index`'s device cases `ctas:0` and `ctas:P` measure it against 1).
   */
  std::uint32_t ctas_per_query{1};
  /// Threads a batch host search uses at most, the calling thread included (0 = one per hardware
  /// thread; a thread gets at least 64 queries, so a batch of 127 or fewer runs on the caller
  /// alone). Answers do not depend on it. The device backend (`index.cuh`) ignores it.
  std::uint32_t threads{0};
};

/// @brief The graph optimisation callbacks (the device backend supplies GPU versions).
struct graph_builder {
  /// kNN: `(rows, n, k, out[n][k])` for the tenant's padded rows of the index dtype.
  std::function<void(void const* rows, std::uint32_t n, std::uint32_t k, std::uint32_t* out)> knn;
  /// Pruning: `(knn[n][k], n, k, degree, out[n][degree])`.
  std::function<void(std::uint32_t const* knn,
                     std::uint32_t n,
                     std::uint32_t k,
                     std::uint32_t degree,
                     std::uint32_t* out)>
    prune;
};

}  // namespace inferscale
