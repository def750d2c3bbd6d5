/**
 * @file detail/index/select_k_instance.hpp
 * @brief The one RAFT `select_k` instance the device index calls (float distances, int64 rows):
 * the macro that names it, for its explicit instantiation (`instances.cuh`) and its `extern`
 * declaration, made here when `INFERSCALE_EXTERN_DEVICE_INSTANCES` is defined.
 *
 * `raft::matrix::select_k` is a header template (radix and warp-sort kernels for every k range):
 * about 50 s of nvcc per translation unit that instantiates it (measured on the project's 2-core
 * machine: one RAFT test unit 84 s of CPU with it, 32 s with the extern declaration). A program
 * with several units that include `index.cuh` compiles it once instead, as RAFT's own compiled
 * library did with its `-ext.cuh` headers.
 */
#pragma once

#include <raft/core/device_mdspan.hpp>
#include <raft/core/resources.hpp>
#include <raft/matrix/select_k.cuh>

#include <cstdint>
#include <optional>

/// `PREFIX template void raft::matrix::select_k<float, std::int64_t>(…);` (PREFIX: `extern` or
/// nothing).
#define INFERSCALE_SELECT_K_INSTANCE(PREFIX)                                            \
  PREFIX template void ::raft::matrix::select_k<float, std::int64_t>(                   \
    ::raft::resources const&,                                                           \
    ::raft::device_matrix_view<float const, std::int64_t, ::raft::row_major>,           \
    std::optional<                                                                      \
      ::raft::device_matrix_view<std::int64_t const, std::int64_t, ::raft::row_major>>, \
    ::raft::device_matrix_view<float, std::int64_t, ::raft::row_major>,                 \
    ::raft::device_matrix_view<std::int64_t, std::int64_t, ::raft::row_major>,          \
    bool,                                                                               \
    bool,                                                                               \
    ::raft::matrix::SelectAlgo);

#if defined(INFERSCALE_EXTERN_DEVICE_INSTANCES)
// Compiled once, in the program's unit that includes <inferscale/instances.cuh>.
INFERSCALE_SELECT_K_INSTANCE(extern)
#endif
