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

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

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
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= huge_page_bytes) {
      std::size_t const rounded = (bytes + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
      std::size_t const mapped  = rounded + huge_page_bytes;  // room to align the start
      void* const base =
        mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) { throw std::bad_alloc{}; }
      auto const start   = reinterpret_cast<std::uintptr_t>(base);
      auto const aligned = (start + huge_page_bytes - 1) / huge_page_bytes * huge_page_bytes;
      // Return the unaligned head and the tail beyond the rounded size to the system.
      if (aligned > start) { munmap(base, aligned - start); }
      std::size_t const tail = start + mapped - (aligned + rounded);
      if (tail > 0) { munmap(reinterpret_cast<void*>(aligned + rounded), tail); }
      data_   = reinterpret_cast<void*>(aligned);
      mapped_ = rounded;
      huge_   = madvise(data_, rounded, MADV_HUGEPAGE) == 0;
      // Anonymous memory reads as zero already; writing it commits the pages now (as the
      // value-initialising allocation did), huge ones where the kernel grants them.
      std::memset(data_, 0, rounded);
      return;
    }
#endif
    data_ = std::calloc(bytes, 1);
    if (data_ == nullptr) { throw std::bad_alloc{}; }
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
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (mapped_ != 0) {
      munmap(data_, mapped_);
      data_ = nullptr;
      return;
    }
#endif
    std::free(data_);
    data_ = nullptr;
  }

  void* data_{nullptr};
  std::size_t mapped_{0};  ///< nonzero: mapped (munmap), else calloc (free)
  bool huge_{false};
};

}  // namespace inferscale::detail
