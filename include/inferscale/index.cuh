/**
 * @file index.cuh
 * @brief Device backend of the fact index (index.hpp), built on RAFT:
 *  - `search`: batched search of a device-memory index, one kernel launch for the whole batch,
 *    each query in its own namespace; the answer equals `graph_index::search` on a host-memory
 *    index with the same content bit for bit (ids and distances);
 *  - `exact_search`: brute force of one namespace with RAFT gemm + select_k;
 *  - `make_device_graph_builder`: the kNN graph (gemm + select_k) and the rank-based pruning
 *    (a kernel running `detail::index::prune_node`) of `graph_index::add/build/compact` on the
 *    GPU.
 *
 * Every call enqueues its work on the stream of the `raft::resources` it is given and takes its
 * temporary memory from their workspace resource. Queries and outputs are device memory; the
 * host checks shapes, namespaces and parameters before anything is written and never reads
 * device data, so a device query with a NaN or infinite element, a zero query under cosine, or
 * a squared norm above 1e30 (where the host refuses) is answered with a row of `invalid_fact_id` /
 * +infinity instead of an exception.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/index/kernels.cuh>
#include <inferscale/detail/index/tuning.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <raft/core/device_mdspan.hpp>
#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resource/device_memory_resource.hpp>
#include <raft/core/resources.hpp>
#include <raft/linalg/gemm.cuh>
#include <raft/matrix/select_k.cuh>
#include <rmm/device_uvector.hpp>

#include <cuda/std/span>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale {
namespace detail::index {

using device_policy = index_policy_sm90;

/**
 * @brief The dynamic shared memory a search block may use on `device`: the policy's cap, or the
 * device's opt-in limit less the kernel's static state. It depends on the device only, never on a
 * call's batch.
 */
template <class Policy>
std::size_t search_shared_limit(int device)
{
  static std::mutex guard;
  static std::vector<std::size_t> limits;  // per device, 0 = not read yet
  std::lock_guard<std::mutex> lock(guard);
  auto const d = static_cast<std::size_t>(device);
  if (d < limits.size() && limits[d] != 0) { return limits[d]; }
  int optin = 0;
  INFERSCALE_CUDA_TRY(
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (limits.size() <= d) { limits.resize(d + 1, 0); }
  limits[d] = std::min<std::size_t>(Policy::max_search_shared_bytes,
                                    static_cast<std::size_t>(optin) - sizeof(search_block_state));
  return limits[d];
}

/**
 * @brief Raises `search_kernel<Policy, T>`'s dynamic shared memory attribute to
 * search_shared_limit on `device`, once per device and process. Every launch needs at most that
 * much. Setting it per call to the call's own size would let one search lower it under another's
 * launch on another thread (searches may run concurrently).
 */
template <class Policy, class T>
void prepare_search_kernel(int device)
{
  static std::mutex guard;
  static std::vector<bool> done;
  std::lock_guard<std::mutex> lock(guard);
  auto const d = static_cast<std::size_t>(device);
  if (d < done.size() && done[d]) { return; }
  INFERSCALE_CUDA_TRY(cudaFuncSetAttribute(search_kernel<Policy, T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(search_shared_limit<Policy>(device))));
  if (done.size() <= d) { done.resize(d + 1, false); }
  done[d] = true;
}

/**
 * @brief CTAs of `search_kernel<Policy, T>` with `shared` bytes of dynamic shared memory that
 * `device` holds at once (occupancy per SM x SMs, at least 1), after preparing the kernel's
 * attribute (prepare_search_kernel). The SM count is read once per device.
 */
template <class Policy, class T>
std::int64_t resident_search_ctas(int device, std::size_t shared)
{
  prepare_search_kernel<Policy, T>(device);
  static std::mutex guard;
  static std::vector<int> sms;
  int count = 0;
  {
    std::lock_guard<std::mutex> lock(guard);
    auto const d = static_cast<std::size_t>(device);
    if (sms.size() <= d) { sms.resize(d + 1, 0); }
    if (sms[d] == 0) {
      INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&sms[d], cudaDevAttrMultiProcessorCount, device));
    }
    count = sms[d];
  }
  static std::mutex occupancy_guard;
  static std::map<std::pair<int, std::size_t>, int> per_sm_of;  // (device, shared) -> CTAs per SM
  std::lock_guard<std::mutex> lock(occupancy_guard);
  auto const key = std::make_pair(device, shared);
  auto it        = per_sm_of.find(key);
  if (it == per_sm_of.end()) {
    int per_sm = 0;
    INFERSCALE_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, search_kernel<Policy, T>, Policy::search_threads, shared));
    it = per_sm_of.emplace(key, per_sm).first;
  }
  return std::max<std::int64_t>(1, std::int64_t{it->second} * count);
}

