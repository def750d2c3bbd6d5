/**
 * @file detail/memory/facade_state.hpp
 * @brief What the memory facade (memory.hpp) keeps besides its store, index and lifecycle
 * catalogue: a count of its searches, the zeroing of freed pages still pending on a caller's
 * stream, and the two locks of its concurrency contract.
 */
#pragma once

#include <inferscale/cuda_error.hpp>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <utility>

namespace inferscale {
namespace detail {
/// @brief A count that const calls may raise from several threads; copies and moves take its value.
class call_counter {
 public:
  call_counter() = default;
  call_counter(call_counter const& o) noexcept : n_{o.get()} {}
  call_counter& operator=(call_counter const& o) noexcept
  {
    n_.store(o.get(), std::memory_order_relaxed);
    return *this;
  }
  void add() const noexcept { n_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t get() const noexcept { return n_.load(std::memory_order_relaxed); }

 private:
  mutable std::atomic<std::uint64_t> n_{0};
};

/// @brief The last zeroing of freed pages enqueued on a caller's stream (memory::erase_fact(id,
/// stream)): the facade's own writes of the store, made on the default stream, wait for it first
/// (a host wait on that event, not on the device). Move-only; the event is made on first use.
class pending_zeroing {
 public:
  pending_zeroing() = default;
  pending_zeroing(pending_zeroing&& o) noexcept
    : event_{std::exchange(o.event_, nullptr)}, recorded_{std::exchange(o.recorded_, false)}
  {
  }
  pending_zeroing& operator=(pending_zeroing&& o) noexcept
  {
    std::swap(event_, o.event_);
    std::swap(recorded_, o.recorded_);
    return *this;
  }
  pending_zeroing(pending_zeroing const&)            = delete;
  pending_zeroing& operator=(pending_zeroing const&) = delete;
  ~pending_zeroing()
  {
    if (event_ != nullptr) { (void)cudaEventDestroy(event_); }
  }
  /// @brief Marks the work enqueued so far on `stream` as the pending zeroing. Never waits.
  void record(cudaStream_t stream)
  {
    if (event_ == nullptr) {
      INFERSCALE_CUDA_TRY(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    }
    INFERSCALE_CUDA_TRY(cudaEventRecord(event_, stream));
    recorded_ = true;
  }
  /// @brief Waits until the pending zeroing is done (returns at once when there is none).
  void wait()
  {
    if (recorded_) {
      INFERSCALE_CUDA_TRY(cudaEventSynchronize(event_));
      recorded_ = false;
    }
  }

 private:
  cudaEvent_t event_{nullptr};
  bool recorded_{false};
};

/**
 * @brief The facade's locks (memory.hpp, "Concurrency"). `read()` is shared by the serving calls;
 * `commit()` is exclusive, held by a mutation only while it changes the store, the index and the
 * catalogue; `serial()` is held by a mutation for its whole call (validation, embedding and the
 * model's forwards included) and by a save, so mutations and saves run one at a time while serving
 * goes on beside them. Lock order: serial, then commit; a reader never takes serial, and never
 * takes read() twice.
 *
 * Writers are not starved: both read() and commit() pass a gate (a mutex held only while taking
 * the state lock), and a commit waiting for the readers in flight holds the gate, so readers
 * arriving after it wait behind it. (A plain std::shared_mutex on glibc prefers readers: with eight
 * threads serving back to back, a commit waited seconds; tests/stress measured it.)
 * A move gives fresh, unlocked locks: moving a memory other threads use is the caller's race.
 */
class facade_locks {
 public:
  facade_locks() = default;
  facade_locks(facade_locks&&) noexcept {}
  facade_locks& operator=(facade_locks&&) noexcept { return *this; }
  facade_locks(facade_locks const&)            = delete;
  facade_locks& operator=(facade_locks const&) = delete;

  [[nodiscard]] std::shared_lock<std::shared_mutex> read() const
  {
    std::lock_guard<std::mutex> const turn{gate_};
    return std::shared_lock<std::shared_mutex>{state_};
  }
  [[nodiscard]] std::unique_lock<std::shared_mutex> commit() const
  {
    std::lock_guard<std::mutex> const turn{gate_};
    return std::unique_lock<std::shared_mutex>{state_};
  }
  [[nodiscard]] std::unique_lock<std::mutex> serial() const
  {
    return std::unique_lock<std::mutex>{serial_};
  }

 private:
  mutable std::mutex gate_;
  mutable std::shared_mutex state_;
  mutable std::mutex serial_;
};
}  // namespace detail

}  // namespace inferscale
