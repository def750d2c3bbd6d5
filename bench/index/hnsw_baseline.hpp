/**
 * @file bench/index/hnsw_baseline.hpp
 * @brief The CPU baseline of bench_index: hnswlib (Debian's libhnswlib-dev 0.6.2, header only)
 * behind a small interface, so its header (which defines non-inline functions and needs no CUDA)
 * is compiled once, by the host compiler, in hnsw_baseline.cpp.
 *
 * The index uses hnswlib's InnerProductSpace (distance = 1 - dot) over the rows given, which the
 * benchmark L2-normalises first, so the distances are the fact index's cosine distances. Labels
 * are row numbers. `add` and `search` may be called from several threads at once (hnswlib locks
 * per node); `set_ef` may not overlap a search.
 */
#pragma once

#include <cstdint>
#include <memory>

namespace inferscale::bench {

class hnsw_baseline {
 public:
  /// @param capacity rows the index can hold; @param m hnswlib's M; @param ef_construction efC
  hnsw_baseline(std::int64_t dim, std::int64_t capacity, int m, int ef_construction);
  ~hnsw_baseline();
  hnsw_baseline(hnsw_baseline const&)            = delete;
  hnsw_baseline& operator=(hnsw_baseline const&) = delete;

  /// @brief Inserts one row (`dim` floats) with label `label`.
  void add(float const* row, std::uint64_t label);
  /// @brief The search's candidate list size (hnswlib's ef; raised to k by hnswlib).
  void set_ef(int ef);
  int ef() const noexcept { return ef_; }
  /// @brief The k nearest labels of one query, closest first, and their distances (1 - dot);
  /// slots beyond the results found get label 2^64-1 and +infinity.
  void search(float const* query, int k, std::uint64_t* labels, float* distances) const;

  /**
   * @brief Bytes the index holds beside its vectors, from hnswlib 0.6.2's layout
   * (hnswlib/hnswalg.h, the constructor and `addPoint`), for the `capacity` rows it was made for:
   *  - per row: the level-0 record less the vector, `size_data_per_element_ - data_size_` =
   *    `(2 M) * 4 + 4` (links and their count, `size_links_level0_`) + 8 (the label); the
   *    `linkLists_` pointer (8), `element_levels_` (an int, 4), `link_list_locks_` (one
   *    std::mutex, 40 on glibc x86-64) and the visited list (one `unsigned short` per row, one
   *    list: one thread searched at a time);
   *  - per row with a level L > 0: `size_links_per_element_ * L + 1` bytes (`M * 4 + 4` per
   *    level), counted from the index's own `element_levels_`;
   *  - `label_lookup_` (std::unordered_map<size_t, unsigned>): 32 bytes a node (next pointer,
   *    key, value, malloc's header, rounded to 16) and 8 a bucket;
   *  - fixed: `link_list_update_locks_`, 65,536 std::mutex whatever the capacity
   *    (`fixed_overhead_bytes`).
   * Allocator headers of the large blocks and the object itself are not counted.
   */
  std::int64_t overhead_bytes() const;
  /// @brief The part of `overhead_bytes` that does not depend on the rows (the update locks).
  std::int64_t fixed_overhead_bytes() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
  int ef_{10};
};

}  // namespace inferscale::bench
