/**
 * @file detail/index/definitions.inl
 * @brief The definitions of `graph_index`'s out-of-class members and of the host `search`
 * (index.hpp declares them), by concept: storage (`arena.inl`), graph maintenance
 * (`maintenance.inl`) and host search (`search.inl`). Included by `index.hpp` in the header-only
 * form; where a program compiles the index once (`INFERSCALE_EXTERN_TEMPLATES`), by the one unit
 * that includes `instances.hpp`, which also instantiates the member templates for float and
 * half_t (`INFERSCALE_INDEX_INSTANCES()`).
 */
#pragma once

#include <inferscale/detail/index/arena.inl>
#include <inferscale/detail/index/maintenance.inl>
#include <inferscale/detail/index/search.inl>
#include <inferscale/dtype.hpp>
#include <inferscale/index.hpp>

#include <cuda/std/span>

#include <cstdint>
#include <vector>

/// The index's templates for one vector / query type T (float or half_t), instantiated.
#define INFERSCALE_INDEX_INSTANCES_FOR(T)                                                   \
  template void ::inferscale::graph_index::add<T>(std::uint64_t,                            \
                                                  ::inferscale::matrix_view<T const>,       \
                                                  ::cuda::std::span<std::uint64_t const>,   \
                                                  ::inferscale::graph_builder const&);      \
  template void ::inferscale::graph_index::build<T>(std::uint64_t,                          \
                                                    ::inferscale::matrix_view<T const>,     \
                                                    ::cuda::std::span<std::uint64_t const>, \
                                                    ::inferscale::graph_builder const&);    \
  template std::vector<float> inferscale::graph_index::prepare_queries<T>(                  \
    ::inferscale::matrix_view<T const>) const;                                              \
  template std::vector<std::int64_t> inferscale::graph_index::check_search<T>(              \
    ::inferscale::matrix_view<T const>,                                                     \
    ::cuda::std::span<std::uint64_t const>,                                                 \
    std::uint32_t,                                                                          \
    ::inferscale::search_params const&,                                                     \
    std::int64_t,                                                                           \
    std::int64_t,                                                                           \
    std::int64_t,                                                                           \
    std::int64_t) const;                                                                    \
  template void ::inferscale::search<T>(::inferscale::graph_index const&,                   \
                                        ::inferscale::matrix_view<T const>,                 \
                                        ::cuda::std::span<std::uint64_t const>,             \
                                        std::uint32_t,                                      \
                                        ::inferscale::search_params const&,                 \
                                        ::inferscale::matrix_view<std::uint64_t>,           \
                                        ::inferscale::matrix_view<float>);

/// The index's templates for float and half_t, the types it takes.
#define INFERSCALE_INDEX_INSTANCES()    \
  INFERSCALE_INDEX_INSTANCES_FOR(float) \
  INFERSCALE_INDEX_INSTANCES_FOR(::inferscale::half_t)
