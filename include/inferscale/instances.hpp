/**
 * @file instances.hpp
 * @brief The host library's heavy code compiled once: explicit instantiation of the host
 * injection and extraction paths, and the definitions of the fact index (`graph_index`'s members
 * and the host `search`, for float and half_t), for programs that compile them once instead of in
 * every translation unit that injects or indexes.
 *
 * The host backend dispatches the store and cache dtypes, the layout, the fp8 scales, the rotary
 * pairing and rounding and the CPU's vector level at run time, into one loop per combination:
 * several hundred functions for each kind of rotation (rope_params; the engines' cos/sin tables,
 * whose types share one set: detail/inject/host_rotation.hpp), compiled wherever the host run
 * (injection_batch::run),
 * tiered_store::run, extract_host or the memory facade's serve is used. A program with many such
 * units (an engine's sources, a test suite) may instead
 *  1. define `INFERSCALE_EXTERN_TEMPLATES` in every translation unit (a compile definition of the
 *     target), so that the headers declare those functions `extern template` (and `index.hpp`
 *     declares the index's members without defining them), and
 *  2. include this header in exactly one translation unit (which defines them).
 * Results are the same; only where the code is compiled changes. Rotation types other than
 * rope_params and rope_cos_sin_table<float / bfloat16_t / half_t> are instantiated where they are
 * used.
 */
#pragma once

#include <inferscale/detail/index/definitions.inl>
#include <inferscale/extract.hpp>
#include <inferscale/inject.hpp>

INFERSCALE_HOST_INSTANCES()
INFERSCALE_INDEX_INSTANCES()
