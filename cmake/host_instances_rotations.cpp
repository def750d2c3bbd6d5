// The host injection fronts and extraction loops of each rotation the library ships (rope_params,
// the cos/sin tables of float, bfloat16 and float16), compiled once for this build's tests,
// benchmarks and examples beside host_instances_loops.cpp (the loops they call).
#include <inferscale/extract.hpp>
#include <inferscale/inject.hpp>

INFERSCALE_HOST_INSTANCES_FOR(, ::inferscale::rope_params)
INFERSCALE_HOST_INSTANCES_FOR(, ::inferscale::rope_cos_sin_table<float>)
INFERSCALE_HOST_INSTANCES_FOR(, ::inferscale::rope_cos_sin_table<::inferscale::bfloat16_t>)
INFERSCALE_HOST_INSTANCES_FOR(, ::inferscale::rope_cos_sin_table<::inferscale::half_t>)
