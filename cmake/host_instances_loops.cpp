// The host injection loops (every dtype pair, layout and vector level; once for the cos/sin
// tables, once for rope_params), compiled once for this build's tests, benchmarks and examples
// (include/inferscale/instances.hpp defines the same in a user's program). Every target that uses
// them is compiled with INFERSCALE_EXTERN_TEMPLATES (cmake/targets.cmake,
// inferscale_shared_instances).
#include <inferscale/inject.hpp>

INFERSCALE_HOST_LOOP_INSTANCES()
