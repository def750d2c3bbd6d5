// The device index's RAFT select_k instance, compiled once for this build's RAFT targets (tests,
// benchmarks, examples): include/inferscale/instances.cuh. Every target that uses it is compiled
// with INFERSCALE_EXTERN_DEVICE_INSTANCES (cmake/targets.cmake, inferscale_target_defaults RAFT).
#include <inferscale/instances.cuh>