/// @brief Calls `f(type_tag<T>{})` for the index's vector dtype (float or half_t).
template <class F>
decltype(auto) dispatch_vector_dtype(dtype t, F&& f)
{
  switch (t) {
    case dtype::float32: return f(type_tag<float>{});
    case dtype::float16: return f(type_tag<half_t>{});
    default: break;
  }
  INFERSCALE_FAIL(std::string{"index: vectors are float32 or float16, got "} + to_string(t));
}

/// @brief Blocks of an element-wise launch over `work` items (grid-stride loops cover the rest).
inline unsigned elementwise_blocks(std::int64_t work, int threads)
{
  std::int64_t const blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, std::int64_t{1} << 20));
}

/// @brief Temporary device memory from the resources' workspace, on their stream.
template <class T>
rmm::device_uvector<T> workspace_vector(raft::resources const& res, std::int64_t count)
{
  return rmm::device_uvector<T>(static_cast<std::size_t>(std::max<std::int64_t>(count, 1)),
                                raft::resource::get_cuda_stream(res),
                                raft::resource::get_workspace_resource_ref(res));
}

/// @brief Workspace a call may not need: nothing is allocated for `count` 0 (`data_or_null` is then
/// null), so a search that needs none enqueues nothing but its kernel (capturable in a CUDA graph;
/// an allocation during a capture fails with cudaErrorStreamCaptureUnsupported).
template <class T>
std::optional<rmm::device_uvector<T>> optional_workspace(raft::resources const& res,
                                                         std::int64_t count)
{
  if (count <= 0) { return std::nullopt; }
  return workspace_vector<T>(res, count);
}

template <class T>
T* data_or_null(std::optional<rmm::device_uvector<T>>& v) noexcept
{
  return v ? v->data() : nullptr;
}

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
    auto const grid     = static_cast<unsigned>((count + warps - 1) / warps);
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
    params.knn     = knn.data();
    params.out     = pruned.data();
    params.scratch = scratch.data();
    params.width   = k;
    params.k       = k;
    params.degree  = degree;
    params.first   = static_cast<std::uint32_t>(first);
    params.count   = static_cast<std::uint32_t>(std::min<std::int64_t>(per_launch, n - first));
    auto const grid =
      static_cast<unsigned>((params.count + policy::prune_threads - 1) / policy::prune_threads);
    prune_kernel<policy><<<grid, policy::prune_threads, 0, stream>>>(params);
    INFERSCALE_CHECK_LAUNCH();
  }
  INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
    out, pruned.data(), std::size_t{n} * degree * 4, cudaMemcpyDeviceToHost, stream));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream));
}

inline void require_device_index(graph_index const& index, char const* what)
{
  INFERSCALE_EXPECTS(index.memory() == memory_kind::device,
                     std::string{what} +
                       ": the index lives in host memory; search it with graph_index::search "
                       "(or build it with index_config::memory = memory_kind::device)");
}

}  // namespace detail::index

/**
 * @brief A graph builder for `graph_index::add/build/compact` whose kNN is RAFT gemm + select_k on
 * the device (row and query tiles, bounded memory) and whose pruning is a kernel running
 * `detail::index::prune_node` per node. Reverse edges and the merge stay on the host.
 *
 * @param res    stream and workspace of the device work (copied: keep the underlying stream and
 *               memory resources alive as long as the builder)
 * @param config the index's configuration (row layout, dtype and metric of the rows the kNN
 *               callback receives)
 * @note Both callbacks copy their input to the device and wait for their result. The kNN ranks
 * by fp32 gemm distances, so rows may order near-ties differently from the host kNN; each row is
 * sorted by (distance, node).
 */
