/**
 * @file inject.hpp
 * @brief Injection, host backend: stored pre-RoPE facts -> an engine's paged KV cache, keys rotated
 * to their virtual positions, by the injection step's host run (injection_batch::run(cache,
 * rotation), defined here). The parts: the step (injection_batch.hpp), the checks, the scalar
 * loop, the vector paths and the dispatch (detail/inject/); extraction, the inverse, is
 * extract.hpp.
 *
 * Flow: compose() a plan per request, add each plan with its slots (a span, a block table, or a
 * cache adapter) to one injection_batch per scheduler step, then run it: run(cache, rotation)
 * here, or run(cache, rotation, device) with a device_context on the device (inject.cuh).
 * Everything is validated before the first write; a refused run leaves the store, the cache and the
 * adapters unchanged.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/checks.hpp>
#include <inferscale/detail/inject/host_dispatch.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/rope_layers.hpp>
#include <inferscale/store.hpp>

namespace inferscale {

namespace detail {
/// @brief The host run's body (injection_batch::run): every check, then the write.
template <class Rotation>
void inject_batch_host(kv_store const& store,
                       injection_batch const& batch,
                       paged_kv_cache const& cache,
                       Rotation const& rotation,
                       char const* who)
{
  batch.check_target(cache, who);
  check_injection(store, batch, cache, rotation, memory_space::host, who);
  inject_host_view(store.ref(), batch.host_view(), cache, rotation);
}
}  // namespace detail

template <class Rotation>
void injection_batch::run(paged_kv_cache const& cache, Rotation const& rotation)
{
  run_and_commit(
    [&] { detail::inject_batch_host(store(), *this, cache, rotation, "injection_batch::run"); });
}

}  // namespace inferscale

#include <inferscale/detail/inject/instances.hpp>
#if defined(INFERSCALE_EXTERN_TEMPLATES)
// Compiled once, in the program's unit that includes <inferscale/instances.hpp>.
INFERSCALE_INJECT_HOST_INSTANCES(extern)
#endif
