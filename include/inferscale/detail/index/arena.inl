/**
 * @file detail/index/arena.inl
 * @brief `graph_index`'s storage (included at the end of `index.hpp`, not a header of its own):
 * construction, the tenants and their rows, the arena's growth and compaction, the float16
 * copies of the fast host search, and the device mirror of a device-memory index.
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/cuda_error.hpp>  // the CUDA runtime, or its CPU-only stand-in
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/index.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace inferscale {

// ---------------------------------------------------------------------------------------------
// Construction and moves

INFERSCALE_INDEX_LINKAGE graph_index::graph_index(index_config const& config) : config_(config)
{
  INFERSCALE_EXPECTS(config.dim > 0 && config.dim <= (1 << 20),
                     "index_config: dim must be in [1, 2^20], got " + std::to_string(config.dim));
  INFERSCALE_EXPECTS(config.vector_dtype == dtype::float32 || config.vector_dtype == dtype::float16,
                     std::string{"index_config: vectors are float32 or float16, got "} +
                       to_string(config.vector_dtype));
  INFERSCALE_EXPECTS(config.graph_degree >= 1 &&
                       config.graph_degree <= config.intermediate_graph_degree &&
                       config.intermediate_graph_degree <= 1024,
                     "index_config: need 1 <= graph_degree (" +
                       std::to_string(config.graph_degree) + ") <= intermediate_graph_degree (" +
                       std::to_string(config.intermediate_graph_degree) + ") <= 1024");
  INFERSCALE_EXPECTS(config.exact_search_threshold >= -1,
                     "index_config: exact_search_threshold is -1 (default) or >= 0");
  INFERSCALE_EXPECTS(
    config.host_knn == knn_build::automatic || config.host_knn == knn_build::exact ||
      config.host_knn == knn_build::nn_descent,
    "index_config: unknown host_knn code " + std::to_string(static_cast<int>(config.host_knn)));
  INFERSCALE_EXPECTS(config.nn_descent.rho > 0.0f && config.nn_descent.rho <= 1.0f,
                     "index_config: nn_descent.rho (the sampling rate) must be in (0, 1], got " +
                       std::to_string(config.nn_descent.rho));
  INFERSCALE_EXPECTS(config.nn_descent.delta >= 0.0f && config.nn_descent.delta <= 1.0f,
                     "index_config: nn_descent.delta (the stop fraction) must be in [0, 1], got " +
                       std::to_string(config.nn_descent.delta));
  INFERSCALE_EXPECTS(config.host_entry_points == -1 ||
                       (config.host_entry_points >= 1 && config.host_entry_points <= (1 << 20)),
                     "index_config: host_entry_points is -1 (automatic) or in [1, 2^20], got " +
                       std::to_string(config.host_entry_points));
  INFERSCALE_EXPECTS(config.nn_descent.max_iterations >= 1,
                     std::string{"index_config: nn_descent.max_iterations must be at least 1"});
  INFERSCALE_EXPECTS(std::isfinite(config.max_row_overhead) &&
                       (config.max_row_overhead == 0.0 || config.max_row_overhead >= 1.0),
                     "index_config: max_row_overhead is 0 (no automatic compaction) or a finite "
                     "factor >= 1, got " +
                       std::to_string(config.max_row_overhead));
  check_traversal_dtype(config, "index_config");
  element_size_ = size_of(config.vector_dtype);
  row_elements_ = detail::index::padded_dim(config.dim, element_size_);
}

INFERSCALE_INDEX_LINKAGE graph_index& graph_index::operator=(graph_index&& other) noexcept
{
  if (this != &other) {
    graph_index tmp{std::move(other)};
    swap(tmp);
  }
  return *this;
}

INFERSCALE_INDEX_LINKAGE void graph_index::swap(graph_index& o) noexcept
{
  std::swap(config_, o.config_);
  std::swap(element_size_, o.element_size_);
  std::swap(row_elements_, o.row_elements_);
  std::swap(vectors_, o.vectors_);
  std::swap(graph_, o.graph_);
  std::swap(ids_, o.ids_);
  std::swap(deleted_, o.deleted_);
  std::swap(arena_capacity_, o.arena_capacity_);
  std::swap(arena_used_, o.arena_used_);
  std::swap(tenants_, o.tenants_);
  std::swap(tenant_of_, o.tenant_of_);
  std::swap(id_to_row_, o.id_to_row_);
  std::swap(version_, o.version_);
  std::swap(compactions_, o.compactions_);
  d_vectors_.swap(o.d_vectors_);
  d_graph_.swap(o.d_graph_);
  d_ids_.swap(o.d_ids_);
  d_deleted_.swap(o.d_deleted_);
  std::swap(d_capacity_, o.d_capacity_);
  std::swap(device_stale_, o.device_stale_);
  std::swap(last_nn_descent_, o.last_nn_descent_);
}

// ---------------------------------------------------------------------------------------------
// Tenants and their rows

INFERSCALE_INDEX_LINKAGE std::vector<std::uint64_t> graph_index::namespaces() const
{
  std::vector<std::uint64_t> out;
  for (auto const& t : tenants_) {
    if (t.alive) { out.push_back(t.ns); }
  }
  return out;
}

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::size(std::uint64_t ns) const noexcept
{
  auto it = tenant_of_.find(ns);
  return it == tenant_of_.end() ? 0 : tenants_[it->second].ref.live;
}

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::host_entry_points(
  std::uint64_t ns) const noexcept
{
  auto it = tenant_of_.find(ns);
  return it == tenant_of_.end() ? 0
                                : static_cast<std::uint32_t>(tenants_[it->second].entries.size());
}

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::host_default_ef(std::uint64_t ns) const noexcept
{
  auto it = tenant_of_.find(ns);
  return it == tenant_of_.end() ? 0 : tenants_[it->second].default_ef;
}

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::rows(std::uint64_t ns) const noexcept
{
  auto it = tenant_of_.find(ns);
  return it == tenant_of_.end() ? 0 : tenants_[it->second].ref.size;
}

INFERSCALE_INDEX_LINKAGE std::uint64_t graph_index::namespace_of(std::uint64_t id) const
{
  auto it = id_to_row_.find(id);
  INFERSCALE_EXPECTS(it != id_to_row_.end(), "graph_index: unknown fact id " + std::to_string(id));
  return tenants_[it->second.tenant].ns;
}

INFERSCALE_INDEX_LINKAGE std::vector<std::uint64_t> graph_index::ids(std::uint64_t ns) const
{
  std::vector<std::uint64_t> out;
  auto it = tenant_of_.find(ns);
  if (it == tenant_of_.end()) { return out; }
  auto const& t = tenants_[it->second].ref;
  for (std::uint32_t v = 0; v < t.size; ++v) {
    if (!deleted_[t.row_begin + v]) { out.push_back(ids_[t.row_begin + v]); }
  }
  return out;
}

INFERSCALE_INDEX_LINKAGE auto graph_index::tenant_segment(std::uint64_t ns) const noexcept
  -> tenant_ref
{
  auto it = tenant_of_.find(ns);
  return it == tenant_of_.end() ? tenant_ref{} : tenants_[it->second].ref;
}

INFERSCALE_INDEX_LINKAGE auto graph_index::tenant_table() const -> std::vector<tenant_ref>
{
  std::vector<tenant_ref> out;
  for (auto const& t : tenants_) {
    out.push_back(t.ref);
  }
  return out;
}

INFERSCALE_INDEX_LINKAGE auto graph_index::checked_tenant(std::uint64_t ns) const -> tenant_ref
{
  auto it = tenant_of_.find(ns);
  INFERSCALE_EXPECTS(it != tenant_of_.end(),
                     "graph_index: unknown namespace " + std::to_string(ns));
  return tenants_[it->second].ref;
}

INFERSCALE_INDEX_LINKAGE std::uint32_t const* graph_index::graph_rows(std::uint64_t ns) const
{
  auto const t = checked_tenant(ns);
  return graph_.data() + t.row_begin * config_.graph_degree;
}

INFERSCALE_INDEX_LINKAGE void const* graph_index::vector_rows(std::uint64_t ns) const
{
  auto const t = checked_tenant(ns);
  return vectors_.data() + static_cast<std::size_t>(t.row_begin * row_elements_) * element_size_;
}

INFERSCALE_INDEX_LINKAGE std::uint64_t const* graph_index::id_rows(std::uint64_t ns) const
{
  return ids_.data() + checked_tenant(ns).row_begin;
}

INFERSCALE_INDEX_LINKAGE std::uint8_t const* graph_index::deleted_rows(std::uint64_t ns) const
{
  return deleted_.data() + checked_tenant(ns).row_begin;
}

INFERSCALE_INDEX_LINKAGE std::uint64_t graph_index::arena_bytes() const noexcept
{
  return static_cast<std::uint64_t>(arena_capacity_) *
         (static_cast<std::uint64_t>(row_elements_) * element_size_ +
          std::uint64_t{config_.graph_degree} * 4 + 8 + 1);
}

template <class Fn>
decltype(auto) graph_index::with_rows(std::size_t t, Fn&& fn) const
{
  unsigned char const* base =
    vectors_.data() +
    static_cast<std::size_t>(tenants_[t].ref.row_begin * row_elements_) * element_size_;
  if (config_.vector_dtype == dtype::float32) { return fn(reinterpret_cast<float const*>(base)); }
  return fn(reinterpret_cast<half_t const*>(base));
}

template <class T>
double graph_index::row_norm2(matrix_view<T const> vectors, std::int64_t r) noexcept
{
  double norm2 = 0.0;
  for (std::int64_t e = 0; e < vectors.extent(1); ++e) {
    double const x = to_float(vectors(r, e));
    norm2 += x * x;
  }
  return norm2;
}

template <class T>
void graph_index::write_rows(std::size_t t,
                             std::uint32_t first,
                             matrix_view<T const> vectors,
                             cuda::std::span<std::uint64_t const> ids)
{
  auto& tr = tenants_[t];
  for (std::int64_t r = 0; r < vectors.extent(0); ++r) {
    std::int64_t const row = tr.ref.row_begin + first + r;
    bool const cosine      = config_.metric == distance_metric::cosine;
    double const scale     = cosine ? detail::index::cosine_scale(row_norm2(vectors, r)) : 1.0;
    unsigned char* dst =
      vectors_.data() + static_cast<std::size_t>(row * row_elements_) * element_size_;
    std::memset(dst, 0, static_cast<std::size_t>(row_elements_) * element_size_);
    for (std::int64_t e = 0; e < config_.dim; ++e) {
      float const x = cosine ? detail::index::cosine_normalised(to_float(vectors(r, e)), scale)
                             : to_float(vectors(r, e));
      if (config_.vector_dtype == dtype::float32) {
        std::memcpy(dst + e * 4, &x, 4);
      } else {
        half_t const h = from_float<half_t>(x);
        std::memcpy(dst + e * 2, &h, 2);
      }
    }
    ids_[row]     = ids[static_cast<std::size_t>(r)];
    deleted_[row] = 0;
    std::fill_n(graph_.begin() + row * config_.graph_degree,
                config_.graph_degree,
                detail::index::invalid_node);
    id_to_row_[ids_[row]] = {t, static_cast<std::uint32_t>(first + r)};
  }
  write_traversal(t, first, static_cast<std::uint32_t>(vectors.extent(0)));
}

// ---------------------------------------------------------------------------------------------
// Growth

INFERSCALE_INDEX_LINKAGE auto graph_index::allocate_arena(std::int64_t rows) const -> arena
{
  arena a;
  a.vectors.assign(static_cast<std::size_t>(rows * row_elements_) * element_size_, 0);
  a.graph.assign(static_cast<std::size_t>(rows) * config_.graph_degree,
                 detail::index::invalid_node);
  a.ids.assign(static_cast<std::size_t>(rows), invalid_fact_id);
  a.deleted.assign(static_cast<std::size_t>(rows), 0);
  return a;
}

INFERSCALE_INDEX_LINKAGE std::int64_t graph_index::row_limit(std::uint64_t live) const noexcept
{
  if (config_.max_row_overhead == 0.0) { return std::numeric_limits<std::int64_t>::max(); }
  std::int64_t const n = static_cast<std::int64_t>(live);
  return std::max(
    static_cast<std::int64_t>(std::floor(config_.max_row_overhead * static_cast<double>(n))),
    n + compaction_floor_rows);
}

INFERSCALE_INDEX_LINKAGE std::int64_t graph_index::growth_cap(
  std::int64_t needed, std::uint64_t live_after) const noexcept
{
  std::int64_t const limit = row_limit(live_after);
  std::int64_t const cap   = needed < limit ? needed + (limit - needed) / 2 : needed;
  return std::max(cap, arena_capacity_);
}

INFERSCALE_INDEX_LINKAGE std::uint32_t graph_index::spare_rows(
  std::uint32_t rows, std::int64_t end, std::uint64_t live_after) const noexcept
{
  std::int64_t const room = growth_cap(end, live_after) - end;
  return static_cast<std::uint32_t>(std::clamp<std::int64_t>(room, 0, rows / 4));
}

INFERSCALE_INDEX_LINKAGE void graph_index::grow_arena(std::int64_t needed, std::uint64_t live_after)
{
  if (needed <= arena_capacity_) { return; }
  // The arena holds exactly the rows handed out (`needed`); its growth is amortized by the
  // vectors' capacity, reserved ahead and not written, so not resident until rows use it. Spare
  // rows are given per namespace (`ensure_room`), where they save a move.
  std::int64_t const reserved =
    config_.max_row_overhead == 0.0
      ? std::max<std::int64_t>(needed, 2 * arena_capacity_)
      : std::max<std::int64_t>(
          needed, std::min(arena_capacity_ + arena_capacity_ / 4, growth_cap(needed, live_after)));
  std::size_t const ahead = static_cast<std::size_t>(reserved);
  if (ids_.capacity() < static_cast<std::size_t>(needed)) {
    vectors_.reserve(ahead * static_cast<std::size_t>(row_elements_) * element_size_);
    graph_.reserve(ahead * config_.graph_degree);
    ids_.reserve(ahead);
    deleted_.reserve(ahead);
  }
  std::int64_t const capacity = needed;
  std::size_t const rows      = static_cast<std::size_t>(capacity);
  vectors_.resize(rows * static_cast<std::size_t>(row_elements_) * element_size_, 0);
  graph_.resize(rows * config_.graph_degree, detail::index::invalid_node);
  ids_.resize(rows, invalid_fact_id);
  deleted_.resize(rows, 0);
  arena_capacity_ = capacity;
  // the device mirror is reallocated (and copied whole) only when the new rows do not fit it;
  // within it, the namespace given the rows uploads them (`upload_tenant`)
  if (d_capacity_ < capacity) { device_stale_ = true; }
}

INFERSCALE_INDEX_LINKAGE std::size_t graph_index::ensure_room(std::uint64_t ns,
                                                              std::uint32_t rows,
                                                              std::uint64_t live_after)
{
  bool const automatic = config_.max_row_overhead != 0.0;
  auto it              = tenant_of_.find(ns);
  if (it == tenant_of_.end()) {
    // a new namespace gets exactly its rows (one built in one call, a bulk import or a
    // restored user, may never grow); spare rows come with its first growth
    std::uint32_t const capacity = automatic ? rows : std::max<std::uint32_t>(rows, 16);
    grow_arena(arena_used_ + capacity, live_after);
    tenant t;
    t.ns            = ns;
    t.ref.row_begin = arena_used_;
    t.capacity      = capacity;
    arena_used_ += capacity;
    tenant_of_[ns] = tenants_.size();
    tenants_.push_back(t);
    return tenants_.size() - 1;
  }
  std::size_t const index = it->second;
  tenant& t               = tenants_[index];
  if (rows <= t.capacity) { return index; }
  bool const last          = t.ref.row_begin + t.capacity == arena_used_;
  std::int64_t const begin = last ? t.ref.row_begin : arena_used_;
  std::uint32_t const capacity =
    automatic
      ? rows + spare_rows(rows, begin + rows, live_after)
      : static_cast<std::uint32_t>(std::max<std::uint64_t>(rows, std::uint64_t{2} * t.capacity));
  if (last) {  // grow in place at the end of the arena
    grow_arena(t.ref.row_begin + capacity, live_after);
    arena_used_              = t.ref.row_begin + capacity;
    tenants_[index].capacity = capacity;
    return index;
  }
  grow_arena(arena_used_ + capacity, live_after);
  tenant& moved            = tenants_[index];
  std::int64_t const from  = moved.ref.row_begin;
  std::int64_t const to    = arena_used_;
  std::uint32_t const used = moved.ref.size;
  std::memmove(vectors_.data() + static_cast<std::size_t>(to * row_elements_) * element_size_,
               vectors_.data() + static_cast<std::size_t>(from * row_elements_) * element_size_,
               static_cast<std::size_t>(used * row_elements_) * element_size_);
  std::copy_n(graph_.begin() + from * config_.graph_degree,
              std::size_t{used} * config_.graph_degree,
              graph_.begin() + to * config_.graph_degree);
  std::copy_n(ids_.begin() + from, used, ids_.begin() + to);
  std::copy_n(deleted_.begin() + from, used, deleted_.begin() + to);
  std::fill_n(ids_.begin() + from, moved.capacity, invalid_fact_id);  // the hole
  std::fill_n(deleted_.begin() + from, moved.capacity, std::uint8_t{1});
  moved.ref.row_begin = to;
  moved.capacity      = capacity;
  arena_used_ += capacity;
  device_stale_ = true;
  return index;
}

// ---------------------------------------------------------------------------------------------
// Compaction

INFERSCALE_INDEX_LINKAGE void graph_index::compact(graph_builder const& builder)
{
  std::vector<std::uint8_t> rebuild(tenants_.size(), 0);
  for (std::size_t t = 0; t < tenants_.size(); ++t) {
    rebuild[t] = tenants_[t].ref.live != tenants_[t].ref.size;
  }
  repack(rebuild, 0, builder);
  ++version_;
}

INFERSCALE_INDEX_LINKAGE std::int64_t graph_index::repack_target(std::uint64_t live) const noexcept
{
  std::int64_t const n = static_cast<std::int64_t>(live);
  double const factor  = 1.0 + (config_.max_row_overhead - 1.0) / 2.0;
  return std::max(static_cast<std::int64_t>(std::floor(factor * static_cast<double>(n))),
                  n + compaction_floor_rows / 2);
}

INFERSCALE_INDEX_LINKAGE bool graph_index::compact_if_needed(graph_builder const& builder)
{
  std::uint64_t const live = total_size();
  if (arena_capacity_ <= row_limit(live)) { return false; }
  std::int64_t const target = repack_target(live);
  std::int64_t packed       = 0;
  std::vector<std::size_t> with_deleted;
  for (std::size_t t = 0; t < tenants_.size(); ++t) {
    if (!tenants_[t].alive) { continue; }
    packed += tenants_[t].ref.size;
    if (tenants_[t].ref.live != tenants_[t].ref.size) { with_deleted.push_back(t); }
  }
  // drop deleted rows where they are the largest share of a namespace (the most rows
  // reclaimed per row rebuilt) until the target is met; sizes < 2^31, so products fit int64
  auto deleted_of = [&](std::size_t t) {
    return std::int64_t{tenants_[t].ref.size} - tenants_[t].ref.live;
  };
  std::stable_sort(with_deleted.begin(), with_deleted.end(), [&](std::size_t a, std::size_t b) {
    return deleted_of(a) * tenants_[b].ref.size > deleted_of(b) * tenants_[a].ref.size;
  });
  std::vector<std::uint8_t> rebuild(tenants_.size(), 0);
  for (auto t : with_deleted) {
    if (packed <= target) { break; }
    rebuild[t] = 1;
    packed -= deleted_of(t);
  }
  repack(rebuild, std::max<std::int64_t>(0, target - packed), builder);
  ++compactions_;
  return true;
}

INFERSCALE_INDEX_LINKAGE void graph_index::repack(std::vector<std::uint8_t> const& rebuild,
                                                  std::int64_t spare,
                                                  graph_builder const& builder)
{
  std::vector<std::size_t> order;
  std::int64_t packed = 0;
  for (std::size_t t = 0; t < tenants_.size(); ++t) {
    if (!tenants_[t].alive) { continue; }
    order.push_back(t);
    packed += rebuild[t] ? tenants_[t].ref.live : tenants_[t].ref.size;
  }
  double const fraction =
    packed == 0 ? 0.0 : std::min(0.25, static_cast<double>(spare) / static_cast<double>(packed));
  std::int64_t spare_left = spare;
  std::vector<tenant> next_tenants;
  next_tenants.reserve(order.size());
  std::int64_t cursor = 0;
  for (auto t : order) {
    tenant nt   = tenants_[t];
    nt.ref.size = rebuild[t] ? nt.ref.live : nt.ref.size;
    std::int64_t const extra =
      std::min(spare_left, static_cast<std::int64_t>(std::floor(nt.ref.size * fraction)));
    spare_left -= extra;
    nt.ref.row_begin      = cursor;
    nt.capacity           = nt.ref.size + static_cast<std::uint32_t>(extra);
    nt.rebuild_on_compact = nt.ref.size != tenants_[t].ref.size;
    cursor += nt.capacity;
    next_tenants.push_back(nt);
  }
  arena next               = allocate_arena(cursor);  // may throw: nothing has changed yet
  std::size_t const vb     = static_cast<std::size_t>(row_elements_) * element_size_;
  std::size_t const degree = config_.graph_degree;
  for (std::size_t i = 0; i < order.size(); ++i) {
    auto const& old       = tenants_[order[i]].ref;
    auto const& nt        = next_tenants[i].ref;
    std::size_t const src = static_cast<std::size_t>(old.row_begin);
    std::size_t const dst = static_cast<std::size_t>(nt.row_begin);
    if (!next_tenants[i].rebuild_on_compact) {  // the segment moves as it is
      std::memcpy(next.vectors.data() + dst * vb, vectors_.data() + src * vb, nt.size * vb);
      std::memcpy(
        next.graph.data() + dst * degree, graph_.data() + src * degree, nt.size * degree * 4);
      std::memcpy(next.ids.data() + dst, ids_.data() + src, nt.size * 8);
      std::memcpy(next.deleted.data() + dst, deleted_.data() + src, nt.size);
      continue;
    }
    std::size_t out = dst;
    for (std::size_t v = 0; v < old.size; ++v) {
      if (deleted_[src + v]) { continue; }
      std::memcpy(next.vectors.data() + out * vb, vectors_.data() + (src + v) * vb, vb);
      next.ids[out++] = ids_[src + v];
    }
  }
  std::swap(vectors_, next.vectors);
  std::swap(graph_, next.graph);
  std::swap(ids_, next.ids);
  std::swap(deleted_, next.deleted);
  arena_capacity_ = cursor;
  arena_used_     = cursor;
  tenants_        = std::move(next_tenants);
  tenant_of_.clear();
  for (std::size_t i = 0; i < tenants_.size(); ++i) {
    tenant_of_[tenants_[i].ns] = i;
    // the locations of a tenant that kept its place in the table and its rows stay valid
    if (i == order[i] && !tenants_[i].rebuild_on_compact) { continue; }
    auto const& tr = tenants_[i].ref;
    for (std::uint32_t v = 0; v < tr.size; ++v) {
      if (!deleted_[tr.row_begin + v]) { id_to_row_[ids_[tr.row_begin + v]] = {i, v}; }
    }
  }
  for (std::size_t i = 0; i < tenants_.size(); ++i) {
    if (tenants_[i].rebuild_on_compact) {
      rebuild_graph(i, builder);
      tenants_[i].rebuild_on_compact = false;
    }
  }
  device_stale_ = true;
  reallocate_device();
}

// ---------------------------------------------------------------------------------------------
// Float16 copies of the rows (index_config::host_traversal_dtype)

INFERSCALE_INDEX_LINKAGE void graph_index::set_host_traversal_dtype(dtype d)
{
  index_config next         = config_;
  next.host_traversal_dtype = d;
  check_traversal_dtype(next, "graph_index::set_host_traversal_dtype");
  if (d == config_.host_traversal_dtype) { return; }
  if (d == dtype::float16) {
    float const* rows = reinterpret_cast<float const*>(vectors_.data());
    for (auto const& t : tenants_) {
      for (std::uint32_t v = 0; v < t.ref.size; ++v) {
        std::size_t const row = static_cast<std::size_t>(t.ref.row_begin + v);
        for (std::int64_t e = 0; e < row_elements_; ++e) {
          INFERSCALE_EXPECTS(
            std::isfinite(to_float(from_float<half_t>(rows[row * row_elements_ + e]))),
            "graph_index::set_host_traversal_dtype: fact id " + std::to_string(ids_[row]) +
              " overflows float16 at element " + std::to_string(e));
        }
      }
    }
  }
  config_.host_traversal_dtype = d;
  for (std::size_t t = 0; t < tenants_.size(); ++t) {
    rebuild_traversal(t);
  }
  ++version_;
}

INFERSCALE_INDEX_LINKAGE half_t const* graph_index::host_traversal_rows(
  std::uint64_t ns) const noexcept
{
  auto it = tenant_of_.find(ns);
  if (it == tenant_of_.end() || !traverses_fp16()) { return nullptr; }
  return tenants_[it->second].traversal.data();
}

INFERSCALE_INDEX_LINKAGE std::uint64_t graph_index::host_traversal_bytes() const noexcept
{
  std::uint64_t total = 0;
  for (auto const& t : tenants_) {
    total += (t.traversal.size() + t.entry_traversal.size()) * sizeof(half_t);
  }
  return total;
}

INFERSCALE_INDEX_LINKAGE std::uint64_t graph_index::host_entry_bytes() const noexcept
{
  std::uint64_t total = 0;
  for (auto const& t : tenants_) {
    total += t.entries.size() * sizeof(std::uint32_t) + t.entry_vectors.size();
  }
  return total;
}

INFERSCALE_INDEX_LINKAGE void graph_index::check_traversal_dtype(index_config const& config,
                                                                 char const* who)
{
  INFERSCALE_EXPECTS(
    config.host_traversal_dtype == dtype::float32 || config.host_traversal_dtype == dtype::float16,
    std::string{who} + ": host_traversal_dtype is float32 or float16, got " +
      to_string(config.host_traversal_dtype));
  INFERSCALE_EXPECTS(
    config.host_traversal_dtype == dtype::float32 ||
      (config.vector_dtype == dtype::float32 && config.space == memory_space::host),
    std::string{who} +
      ": host_traversal_dtype float16 needs a host-memory index of float32 "
      "vectors (got vector_dtype " +
      to_string(config.vector_dtype) + ", " +
      (config.space == memory_space::host ? "host" : "device") + " memory)");
}

INFERSCALE_INDEX_LINKAGE void graph_index::write_traversal(std::size_t t,
                                                           std::uint32_t first,
                                                           std::uint32_t count)
{
  if (!traverses_fp16() || count == 0) { return; }
  auto& tn                 = tenants_[t];
  std::size_t const re     = static_cast<std::size_t>(row_elements_);
  std::size_t const needed = (std::size_t{first} + count) * re;
  if (tn.traversal.size() < needed) { tn.traversal.resize(needed); }
  float const* rows = reinterpret_cast<float const*>(vectors_.data()) +
                      static_cast<std::size_t>(tn.ref.row_begin) * re;
  std::size_t const begin = std::size_t{first} * re;
  to_half(rows + begin, tn.traversal.data() + begin, needed - begin);
}

INFERSCALE_INDEX_LINKAGE void graph_index::to_half(float const* from,
                                                   half_t* to,
                                                   std::size_t n) noexcept
{
  for (std::size_t i = 0; i < n; ++i) {
    to[i] = from_float<half_t>(from[i]);
  }
}

INFERSCALE_INDEX_LINKAGE void graph_index::rebuild_traversal(std::size_t t)
{
  auto& tn = tenants_[t];
  if (!traverses_fp16()) {
    detail::huge_page_vector<half_t>().swap(tn.traversal);
    std::vector<half_t>().swap(tn.entry_traversal);
    return;
  }
  tn.traversal.resize(static_cast<std::size_t>(tn.ref.size) *
                      static_cast<std::size_t>(row_elements_));
  write_traversal(t, 0, tn.ref.size);  // every element rewritten
  tn.entry_traversal.resize(tn.entry_vectors.size() / sizeof(float));
  to_half(reinterpret_cast<float const*>(tn.entry_vectors.data()),
          tn.entry_traversal.data(),
          tn.entry_traversal.size());
}

// ---------------------------------------------------------------------------------------------
// Device mirror (device-memory indexes only)

INFERSCALE_INDEX_LINKAGE detail::index::graph_index_ref graph_index::ref() const noexcept
{
  detail::index::graph_index_ref r;
  r.vectors      = d_vectors_.data();
  r.graph        = d_graph_.data();
  r.ids          = d_ids_.data();
  r.deleted      = d_deleted_.data();
  r.row_elements = row_elements_;
  r.degree       = config_.graph_degree;
  r.metric       = config_.metric;
  r.vector_dtype = config_.vector_dtype;
  return r;
}

INFERSCALE_INDEX_LINKAGE void graph_index::free_device() noexcept
{
  d_vectors_.release();
  d_graph_.release();
  d_ids_.release();
  d_deleted_.release();
  d_capacity_ = 0;
}

INFERSCALE_INDEX_LINKAGE void graph_index::reallocate_device()
{
  if (config_.space != memory_space::device) { return; }
  free_device();
  // a quarter beyond the arena (as the host arena reserves ahead), so that a growing index is
  // not allocated and copied again at every add
  std::int64_t const rows = std::max<std::int64_t>(arena_capacity_ + arena_capacity_ / 4, 1);
  auto const n            = static_cast<std::size_t>(rows);
  memory_resource* const resource = config_.resource;
  d_vectors_                      = device_buffer<unsigned char>(
    n * static_cast<std::size_t>(row_elements_) * element_size_, nullptr, resource);
  d_graph_    = device_buffer<std::uint32_t>(n * config_.graph_degree, nullptr, resource);
  d_ids_      = device_buffer<std::uint64_t>(n, nullptr, resource);
  d_deleted_  = device_buffer<std::uint8_t>(n, nullptr, resource);
  d_capacity_ = rows;
  if (arena_capacity_ > 0) { copy_rows(0, arena_capacity_); }
  device_stale_ = false;
}

INFERSCALE_INDEX_LINKAGE void graph_index::copy_rows(std::int64_t begin,
                                                     std::int64_t count,
                                                     unsigned parts)
{
  if (count <= 0) { return; }
  std::size_t const vb = static_cast<std::size_t>(row_elements_) * element_size_;
  if (parts & upload_vectors) {
    INFERSCALE_CUDA_TRY(cudaMemcpy(d_vectors_.data() + begin * vb,
                                   vectors_.data() + begin * vb,
                                   count * vb,
                                   cudaMemcpyHostToDevice));
    INFERSCALE_CUDA_TRY(cudaMemcpy(d_ids_.data() + begin,
                                   ids_.data() + begin,
                                   static_cast<std::size_t>(count) * 8,
                                   cudaMemcpyHostToDevice));
  }
  if (parts & upload_graph) {
    INFERSCALE_CUDA_TRY(cudaMemcpy(d_graph_.data() + begin * config_.graph_degree,
                                   graph_.data() + begin * config_.graph_degree,
                                   static_cast<std::size_t>(count) * config_.graph_degree * 4,
                                   cudaMemcpyHostToDevice));
  }
  if (parts & upload_flags) {
    INFERSCALE_CUDA_TRY(cudaMemcpy(d_deleted_.data() + begin,
                                   deleted_.data() + begin,
                                   static_cast<std::size_t>(count),
                                   cudaMemcpyHostToDevice));
  }
}

INFERSCALE_INDEX_LINKAGE void graph_index::upload_tenant(std::size_t t,
                                                         std::uint32_t first_new,
                                                         unsigned parts)
{
  if (config_.space != memory_space::device) { return; }
  if (device_stale_ || d_capacity_ < arena_capacity_) {
    reallocate_device();
    return;
  }
  auto const& tr = tenants_[t].ref;
  if (parts & upload_vectors) {
    copy_rows(
      tr.row_begin + first_new, std::int64_t{tr.size} - first_new, upload_vectors | upload_flags);
  }
  if (parts & upload_graph) { copy_rows(tr.row_begin, tr.size, upload_graph); }
  if (parts & upload_flags) { copy_rows(tr.row_begin, tenants_[t].capacity, upload_flags); }
}

}  // namespace inferscale
