/**
 * @file detail/index/device_brute_force.inl
 * @brief The index's device brute force (part of `index.cuh`, which includes it; RAFT-based, so
 * not a header of its own): `brute_force_select` (gemm tiles + select_k) behind `exact_search`
 * and the device kNN graph, and the device graph builder's callbacks `device_knn` and
 * `device_prune` (`make_device_graph_builder`).
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/index/device_launch.inl>
#include <inferscale/detail/index/kernels.cuh>
#include <inferscale/detail/index/select_k_instance.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <raft/core/device_mdspan.hpp>
#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resources.hpp>
#include <raft/linalg/gemm.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale::detail::index {

/// @brief Tile sizes of the brute force (queries and rows per gemm).
struct brute_force_blocks {
  std::int64_t queries{device_policy::knn_query_block};
  std::int64_t rows{device_policy::knn_row_block};
};

/**
 * @brief The `k` nearest rows of each query by brute force: gemm tiles of
 * `blocks.queries x blocks.rows`, distances per `metric`, select_k per tile, merged with the best
 * so far by a second select_k, finally each query's k sorted by (distance, row).
 *
 * @param rows       device `[n][row_elements]` of T (zero-padded rows)
 * @param deleted    device `[n]` flags (deleted rows are never selected unless fewer than k
 *                   rows remain, then with +inf), or null
 * @param queries    device `[num_queries][row_elements]` prepared fp32 queries; null: the
 *                   queries are rows `[first_query, first_query + num_queries)` themselves and
 *                   each query's own row is excluded (the kNN graph)
 * @param query_norms squared norms of `queries` (squared_l2 only)
 * @param out_distances, out_rows device `[num_queries][k]`; missing entries +inf / -1
 */
