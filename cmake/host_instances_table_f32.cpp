// The host injection and extraction instances for cos/sin tables of float, compiled once for this
// build's tests, benchmarks and examples (include/inferscale/instances.hpp; one unit per rotation
// type, so the four compile side by side). Every target that uses them is compiled with
// INFERSCALE_EXTERN_TEMPLATES (cmake/targets.cmake, inferscale_shared_instances).
#include <inferscale/inject.hpp>

INFERSCALE_HOST_INSTANCES_FOR(, ::inferscale::rope_cos_sin_table<float>)
