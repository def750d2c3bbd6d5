/**
 * @file detail/tier/staging.inl
 * @brief Definitions for tier.hpp, staging of host-resident facts into the device tier: copy runs,
 * the host copies (whole runs or per layer), the device copies (one cudaMemcpy2DAsync per layer
 * and run, one event per layer), the batch split for tiered injection, and the events (which
 * wait_device synchronises on, instead of the whole device).
 */
#pragma once

#include <inferscale/cuda_error.hpp>  // the CUDA runtime, or its CPU-only stand-in

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

namespace inferscale {

inline void tiered_store::stage_host(tier_request& r)
{
  INFERSCALE_EXPECTS(config_.device.space == memory_space::host,
                     "tiered_store::stage_host: the device tier is in device memory; use "
                     "stage_async");
  // Whole runs: every layer of consecutive pages is one contiguous block in both pools.
  std::size_t const page_bytes = page_bytes_();
  auto* const dst              = static_cast<unsigned char*>(device_.ref().pool);
  auto const* const src        = static_cast<unsigned char const*>(host_.ref().pool);
  for (tier_copy_run const& run : r.runs) {
    std::memcpy(dst + static_cast<std::size_t>(run.device_page) * page_bytes,
                src + static_cast<std::size_t>(run.host_page) * page_bytes,
                static_cast<std::size_t>(run.pages) * page_bytes);
  }
  r.copies_issued = true;
}

inline void tiered_store::stage_async(tier_request& r,
                                      cudaStream_t copy_stream,
                                      cudaStream_t compute_stream)
{
  INFERSCALE_EXPECTS(config_.device.space == memory_space::device,
                     "tiered_store::stage_async: the tiers are in host memory; use stage_host");
  INFERSCALE_EXPECTS(!r.copies_issued, "tiered_store::stage_async: copies already issued");
  INFERSCALE_CUDA_TRY(cudaEventRecord(compute_mark_, compute_stream));
  INFERSCALE_CUDA_TRY(cudaStreamWaitEvent(copy_stream, compute_mark_, 0));
  std::size_t const page_bytes  = page_bytes_();
  std::size_t const layer_bytes = page_bytes / static_cast<std::size_t>(layers());
  auto* const dst               = static_cast<unsigned char*>(device_.ref().pool);
  auto const* const src         = static_cast<unsigned char const*>(host_.ref().pool);
  for (std::int32_t l = 0; l < layers(); ++l) {
    for (tier_copy_run const& run : r.runs) {
      INFERSCALE_CUDA_TRY(
        cudaMemcpy2DAsync(dst + static_cast<std::size_t>(run.device_page) * page_bytes +
                            static_cast<std::size_t>(l) * layer_bytes,
                          page_bytes,
                          src + static_cast<std::size_t>(run.host_page) * page_bytes +
                            static_cast<std::size_t>(l) * layer_bytes,
                          page_bytes,
                          layer_bytes,
                          static_cast<std::size_t>(run.pages),
                          cudaMemcpyHostToDevice,
                          copy_stream));
    }
    INFERSCALE_CUDA_TRY(cudaEventRecord(copy_done_[static_cast<std::size_t>(l)], copy_stream));
  }
  r.copies_issued = true;
}

inline cudaEvent_t tiered_store::layer_ready(std::int32_t l) const noexcept
{
  return copy_done_[static_cast<std::size_t>(l)];
}

inline void tiered_store::copy_layer_host(tier_request const& r, std::int32_t l)
{
  std::size_t const page_bytes  = page_bytes_();
  std::size_t const layer_bytes = page_bytes / static_cast<std::size_t>(layers());
  auto* const dst               = static_cast<unsigned char*>(device_.ref().pool);
  auto const* const src         = static_cast<unsigned char const*>(host_.ref().pool);
  for (tier_copy_run const& run : r.runs) {
    for (std::int64_t p = 0; p < run.pages; ++p) {
      std::memcpy(dst + static_cast<std::size_t>(run.device_page + p) * page_bytes +
                    static_cast<std::size_t>(l) * layer_bytes,
                  src + static_cast<std::size_t>(run.host_page + p) * page_bytes +
                    static_cast<std::size_t>(l) * layer_bytes,
                  layer_bytes);
    }
  }
}

inline tier_split_batch tiered_store::split(tier_request const& r,
                                            injection_batch const& batch,
                                            char const* who) const
{
  INFERSCALE_EXPECTS(&batch.store() == &device_,
                     std::string{who} + ": the batch was not built against device_tier()");
  batch.check_store(who);
  INFERSCALE_EXPECTS(
    r.store_identity == device_.identity() && r.device_version == device_.version(),
    std::string{who} + ": the device tier changed since this request was admitted; admit again");
  std::unordered_set<std::int64_t> staged_pages;
  for (tier_copy_run const& run : r.runs) {
    for (std::int64_t p = 0; p < run.pages; ++p) {
      staged_pages.insert(run.device_page + p);
    }
  }
  kv_store_ref const ref = device_.ref();
  tier_split_batch out;
  std::int64_t const n = batch.num_tokens();
  out.store_token.reserve(static_cast<std::size_t>(n));
  out.position.reserve(static_cast<std::size_t>(n));
  out.slot.reserve(static_cast<std::size_t>(n));
  for (int pass = 0; pass < 2; ++pass) {
    for (std::int64_t j = 0; j < n; ++j) {
      std::int64_t const t = batch.store_tokens()[static_cast<std::size_t>(j)];
      bool const staged    = staged_pages.count(t / ref.page_size) != 0;
      if (staged != (pass == 1)) { continue; }
      out.store_token.push_back(staged ? tier_layer_token(ref, t) : t);
      out.position.push_back(batch.positions()[static_cast<std::size_t>(j)]);
      out.slot.push_back(batch.slots()[static_cast<std::size_t>(j)]);
    }
    if (pass == 0) { out.resident = out.num_tokens(); }
  }
  return out;
}

inline std::size_t tiered_store::page_bytes_() const noexcept { return device_.page_bytes(); }

inline void tiered_store::append_runs(std::vector<tier_copy_run>& runs,
                                      std::vector<std::int64_t> const& host_pages,
                                      std::vector<std::int64_t> const& device_pages)
{
  for (std::size_t i = 0; i < host_pages.size(); ++i) {
    if (!runs.empty()) {
      tier_copy_run& last = runs.back();
      if (last.host_page + last.pages == host_pages[i] &&
          last.device_page + last.pages == device_pages[i]) {
        ++last.pages;
        continue;
      }
    }
    runs.push_back({host_pages[i], device_pages[i], 1});
  }
}

inline void tiered_store::copy_pages(fact_record const& device_fact,
                                     fact_record const& host_fact,
                                     bool to_device)
{
  std::size_t const page_bytes = page_bytes_();
  auto* const dpool            = static_cast<unsigned char*>(device_.ref().pool);
  auto* const hpool            = static_cast<unsigned char*>(host_.ref().pool);
  for (std::size_t i = 0; i < device_fact.pages.size(); ++i) {
    unsigned char* const d = dpool + static_cast<std::size_t>(device_fact.pages[i]) * page_bytes;
    unsigned char* const h = hpool + static_cast<std::size_t>(host_fact.pages[i]) * page_bytes;
    if (config_.device.space == memory_space::device) {
      INFERSCALE_CUDA_TRY(to_device ? cudaMemcpy(d, h, page_bytes, cudaMemcpyHostToDevice)
                                    : cudaMemcpy(h, d, page_bytes, cudaMemcpyDeviceToHost));
    } else {
      std::memcpy(to_device ? d : h, to_device ? h : d, page_bytes);
    }
  }
}

inline void tiered_store::stage_now(tier_request& r)
{
  if (config_.device.space == memory_space::host) {
    stage_host(r);
    return;
  }
  for (std::uint64_t id : r.staged) {
    copy_pages(device_.at(id), host_.at(id), /*to_device=*/true);
  }
  r.copies_issued = true;
}

inline void tiered_store::mark_injected(cudaStream_t compute_stream)
{
  if (config_.device.space != memory_space::device) { return; }
  INFERSCALE_CUDA_TRY(cudaEventRecord(compute_mark_, compute_stream));
}

inline void tiered_store::wait_device()
{
  if (config_.device.space != memory_space::device) { return; }
  // The tier's own device work, not the whole device: the last staging's copies (one event per
  // layer, recorded in order on the copy stream) and the compute-stream mark, recorded by
  // stage_async and again after the last launch of the device run (mark_injected). An
  // event never recorded completes at once.
  for (cudaEvent_t e : copy_done_) {
    if (e) { INFERSCALE_CUDA_TRY(cudaEventSynchronize(e)); }
  }
  if (compute_mark_) { INFERSCALE_CUDA_TRY(cudaEventSynchronize(compute_mark_)); }
}

inline void tiered_store::create_events()
{
  if (config_.device.space != memory_space::device) { return; }
  try {
    copy_done_.assign(static_cast<std::size_t>(device_.geometry().num_layers), nullptr);
    for (auto& e : copy_done_) {
      INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&compute_mark_, cudaEventDisableTiming));
  } catch (...) {
    release_events();
    throw;
  }
}

inline void tiered_store::release_events() noexcept
{
  for (auto& e : copy_done_) {
    if (e) { (void)cudaEventDestroy(e); }
  }
  copy_done_.clear();
  if (compute_mark_) { (void)cudaEventDestroy(compute_mark_); }
  compute_mark_ = nullptr;
}

}  // namespace inferscale
