/**
 * @file bench/index/hnsw_baseline.cpp
 * @brief hnswlib behind bench/index/hnsw_baseline.hpp (the only translation unit that includes
 * <hnswlib/hnswlib.h>).
 */
#include "hnsw_baseline.hpp"

#include <hnswlib/hnswlib.h>

#include <limits>
#include <mutex>

namespace inferscale::bench {

struct hnsw_baseline::impl {
  hnswlib::InnerProductSpace space;
  hnswlib::HierarchicalNSW<float> index;

  impl(std::int64_t dim, std::int64_t capacity, int m, int ef_construction)
    : space(static_cast<std::size_t>(dim)),
      index(&space,
            static_cast<std::size_t>(capacity),
            static_cast<std::size_t>(m),
            static_cast<std::size_t>(ef_construction))
  {
  }
};

hnsw_baseline::hnsw_baseline(std::int64_t dim, std::int64_t capacity, int m, int ef_construction)
  : impl_(std::make_unique<impl>(dim, capacity, m, ef_construction))
{
}

hnsw_baseline::~hnsw_baseline() = default;

void hnsw_baseline::add(float const* row, std::uint64_t label)
{
  impl_->index.addPoint(row, static_cast<hnswlib::labeltype>(label));
}

void hnsw_baseline::set_ef(int ef)
{
  ef_ = ef;
  impl_->index.setEf(static_cast<std::size_t>(ef));
}

void hnsw_baseline::search(float const* query, int k, std::uint64_t* labels, float* distances) const
{
  auto found = impl_->index.searchKnn(query, static_cast<std::size_t>(k));
  // a max-heap: the farthest comes out first
  for (int j = k - 1; j >= 0; --j) {
    if (j >= static_cast<int>(found.size())) {
      labels[j]    = std::numeric_limits<std::uint64_t>::max();
      distances[j] = std::numeric_limits<float>::infinity();
      continue;
    }
    labels[j]    = static_cast<std::uint64_t>(found.top().second);
    distances[j] = found.top().first;
    found.pop();
  }
}

std::int64_t hnsw_baseline::fixed_overhead_bytes() const
{
  return static_cast<std::int64_t>(impl_->index.link_list_update_locks_.size() *
                                   sizeof(std::mutex));
}

std::int64_t hnsw_baseline::overhead_bytes() const
{
  auto const& h             = impl_->index;
  std::size_t const per_row = (h.size_data_per_element_ - h.data_size_) + sizeof(void*) +
                              sizeof(int) + sizeof(std::mutex) + sizeof(hnswlib::vl_type);
  std::size_t upper = 0;
  for (std::size_t i = 0; i < h.cur_element_count; ++i) {
    if (h.element_levels_[i] > 0) {
      upper += h.size_links_per_element_ * static_cast<std::size_t>(h.element_levels_[i]) + 1;
    }
  }
  std::size_t const labels = h.label_lookup_.size() * 32 + h.label_lookup_.bucket_count() * 8;
  return static_cast<std::int64_t>(h.max_elements_ * per_row + upper + labels) +
         fixed_overhead_bytes();
}

}  // namespace inferscale::bench
