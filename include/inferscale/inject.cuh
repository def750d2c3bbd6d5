/**
 * @file inject.cuh
 * @brief Device backend of injection and extraction: one fused launch per scheduler step writes
 * every admitted request's memory tokens, all layers of the shard, into the engine's paged cache.
 *
 * The step's device run, injection_batch::run(cache, rotation, device) with a device_context
 * (device_context.hpp: its workspace and stream), is defined here: it validates the host step
 * completely (as the host run does), stages its arrays into the workspace, launches, then commits
 * the step's cache adapters. Below it, detail::inject_view_async is the launch itself on device
 * arrays (no allocation, no host synchronisation, nothing read on the host): tokens whose device
 * slot lies outside the cache, whose position lies outside the table or whose store token lies
 * outside the pool, and rows whose fp8 scale is not positive and finite, are skipped and counted
 * in the workspace's inject_device_errors: the device cannot throw.
 *
 * The run dispatches on the store's and the cache's element types at run time, which compiles the
 * kernel for every pair (15 per rotation type). A program that knows its pair names it,
 * `step.run<bfloat16_t, bfloat16_t>(cache, rotation, device)`: the same checks, plus the two
 * types' (a mismatch is refused before anything is staged), and only that pair's kernels are
 * compiled.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/inject/kernels.cuh>
#include <inferscale/detail/inject/tuning.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/device_context.hpp>
#include <inferscale/extract.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/memory_resource.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace inferscale {

/**
 * @brief Device arrays (and pinned host staging) for the flattened work of injection batches of up
 * to `capacity` tokens. Allocated once; move-only.
 */
