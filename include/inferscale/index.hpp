/**
 * @file index.hpp
 * @brief The fact index: a CAGRA-style proximity graph over fact embeddings, with stable 64-bit
 * fact ids, incremental insert, delete and compaction, and many small per-user graphs (tenants,
 * one per namespace) in one arena. This header is the data structure and the host backend; the
 * device backend (GPU kNN build, batched beam search, exact search with RAFT) is `index.cuh`.
 *
 * Arena layout (host mirror always; device copies when `memory_space::device`):
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
 *
 * Where the parts live: the parameters in `index_params.hpp`; the search cost model in
 * `detail/index/cost_model.hpp`; the class's member definitions, included at the end of this
 * header, in `detail/index/arena.inl` (rows, tenants, growth, compaction, float16 copies, device
 * mirror), `detail/index/maintenance.inl` (add / build / erase, graph builds, inserts and repair,
 * entry points) and `detail/index/search.inl` (the free host `search`, and the plan and checks
 * the device backend shares); persistence (`save_index` / `load_index`) in `index_snapshot.hpp`.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/host_memory.hpp>
#include <inferscale/detail/index/cost_model.hpp>
#include <inferscale/detail/index/graph_build.hpp>
#include <inferscale/detail/index/math.hpp>
#include <inferscale/detail/index/search_host.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/index_params.hpp>
#include <inferscale/memory_resource.hpp>
#include <inferscale/memory_space.hpp>

#include <cuda/std/span>

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace inferscale {

namespace detail::index {
/// @brief One tenant's segment of the arena (trivially copyable: kernels read it).
struct tenant_ref {
  std::int64_t row_begin{0};
  std::uint32_t size{0};  ///< rows used (live + deleted)
  std::uint32_t live{0};
};

/// @brief Non-owning device handle of an index's arena (pointers into the device arrays; rows of
/// a namespace start at its `tenant_ref::row_begin`, graph node ids are local to it).
struct graph_index_ref {
  void const* vectors{nullptr};          ///< `[rows][row_elements]` of the index dtype
  std::uint32_t const* graph{nullptr};   ///< `[rows][degree]` local node ids
  std::uint64_t const* ids{nullptr};     ///< `[rows]` fact ids
  std::uint8_t const* deleted{nullptr};  ///< `[rows]` 1 = deleted
  std::int64_t row_elements{0};
  std::uint32_t degree{0};
  distance_metric metric{distance_metric::cosine};
  dtype vector_dtype{dtype::float32};
};

/**
 * Namespaces of at least this many rows (when their entry points are chosen) keep a packed copy
 * of their entry points' rows, which the fast search scans as one stream; smaller ones read the
 * entry rows in place, at random, as the walk reads every other row. From here on the copy is at
 * most 6.4 % of the vectors (64 of 1,000 rows; 4 / sqrt(n) above), and it saves 3-10 % of a
 * search at 1,000 rows and 10-26 % at 10,000 (384-d). Below, a namespace is mostly searched
 * exactly (the automatic threshold is 313-1,523 rows at the default lists), which reads no entry
 * point, and the copy would cost up to 64 % of its vectors: at 1,000 users with every
 * namespace's entry rows packed the index held 564 B per fact of them
 * (bench/results/2026-12-06-tenants-overhead.md).
 */
inline constexpr std::uint32_t packed_entry_min_rows = 1000;

struct index_access;
struct snapshot_access;
}  // namespace detail::index

class graph_index;

/// How `graph_index`'s out-of-class members are defined: `inline` in the header-only form;
/// nothing when the program compiles them once (`INFERSCALE_EXTERN_TEMPLATES`: the unit that
/// includes instances.hpp holds their one definition, `detail/index/definitions.inl`).
#if defined(INFERSCALE_EXTERN_TEMPLATES)
#define INFERSCALE_INDEX_LINKAGE
#else
#define INFERSCALE_INDEX_LINKAGE inline
#endif

