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

/// @brief Hopper (H100/H200): same shape until measured otherwise.
struct index_policy_sm90 : index_policy_sm80 {};

}  // namespace inferscale::detail::index
