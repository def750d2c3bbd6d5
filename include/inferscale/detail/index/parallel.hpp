/**
 * @file detail/index/parallel.hpp
 * @brief The index's host thread helpers: `parallel_ranges` (fixed contiguous ranges, for the
 * graph builds, whose results do not depend on the split) and `parallel_chunks` (chunks handed
 * out as threads come free, for a search batch whose queries differ in cost), with the thread
 * count both use (`parallel_parts`).
 */
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace inferscale::detail::index {

/**
 * @brief Runs `fn(begin, end)` over `[0, n)` split into contiguous ranges, on at most `threads`
 * threads in all, the calling thread included: it runs the first range itself and starts one
 * `std::thread` per further range (none when `threads` is 1). `threads` 0 means one per hardware
 * thread. A range has at least 64 items, so small `n` use fewer threads (`n <= 127`: the caller
 * alone; `fn(0, 0)` for `n == 0`).
 *
 * If a thread cannot be started, the caller runs that range itself; if `fn` throws, every
 * started thread is joined first and the first exception (in range order) is rethrown.
 */
/// @brief `std::thread::hardware_concurrency()`, asked once: glibc answers it by reading
/// /sys/devices/system/cpu/online, a system call that cost 2 us per single-query search.
inline unsigned hardware_threads() noexcept
{
  static unsigned const count = std::max(1u, std::thread::hardware_concurrency());
  return count;
}

/// @brief How many threads (the caller included) parallel_ranges and parallel_chunks use for
/// `n` items: one per 64 items at most, `threads` at most (0: one per hardware thread).
inline std::int64_t parallel_parts(std::int64_t n, unsigned threads) noexcept
{
  if (n < 128) { return 1; }  // one range of at least 64 items: the caller alone, nothing to ask
  unsigned const wanted = threads != 0 ? threads : hardware_threads();
  return std::min<std::int64_t>(wanted, std::max<std::int64_t>(1, n / 64));
}

template <class Fn>
void parallel_ranges(std::int64_t n, unsigned threads, Fn&& fn)
{
  std::int64_t const parts = parallel_parts(n, threads);
  if (parts <= 1) {
    fn(std::int64_t{0}, n);
    return;
  }
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(parts));
  auto run = [&fn, &errors, n, parts](std::int64_t p) noexcept {
    try {
      fn(n * p / parts, n * (p + 1) / parts);
    } catch (...) {
      errors[static_cast<std::size_t>(p)] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(parts - 1));
  std::vector<std::int64_t> unstarted;
  for (std::int64_t p = 1; p < parts; ++p) {
    try {
      workers.emplace_back(run, p);
    } catch (std::system_error const&) {
      unstarted.push_back(p);  // no thread to be had: this one runs on the caller below
    }
  }
  run(0);
  for (auto p : unstarted) {
    run(p);
  }
  for (auto& w : workers) {
    w.join();
  }
  for (auto const& e : errors) {
    if (e) { std::rethrow_exception(e); }
  }
}

/**
 * @brief `parallel_ranges` with the work handed out as it goes: `fn(begin, end)` over `[0, n)`
 * in chunks of `chunk` items (the last one shorter), each taken in order from a shared counter
 * by whichever thread is free, on as many threads as `parallel_ranges` would use (the calling
 * thread included; `n <= 127`: the caller alone, `fn(0, n)`). For work whose items differ in
 * cost (the queries of a multi-tenant step: a namespace of 5,000 rows costs as much as a hundred
 * of 50), where contiguous ranges leave one thread waiting for the other. Every chunk runs once;
 * after an exception the threads take no further chunk, every started thread is joined, and the
 * first exception thrown is rethrown.
 */
template <class Fn>
void parallel_chunks(std::int64_t n, unsigned threads, std::int64_t chunk, Fn&& fn)
{
  std::int64_t const parts = parallel_parts(n, threads);
  if (parts <= 1) {
    fn(std::int64_t{0}, n);
    return;
  }
  chunk = std::max<std::int64_t>(1, chunk);
  std::atomic<std::int64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_lock;
  std::exception_ptr error;
  auto run = [&]() noexcept {
    try {
      while (!failed.load(std::memory_order_relaxed)) {
        std::int64_t const begin = next.fetch_add(chunk, std::memory_order_relaxed);
        if (begin >= n) { return; }
        fn(begin, std::min(n, begin + chunk));
      }
    } catch (...) {
      std::lock_guard<std::mutex> guard(error_lock);
      if (!error) { error = std::current_exception(); }
      failed.store(true, std::memory_order_relaxed);
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(parts - 1));
  for (std::int64_t p = 1; p < parts; ++p) {
    try {
      workers.emplace_back(run);
    } catch (std::system_error const&) {
      break;  // no thread to be had: the ones started and the caller share the chunks
    }
  }
  run();
  for (auto& w : workers) {
    w.join();
  }
  if (error) { std::rethrow_exception(error); }
}

}  // namespace inferscale::detail::index
