/**
 * @file index.hpp
 * @brief The fact index: a CAGRA-style proximity graph over fact embeddings, with stable 64-bit
 * fact ids, incremental insert, delete and compaction, and many small per-user graphs (tenants,
 * one per namespace) in one arena. This header is the data structure and the host backend; the
 * device backend (GPU kNN build, batched beam search, exact search with RAFT) is `index.cuh`.
 *
 * Arena layout (host mirror always; device copies when `memory_kind::device`):
 *  - vectors `[rows][row_elements]` of fp32 or fp16, each row padded with zeros to 16 bytes;
 *  - graph `[rows][graph_degree]` of uint32 node ids local to the tenant (`0xFFFFFFFF` = empty);
 *  - fact ids `[rows]` (uint64) and deleted flags `[rows]` (uint8).
 * A tenant owns the rows `[row_begin, row_begin + capacity)`, of which the first `size` are used.
 * A tenant that outgrows its segment moves to the end of the arena (its old segment is a hole),
 * and deleted rows stay (they route). Automatic compaction (`index_config::max_row_overhead`)
 * repacks the arena when its rows exceed the configured multiple of the live facts; `compact()`
 * repacks on demand.
 *
 * Every mutating call validates all of its input before the first write, so a refused call leaves
 * the index unchanged (`version()` included).
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/host_memory.hpp>
#include <inferscale/detail/index/graph_build.hpp>
#include <inferscale/detail/index/math.hpp>
#include <inferscale/detail/index/search_host.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_kind.hpp>
#include <inferscale/views.hpp>

#include <cuda/std/span>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace inferscale {

/// @brief A `[rows, cols]` matrix view with a row stride (in elements): embeddings and results.
template <class T>
using matrix_view = cuda::std::mdspan<T, extents_t<2>, cuda::std::layout_stride>;

/// @brief Makes a matrix_view; `row_stride` defaults to `cols` (contiguous rows).
template <class T>
matrix_view<T> make_matrix_view(T* data, std::int64_t rows, std::int64_t cols,
                                std::int64_t row_stride = -1)
{
  using mapping = cuda::std::layout_stride::mapping<extents_t<2>>;
  return matrix_view<T>{data, mapping{extents_t<2>{rows, cols},
                                      cuda::std::array<std::int64_t, 2>{
                                        row_stride < 0 ? cols : row_stride, std::int64_t{1}}}};
}

/// @brief How the host builds the kNN graph a namespace's graph is pruned from (a
/// `graph_builder` with a `knn` callback, such as the device one, replaces it).
enum class knn_build : std::uint8_t {
  /// exact up to `exact_knn_max_rows` rows, NN-descent above (see `graph_index::uses_nn_descent`)
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

/// @brief Fixed properties of an index, chosen at construction.
struct index_config {
  std::int64_t dim{0};                                ///< embedding dimension
  distance_metric metric{distance_metric::cosine};    ///< how embeddings compare
  dtype vector_dtype{dtype::float32};                 ///< stored as float32 or float16
  std::uint32_t graph_degree{32};                     ///< CAGRA `graph_degree` (final out-degree)
  std::uint32_t intermediate_graph_degree{64};        ///< CAGRA `intermediate_graph_degree`
  memory_kind memory{memory_kind::host};              ///< where searches run
  /// Tenants with at most this many live facts are searched exactly (brute force); -1 = chosen
  /// automatically per search (see `graph_index::exact_search_threshold`).
  std::int64_t exact_search_threshold{-1};
  /// How the host builds a namespace's kNN graph. Not stored by `save_index` (like `memory`):
  /// a loaded index has the defaults.
  knn_build host_knn{knn_build::automatic};
  nn_descent_params nn_descent{};  ///< used when the host builds with NN-descent
  /// Entry points per namespace of the host's fast search (`host_search_mode::fast`): -1 =
  /// automatic (`default_host_entry_points`), else that many (at least 1). Not stored by
  /// `save_index`: a loaded index recomputes them with the default.
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
   * default). See `graph_index::compactions` for what a repack does and costs.
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
   * (as for `vector_dtype` float16; cosine rows always do). The exact search, the reference
   * mode and the builds use the float32 rows. Not stored by `save_index`: set it on a loaded
   * index with `graph_index::set_host_traversal_dtype`.
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
  while (e < 2048 && std::uint64_t{e} * e < std::uint64_t{16} * rows) { ++e; }
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
constexpr std::uint32_t split_itopk(std::uint32_t itopk, std::uint32_t k, std::uint32_t parts) noexcept
{
  std::uint32_t const t = (itopk + parts - 1) / parts;
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
constexpr std::uint32_t auto_ctas_per_query(std::int64_t queries, std::uint32_t itopk,
                                            std::uint32_t k) noexcept
{
  std::uint32_t const floor_list = k > split_auto_min_part_itopk ? k : split_auto_min_part_itopk;
  std::uint32_t parts            = 1;
  while (parts < split_auto_max_parts && queries * (2 * parts) <= split_auto_ctas &&
         (itopk + 2 * parts - 1) / (2 * parts) >= floor_list) {
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
  /// calibrated list size (`graph_index::host_default_ef`), the smallest that reached recall@10
  /// 0.99 on its own rows.
  std::uint32_t itopk_size{0};
  std::uint32_t search_width{1};           ///< parents per iteration (1..64)
  /// 0 = CAGRA's automatic bound. (CAGRA's `min_iterations` has no counterpart: here a step
  /// with no new parent changes nothing, so the search simply ends.)
  std::uint32_t max_iterations{0};
  /// Draws per seed slot (the closest is kept). cuVS defaults to 1, which leaves whole clusters
  /// unseeded on clustered embeddings (cuVS issue #2102: ~60 % recall at N >= 100k); measured
  /// here on a 200-cluster mixture (20k x 384): 1 -> 0.43, 4 -> 0.90, 8 -> 0.995 recall@10.
  std::uint32_t num_random_samplings{8};
  std::uint64_t rand_xor_mask{0x128394};   ///< seed generator mask
  search_algo algo{search_algo::automatic};
  /// Host backend only. Under `host_search_mode::fast` the search keeps `itopk_size` (at least
  /// k) results (hnswlib's `ef`), expands one node at a time, and `search_width`,
  /// `num_random_samplings` and `rand_xor_mask` do not apply; `max_iterations`, when not 0,
  /// bounds the nodes expanded (`max_iterations * search_width`).
  host_search_mode host_mode{host_search_mode::fast};
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
  std::function<void(std::uint32_t const* knn, std::uint32_t n, std::uint32_t k,
                     std::uint32_t degree, std::uint32_t* out)>
    prune;
};

namespace detail::index {
/// @brief One tenant's segment of the arena (trivially copyable: kernels read it).
struct tenant_ref {
  std::int64_t row_begin{0};
  std::uint32_t size{0};  ///< rows used (live + deleted)
  std::uint32_t live{0};
};

/**
 * @brief The automatic exact/graph switch-over as a cost model: a graph search computes about
 * `graph_cost_factor * estimated_graph_distances(plan)` distances' worth of work, an exact search
 * one per live fact, so a tenant is searched exactly while `live <= factor * estimate`.
 *
 * Host factor, measured (bench_index `host/crossover`, and bench/results/2026-11-30-index-host.md):
 * at the batch-1 latency parity point the ratio was 0.48-0.61 for N = 500..8000 at 384-d
 * (itopk 64, 8 samplings, degree 32), i.e. a threshold of about 1,600 facts.
 * Device factor: an estimate, NOT yet measured on a GPU (a CTA scans exactly with all its teams
 * at once, while a graph iteration has only `width * degree` distances to spread over them);
 * `bench_index device/crossover` prints the measured crossover beside it.
 */
inline constexpr double host_graph_cost_factor   = 0.55;
inline constexpr double device_graph_cost_factor = 2.0;

/**
 * @brief The same for the host's fast search (`host_search_mode::fast`): its graph search costs
 * about `host_fast_graph_cost_factor * estimated_fast_graph_distances(...)` exact-scan distances
 * (a graph distance reads a row at random, an exact one streams it). Measured at batch 1 on the
 * 384-d 100-cluster mixture with the default search_params: the graph's and the exact search's
 * times cross between 1,500 rows (exact 0.83x the graph's time) and 2,000 rows (1.49x), about
 * 1,700, where the estimate is 1,209 distances: factor 1.4
 * (bench/results/2026-12-01-index-search-host.md).
 */
inline constexpr double host_fast_graph_cost_factor = 1.4;

/// @brief Estimate of the distances a fast host search computes: its entry points, then about
/// `degree / 2` new neighbours for each of about `ef` expanded nodes.
constexpr double estimated_fast_graph_distances(std::uint32_t ef, std::uint32_t entries,
                                                std::uint32_t degree) noexcept
{
  return static_cast<double>(entries) + static_cast<double>(ef) * degree / 2.0;
}

/// @brief Upper estimate of the distances a graph search computes: seeds, then every iteration.
constexpr double estimated_graph_distances(search_plan const& plan, std::uint32_t degree) noexcept
{
  return static_cast<double>(plan.itopk + plan.width * degree) * plan.samplings +
         static_cast<double>(plan.max_iterations) * plan.width * degree;
}

struct index_access;
}  // namespace detail::index

/**
 * @brief Non-owning device handle of an index (pointers into the device arena).
 */
struct graph_index_ref {
  void const* vectors{nullptr};        ///< `[rows][row_elements]` of the index dtype
  std::uint32_t const* graph{nullptr}; ///< `[rows][degree]` local node ids
  std::uint64_t const* ids{nullptr};   ///< `[rows]` fact ids
  std::uint8_t const* deleted{nullptr};///< `[rows]` 1 = deleted
  std::int64_t row_elements{0};
  std::uint32_t degree{0};
  distance_metric metric{distance_metric::cosine};
  dtype vector_dtype{dtype::float32};
};

/**
 * @brief The fact index (move-only owner). See the file comment for the layout and contracts.
 *
 * @note Host-memory indexes are searched with `search()` here; device-memory indexes with
 * `inferscale::search` from `index.cuh`. All mutations run on the host mirror and copy the
 * changed tenant segment to the device before returning (they synchronise).
 */
class graph_index {
 public:
  using tenant_ref = detail::index::tenant_ref;