template <class T>
void brute_force_select(raft::resources const& res,
                        T const* rows,
                        std::int64_t row_elements,
                        std::int64_t n,
                        std::uint8_t const* deleted,
                        float const* queries,
                        float const* query_norms,
                        std::int64_t first_query,
                        std::int64_t num_queries,
                        tile_metric metric,
                        std::uint32_t k,
                        float* out_distances,
                        std::int64_t* out_rows,
                        brute_force_blocks blocks = {})
{
  using policy              = device_policy;
  constexpr bool convert    = !std::is_same_v<T, float>;
  bool const self           = queries == nullptr;
  bool const l2             = metric == tile_metric::squared_l2;
  cudaStream_t const stream = raft::resource::get_cuda_stream(res).get();
  int const threads         = policy::elementwise_threads;
  std::int64_t const qb     = std::max<std::int64_t>(1, std::min(num_queries, blocks.queries));
  std::int64_t const rb     = std::max<std::int64_t>(1, std::min(n, blocks.rows));
  std::int64_t const tile_k = std::min<std::int64_t>(k, rb);
  std::int64_t const width  = 2 * std::int64_t{k};
  if (num_queries <= 0) { return; }

  auto row_copy   = workspace_vector<float>(res, convert ? rb * row_elements : 0);
  auto row_norms  = workspace_vector<float>(res, l2 ? rb : 0);
  auto query_copy = workspace_vector<float>(res, self && convert ? qb * row_elements : 0);
  auto self_norms = workspace_vector<float>(res, self && l2 ? qb : 0);
  auto tile       = workspace_vector<float>(res, qb * rb);
  auto tile_d     = workspace_vector<float>(res, qb * tile_k);
  auto tile_r     = workspace_vector<std::int64_t>(res, qb * tile_k);
  auto merged_d   = workspace_vector<float>(res, qb * width);
  auto merged_r   = workspace_vector<std::int64_t>(res, qb * width);
  auto best_d     = workspace_vector<float>(res, qb * k);
  auto best_r     = workspace_vector<std::int64_t>(res, qb * k);

  auto to_float_rows = [&](T const* source, std::int64_t count, float* copy, float* norms) {
    rows_to_float_params params;
    params.rows         = source;
    params.out          = copy;
    params.norms        = norms;
    params.row_elements = row_elements;
    params.count        = count;
    constexpr int warps = policy::elementwise_threads / 32;
    auto const grid     = static_cast<unsigned>(ceil_div(count, warps));
    rows_to_float_kernel<policy, T><<<grid, threads, 0, stream>>>(params);
    INFERSCALE_CHECK_LAUNCH();
  };

  for (std::int64_t q0 = 0; q0 < num_queries; q0 += qb) {
    std::int64_t const qcount = std::min(qb, num_queries - q0);
    float const* q_rows       = nullptr;
    float const* q_norms      = nullptr;
    if (self) {
      T const* source = rows + (first_query + q0) * row_elements;
      if (convert || l2) {
        to_float_rows(
          source, qcount, convert ? query_copy.data() : nullptr, l2 ? self_norms.data() : nullptr);
      }
      if constexpr (convert) {
        q_rows = query_copy.data();
      } else {
        q_rows = source;
      }
      q_norms = self_norms.data();
    } else {
      q_rows  = queries + q0 * row_elements;
      q_norms = query_norms == nullptr ? nullptr : query_norms + q0;
    }
    fill_selection_kernel<policy><<<elementwise_blocks(qcount * k, threads), threads, 0, stream>>>(
      fill_selection_params{best_d.data(), best_r.data(), qcount * k});
    INFERSCALE_CHECK_LAUNCH();

    for (std::int64_t r0 = 0; r0 < n; r0 += rb) {
      std::int64_t const rcount = std::min(rb, n - r0);
      T const* source           = rows + r0 * row_elements;
      if (convert || l2) {
        to_float_rows(
          source, rcount, convert ? row_copy.data() : nullptr, l2 ? row_norms.data() : nullptr);
      }
      float const* r_rows = nullptr;
      if constexpr (convert) {
        r_rows = row_copy.data();
      } else {
        r_rows = source;
      }

      // tile[i][j] = q_i . r_j: x = Q [qcount][dim] row-major, y = R^T [dim][rcount] col-major
      auto x = raft::make_device_matrix_view<float, std::int64_t, raft::row_major>(
        const_cast<float*>(q_rows), qcount, row_elements);
      auto y = raft::make_device_matrix_view<float, std::int64_t, raft::col_major>(
        const_cast<float*>(r_rows), row_elements, rcount);
      auto z = raft::make_device_matrix_view<float, std::int64_t, raft::row_major>(
        tile.data(), qcount, rcount);
      raft::linalg::gemm(res, x, y, z);

      finish_tile_params finish;
      finish.tile         = tile.data();
      finish.query_norms  = q_norms;
      finish.row_norms    = row_norms.data();
      finish.deleted      = deleted == nullptr ? nullptr : deleted + r0;
      finish.queries      = qcount;
      finish.rows         = rcount;
      finish.self_shift   = first_query + q0 - r0;
      finish.exclude_self = self;
      finish.metric       = metric;
      finish_tile_kernel<policy>
        <<<elementwise_blocks(qcount * rcount, threads), threads, 0, stream>>>(finish);
      INFERSCALE_CHECK_LAUNCH();

      std::int64_t const kb = std::min<std::int64_t>(k, rcount);
      auto tile_view =
        raft::make_device_matrix_view<float const, std::int64_t>(tile.data(), qcount, rcount);
      // one tile holding every row: its selection is the answer, written straight into best
      bool const whole = rcount == n && kb == k;
      raft::matrix::select_k<float, std::int64_t>(
        res,
        tile_view,
        std::nullopt,
        raft::make_device_matrix_view<float, std::int64_t>(
          whole ? best_d.data() : tile_d.data(), qcount, kb),
        raft::make_device_matrix_view<std::int64_t, std::int64_t>(
          whole ? best_r.data() : tile_r.data(), qcount, kb),
        true,
        false);
      if (whole) { continue; }

      merge_selection_params merge;
      merge.best_distances   = best_d.data();
      merge.best_rows        = best_r.data();
      merge.tile_distances   = tile_d.data();
      merge.tile_rows        = tile_r.data();
      merge.merged_distances = merged_d.data();
      merge.merged_rows      = merged_r.data();
      merge.queries          = qcount;
      merge.row_offset       = r0;
      merge.k                = k;
      merge.tile_k           = static_cast<std::uint32_t>(kb);
      merge_selection_kernel<policy>
        <<<elementwise_blocks(qcount * width, threads), threads, 0, stream>>>(merge);
      INFERSCALE_CHECK_LAUNCH();
      raft::matrix::select_k<float, std::int64_t>(
        res,
        raft::make_device_matrix_view<float const, std::int64_t>(merged_d.data(), qcount, width),
        std::make_optional(raft::make_device_matrix_view<std::int64_t const, std::int64_t>(
          merged_r.data(), qcount, width)),
        raft::make_device_matrix_view<float, std::int64_t>(best_d.data(), qcount, k),
        raft::make_device_matrix_view<std::int64_t, std::int64_t>(best_r.data(), qcount, k),
        true,
        false);
    }

    sort_selection_params sort;
    sort.distances      = best_d.data();
    sort.rows           = best_r.data();
    sort.out_distances  = out_distances + q0 * k;
    sort.out_rows       = out_rows + q0 * k;
    sort.queries        = qcount;
    sort.k              = k;
    sort.size           = static_cast<std::uint32_t>(next_pow2(k));
    auto const blocks_x = static_cast<unsigned>(std::min<std::int64_t>(qcount, 1 << 20));
    sort_selection_kernel<policy>
      <<<blocks_x, policy::sort_threads, sort.size * sizeof(selection_entry), stream>>>(sort);
    INFERSCALE_CHECK_LAUNCH();
  }
}

