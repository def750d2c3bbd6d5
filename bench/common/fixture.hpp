/**
 * @file bench/common/fixture.hpp
 * @brief The one Google Benchmark fixture every InferScale benchmark uses.
 *
 * What it provides (see STYLE.md "Benchmarks" and DESIGN.md "Performance"):
 *  - registration presets: device_benchmark / host_benchmark, applied with `->Apply(...)`, switch
 * on UseManualTime, so the reported time is exactly the measured operation (CUDA events on the
 *    device, std::chrono::steady_clock wall time on the host) and nothing of the setup, the L2
 *    flush or the interleaved copy;
 *  - require_device: `SkipWithError("no CUDA device visible")` when there is no GPU;
 *  - run_device / run_host: the timing loops. Before each timed launch the device loop optionally
 *    overwrites a buffer twice the size of the L2 (outside the timed region), so every launch
 *    starts with a cold L2;
 *  - the ceiling measured in the same run: each iteration also times a plain copy of the same
 *    bytes (cudaMemcpyAsync device-to-device on the device, std::memcpy on the host), interleaved
 *    with the measured operation so both see the same machine state, and reports
 *    `copy_GB/s` and `vs_copy` = GB/s / copy_GB/s;
 *  - report_throughput: SetBytesProcessed / SetItemsProcessed and the decimal `GB/s` counter
 *    (bytes / seconds / 1e9, the unit HBM figures are quoted in; Google Benchmark's own
 *    bytes_per_second is printed in binary GiB/s);
 *  - run_guarded: turns an exception (inferscale::cuda_error, logic_error, std::bad_alloc) into
 *    SkipWithError instead of terminating the whole executable;
 *  - INFERSCALE_BENCHMARK_MAIN(): main() that also records the GPU in the JSON context, and the
 *    host vector level in use (`host_simd`: avx512_bf16, avx512, avx2 or scalar);
 *    `INFERSCALE_BENCH_HOST_SIMD=scalar` (or `avx2`, `avx512`) in the environment caps the host
 *    backend to that level (the "before" of a vector path, measured with the same binary).
 *
 * Byte counting: `traffic::bytes` is what one call of the measured operation reads plus what it
 * writes. The copy ceiling copies `bytes / 2` bytes, which reads and writes `bytes` in total, so
 * both GB/s figures count the same way (an in-place kernel over N bytes: bytes = 2 N, copy of N).
 *
 * Google Benchmark's "CPU" column counts the whole loop (flushes and the copy included); the time
 * that matters is the manual one ("Time", real_time in JSON).
 *
 * Only the CUDA runtime API is used here (no kernels), so the header compiles with a plain C++17
 * compiler as well as with nvcc.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/dtype.hpp>

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace inferscale::bench {

/// @brief The message of every device benchmark run on a machine without a GPU.
inline constexpr char const* no_device_message = "no CUDA device visible";

/**
 * @brief True when a CUDA device is visible; otherwise marks the benchmark skipped with
 * "no CUDA device visible" and returns false. Call it first, before any device setup.
 */
inline bool require_device(benchmark::State& state)
{
  if (visible_device_count() > 0) { return true; }
  state.SkipWithError(no_device_message);
  return false;
}

/**
 * @brief Registration preset of device benchmarks (`->Apply(device_benchmark)`): CUDA-event
 * (manual) time in microseconds, at least 0.1 s of measured time (tens of thousands of launches
 * for a small kernel; each iteration also spends two L2 flushes and a copy outside the
 * measurement). A later `->MinTime(...)` overrides it.
 */
inline void device_benchmark(benchmark::internal::Benchmark* b)
{
  b->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.1);
}

/**
 * @brief Registration preset of host benchmarks (`->Apply(host_benchmark)`): wall (manual) time
 * in milliseconds, at least 0.2 s of measured time, so a whole executable runs in seconds on a
 * small CI machine. A later `->MinTime(...)` overrides it.
 */
inline void host_benchmark(benchmark::internal::Benchmark* b)
{
  b->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.2);
}

/// @brief What one call of the measured operation moves.
struct traffic {
  std::int64_t bytes{};  ///< bytes read + bytes written by one call
  std::int64_t items{};  ///< items processed by one call (0: not reported)
};

/// @brief Options of run_device / run_host.
struct run_options {
  bool flush_l2{true};      ///< device: overwrite 2x L2 before each timed launch and each copy
  bool copy_ceiling{true};  ///< interleave a plain copy of the same bytes (copy_GB/s, vs_copy)
};