  /// @throw logic_error on a zero dimension, a dtype other than float32/float16, or degrees
  /// outside `1 <= graph_degree <= intermediate_graph_degree <= 1024`.
  explicit graph_index(index_config const& config) : config_(config)
  {
    INFERSCALE_EXPECTS(config.dim > 0 && config.dim <= (1 << 20),
                       "index_config: dim must be in [1, 2^20], got " + std::to_string(config.dim));
    INFERSCALE_EXPECTS(config.vector_dtype == dtype::float32 || config.vector_dtype == dtype::float16,
                       std::string{"index_config: vectors are float32 or float16, got "} +
                         to_string(config.vector_dtype));
    INFERSCALE_EXPECTS(config.graph_degree >= 1 &&
                         config.graph_degree <= config.intermediate_graph_degree &&
                         config.intermediate_graph_degree <= 1024,
                       "index_config: need 1 <= graph_degree (" +
                         std::to_string(config.graph_degree) + ") <= intermediate_graph_degree (" +
                         std::to_string(config.intermediate_graph_degree) + ") <= 1024");
    INFERSCALE_EXPECTS(config.exact_search_threshold >= -1,
                       "index_config: exact_search_threshold is -1 (default) or >= 0");
    INFERSCALE_EXPECTS(config.host_knn == knn_build::automatic ||
                         config.host_knn == knn_build::exact ||
                         config.host_knn == knn_build::nn_descent,
                       "index_config: unknown host_knn code " +
                         std::to_string(static_cast<int>(config.host_knn)));
    INFERSCALE_EXPECTS(config.nn_descent.rho > 0.0f && config.nn_descent.rho <= 1.0f,
                       "index_config: nn_descent.rho (the sampling rate) must be in (0, 1], got " +
                         std::to_string(config.nn_descent.rho));
    INFERSCALE_EXPECTS(config.nn_descent.delta >= 0.0f && config.nn_descent.delta <= 1.0f,
                       "index_config: nn_descent.delta (the stop fraction) must be in [0, 1], got " +
                         std::to_string(config.nn_descent.delta));
    INFERSCALE_EXPECTS(config.host_entry_points == -1 ||
                         (config.host_entry_points >= 1 && config.host_entry_points <= (1 << 20)),
                       "index_config: host_entry_points is -1 (automatic) or in [1, 2^20], got " +
                         std::to_string(config.host_entry_points));
    INFERSCALE_EXPECTS(config.nn_descent.max_iterations >= 1,
                       std::string{"index_config: nn_descent.max_iterations must be at least 1"});
    INFERSCALE_EXPECTS(std::isfinite(config.max_row_overhead) &&
                         (config.max_row_overhead == 0.0 || config.max_row_overhead >= 1.0),
                       "index_config: max_row_overhead is 0 (no automatic compaction) or a finite "
                       "factor >= 1, got " + std::to_string(config.max_row_overhead));
    check_traversal_dtype(config, "index_config");
    element_size_ = size_of(config.vector_dtype);
    row_elements_ = detail::index::padded_dim(config.dim, element_size_);
  }

  graph_index(graph_index&& other) noexcept { swap(other); }
  graph_index& operator=(graph_index&& other) noexcept
  {
    if (this != &other) {
      graph_index tmp{std::move(other)};
      swap(tmp);
    }
    return *this;
  }
  graph_index(graph_index const&)            = delete;
  graph_index& operator=(graph_index const&) = delete;
  ~graph_index() { free_device(); }

  // ---------------------------------------------------------------------------------------------
  // Properties

  index_config const& config() const noexcept { return config_; }
  std::int64_t dim() const noexcept { return config_.dim; }
  std::int64_t row_elements() const noexcept { return row_elements_; }
  /// @brief Stored graph out-degree (rows of small tenants are padded with empty slots).
  std::uint32_t graph_degree() const noexcept { return config_.graph_degree; }
  memory_kind memory() const noexcept { return config_.memory; }
  /// @brief Increases on every successful mutation; a refused call leaves it unchanged.
  std::uint64_t version() const noexcept { return version_; }

  /**
   * @brief Under `search_algo::automatic`, a namespace of `rows` rows with at most this many live
   * facts is searched exactly. The configured value when `index_config::exact_search_threshold`
   * is >= 0; otherwise chosen automatically from the search parameters by the cost model of
   * `detail::index::estimated_graph_distances` with the backend's measured factor.
   */
  std::int64_t exact_search_threshold(search_params const& p = {},
                                      std::uint32_t rows = 100000) const noexcept
  {
    if (config_.exact_search_threshold >= 0) { return config_.exact_search_threshold; }
    if (config_.memory == memory_kind::host && p.host_mode == host_search_mode::fast) {
      return static_cast<std::int64_t>(
        detail::index::host_fast_graph_cost_factor *
        detail::index::estimated_fast_graph_distances(resolved_itopk(p.itopk_size, 1),
                                                      entry_point_count(rows),
                                                      config_.graph_degree));
    }
    double const factor = config_.memory == memory_kind::device
                            ? detail::index::device_graph_cost_factor
                            : detail::index::host_graph_cost_factor;
    auto const plan = plan_for(rows, 1, p);
    return static_cast<std::int64_t>(
      factor * detail::index::estimated_graph_distances(plan, config_.graph_degree));
  }

  /**
   * @brief Whether the host builds the kNN graph of a namespace of `rows` rows with NN-descent
   * (true) or exactly: `host_knn`, and under `automatic` NN-descent above `exact_knn_max_rows`.
   * A `graph_builder` with a `knn` callback overrides both.
   */
  bool uses_nn_descent(std::uint32_t rows) const noexcept
  {
    if (config_.host_knn == knn_build::automatic) { return rows > exact_knn_max_rows; }
    return config_.host_knn == knn_build::nn_descent;
  }

  /// @brief What the last host NN-descent build did (zeros if none ran).
  detail::index::nn_descent_report const& last_nn_descent() const noexcept
  {
    return last_nn_descent_;
  }

