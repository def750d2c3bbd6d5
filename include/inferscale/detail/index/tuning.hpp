/**
 * @file detail/index/tuning.hpp
 * @brief Launch shapes and memory budgets of the index's device kernels (CUB-style policy: data,
 * not code). Changing a value here changes speed and memory, never a result: the search is exact
 * with respect to the sequential spec for every value.
 */
#pragma once

#include <cstddef>
#include <cstdint>

namespace inferscale::detail::index {

/// @brief Launch policy of the index kernels (Ampere and later).
struct index_policy_sm80 {
  /// Threads of a search CTA (one CTA per query; distance teams of 2..32 lanes share it).
  static constexpr int search_threads = 256;
  /// Candidate slots of the search buffer beside the top list: the buffer is the power of two
  /// at or above `itopk + min_candidates`, so a merge sorts at most twice the top list.
  static constexpr std::uint32_t min_candidates = 128;
  /// The prepared query lives in shared memory up to this size, else in a global workspace.
  static constexpr std::size_t max_shared_query_bytes = 32 * 1024;
  /// The visited hash lives in shared memory up to this size, else in a global workspace slice.
  static constexpr std::size_t max_shared_hash_bytes = 32 * 1024;
  /// Dynamic shared memory of one search CTA at most (keeps two or more CTAs per SM).
  static constexpr std::size_t max_search_shared_bytes = 96 * 1024;
  /// Smallest visited hash (entries); the hash is at least twice the nodes a query can visit.
  static constexpr std::uint32_t min_hash_entries = 64;

  /// Threads per block of the pruning kernel (one thread per node).
  static constexpr int prune_threads = 128;
  /// Global scratch of one pruning launch (3 * k words per node); nodes are chunked to fit.
  static constexpr std::size_t prune_scratch_bytes = std::size_t{64} << 20;

  /// Brute force (exact search, kNN build): queries and rows per gemm tile, so the distance
  /// tile is at most `knn_query_block * knn_row_block` floats (64 MiB).
  static constexpr std::int64_t knn_query_block = 2048;
  static constexpr std::int64_t knn_row_block   = 8192;

  /// Threads per block of the element-wise helper kernels and of the per-row sort.
  static constexpr int elementwise_threads = 256;
  static constexpr int sort_threads        = 256;
};

/// @brief How a search launch lays out its global workspace (`search_launch_plan`).
struct search_launch {
  std::int64_t grid{0};  ///< CTAs launched; each takes queries blockIdx.x, + gridDim.x, ...
  std::int64_t query_elements{0};  ///< floats of the global query workspace (0: queries shared)
  std::int64_t hash_elements{0};   ///< words of the global hash workspace (0: hash shared)
  std::int64_t hash_stride{0};     ///< words between two CTAs' hash slices
};

/**
 * @brief The launch of a batch search of `queries` queries: one CTA per query while everything
 * a query needs fits in shared memory; otherwise at most `resident` CTAs (what the device holds
 * at once for this kernel and shared size), each pulling queries in a grid-stride loop and
 * reusing one global slice of `row_elements` floats (query) and `hash_entries` words (the
 * batch's largest visited hash). The workspace is then bounded by the resident CTAs, not by the
 * batch: 100,000 queries at itopk 128 need `resident` slices instead of 100,000.
 */
constexpr search_launch search_launch_plan(std::int64_t queries,
                                           std::int64_t resident,
                                           bool query_in_shared,
                                           bool hash_in_shared,
                                           std::int64_t row_elements,
                                           std::int64_t hash_entries) noexcept
{
  search_launch out;
  if (queries <= 0) { return out; }
  bool const global      = !query_in_shared || !hash_in_shared;
  std::int64_t const cap = std::int64_t{1} << 30;
  out.grid               = global ? (queries < resident ? queries : (resident > 0 ? resident : 1))
                                  : (queries < cap ? queries : cap);
  out.query_elements     = query_in_shared ? 0 : out.grid * row_elements;
  out.hash_stride        = hash_in_shared ? 0 : hash_entries;
  out.hash_elements      = out.grid * out.hash_stride;
  return out;
}

/// @brief Hopper (H100/H200): same shape until measured otherwise.
struct index_policy_sm90 : index_policy_sm80 {};

}  // namespace inferscale::detail::index
