// The host injection and extraction instances of this build's tests, benchmarks and examples,
// compiled once (include/inferscale/instances.hpp); every target that links
// inferscale_host_instances is compiled with INFERSCALE_EXTERN_TEMPLATES.
#include <inferscale/instances.hpp>