/// @brief The kNN graph of a tenant's host rows on the device (the builder's `knn`).
inline void device_knn(raft::resources const& res,
                       void const* host_rows,
                       std::int64_t row_elements,
                       dtype vector_dtype,
                       distance_metric metric,
                       std::uint32_t n,
                       std::uint32_t k,
                       std::uint32_t* out)
{
  if (n == 0 || k == 0) { return; }
  INFERSCALE_EXPECTS(k < n,
                     "device kNN: k (" + std::to_string(k) + ") must be below the row count (" +
                       std::to_string(n) + ")");
  cudaStream_t const stream = raft::resource::get_cuda_stream(res).get();
  std::size_t const bytes =
    static_cast<std::size_t>(n) * static_cast<std::size_t>(row_elements) * size_of(vector_dtype);
  auto rows = workspace_vector<unsigned char>(res, static_cast<std::int64_t>(bytes));
  INFERSCALE_CUDA_TRY(
    cudaMemcpyAsync(rows.data(), host_rows, bytes, cudaMemcpyHostToDevice, stream));
  // queries in chunks so the selection buffers stay bounded
  std::int64_t const chunk =
    std::max<std::int64_t>(1, std::min<std::int64_t>(n, (std::int64_t{64} << 20) / (12 * k)));
  auto distances = workspace_vector<float>(res, chunk * k);
  auto selected  = workspace_vector<std::int64_t>(res, chunk * k);
  std::vector<std::int64_t> host(static_cast<std::size_t>(chunk * k));
  tile_metric const tm =
    metric == distance_metric::squared_l2 ? tile_metric::squared_l2 : tile_metric::negative_dot;
  for (std::int64_t first = 0; first < n; first += chunk) {
    std::int64_t const count = std::min<std::int64_t>(chunk, n - first);
    dispatch_vector_dtype(vector_dtype, [&](auto tag) {
      using T = typename decltype(tag)::type;
      brute_force_select<T>(res,
                            reinterpret_cast<T const*>(rows.data()),
                            row_elements,
                            n,
                            nullptr,
                            nullptr,
                            nullptr,
                            first,
                            count,
                            tm,
                            k,
                            distances.data(),
                            selected.data());
    });
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(host.data(),
                                        selected.data(),
                                        static_cast<std::size_t>(count * k) * sizeof(std::int64_t),
                                        cudaMemcpyDeviceToHost,
                                        stream));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
    for (std::int64_t i = 0; i < count * k; ++i) {
      std::int64_t const r = host[static_cast<std::size_t>(i)];
      out[first * k + i]   = r < 0 ? invalid_node : static_cast<std::uint32_t>(r);
    }
  }
}

/// @brief Rank-based pruning of every node on the device (the builder's `prune`).
inline void device_prune(raft::resources const& res,
                         std::uint32_t const* host_knn,
                         std::uint32_t n,
                         std::uint32_t k,
                         std::uint32_t degree,
                         std::uint32_t* out)
{
  using policy = device_policy;
  if (n == 0 || degree == 0) { return; }
  cudaStream_t const stream     = raft::resource::get_cuda_stream(res).get();
  auto knn                      = workspace_vector<std::uint32_t>(res, std::int64_t{n} * k);
  auto pruned                   = workspace_vector<std::uint32_t>(res, std::int64_t{n} * degree);
  std::int64_t const per_launch = std::max<std::int64_t>(
    1,
    std::min<std::int64_t>(
      n,
      static_cast<std::int64_t>(policy::prune_scratch_bytes /
                                (3 * sizeof(std::uint32_t) * std::max<std::uint32_t>(k, 1)))));
  auto scratch = workspace_vector<std::uint32_t>(res, per_launch * 3 * k);
  INFERSCALE_CUDA_TRY(
    cudaMemcpyAsync(knn.data(), host_knn, std::size_t{n} * k * 4, cudaMemcpyHostToDevice, stream));
  for (std::int64_t first = 0; first < n; first += per_launch) {
    prune_kernel_params params;
    params.knn      = knn.data();
    params.out      = pruned.data();
    params.scratch  = scratch.data();
    params.width    = k;
    params.k        = k;
    params.degree   = degree;
    params.first    = static_cast<std::uint32_t>(first);
    params.count    = static_cast<std::uint32_t>(std::min<std::int64_t>(per_launch, n - first));
    auto const grid = static_cast<unsigned>(ceil_div(params.count, policy::prune_threads));
    prune_kernel<policy><<<grid, policy::prune_threads, 0, stream>>>(params);
    INFERSCALE_CHECK_LAUNCH();
  }
  INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
    out, pruned.data(), std::size_t{n} * degree * 4, cudaMemcpyDeviceToHost, stream));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
}

}  // namespace inferscale::detail::index