/**
 * @brief Calls `body()` and turns an exception into `state.SkipWithError(what)`, so one failing
 * benchmark is reported in the output instead of terminating the executable.
 */
template <class Body>
void run_guarded(benchmark::State& state, Body&& body)
{
  try {
    std::forward<Body>(body)();
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
  }
}

/**
 * @brief Sets bytes/items processed and the decimal counters from the accumulated measured time.
 *
 * Counters: `GB/s` = bytes * iterations / seconds / 1e9; with `copy_seconds > 0` also
 * `copy_GB/s` (same bytes over the copy's time) and `vs_copy` = GB/s / copy_GB/s.
 */
inline void report_throughput(benchmark::State& state,
                              traffic t,
                              double seconds,
                              double copy_seconds = 0.0)
{
  if (state.error_occurred()) { return; }
  auto const iterations = static_cast<std::int64_t>(state.iterations());
  state.SetBytesProcessed(t.bytes * iterations);
  if (t.items > 0) { state.SetItemsProcessed(t.items * iterations); }
  double const total_bytes = static_cast<double>(t.bytes) * static_cast<double>(iterations);
  if (seconds <= 0.0) { return; }
  double const gbps      = total_bytes / seconds / 1e9;
  state.counters["GB/s"] = benchmark::Counter(gbps);
  if (copy_seconds > 0.0) {
    double const copy_gbps      = total_bytes / copy_seconds / 1e9;
    state.counters["copy_GB/s"] = benchmark::Counter(copy_gbps);
    state.counters["vs_copy"]   = benchmark::Counter(gbps / copy_gbps);
  }
}

#if INFERSCALE_HAS_CUDA_RUNTIME
// The CUDA runtime's streams, events and device timing: absent from a CPU-only build
// (INFERSCALE_WITH_CUDA=OFF), whose benchmarks run on the host only.

// ------------------------------------------------------------------------------------------------
// Small RAII owners of CUDA resources (setup only; never inside a timed region).

// Device arrays are the library's device_buffer<T> (device_buffer.hpp): cudaMalloc'd by default.
using inferscale::device_buffer;

/// @brief A non-blocking CUDA stream.
class cuda_stream {
 public:
  cuda_stream() { INFERSCALE_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  cuda_stream(cuda_stream const&)            = delete;
  cuda_stream& operator=(cuda_stream const&) = delete;
  ~cuda_stream() { (void)cudaStreamDestroy(stream_); }
  cudaStream_t get() const noexcept { return stream_; }

 private:
  cudaStream_t stream_{};
};

/// @brief A CUDA event with timing enabled.
class cuda_event {
 public:
  cuda_event() { INFERSCALE_CUDA_TRY(cudaEventCreate(&event_)); }
  cuda_event(cuda_event const&)            = delete;
  cuda_event& operator=(cuda_event const&) = delete;
  ~cuda_event() { (void)cudaEventDestroy(event_); }
  cudaEvent_t get() const noexcept { return event_; }