/**
 * @brief Searches a host-memory index: query `q` looks in namespace `namespaces[q]` (or all in
 * `namespaces[0]` when one namespace is given). Row `q` of the outputs gets the `k` nearest live
 * facts sorted by distance; slots beyond the namespace's live facts get `invalid_fact_id` and
 * +infinity.
 *
 * The host half of the library's one `search`: the device backend's overload in `index.cuh`,
 * `search(raft::resources const&, index, queries, namespaces, k, params, out_ids,
 * out_distances)`, takes the same arguments after the RAFT handle (as cuVS has one `search` per
 * index type); on a device-memory index of the same content it gives this function's answers
 * under `host_search_mode::reference`, bit for bit. It is the host index's one search entry
 * point (`graph_index` has no search member).
 *
 * @tparam T float or half_t (queries are compared in fp32)
 * @param[in] index a host-memory index
 * @param[in] queries `[q][dim]` host view (any strides)
 * @param[in] namespaces one namespace per query, or one for all
 * @param[in] k results per query (>= 1)
 * @param[in] params search knobs (itopk, width, split, threads, ...)
 * @param[out] out_ids `[q][k]` fact ids; `invalid_fact_id` beyond the namespace's live facts
 * @param[out] out_distances `[q][k]` distances under the index metric; +infinity where no fact
 * @throw logic_error (outputs untouched) for a device index, a dimension mismatch, NaN/Inf in a
 * query, a zero query under cosine, a query with a squared norm above 1e30 under inner product or
 * squared L2, an unknown namespace, k == 0, output shapes other than `[queries][k]`, or
 * search_width outside 1..64
 */
template <class T>
void search(graph_index const& index,
            matrix_view<T const> queries,
            cuda::std::span<std::uint64_t const> namespaces,
            std::uint32_t k,
            search_params const& params,
            matrix_view<std::uint64_t> out_ids,
            matrix_view<float> out_distances);

/**
 * @brief The fact index (move-only owner). See the file comment for the layout and contracts.
 *
 * The public members are what a user calls: construction, properties, sizes (namespaces, facts,
 * rows and bytes held) and the mutations; searches are the free `inferscale::search` and
 * persistence the free `save_index` / `load_index` (`index_snapshot.hpp`). The backends'
 * plumbing (tenant segments, raw rows, search plans and checks, the fast host search's state) is
 * private, read by the library's own code through `detail::index::index_access`.
 *
 * @note Searched with the free `inferscale::search`: host-memory indexes with the overload in
 * this header, device-memory indexes with the one in `index.cuh` (a `raft::resources` first).
 * All mutations run on the host mirror and copy the changed tenant segment to the device before
 * returning (they synchronise).
 */
class graph_index {
 public:
  /// @throw logic_error on a zero dimension, a dtype other than float32/float16, or degrees
  /// outside `1 <= graph_degree <= intermediate_graph_degree <= 1024`.
  explicit graph_index(index_config const& config);

  graph_index(graph_index&& other) noexcept { swap(other); }
  graph_index& operator=(graph_index&& other) noexcept;
  graph_index(graph_index const&)            = delete;
  graph_index& operator=(graph_index const&) = delete;
  ~graph_index() { free_device(); }

  // ---------------------------------------------------------------------------------------------
  // Properties

  /// @brief The configuration (of a loaded index: what `load_index` restores, the rest default).
  index_config const& config() const noexcept { return config_; }
  /// @brief The embedding dimension (`config().dim`): queries and vectors are `[rows][dim]`.
  std::int64_t dim() const noexcept { return config_.dim; }
  /// @brief Where the index lives and is searched (`config().space`).
  memory_space space() const noexcept { return config_.space; }
  /// @brief Increases on every successful mutation; a refused call leaves it unchanged.
  std::uint64_t version() const noexcept { return version_; }

  /**
   * @brief Under `search_algo::automatic`, a namespace of `rows` rows with at most this many live
   * facts is searched exactly. The configured value when `index_config::exact_search_threshold`
   * is >= 0; otherwise chosen automatically from the search parameters by the cost model of
   * `detail::index::estimated_graph_distances` with the backend's measured factor.
   */
  std::int64_t exact_search_threshold(search_params const& p = {},
                                      std::uint32_t rows     = 100000) const noexcept;