inline graph_builder make_device_graph_builder(raft::resources const& res,
                                               index_config const& config)
{
  INFERSCALE_EXPECTS(
    config.vector_dtype == dtype::float32 || config.vector_dtype == dtype::float16,
    std::string{"make_device_graph_builder: vectors are float32 or float16, got "} +
      to_string(config.vector_dtype));
  graph_builder builder;
  std::int64_t const row_elements =
    detail::index::padded_dim(config.dim, size_of(config.vector_dtype));
  builder.knn = [res, row_elements, vector_dtype = config.vector_dtype, metric = config.metric](
                  void const* rows, std::uint32_t n, std::uint32_t k, std::uint32_t* out) {
    detail::index::device_knn(res, rows, row_elements, vector_dtype, metric, n, k, out);
  };
  builder.prune = [res](std::uint32_t const* knn,
                        std::uint32_t n,
                        std::uint32_t k,
                        std::uint32_t degree,
                        std::uint32_t* out) {
    detail::index::device_prune(res, knn, n, k, degree, out);
  };
  return builder;
}

/**
 * @brief Exact search of one namespace of a device-memory index: RAFT gemm + select_k over the
 * namespace's live facts.
 *
 * @param queries       device `[q][dim]` fp32 queries (normalised here under cosine)
 * @param out_ids       device `[q][k]`: nearest live facts first; slots beyond the live count get
 *                      `invalid_fact_id`
 * @param out_distances device `[q][k]`: inner product -dot, cosine 1 - dot (normalised vectors),
 *                      squared L2 |q|^2 + |x|^2 - 2 dot clamped at 0; +inf for empty slots. fp32
 *                      gemm values: close to, not bitwise equal to, `graph_index::search`.
 * @throw logic_error (outputs untouched) for a host-memory index, and as
 *        `graph_index::check_search`: dimension mismatch, unknown namespace, k == 0 or above
 *        1024, output shapes other than `[q][k]`
 * @note Enqueued on the resources' stream; does not wait for completion. A query with a NaN or
 *       infinite element, a zero query under cosine or a squared norm above 1e30 gets a row of
 *       invalid ids / +inf.
 */
inline void exact_search(raft::resources const& res,
                         graph_index const& index,
                         std::uint64_t ns,
                         matrix_view<float const> queries,
                         std::uint32_t k,
                         matrix_view<std::uint64_t> out_ids,
                         matrix_view<float> out_distances)
{
  using policy = detail::index::device_policy;
  detail::index::require_device_index(index, "inferscale::exact_search");
  std::uint64_t const one_namespace[1] = {ns};
  (void)index.check_search(queries,
                           cuda::std::span<std::uint64_t const>{one_namespace, 1},
                           k,
                           search_params{},
                           out_ids.extent(0),
                           out_ids.extent(1),
                           out_distances.extent(0),
                           out_distances.extent(1));
  std::int64_t const nq = queries.extent(0);
  if (nq == 0) { return; }
  auto const tenant         = index.tenant_segment(ns);
  auto const ref            = index.ref();
  std::int64_t const re     = index.row_elements();
  cudaStream_t const stream = raft::resource::get_cuda_stream(res).get();
  int const threads         = policy::elementwise_threads;
  bool const l2             = ref.metric == distance_metric::squared_l2;

  auto prepared = detail::index::workspace_vector<float>(res, nq * re);
  auto norms    = detail::index::workspace_vector<float>(res, l2 ? nq : 0);
  auto valid    = detail::index::workspace_vector<std::uint8_t>(res, nq);
  detail::index::prepare_queries_params prep;
  prep.queries      = queries.data_handle();
  prep.stride0      = queries.stride(0);
  prep.stride1      = queries.stride(1);
  prep.count        = nq;
  prep.dim          = index.dim();
  prep.row_elements = re;
  prep.out          = prepared.data();
  prep.norms        = l2 ? norms.data() : nullptr;
  prep.valid        = valid.data();
  prep.metric       = ref.metric;
  detail::index::prepare_queries_kernel<policy>
    <<<static_cast<unsigned>(std::min<std::int64_t>(nq, 1 << 20)), threads, 0, stream>>>(prep);
  INFERSCALE_CHECK_LAUNCH();

  auto best_d = detail::index::workspace_vector<float>(res, nq * k);
  auto best_r = detail::index::workspace_vector<std::int64_t>(res, nq * k);
  if (tenant.size > 0 && tenant.live > 0) {
    detail::index::tile_metric const tm =
      ref.metric == distance_metric::squared_l2      ? detail::index::tile_metric::squared_l2
      : ref.metric == distance_metric::inner_product ? detail::index::tile_metric::negative_dot
                                                     : detail::index::tile_metric::one_minus_dot;
    detail::index::dispatch_vector_dtype(ref.vector_dtype, [&](auto tag) {
      using T       = typename decltype(tag)::type;
      T const* rows = static_cast<T const*>(ref.vectors) + tenant.row_begin * re;
      detail::index::brute_force_select<T>(res,
                                           rows,
                                           re,
                                           tenant.size,
                                           ref.deleted + tenant.row_begin,
                                           prepared.data(),
                                           l2 ? norms.data() : nullptr,
                                           0,
                                           nq,
                                           tm,
                                           k,
                                           best_d.data(),
                                           best_r.data());
    });
  } else {
    detail::index::fill_selection_kernel<policy>
      <<<detail::index::elementwise_blocks(nq * k, threads), threads, 0, stream>>>(
        detail::index::fill_selection_params{best_d.data(), best_r.data(), nq * k});
    INFERSCALE_CHECK_LAUNCH();
  }

  detail::index::exact_output_params out;
  out.distances         = best_d.data();
  out.rows              = best_r.data();
  out.valid             = valid.data();
  out.ids               = ref.ids + tenant.row_begin;
  out.deleted           = ref.deleted + tenant.row_begin;
  out.out_ids           = out_ids.data_handle();
  out.ids_stride0       = out_ids.stride(0);
  out.ids_stride1       = out_ids.stride(1);
  out.out_distances     = out_distances.data_handle();
  out.distances_stride0 = out_distances.stride(0);
  out.distances_stride1 = out_distances.stride(1);
  out.queries           = nq;
  out.k                 = k;
  detail::index::exact_output_kernel<policy>
    <<<detail::index::elementwise_blocks(nq * k, threads), threads, 0, stream>>>(out);
  INFERSCALE_CHECK_LAUNCH();
}

