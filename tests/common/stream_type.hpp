// The CUDA runtime's stream type as the tests name it: the toolkit's cudaStream_t, or in the
// CPU-only build (INFERSCALE_WITH_CUDA=OFF, INFERSCALE_HOST_ONLY) the headers' stand-in
// (detail/cuda_runtime.hpp), which lives in namespace inferscale and which a toolkit's runtime
// header, included by CCCL where one is installed, does not replace (an unqualified cudaStream_t
// outside namespace inferscale would then be ambiguous).
#pragma once

#include <inferscale/cuda_error.hpp>

namespace inferscale_test {

#if INFERSCALE_HAS_CUDA_RUNTIME
using stream_t = cudaStream_t;
#else
using stream_t = inferscale::detail::host_only_runtime::cudaStream_t;
#endif

}  // namespace inferscale_test
