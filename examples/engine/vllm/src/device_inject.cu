// See device_inject.hpp. Compiled by nvcc only when the package is built with INFERSCALE_VLLM_CUDA.
#include "device_inject.hpp"

#include <inferscale/inject.cuh>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace inferscale_vllm {

struct device_injector::impl {
  std::optional<inferscale::injection_workspace> workspace;
};

device_injector::device_injector() : impl_{std::make_unique<impl>()} {}
device_injector::~device_injector()                                     = default;
device_injector::device_injector(device_injector&&) noexcept            = default;
device_injector& device_injector::operator=(device_injector&&) noexcept = default;

void device_injector::inject(inferscale::injection_batch& batch,
                             inferscale::paged_kv_cache const& cache,
                             rotation_table const& rotation,
                             std::uintptr_t stream)
{
  cuda::stream_ref const s{reinterpret_cast<cudaStream_t>(stream)};
  std::int64_t const n = batch.num_tokens();
  if (!impl_->workspace || impl_->workspace->capacity() < n) {
    // Grown before the checks run: allocation changes nothing the caller can see. Freeing the old
    // workspace (cudaFree) waits for the kernels that may still read it.
    std::int64_t const capacity =
      std::max<std::int64_t>(n, impl_->workspace ? 2 * impl_->workspace->capacity() : 256);
    impl_->workspace.reset();
    impl_->workspace.emplace(capacity);
  }
  inferscale::device_context const device{*impl_->workspace, s};
  std::visit([&](auto const& table) { batch.run(cache, table, device); }, rotation);
}

}  // namespace inferscale_vllm
