/**
 * @file tier.cuh
 * @brief Device backend of tiered injection (tier.hpp): the resident facts of a step in one
 * all-layer launch, the facts staged from the pinned host tier layer by layer, each layer's launch
 * waiting on the compute stream for its copy event, so copies overlap injection and the host never
 * waits.
 */
#pragma once

#include <inferscale/inject.cuh>
#include <inferscale/tier.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace inferscale {

/**
 * @brief Writes `batch` (built against `tiers.device_tier()` after `admit` returned `request`)
 * into `cache` (device memory).
 *
 * Enqueues, without waiting: (if not done yet) the request's copies on `copy_stream` after
 * everything already on `stream` (tiered_store::stage_async); the split batch's arrays into
 * `workspace` on `stream`; one all-layer launch for the tokens of resident facts; then per layer
 * `l` a wait on the copy event of layer `l` and a one-layer launch for the staged tokens.
 * Work enqueued on `stream` afterwards sees every staged fact (its copies are ordered before the
 * last launch); work on another stream must wait on an event recorded on `stream`. Last, the
 * tier's compute-stream event is recorded on `stream` (tiered_store::mark_injected), which
 * tiered_store::evict waits for before it frees the pages.
 *
 * @throw logic_error as the device run (injection_batch::run), if the batch holds cache adapters
 *        (they commit only through injection_batch::run), or if the request is stale (nothing is
 *        enqueued then); cuda_error on a CUDA failure.
 * @note `workspace` holds the split arrays: at least `batch.num_tokens()` tokens; its device
 *       error counters (injection_workspace::read_errors) count what the launches skipped.
 */
template <class Rotation>
void inject_tiered_async(tiered_store& tiers,
                         tier_request& request,
                         injection_batch const& batch,
                         paged_kv_cache const& cache,
                         Rotation const& rotation,
                         injection_workspace& workspace,
                         cuda::stream_ref stream,
                         cudaStream_t copy_stream)
{
  char const* const who = "inject_tiered_async";
  kv_store const& store = tiers.device_tier();
  INFERSCALE_EXPECTS(batch.num_pending_commits() == 0,
                     std::string{who} + ": the batch holds cache adapters, which commit only "
                                        "through injection_batch::run");
  batch.check_target(cache, who);
  detail::check_injection(store, batch, cache, rotation, memory_space::device, who);
  INFERSCALE_EXPECTS(batch.num_tokens() <= workspace.capacity(),
                     std::string{who} + ": the batch has " + std::to_string(batch.num_tokens()) +
                       " tokens, the workspace holds " + std::to_string(workspace.capacity()));
  tier_split_batch const split = tiers.split(request, batch, who);
  if (!request.copies_issued) { tiers.stage_async(request, copy_stream, stream.get()); }
  workspace.stage(injection_batch_view{split.store_token.data(),
                                       split.position.data(),
                                       split.slot.data(),
                                       split.num_tokens()},
                  stream);
  injection_batch_view const all = workspace.view();
  kv_store_ref const ref         = store.ref();
  if (split.resident > 0) {
    inject_async(ref, injection_batch_view{all.store_token, all.position, all.slot, split.resident},
                 cache, rotation, workspace.device_errors(), stream);
  }
  std::int64_t const staged = split.num_tokens() - split.resident;
  if (staged == 0) {
    workspace.mark_used(stream);
    tiers.mark_injected(stream.get());  // evict() waits for this, not for the device
    return;
  }
  injection_batch_view const tail{all.store_token + split.resident,
                                  all.position + split.resident,
                                  all.slot + split.resident,
                                  staged};
  for (std::int32_t l = 0; l < ref.num_layers; ++l) {
    INFERSCALE_CUDA_TRY(cudaStreamWaitEvent(stream.get(), tiers.layer_ready(l), 0));
    // A bad token would be skipped by every layer's launch: only the first one counts it.
    inject_async(tier_layer_view(ref, l), tail, tier_cache_layer(cache, l), rotation,
                 l == 0 ? workspace.device_errors() : nullptr, stream);
  }
  workspace.mark_used(stream);
  tiers.mark_injected(stream.get());  // evict() waits for this, not for the device
}

}  // namespace inferscale
