// A memory_resource for tests that records every call (stream, bytes, alignment, pointer) and
// forwards it to an upstream resource, or, with none, serves it from ordinary host memory (so
// host-only tests can route a pinned store's pool through it without a GPU).
#pragma once

#include "stream_type.hpp"

#include <inferscale/memory_resource.hpp>

#include <cstddef>
#include <cstdlib>
#include <new>
#include <vector>

namespace inferscale_test {

class counting_resource final : public inferscale::memory_resource {
 public:
  struct call {
    stream_t stream;
    void* pointer;
    std::size_t bytes;
    std::size_t alignment;
  };

  /// @param upstream where the memory comes from; null: host memory (std::aligned_alloc)
  explicit counting_resource(inferscale::memory_resource* upstream = nullptr) : upstream_{upstream}
  {
  }

  std::vector<call> allocations;
  std::vector<call> deallocations;

 private:
  void* do_allocate(stream_t stream, std::size_t bytes, std::size_t alignment) override
  {
    void* p = nullptr;
    if (upstream_ != nullptr) {
      p = upstream_->allocate(stream, bytes, alignment);
    } else {
      std::size_t const rounded = (bytes + alignment - 1) / alignment * alignment;
      p                         = std::aligned_alloc(alignment, rounded);
      if (p == nullptr) { throw std::bad_alloc{}; }
    }
    allocations.push_back({stream, p, bytes, alignment});
    return p;
  }
  void do_deallocate(stream_t stream,
                     void* p,
                     std::size_t bytes,
                     std::size_t alignment) noexcept override
  {
    deallocations.push_back({stream, p, bytes, alignment});
    if (upstream_ != nullptr) {
      upstream_->deallocate(stream, p, bytes, alignment);
    } else {
      std::free(p);
    }
  }

  inferscale::memory_resource* upstream_;
};

}  // namespace inferscale_test