class injection_workspace {
 public:
  /**
   * @brief Allocates room for `capacity` tokens: the device arrays from `device_resource` (null:
   * cudaMalloc), the host staging from `pinned_resource` (null: cudaMallocHost), both on the null
   * stream. The resources are not owned and must outlive the workspace.
   * @throw logic_error if `capacity` is negative; cuda_error if allocation fails.
   */
  explicit injection_workspace(std::int64_t capacity,
                               memory_resource* device_resource = nullptr,
                               memory_resource* pinned_resource = nullptr)
    : capacity_{checked_capacity(capacity)},
      device_{3 * static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)),
              nullptr,
              device_resource},
      host_{3 * static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)),
            nullptr,
            pinned_resource != nullptr ? pinned_resource : pinned_host_resource()},
      errors_{1, nullptr, device_resource}
  {
    INFERSCALE_CUDA_TRY(cudaMemset(errors_.data(), 0, sizeof(inject_device_errors)));
    INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming));
    cudaError_t const e = cudaEventCreateWithFlags(&used_, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      (void)cudaEventDestroy(staged_);
      INFERSCALE_CUDA_TRY(e);
    }
  }
  ~injection_workspace()
  {
    // A stream-ordered resource frees on the allocation stream: after the last marked reader.
    if (used_recorded_) { (void)cudaStreamWaitEvent(device_.stream(), used_, 0); }
    if (staged_) { (void)cudaEventDestroy(staged_); }
    if (used_) { (void)cudaEventDestroy(used_); }
  }
  injection_workspace(injection_workspace&& o) noexcept
    : capacity_{std::exchange(o.capacity_, 0)},
      count_{std::exchange(o.count_, 0)},
      device_{std::move(o.device_)},
      host_{std::move(o.host_)},
      staged_{std::exchange(o.staged_, nullptr)},
      used_{std::exchange(o.used_, nullptr)},
      used_recorded_{std::exchange(o.used_recorded_, false)},
      errors_{std::move(o.errors_)}
  {
  }
  injection_workspace& operator=(injection_workspace&& o) noexcept
  {
    if (this != &o) {
      injection_workspace tmp{std::move(o)};
      std::swap(capacity_, tmp.capacity_);
      std::swap(count_, tmp.count_);
      device_.swap(tmp.device_);
      host_.swap(tmp.host_);
      std::swap(staged_, tmp.staged_);
      std::swap(used_, tmp.used_);
      std::swap(used_recorded_, tmp.used_recorded_);
      errors_.swap(tmp.errors_);
    }
    return *this;
  }
  injection_workspace(injection_workspace const&)            = delete;
  injection_workspace& operator=(injection_workspace const&) = delete;

  std::int64_t capacity() const noexcept { return capacity_; }

  /**
   * @brief Copies a batch's arrays to the device on `stream` (through pinned memory).
   * @throw logic_error if the batch exceeds the capacity (nothing is copied).
   * @note Waits only if the previous staging's copy has not finished yet (the pinned buffer is
   *       reused). On the device, the copy also waits for the work marked with mark_used() (the
   *       library's own launches mark themselves), on whatever stream it ran: a launch still
   *       reading the previous arrays on another stream is never overwritten.
   */
  void stage(injection_batch const& batch, cuda::stream_ref stream)
  {
    stage(batch.host_view(), stream);
  }

  /**
   * @brief Copies three host arrays (store tokens, positions, slots) to the device on `stream`, as
   * stage(batch) does; for callers that build the arrays themselves (tiered injection).
   * @throw logic_error if the arrays exceed the capacity or a pointer is null (nothing copied).
   */
  void stage(injection_batch_view const& host_arrays, cuda::stream_ref stream)
  {
    std::int64_t const n = host_arrays.num_tokens;
    INFERSCALE_EXPECTS(n >= 0 && n <= capacity_,
                       "injection_workspace: the batch has " + detail::count_of(n, "token") +
                         ", the workspace holds " + std::to_string(capacity_));
    INFERSCALE_EXPECTS(n == 0 || (host_arrays.store_token != nullptr &&
                                  host_arrays.position != nullptr && host_arrays.slot != nullptr),
                       std::string{"injection_workspace: null host array"});
    INFERSCALE_CUDA_TRY(cudaEventSynchronize(staged_));
    // the device arrays are overwritten only after the last marked reader of them (any stream)
    if (used_recorded_) { INFERSCALE_CUDA_TRY(cudaStreamWaitEvent(stream.get(), used_, 0)); }
    std::size_t const bytes = static_cast<std::size_t>(n) * sizeof(std::int64_t);
    if (n > 0) {
      std::memcpy(host_.data(), host_arrays.store_token, bytes);
      std::memcpy(host_.data() + capacity_, host_arrays.position, bytes);
      std::memcpy(host_.data() + 2 * capacity_, host_arrays.slot, bytes);
      for (int a = 0; a < 3; ++a) {
        INFERSCALE_CUDA_TRY(cudaMemcpyAsync(device_.data() + a * capacity_,
                                            host_.data() + a * capacity_,
                                            bytes,
                                            cudaMemcpyHostToDevice,
                                            stream.get()));
      }
    }
    INFERSCALE_CUDA_TRY(cudaEventRecord(staged_, stream.get()));
    count_ = n;
  }

  /**
   * @brief The device counters the device run (injection_batch::run) passes to its kernel; they
   * accumulate over launches until reset_errors_async().
   */
  inject_device_errors* device_errors() const noexcept { return errors_.data(); }

  /// @brief Zeroes the device counters on `stream`. Never waits.
  void reset_errors_async(cuda::stream_ref stream)
  {
    INFERSCALE_CUDA_TRY(
      cudaMemsetAsync(errors_.data(), 0, sizeof(inject_device_errors), stream.get()));
  }

  /// @brief Copies the device counters to the host. @note Waits for `stream`.
  inject_device_errors read_errors(cuda::stream_ref stream) const
  {
    inject_device_errors out{};
    INFERSCALE_CUDA_TRY(
      cudaMemcpyAsync(&out, errors_.data(), sizeof out, cudaMemcpyDeviceToHost, stream.get()));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    return out;
  }

  /**
   * @brief Marks the work enqueued so far on `stream` as reading the staged arrays: the next
   * stage(), on any stream, waits for it on the device before overwriting them. The device runs
   * (injection_batch::run, tiered_store::run) call it after their launches; a caller that
   * launches its own kernels on view() calls it after them. Never waits.
   */
  void mark_used(cuda::stream_ref stream)
  {
    INFERSCALE_CUDA_TRY(cudaEventRecord(used_, stream.get()));
    used_recorded_ = true;
  }

  /// @brief The staged arrays (device memory), valid for kernels enqueued after stage().
  injection_batch_view view() const noexcept
  {
    std::int64_t* const d = device_.data();
    return {d, d + capacity_, d + 2 * capacity_, count_};
  }

  /// @brief The same arrays with an explicit token count (e.g. for a captured graph).
  injection_batch_view view(std::int64_t num_tokens) const noexcept
  {
    std::int64_t* const d = device_.data();
    return {d, d + capacity_, d + 2 * capacity_, num_tokens};
  }

 private:
  static std::int64_t checked_capacity(std::int64_t capacity)
  {
    INFERSCALE_EXPECTS(
      capacity >= 0,
      "injection_workspace: capacity must be non-negative, got " + std::to_string(capacity));
    return capacity;
  }

  std::int64_t capacity_{};
  std::int64_t count_{};
  device_buffer<std::int64_t> device_;  ///< [3][capacity]: store tokens, positions, slots
  device_buffer<std::int64_t> host_;    ///< the same, pinned host staging
  cudaEvent_t staged_{};
  cudaEvent_t used_{};
  bool used_recorded_{false};
  device_buffer<inject_device_errors> errors_;
};

