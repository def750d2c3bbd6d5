/**
 * @file memory.cuh
 * @brief The memory facade serving from a device store: include this (nvcc) to call
 * memory::serve, serve_step and inject with a device_context (an injection workspace and a
 * stream), which inject the device store's facts into a cache in device memory with the
 * injection step's device run (injection_batch::run, inject.cuh).
 * The facade itself is memory.hpp, which needs no CUDA toolkit.
 */
#pragma once

#include <inferscale/engine.cuh>
#include <inferscale/inject.cuh>
#include <inferscale/memory.hpp>
