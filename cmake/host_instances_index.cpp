// The fact index (graph_index's members and the host search, for float and half_t vectors),
// compiled once for this build's tests, benchmarks and examples beside host_instances_loops.cpp
// (include/inferscale/instances.hpp defines the same in a user's program). Every target that
// uses it is compiled with INFERSCALE_EXTERN_TEMPLATES, where index.hpp only declares them.
#include <inferscale/detail/index/definitions.inl>

INFERSCALE_INDEX_INSTANCES()