 private:
  cudaEvent_t event_{};
};

/// @brief Seconds between two recorded (and completed) events.
inline double elapsed_seconds(cuda_event const& start, cuda_event const& stop)
{
  float ms = 0.0f;
  INFERSCALE_CUDA_TRY(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return static_cast<double>(ms) * 1e-3;
}

/**
 * @brief Evicts the L2 by writing a buffer twice its size (the device's cudaDevAttrL2CacheSize)
 * on a stream; what the next kernel reads then comes from HBM.
 */
class l2_flusher {
 public:
  l2_flusher()
  {
    int device = 0, l2_bytes = 0;
    INFERSCALE_CUDA_TRY(cudaGetDevice(&device));
    INFERSCALE_CUDA_TRY(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
    buffer_ = device_buffer<std::byte>(2 * static_cast<std::size_t>(l2_bytes));
  }
  void flush(cudaStream_t stream)
  {
    if (buffer_.size() == 0) { return; }
    value_ ^= 1;  // a different value each time, so every flush really writes
    INFERSCALE_CUDA_TRY(cudaMemsetAsync(buffer_.data(), value_, buffer_.bytes(), stream));
  }

 private:
  device_buffer<std::byte> buffer_{};
  int value_{};
};

// ------------------------------------------------------------------------------------------------
// Timing loops

/**
 * @brief Device timing loop: each iteration times `launch(stream)` between two CUDA events and
 * reports it with SetIterationTime; the L2 flush happens before the start event.
 *
 * With `options.copy_ceiling`, each iteration then also times (after its own L2 flush) a
 * cudaMemcpyAsync device-to-device of `t.bytes / 2` bytes from `copy_source` (a device pointer
 * with at least that many bytes, typically the benchmark's own data; null: a scratch buffer),
 * not counted in the benchmark's time. One untimed warm-up launch and copy come first.
 *
 * @param launch callable `void(cudaStream_t)` that enqueues the measured work (one or more
 *        launches) on the stream and must not synchronise
 * @pre the benchmark is registered with device_benchmark (UseManualTime); require_device passed.
 */
template <class Launch>
void run_device(benchmark::State& state,
                traffic t,
                void const* copy_source,
                Launch&& launch,
                run_options options = {})
{
  cuda_stream stream;
  cuda_event start, stop, copy_start, copy_stop;
  std::optional<l2_flusher> flusher;
  if (options.flush_l2) { flusher.emplace(); }
  auto const flush = [&] {
    if (flusher) { flusher->flush(stream.get()); }
  };

  std::size_t const copy_bytes = options.copy_ceiling ? static_cast<std::size_t>(t.bytes / 2) : 0;
  device_buffer<std::byte> copy_destination(copy_bytes);
  device_buffer<std::byte> scratch_source(copy_source == nullptr ? copy_bytes : 0);
  if (copy_source == nullptr && copy_bytes > 0) {
    INFERSCALE_CUDA_TRY(cudaMemset(scratch_source.data(), 1, copy_bytes));
    copy_source = scratch_source.data();
  }
  auto const enqueue_copy = [&] {
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
      copy_destination.data(), copy_source, copy_bytes, cudaMemcpyDeviceToDevice, stream.get()));
  };

  // Warm-up (module loading, first-touch of the pages), outside the measurement.
  launch(stream.get());
  if (copy_bytes > 0) { enqueue_copy(); }
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));

  double seconds = 0.0, copy_seconds = 0.0;
  for (auto _ : state) {
    flush();
    INFERSCALE_CUDA_TRY(cudaEventRecord(start.get(), stream.get()));
    launch(stream.get());
    INFERSCALE_CUDA_TRY(cudaEventRecord(stop.get(), stream.get()));
    if (copy_bytes > 0) {
      flush();
      INFERSCALE_CUDA_TRY(cudaEventRecord(copy_start.get(), stream.get()));
      enqueue_copy();
      INFERSCALE_CUDA_TRY(cudaEventRecord(copy_stop.get(), stream.get()));
    }
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    double const s = elapsed_seconds(start, stop);
    state.SetIterationTime(s);
    seconds += s;
    if (copy_bytes > 0) { copy_seconds += elapsed_seconds(copy_start, copy_stop); }
  }
  report_throughput(state, t, seconds, copy_seconds);
}
#endif  // INFERSCALE_HAS_CUDA_RUNTIME

/**
 * @brief Host timing loop: each iteration times `work()` with std::chrono::steady_clock (wall
 * time) and reports it with SetIterationTime.
 *
 * With `options.copy_ceiling`, each iteration then also times a std::memcpy of `t.bytes / 2`
 * bytes from `copy_source` (host memory with at least that many bytes, typically the benchmark's
 * own data; null: a scratch buffer) into a pre-touched buffer, not counted in the benchmark's
 * time. One untimed warm-up call and copy come first. `options.flush_l2` is ignored on the host.
 *
 * @pre the benchmark is registered with host_benchmark (UseManualTime).
 */
template <class Work>
void run_host(benchmark::State& state,
              traffic t,
              void const* copy_source,
              Work&& work,
              run_options options = {})
{
  using clock                  = std::chrono::steady_clock;
  std::size_t const copy_bytes = options.copy_ceiling ? static_cast<std::size_t>(t.bytes / 2) : 0;
  std::vector<std::byte> copy_destination(copy_bytes);  // value-initialised: pages touched now
  std::vector<std::byte> scratch_source(copy_source == nullptr ? copy_bytes : 0, std::byte{1});
  if (copy_source == nullptr) { copy_source = scratch_source.data(); }
  auto const copy = [&] {
    std::memcpy(copy_destination.data(), copy_source, copy_bytes);
    benchmark::DoNotOptimize(copy_destination.data());
    benchmark::ClobberMemory();
  };

  work();
  if (copy_bytes > 0) { copy(); }

  double seconds = 0.0, copy_seconds = 0.0;
  for (auto _ : state) {
    auto const t0 = clock::now();
    work();
    benchmark::ClobberMemory();
    auto const t1  = clock::now();
    double const s = std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(s);
    seconds += s;
    if (copy_bytes > 0) {
      auto const c0 = clock::now();
      copy();
      auto const c1 = clock::now();
      copy_seconds += std::chrono::duration<double>(c1 - c0).count();
    }
  }
  report_throughput(state, t, seconds, copy_seconds);
}

