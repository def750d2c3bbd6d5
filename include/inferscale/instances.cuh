/**
 * @file instances.cuh
 * @brief Explicit instantiation of the device index's heavy RAFT template (`select_k<float,
 * int64>`), for programs that compile it once instead of in every CUDA translation unit that
 * includes `index.cuh` (the device twin of `instances.hpp`).
 *
 * Such a program
 *  1. defines `INFERSCALE_EXTERN_DEVICE_INSTANCES` in every translation unit (a compile definition
 *     of the target), so that the headers declare the instance `extern template`, and
 *  2. includes this header in exactly one CUDA translation unit (which defines it).
 * Results are the same; only where the code is compiled changes (this project's own targets do
 * so: cmake/device_instances.cu).
 */
#pragma once

#include <inferscale/index.cuh>

INFERSCALE_SELECT_K_INSTANCE()
