/**
 * @file detail/index/kernels.cuh
 * @brief The index's device kernels, thin shells around the math that the host backend shares
 * (detail/index/math.hpp, graph_build.hpp):
 *  - search_kernel: one CTA per query runs the sequential search of search_host.hpp (graph beam
 *    search or exact scan of the query's tenant) and reproduces its answer bit for bit;
 *  - prune_kernel: detail::index::prune_node per node (the device graph build);
 *  - the element-wise helpers of the RAFT brute force (exact search and the kNN graph).
 *
 * How the search kernel stays identical to the sequential spec:
 *  - a distance is computed by a team of `team_size_for(chunks)` lanes, lane `l` reading the
 *    16-byte chunks `l, l + team, ...` and accumulating their elements in order with separately
 *    rounded operations, then a shuffle butterfly: exactly `team_distance`;
 *  - the visited set is exact (an open-addressing hash at least twice as large as the nodes a
 *    query can visit), so the set of candidates of each step does not depend on thread timing;
 *  - buffer entries are unique and ordered by `entry_less` (a total order), so sorting the top
 *    list with the candidates (a bitonic sort) gives the spec's `partial_sort` result whatever
 *    the order in which candidates were appended. A step's candidates may be merged in several
 *    rounds (the best `itopk` of a union is the best `itopk` of the best of its parts), and a
 *    candidate that does not beat the current last top entry is dropped at once (it could not
 *    enter the top list).
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/index/graph_build.hpp>
#include <inferscale/detail/index/math.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/dtype.hpp>

#include <cstdint>
#include <type_traits>

namespace inferscale::detail::index {

/// @brief Smallest power of two at or above `x` (1 for 0).
INFERSCALE_HOST_DEVICE constexpr std::uint64_t next_pow2(std::uint64_t x) noexcept
{
  std::uint64_t p = 1;
  while (p < x) {
    p <<= 1;
  }
  return p;
}

/// @brief Marks a top-list entry that has been a parent (node ids are below 2^31).
inline constexpr std::uint32_t parent_flag = 0x80000000u;
inline constexpr std::uint32_t node_mask   = 0x7FFFFFFFu;

/// @brief What a query's CTA does with its tenant.
enum class search_mode : std::uint32_t {
  none  = 0,  ///< no live fact: a row of invalid ids
  exact = 1,  ///< brute force over the tenant's rows
  graph = 2   ///< beam search on the tenant's graph
};

/// @brief Per-query work staged by the host (the per-query tenant table).
struct search_task {
  std::int64_t row_begin{0};        ///< first arena row of the tenant
  std::uint32_t rows{0};            ///< tenant rows (live + deleted)
  std::uint32_t max_iterations{0};  ///< resolved plan for this tenant
  std::uint32_t hash_mask{0};       ///< hash entries - 1 (a power of two minus one)
  search_mode mode{search_mode::none};
  std::uint64_t xor_mask{0};  ///< seed mask (a split search's part's own; search_params)
};

/// @brief Tasks a search launch carries in its parameters (no staging copy, no allocation).
inline constexpr std::int64_t inline_search_tasks = 8;

/// @brief Everything search_kernel reads; trivially copyable, passed as __grid_constant__.
struct search_kernel_params {
  void const* vectors{nullptr};          ///< arena `[rows][row_elements]` of the index dtype
  std::uint32_t const* graph{nullptr};   ///< arena `[rows][degree]`
  std::uint64_t const* ids{nullptr};     ///< arena `[rows]`
  std::uint8_t const* deleted{nullptr};  ///< arena `[rows]`
  float const* queries{nullptr};         ///< `[num_queries][dim]` with the strides below
  std::int64_t query_stride0{0};
  std::int64_t query_stride1{1};
  /// `[num_queries]` in device memory, or null: then `inline_tasks` holds them (at most
  /// `inline_search_tasks` queries), so a small search is one launch and nothing else
  search_task const* tasks{nullptr};
  search_task inline_tasks[inline_search_tasks]{};
  std::uint64_t* out_ids{nullptr};
  std::int64_t ids_stride0{0};
  std::int64_t ids_stride1{1};
  float* out_distances{nullptr};
  std::int64_t distances_stride0{0};
  std::int64_t distances_stride1{1};
  float* query_workspace{nullptr};         ///< `[gridDim.x][row_elements]` (query not shared)
  std::uint32_t* hash_workspace{nullptr};  ///< `[gridDim.x][hash_stride]` (hash not shared)
  std::int64_t hash_stride{0};             ///< words per CTA's hash slice (the batch's largest)
  /// Virtual queries: `num_queries` = queries x `parts`; virtual query v is part v % parts of
  /// query v / parts, its task `tasks[v]`. With parts > 1 each writes its answer (the first k
  /// live top entries, local nodes) to `part_out[v][k]`, and merge_split_kernel writes the rows.
  std::int64_t num_queries{0};
  std::uint32_t parts{1};
  struct buffer_entry* part_out{nullptr};
  std::int64_t dim{0};
  std::int64_t row_elements{0};
  std::uint64_t xor_mask{0};
  std::uint32_t degree{0};
  std::uint32_t k{0};
  std::uint32_t itopk{0};
  std::uint32_t width{1};
  std::uint32_t samplings{1};
  std::uint32_t buffer_entries{0};  ///< power of two >= itopk + candidates
  bool query_in_shared{true};
  bool hash_in_shared{true};
  distance_metric metric{distance_metric::cosine};
};

/// @brief A search buffer entry: distance and local node (bit 31: has been a parent).
struct buffer_entry {
  float distance;
  std::uint32_t node;
};

/// @brief Static shared state of a search CTA.
struct search_block_state {
  std::uint32_t parents[64];
  std::uint32_t taken;
  std::uint32_t count;
  double scale;  ///< cosine: 1 / |q| (beyond float32 for a denormal query)
  int bad;
};

#if defined(__CUDACC__)

inline constexpr unsigned full_warp = 0xFFFFFFFFu;

__device__ INFERSCALE_FORCEINLINE buffer_entry invalid_entry()
{
  return buffer_entry{__int_as_float(0x7F800000), invalid_node};
}

/// @brief The spec's order (`entry_less`) on entries, ignoring the parent flag; invalid last.
__device__ INFERSCALE_FORCEINLINE bool entry_before(buffer_entry const& a, buffer_entry const& b)
{
  return entry_less(a.distance, a.node & node_mask, b.distance, b.node & node_mask);
}

/// @brief One element of a lane's partial sum, exactly as `lane_partial` accumulates it.
__device__ INFERSCALE_FORCEINLINE float accumulate(float acc, float x, float q, bool l2)
{
  if (l2) {
    float const d = sub_rn(x, q);
    return add_rn(acc, mul_rn(d, d));
  }
  return add_rn(acc, mul_rn(x, q));
}

/**
 * @brief `lane_partial` with 16-byte loads: chunk `c` of the row is one aligned vector, and its
 * elements are accumulated in the same order (so the result is the same bits).
 */
