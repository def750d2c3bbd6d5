/**
 * @file tier.cuh
 * @brief Device run of a tiered step (tiered_store::run with a device_context, tier.hpp): the
 * resident facts of a step in one all-layer launch, the facts staged from the pinned host tier
 * layer by layer, each layer's launch waiting on the compute stream for its copy event, so copies
 * overlap injection and the host never waits.
 */
#pragma once

#include <inferscale/inject.cuh>
#include <inferscale/tier.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace inferscale {

template <class Rotation>
void tiered_store::run(tier_request& request,
                       injection_batch const& batch,
                       paged_kv_cache const& cache,
                       Rotation const& rotation,
                       device_context const& device)
{
  char const* const who = "tiered_store::run";
  kv_store const& store = device_;
  INFERSCALE_EXPECTS(device.workspace() != nullptr,
                     std::string{who} +
                       ": the device context has no injection workspace (the device run stages "
                       "the step's arrays through one: device_context{workspace, stream})");
  injection_workspace& workspace = *device.workspace();
  cuda::stream_ref const stream  = device.stream();
  INFERSCALE_EXPECTS(batch.num_pending_commits() == 0,
                     std::string{who} +
                       ": the batch holds cache adapters, which commit only "
                       "through injection_batch::run");
  batch.check_target(cache, who);
  detail::check_injection(store, batch, cache, rotation, memory_space::device, who);
  INFERSCALE_EXPECTS(batch.num_tokens() <= workspace.capacity(),
                     std::string{who} + ": the batch has " + std::to_string(batch.num_tokens()) +
                       " tokens, the workspace holds " + std::to_string(workspace.capacity()));
  tier_split_batch const split = this->split(request, batch, who);
  if (!request.copies_issued) { stage_async(request, device.copy_stream().get(), stream.get()); }
  workspace.stage(
    injection_batch_view{
      split.store_token.data(), split.position.data(), split.slot.data(), split.num_tokens()},
    stream);
  injection_batch_view const all = workspace.view();
  kv_store_ref const ref         = store.ref();
  if (split.resident > 0) {
    detail::inject_view_async(
      ref,
      injection_batch_view{all.store_token, all.position, all.slot, split.resident},
      cache,
      rotation,
      workspace.device_errors(),
      stream);
  }
  std::int64_t const staged = split.num_tokens() - split.resident;
  if (staged > 0) {
    injection_batch_view const tail{all.store_token + split.resident,
                                    all.position + split.resident,
                                    all.slot + split.resident,
                                    staged};
    for (std::int32_t l = 0; l < ref.num_layers; ++l) {
      INFERSCALE_CUDA_TRY(cudaStreamWaitEvent(stream.get(), layer_ready(l), 0));
      // A bad token would be skipped by every layer's launch: only the first one counts it.
      detail::inject_view_async(tier_layer_view(ref, l),
                                tail,
                                tier_cache_layer(cache, l),
                                rotation,
                                l == 0 ? workspace.device_errors() : nullptr,
                                stream);
    }
  }
  workspace.mark_used(stream);
  mark_injected(stream.get());  // evict() waits for this, not for the device
}

}  // namespace inferscale
