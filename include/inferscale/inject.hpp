/**
 * @file inject.hpp
 * @brief Injection, host backend: stored pre-RoPE facts -> an engine's paged KV cache, keys rotated
 * to their virtual positions. The parts: the batch (injection_batch.hpp), the checks, the scalar
 * loop, the vector paths and the dispatch (detail/inject/); extraction, the inverse, is
 * extract.hpp (included here too).
 *
 * Flow: compose() a plan per request, add each plan with its slots to an injection_batch (which
 * resolves every token to its store page and checks the slots), then inject_host() (or
 * inject_async() on the device). Everything is validated before the first write; a refused call
 * leaves the store and the cache unchanged.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/checks.hpp>
#include <inferscale/detail/inject/host_dispatch.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

namespace inferscale {

/**
 * @brief Host backend: writes every token of `batch` into `cache` (host memory): the key read from
 * the store, rotated to the token's virtual position by `rotation`, scaled and converted to the
 * cache dtype; the value scaled and converted. Tokens with a negative slot are skipped.
 *
 * @param store    a host-memory store (the batch's)
 * @param batch    the step's validated work
 * @param cache    the engine's cache for the store's shard (same layers, heads, head_dim)
 * @param rotation rope_params, or the engine's rope_cos_sin_table (host data)
 * @throw logic_error if the batch is stale or for another store, the store is not in host memory,
 *        geometries differ, a slot is beyond the cache or a position beyond the table; nothing is
 *        written then.
 */
template <class Rotation>
void inject_host(kv_store const& store,
                 injection_batch const& batch,
                 paged_kv_cache const& cache,
                 Rotation const& rotation)
{
  detail::check_injection(store, batch, cache, rotation, memory_space::host, "inject_host");
  detail::inject_host_view(store.ref(), batch.host_view(), cache, rotation);
}

}  // namespace inferscale

#include <inferscale/extract.hpp>  // extraction (the inverse) was declared here before the split

#include <inferscale/detail/inject/instances.hpp>
#if defined(INFERSCALE_EXTERN_TEMPLATES)
// Compiled once, in the program's unit that includes <inferscale/instances.hpp>.
INFERSCALE_HOST_INSTANCES(extern)
#endif
