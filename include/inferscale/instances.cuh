/**
 * @file instances.cuh
 * @brief The device index's backend compiled once (the device twin of `instances.hpp`): the
 * definitions of `index.cuh`'s functions (their kernels, RAFT gemm) and the explicit
 * instantiation of its heavy RAFT template (`select_k<float, int64>`), for programs that compile
 * them in one unit instead of in every CUDA translation unit that includes `index.cuh`.
 *
 * Such a program
 *  1. defines `INFERSCALE_EXTERN_DEVICE_INSTANCES` in every translation unit (a compile definition
 *     of the target), so that `index.cuh` declares its functions only and the select_k instance
 *     `extern template`, and
 *  2. includes this header in exactly one CUDA translation unit (which defines them).
 * Results are the same; only where the code is compiled changes (this project's own targets do
 * so: cmake/device_instances.cu).
 */
#pragma once

#if !defined(INFERSCALE_EXTERN_DEVICE_INSTANCES)
#error \
  "inferscale/instances.cuh defines the device index's backend for programs that compile it once: define INFERSCALE_EXTERN_DEVICE_INSTANCES in every translation unit of the program (without it, index.cuh is header-only and this header is not needed)"
#endif

#include <inferscale/detail/index/device_index.inl>
#include <inferscale/detail/index/select_k_instance.hpp>
#include <inferscale/index.cuh>

INFERSCALE_SELECT_K_INSTANCE()