// ------------------------------------------------------------------------------------------------
// Data

/// @brief `count` values uniform in [lo, hi), rounded to T; the same seed gives the same data.
template <class T>
std::vector<T> uniform_values(std::size_t count,
                              std::uint64_t seed,
                              float lo = -1.0f,
                              float hi = 1.0f)
{
  std::mt19937_64 rng{seed};
  std::uniform_real_distribution<float> dist{lo, hi};
  std::vector<T> values(count);
  for (auto& v : values) {
    v = from_float<T>(dist(rng));
  }
  return values;
}

/// @brief Records the visible GPU (name, SMs, L2, CUDA versions) in the benchmark context.
inline void add_device_context()
{
  int const count = visible_device_count();
  benchmark::AddCustomContext("cuda_devices", std::to_string(count));
#if INFERSCALE_HAS_CUDA_RUNTIME
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) {
    benchmark::AddCustomContext("cuda_runtime", std::to_string(runtime));
  }
  benchmark::AddCustomContext("inferscale_version",
                              std::to_string(INFERSCALE_VERSION_MAJOR) + "." +
                                std::to_string(INFERSCALE_VERSION_MINOR) + "." +
                                std::to_string(INFERSCALE_VERSION_PATCH));
  if (count == 0) { return; }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  int driver = 0;
  (void)cudaDriverGetVersion(&driver);
  benchmark::AddCustomContext("cuda_driver", std::to_string(driver));
  benchmark::AddCustomContext("gpu_name", prop.name);
  benchmark::AddCustomContext("gpu_cc",
                              std::to_string(prop.major) + "." + std::to_string(prop.minor));
  benchmark::AddCustomContext("gpu_sms", std::to_string(prop.multiProcessorCount));
  benchmark::AddCustomContext("gpu_l2_bytes", std::to_string(prop.l2CacheSize));
  benchmark::AddCustomContext("gpu_memory_bytes", std::to_string(prop.totalGlobalMem));
#else  // the CPU-only build: no CUDA runtime to describe
  benchmark::AddCustomContext("inferscale_version",
                              std::to_string(INFERSCALE_VERSION_MAJOR) + "." +
                                std::to_string(INFERSCALE_VERSION_MINOR) + "." +
                                std::to_string(INFERSCALE_VERSION_PATCH));
#endif
}

/// @brief Google Benchmark's main plus the device context (use instead of BENCHMARK_MAIN()).
inline int benchmark_main(int argc, char** argv)
{
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) { return 1; }
  char const* const simd = std::getenv("INFERSCALE_BENCH_HOST_SIMD");
  if (simd != nullptr) {  // cap the host vector level: scalar, avx2 or avx512 (below avx512_bf16)
    std::string const cap{simd};
    using ::inferscale::detail::host_simd;
    if (cap == "scalar") { ::inferscale::detail::set_host_simd_cap(host_simd::scalar); }
    if (cap == "avx2") { ::inferscale::detail::set_host_simd_cap(host_simd::avx2); }
    if (cap == "avx512") { ::inferscale::detail::set_host_simd_cap(host_simd::avx512); }
  }
  switch (::inferscale::detail::active_host_simd()) {
    case ::inferscale::detail::host_simd::avx512_bf16:
      benchmark::AddCustomContext("host_simd", "avx512_bf16");
      break;
    case ::inferscale::detail::host_simd::avx512:
      benchmark::AddCustomContext("host_simd", "avx512");
      break;
    case ::inferscale::detail::host_simd::avx2:
      benchmark::AddCustomContext("host_simd", "avx2");
      break;
    default: benchmark::AddCustomContext("host_simd", "scalar");
  }
  add_device_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace inferscale::bench

/// @brief Defines main() for a bench_<concept> executable.
#define INFERSCALE_BENCHMARK_MAIN() \
  int main(int argc, char** argv) { return ::inferscale::bench::benchmark_main(argc, argv); }
