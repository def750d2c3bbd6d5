/**
 * @file detail/index/device_index.inl
 * @brief The definitions of the device index's public functions (`index.cuh`, which documents
 * them): the device graph builder, the exact search of one namespace, and the batched search.
 * Included by `index.cuh` in the header-only form, and by `instances.cuh` (one unit of a program
 * that compiles the backend once, `INFERSCALE_EXTERN_DEVICE_INSTANCES`).
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/index/device_brute_force.inl>
#include <inferscale/detail/index/device_launch.inl>
#include <inferscale/detail/index/device_workspace.inl>
#include <inferscale/detail/index/kernels.cuh>
#include <inferscale/detail/index/tuning.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.cuh>
#include <inferscale/index.hpp>

#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resources.hpp>

#include <cuda/std/span>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace inferscale {

// make_device_graph_builder: documented in index.cuh.
INFERSCALE_DEVICE_INDEX_LINKAGE graph_builder make_device_graph_builder(raft::resources const& res,
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

// exact_search: documented in index.cuh.
INFERSCALE_DEVICE_INDEX_LINKAGE void exact_search(raft::resources const& res,
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
  using access                         = detail::index::index_access;
  (void)access::check_search(index,
                             queries,
                             cuda::std::span<std::uint64_t const>{one_namespace, 1},
                             k,
                             search_params{},
                             out_ids.extent(0),
                             out_ids.extent(1),
                             out_distances.extent(0),
                             out_distances.extent(1));
  std::int64_t const nq = queries.extent(0);
  if (nq == 0) { return; }
  auto const tenant         = access::tenant_segment(index, ns);
  auto const ref            = access::ref(index);
  std::int64_t const re     = access::row_elements(index);
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

// search: documented in index.cuh.
INFERSCALE_DEVICE_INDEX_LINKAGE void search(raft::resources const& res,
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
  using access                                 = detail::index::index_access;
  std::vector<std::int64_t> const tenant_index = access::check_search(index,
                                                                      queries,
                                                                      namespaces,
                                                                      k,
                                                                      call_params,
                                                                      out_ids.extent(0),
                                                                      out_ids.extent(1),
                                                                      out_distances.extent(0),
                                                                      out_distances.extent(1));
  std::int64_t const nq                        = queries.extent(0);
  if (nq == 0) { return; }

  auto const tenants         = access::tenant_table(index);
  auto const ref             = access::ref(index);
  std::int64_t const re      = access::row_elements(index);
  std::uint32_t const degree = access::graph_degree(index);
  // a split search (search_params::ctas_per_query; 0: automatic, by the batch size, as the host
  // reference search resolves it) runs `parts` virtual queries per query
  search_params const params  = access::resolve_split(call_params, nq, k);
  std::uint32_t const parts   = params.ctas_per_query;
  std::uint32_t const itopk   = parts == 1
                                  ? resolved_itopk(params.itopk_size, k)
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
    } else if (access::uses_exact(index, tenant, params)) {
      task.mode = c == 0 ? search_mode::exact : search_mode::none;  // exact: part 0 alone
    } else {
      search_params const part = parts == 1 ? params : access::split_part(params, k, c);
      auto const plan          = access::plan_for(index, tenant.size, k, part);
      task.mode                = search_mode::graph;
      task.xor_mask            = plan.xor_mask;
      task.max_iterations      = plan.max_iterations;
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
  std::size_t const limit       = detail::index::search_shared_limit<policy>(device);
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
  std::int64_t const resident =
    detail::index::dispatch_vector_dtype(ref.vector_dtype, [&](auto tag) {
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
  auto query_workspace =
    detail::index::optional_workspace<float>(res, query_in_shared ? 0 : launch.query_elements);
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
  p.vectors       = ref.vectors;
  p.graph         = ref.graph;
  p.ids           = ref.ids;
  p.deleted       = ref.deleted;
  p.queries       = queries.data_handle();
  p.query_stride0 = queries.stride(0);
  p.query_stride1 = queries.stride(1);
  p.tasks         = detail::index::data_or_null(d_tasks);
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
    using T = typename decltype(tag)::type;
    detail::index::search_kernel<policy, T><<<grid, policy::search_threads, shared, stream>>>(p);
    INFERSCALE_CHECK_LAUNCH();
  });
  if (parts > 1) {  // the parts' answers merged into the output rows
    auto const merge_grid =
      static_cast<unsigned>((nq + policy::elementwise_threads - 1) / policy::elementwise_threads);
    detail::index::merge_split_kernel<policy>
      <<<merge_grid, policy::elementwise_threads, 0, stream>>>(p, nq);
    INFERSCALE_CHECK_LAUNCH();
  }
}

}  // namespace inferscale
