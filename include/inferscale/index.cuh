/**
 * @file index.cuh
 * @brief Device backend of the fact index (index.hpp), built on RAFT:
 *  - `search`: batched search of a device-memory index, one kernel launch for the whole batch,
 *    each query in its own namespace; the device overload of the library's one `search` (the
 *    host one, in index.hpp, takes the same arguments without the RAFT handle), its answer equal
 *    to the host `search` on a host-memory index with the same content bit for bit (ids and
 *    distances);
 *  - `exact_search`: brute force of one namespace with RAFT gemm + select_k;
 *  - `make_device_graph_builder`: the kNN graph (gemm + select_k) and the rank-based pruning
 *    (a kernel running `detail::index::prune_node`) of `graph_index::add/build/compact` on the
 *    GPU.
 *
 * Every call enqueues its work on the stream of the `raft::resources` it is given and takes its
 * temporary memory from their workspace resource. Queries and outputs are device memory; the
 * host checks shapes, namespaces and parameters before anything is written and never reads
 * device data, so a device query with a NaN or infinite element, a zero query under cosine, or
 * a squared norm above 1e30 under inner product or squared L2 (where the host refuses) is answered
 * with a row of `invalid_fact_id` / +infinity instead of an exception. Cosine normalises every
 * other finite query, denormal or huge, in double, as the host does.
 *
 * The backend's detail lives in `detail/index/`: these functions' definitions
 * (`device_index.inl`); the kernels (`kernels.cuh`) and their launch shapes (`tuning.hpp`); launch
 * support and dtype dispatch (`device_launch.inl`); workspace (`device_workspace.inl`); the RAFT
 * brute force and the device graph build's callbacks (`device_brute_force.inl`).
 *
 * Header-only by default: the definitions are `inline` and every CUDA unit that includes this
 * header compiles the backend (its kernels, RAFT gemm). A program with several such units may
 * compile it once instead: it defines `INFERSCALE_EXTERN_DEVICE_INSTANCES` in every unit, where
 * this header then declares the functions only (no kernels, no RAFT algorithms included), and
 * includes `<inferscale/instances.cuh>` in exactly one CUDA unit, which defines them (and RAFT's
 * select_k instance). The answers are the same; only where the code is compiled changes.
 */
#pragma once

#include <inferscale/index.hpp>

#include <raft/core/resources.hpp>

#include <cuda/std/span>

#include <cstdint>

/// `inline` in the header-only form; nothing (one external definition, in the unit that includes
/// instances.cuh) when the program compiles the backend once
/// (`INFERSCALE_EXTERN_DEVICE_INSTANCES`).
#if defined(INFERSCALE_EXTERN_DEVICE_INSTANCES)
#define INFERSCALE_DEVICE_INDEX_LINKAGE
#else
#define INFERSCALE_DEVICE_INDEX_LINKAGE inline
#endif

namespace inferscale {

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
INFERSCALE_DEVICE_INDEX_LINKAGE graph_builder make_device_graph_builder(raft::resources const& res,
                                                                        index_config const& config);

/**
 * @brief Exact search of one namespace of a device-memory index: RAFT gemm + select_k over the
 * namespace's live facts.
 *
 * @param queries       device `[q][dim]` fp32 queries (normalised here under cosine)
 * @param out_ids       device `[q][k]`: nearest live facts first; slots beyond the live count get
 *                      `invalid_fact_id`
 * @param out_distances device `[q][k]`: inner product -dot, cosine 1 - dot (normalised vectors),
 *                      squared L2 |q|^2 + |x|^2 - 2 dot clamped at 0; +inf for empty slots. fp32
 *                      gemm values: close to, not bitwise equal to, the host `search`.
 * @throw logic_error (outputs untouched) for a host-memory index, and as
 *        the host `search` (index.hpp): dimension mismatch, unknown namespace, k == 0 or above
 *        1024, output shapes other than `[q][k]`
 * @note Enqueued on the resources' stream; does not wait for completion. A query with a NaN or
 *       infinite element, a zero query under cosine or a squared norm above 1e30 under inner
 *       product or squared L2 gets a row of invalid ids / +inf.
 */
INFERSCALE_DEVICE_INDEX_LINKAGE void exact_search(raft::resources const& res,
                                                  graph_index const& index,
                                                  std::uint64_t ns,
                                                  matrix_view<float const> queries,
                                                  std::uint32_t k,
                                                  matrix_view<std::uint64_t> out_ids,
                                                  matrix_view<float> out_distances);

/**
 * @brief Batched search of a device-memory index: query `q` looks in `namespaces[q]` (or all in
 * `namespaces[0]` when one is given). Row `q` of the outputs gets the `k` nearest live facts of
 * its namespace, in the order and with the distances the host `search` gives on a host-memory
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
 *        the host `search` (index.hpp): dimension mismatch, unknown namespace, k == 0, itopk
 *        (raised to k) above 1024, search_width outside 1..64, output shapes other than `[q][k]`
 * @note Enqueued on the resources' stream; does not wait for the kernel (the host staging of the
 *       tenant table is consumed before returning). A query with a NaN or infinite element, a
 *       zero query under cosine or a squared norm above 1e30 under inner product or squared L2
 *       gets a row of invalid ids / +inf (the host never reads device queries). Mutating the index
 * while a search is in flight is the caller's race.
 */
INFERSCALE_DEVICE_INDEX_LINKAGE void search(raft::resources const& res,
                                            graph_index const& index,
                                            matrix_view<float const> queries,
                                            cuda::std::span<std::uint64_t const> namespaces,
                                            std::uint32_t k,
                                            search_params const& call_params,
                                            matrix_view<std::uint64_t> out_ids,
                                            matrix_view<float> out_distances);

}  // namespace inferscale

// The definitions: here in the header-only form; in the unit that includes instances.cuh when the
// program compiles the backend once.
#if !defined(INFERSCALE_EXTERN_DEVICE_INSTANCES)
#include <inferscale/detail/index/device_index.inl>
#endif