  // ---------------------------------------------------------------------------------------------
  // Sizes: namespaces and facts

  /// @brief Number of namespaces with a tenant (including ones whose facts were all deleted).
  std::size_t num_namespaces() const noexcept { return tenant_of_.size(); }
  /// @brief The namespaces, in order of creation.
  std::vector<std::uint64_t> namespaces() const;
  /// @brief Whether a namespace has a tenant (as counted by `num_namespaces`).
  bool has_namespace(std::uint64_t ns) const noexcept { return tenant_of_.count(ns) != 0; }
  /// @brief Live facts of a namespace (0 if unknown).
  std::uint32_t size(std::uint64_t ns) const noexcept;
  /// @brief Live facts over all namespaces.
  std::uint64_t total_size() const noexcept { return id_to_row_.size(); }
  /// @brief Whether a fact id is live in some namespace.
  bool contains(std::uint64_t id) const noexcept { return id_to_row_.count(id) != 0; }
  /// @brief The namespace holding a live fact. @throw logic_error for an unknown id.
  std::uint64_t namespace_of(std::uint64_t id) const;
  /// @brief Live fact ids of a namespace, in row order.
  std::vector<std::uint64_t> ids(std::uint64_t ns) const;

  // ---------------------------------------------------------------------------------------------
  // Sizes: memory

