/**
 * @file memory.cuh
 * @brief The memory facade serving from a device store: include this (nvcc) to call
 * memory::serve and memory::inject with an injection workspace and a stream, which inject the
 * device store's facts into a cache in device memory through inject_memory_async (engine.cuh).
 * The facade itself is memory.hpp, which needs no CUDA toolkit.
 */
#pragma once

#include <inferscale/engine.cuh>
#include <inferscale/inject.cuh>
#include <inferscale/memory.hpp>
