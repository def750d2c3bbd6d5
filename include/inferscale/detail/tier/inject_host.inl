/**
 * @file detail/tier/inject_host.inl
 * @brief Definition for tier.hpp, the host run of a tiered step (tiered_store::run).
 */
#pragma once

#include <cstdint>
#include <string>

namespace inferscale {

template <class Rotation>
void tiered_store::run(tier_request& request,
                       injection_batch const& batch,
                       paged_kv_cache const& cache,
                       Rotation const& rotation,
                       tier_host_order order)
{
  char const* const who = "tiered_store::run";
  kv_store const& store = device_;
  tiered_store& tiers   = *this;
  INFERSCALE_EXPECTS(batch.num_pending_commits() == 0,
                     std::string{who} +
                       ": the batch holds cache adapters, which commit only "
                       "through injection_batch::run");
  batch.check_target(cache, who);
  detail::check_injection(store, batch, cache, rotation, memory_space::host, who);
  tier_split_batch const split = tiers.split(request, batch, who);
  kv_store_ref const ref       = store.ref();
  // Each write goes through inject_host_view (the dtypes dispatched there: compiled once under
  // INFERSCALE_EXTERN_TEMPLATES, see instances.hpp).
  if (order == tier_host_order::whole) {
    if (!request.copies_issued) { tiers.stage_host(request); }
    detail::inject_host_view(ref, batch.host_view(), cache, rotation);
  } else {
    if (split.resident > 0) {
      detail::inject_host_view(ref, split.resident_view(), cache, rotation);
    }
    injection_batch_view const staged = split.staged_view();
    for (std::int32_t l = 0; l < ref.num_layers; ++l) {
      if (!request.copies_issued) { tiers.copy_layer_host(request, l); }
      if (staged.num_tokens > 0) {
        detail::inject_host_view(
          tier_layer_view(ref, l), staged, tier_cache_layer(cache, l), rotation);
      }
    }
  }
  request.copies_issued = true;
}

}  // namespace inferscale
