// The device path of inferscale_vllm._inferscale (built with INFERSCALE_VLLM_CUDA=ON): the one
// piece that needs nvcc — the injection step's device run (inject.cuh) and its staging workspace —
// behind a plain C++ interface, so bindings.cpp (nanobind) stays a host C++ translation unit.
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <cstdint>
#include <memory>
#include <variant>

namespace inferscale_vllm {

/// The engine's cos/sin table, in the element type vLLM keeps it.
using rotation_table = std::variant<inferscale::rope_cos_sin_table<float>,
                                    inferscale::rope_cos_sin_table<inferscale::bfloat16_t>,
                                    inferscale::rope_cos_sin_table<inferscale::half_t>>;

/**
 * @brief Owns the device staging of injection batches (grown to the largest batch seen) and runs
 * the injection step's checked device run on a caller's stream.
 */
class device_injector {
 public:
  device_injector();
  ~device_injector();
  device_injector(device_injector&&) noexcept;
  device_injector& operator=(device_injector&&) noexcept;
  device_injector(device_injector const&)            = delete;
  device_injector& operator=(device_injector const&) = delete;

  /**
   * @brief batch.run(cache, rotation, device_context{workspace, stream}) (the device run):
   * validates everything on the host (store in device memory, geometry, slots within the cache,
   * positions within the table), stages the batch and launches on `stream` (a cudaStream_t as an
   * integer; 0 = the legacy default stream). Never waits for the kernel.
   * @throw inferscale::logic_error on a refusal (nothing staged or launched);
   *        inferscale::cuda_error on a CUDA failure.
   */
  void inject(inferscale::injection_batch& batch,
              inferscale::paged_kv_cache const& cache,
              rotation_table const& rotation,
              std::uintptr_t stream);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace inferscale_vllm