/**
 * @brief Batched search of a device-memory index: query `q` looks in `namespaces[q]` (or all in
 * `namespaces[0]` when one is given). Row `q` of the outputs gets the `k` nearest live facts of
 * its namespace, in the order and with the distances `graph_index::search` gives on a host-memory
 * index with the same content, bit for bit: the same plan per tenant (`plan_for`, `uses_exact`),
 * seeds, exact visited set, team distances and (distance, node) order.
 *
 * One kernel launch for the whole batch: one CTA per query while queries and visited sets fit in
 * shared memory; otherwise at most the CTAs the device holds at once, each pulling queries and
 * reusing one global slice for them (`detail::index::search_launch_plan`), so the workspace is
 * bounded by the device, not by the batch. The per-query tenant table is staged first, except
 * for a batch of at most `detail::index::inline_search_tasks` queries whose queries and visited
 * sets fit in shared memory: that search enqueues the kernel and nothing else (no allocation, no
 * copy), so it can be captured in a CUDA graph once a first call has prepared the kernel.
 *
 * A split search (`search_params::ctas_per_query` = P > 1, or the automatic 0 resolved to P > 1 by
 * auto_ctas_per_query for the batch's size, as the host reference search resolves it) runs P
 * virtual queries per query, each part of a query's graph search on its own CTA (the inline limit
 * above counts them), into a workspace of P x k entries per query; a second kernel
 * (merge_split_kernel, one thread per query) merges each query's parts into its row. Its answers
 * equal the host reference search with the same P, bit for bit.
 *
 * @param queries       device `[q][dim]` fp32 queries (any strides)
 * @param namespaces    host span: one namespace per query, or one for all
 * @param out_ids       device `[q][k]`; `invalid_fact_id` beyond the namespace's live facts
 * @param out_distances device `[q][k]`; +inf beyond the live facts
 * @throw logic_error (outputs untouched) for a host-memory index, and as
 *        `graph_index::check_search`: dimension mismatch, unknown namespace, k == 0, itopk (raised
 *        to k) above 1024, search_width outside 1..64, output shapes other than `[q][k]`
 * @note Enqueued on the resources' stream; does not wait for the kernel (the host staging of the
 *       tenant table is consumed before returning). A query with a NaN or infinite element, or a
 *       zero query under cosine, gets a row of invalid ids / +inf (the host never reads device
 *       queries). Mutating the index while a search is in flight is the caller's race.
 */