namespace detail {

/// @brief Refuses a store or cache whose element type is not the pair a typed call names
/// (`what<StoreT, CacheT>`); a call naming no pair (both void) accepts any.
template <class StoreT, class CacheT>
void check_dtype_pair(dtype store, dtype cache, char const* what)
{
  static_assert(std::is_void_v<StoreT> == std::is_void_v<CacheT>,
                "name both element types (StoreT, CacheT), or neither");
  if constexpr (!std::is_void_v<StoreT>) {
    INFERSCALE_EXPECTS(store == dtype_of_v<StoreT> && cache == dtype_of_v<CacheT>,
                       std::string{what} + "<" + to_string(dtype_of_v<StoreT>) + ", " +
                         to_string(dtype_of_v<CacheT>) + ">: the store holds " + to_string(store) +
                         " and the cache " + to_string(cache));
  }
}

/// @brief Launches inject_kernel as make_inject_launch (detail/inject/block.hpp) resolves it.
template <class StoreT, class CacheT, class Rotation>
void inject_launch(kv_store_ref const& store,
                   injection_batch_view const& batch,
                   paged_kv_cache const& cache,
                   Rotation const& rotation,
                   inject_device_errors* errors,
                   cuda::stream_ref stream)
{
  using policy = inject_policy_sm90;
  if (batch.num_tokens == 0) { return; }
  int device = 0, sm_count = 0;
  INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
  INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  auto const config =
    make_inject_launch<StoreT, CacheT>(store, batch, cache, rotation, sm_count, errors);
  dim3 const grid{static_cast<unsigned>(config.grid_x), static_cast<unsigned>(config.grid_y)};
  using kernel_rotation = kernel_rotation_t<Rotation>;  // a per_layer_rotation by value
  if (config.vectorized) {
    inject_kernel<policy, StoreT, CacheT, kernel_rotation, true>
      <<<grid, policy::block_threads, config.shared_bytes, stream.get()>>>(config.args);
  } else {
    inject_kernel<policy, StoreT, CacheT, kernel_rotation, false>
      <<<grid, policy::block_threads, config.shared_bytes, stream.get()>>>(config.args);
  }
  INFERSCALE_CHECK_LAUNCH();
}

/**
 * @brief extract_kernel's grid: x covers one token's units (32-bit; checked), y strides over the
 * tokens (at most 65,535 rows, and about 2^20 blocks in all).
 */
template <class Policy, class Rotation>
dim3 extract_grid(extract_kernel_args<Rotation> const& args)
{
  std::int64_t const per_token = extract_units_per_token(args);
  INFERSCALE_EXPECTS(per_token <= std::int64_t{0x7fffffff},
                     "extract: " + std::to_string(per_token) +
                       " units per token (layers x heads x dims) exceed the kernel's 32-bit index");
  std::int64_t const x =
    std::max<std::int64_t>(detail::ceil_div(per_token, Policy::extract_threads), 1);
  std::int64_t const y = std::clamp<std::int64_t>(
    std::min<std::int64_t>(args.tokens.num_tokens, (std::int64_t{1} << 20) / x), 1, 65535);
  return dim3{static_cast<unsigned>(x), static_cast<unsigned>(y)};
}

}  // namespace detail

