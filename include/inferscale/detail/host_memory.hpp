/**
 * @file detail/host_memory.hpp
 * @brief Zeroed host allocations backed by transparent huge pages where the system allows them.
 *
 * The host KV store's pool is read in rows of a few KiB scattered over hundreds of MiB (a fact's
 * rows for one layer, then the next layer's): with 4 KiB pages nearly every row needs a page walk
 * of its own. On Linux, an allocation of at least 2 MiB is therefore mapped 2 MiB-aligned and
 * advised `MADV_HUGEPAGE`, so that the kernel backs it with 2 MiB pages when transparent huge
 * pages are set to `always` or `madvise` (the common defaults); where they are `never`, or where
 * the kernel has none free, the advice changes nothing and the memory is ordinary. The memory is
 * zeroed and touched once at allocation (as `new T[n]()` would), so first use does not fault.
 * Elsewhere, and for small sizes, it is `std::calloc`.
 */
#pragma once

#include <inferscale/detail/math.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace inferscale::detail {

/// @brief A zeroed, movable, non-copyable host allocation (see the file's description).
class host_allocation {
 public:
  /// Bytes from which an allocation is mapped for huge pages (one 2 MiB page).
  static constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

  host_allocation() = default;

  /// @brief Allocates `bytes` zeroed bytes (at least 1). @throw std::bad_alloc on failure.
  explicit host_allocation(std::size_t bytes)
  {
    bytes = bytes == 0 ? 1 : bytes;
    if (maps_huge_pages(bytes)) {
      data_   = map_huge_pages(bytes, &huge_);
      mapped_ = round_to_huge_pages(bytes);
      // Anonymous memory reads as zero already; writing it commits the pages now (as the
      // value-initialising allocation did), huge ones where the kernel grants them.
      std::memset(data_, 0, mapped_);
      return;
    }
    data_ = std::calloc(bytes, 1);
    if (data_ == nullptr) { throw std::bad_alloc{}; }
  }

  /// @brief True where an allocation of `bytes` is mapped for huge pages (Linux, >= 2 MiB).
  static constexpr bool maps_huge_pages(std::size_t bytes) noexcept
  {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    return bytes >= huge_page_bytes;
#else
    (void)bytes;
    return false;
#endif
  }

  /// @brief `bytes` rounded up to whole huge pages.
  static constexpr std::size_t round_to_huge_pages(std::size_t bytes) noexcept
  {
    return round_up(bytes, huge_page_bytes);
  }

  /**
   * @brief Maps round_to_huge_pages(bytes) of anonymous memory at a 2 MiB boundary, advised
   * `MADV_HUGEPAGE` (`*advised`: whether the advice was taken). Only where maps_huge_pages(bytes)
   * (elsewhere nullptr); @throw std::bad_alloc when the mapping fails.
   */
  static void* map_huge_pages(std::size_t bytes, bool* advised)
  {
    *advised = false;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    std::size_t const rounded = round_to_huge_pages(bytes);
    std::size_t const mapped  = rounded + huge_page_bytes;  // room to align the start
    void* const base =
      mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) { throw std::bad_alloc{}; }
    auto const start   = reinterpret_cast<std::uintptr_t>(base);
    auto const aligned = round_up(start, huge_page_bytes);
    // Return the unaligned head and the tail beyond the rounded size to the system.
    if (aligned > start) { munmap(base, aligned - start); }
    std::size_t const tail = start + mapped - (aligned + rounded);
    if (tail > 0) { munmap(reinterpret_cast<void*>(aligned + rounded), tail); }
    void* const data = reinterpret_cast<void*>(aligned);
    *advised         = madvise(data, rounded, MADV_HUGEPAGE) == 0;
    return data;
#else
    (void)bytes;
    return nullptr;
#endif
  }

  /// @brief Unmaps what map_huge_pages(bytes) returned.
  static void unmap_huge_pages(void* data, std::size_t bytes) noexcept
  {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    munmap(data, round_to_huge_pages(bytes));
#else
    (void)data;
    (void)bytes;
#endif
  }

  host_allocation(host_allocation const&)            = delete;
  host_allocation& operator=(host_allocation const&) = delete;
  host_allocation(host_allocation&& other) noexcept { swap(other); }
  host_allocation& operator=(host_allocation&& other) noexcept
  {
    host_allocation moved{std::move(other)};
    swap(moved);
    return *this;
  }
  ~host_allocation() { release(); }

  void swap(host_allocation& other) noexcept
  {
    std::swap(data_, other.data_);
    std::swap(mapped_, other.mapped_);
    std::swap(huge_, other.huge_);
  }

  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] unsigned char* bytes() const noexcept { return static_cast<unsigned char*>(data_); }
  /// @brief True where the memory was mapped 2 MiB-aligned and the huge-page advice accepted (the
  /// kernel may still back parts of it with 4 KiB pages).
  [[nodiscard]] bool huge_page_advised() const noexcept { return huge_; }

 private:
  void release() noexcept
  {
    if (data_ == nullptr) { return; }
    if (mapped_ != 0) {
      unmap_huge_pages(data_, mapped_);
    } else {
      std::free(data_);
    }
    data_ = nullptr;
  }

  void* data_{nullptr};
  std::size_t mapped_{0};  ///< nonzero: mapped (munmap), else calloc (free)
  bool huge_{false};
};

/**
 * @brief A standard allocator whose allocations of at least one huge page (2 MiB) are mapped as
 * host_allocation's are (2 MiB-aligned, advised `MADV_HUGEPAGE` on Linux), smaller ones by
 * `std::allocator`. For the host index's rows and graph, read at random: with 4 KiB pages a
 * search's every row costs a page walk. Which way a block was allocated follows from its size,
 * which `deallocate` is given again. Stateless: all instances are equal.
 */
template <class T>
struct huge_page_allocator {
  using value_type = T;

  huge_page_allocator() = default;
  template <class U>
  constexpr huge_page_allocator(huge_page_allocator<U> const&) noexcept  // NOLINT: conversion
  {
  }

  [[nodiscard]] T* allocate(std::size_t n)
  {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) { throw std::bad_alloc{}; }
    std::size_t const bytes = n * sizeof(T);
    if (host_allocation::maps_huge_pages(bytes)) {
      bool advised = false;
      return static_cast<T*>(host_allocation::map_huge_pages(bytes, &advised));
    }
    return std::allocator<T>{}.allocate(n);
  }

  void deallocate(T* p, std::size_t n) noexcept
  {
    if (host_allocation::maps_huge_pages(n * sizeof(T))) {
      host_allocation::unmap_huge_pages(p, n * sizeof(T));
      return;
    }
    std::allocator<T>{}.deallocate(p, n);
  }

  template <class U>
  constexpr bool operator==(huge_page_allocator<U> const&) const noexcept
  {
    return true;
  }
  template <class U>
  constexpr bool operator!=(huge_page_allocator<U> const&) const noexcept
  {
    return false;
  }
};

/// @brief A std::vector whose large buffers sit on huge pages (huge_page_allocator).
template <class T>
using huge_page_vector = std::vector<T, huge_page_allocator<T>>;

}  // namespace inferscale::detail