  /// @brief Number of namespaces with a tenant (including ones whose facts were all deleted).
  std::size_t num_namespaces() const noexcept { return tenant_of_.size(); }
  /// @brief The namespaces, in order of creation.
  std::vector<std::uint64_t> namespaces() const
  {
    std::vector<std::uint64_t> out;
    for (auto const& t : tenants_) {
      if (t.alive) { out.push_back(t.ns); }
    }
    return out;
  }
  bool has_namespace(std::uint64_t ns) const noexcept { return tenant_of_.count(ns) != 0; }
  /// @brief Live facts of a namespace (0 if unknown).
  std::uint32_t size(std::uint64_t ns) const noexcept
  {
    auto it = tenant_of_.find(ns);
    return it == tenant_of_.end() ? 0 : tenants_[it->second].ref.live;
  }
  /// @brief Entry points the fast host search of a namespace starts from (0 if unknown; see
  /// `index_config::host_entry_points`).
  std::uint32_t host_entry_points(std::uint64_t ns) const noexcept
  {
    auto it = tenant_of_.find(ns);
    return it == tenant_of_.end() ? 0
                                  : static_cast<std::uint32_t>(tenants_[it->second].entries.size());
  }
  /// @brief The fast host search's result list for `itopk_size` 0 in a namespace (0 if unknown):
  /// the smallest of a grid (10 .. 256) with which searches for 128 of its rows found 99 % of
  /// their 10 nearest other rows, chosen whenever its entry points are.
  std::uint32_t host_default_ef(std::uint64_t ns) const noexcept
  {
    auto it = tenant_of_.find(ns);
    return it == tenant_of_.end() ? 0 : tenants_[it->second].default_ef;
  }
  /**
   * @brief Chooses what the host's fast graph search walks (`index_config::host_traversal_dtype`):
   * float16 makes every namespace's float16 copy (O(rows x dim)), float32 frees them. Results
   * change only as the walk does; the rows, graph and ids do not.
   * @throw logic_error (nothing changed) on another dtype, float16 on a float16 or device index,
   * or float16 when some stored vector overflows float16
   */
  void set_host_traversal_dtype(dtype d)
  {
    index_config next         = config_;
    next.host_traversal_dtype = d;
    check_traversal_dtype(next, "graph_index::set_host_traversal_dtype");
    if (d == config_.host_traversal_dtype) { return; }
    if (d == dtype::float16) {
      float const* rows = reinterpret_cast<float const*>(vectors_.data());
      for (auto const& t : tenants_) {
        for (std::uint32_t v = 0; v < t.ref.size; ++v) {
          std::size_t const row = static_cast<std::size_t>(t.ref.row_begin + v);
          for (std::int64_t e = 0; e < row_elements_; ++e) {
            INFERSCALE_EXPECTS(
              std::isfinite(to_float(from_float<half_t>(rows[row * row_elements_ + e]))),
              "graph_index::set_host_traversal_dtype: fact id " + std::to_string(ids_[row]) +
                " overflows float16 at element " + std::to_string(e));
          }
        }
      }
    }
    config_.host_traversal_dtype = d;
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      rebuild_traversal(t);
    }
    ++version_;
  }

  /// @brief A namespace's float16 rows `[rows(ns)][row_elements]` under float16 traversal, else
  /// null (and null for an unknown namespace).
  half_t const* host_traversal_rows(std::uint64_t ns) const noexcept
  {
    auto it = tenant_of_.find(ns);
    if (it == tenant_of_.end() || !traverses_fp16()) { return nullptr; }
    return tenants_[it->second].traversal.data();
  }

  /// @brief Rows a namespace occupies (live + deleted, until a compaction drops its deleted rows).
  std::uint32_t rows(std::uint64_t ns) const noexcept
  {
    auto it = tenant_of_.find(ns);
    return it == tenant_of_.end() ? 0 : tenants_[it->second].ref.size;
  }
  /// @brief Live facts over all namespaces.
  std::uint64_t total_size() const noexcept { return id_to_row_.size(); }
  /// @brief Arena rows allocated (capacity), and rows in use by tenants, holes included.
  std::int64_t arena_rows() const noexcept { return arena_capacity_; }
  std::int64_t arena_rows_in_use() const noexcept { return arena_used_; }
  /**
   * @brief The most arena rows automatic compaction allows after a mutation:
   * `max(floor(max_row_overhead * total_size()), total_size() + compaction_floor_rows)`, or the
   * largest int64 when `max_row_overhead` is 0.
   */
  std::int64_t max_arena_rows() const noexcept { return row_limit(total_size()); }
  /**
   * @brief Automatic compactions so far (`compact()` calls not counted; not saved).
   *
   * A mutation that leaves `arena_rows() > max_arena_rows()` repacks before it returns: the
   * namespaces' segments are moved together in creation order (holes vanish; graph node ids are
   * local to a namespace, so a moved namespace keeps its rows, graph and answers bit for bit), and
   * namespaces whose deleted rows must go to reach the target are rebuilt from their live facts
   * (a fresh graph build, most deleted share first, only as many as needed). The target is half
   * way between the live facts and the bound: `max(floor((1 + (max_row_overhead - 1) / 2) *
   * total_size()), total_size() + compaction_floor_rows / 2)` rows, spare rows included (each
   * segment gets up to a quarter of its size spare, within the target). So between two repacks
   * the arena gains at least a quarter of the live facts in holes and growth (at the default
   * 1.5), or a sixth of the live facts are erased: a repack's copy of the arena is paid for by
   * the moves and erasures that made it necessary. Growth itself stays below the bound: with
   * automatic compaction a segment grows to 1.25x what it needs and the arena by at most 1.25x,
   * both clipped half way between what is needed and the bound for the facts after the change.
   */
  std::uint64_t compactions() const noexcept { return compactions_; }
  /// @brief Bytes of the arena's vectors, graph, ids and flags (one copy).
  std::uint64_t arena_bytes() const noexcept
  {
    return static_cast<std::uint64_t>(arena_capacity_) *
           (static_cast<std::uint64_t>(row_elements_) * element_size_ +
            std::uint64_t{config_.graph_degree} * 4 + 8 + 1);
  }

  /// @brief Bytes of the float16 copies under `host_traversal_dtype` float16 (each namespace's
  /// rows and packed entry rows; 0 otherwise), beside `arena_bytes`.
  std::uint64_t host_traversal_bytes() const noexcept
  {
    std::uint64_t total = 0;
    for (auto const& t : tenants_) {
      total += (t.traversal.size() + t.entry_traversal.size()) * sizeof(half_t);
    }
    return total;
  }

  bool contains(std::uint64_t id) const noexcept { return id_to_row_.count(id) != 0; }
  /// @brief The namespace holding a live fact. @throw logic_error for an unknown id.
  std::uint64_t namespace_of(std::uint64_t id) const
  {
    auto it = id_to_row_.find(id);
    INFERSCALE_EXPECTS(it != id_to_row_.end(), "graph_index: unknown fact id " + std::to_string(id));
    return tenants_[it->second.tenant].ns;
  }
  /// @brief Live fact ids of a namespace, in row order.
  std::vector<std::uint64_t> ids(std::uint64_t ns) const
  {
    std::vector<std::uint64_t> out;
    auto it = tenant_of_.find(ns);
    if (it == tenant_of_.end()) { return out; }
    auto const& t = tenants_[it->second].ref;
    for (std::uint32_t v = 0; v < t.size; ++v) {
      if (!deleted_[t.row_begin + v]) { out.push_back(ids_[t.row_begin + v]); }
    }
    return out;
  }

  /// @brief The tenant segment of a namespace (`size == 0` if unknown).
  tenant_ref tenant_segment(std::uint64_t ns) const noexcept
  {
    auto it = tenant_of_.find(ns);
    return it == tenant_of_.end() ? tenant_ref{} : tenants_[it->second].ref;
  }
  /// @brief A tenant's graph rows `[rows(ns)][graph_degree]` on the host (local node ids).
  std::uint32_t const* graph_rows(std::uint64_t ns) const
  {
    auto const t = checked_tenant(ns);
    return graph_.data() + t.row_begin * config_.graph_degree;
  }
  /// @brief A tenant's padded vector rows on the host (bytes of the index dtype).
  void const* vector_rows(std::uint64_t ns) const
  {
    auto const t = checked_tenant(ns);
    return vectors_.data() + static_cast<std::size_t>(t.row_begin * row_elements_) * element_size_;
  }
  std::uint64_t const* id_rows(std::uint64_t ns) const
  {
    return ids_.data() + checked_tenant(ns).row_begin;
  }
  std::uint8_t const* deleted_rows(std::uint64_t ns) const
  {
    return deleted_.data() + checked_tenant(ns).row_begin;
  }

  /// @brief Device handle (null pointers for a host index).
  graph_index_ref ref() const noexcept
  {
    graph_index_ref r;
    r.vectors      = d_vectors_;
    r.graph        = d_graph_;
    r.ids          = d_ids_;
    r.deleted      = d_deleted_;
    r.row_elements = row_elements_;
    r.degree       = config_.graph_degree;
    r.metric       = config_.metric;
    r.vector_dtype = config_.vector_dtype;
    return r;
  }

  // ---------------------------------------------------------------------------------------------
  // Mutations

  /**
   * @brief Adds facts to a namespace (creating it). A new or small namespace, or one that more than
   * doubles, gets its graph rebuilt (kNN -> prune -> reverse -> merge); otherwise the facts are
   * inserted one at a time into the existing graph (CAGRA-extend style: a search for neighbours,
   * rank-based pruning, reverse edges replacing the most redundant slots).
   *
   * @tparam T float or half_t (converted to the index dtype)
   * @param vectors `[m][dim]` host view; @param ids m fact ids, new to the whole index and distinct
   * @param builder kNN/pruning backend (default: host, exact or NN-descent as
   *                `uses_nn_descent` says); `index.cuh` has a device one. Also builds the
   *                namespaces an automatic compaction rebuilds (see `compactions`).
   * @throw logic_error (nothing changed) on a dimension mismatch, NaN/Inf, a zero vector under the
   * cosine metric, a repeated or existing id, `ids.size() != rows`, or a namespace over 2^31 rows
   */
  template <class T>
  void add(std::uint64_t ns,
           matrix_view<T const> vectors,
           cuda::std::span<std::uint64_t const> ids,
           graph_builder const& builder = {})
  {
    check_new_facts(vectors, ids);
    std::uint32_t const m = static_cast<std::uint32_t>(ids.size());
    if (m == 0) { return; }
    auto it = tenant_of_.find(ns);
    std::uint32_t const before = it == tenant_of_.end() ? 0 : tenants_[it->second].ref.size;
    INFERSCALE_EXPECTS(std::uint64_t{before} + m < (std::uint64_t{1} << 31),
                       "graph_index::add: a namespace holds fewer than 2^31 rows");

    std::size_t const t = ensure_room(ns, before + m, total_size() + m);
    write_rows(t, before, vectors, ids);
    auto& tr = tenants_[t].ref;
    tr.size  = before + m;
    tr.live += m;
    if (before == 0 || m > before || tr.size <= rebuild_limit()) {
      rebuild_graph(t, builder);
    } else {
      std::vector<std::uint32_t> in_degree(tr.size, 0);
      std::uint32_t const* graph = graph_.data() + tr.row_begin * config_.graph_degree;
      for (std::size_t e = 0; e < std::size_t{before} * config_.graph_degree; ++e) {
        if (graph[e] != detail::index::invalid_node) { ++in_degree[graph[e]]; }
      }
      detail::index::search_scratch scratch;  // one visited table for the whole batch
      for (std::uint32_t v = before; v < tr.size; ++v) {
        insert_node(t, v, in_degree, scratch);
      }
      repair(t);
      // the old entry points stay valid (the new rows are reachable through the graph); they
      // are chosen afresh once the namespace has grown by a quarter
      if (std::uint64_t{tr.size} * 4 > std::uint64_t{tenants_[t].entries_rows} * 5) {
        refresh_entry_points(t);
      }
    }
    ++version_;
    if (!compact_if_needed(builder)) { upload_tenant(t, before, upload_vectors | upload_graph); }
  }

  /**
   * @brief Replaces a namespace's facts with these (a fresh build); a namespace that did not exist
   * is created. Ids may repeat the namespace's old ids, not other namespaces' ids.
   */
  template <class T>
  void build(std::uint64_t ns,
             matrix_view<T const> vectors,
             cuda::std::span<std::uint64_t const> ids,
             graph_builder const& builder = {})
  {
    check_new_facts(vectors, ids, ns);
    INFERSCALE_EXPECTS(ids.size() < (std::size_t{1} << 31),
                       "graph_index::build: a namespace holds fewer than 2^31 rows");
    std::uint64_t const before = version_;
    erase_namespace_rows(ns);
    ensure_room(ns, 0, total_size());  // an empty build still creates the namespace
    add(ns, vectors, ids, builder);
    if (version_ == before) { ++version_; }
    compact_if_needed(builder);  // an empty build leaves the old rows behind (add did not check)
  }

  /**
   * @brief Deletes facts: they leave search results at once (their nodes still route) and their
   * ids can be added again; the rows are reclaimed by `compact()` or an automatic compaction.
   * @param builder builds the namespaces an automatic compaction rebuilds (see `compactions`)
   * @throw logic_error (nothing changed) if any id is unknown or repeated
   */
  void erase(cuda::std::span<std::uint64_t const> ids, graph_builder const& builder = {})
  {
    INFERSCALE_EXPECTS(ids.empty() || ids.data() != nullptr,
                       std::string{"graph_index::erase: null ids"});
    std::unordered_set<std::uint64_t> seen;
    for (auto id : ids) {
      INFERSCALE_EXPECTS(id_to_row_.count(id) != 0,
                         "graph_index::erase: unknown fact id " + std::to_string(id));
      INFERSCALE_EXPECTS(seen.insert(id).second,
                         "graph_index::erase: fact id " + std::to_string(id) + " given twice");
    }
    std::vector<std::size_t> touched;
    for (auto id : ids) {
      auto const loc = id_to_row_.at(id);
      auto& t        = tenants_[loc.tenant];
      deleted_[t.ref.row_begin + loc.local] = 1;
      --t.ref.live;
      id_to_row_.erase(id);
      touched.push_back(loc.tenant);
    }
    if (ids.empty()) { return; }
    ++version_;
    if (compact_if_needed(builder)) { return; }  // the device got the whole arena
    std::sort(touched.begin(), touched.end());
    touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
    for (auto t : touched) {
      upload_tenant(t, 0, upload_flags);
    }
  }

  /// @brief Deletes every fact of a namespace and the namespace itself (its rows become a hole).
  /// @param builder builds the namespaces an automatic compaction rebuilds (see `compactions`)
  /// @return the number of live facts removed (0 for an unknown namespace).
  std::uint32_t erase_namespace(std::uint64_t ns, graph_builder const& builder = {})
  {
    auto it = tenant_of_.find(ns);
    if (it == tenant_of_.end()) { return 0; }
    std::uint32_t const live = tenants_[it->second].ref.live;
    erase_namespace_rows(ns);
    tenants_[it->second].alive = false;
    tenant_of_.erase(it);
    ++version_;
    compact_if_needed(builder);
    return live;
  }

  /**
   * @brief Reclaims the rows of deleted facts and the holes left by moved or erased tenants:
   * each tenant with deletions is rebuilt from its live facts, and the arena is repacked with no
   * spare rows (`arena_rows() == total_size()`).
   */
  void compact(graph_builder const& builder = {})
  {
    std::vector<std::uint8_t> rebuild(tenants_.size(), 0);
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      rebuild[t] = tenants_[t].ref.live != tenants_[t].ref.size;
    }
    repack(rebuild, 0, builder);
    ++version_;
  }

  // ---------------------------------------------------------------------------------------------
  // Host search

  /**
   * @brief Searches a host-memory index: query `q` looks in namespace `namespaces[q]` (or all in
   * `namespaces[0]` when one namespace is given). Row `q` of the outputs gets the `k` nearest live
   * facts sorted by distance; slots beyond the namespace's live facts get `invalid_fact_id` and
   * +infinity.
   *
   * @throw logic_error (outputs untouched) for a device index, a dimension mismatch, NaN/Inf in a
   * query, a zero query under cosine, an unknown namespace, k == 0, output shapes other than
   * `[queries][k]`, or search_width outside 1..64
   */
  template <class T>
  void search(matrix_view<T const> queries,
              cuda::std::span<std::uint64_t const> namespaces,
              std::uint32_t k,
              search_params const& params,
              matrix_view<std::uint64_t> out_ids,
              matrix_view<float> out_distances) const
  {
    INFERSCALE_EXPECTS(config_.memory == memory_kind::host,
                       "graph_index::search: this index lives in device memory; use "
                       "inferscale::search from index.cuh");
    std::vector<std::int64_t> tenant_index = check_search(queries, namespaces, k, params,
                                                          out_ids.extent(0), out_ids.extent(1),
                                                          out_distances.extent(0),
                                                          out_distances.extent(1));
    INFERSCALE_EXPECTS(queries.extent(0) == 0 ||
                         (out_ids.data_handle() != nullptr && out_distances.data_handle() != nullptr),
                       std::string{"graph_index::search: null output"});
    std::vector<float> padded = prepare_queries(queries);
    std::int64_t const nq     = queries.extent(0);
    search_params const split = resolve_split(params, nq, k);  // (automatic: by the batch size)
    detail::index::parallel_ranges(nq, params.threads, [&](std::int64_t begin, std::int64_t end) {
      // per thread, kept across calls: single-query searches reuse the visited stamps (an epoch
      // per query, so nothing is cleared) instead of allocating a table of n entries each time
      thread_local detail::index::search_scratch scratch;
      std::vector<detail::index::search_entry> result;
      for (std::int64_t q = begin; q < end; ++q) {
        auto const& tn = tenants_[static_cast<std::size_t>(tenant_index[q])];
        auto const& tr = tn.ref;
        search_tenant(tn, padded.data() + q * row_elements_, k, split, scratch, result);
        for (std::uint32_t j = 0; j < k; ++j) {
          bool const valid       = j < result.size();
          out_ids(q, j)          = valid ? ids_[tr.row_begin + result[j].node] : invalid_fact_id;
          out_distances(q, j)    = valid ? result[j].distance
                                         : std::numeric_limits<float>::infinity();
        }
      }
    });
  }

  /**
   * @brief The resolved plan of a search of one tenant of `n` rows (itopk raised to k, automatic
   * iteration bound). Shared by both backends.
   */
  detail::index::search_plan plan_for(std::uint32_t n, std::uint32_t k,
                                      search_params const& p) const noexcept
  {
    detail::index::search_plan plan;
    plan.k         = k;
    plan.itopk     = resolved_itopk(p.itopk_size, k);
    plan.width     = p.search_width;
    plan.samplings = std::max<std::uint32_t>(1, p.num_random_samplings);
    plan.xor_mask  = p.rand_xor_mask;
    plan.max_iterations = p.max_iterations != 0
                            ? p.max_iterations
                            : detail::index::auto_max_iterations(plan.itopk, plan.width,
                                                                 config_.graph_degree, n);
    return plan;
  }

  /**
   * @brief `p` with its split resolved for a batch of `queries` graph searches:
   * `ctas_per_query` 0 (automatic) becomes auto_ctas_per_query; any other value stays.
   */
  static search_params resolve_split(search_params const& p, std::int64_t queries,
                                     std::uint32_t k) noexcept
  {
    search_params r = p;
    if (r.ctas_per_query == 0) {
      r.ctas_per_query = auto_ctas_per_query(queries, resolved_itopk(p.itopk_size, k), k);
    }
    return r;
  }

  /**
   * @brief The parameters of part `c` of a split search (`search_params::ctas_per_query`): the
   * part's top list and seed mask, one part. Both backends plan each part from them (plan_for).
   */
  static search_params split_part(search_params const& p, std::uint32_t k, std::uint32_t c) noexcept
  {
    search_params part  = p;
    part.itopk_size     = split_itopk(resolved_itopk(p.itopk_size, k), k, p.ctas_per_query);
    part.rand_xor_mask  = p.rand_xor_mask ^ split_seed_mix(c);
    part.ctas_per_query = 1;
    return part;
  }

  /// @brief Whether a search of this tenant runs exactly (true) or on the graph.
  bool uses_exact(tenant_ref const& t, search_params const& p) const noexcept
  {
    if (p.algo == search_algo::exact) { return true; }
    if (p.algo == search_algo::graph) { return false; }
    return static_cast<std::int64_t>(t.live) <= exact_search_threshold(p, t.size);
  }

  /**
   * @brief Queries padded to the row length and normalised for cosine, as both backends compare
   * them (fp32). @throw logic_error on a dimension mismatch, NaN/Inf or a zero cosine query.
   */
  template <class T>
  std::vector<float> prepare_queries(matrix_view<T const> queries) const
  {
    INFERSCALE_EXPECTS(queries.extent(1) == config_.dim,
                       "graph_index: queries have " + detail::count_of(queries.extent(1), "dimension") +
                         ", the index " + std::to_string(config_.dim));
    INFERSCALE_EXPECTS(queries.size() == 0 || queries.data_handle() != nullptr,
                       std::string{"graph_index: null query data"});
    std::int64_t const nq = queries.extent(0);
    std::vector<float> out(static_cast<std::size_t>(nq * row_elements_), 0.0f);
    std::vector<float> row(static_cast<std::size_t>(config_.dim));
    for (std::int64_t q = 0; q < nq; ++q) {
      for (std::int64_t e = 0; e < config_.dim; ++e) {
        float const x = to_float(queries(q, e));
        INFERSCALE_EXPECTS(std::isfinite(x), "graph_index: query " + std::to_string(q) +
                                               " has a NaN or infinite element at " +
                                               std::to_string(e));
        row[static_cast<std::size_t>(e)] = x;
      }
      // the device kernel normalises with the same double-precision lane order
      double const norm2 = detail::index::norm2_spec(row.data(), config_.dim);
      INFERSCALE_EXPECTS(config_.metric != distance_metric::cosine || norm2 > 0.0,
                         "graph_index: query " + std::to_string(q) +
                           " is a zero vector, which has no cosine");
      INFERSCALE_EXPECTS(norm2 <= max_norm2,
                         "graph_index: query " + std::to_string(q) +
                           " has a squared norm above 1e30: its distances would overflow float32");
      float const scale = config_.metric == distance_metric::cosine
                            ? static_cast<float>(1.0 / std::sqrt(norm2))
                            : 1.0f;
      for (std::int64_t e = 0; e < config_.dim; ++e) {
        out[static_cast<std::size_t>(q * row_elements_ + e)] = row[static_cast<std::size_t>(e)] * scale;
      }
    }
    return out;
  }

  /**
   * @brief Validates a search and resolves each query's tenant (index into the tenant table).
   * Shared by both backends. @throw logic_error as described at `search`.
   */
  template <class T>
  std::vector<std::int64_t> check_search(matrix_view<T const> queries,
                                         cuda::std::span<std::uint64_t const> namespaces,
                                         std::uint32_t k,
                                         search_params const& params,
                                         std::int64_t ids_rows, std::int64_t ids_cols,
                                         std::int64_t dist_rows, std::int64_t dist_cols) const
  {
    std::int64_t const nq = queries.extent(0);
    INFERSCALE_EXPECTS(queries.extent(1) == config_.dim,
                       "graph_index: queries have " + detail::count_of(queries.extent(1), "dimension") +
                         ", the index " + std::to_string(config_.dim));
    INFERSCALE_EXPECTS(queries.size() == 0 || queries.data_handle() != nullptr,
                       std::string{"graph_index: null query data"});
    INFERSCALE_EXPECTS(namespaces.empty() || namespaces.data() != nullptr,
                       std::string{"graph_index: null namespaces"});
    INFERSCALE_EXPECTS(k >= 1, "graph_index: k must be at least 1");
    INFERSCALE_EXPECTS(params.search_width >= 1 && params.search_width <= 64,
                       "graph_index: search_width must be in 1..64, got " +
                         std::to_string(params.search_width));
    INFERSCALE_EXPECTS(resolved_itopk(params.itopk_size, k) <= 1024,
                       "graph_index: itopk_size (raised to k) must be at most 1024");
    INFERSCALE_EXPECTS(params.ctas_per_query <= 16,
                       "graph_index: ctas_per_query must be in 0..16 (0: automatic), got " +
                         std::to_string(params.ctas_per_query));
    INFERSCALE_EXPECTS(namespaces.size() == 1 || static_cast<std::int64_t>(namespaces.size()) == nq,
                       "graph_index: give one namespace, or one per query (" + std::to_string(nq) +
                         "), not " + std::to_string(namespaces.size()));
    INFERSCALE_EXPECTS(ids_rows == nq && dist_rows == nq && ids_cols == k && dist_cols == k,
                       "graph_index: outputs must be [queries=" + std::to_string(nq) + "][k=" +
                         std::to_string(k) + "]");
    std::vector<std::int64_t> tenant_index(static_cast<std::size_t>(nq));
    for (std::int64_t q = 0; q < nq; ++q) {
      std::uint64_t const ns = namespaces.size() == 1 ? namespaces[0] : namespaces[q];
      auto it                = tenant_of_.find(ns);
      INFERSCALE_EXPECTS(it != tenant_of_.end(),
                         "graph_index: unknown namespace " + std::to_string(ns));
      tenant_index[static_cast<std::size_t>(q)] = static_cast<std::int64_t>(it->second);
    }
    return tenant_index;
  }

  /// @brief The tenant table (for the device backend: index = position in `tenant_table()`).
  std::vector<tenant_ref> tenant_table() const
  {
    std::vector<tenant_ref> out;
    for (auto const& t : tenants_) {
      out.push_back(t.ref);
    }
    return out;
  }

 private:
  friend struct detail::index::index_access;

  struct tenant {
    std::uint64_t ns{0};
    tenant_ref ref{};
    std::uint32_t capacity{0};
    bool alive{true};
    bool rebuild_on_compact{false};
    /// Entry points of the fast host search (local ids), their rows packed (index dtype), and
    /// the rows the tenant had when they were chosen.
    std::vector<std::uint32_t> entries;
    std::vector<unsigned char> entry_vectors;
    std::uint32_t entries_rows{0};
    /// The fast search's result list when `itopk_size` is 0 (`detail::index::calibrate_ef`).
    std::uint32_t default_ef{default_itopk};
    /// Under `host_traversal_dtype` float16: the tenant's rows (local ids, `row_elements` each)
    /// and its packed entry rows in float16, kept equal to `from_float<half_t>` of the stored
    /// rows (written with them, rebuilt with the entry points); empty otherwise.
    detail::huge_page_vector<half_t> traversal;
    std::vector<half_t> entry_traversal;
  };
  struct row_location {
    std::size_t tenant{0};
    std::uint32_t local{0};
  };
  struct arena {
    detail::huge_page_vector<unsigned char> vectors;
    detail::huge_page_vector<std::uint32_t> graph;
    std::vector<std::uint64_t> ids;
    std::vector<std::uint8_t> deleted;
  };

  void swap(graph_index& o) noexcept
  {
    std::swap(config_, o.config_);
    std::swap(element_size_, o.element_size_);
    std::swap(row_elements_, o.row_elements_);
    std::swap(vectors_, o.vectors_);
    std::swap(graph_, o.graph_);
    std::swap(ids_, o.ids_);
    std::swap(deleted_, o.deleted_);
    std::swap(arena_capacity_, o.arena_capacity_);
    std::swap(arena_used_, o.arena_used_);
    std::swap(tenants_, o.tenants_);
    std::swap(tenant_of_, o.tenant_of_);
    std::swap(id_to_row_, o.id_to_row_);
    std::swap(version_, o.version_);
    std::swap(compactions_, o.compactions_);
    std::swap(d_vectors_, o.d_vectors_);
    std::swap(d_graph_, o.d_graph_);
    std::swap(d_ids_, o.d_ids_);
    std::swap(d_deleted_, o.d_deleted_);
    std::swap(d_capacity_, o.d_capacity_);
    std::swap(device_stale_, o.device_stale_);
    std::swap(last_nn_descent_, o.last_nn_descent_);
  }

  tenant_ref checked_tenant(std::uint64_t ns) const
  {
    auto it = tenant_of_.find(ns);
    INFERSCALE_EXPECTS(it != tenant_of_.end(),
                       "graph_index: unknown namespace " + std::to_string(ns));
    return tenants_[it->second].ref;
  }

  /// Vectors and queries with a larger squared norm are refused: with |q|^2, |x|^2 <= 1e30 every
  /// dot product and squared distance stays below float32's 3.4e38 (never Inf or NaN), so the
  /// (distance, node) order stays total.
  static constexpr double max_norm2 = 1e30;

  /// Below this many rows a namespace's graph is rebuilt on every add (cheap, and best quality).
  std::uint32_t rebuild_limit() const noexcept
  {
    return std::max<std::uint32_t>(256, 2 * config_.intermediate_graph_degree);
  }

  template <class T>
  void check_new_facts(matrix_view<T const> vectors,
                       cuda::std::span<std::uint64_t const> ids,
                       std::uint64_t replacing_ns = invalid_fact_id) const
  {
    static_assert(std::is_same_v<std::remove_cv_t<T>, float> ||
                    std::is_same_v<std::remove_cv_t<T>, half_t>,
                  "graph_index: vectors are float or half_t");
    INFERSCALE_EXPECTS(vectors.extent(1) == config_.dim,
                       "graph_index: vectors have " + detail::count_of(vectors.extent(1), "dimension") +
                         ", the index " + std::to_string(config_.dim));
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(ids.size()) == vectors.extent(0),
                       "graph_index: " +
                         detail::count_of(static_cast<std::int64_t>(ids.size()), "id") + " for " +
                         detail::count_of(vectors.extent(0), "vector"));
    INFERSCALE_EXPECTS(vectors.size() == 0 || vectors.data_handle() != nullptr,
                       std::string{"graph_index: null vector data"});
    INFERSCALE_EXPECTS(ids.empty() || ids.data() != nullptr, std::string{"graph_index: null ids"});
    std::unordered_set<std::uint64_t> seen;
    seen.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::uint64_t const id = ids[i];
      INFERSCALE_EXPECTS(id != invalid_fact_id,
                         "graph_index: fact id 2^64-1 is reserved (invalid_fact_id)");
      INFERSCALE_EXPECTS(seen.insert(id).second,
                         "graph_index: fact id " + std::to_string(id) + " given twice");
      auto it = id_to_row_.find(id);
      INFERSCALE_EXPECTS(it == id_to_row_.end() ||
                           (replacing_ns != invalid_fact_id &&
                            tenants_[it->second.tenant].ns == replacing_ns),
                         "graph_index: fact id " + std::to_string(id) + " is already indexed");
    }
    for (std::int64_t r = 0; r < vectors.extent(0); ++r) {
      double norm2 = 0.0;
      for (std::int64_t e = 0; e < config_.dim; ++e) {
        float const x = to_float(vectors(r, e));
        INFERSCALE_EXPECTS(std::isfinite(x), "graph_index: vector " + std::to_string(r) +
                                               " (fact id " + std::to_string(ids[r]) +
                                               ") has a NaN or infinite element at " +
                                               std::to_string(e));
        norm2 += double{x} * x;
      }
      INFERSCALE_EXPECTS(config_.metric != distance_metric::cosine || norm2 > 0.0,
                         "graph_index: vector " + std::to_string(r) + " (fact id " +
                           std::to_string(ids[r]) + ") is zero, which has no cosine");
      INFERSCALE_EXPECTS(norm2 <= max_norm2,
                         "graph_index: vector " + std::to_string(r) + " (fact id " +
                           std::to_string(ids[r]) +
                           ") has a squared norm above 1e30: its distances would overflow float32");
      if (config_.vector_dtype == dtype::float16 || traverses_fp16()) {
        double const scale = config_.metric == distance_metric::cosine ? 1.0 / std::sqrt(norm2) : 1.0;
        for (std::int64_t e = 0; e < config_.dim; ++e) {
          float const x = static_cast<float>(to_float(vectors(r, e)) * scale);
          INFERSCALE_EXPECTS(std::isfinite(to_float(from_float<half_t>(x))),
                             "graph_index: vector " + std::to_string(r) +
                               " overflows float16 at element " + std::to_string(e) +
                               (config_.vector_dtype == dtype::float16
                                  ? std::string{}
                                  : std::string{" (index_config::host_traversal_dtype float16)"}));
        }
      }
    }
  }

  arena allocate_arena(std::int64_t rows) const
  {
    arena a;
    a.vectors.assign(static_cast<std::size_t>(rows * row_elements_) * element_size_, 0);
    a.graph.assign(static_cast<std::size_t>(rows) * config_.graph_degree, detail::index::invalid_node);
    a.ids.assign(static_cast<std::size_t>(rows), invalid_fact_id);
    a.deleted.assign(static_cast<std::size_t>(rows), 0);
    return a;
  }

  /// `max_arena_rows()` for `live` live facts.
  std::int64_t row_limit(std::uint64_t live) const noexcept
  {
    if (config_.max_row_overhead == 0.0) { return std::numeric_limits<std::int64_t>::max(); }
    std::int64_t const n = static_cast<std::int64_t>(live);
    return std::max(static_cast<std::int64_t>(std::floor(config_.max_row_overhead * static_cast<double>(n))),
                    n + compaction_floor_rows);
  }

  /// What an automatic repack packs the arena into: half way between the live facts and the
  /// bound, so that the next repack is many mutations away (see `compactions`).
  std::int64_t repack_target(std::uint64_t live) const noexcept
  {
    std::int64_t const n = static_cast<std::int64_t>(live);
    double const factor  = 1.0 + (config_.max_row_overhead - 1.0) / 2.0;
    return std::max(static_cast<std::int64_t>(std::floor(factor * static_cast<double>(n))),
                    n + compaction_floor_rows / 2);
  }

  /// How far growth may take the arena when it needs `needed` rows for `live_after` facts: half
  /// way from `needed` to the bound (at least `needed` and the current size). Growth then leaves
  /// room for more moves and erasures before a repack, and about log2(gap / move) growths fill the
  /// gap a repack left, instead of one reallocation per move.
  std::int64_t growth_cap(std::int64_t needed, std::uint64_t live_after) const noexcept
  {
    std::int64_t const limit = row_limit(live_after);
    std::int64_t const cap   = needed < limit ? needed + (limit - needed) / 2 : needed;
    return std::max(cap, arena_capacity_);
  }

  /// Spare rows for a segment of `rows` rows that would end at `end` without them: a quarter of
  /// its rows, as far as `growth_cap` allows.
  std::uint32_t spare_rows(std::uint32_t rows, std::int64_t end, std::uint64_t live_after) const noexcept
  {
    std::int64_t const room = growth_cap(end, live_after) - end;
    return static_cast<std::uint32_t>(std::clamp<std::int64_t>(room, 0, rows / 4));
  }

  /// Makes the arena hold at least `needed` rows: doubling without automatic compaction, else
  /// 1.25x clipped at `growth_cap` (never below `needed`). The vectors are reserved exactly, so
  /// `arena_rows()` is what is allocated.
  void grow_arena(std::int64_t needed, std::uint64_t live_after)
  {
    if (needed <= arena_capacity_) { return; }
    std::int64_t const capacity =
      config_.max_row_overhead == 0.0
        ? std::max<std::int64_t>(needed, 2 * arena_capacity_)
        : std::max<std::int64_t>(needed, std::min(arena_capacity_ + arena_capacity_ / 4,
                                                  growth_cap(needed, live_after)));
    std::size_t const rows = static_cast<std::size_t>(capacity);
    vectors_.reserve(rows * static_cast<std::size_t>(row_elements_) * element_size_);
    graph_.reserve(rows * config_.graph_degree);
    ids_.reserve(rows);
    deleted_.reserve(rows);
    vectors_.resize(rows * static_cast<std::size_t>(row_elements_) * element_size_, 0);
    graph_.resize(rows * config_.graph_degree, detail::index::invalid_node);
    ids_.resize(rows, invalid_fact_id);
    deleted_.resize(rows, 0);
    arena_capacity_ = capacity;
    device_stale_   = true;
  }

  /// Finds or creates the tenant of `ns` with room for `rows` rows (moving it if needed), for an
  /// index that will hold `live_after` live facts.
  std::size_t ensure_room(std::uint64_t ns, std::uint32_t rows, std::uint64_t live_after)
  {
    bool const automatic = config_.max_row_overhead != 0.0;
    auto it = tenant_of_.find(ns);
    if (it == tenant_of_.end()) {
      std::uint32_t const capacity =
        automatic ? rows + spare_rows(rows, arena_used_ + rows, live_after)
                  : std::max<std::uint32_t>(rows, 16);
      grow_arena(arena_used_ + capacity, live_after);
      tenant t;
      t.ns            = ns;
      t.ref.row_begin = arena_used_;
      t.capacity      = capacity;
      arena_used_ += capacity;
      tenant_of_[ns] = tenants_.size();
      tenants_.push_back(t);
      return tenants_.size() - 1;
    }
    std::size_t const index = it->second;
    tenant& t               = tenants_[index];
    if (rows <= t.capacity) { return index; }
    bool const last = t.ref.row_begin + t.capacity == arena_used_;
    std::int64_t const begin = last ? t.ref.row_begin : arena_used_;
    std::uint32_t const capacity =
      automatic ? rows + spare_rows(rows, begin + rows, live_after)
                : static_cast<std::uint32_t>(std::max<std::uint64_t>(rows, std::uint64_t{2} * t.capacity));
    if (last) {  // grow in place at the end of the arena
      grow_arena(t.ref.row_begin + capacity, live_after);
      arena_used_ = t.ref.row_begin + capacity;
      tenants_[index].capacity = capacity;
      return index;
    }
    grow_arena(arena_used_ + capacity, live_after);
    tenant& moved              = tenants_[index];
    std::int64_t const from    = moved.ref.row_begin;
    std::int64_t const to      = arena_used_;
    std::uint32_t const used   = moved.ref.size;
    std::memmove(vectors_.data() + static_cast<std::size_t>(to * row_elements_) * element_size_,
                 vectors_.data() + static_cast<std::size_t>(from * row_elements_) * element_size_,
                 static_cast<std::size_t>(used * row_elements_) * element_size_);
    std::copy_n(graph_.begin() + from * config_.graph_degree,
                std::size_t{used} * config_.graph_degree,
                graph_.begin() + to * config_.graph_degree);
    std::copy_n(ids_.begin() + from, used, ids_.begin() + to);
    std::copy_n(deleted_.begin() + from, used, deleted_.begin() + to);
    std::fill_n(ids_.begin() + from, moved.capacity, invalid_fact_id);  // the hole
    std::fill_n(deleted_.begin() + from, moved.capacity, std::uint8_t{1});
    moved.ref.row_begin = to;
    moved.capacity      = capacity;
    arena_used_ += capacity;
    device_stale_ = true;
    return index;
  }

  /// After a mutation: repacks when the arena holds more than `max_arena_rows()` (see
  /// `compactions`). @return whether it did (a device index then got the whole arena uploaded)
  bool compact_if_needed(graph_builder const& builder)
  {
    std::uint64_t const live = total_size();
    if (arena_capacity_ <= row_limit(live)) { return false; }
    std::int64_t const target = repack_target(live);
    std::int64_t packed       = 0;
    std::vector<std::size_t> with_deleted;
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      if (!tenants_[t].alive) { continue; }
      packed += tenants_[t].ref.size;
      if (tenants_[t].ref.live != tenants_[t].ref.size) { with_deleted.push_back(t); }
    }
    // drop deleted rows where they are the largest share of a namespace (the most rows
    // reclaimed per row rebuilt) until the target is met; sizes < 2^31, so products fit int64
    auto deleted_of = [&](std::size_t t) {
      return std::int64_t{tenants_[t].ref.size} - tenants_[t].ref.live;
    };
    std::stable_sort(with_deleted.begin(), with_deleted.end(), [&](std::size_t a, std::size_t b) {
      return deleted_of(a) * tenants_[b].ref.size > deleted_of(b) * tenants_[a].ref.size;
    });
    std::vector<std::uint8_t> rebuild(tenants_.size(), 0);
    for (auto t : with_deleted) {
      if (packed <= target) { break; }
      rebuild[t] = 1;
      packed -= deleted_of(t);
    }
    repack(rebuild, std::max<std::int64_t>(0, target - packed), builder);
    ++compactions_;
    return true;
  }

  /**
   * Repacks the arena: the alive tenants in creation order, holes dropped. A tenant with
   * `rebuild[t]` keeps only its live rows (in order) and gets a fresh graph; the others keep their
   * rows, flags and graph bytes as they are (node ids are tenant-local). Up to `spare` rows are
   * handed out as spare capacity in proportion to the sizes, at most a quarter of a tenant's size
   * each. Re-uploads a device index. Does not change `version()`.
   */
  void repack(std::vector<std::uint8_t> const& rebuild, std::int64_t spare,
              graph_builder const& builder)
  {
    std::vector<std::size_t> order;
    std::int64_t packed = 0;
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      if (!tenants_[t].alive) { continue; }
      order.push_back(t);
      packed += rebuild[t] ? tenants_[t].ref.live : tenants_[t].ref.size;
    }
    double const fraction =
      packed == 0 ? 0.0 : std::min(0.25, static_cast<double>(spare) / static_cast<double>(packed));
    std::int64_t spare_left = spare;
    std::vector<tenant> next_tenants;
    next_tenants.reserve(order.size());
    std::int64_t cursor = 0;
    for (auto t : order) {
      tenant nt      = tenants_[t];
      nt.ref.size    = rebuild[t] ? nt.ref.live : nt.ref.size;
      std::int64_t const extra =
        std::min(spare_left, static_cast<std::int64_t>(std::floor(nt.ref.size * fraction)));
      spare_left -= extra;
      nt.ref.row_begin      = cursor;
      nt.capacity           = nt.ref.size + static_cast<std::uint32_t>(extra);
      nt.rebuild_on_compact = nt.ref.size != tenants_[t].ref.size;
      cursor += nt.capacity;
      next_tenants.push_back(nt);
    }
    arena next = allocate_arena(cursor);  // may throw: nothing has changed yet
    std::size_t const vb     = static_cast<std::size_t>(row_elements_) * element_size_;
    std::size_t const degree = config_.graph_degree;
    for (std::size_t i = 0; i < order.size(); ++i) {
      auto const& old    = tenants_[order[i]].ref;
      auto const& nt     = next_tenants[i].ref;
      std::size_t const src = static_cast<std::size_t>(old.row_begin);
      std::size_t const dst = static_cast<std::size_t>(nt.row_begin);
      if (!next_tenants[i].rebuild_on_compact) {  // the segment moves as it is
        std::memcpy(next.vectors.data() + dst * vb, vectors_.data() + src * vb, nt.size * vb);
        std::memcpy(next.graph.data() + dst * degree, graph_.data() + src * degree,
                    nt.size * degree * 4);
        std::memcpy(next.ids.data() + dst, ids_.data() + src, nt.size * 8);
        std::memcpy(next.deleted.data() + dst, deleted_.data() + src, nt.size);
        continue;
      }
      std::size_t out = dst;
      for (std::size_t v = 0; v < old.size; ++v) {
        if (deleted_[src + v]) { continue; }
        std::memcpy(next.vectors.data() + out * vb, vectors_.data() + (src + v) * vb, vb);
        next.ids[out++] = ids_[src + v];
      }
    }
    std::swap(vectors_, next.vectors);
    std::swap(graph_, next.graph);
    std::swap(ids_, next.ids);
    std::swap(deleted_, next.deleted);
    arena_capacity_ = cursor;
    arena_used_     = cursor;
    tenants_        = std::move(next_tenants);
    tenant_of_.clear();
    for (std::size_t i = 0; i < tenants_.size(); ++i) {
      tenant_of_[tenants_[i].ns] = i;
      // the locations of a tenant that kept its place in the table and its rows stay valid
      if (i == order[i] && !tenants_[i].rebuild_on_compact) { continue; }
      auto const& tr = tenants_[i].ref;
      for (std::uint32_t v = 0; v < tr.size; ++v) {
        if (!deleted_[tr.row_begin + v]) { id_to_row_[ids_[tr.row_begin + v]] = {i, v}; }
      }
    }
    for (std::size_t i = 0; i < tenants_.size(); ++i) {
      if (tenants_[i].rebuild_on_compact) {
        rebuild_graph(i, builder);
        tenants_[i].rebuild_on_compact = false;
      }
    }
    device_stale_ = true;
    reallocate_device();
  }

  template <class T>
  void write_rows(std::size_t t,
                  std::uint32_t first,
                  matrix_view<T const> vectors,
                  cuda::std::span<std::uint64_t const> ids)
  {
    auto& tr = tenants_[t];
    for (std::int64_t r = 0; r < vectors.extent(0); ++r) {
      std::int64_t const row = tr.ref.row_begin + first + r;
      double norm2           = 0.0;
      for (std::int64_t e = 0; e < config_.dim; ++e) {
        double const x = to_float(vectors(r, e));
        norm2 += x * x;
      }
      float const scale = config_.metric == distance_metric::cosine
                            ? static_cast<float>(1.0 / std::sqrt(norm2))
                            : 1.0f;
      unsigned char* dst = vectors_.data() + static_cast<std::size_t>(row * row_elements_) * element_size_;
      std::memset(dst, 0, static_cast<std::size_t>(row_elements_) * element_size_);
      for (std::int64_t e = 0; e < config_.dim; ++e) {
        float const x = to_float(vectors(r, e)) * scale;
        if (config_.vector_dtype == dtype::float32) {
          std::memcpy(dst + e * 4, &x, 4);
        } else {
          half_t const h = from_float<half_t>(x);
          std::memcpy(dst + e * 2, &h, 2);
        }
      }
      ids_[row]     = ids[static_cast<std::size_t>(r)];
      deleted_[row] = 0;
      std::fill_n(graph_.begin() + row * config_.graph_degree, config_.graph_degree,
                  detail::index::invalid_node);
      id_to_row_[ids_[row]] = {t, static_cast<std::uint32_t>(first + r)};
    }
    write_traversal(t, first, static_cast<std::uint32_t>(vectors.extent(0)));
  }

  /// Whether the fast host search walks a float16 copy of the rows (`host_traversal_dtype`).
  bool traverses_fp16() const noexcept
  {
    return config_.host_traversal_dtype == dtype::float16;
  }

  static void check_traversal_dtype(index_config const& config, char const* who)
  {
    INFERSCALE_EXPECTS(config.host_traversal_dtype == dtype::float32 ||
                         config.host_traversal_dtype == dtype::float16,
                       std::string{who} + ": host_traversal_dtype is float32 or float16, got " +
                         to_string(config.host_traversal_dtype));
    INFERSCALE_EXPECTS(config.host_traversal_dtype == dtype::float32 ||
                         (config.vector_dtype == dtype::float32 && config.memory == memory_kind::host),
                       std::string{who} +
                         ": host_traversal_dtype float16 needs a host-memory index of float32 "
                         "vectors (got vector_dtype " + to_string(config.vector_dtype) + ", " +
                         (config.memory == memory_kind::host ? "host" : "device") + " memory)");
  }

  /// Rows `[first, first + count)` of tenant `t` into its float16 copy (under float16 traversal).
  void write_traversal(std::size_t t, std::uint32_t first, std::uint32_t count)
  {
    if (!traverses_fp16() || count == 0) { return; }
    auto& tn                   = tenants_[t];
    std::size_t const re       = static_cast<std::size_t>(row_elements_);
    std::size_t const needed   = (std::size_t{first} + count) * re;
    if (tn.traversal.size() < needed) { tn.traversal.resize(needed); }
    float const* rows =
      reinterpret_cast<float const*>(vectors_.data()) + static_cast<std::size_t>(tn.ref.row_begin) * re;
    std::size_t const begin = std::size_t{first} * re;
    to_half(rows + begin, tn.traversal.data() + begin, needed - begin);
  }

  static void to_half(float const* from, half_t* to, std::size_t n) noexcept
  {
    for (std::size_t i = 0; i < n; ++i) {
      to[i] = from_float<half_t>(from[i]);
    }
  }

  /// The float16 copies of tenant `t` made afresh (rows and packed entry rows), or dropped when
  /// the index does not traverse float16.
  void rebuild_traversal(std::size_t t)
  {
    auto& tn = tenants_[t];
    if (!traverses_fp16()) {
      detail::huge_page_vector<half_t>().swap(tn.traversal);
      std::vector<half_t>().swap(tn.entry_traversal);
      return;
    }
    tn.traversal.resize(static_cast<std::size_t>(tn.ref.size) * static_cast<std::size_t>(row_elements_));
    write_traversal(t, 0, tn.ref.size);  // every element rewritten
    tn.entry_traversal.resize(tn.entry_vectors.size() / sizeof(float));
    to_half(reinterpret_cast<float const*>(tn.entry_vectors.data()), tn.entry_traversal.data(),
            tn.entry_traversal.size());
  }

  void erase_namespace_rows(std::uint64_t ns)
  {
    auto it = tenant_of_.find(ns);
    if (it == tenant_of_.end()) { return; }
    std::size_t const index = it->second;
    auto& t                 = tenants_[index];
    for (std::uint32_t v = 0; v < t.ref.size; ++v) {
      std::int64_t const row = t.ref.row_begin + v;
      if (!deleted_[row]) { id_to_row_.erase(ids_[row]); }
      deleted_[row] = 1;
    }
    upload_tenant(index, 0, upload_flags);
    t.ref.live = 0;
    t.ref.size = 0;
    rebuild_traversal(index);
  }

  template <class Fn>
  decltype(auto) with_rows(std::size_t t, Fn&& fn) const
  {
    unsigned char const* base =
      vectors_.data() + static_cast<std::size_t>(tenants_[t].ref.row_begin * row_elements_) * element_size_;
    if (config_.vector_dtype == dtype::float32) {
      return fn(reinterpret_cast<float const*>(base));
    }
    return fn(reinterpret_cast<half_t const*>(base));
  }

  /// Full CAGRA build of a tenant's graph from its rows (deleted rows included: they route).
  void rebuild_graph(std::size_t t, graph_builder const& builder)
  {
    auto const& tr = tenants_[t].ref;
    std::uint32_t const n = tr.size;
    std::uint32_t const degree = config_.graph_degree;
    std::uint32_t* graph = graph_.data() + tr.row_begin * degree;
    std::fill_n(graph, std::size_t{n} * degree, detail::index::invalid_node);
    auto const eff = detail::index::degrees_for(config_.intermediate_graph_degree, degree, n);
    if (n <= 1 || eff.final == 0) {
      refresh_entry_points(t);
      return;
    }
    std::vector<std::uint32_t> knn(std::size_t{n} * eff.intermediate);
    void const* rows = vectors_.data() +
                       static_cast<std::size_t>(tr.row_begin * row_elements_) * element_size_;
    if (builder.knn) {
      builder.knn(rows, n, eff.intermediate, knn.data());
    } else if (uses_nn_descent(n)) {
      with_rows(t, [&](auto const* r) {
        last_nn_descent_ = detail::index::nn_descent_knn_host(
          r, row_elements_, n, config_.metric, eff.intermediate, config_.nn_descent, knn.data());
      });
    } else {
      with_rows(t, [&](auto const* r) {
        detail::index::exact_knn_host(r, row_elements_, n, config_.metric, eff.intermediate,
                                      knn.data(), config_.build_threads);
      });
    }
    std::vector<std::uint32_t> pruned(std::size_t{n} * eff.final);
    if (builder.prune) {
      builder.prune(knn.data(), n, eff.intermediate, eff.final, pruned.data());
    } else {
      detail::index::prune_host(knn.data(), eff.intermediate, eff.intermediate, n, eff.final,
                                pruned.data(), config_.build_threads);
    }
    detail::index::reverse_and_merge_host(pruned.data(), n, eff.final, graph, degree,
                                          config_.build_threads);
    repair(t);
    refresh_entry_points(t);
  }

  /// Fewest entry points of the automatic choice, and rows probed to choose.
  static constexpr std::uint32_t min_host_entry_points = 64;
  static constexpr std::uint32_t entry_probes          = 200;
  /// Rows probed, and the recall@10 their searches must reach, to calibrate `default_ef`.
  static constexpr std::uint32_t calibration_probes = 256;
  static constexpr double calibration_recall        = 0.99;

  /// Entry points a namespace of `rows` rows gets at most (`index_config::host_entry_points`).
  std::uint32_t entry_point_count(std::uint32_t rows) const noexcept
  {
    if (config_.host_entry_points < 0) { return default_host_entry_points(rows); }
    return static_cast<std::uint32_t>(
      std::min<std::int64_t>(config_.host_entry_points, rows));
  }

  /// Chooses a tenant's entry points for the fast host search from its current rows.
  void refresh_entry_points(std::size_t t)
  {
    auto& tn                   = tenants_[t];
    std::uint32_t const n      = tn.ref.size;
    std::uint32_t const count  = entry_point_count(n);
    constexpr std::uint64_t seed = 0x9E3779B97F4A7C15ull;
    tn.entries = with_rows(t, [&](auto const* rows) {
      return detail::index::choose_entry_points(rows, row_elements_, n, count, 8 * count, seed);
    });
    std::size_t const row_bytes = static_cast<std::size_t>(row_elements_) * element_size_;
    tn.entry_vectors.resize(tn.entries.size() * row_bytes);
    unsigned char const* base =
      vectors_.data() + static_cast<std::size_t>(tn.ref.row_begin) * row_bytes;
    for (std::size_t i = 0; i < tn.entries.size(); ++i) {
      std::memcpy(tn.entry_vectors.data() + i * row_bytes, base + tn.entries[i] * row_bytes,
                  row_bytes);
    }
    if (config_.host_entry_points < 0) {  // automatic: as many as the data's clusters need
      std::uint32_t const needed = with_rows(t, [&](auto const* rows) {
        using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
        return detail::index::entry_points_needed(
          rows, row_elements_, graph_.data() + tn.ref.row_begin * config_.graph_degree,
          config_.graph_degree, n, tn.entries.data(),
          reinterpret_cast<T const*>(tn.entry_vectors.data()),
          static_cast<std::uint32_t>(tn.entries.size()),
          detail::index::fast_kernels_for<T>(config_.metric), min_host_entry_points,
          entry_probes);
      });
      tn.entries.resize(needed);  // a prefix: its rows are the packed buffer's first ones
      tn.entry_vectors.resize(std::size_t{needed} * row_bytes);
    }
    tn.default_ef = with_rows(t, [&](auto const* rows) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
      return detail::index::calibrate_ef(
        rows, row_elements_, graph_.data() + tn.ref.row_begin * config_.graph_degree,
        config_.graph_degree, n, tn.entries.data(),
        reinterpret_cast<T const*>(tn.entry_vectors.data()),
        static_cast<std::uint32_t>(tn.entries.size()),
        detail::index::fast_kernels_for<T>(config_.metric), calibration_probes,
        calibration_recall);
    });
    tn.entries_rows = n;
    rebuild_traversal(t);
  }

  float node_distance(std::size_t t, std::uint32_t a, std::uint32_t b) const
  {
    return with_rows(t, [&](auto const* rows) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
      std::vector<float> q(static_cast<std::size_t>(row_elements_));
      for (std::int64_t e = 0; e < row_elements_; ++e) {
        q[static_cast<std::size_t>(e)] = to_float(rows[std::int64_t{b} * row_elements_ + e]);
      }
      std::int64_t const chunks = row_elements_ / detail::index::chunk_elements<T>;
      return detail::index::team_distance(rows + std::int64_t{a} * row_elements_, q.data(), chunks,
                                          detail::index::team_size_for(chunks), config_.metric);
    });
  }

  void repair(std::size_t t)
  {
    auto const& tr = tenants_[t].ref;
    std::uint32_t* graph = graph_.data() + tr.row_begin * config_.graph_degree;
    detail::index::repair_reachability(graph, tr.size, config_.graph_degree, config_.graph_degree,
                                       [&](std::uint32_t a, std::uint32_t b) {
                                         return node_distance(t, a, b);
                                       });
  }

  /// Inserts row `v` of tenant `t` into the graph of rows `[0, v)` (CAGRA extend, sequential);
  /// `in_degree` (edges into each row) is kept up to date.
  void insert_node(std::size_t t, std::uint32_t v, std::vector<std::uint32_t>& in_degree,
                   detail::index::search_scratch& scratch)
  {
    auto const& tr             = tenants_[t].ref;
    std::uint32_t const degree = config_.graph_degree;
    std::uint32_t* graph       = graph_.data() + tr.row_begin * degree;
    std::uint32_t const want   = std::min(config_.intermediate_graph_degree, v);
    // the candidates: the host's fast search of rows [0, v) from the tenant's entry points
    // (those below v), deleted rows included (they route, and stay linked until compaction)
    auto const& tn = tenants_[t];
    detail::index::fast_plan plan;
    plan.k           = want;
    plan.ef          = std::max<std::uint32_t>(2 * want, 64);
    plan.entry_nodes = tn.entries.empty() ? nullptr : tn.entries.data();
    plan.entry_rows  = tn.entries.empty() ? nullptr : tn.entry_vectors.data();
    plan.entry_count = tn.entries.empty() ? entry_point_count(v)
                                          : static_cast<std::uint32_t>(tn.entries.size());
    std::vector<detail::index::search_entry> top;
    with_rows(t, [&](auto const* rows) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows)>>;
      std::vector<float> q(static_cast<std::size_t>(row_elements_));
      for (std::int64_t e = 0; e < row_elements_; ++e) {
        q[static_cast<std::size_t>(e)] = to_float(rows[std::int64_t{v} * row_elements_ + e]);
      }
      detail::index::graph_search_fast(rows, row_elements_, graph, degree, v, nullptr, q.data(),
                                       detail::index::fast_kernels_for<T>(config_.metric), plan,
                                       scratch, top);
    });
    // candidates L (by distance); detour counts use the candidates' graph rows
    std::vector<std::uint32_t> cand;
    for (auto const& e : top) {
      if (e.node != detail::index::invalid_node && cand.size() < want) { cand.push_back(e.node); }
    }
    std::uint32_t const k = static_cast<std::uint32_t>(cand.size());
    std::vector<std::uint32_t> counts(k, 0);
    std::unordered_map<std::uint32_t, std::uint32_t> rank;
    for (std::uint32_t i = 0; i < k; ++i) {
      rank[cand[i]] = i;
    }
    for (std::uint32_t a = 0; a < k; ++a) {
      std::uint32_t const* row = graph + std::size_t{cand[a]} * degree;
      for (std::uint32_t j = 0; j < degree; ++j) {
        auto it = rank.find(row[j]);
        if (it != rank.end() && it->second > a && j < it->second) { ++counts[it->second]; }
      }
    }
    std::uint32_t* out    = graph + std::size_t{v} * degree;
    std::uint32_t written = 0;
    for (std::uint32_t c = 0; c <= k && written < degree; ++c) {
      for (std::uint32_t r = 0; r < k && written < degree; ++r) {
        if (counts[r] == c) { out[written++] = cand[r]; }
      }
    }
    std::fill(out + written, out + degree, detail::index::invalid_node);
    // reverse edges: each of the first degree/2 neighbours points back at v, replacing an empty
    // slot or the second-half slot whose target has the most in-edges
    for (std::uint32_t i = 0; i < written; ++i) {
      ++in_degree[out[i]];
    }
    std::uint32_t const back = std::max<std::uint32_t>(1, degree / 2);
    for (std::uint32_t i = 0; i < std::min(back, written); ++i) {
      std::uint32_t* row = graph + std::size_t{out[i]} * degree;
      if (std::find(row, row + degree, v) != row + degree) { continue; }
      std::uint32_t slot = degree;
      for (std::uint32_t r = 0; r < degree && slot == degree; ++r) {
        if (row[r] == detail::index::invalid_node) { slot = r; }
      }
      if (slot == degree) {
        slot = degree - 1;
        for (std::uint32_t r = degree / 2; r < degree; ++r) {
          if (in_degree[row[r]] > in_degree[row[slot]]) { slot = r; }
        }
        --in_degree[row[slot]];
      }
      row[slot] = v;
      ++in_degree[v];
    }
  }

  template <class T>
  void search_tenant_typed(T const* rows,
                           tenant const& tn,
                           float const* query,
                           std::uint32_t k,
                           search_params const& params,
                           detail::index::search_scratch& scratch,
                           std::vector<detail::index::search_entry>& result) const
  {
    tenant_ref const& tr        = tn.ref;
    std::uint8_t const* deleted = deleted_.data() + tr.row_begin;
    if (tr.live == 0) {
      result.clear();
      return;
    }
    if (params.host_mode == host_search_mode::fast) {
      auto const kernels = detail::index::fast_kernels_for<T>(config_.metric);
      search_params resolved = params;  // the namespace's calibrated list when itopk_size is 0
      if (resolved.itopk_size == 0) { resolved.itopk_size = tn.default_ef; }
      if (uses_exact(tr, resolved)) {
        detail::index::exact_search_fast(rows, row_elements_, tr.size, deleted, query, kernels, k,
                                         scratch, result);
        return;
      }
      detail::index::fast_plan plan;
      plan.k              = k;
      plan.ef             = std::max(resolved.itopk_size, k);
      // a namespace built before its entry points existed (none yet) seeds from the generator
      plan.entry_nodes    = tn.entries.empty() ? nullptr : tn.entries.data();
      plan.entry_rows     = tn.entries.empty() ? nullptr : tn.entry_vectors.data();
      plan.entry_count    = tn.entries.empty() ? entry_point_count(tr.size)
                                               : static_cast<std::uint32_t>(tn.entries.size());
      plan.xor_mask       = params.rand_xor_mask;
      plan.max_expansions = params.max_iterations * params.search_width;
      if constexpr (std::is_same_v<T, float>) {
        if (traverses_fp16()) {  // the walk on the float16 copy, the best entries measured again
          assert(tn.traversal.size() >= std::size_t{tr.size} * static_cast<std::size_t>(row_elements_));
          plan.k          = plan.ef;  // the whole list
          plan.entry_rows = tn.entries.empty() ? nullptr : tn.entry_traversal.data();
          auto& walked    = scratch.walked;
          detail::index::graph_search_fast(
            tn.traversal.data(), row_elements_, graph_.data() + tr.row_begin * config_.graph_degree,
            config_.graph_degree, tr.size, deleted, query,
            detail::index::fast_kernels_for<half_t>(config_.metric), plan, scratch, walked);
          double const window = config_.metric == distance_metric::cosine
                                  ? 2.0 * detail::index::cosine_fp16_error_bound(row_elements_)
                                  : std::numeric_limits<double>::infinity();
          detail::index::rerank_exact(rows, row_elements_, query, kernels.distance, walked, k,
                                      window, result);
          return;
        }
      }
      detail::index::graph_search_fast(rows, row_elements_,
                                       graph_.data() + tr.row_begin * config_.graph_degree,
                                       config_.graph_degree, tr.size, deleted, query, kernels,
                                       plan, scratch, result);
      return;
    }
    if (uses_exact(tr, params)) {
      detail::index::exact_search_host(rows, row_elements_, tr.size, deleted, query,
                                       config_.metric, k, result);
      return;
    }
    std::uint32_t const parts = params.ctas_per_query;
    std::vector<detail::index::search_entry> top;
    result.clear();
    for (std::uint32_t c = 0; c < parts; ++c) {
      auto const plan = plan_for(tr.size, k, parts == 1 ? params : split_part(params, k, c));
      detail::index::graph_search_host(rows, row_elements_,
                                       graph_.data() + tr.row_begin * config_.graph_degree,
                                       config_.graph_degree, tr.size, query, config_.metric, plan,
                                       scratch, top);
      std::uint32_t taken = 0;  // the part's first k live entries (a part's answer)
      for (auto const& e : top) {
        if (taken == k) { break; }
        if (e.node != detail::index::invalid_node && !deleted[e.node]) {
          result.push_back({e.distance, e.node, false});
          ++taken;
        }
      }
    }
    if (parts > 1) {  // the best k distinct nodes of the parts, as the device's merge_split_kernel
      std::sort(result.begin(), result.end());
      result.erase(std::unique(result.begin(), result.end(),
                               [](auto const& a, auto const& b) { return a.node == b.node; }),
                   result.end());
      if (result.size() > k) { result.resize(k); }
    }
  }

  void search_tenant(tenant const& tn,
                     float const* query,
                     std::uint32_t k,
                     search_params const& params,
                     detail::index::search_scratch& scratch,
                     std::vector<detail::index::search_entry>& result) const
  {
    tenant_ref const& tr = tn.ref;
    unsigned char const* base =
      vectors_.data() + static_cast<std::size_t>(tr.row_begin * row_elements_) * element_size_;
    if (config_.vector_dtype == dtype::float32) {
      search_tenant_typed(reinterpret_cast<float const*>(base), tn, query, k, params, scratch,
                          result);
    } else {
      search_tenant_typed(reinterpret_cast<half_t const*>(base), tn, query, k, params, scratch,
                          result);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Device copies (device-memory indexes only)

  void free_device() noexcept
  {
    if (d_vectors_ != nullptr) { (void)cudaFree(d_vectors_); }
    if (d_graph_ != nullptr) { (void)cudaFree(d_graph_); }
    if (d_ids_ != nullptr) { (void)cudaFree(d_ids_); }
    if (d_deleted_ != nullptr) { (void)cudaFree(d_deleted_); }
    d_vectors_ = nullptr;
    d_graph_   = nullptr;
    d_ids_     = nullptr;
    d_deleted_ = nullptr;
    d_capacity_ = 0;
  }

  void reallocate_device()
  {
    if (config_.memory != memory_kind::device) { return; }
    free_device();
    std::int64_t const rows = std::max<std::int64_t>(arena_capacity_, 1);
    INFERSCALE_CUDA_TRY(cudaMalloc(&d_vectors_, static_cast<std::size_t>(rows * row_elements_) * element_size_));
    INFERSCALE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&d_graph_),
                                   static_cast<std::size_t>(rows) * config_.graph_degree * 4));
    INFERSCALE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&d_ids_), static_cast<std::size_t>(rows) * 8));
    INFERSCALE_CUDA_TRY(cudaMalloc(reinterpret_cast<void**>(&d_deleted_), static_cast<std::size_t>(rows)));
    d_capacity_ = rows;
    if (arena_capacity_ > 0) { copy_rows(0, arena_capacity_); }
    device_stale_ = false;
  }

  /// What a partial upload copies.
  enum upload_part : unsigned { upload_vectors = 1, upload_graph = 2, upload_flags = 4, upload_all = 7 };

  void copy_rows(std::int64_t begin, std::int64_t count, unsigned parts = upload_all)
  {
    if (count <= 0) { return; }
    std::size_t const vb = static_cast<std::size_t>(row_elements_) * element_size_;
    if (parts & upload_vectors) {
      INFERSCALE_CUDA_TRY(cudaMemcpy(static_cast<unsigned char*>(d_vectors_) + begin * vb,
                                     vectors_.data() + begin * vb, count * vb,
                                     cudaMemcpyHostToDevice));
      INFERSCALE_CUDA_TRY(cudaMemcpy(d_ids_ + begin, ids_.data() + begin,
                                     static_cast<std::size_t>(count) * 8, cudaMemcpyHostToDevice));
    }
    if (parts & upload_graph) {
      INFERSCALE_CUDA_TRY(cudaMemcpy(d_graph_ + begin * config_.graph_degree,
                                     graph_.data() + begin * config_.graph_degree,
                                     static_cast<std::size_t>(count) * config_.graph_degree * 4,
                                     cudaMemcpyHostToDevice));
    }
    if (parts & upload_flags) {
      INFERSCALE_CUDA_TRY(cudaMemcpy(d_deleted_ + begin, deleted_.data() + begin,
                                     static_cast<std::size_t>(count), cudaMemcpyHostToDevice));
    }
  }

  /// Copies a tenant's changed rows to the device: the new rows `[first_new, size)` (vectors,
  /// ids, flags) and the whole graph of the tenant (reverse edges touch old rows), or only the
  /// flags after a delete. Reallocates and copies everything when the arena grew or moved rows.
  void upload_tenant(std::size_t t, std::uint32_t first_new = 0, unsigned parts = upload_all)
  {
    if (config_.memory != memory_kind::device) { return; }
    if (device_stale_ || d_capacity_ < arena_capacity_) {
      reallocate_device();
      return;
    }
    auto const& tr = tenants_[t].ref;
    if (parts & upload_vectors) {
      copy_rows(tr.row_begin + first_new, std::int64_t{tr.size} - first_new, upload_vectors | upload_flags);
    }
    if (parts & upload_graph) { copy_rows(tr.row_begin, tr.size, upload_graph); }
    if (parts & upload_flags) { copy_rows(tr.row_begin, tenants_[t].capacity, upload_flags); }
  }

  index_config config_{};
  std::size_t element_size_{4};
  std::int64_t row_elements_{0};
  // Rows and graph on huge pages where the system allows (read at random by every search).
  detail::huge_page_vector<unsigned char> vectors_;
  detail::huge_page_vector<std::uint32_t> graph_;
  std::vector<std::uint64_t> ids_;
  std::vector<std::uint8_t> deleted_;
  std::int64_t arena_capacity_{0};
  std::int64_t arena_used_{0};
  std::vector<tenant> tenants_;
  std::unordered_map<std::uint64_t, std::size_t> tenant_of_;
  std::unordered_map<std::uint64_t, row_location> id_to_row_;
  std::uint64_t version_{0};
  std::uint64_t compactions_{0};
  bool device_stale_{false};
  void* d_vectors_{nullptr};
  std::uint32_t* d_graph_{nullptr};
  std::uint64_t* d_ids_{nullptr};
  std::uint8_t* d_deleted_{nullptr};
  std::int64_t d_capacity_{0};
  detail::index::nn_descent_report last_nn_descent_{};
};

}  // namespace inferscale
#include <inferscale/detail/index/serialize.hpp>