namespace detail {
/**
 * @brief The device launch under the runs: writes every token of `batch` (device arrays) into
 * `cache` (device memory), keys rotated to their positions, in one launch for all layers of the
 * shard. Used by injection_batch::run and tiered_store::run (after their host checks); the
 * library's tests and benchmarks time and check the kernel through it.
 *
 * @param store    the store's ref (device pool)
 * @param batch    device arrays of store tokens, positions and slots (e.g. injection_workspace)
 * @param cache    the engine's cache for the store's shard
 * @param rotation rope_params (by value), a rope_cos_sin_table with device data, or a
 *                 per_layer_rotation of either (copied into the kernel's arguments; its tables'
 *                 data on the device, up to 256 layers)
 * @param errors   device counters of what was skipped (inject_device_errors), or null
 * @param stream   the stream the kernel is enqueued on
 * @throw logic_error if the store and cache disagree on geometry or the rotation on head_dim, or
 *        the batch arrays or the pool are null (nothing is launched); cuda_error if the launch
 *        fails.
 * @note Never waits, allocates nothing and reads nothing on the host beyond its arguments.
 *       Tokens whose slot is negative are skipped; tokens whose slot is beyond the cache, whose
 *       position is negative or beyond the table, or whose store token lies outside the pool are
 *       skipped and counted in `errors`, as are rows whose fp8 scale is not positive and finite.
 * @pre  No two tokens of `batch` share a slot (injection_batch::add refuses a slot written twice
 *       before anything is staged); if two do, each element of that slot holds one of the two
 *       tokens' values, unspecified which, and nothing is counted.
 */
template <class StoreT = void, class CacheT = void, class Rotation>
void inject_view_async(kv_store_ref const& store,
                       injection_batch_view const& batch,
                       paged_kv_cache const& cache,
                       Rotation const& rotation,
                       inject_device_errors* errors,
                       cuda::stream_ref stream)
{
  char const* const who = "inject (device launch)";
  cache.validate();
  INFERSCALE_EXPECTS(cache.num_layers == store.num_layers && cache.num_heads() == store.num_heads &&
                       cache.head_dim() == store.head_dim,
                     std::string{who} + ": geometry mismatch between the store and the cache");
  check_rotation(rotation, store.head_dim, -1, who);
  check_rotation_layers(rotation, cache.num_layers, who);
  INFERSCALE_EXPECTS(batch.num_tokens >= 0, std::string{who} + ": negative token count");
  // Device pointers cannot be dereferenced here, but a null one can be refused.
  INFERSCALE_EXPECTS(batch.num_tokens == 0 || (batch.store_token != nullptr &&
                                               batch.position != nullptr && batch.slot != nullptr),
                     std::string{who} + ": null batch arrays");
  INFERSCALE_EXPECTS(batch.num_tokens == 0 || store.pool != nullptr,
                     std::string{who} + ": the store's pool is null");
  if constexpr (std::is_void_v<StoreT> && std::is_void_v<CacheT>) {
    dispatch_store_cache(store.store_dtype, cache.cache_dtype, [&](auto s, auto c) {
      using S = typename decltype(s)::type;
      using C = typename decltype(c)::type;
      inject_launch<S, C>(store, batch, cache, rotation, errors, stream);
    });
  } else {
    check_dtype_pair<StoreT, CacheT>(store.store_dtype, cache.cache_dtype, who);
    inject_launch<StoreT, CacheT>(store, batch, cache, rotation, errors, stream);
  }
}
}  // namespace detail

namespace detail {
/// @brief The device run's body (injection_batch::run): every host check, the staging and the
/// launch.
template <class StoreT, class CacheT, class Rotation>
void inject_batch_device(kv_store const& store,
                         injection_batch const& batch,
                         paged_kv_cache const& cache,
                         Rotation const& rotation,
                         injection_workspace& workspace,
                         cuda::stream_ref stream,
                         char const* who)
{
  batch.check_target(cache, who);
  check_injection(store, batch, cache, rotation, memory_space::device, who);
  INFERSCALE_EXPECTS(batch.num_tokens() <= workspace.capacity(),
                     std::string{who} + ": the batch has " + count_of(batch.num_tokens(), "token") +
                       ", the workspace holds " + std::to_string(workspace.capacity()));
  // A wrong pair is refused before staging (the raw launch would refuse it after).
  check_dtype_pair<StoreT, CacheT>(store.store_dtype(), cache.cache_dtype, who);
  workspace.stage(batch, stream);
  inject_view_async<StoreT, CacheT>(
    store.ref(), workspace.view(), cache, rotation, workspace.device_errors(), stream);
  workspace.mark_used(stream);
}
}  // namespace detail

template <class StoreT, class CacheT, class Rotation>
void injection_batch::run(paged_kv_cache const& cache,
                          Rotation const& rotation,
                          device_context const& device)
{
  run_and_commit([&] {
    char const* const who = "injection_batch::run";
    INFERSCALE_EXPECTS(device.workspace() != nullptr,
                       std::string{who} +
                         ": the device context has no injection workspace (the device run "
                         "stages the step's arrays through one: device_context{workspace, "
                         "stream})");
    detail::inject_batch_device<StoreT, CacheT>(
      store(), *this, cache, rotation, *device.workspace(), device.stream(), who);
  });
}