template <class T, bool L2>
__device__ INFERSCALE_FORCEINLINE float lane_partial_vector(
  T const* row, float const* query, std::int64_t chunks, int lane, int team)
{
  constexpr bool l2 = L2;  // a template argument: one loop per metric, no predicated twins
  // Four chunks per step: their row and query loads are all issued before the first is summed
  // (independent loads in flight instead of one round trip per chunk); the sums still run
  // chunk by chunk, element by element, so the bits are those of lane_partial.
  constexpr int unroll = 4;
  float acc            = 0.0f;
  std::int64_t c       = lane;
  if constexpr (sizeof(T) == 4) {
    auto const* r4  = reinterpret_cast<float4 const*>(row);
    auto const* q4  = reinterpret_cast<float4 const*>(query);
    auto const add4 = [&](float4 const& x, float4 const& q) {
      acc = accumulate(acc, x.x, q.x, l2);
      acc = accumulate(acc, x.y, q.y, l2);
      acc = accumulate(acc, x.z, q.z, l2);
      acc = accumulate(acc, x.w, q.w, l2);
    };
    for (; c + (unroll - 1) * team < chunks; c += unroll * team) {
      float4 x[unroll], q[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        x[u] = r4[c + u * team];
        q[u] = q4[c + u * team];
      }
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        add4(x[u], q[u]);
      }
    }
    for (; c < chunks; c += team) {
      add4(r4[c], q4[c]);
    }
  } else {
    auto const* r8             = reinterpret_cast<uint4 const*>(row);
    auto const* q4             = reinterpret_cast<float4 const*>(query);
    auto const accumulate_word = [&](unsigned word, float q_lo, float q_hi) {
      acc = accumulate(acc, to_float(half_t{static_cast<std::uint16_t>(word & 0xFFFFu)}), q_lo, l2);
      acc = accumulate(acc, to_float(half_t{static_cast<std::uint16_t>(word >> 16)}), q_hi, l2);
    };
    auto const add8 = [&](uint4 const& raw, float4 const& qa, float4 const& qb) {
      accumulate_word(raw.x, qa.x, qa.y);
      accumulate_word(raw.y, qa.z, qa.w);
      accumulate_word(raw.z, qb.x, qb.y);
      accumulate_word(raw.w, qb.z, qb.w);
    };
    for (; c + (unroll - 1) * team < chunks; c += unroll * team) {
      uint4 raw[unroll];
      float4 qa[unroll], qb[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        std::int64_t const at = c + u * team;
        raw[u]                = r8[at];
        qa[u]                 = q4[2 * at];
        qb[u]                 = q4[2 * at + 1];
      }
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        add8(raw[u], qa[u], qb[u]);
      }
    }
    for (; c < chunks; c += team) {
      add8(r8[c], q4[2 * c], q4[2 * c + 1]);
    }
  }
  return acc;
}

/// @brief The team butterfly of `team_distance` (`p[l] + p[l ^ o]`, o = team/2 .. 1). Every
/// lane of the warp must call it (the team size is the same for the whole CTA).
__device__ INFERSCALE_FORCEINLINE float team_sum(float partial, int team)
{
  for (int o = team / 2; o >= 1; o /= 2) {
    partial = add_rn(partial, __shfl_xor_sync(full_warp, partial, o));
  }
  return partial;
}

/// @brief Bucket of a node in the visited hash (murmur3 finaliser).
__device__ INFERSCALE_FORCEINLINE std::uint32_t hash_bucket(std::uint32_t node)
{
  node ^= node >> 16;
  node *= 0x85EBCA6Bu;
  node ^= node >> 13;
  node *= 0xC2B2AE35u;
  node ^= node >> 16;
  return node;
}

/// @brief atomicCAS on a word of shared memory, as a shared-space atomic (ATOMS): `word` is a
/// generic pointer into shared memory, which a generic atomic would resolve on every probe.
__device__ INFERSCALE_FORCEINLINE std::uint32_t shared_cas(std::uint32_t* word,
                                                           std::uint32_t compare,
                                                           std::uint32_t value)
{
  auto const address = static_cast<unsigned>(__cvta_generic_to_shared(word));
  std::uint32_t previous;
  asm volatile("atom.shared.cas.b32 %0, [%1], %2, %3;"
               : "=r"(previous)
               : "r"(address), "r"(compare), "r"(value)
               : "memory");
  return previous;
}

/// @brief Inserts `node` into the visited set; true when it was not there before. The table
/// holds at least twice the nodes a query can insert, so the probe always ends. `in_shared`:
/// the table is in shared memory (the same for the whole launch).
__device__ INFERSCALE_FORCEINLINE bool visit(std::uint32_t* table,
                                             std::uint32_t mask,
                                             std::uint32_t node,
                                             bool in_shared)
{
  std::uint32_t slot = hash_bucket(node) & mask;
  while (true) {
    std::uint32_t const previous = in_shared ? shared_cas(table + slot, invalid_node, node)
                                             : atomicCAS(table + slot, invalid_node, node);
    if (previous == invalid_node) { return true; }
    if (previous == node) { return false; }
    slot = (slot + 1) & mask;
  }
}