  /// @brief Rows a namespace occupies (live + deleted, until a compaction drops its deleted rows).
  std::uint32_t rows(std::uint64_t ns) const noexcept;
  /// @brief Arena rows held (what the namespaces were given: their rows, spare rows and holes;
  /// the vectors' capacity reserved beyond them is not written, so not resident). Automatic
  /// compaction keeps them within `index_config::max_row_overhead` of `total_size()`.
  std::int64_t arena_rows() const noexcept { return arena_capacity_; }
  /// @brief Bytes of the arena's vectors, graph, ids and flags (one copy).
  std::uint64_t arena_bytes() const noexcept;
  /// @brief Bytes of the float16 copies under `host_traversal_dtype` float16 (each namespace's
  /// rows and packed entry rows; 0 otherwise), beside `arena_bytes`.
  std::uint64_t host_traversal_bytes() const noexcept;
  /// @brief Bytes of the fast host search's entry points beside `arena_bytes`: each
  /// namespace's entry point ids (4 bytes each) and, in namespaces of at least
  /// `detail::index::packed_entry_min_rows` rows, the packed copy of their rows in the index's
  /// dtype (their float16 copies count in `host_traversal_bytes`).
  std::uint64_t host_entry_bytes() const noexcept;

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
   *                `index_config::host_knn` says); `index.cuh` has a device one. Also builds
   *                the namespaces an automatic compaction rebuilds (see
   *                `index_config::max_row_overhead`).
   * @throw logic_error (nothing changed) on a dimension mismatch, NaN/Inf, a zero vector under the
   * cosine metric, a squared norm above 1e30 under inner product or squared L2 (cosine normalises
   * every other finite vector, denormal or huge), a value beyond float16 under float16 rows, a
   * repeated or existing id, `ids.size() != rows`, or a namespace over 2^31 rows
   */
  template <class T>
  void add(std::uint64_t ns,
           matrix_view<T const> vectors,
           cuda::std::span<std::uint64_t const> ids,
           graph_builder const& builder = {});

  /**
   * @brief Replaces a namespace's facts with these (a fresh build); a namespace that did not exist
   * is created. Ids may repeat the namespace's old ids, not other namespaces' ids.
   */
  template <class T>
  void build(std::uint64_t ns,
             matrix_view<T const> vectors,
             cuda::std::span<std::uint64_t const> ids,
             graph_builder const& builder = {});

  /**
   * @brief Deletes facts: they leave search results at once (their nodes still route) and their
   * ids can be added again; the rows are reclaimed by `compact()` or an automatic compaction.
   * @param builder builds the namespaces an automatic compaction rebuilds (see
   * `index_config::max_row_overhead`)
   * @throw logic_error (nothing changed) if any id is unknown or repeated
   */
  void erase(cuda::std::span<std::uint64_t const> ids, graph_builder const& builder = {});

  /// @brief Deletes every fact of a namespace and the namespace itself (its rows become a hole).
  /// @param builder builds the namespaces an automatic compaction rebuilds (see
  /// `index_config::max_row_overhead`)
  /// @return the number of live facts removed (0 for an unknown namespace).
  std::uint32_t erase_namespace(std::uint64_t ns, graph_builder const& builder = {});

  /**
   * @brief Reclaims the rows of deleted facts and the holes left by moved or erased tenants:
   * each tenant with deletions is rebuilt from its live facts, and the arena is repacked with no
   * spare rows (`arena_rows() == total_size()`).
   */
  void compact(graph_builder const& builder = {});

  /**
   * @brief Chooses what the host's fast graph search walks (`index_config::host_traversal_dtype`):
   * float16 makes every namespace's float16 copy (O(rows x dim)), float32 frees them. Results
   * change only as the walk does; the rows, graph and ids do not.
   * @throw logic_error (nothing changed) on another dtype, float16 on a float16 or device index,
   * or float16 when some stored vector overflows float16
   */
  void set_host_traversal_dtype(dtype d);

 private:
  friend struct detail::index::index_access;
  friend struct detail::index::snapshot_access;

  template <class T>
  friend void search(graph_index const& index,
                     matrix_view<T const> queries,
                     cuda::std::span<std::uint64_t const> namespaces,
                     std::uint32_t k,
                     search_params const& params,
                     matrix_view<std::uint64_t> out_ids,
                     matrix_view<float> out_distances);

  using tenant_ref = detail::index::tenant_ref;

  // ---------------------------------------------------------------------------------------------
  // Internals that the library's own code (the device backend in index.cuh, the tests and the
  // benchmarks) reads through `detail::index::index_access`, the only way in from outside

  std::int64_t row_elements() const noexcept { return row_elements_; }
  /// Stored graph out-degree (rows of small tenants are padded with empty slots).
  std::uint32_t graph_degree() const noexcept { return config_.graph_degree; }

  /// Whether the host builds the kNN graph of a namespace of `rows` rows with NN-descent (true)
  /// or exactly: `host_knn`, and under `automatic` NN-descent above `exact_knn_max_rows`. A
  /// `graph_builder` with a `knn` callback overrides both.
  bool uses_nn_descent(std::uint32_t rows) const noexcept;

  /// What the last host NN-descent build did (zeros if none ran).
  detail::index::nn_descent_report const& last_nn_descent() const noexcept
  {
    return last_nn_descent_;
  }

  /// Entry points the fast host search of a namespace starts from (0 if unknown; see
  /// `index_config::host_entry_points`).
  std::uint32_t host_entry_points(std::uint64_t ns) const noexcept;
  /// The fast host search's result list for `itopk_size` 0 in a namespace (0 if unknown): the
  /// smallest of a grid (10 .. 256) with which searches for 256 of its rows found 99 % of their
  /// 10 nearest other rows, chosen whenever its entry points are.
  std::uint32_t host_default_ef(std::uint64_t ns) const noexcept;
  /// A namespace's float16 rows `[rows(ns)][row_elements]` under float16 traversal, else null
  /// (and null for an unknown namespace).
  half_t const* host_traversal_rows(std::uint64_t ns) const noexcept;

  /// Arena rows in use by tenants, holes included (`arena_rows()` less the rows at its end that
  /// no tenant was given).
  std::int64_t arena_rows_in_use() const noexcept { return arena_used_; }
  /// The most arena rows automatic compaction allows after a mutation:
  /// `max(floor(max_row_overhead * total_size()), total_size() + compaction_floor_rows)`, or the
  /// largest int64 when `max_row_overhead` is 0 (`index_config::max_row_overhead`).
  std::int64_t max_arena_rows() const noexcept { return row_limit(total_size()); }
  /// Automatic compactions so far (`compact()` calls not counted; not saved). A mutation that
  /// leaves `arena_rows() > max_arena_rows()` repacks before it returns, as
  /// `index_config::max_row_overhead` describes.
  std::uint64_t compactions() const noexcept { return compactions_; }

  /// The tenant segment of a namespace (`size == 0` if unknown).
  tenant_ref tenant_segment(std::uint64_t ns) const noexcept;
  /// The tenant table (for the device backend: index = position in `tenant_table()`, as
  /// `check_search` resolves the queries' namespaces).
  std::vector<tenant_ref> tenant_table() const;
  /// A tenant's rows on the host: the graph `[rows(ns)][graph_degree]` (local node ids), the
  /// padded vectors (bytes of the index dtype), the fact ids and the deleted flags.
  /// @throw logic_error for an unknown namespace
  std::uint32_t const* graph_rows(std::uint64_t ns) const;
  void const* vector_rows(std::uint64_t ns) const;
  std::uint64_t const* id_rows(std::uint64_t ns) const;
  std::uint8_t const* deleted_rows(std::uint64_t ns) const;
  /// The device arrays (null pointers for a host index).
  detail::index::graph_index_ref ref() const noexcept;

  /// The resolved plan of a search of one tenant of `n` rows (itopk raised to k, automatic
  /// iteration bound). Shared by both backends.
  detail::index::search_plan plan_for(std::uint32_t n,
                                      std::uint32_t k,
                                      search_params const& p) const noexcept;

  /// `p` with its split resolved for a batch of `queries` graph searches: `ctas_per_query` 0
  /// (automatic) becomes auto_ctas_per_query; any other value stays.
  static search_params resolve_split(search_params const& p,
                                     std::int64_t queries,
                                     std::uint32_t k) noexcept;

  /// The parameters of part `c` of a split search (`search_params::ctas_per_query`): the part's
  /// top list and seed mask, one part. Both backends plan each part from them (plan_for).
  static search_params split_part(search_params const& p,
                                  std::uint32_t k,
                                  std::uint32_t c) noexcept;

  /// Whether a search of this tenant runs exactly (true) or on the graph.
  bool uses_exact(tenant_ref const& t, search_params const& p) const noexcept;

  /// Queries padded to the row length and normalised for cosine, as both backends compare them
  /// (fp32). @throw logic_error on a dimension mismatch, NaN/Inf, a zero cosine query or a
  /// squared norm above 1e30 under inner product or squared L2.
  template <class T>
  std::vector<float> prepare_queries(matrix_view<T const> queries) const;

  /// Validates a search and resolves each query's tenant (index into the tenant table). Shared
  /// by both backends. @throw logic_error as described at `inferscale::search`.
  template <class T>
  std::vector<std::int64_t> check_search(matrix_view<T const> queries,
                                         cuda::std::span<std::uint64_t const> namespaces,
                                         std::uint32_t k,
                                         search_params const& params,
                                         std::int64_t ids_rows,
                                         std::int64_t ids_cols,
                                         std::int64_t dist_rows,
                                         std::int64_t dist_cols) const;

  // ---------------------------------------------------------------------------------------------
  // Arena state

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

  /// Vectors and queries with a larger squared norm are refused under inner product and squared
  /// L2: with |q|^2, |x|^2 <= 1e30 every dot product and squared distance stays below float32's
  /// 3.4e38 (never Inf or NaN), so the (distance, node) order stays total. Cosine normalises
  /// every finite non-zero vector (denormal and largest finite ones too) and needs no bound.
  static constexpr double max_norm2 = 1e30;

  /// Squared norm of row `r` of `vectors` in double, its elements in order: what `add` checks
  /// and (under cosine) normalises by.
  template <class T>
  static double row_norm2(matrix_view<T const> vectors, std::int64_t r) noexcept;

  // ---------------------------------------------------------------------------------------------
  // Arena: rows, tenants, growth, compaction, float16 copies (detail/index/arena.inl)

  void swap(graph_index& o) noexcept;

  tenant_ref checked_tenant(std::uint64_t ns) const;

  /// Calls `fn` with tenant `t`'s rows as `float const*` or `half_t const*` (the index dtype).
  template <class Fn>
  decltype(auto) with_rows(std::size_t t, Fn&& fn) const;

  template <class T>
  void write_rows(std::size_t t,
                  std::uint32_t first,
                  matrix_view<T const> vectors,
                  cuda::std::span<std::uint64_t const> ids);

  arena allocate_arena(std::int64_t rows) const;

  /// `max_arena_rows()` for `live` live facts.
  std::int64_t row_limit(std::uint64_t live) const noexcept;

  /// What an automatic repack packs the arena into: half way between the live facts and the
  /// bound, so that the next repack is many mutations away (see `compactions`).
  std::int64_t repack_target(std::uint64_t live) const noexcept;

  /// How far growth may take the arena when it needs `needed` rows for `live_after` facts: half
  /// way from `needed` to the bound (at least `needed` and the current size). Growth then leaves
  /// room for more moves and erasures before a repack, and about log2(gap / move) growths fill the
  /// gap a repack left, instead of one reallocation per move.
  std::int64_t growth_cap(std::int64_t needed, std::uint64_t live_after) const noexcept;

  /// Spare rows for a segment of `rows` rows that would end at `end` without them: a quarter of
  /// its rows, as far as `growth_cap` allows.
  std::uint32_t spare_rows(std::uint32_t rows,
                           std::int64_t end,
                           std::uint64_t live_after) const noexcept;

  /// Makes the arena hold `needed` rows when it holds fewer. Its vectors reserve ahead when they
  /// must reallocate: doubling without automatic compaction, else 1.25x clipped at `growth_cap`
  /// (never below `needed`); the reserve is not written, so `arena_rows()` is what is resident.
  void grow_arena(std::int64_t needed, std::uint64_t live_after);

  /// Finds or creates the tenant of `ns` with room for `rows` rows (moving it if needed), for an
  /// index that will hold `live_after` live facts.
  std::size_t ensure_room(std::uint64_t ns, std::uint32_t rows, std::uint64_t live_after);

  /// After a mutation: repacks when the arena holds more than `max_arena_rows()` (see
  /// `compactions`). @return whether it did (a device index then got the whole arena uploaded)
  bool compact_if_needed(graph_builder const& builder);

  /**
   * Repacks the arena: the alive tenants in creation order, holes dropped. A tenant with
   * `rebuild[t]` keeps only its live rows (in order) and gets a fresh graph; the others keep their
   * rows, flags and graph bytes as they are (node ids are tenant-local). Up to `spare` rows are
   * handed out as spare capacity in proportion to the sizes, at most a quarter of a tenant's size
   * each. Re-uploads a device index. Does not change `version()`.
   */
  void repack(std::vector<std::uint8_t> const& rebuild,
              std::int64_t spare,
              graph_builder const& builder);

  /// Whether the fast host search walks a float16 copy of the rows (`host_traversal_dtype`).
  bool traverses_fp16() const noexcept { return config_.host_traversal_dtype == dtype::float16; }

  static void check_traversal_dtype(index_config const& config, char const* who);

  /// Rows `[first, first + count)` of tenant `t` into its float16 copy (under float16 traversal).
  void write_traversal(std::size_t t, std::uint32_t first, std::uint32_t count);

  static void to_half(float const* from, half_t* to, std::size_t n) noexcept;

  /// The float16 copies of tenant `t` made afresh (rows and packed entry rows), or dropped when
  /// the index does not traverse float16.
  void rebuild_traversal(std::size_t t);

  // ---------------------------------------------------------------------------------------------
  // Graph maintenance (detail/index/maintenance.inl)

  /// Below this many rows a namespace's graph is rebuilt on every add (cheap, and best quality).
  std::uint32_t rebuild_limit() const noexcept;

  template <class T>
  void check_new_facts(matrix_view<T const> vectors,
                       cuda::std::span<std::uint64_t const> ids,
                       std::uint64_t replacing_ns = invalid_fact_id) const;

  void erase_namespace_rows(std::uint64_t ns);

  /// Full CAGRA build of a tenant's graph from its rows (deleted rows included: they route).
  void rebuild_graph(std::size_t t, graph_builder const& builder);

  /// Inserts row `v` of tenant `t` into the graph of rows `[0, v)` (CAGRA extend, sequential);
  /// `in_degree` (edges into each row) is kept up to date.
  void insert_node(std::size_t t,
                   std::uint32_t v,
                   std::vector<std::uint32_t>& in_degree,
                   detail::index::search_scratch& scratch);

  float node_distance(std::size_t t, std::uint32_t a, std::uint32_t b) const;

  void repair(std::size_t t);

  /// Fewest entry points of the automatic choice, and rows probed to choose.
  static constexpr std::uint32_t min_host_entry_points = 64;
  static constexpr std::uint32_t entry_probes          = 200;
  /// Rows probed, and the recall@10 their searches must reach, to calibrate `default_ef`.
  static constexpr std::uint32_t calibration_probes = 256;
  static constexpr double calibration_recall        = 0.99;

  /// Entry points a namespace of `rows` rows gets at most (`index_config::host_entry_points`).
  std::uint32_t entry_point_count(std::uint32_t rows) const noexcept;

  /// Makes tenant `t`'s packed entry rows those of its current entry points, or empties them
  /// below `packed_entry_min_rows` (their float16 copy follows in `rebuild_traversal`).
  void pack_entry_rows(std::size_t t);

  /// The packed entry rows of a tenant for `fast_plan::entry_rows`, or null when not packed.
  static void const* packed_entry_rows(tenant const& tn) noexcept
  {
    return tn.entry_vectors.empty() ? nullptr : tn.entry_vectors.data();
  }

  /// Chooses a tenant's entry points for the fast host search from its current rows.
  void refresh_entry_points(std::size_t t);

  // ---------------------------------------------------------------------------------------------
  // Host search (detail/index/search.inl)

  void search_tenant(tenant const& tn,
                     float const* query,
                     std::uint32_t k,
                     search_params const& params,
                     detail::index::search_scratch& scratch,
                     std::vector<detail::index::search_entry>& result) const;

  template <class T>
  void search_tenant_typed(T const* rows,
                           tenant const& tn,
                           float const* query,
                           std::uint32_t k,
                           search_params const& params,
                           detail::index::search_scratch& scratch,
                           std::vector<detail::index::search_entry>& result) const;

  // ---------------------------------------------------------------------------------------------
  // Device copies (device-memory indexes only; detail/index/arena.inl)

  void free_device() noexcept;

  void reallocate_device();

  /// What a partial upload copies.
  enum upload_part : unsigned {
    upload_vectors = 1,
    upload_graph   = 2,
    upload_flags   = 4,
    upload_all     = 7
  };

  void copy_rows(std::int64_t begin, std::int64_t count, unsigned parts = upload_all);

  /// Copies a tenant's changed rows to the device: the new rows `[first_new, size)` (vectors,
  /// ids, flags) and the whole graph of the tenant (reverse edges touch old rows), or only the
  /// flags after a delete. Reallocates and copies everything when the arena grew or moved rows.
  void upload_tenant(std::size_t t, std::uint32_t first_new = 0, unsigned parts = upload_all);

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
  device_buffer<unsigned char> d_vectors_;
  device_buffer<std::uint32_t> d_graph_;
  device_buffer<std::uint64_t> d_ids_;
  device_buffer<std::uint8_t> d_deleted_;
  std::int64_t d_capacity_{0};
  detail::index::nn_descent_report last_nn_descent_{};
};

}  // namespace inferscale

// The library's own way into the internals (tests, benchmarks, the device backend).
#include <inferscale/detail/index/index_access.inl>

// The member definitions, by concept (see the file comment). Persistence is index_snapshot.hpp.
// A program that compiles them once (INFERSCALE_EXTERN_TEMPLATES, instances.hpp) sees only the
// declarations above here; the unit that includes instances.hpp defines them.
#if !defined(INFERSCALE_EXTERN_TEMPLATES)
#include <inferscale/detail/index/definitions.inl>
#endif