inline void search(raft::resources const& res,
                   graph_index const& index,
                   matrix_view<float const> queries,
                   cuda::std::span<std::uint64_t const> namespaces,
                   std::uint32_t k,
                   search_params const& call_params,
                   matrix_view<std::uint64_t> out_ids,
                   matrix_view<float> out_distances)
{
  using policy = detail::index::device_policy;
  using detail::index::search_mode;
  detail::index::require_device_index(index, "inferscale::search");
  std::vector<std::int64_t> const tenant_index = index.check_search(queries,
                                                                    namespaces,
                                                                    k,
                                                                    call_params,
                                                                    out_ids.extent(0),
                                                                    out_ids.extent(1),
                                                                    out_distances.extent(0),
                                                                    out_distances.extent(1));
  std::int64_t const nq                        = queries.extent(0);
  if (nq == 0) { return; }

  auto const tenants          = index.tenant_table();
  auto const ref              = index.ref();
  std::int64_t const re       = index.row_elements();
  std::uint32_t const degree  = index.graph_degree();
  // a split search (search_params::ctas_per_query; 0: automatic, by the batch size, as the host
  // reference search resolves it) runs `parts` virtual queries per query
  search_params const params = graph_index::resolve_split(call_params, nq, k);
  std::uint32_t const parts  = params.ctas_per_query;
  std::uint32_t const itopk = parts == 1 ? resolved_itopk(params.itopk_size, k)
                                         : split_itopk(resolved_itopk(params.itopk_size, k), k, parts);
  std::uint32_t const entries = static_cast<std::uint32_t>(
    detail::index::next_pow2(std::uint64_t{itopk} + policy::min_candidates));
  std::int64_t const virtual_queries = nq * parts;

  std::vector<detail::index::search_task> tasks(static_cast<std::size_t>(virtual_queries));
  std::uint64_t hash_max = 0;
  for (std::int64_t v = 0; v < virtual_queries; ++v) {
    std::int64_t const q = v / parts;
    auto const c         = static_cast<std::uint32_t>(v % parts);
    auto const& tenant =
      tenants[static_cast<std::size_t>(tenant_index[static_cast<std::size_t>(q)])];
    auto& task     = tasks[static_cast<std::size_t>(v)];
    task.row_begin = tenant.row_begin;
    task.rows      = tenant.size;
    task.xor_mask  = params.rand_xor_mask;
    if (tenant.live == 0) {
      task.mode = search_mode::none;
    } else if (index.uses_exact(tenant, params)) {
      task.mode = c == 0 ? search_mode::exact : search_mode::none;  // exact: part 0 alone
    } else {
      search_params const part = parts == 1 ? params : graph_index::split_part(params, k, c);
      auto const plan     = index.plan_for(tenant.size, k, part);
      task.mode           = search_mode::graph;
      task.xor_mask       = plan.xor_mask;
      task.max_iterations = plan.max_iterations;
      // nodes a query can visit: its seed slots and every neighbour of every parent, at most n
      std::uint64_t const visits = std::min<std::uint64_t>(
        tenant.size,
        std::uint64_t{plan.itopk} +
          std::uint64_t{plan.width} * degree * (std::uint64_t{plan.max_iterations} + 1));
      std::uint64_t const hash_entries =
        std::max<std::uint64_t>(policy::min_hash_entries, detail::index::next_pow2(2 * visits));
      task.hash_mask = static_cast<std::uint32_t>(hash_entries - 1);
      hash_max       = std::max(hash_max, hash_entries);
    }
  }

  // shared memory: the buffer always; the query and the hash when they fit
  int device = 0;
  INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
  std::size_t const limit = detail::index::search_shared_limit<policy>(device);
  std::size_t shared            = std::size_t{entries} * sizeof(detail::index::buffer_entry);
  std::size_t const query_bytes = static_cast<std::size_t>(re) * sizeof(float);
  bool const query_in_shared =
    query_bytes <= policy::max_shared_query_bytes && shared + query_bytes <= limit;
  if (query_in_shared) { shared += query_bytes; }
  std::size_t const hash_bytes = static_cast<std::size_t>(hash_max) * sizeof(std::uint32_t);
  bool const hash_in_shared =
    hash_bytes <= policy::max_shared_hash_bytes && shared + hash_bytes <= limit;
  if (hash_in_shared) { shared += hash_bytes; }
  INFERSCALE_EXPECTS(shared <= limit,
                     "inferscale::search: the search buffer of itopk " + std::to_string(itopk) +
                       " does not fit in shared memory");

  cudaStream_t const stream = raft::resource::get_cuda_stream(res).get();
  // with a global workspace, at most the CTAs the device holds at once, each reusing one slice
  std::int64_t const resident = detail::index::dispatch_vector_dtype(ref.vector_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (query_in_shared && hash_in_shared) {  // one CTA per query: the occupancy does not matter
      detail::index::prepare_search_kernel<policy, T>(device);
      return std::int64_t{0};
    }
    return detail::index::resident_search_ctas<policy, T>(device, shared);  // prepares it too
  });
  auto const launch = detail::index::search_launch_plan(virtual_queries,
                                                       resident,
                                                       query_in_shared,
                                                       hash_in_shared,
                                                       re,
                                                       static_cast<std::int64_t>(hash_max));
  // a small batch carries its tasks in the launch's parameters: no allocation, no copy
  bool const inline_tasks = virtual_queries <= detail::index::inline_search_tasks;
  auto d_tasks            = detail::index::optional_workspace<detail::index::search_task>(
    res, inline_tasks ? 0 : virtual_queries);
  auto part_out = detail::index::optional_workspace<detail::index::buffer_entry>(
    res, parts == 1 ? 0 : virtual_queries * k);
  auto query_workspace = detail::index::optional_workspace<float>(
    res, query_in_shared ? 0 : launch.query_elements);
  auto hash_workspace = detail::index::optional_workspace<std::uint32_t>(
    res, hash_in_shared ? 0 : launch.hash_elements);
  if (!inline_tasks) {
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(detail::index::data_or_null(d_tasks),
                                        tasks.data(),
                                        tasks.size() * sizeof(detail::index::search_task),
                                        cudaMemcpyHostToDevice,
                                        stream));
  }

  detail::index::search_kernel_params p;
  p.vectors           = ref.vectors;
  p.graph             = ref.graph;
  p.ids               = ref.ids;
  p.deleted           = ref.deleted;
  p.queries           = queries.data_handle();
  p.query_stride0     = queries.stride(0);
  p.query_stride1     = queries.stride(1);
  p.tasks             = detail::index::data_or_null(d_tasks);
  if (inline_tasks) { std::copy(tasks.begin(), tasks.end(), p.inline_tasks); }
  p.out_ids           = out_ids.data_handle();
  p.ids_stride0       = out_ids.stride(0);
  p.ids_stride1       = out_ids.stride(1);
  p.out_distances     = out_distances.data_handle();
  p.distances_stride0 = out_distances.stride(0);
  p.distances_stride1 = out_distances.stride(1);
  p.query_workspace   = detail::index::data_or_null(query_workspace);
  p.hash_workspace    = detail::index::data_or_null(hash_workspace);
  p.hash_stride       = launch.hash_stride;
  p.num_queries       = virtual_queries;
  p.parts             = parts;
  p.part_out          = detail::index::data_or_null(part_out);
  p.dim               = index.dim();
  p.row_elements      = re;
  p.xor_mask          = params.rand_xor_mask;  // (each task carries its own: a split's parts)
  p.degree            = degree;
  p.k                 = k;
  p.itopk             = itopk;
  p.width             = params.search_width;
  p.samplings         = std::max<std::uint32_t>(1, params.num_random_samplings);
  p.buffer_entries    = entries;
  p.query_in_shared   = query_in_shared;
  p.hash_in_shared    = hash_in_shared;
  p.metric            = ref.metric;

  auto const grid = static_cast<unsigned>(launch.grid);
  detail::index::dispatch_vector_dtype(ref.vector_dtype, [&](auto tag) {
    using T     = typename decltype(tag)::type;
    detail::index::search_kernel<policy, T><<<grid, policy::search_threads, shared, stream>>>(p);
    INFERSCALE_CHECK_LAUNCH();
  });
  if (parts > 1) {  // the parts' answers merged into the output rows
    auto const merge_grid = static_cast<unsigned>((nq + policy::elementwise_threads - 1) /
                                                  policy::elementwise_threads);
    detail::index::merge_split_kernel<policy>
      <<<merge_grid, policy::elementwise_threads, 0, stream>>>(p, nq);
    INFERSCALE_CHECK_LAUNCH();
  }
}

}  // namespace inferscale