/**
 * @brief Sorts `size` (a power of two) entries of shared memory with the whole CTA (bitonic
 * network). The caller synchronises before; the sort ends with a barrier.
 */
template <class Entry, class Less>
__device__ void block_bitonic_sort(Entry* buffer, std::uint32_t size, Less less)
{
  for (std::uint32_t width = 2; width <= size; width <<= 1) {
    for (std::uint32_t stride = width >> 1; stride > 0; stride >>= 1) {
      for (std::uint32_t i = threadIdx.x; i < size / 2; i += blockDim.x) {
        std::uint32_t const lo = 2 * i - (i & (stride - 1));
        std::uint32_t const hi = lo + stride;
        Entry const a          = buffer[lo];
        Entry const b          = buffer[hi];
        bool const ascending   = (lo & width) == 0;
        if (ascending ? less(b, a) : less(a, b)) {
          buffer[lo] = b;
          buffer[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

/**
 * @brief Loads query `q` into `out` (`row_elements` floats, zero padded) and normalises it for
 * cosine exactly as `graph_index::prepare_queries` does: norm2 from `lane_norm2` and a 32-lane
 * butterfly in double, then `cosine_scale` and `cosine_normalised` (the scale and each product
 * in double, rounded once: a denormal query has a scale beyond float32's range).
 * @return false (for the whole CTA) when the query has a NaN or infinite element, is zero under
 * cosine, or has |q|^2 > 1e30 under the other metrics. Ends with a barrier.
 */
__device__ inline bool prepare_query(float const* queries,
                                     std::int64_t stride0,
                                     std::int64_t stride1,
                                     std::int64_t q,
                                     std::int64_t dim,
                                     std::int64_t row_elements,
                                     distance_metric metric,
                                     float* out,
                                     search_block_state& state)
{
  int bad = 0;
  for (std::int64_t e = threadIdx.x; e < row_elements; e += blockDim.x) {
    float x = 0.0f;
    if (e < dim) {
      x = queries[q * stride0 + e * stride1];
      if (!isfinite(x)) { bad = 1; }
    }
    out[e] = x;
  }
  if (__syncthreads_or(bad) != 0) { return false; }
  bool const cosine = metric == distance_metric::cosine;
  if (threadIdx.x < 32) {
    int const lane = static_cast<int>(threadIdx.x);
    double norm2   = lane_norm2(out, dim, lane);
    for (int o = 16; o >= 1; o /= 2) {
      norm2 = __dadd_rn(norm2, __shfl_xor_sync(full_warp, norm2, o));
    }
    if (lane == 0) {
      // as the host refuses: a zero cosine query, or |q|^2 > 1e30 under inner product or
      // squared L2 (distances would overflow); cosine normalises any other finite query
      state.bad   = cosine ? !(norm2 > 0.0) : norm2 > 1e30;
      state.scale = state.bad || !cosine ? 1.0 : cosine_scale(norm2);
    }
  }
  __syncthreads();
  if (state.bad != 0) { return false; }
  if (!cosine) { return true; }
  double const scale = state.scale;
  for (std::int64_t e = threadIdx.x; e < dim; e += blockDim.x) {
    out[e] = cosine_normalised(out[e], scale);
  }
  __syncthreads();
  return true;
}

/// @brief Writes a row of invalid ids / +inf (the CTA's threads share the work).
__device__ inline void write_invalid_row(search_kernel_params const& p, std::int64_t q)
{
  if (p.parts > 1) {  // q is a virtual query: an empty part answer
    for (std::uint32_t j = threadIdx.x; j < p.k; j += blockDim.x) {
      p.part_out[q * p.k + j] = invalid_entry();
    }
    return;
  }
  for (std::uint32_t j = threadIdx.x; j < p.k; j += blockDim.x) {
    p.out_ids[q * p.ids_stride0 + j * p.ids_stride1]                   = invalid_fact_id;
    p.out_distances[q * p.distances_stride0 + j * p.distances_stride1] = __int_as_float(0x7F800000);
  }
}

/// @brief Sorts the `count` (<= 32) entries at `c` by the spec's order with warp 0 alone: a
/// bitonic network over the 32 lanes in registers (shuffles, no block barrier), lanes past
/// `count` holding invalid entries, which sort last.
__device__ INFERSCALE_FORCEINLINE void warp_sort_candidates(buffer_entry* c, std::uint32_t count)
{
  if (threadIdx.x >= 32) { return; }
  auto const lane = static_cast<unsigned>(threadIdx.x);
  buffer_entry e  = lane < count ? c[lane] : invalid_entry();
  for (unsigned width = 2; width <= 32; width <<= 1) {
    for (unsigned stride = width >> 1; stride > 0; stride >>= 1) {
      buffer_entry const o{__shfl_xor_sync(full_warp, e.distance, static_cast<int>(stride)),
                           __shfl_xor_sync(full_warp, e.node, static_cast<int>(stride))};
      // the pair's lower lane keeps the smaller entry in an ascending run, the larger otherwise
      bool const take_min = ((lane & stride) == 0) == ((lane & width) == 0);
      if (take_min ? entry_before(o, e) : entry_before(e, o)) { e = o; }
    }
  }
  if (lane < count) { c[lane] = e; }
}

/// @brief Entries of the sorted `list[0, n)` before `e` (`or_equal`: before or equal), by binary
/// search in the spec's order.
__device__ INFERSCALE_FORCEINLINE std::uint32_t rank_in(buffer_entry const* list,
                                                        std::uint32_t n,
                                                        buffer_entry const& e,
                                                        bool or_equal)
{
  std::uint32_t lo = 0, hi = n;
  while (lo < hi) {
    std::uint32_t const mid = (lo + hi) / 2;
    bool const goes_before  = or_equal ? !entry_before(e, list[mid]) : entry_before(list[mid], e);
    if (goes_before) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// @brief The largest top list a search keeps (`graph_index::check_search` refuses more).
inline constexpr std::uint32_t max_search_itopk = 1024;

/// @brief Most candidates one warp sorts before they are merged (a parent's neighbours at the
/// default search width; more take the whole-buffer sort).
inline constexpr std::uint32_t warp_merge_candidates = 32;

/// @brief Merges the candidates appended after the top list (`state.count` of them) into it:
/// the first `top` entries of the two by the spec's order stay, in order, and the rest of the
/// buffer is reset to invalid. Up to 32 candidates are sorted by one warp and merged with the
/// (always sorted) top list by ranks (each entry's place is its index plus its rank in the other
/// list, top-list entries first among equals): five barriers in all, where a bitonic sort of
/// the whole used prefix takes 31 (28 for the sort at itopk 64 with 32 candidates). More
/// candidates take that sort. Both give the same buffer: the order is total and the candidates
/// are new nodes. Starts and ends with a barrier. Not inlined: one copy for its three callers.
template <std::uint32_t Threads, std::uint32_t MaxTop>
__device__ __noinline__ void merge_candidates(buffer_entry* buffer,
                                              std::uint32_t top,
                                              search_block_state& state)
{
  __syncthreads();
  std::uint32_t const count = state.count;
  if (count > 0 && count <= warp_merge_candidates) {
    warp_sort_candidates(buffer + top, count);
    __syncthreads();
    constexpr std::uint32_t per_thread = ceil_div(MaxTop + warp_merge_candidates, Threads);
    buffer_entry held[per_thread];
    std::uint32_t place[per_thread];
    std::uint32_t const total = top + count;
#pragma unroll
    for (std::uint32_t r = 0; r < per_thread; ++r) {
      std::uint32_t const i = threadIdx.x + r * Threads;
      place[r]              = invalid_node;  // not held
      if (i < total) {
        held[r]  = buffer[i];
        place[r] = i < top ? i + rank_in(buffer + top, count, held[r], false)
                           : (i - top) + rank_in(buffer, top, held[r], true);
      }
    }
    __syncthreads();
#pragma unroll
    for (std::uint32_t r = 0; r < per_thread; ++r) {
      if (place[r] < top) { buffer[place[r]] = held[r]; }
    }
    for (std::uint32_t i = top + threadIdx.x; i < total; i += Threads) {
      buffer[i] = invalid_entry();
    }
  } else if (count > 0) {
    auto const size = static_cast<std::uint32_t>(next_pow2(std::uint64_t{top} + count));
    block_bitonic_sort(buffer, size, [](buffer_entry const& a, buffer_entry const& b) {
      return entry_before(a, b);
    });
    for (std::uint32_t i = top + threadIdx.x; i < size; i += blockDim.x) {
      buffer[i] = invalid_entry();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) { state.count = 0; }
  __syncthreads();
}

/// @brief Appends a candidate after the top list (one thread per candidate).
__device__ INFERSCALE_FORCEINLINE void append_candidate(buffer_entry* buffer,
                                                        std::uint32_t top,
                                                        search_block_state& state,
                                                        float distance,
                                                        std::uint32_t node)
{
  std::uint32_t const at = atomicAdd(&state.count, 1u);
  buffer[top + at]       = buffer_entry{distance, node};
}

/**
 * @brief One query: its tenant's exact scan or graph search, then the answer row. Every thread
 * of the CTA calls it; `buffer`, `query` and `hash` are the CTA's (shared or global) memory.
 */
template <class Policy, class T>
__device__ void search_one_query(search_kernel_params const& p,
                                 std::int64_t q,
                                 buffer_entry* buffer,
                                 float* query,
                                 std::uint32_t* hash_shared,
                                 search_block_state& state)
{
  search_task const task = p.tasks != nullptr ? p.tasks[q] : p.inline_tasks[q];
  if (task.mode == search_mode::none) {
    write_invalid_row(p, q);
    return;
  }
  if (!prepare_query(p.queries,
                     p.query_stride0,
                     p.query_stride1,
                     q / p.parts,
                     p.dim,
                     p.row_elements,
                     p.metric,
                     query,
                     state)) {
    write_invalid_row(p, q);
    return;
  }

  std::int64_t const chunks   = p.row_elements / chunk_elements<T>;
  int const team              = team_size_for(chunks);
  int const lane              = static_cast<int>(threadIdx.x) % team;
  std::uint32_t const team_id = threadIdx.x / static_cast<std::uint32_t>(team);
  std::uint32_t const teams   = blockDim.x / static_cast<std::uint32_t>(team);
  bool const l2               = p.metric == distance_metric::squared_l2;
  bool const graph_mode       = task.mode == search_mode::graph;
  std::uint32_t const top     = graph_mode ? p.itopk : p.k;
  std::uint32_t const room    = p.buffer_entries - top;  // candidates per merge
  std::uint32_t const n       = task.rows;
  T const* rows               = static_cast<T const*>(p.vectors) + task.row_begin * p.row_elements;
  std::uint8_t const* deleted = p.deleted + task.row_begin;
  // a CTA's global slice is reused by every query it takes (search_launch_plan)
  std::uint32_t* hash =
    p.hash_in_shared ? hash_shared : p.hash_workspace + std::int64_t{blockIdx.x} * p.hash_stride;

  auto distance_of = [&](bool active, std::uint32_t node) {
    float const partial =
      !active ? 0.0f
      : l2    ? lane_partial_vector<T, true>(
               rows + std::int64_t{node} * p.row_elements, query, chunks, lane, team)
           : lane_partial_vector<T, false>(
               rows + std::int64_t{node} * p.row_elements, query, chunks, lane, team);
    return finish_distance(team_sum(partial, team), p.metric);
  };
  auto beats_last = [&](float distance, std::uint32_t node) {
    return entry_before(buffer_entry{distance, node}, buffer[top - 1]);
  };

  for (std::uint32_t i = threadIdx.x; i < p.buffer_entries; i += blockDim.x) {
    buffer[i] = invalid_entry();
  }
  if (graph_mode) {
    for (std::uint64_t i = threadIdx.x; i <= task.hash_mask; i += blockDim.x) {
      hash[i] = invalid_node;
    }
  }
  if (threadIdx.x == 0) { state.count = 0; }
  __syncthreads();

  if (!graph_mode) {
    // exact: every live row, merged `room` rows at a time
    for (std::uint32_t base = 0; base < n; base += room) {
      std::uint32_t const round = n - base < room ? n - base : room;
      for (std::uint32_t first = 0; first < round; first += teams) {
        std::uint32_t const node = base + first + team_id;
        bool const active        = first + team_id < round && deleted[node] == 0;
        float const d            = distance_of(active, node);
        if (active && lane == 0 && beats_last(d, node)) {
          append_candidate(buffer, top, state, d, node);
        }
      }
      merge_candidates<Policy::search_threads, max_search_itopk>(buffer, top, state);
    }
  } else {
    // seeds: slot s keeps the best of `samplings` draws; repeated nodes are dropped
    std::uint32_t const slots = p.itopk + p.width * p.degree;
    for (std::uint32_t base = 0; base < slots; base += room) {
      std::uint32_t const round = slots - base < room ? slots - base : room;
      for (std::uint32_t first = 0; first < round; first += teams) {
        std::uint32_t const slot = base + first + team_id;
        bool const active        = first + team_id < round;
        std::uint32_t best       = invalid_node;
        float best_d             = 0.0f;
        for (std::uint32_t j = 0; j < p.samplings; ++j) {
          std::uint32_t const v = active ? seed_node(slot, j, p.samplings, task.xor_mask, n) : 0u;
          float const d         = distance_of(active, v);
          if (best == invalid_node || entry_less(d, v, best_d, best)) {
            best   = v;
            best_d = d;
          }
        }
        if (active && lane == 0 && visit(hash, task.hash_mask, best, p.hash_in_shared) &&
            beats_last(best_d, best)) {
          append_candidate(buffer, top, state, best_d, best);
        }
      }
      merge_candidates<Policy::search_threads, max_search_itopk>(buffer, top, state);
    }

    for (std::uint32_t iteration = 0; iteration < task.max_iterations; ++iteration) {
      // parents: the first `width` top entries not yet parents, in order (warp 0)
      if (threadIdx.x < 32) {
        unsigned const warp_lane = threadIdx.x;
        std::uint32_t taken      = 0;
        for (std::uint32_t first = 0; first < top && taken < p.width; first += 32) {
          std::uint32_t const i = first + warp_lane;
          buffer_entry e        = invalid_entry();
          if (i < top) { e = buffer[i]; }
          bool const candidate  = e.node != invalid_node && (e.node & parent_flag) == 0;
          unsigned const ballot = __ballot_sync(full_warp, candidate);
          std::uint32_t const rank =
            static_cast<std::uint32_t>(__popc(ballot & ((1u << warp_lane) - 1u)));
          if (candidate && taken + rank < p.width) {
            buffer[i].node              = e.node | parent_flag;
            state.parents[taken + rank] = e.node;
          }
          std::uint32_t const found = static_cast<std::uint32_t>(__popc(ballot));
          taken += found < p.width - taken ? found : p.width - taken;
        }
        if (warp_lane == 0) { state.taken = taken; }
      }
      __syncthreads();
      std::uint32_t const taken = state.taken;
      if (taken == 0) { break; }

      // neighbours of the parents: each new one is visited once and becomes a candidate
      std::uint32_t const slots_now = taken * p.degree;
      for (std::uint32_t base = 0; base < slots_now; base += room) {
        std::uint32_t const round = slots_now - base < room ? slots_now - base : room;
        for (std::uint32_t i = threadIdx.x; i < round; i += blockDim.x) {
          std::uint32_t const s      = base + i;
          std::uint32_t const parent = state.parents[s / p.degree];
          std::uint32_t const v =
            p.graph[(task.row_begin + parent) * std::int64_t{p.degree} + s % p.degree];
          if (v != invalid_node && v < n && visit(hash, task.hash_mask, v, p.hash_in_shared)) {
            append_candidate(buffer, top, state, 0.0f, v);
          }
        }
        __syncthreads();
        std::uint32_t const count = state.count;
        for (std::uint32_t first = 0; first < count; first += teams) {
          std::uint32_t const i = first + team_id;
          bool const active     = i < count;
          std::uint32_t const v = active ? buffer[top + i].node : 0u;
          float const d         = distance_of(active, v);
          if (active && lane == 0) {
            buffer[top + i] = beats_last(d, v) ? buffer_entry{d, v} : invalid_entry();
          }
        }
        merge_candidates<Policy::search_threads, max_search_itopk>(buffer, top, state);
      }
    }
  }

  // the answer: the first k top entries that are not deleted (warp 0, in order)
  if (threadIdx.x < 32) {
    unsigned const warp_lane = threadIdx.x;
    std::uint32_t written    = 0;
    for (std::uint32_t first = 0; first < top && written < p.k; first += 32) {
      std::uint32_t const i = first + warp_lane;
      buffer_entry e        = invalid_entry();
      if (i < top) { e = buffer[i]; }
      std::uint32_t const node = e.node & node_mask;
      bool const live          = e.node != invalid_node && deleted[node] == 0;
      unsigned const ballot    = __ballot_sync(full_warp, live);
      std::uint32_t const at =
        written + static_cast<std::uint32_t>(__popc(ballot & ((1u << warp_lane) - 1u)));
      if (live && at < p.k) {
        if (p.parts > 1) {
          p.part_out[q * p.k + at] = buffer_entry{e.distance, node};
        } else {
          p.out_ids[q * p.ids_stride0 + at * p.ids_stride1] = p.ids[task.row_begin + node];
          p.out_distances[q * p.distances_stride0 + at * p.distances_stride1] = e.distance;
        }
      }
      written += static_cast<std::uint32_t>(__popc(ballot));
    }
    for (std::uint32_t j = (written < p.k ? written : p.k) + warp_lane; j < p.k; j += 32) {
      if (p.parts > 1) {
        p.part_out[q * p.k + j] = invalid_entry();
      } else {
        p.out_ids[q * p.ids_stride0 + j * p.ids_stride1] = invalid_fact_id;
        p.out_distances[q * p.distances_stride0 + j * p.distances_stride1] =
          __int_as_float(0x7F800000);
      }
    }
  }
}

/**
 * @brief Batched search: CTA `b` answers queries `b, b + gridDim.x, ...`, reusing its own global
 * slices of `query_workspace` and `hash_workspace` (when those are global) for each. Dynamic shared
 * memory: the buffer (`buffer_entries` entries), then the query (`row_elements` floats) when
 * `query_in_shared`, then the hash when `hash_in_shared` (entries: the largest `hash_mask + 1`
 * of the batch).
 */
template <class Policy, class T>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::search_threads)
  search_kernel(__grid_constant__ search_kernel_params const params)
{
  extern __shared__ __align__(16) unsigned char search_shared[];
  __shared__ search_block_state state;
  auto* buffer = reinterpret_cast<buffer_entry*>(search_shared);
  unsigned char* after_buffer =
    search_shared + std::size_t{params.buffer_entries} * sizeof(buffer_entry);
  float* shared_query = reinterpret_cast<float*>(after_buffer);
  auto* shared_hash   = reinterpret_cast<std::uint32_t*>(
    after_buffer +
    (params.query_in_shared ? static_cast<std::size_t>(params.row_elements) * sizeof(float) : 0));
  for (std::int64_t q = blockIdx.x; q < params.num_queries; q += gridDim.x) {
    float* query = params.query_in_shared
                     ? shared_query
                     : params.query_workspace + std::int64_t{blockIdx.x} * params.row_elements;
    search_one_query<Policy, T>(params, q, buffer, query, shared_hash, state);
    __syncthreads();
  }
}

/**
 * @brief The rows of a split search (`parts` > 1): query `q`'s answer is the best `k` distinct
 * nodes of its parts' answers `part_out[q * parts .. q * parts + parts - 1][k]` (each sorted by
 * the spec's order, invalid last), in that order; a node found by several parts has the same
 * distance in each (the same team distance) and is taken once. One thread per query: a
 * `parts`-way merge of at most 16 lists.
 */
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  merge_split_kernel(__grid_constant__ search_kernel_params const p, std::int64_t queries)
{
  std::int64_t const q = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (q >= queries) { return; }
  std::int64_t const first_part = q * p.parts;
  search_task const task = p.tasks != nullptr ? p.tasks[first_part] : p.inline_tasks[first_part];
  std::uint32_t head[16]{};
  std::uint32_t written = 0;
  std::uint32_t last    = invalid_node;
  while (written < p.k) {
    buffer_entry best  = invalid_entry();
    std::uint32_t from = p.parts;
    for (std::uint32_t c = 0; c < p.parts; ++c) {
      if (head[c] == p.k) { continue; }
      buffer_entry const e = p.part_out[(first_part + c) * p.k + head[c]];
      if (e.node != invalid_node && (from == p.parts || entry_before(e, best))) {
        best = e;
        from = c;
      }
    }
    if (from == p.parts) { break; }  // every part exhausted
    ++head[from];
    if (best.node == last) { continue; }  // the same node from another part
    last                                                   = best.node;
    p.out_ids[q * p.ids_stride0 + written * p.ids_stride1] = p.ids[task.row_begin + best.node];
    p.out_distances[q * p.distances_stride0 + written * p.distances_stride1] = best.distance;
    ++written;
  }
  for (std::uint32_t j = written; j < p.k; ++j) {
    p.out_ids[q * p.ids_stride0 + j * p.ids_stride1]                   = invalid_fact_id;
    p.out_distances[q * p.distances_stride0 + j * p.distances_stride1] = __int_as_float(0x7F800000);
  }
}

// -------------------------------------------------------------------------------------------
// Pruning

/// @brief Arguments of prune_kernel (one launch prunes nodes `[first, first + count)`).
struct prune_kernel_params {
  std::uint32_t const* knn{nullptr};  ///< `[n][width]` kNN rows
  std::uint32_t* out{nullptr};        ///< `[n][degree]`
  std::uint32_t* scratch{
    nullptr};  ///< `[3 * k][count]`: entry p of thread i's array at p * count + i
  std::uint32_t width{0};
  std::uint32_t k{0};
  std::uint32_t degree{0};
  std::uint32_t first{0};
  std::uint32_t count{0};
};

/**
 * @brief One thread per node runs `prune_node` (the host's function) with global scratch,
 * interleaved over the launch's threads (stride `count`): where neighbouring threads touch the
 * same entry of their arrays (the sort's start, the counts' reset, the final scan), they touch
 * neighbouring words.
 */
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::prune_threads)
  prune_kernel(__grid_constant__ prune_kernel_params const params)
{
  std::uint32_t const i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= params.count) { return; }
  std::uint32_t const node  = params.first + i;
  std::uint64_t const array = std::uint64_t{params.k} * params.count;  // words per scratch array
  std::uint32_t* scratch    = params.scratch + i;
  prune_node(params.knn,
             params.width,
             params.k,
             node,
             params.degree,
             params.out + std::uint64_t{node} * params.degree,
             scratch,
             scratch + array,
             scratch + 2 * array,
             params.count);
}

// -------------------------------------------------------------------------------------------
// Brute force helpers (exact search and the kNN graph on RAFT gemm + select_k)

/// @brief How a dot product tile becomes distances.
enum class tile_metric : std::uint32_t {
  negative_dot,   ///< -dot (inner product; cosine ranking for the kNN graph)
  one_minus_dot,  ///< 1 - dot (cosine distances of exact search)
  squared_l2      ///< |q|^2 + |x|^2 - 2 dot, at least 0
};

struct rows_to_float_params {
  void const* rows{nullptr};  ///< `[count][row_elements]` of T
  float* out{nullptr};        ///< fp32 copy, or null
  float* norms{nullptr};      ///< squared norms, or null
  std::int64_t row_elements{0};
  std::int64_t count{0};
};

/// @brief A warp per row: the fp32 copy of the row and/or its squared norm (double sum).
template <class Policy, class T>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  rows_to_float_kernel(__grid_constant__ rows_to_float_params const params)
{
  constexpr int warps  = Policy::elementwise_threads / 32;
  std::int64_t const r = std::int64_t{blockIdx.x} * warps + threadIdx.x / 32;
  int const lane       = static_cast<int>(threadIdx.x % 32);
  if (r >= params.count) { return; }
  T const* row = static_cast<T const*>(params.rows) + r * params.row_elements;
  double norm2 = 0.0;
  for (std::int64_t e = lane; e < params.row_elements; e += 32) {
    float const x = to_float(row[e]);
    if (params.out != nullptr) { params.out[r * params.row_elements + e] = x; }
    norm2 += double{x} * x;
  }
  for (int o = 16; o >= 1; o /= 2) {
    norm2 += __shfl_xor_sync(full_warp, norm2, o);
  }
  if (lane == 0 && params.norms != nullptr) { params.norms[r] = static_cast<float>(norm2); }
}

struct prepare_queries_params {
  float const* queries{nullptr};
  std::int64_t stride0{0};
  std::int64_t stride1{1};
  std::int64_t count{0};
  std::int64_t dim{0};
  std::int64_t row_elements{0};
  float* out{nullptr};           ///< `[count][row_elements]`
  float* norms{nullptr};         ///< squared norms of the prepared queries, or null
  std::uint8_t* valid{nullptr};  ///< `[count]`: 0 for NaN/Inf or a zero cosine query
  distance_metric metric{distance_metric::cosine};
};

/// @brief One CTA per query: `prepare_query` into a global row (the search kernel's query prep).
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  prepare_queries_kernel(__grid_constant__ prepare_queries_params const params)
{
  __shared__ search_block_state state;
  for (std::int64_t q = blockIdx.x; q < params.count; q += gridDim.x) {
    float* out    = params.out + q * params.row_elements;
    bool const ok = prepare_query(params.queries,
                                  params.stride0,
                                  params.stride1,
                                  q,
                                  params.dim,
                                  params.row_elements,
                                  params.metric,
                                  out,
                                  state);
    if (!ok) {  // a harmless row, never reported
      for (std::int64_t e = threadIdx.x; e < params.row_elements; e += blockDim.x) {
        out[e] = 0.0f;
      }
    }
    if (threadIdx.x < 32) {
      int const lane = static_cast<int>(threadIdx.x);
      double norm2   = 0.0;
      for (std::int64_t e = lane; e < params.row_elements; e += 32) {
        double const x = ok ? out[e] : 0.0;
        norm2 += x * x;
      }
      for (int o = 16; o >= 1; o /= 2) {
        norm2 += __shfl_xor_sync(full_warp, norm2, o);
      }
      if (lane == 0) {
        params.valid[q] = ok ? 1 : 0;
        if (params.norms != nullptr) { params.norms[q] = static_cast<float>(norm2); }
      }
    }
    __syncthreads();
  }
}

struct finish_tile_params {
  float* tile{nullptr};  ///< `[queries][rows]` dot products in, distances out
  float const* query_norms{nullptr};
  float const* row_norms{nullptr};
  std::uint8_t const* deleted{nullptr};  ///< of the tile's first row, or null
  std::int64_t queries{0};
  std::int64_t rows{0};
  std::int64_t self_shift{0};  ///< query i is tile row i + self_shift (when exclude_self)
  bool exclude_self{false};
  tile_metric metric{tile_metric::negative_dot};
};

/// @brief Dot products to distances; deleted rows and the query's own row become +inf.
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  finish_tile_kernel(__grid_constant__ finish_tile_params const params)
{
  std::int64_t const total = params.queries * params.rows;
  for (std::int64_t at = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; at < total;
       at += std::int64_t{gridDim.x} * blockDim.x) {
    std::int64_t const i = at / params.rows;
    std::int64_t const j = at - i * params.rows;
    float const dot      = params.tile[at];
    float d              = 0.0f;
    switch (params.metric) {
      case tile_metric::negative_dot: d = -dot; break;
      case tile_metric::one_minus_dot: d = 1.0f - dot; break;
      case tile_metric::squared_l2:
        d = fmaxf(0.0f, params.query_norms[i] + params.row_norms[j] - 2.0f * dot);
        break;
    }
    if ((params.deleted != nullptr && params.deleted[j] != 0) ||
        (params.exclude_self && j == i + params.self_shift)) {
      d = __int_as_float(0x7F800000);
    }
    params.tile[at] = d;
  }
}

struct merge_selection_params {
  float const* best_distances{nullptr};  ///< `[queries][k]`
  std::int64_t const* best_rows{nullptr};
  float const* tile_distances{nullptr};  ///< `[queries][tile_k]`
  std::int64_t const* tile_rows{nullptr};
  float* merged_distances{nullptr};  ///< `[queries][2 k]`
  std::int64_t* merged_rows{nullptr};
  std::int64_t queries{0};
  std::int64_t row_offset{0};  ///< added to tile rows
  std::uint32_t k{0};
  std::uint32_t tile_k{0};
};

/// @brief `[best | tile selection + offset | +inf padding]`, the input of the next select_k.
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  merge_selection_kernel(__grid_constant__ merge_selection_params const params)
{
  std::int64_t const width = 2 * std::int64_t{params.k};
  std::int64_t const total = params.queries * width;
  for (std::int64_t at = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; at < total;
       at += std::int64_t{gridDim.x} * blockDim.x) {
    std::int64_t const i = at / width;
    std::int64_t const c = at - i * width;
    float d              = __int_as_float(0x7F800000);
    std::int64_t row     = -1;
    if (c < params.k) {
      d   = params.best_distances[i * params.k + c];
      row = params.best_rows[i * params.k + c];
    } else if (c - params.k < params.tile_k) {
      std::int64_t const t = i * params.tile_k + (c - params.k);
      d                    = params.tile_distances[t];
      row                  = params.tile_rows[t] + params.row_offset;
    }
    params.merged_distances[at] = d;
    params.merged_rows[at]      = row;
  }
}

struct fill_selection_params {
  float* distances{nullptr};
  std::int64_t* rows{nullptr};
  std::int64_t count{0};
};

/// @brief Fills `count` (distance, row) pairs with (+inf, -1).
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  fill_selection_kernel(__grid_constant__ fill_selection_params const params)
{
  for (std::int64_t at = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; at < params.count;
       at += std::int64_t{gridDim.x} * blockDim.x) {
    params.distances[at] = __int_as_float(0x7F800000);
    params.rows[at]      = -1;
  }
}

/// @brief A (distance, row) pair of the per-row sort; row -1 (none) sorts after every row.
struct selection_entry {
  float distance;
  std::uint64_t row;
};

struct sort_selection_params {
  float const* distances{nullptr};  ///< `[queries][k]`
  std::int64_t const* rows{nullptr};
  float* out_distances{nullptr};
  std::int64_t* out_rows{nullptr};
  std::int64_t queries{0};
  std::uint32_t k{0};
  std::uint32_t size{0};  ///< next power of two of k (shared entries)
};

/// @brief One CTA per query: its k selected pairs sorted by (distance, row), so ties break by
/// row whatever order select_k left them in.
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::sort_threads)
  sort_selection_kernel(__grid_constant__ sort_selection_params const params)
{
  extern __shared__ __align__(16) unsigned char sort_shared[];
  auto* entries = reinterpret_cast<selection_entry*>(sort_shared);
  for (std::int64_t q = blockIdx.x; q < params.queries; q += gridDim.x) {
    for (std::uint32_t j = threadIdx.x; j < params.size; j += blockDim.x) {
      entries[j] = j < params.k
                     ? selection_entry{params.distances[q * params.k + j],
                                       static_cast<std::uint64_t>(params.rows[q * params.k + j])}
                     : selection_entry{__int_as_float(0x7F800000), ~std::uint64_t{0}};
    }
    __syncthreads();
    block_bitonic_sort(
      entries, params.size, [](selection_entry const& a, selection_entry const& b) {
        return a.distance < b.distance || (a.distance == b.distance && a.row < b.row);
      });
    for (std::uint32_t j = threadIdx.x; j < params.k; j += blockDim.x) {
      params.out_distances[q * params.k + j] = entries[j].distance;
      params.out_rows[q * params.k + j]      = static_cast<std::int64_t>(entries[j].row);
    }
    __syncthreads();
  }
}

struct exact_output_params {
  float const* distances{nullptr};  ///< `[queries][k]`, sorted
  std::int64_t const* rows{nullptr};
  std::uint8_t const* valid{nullptr};    ///< per query
  std::uint64_t const* ids{nullptr};     ///< the tenant's first row
  std::uint8_t const* deleted{nullptr};  ///< the tenant's first row
  std::uint64_t* out_ids{nullptr};
  std::int64_t ids_stride0{0};
  std::int64_t ids_stride1{1};
  float* out_distances{nullptr};
  std::int64_t distances_stride0{0};
  std::int64_t distances_stride1{1};
  std::int64_t queries{0};
  std::uint32_t k{0};
};

/// @brief Selected rows to fact ids; no row, a deleted row or an invalid query -> invalid / +inf.
template <class Policy>
INFERSCALE_KERNEL
void __launch_bounds__(Policy::elementwise_threads)
  exact_output_kernel(__grid_constant__ exact_output_params const params)
{
  std::int64_t const total = params.queries * params.k;
  for (std::int64_t at = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; at < total;
       at += std::int64_t{gridDim.x} * blockDim.x) {
    std::int64_t const q   = at / params.k;
    std::int64_t const j   = at - q * params.k;
    std::int64_t const row = params.rows == nullptr ? -1 : params.rows[at];
    bool const ok          = params.valid[q] != 0 && row >= 0 && params.deleted[row] == 0;
    params.out_ids[q * params.ids_stride0 + j * params.ids_stride1] =
      ok ? params.ids[row] : invalid_fact_id;
    params.out_distances[q * params.distances_stride0 + j * params.distances_stride1] =
      ok ? params.distances[at] : __int_as_float(0x7F800000);
  }
}

static_assert(std::is_trivially_copyable_v<search_kernel_params>);
static_assert(std::is_trivially_copyable_v<prune_kernel_params>);
static_assert(std::is_trivially_copyable_v<rows_to_float_params>);
static_assert(std::is_trivially_copyable_v<prepare_queries_params>);
static_assert(std::is_trivially_copyable_v<finish_tile_params>);
static_assert(std::is_trivially_copyable_v<merge_selection_params>);
static_assert(std::is_trivially_copyable_v<fill_selection_params>);
static_assert(std::is_trivially_copyable_v<sort_selection_params>);
static_assert(std::is_trivially_copyable_v<exact_output_params>);

#endif  // __CUDACC__

}  // namespace inferscale::detail::index