/**
 * @brief Device backend of extraction: reads the tokens in `slots` (absolute positions
 * `first_position ..`) from the engine's cache (device memory), dequantizes, de-rotates the keys
 * and stores them as a new fact of the device store.
 * @throw logic_error as extract_host (nothing is changed), fp8 scales included (copied to the
 *        host to be checked); cuda_error on a CUDA failure (the fact is then removed again).
 * @note Unlike extract_host, the cache's elements are not checked for NaN or infinity (they are
 *       device memory; a dry run would need a kernel of its own).
 * @note Waits for completion; allocates a small temporary device buffer (not a hot path).
 */
template <class StoreT = void, class CacheT = void, class Rotation>
void extract(paged_kv_cache const& cache,
             std::vector<std::int64_t> const& slots,
             std::int64_t first_position,
             Rotation const& rotation,
             kv_store& store,
             std::uint64_t fact_id,
             std::uint64_t namespace_id,
             std::vector<std::int32_t> token_ids,
             cuda::stream_ref stream)
{
  detail::check_extraction(cache,
                           slots,
                           first_position,
                           rotation,
                           store,
                           fact_id,
                           token_ids,
                           memory_space::device,
                           "extract");
  detail::check_dtype_pair<StoreT, CacheT>(store.store_dtype(), cache.cache_dtype, "extract");
  if (cache.scale_granularity != kv_scale_granularity::none) {
    // The fp8 scales are device memory: check a host copy of their values before anything is
    // reserved (extraction waits anyway), as extract_host checks its host scales.
    std::int32_t const count =
      cache.scale_granularity == kv_scale_granularity::per_head ? cache.num_heads() : 1;
    std::vector<float> values(static_cast<std::size_t>(2 * cache.num_layers * count));
    paged_kv_cache host_scales = cache;
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      float* const k = values.data() + static_cast<std::size_t>(2 * l) * count;
      float* const v = k + count;
      INFERSCALE_CUDA_TRY(
        cudaMemcpy(k, cache.key_scale[l], count * sizeof(float), cudaMemcpyDeviceToHost));
      INFERSCALE_CUDA_TRY(
        cudaMemcpy(v, cache.value_scale[l], count * sizeof(float), cudaMemcpyDeviceToHost));
      host_scales.key_scale[l]   = k;
      host_scales.value_scale[l] = v;
    }
    host_scales.check_scale_values("extract");
  }
  std::int64_t const n = static_cast<std::int64_t>(slots.size());
  std::vector<std::int64_t> host(static_cast<std::size_t>(3 * n));
  device_buffer<std::int64_t> arrays(host.size(), stream.get());
  std::int64_t* const device = arrays.data();
  fact_record const& fact    = store.reserve(fact_id, namespace_id, std::move(token_ids));
  try {
    std::vector<std::int64_t> const store_tokens = detail::fact_store_tokens(store, fact);
    std::copy(store_tokens.begin(), store_tokens.end(), host.begin());
    for (std::int64_t j = 0; j < n; ++j) {
      host[static_cast<std::size_t>(n + j)] = first_position + j;
    }
    std::copy(slots.begin(), slots.end(), host.begin() + 2 * n);
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(device,
                                        host.data(),
                                        host.size() * sizeof(std::int64_t),
                                        cudaMemcpyHostToDevice,
                                        stream.get()));
    auto const launch = [&](auto s, auto c) {
      using S         = typename decltype(s)::type;
      using C         = typename decltype(c)::type;
      using policy    = detail::inject_policy_sm90;
      auto const args = detail::make_extract_args(
        store.ref(), cache, rotation, {device, device + n, device + 2 * n, n});
      dim3 const grid = detail::extract_grid<policy>(args);
      detail::extract_kernel<policy, S, C, detail::kernel_rotation_t<Rotation>>
        <<<grid, policy::extract_threads, 0, stream.get()>>>(args);
      INFERSCALE_CHECK_LAUNCH();
    };
    if constexpr (std::is_void_v<StoreT>) {
      detail::dispatch_store_cache(store.store_dtype(), cache.cache_dtype, launch);
    } else {
      launch(type_tag<StoreT>{}, type_tag<CacheT>{});
    }
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  } catch (...) {
    (void)cudaStreamSynchronize(stream.get());
    store.erase(fact_id);
    throw;
  }
}

}  // namespace inferscale
