/**
 * @file inject.hpp
 * @brief Injection (stored pre-RoPE facts -> an engine's paged KV cache, keys rotated to their
 * virtual positions) and extraction (the inverse), host backend; and the injection batch, the
 * validated, flattened work of one scheduler step shared with the device backend (inject.cuh).
 *
 * Flow: compose() a plan per request, add each plan with its slots to an injection_batch (which
 * resolves every token to its store page and checks the slots), then inject_host() (or
 * inject_async() on the device). Everything is validated before the first write; a refused call
 * leaves the store and the cache unchanged.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/detail/inject/token_major_keys.hpp>
#include <inferscale/detail/rope/rotate_simd.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

namespace inferscale {

/**
 * @brief Flattened per-token work of an injection, as three arrays of `num_tokens` entries in the
 * memory of the backend that reads them. Trivially copyable.
 */
struct injection_batch_view {
  std::int64_t const* store_token{};  ///< source: page * page_size + offset in the store's pool
  std::int64_t const* position{};     ///< virtual position the key is rotated to
  std::int64_t const* slot{};         ///< destination slot in the cache; negative = skip
  std::int64_t num_tokens{};
};

/**
 * @brief What the device injection skipped, counted by the kernel (device memory, zeroed by the
 * caller before the launch; pass null to skip silently). The host cannot read the device's
 * arrays before a launch, and a kernel cannot throw, so a token the host did not validate is
 * skipped (nothing of it is written) and counted here, to be read back after the launch:
 *  - `bad_slot`: slot at or beyond the cache's slots (a negative slot is a deliberate skip, not
 *    counted);
 *  - `bad_position`: position negative or at or beyond the cos/sin table's rows;
 *  - `bad_store_token`: store token outside the pool (`[0, num_pages * page_size)`);
 *  - `bad_scale`: (token, layer, head, K or V) rows not written because their fp8 scale is zero,
 *    negative or not finite.
 * A token is counted once, under the first failing check in the order slot, position, store
 * token. Counts are atomic increments, so any number of launches may share one.
 */
struct inject_device_errors {
  unsigned long long bad_slot{};
  unsigned long long bad_position{};
  unsigned long long bad_store_token{};
  unsigned long long bad_scale{};

  /// @brief Everything skipped (0 after a clean launch).
  INFERSCALE_HOST_DEVICE constexpr unsigned long long total() const noexcept
  {
    return bad_slot + bad_position + bad_store_token + bad_scale;
  }
};

namespace detail {
/**
 * @brief The slots a batch writes, to refuse a slot written twice: a bitmap for slots below 2^28
 * (32 MiB at most, grown as needed; engine caches hold far fewer slots), a hash set above.
 */
class slot_set {
 public:
  /// @brief Adds `slot` (>= 0); false if it was already there.
  bool insert(std::int64_t slot)
  {
    if (slot >= bitmap_limit) { return large_.insert(slot).second; }
    auto const word = static_cast<std::size_t>(slot >> 6);
    if (word >= bits_.size()) { bits_.resize(std::max(word + 1, 2 * bits_.size()), 0); }
    std::uint64_t const bit = std::uint64_t{1} << (slot & 63);
    if (bits_[word] & bit) { return false; }
    bits_[word] |= bit;
    return true;
  }
  /// @brief Removes every slot, keeping the bitmap's memory.
  void clear()
  {
    std::fill(bits_.begin(), bits_.end(), std::uint64_t{0});
    large_.clear();
  }
  /// @brief Removes `slot` (>= 0) if present.
  void erase(std::int64_t slot)
  {
    if (slot >= bitmap_limit) {
      large_.erase(slot);
      return;
    }
    auto const word = static_cast<std::size_t>(slot >> 6);
    if (word < bits_.size()) { bits_[word] &= ~(std::uint64_t{1} << (slot & 63)); }
  }

 private:
  static constexpr std::int64_t bitmap_limit = std::int64_t{1} << 28;
  std::vector<std::uint64_t> bits_;
  std::unordered_set<std::int64_t> large_;
};
}  // namespace detail

/**
 * @brief The validated work of one scheduler step: every admitted request's plan and slots,
 * flattened to (store token, position, slot) per memory token. Built on the host.
 *
 * A batch is tied to the store state it was built against: injecting after the store changed
 * (insert, erase) is refused, since pages may have been reused.
 */
class injection_batch {
 public:
  /// @brief An empty batch for facts of `store`.
  explicit injection_batch(kv_store const& store)
    : store_{&store}, store_identity_{store.identity()}, store_version_{store.version()}
  {
  }

  /// @brief Room for `tokens` tokens without reallocation (an engine keeps one batch per step
  /// loop: reserve once, clear() every step).
  void reserve(std::int64_t tokens)
  {
    auto const n = static_cast<std::size_t>(std::max<std::int64_t>(tokens, 0));
    store_token_.reserve(n);
    position_.reserve(n);
    slot_.reserve(n);
  }

  /// @brief Empties the batch, keeping its memory, and ties it to the store's current state.
  void clear()
  {
    store_token_.clear();
    position_.clear();
    slot_.clear();
    request_offsets_.assign(1, 0);
    slots_.clear();
    max_slot_       = -1;
    max_position_   = -1;
    store_identity_ = store_->identity();
    store_version_  = store_->version();
  }

  /**
   * @brief Adds a request whose memory tokens go to `slot_mapping[0 .. m-1]` (vLLM slot mapping;
   * entries past m belong to the query tokens the engine prefills and are not read).
   *
   * @throw logic_error if the store changed since the batch was made, a fact of the plan is not
   *        in the store (or shorter than the plan says), the plan's sources and tokens disagree,
   *        its first position is negative or its last overflows 64 bits, the mapping is null or
   *        has fewer than m entries, or a slot repeats within the batch; the batch is unchanged
   *        then. (Slots beyond the cache and positions beyond a table are refused at injection,
   *        which knows the cache and the rotation.)
   */
  void add(composition const& plan, std::vector<std::int64_t> const& slot_mapping)
  {
    add(plan, slot_mapping.data(), static_cast<std::int64_t>(slot_mapping.size()));
  }

  /// @brief As add(plan, slot_mapping) with a host array of `num_slots` slots.
  void add(composition const& plan, std::int64_t const* slot_mapping, std::int64_t num_slots)
  {
    check_store("injection_batch::add");
    std::int64_t const m = plan.length();
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(plan.sources.size()) == m,
                       "injection_batch::add: the plan has " +
                         detail::count_of(static_cast<std::int64_t>(plan.sources.size()), "source") +
                         " for " + detail::count_of(m, "token"));
    INFERSCALE_EXPECTS(num_slots >= m,
                       "injection_batch::add: the plan has " + detail::count_of(m, "token") +
                         " but only " + detail::count_of(num_slots, "slot") + " were given");
    INFERSCALE_EXPECTS(m == 0 || slot_mapping != nullptr,
                       std::string{"injection_batch::add: null slot mapping"});
    // A hand-built plan can hold any p0: its positions p0 .. p0 + m - 1 must be valid positions
    // (non-negative, no overflow) before they reach a rotation or an engine's cos/sin table.
    INFERSCALE_EXPECTS(
      m == 0 || (plan.first_position >= 0 &&
                 plan.first_position <= std::numeric_limits<std::int64_t>::max() - (m - 1)),
      "injection_batch::add: the plan's positions " + std::to_string(plan.first_position) +
        " .. p0 + " + std::to_string(m - 1) + " must be non-negative and fit 64 bits");

    // Resolve and check everything into temporaries first.
    std::vector<std::int64_t> store_tokens(static_cast<std::size_t>(m));
    std::vector<std::int64_t> new_slots;  // taken in slots_, given back if the request is refused
    new_slots.reserve(static_cast<std::size_t>(m));
    struct rollback {
      detail::slot_set& set;
      std::vector<std::int64_t> const& taken;
      bool committed = false;
      ~rollback()
      {
        if (!committed) {
          for (std::int64_t slot : taken) {
            set.erase(slot);
          }
        }
      }
    } undo{slots_, new_slots};
    std::uint64_t cached_id   = 0;
    fact_record const* cached = nullptr;
    std::int64_t max_slot     = max_slot_;
    for (std::int64_t j = 0; j < m; ++j) {
      token_source const& src = plan.sources[static_cast<std::size_t>(j)];
      if (cached == nullptr || cached_id != src.fact_id) {
        INFERSCALE_EXPECTS(store_->contains(src.fact_id),
                           "injection_batch::add: unknown fact id " + std::to_string(src.fact_id) +
                             " (token " + std::to_string(j) + " of the plan)");
        cached    = &store_->at(src.fact_id);
        cached_id = src.fact_id;
      }
      INFERSCALE_EXPECTS(src.offset >= 0 && src.offset < cached->length(),
                         "injection_batch::add: token " + std::to_string(j) + " reads offset " +
                           std::to_string(src.offset) + " of fact " + std::to_string(src.fact_id) +
                           ", which has " + detail::count_of(cached->length(), "token"));
      store_tokens[static_cast<std::size_t>(j)] = store_->store_token(*cached, src.offset);
      std::int64_t const slot                   = slot_mapping[j];
      if (slot >= 0) {
        INFERSCALE_EXPECTS(
          slots_.insert(slot),
          "injection_batch::add: slot " + std::to_string(slot) + " is written twice in this batch");
        new_slots.push_back(slot);
        max_slot = std::max(max_slot, slot);
      }
    }
    std::int64_t const last_position = m > 0 ? plan.position(m - 1) : -1;

    // Commit.
    store_token_.insert(store_token_.end(), store_tokens.begin(), store_tokens.end());
    slot_.insert(slot_.end(), slot_mapping, slot_mapping + m);
    std::size_t const first = position_.size();
    position_.resize(first + static_cast<std::size_t>(m));
    for (std::int64_t j = 0; j < m; ++j) {
      position_[first + static_cast<std::size_t>(j)] = plan.position(j);
    }
    undo.committed = true;
    max_slot_      = max_slot;
    max_position_  = std::max(max_position_, last_position);
    request_offsets_.push_back(num_tokens());
  }

  /**
   * @brief Adds a request whose memory tokens are prompt tokens `start_position ..
   * start_position + m - 1` of a request with block table `block_ids` (slot rule of
   * slots_from_block_table).
   * @throw logic_error as add(plan, slot_mapping), or if the table is too short.
   */
  void add(composition const& plan,
           std::int32_t const* block_ids,
           std::int64_t num_block_ids,
           std::int32_t block_size,
           std::int64_t start_position)
  {
    add(
      plan,
      slots_from_block_table(block_ids, num_block_ids, block_size, start_position, plan.length()));
  }

  std::int64_t num_tokens() const noexcept { return static_cast<std::int64_t>(slot_.size()); }
  std::int64_t num_requests() const noexcept
  {
    return static_cast<std::int64_t>(request_offsets_.size()) - 1;
  }
  /// @brief Request r's tokens are `[request_offsets()[r], request_offsets()[r+1])`.
  std::vector<std::int64_t> const& request_offsets() const noexcept { return request_offsets_; }
  std::vector<std::int64_t> const& store_tokens() const noexcept { return store_token_; }
  std::vector<std::int64_t> const& positions() const noexcept { return position_; }
  std::vector<std::int64_t> const& slots() const noexcept { return slot_; }
  /// @brief Largest non-negative slot (-1 if none).
  std::int64_t max_slot() const noexcept { return max_slot_; }
  /// @brief Largest virtual position (-1 if none).
  std::int64_t max_position() const noexcept { return max_position_; }

  /// @brief The store the batch reads from.
  kv_store const& store() const noexcept { return *store_; }

  /// @brief The three arrays in host memory.
  injection_batch_view host_view() const noexcept
  {
    return {store_token_.data(), position_.data(), slot_.data(), num_tokens()};
  }

  /// @brief Throws unless the store is the same object in the same state as when the batch began.
  void check_store(char const* who) const
  {
    INFERSCALE_EXPECTS(store_->identity() == store_identity_ && store_->version() == store_version_,
                       std::string{who} +
                         ": the store changed since this injection batch was made (facts "
                         "inserted or erased); build a new batch");
  }

 private:
  kv_store const* store_;
  std::uint64_t store_identity_;
  std::uint64_t store_version_;
  std::vector<std::int64_t> store_token_;
  std::vector<std::int64_t> position_;
  std::vector<std::int64_t> slot_;
  std::vector<std::int64_t> request_offsets_{0};
  detail::slot_set slots_;
  std::int64_t max_slot_{-1};
  std::int64_t max_position_{-1};
};

namespace detail {

/// @brief Checks that a store shard and a cache describe the same heads, layers and head_dim.
inline void check_store_cache_geometry(kv_store const& store,
                                       paged_kv_cache const& cache,
                                       char const* who)
{
  cache.validate();
  kv_geometry const g = store.geometry();
  INFERSCALE_EXPECTS(
    cache.num_layers == g.num_layers && cache.num_heads() == g.num_kv_heads &&
      cache.head_dim() == g.head_dim,
    std::string{who} + ": geometry mismatch: the store holds " +
      detail::count_of(g.num_layers, "layer") + " x " + detail::count_of(g.num_kv_heads, "head") +
      " x " + std::to_string(g.head_dim) +
      ", the cache " + std::to_string(cache.num_layers) + " x " +
      std::to_string(cache.num_heads()) + " x " + std::to_string(cache.head_dim()));
}

/// @brief Whether a rotation asks for vLLM's AVX2 CPU conversion (rope_cos_sin_table).
template <class Rotation>
constexpr bool truncates_to_bfloat16(Rotation const&) noexcept
{
  return false;
}
template <class U>
constexpr bool truncates_to_bfloat16(rope_cos_sin_table<U> const& table) noexcept
{
  return table.truncate_to_bfloat16;
}

/// @brief fp32 -> bfloat16 by truncation (the upper 16 bits; NaN stays NaN).
inline bfloat16_t bfloat16_toward_zero(float x) noexcept
{
  if (x != x) { return from_float<bfloat16_t>(x); }
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  std::uint16_t const top = static_cast<std::uint16_t>(bits >> 16);
  bfloat16_t out;
  std::memcpy(&out, &top, sizeof out);
  return out;
}

/// @brief Checks a rotation against a head_dim and the largest position it will be asked for.
template <class Rotation>
void check_rotation(Rotation const& rotation,
                    std::int32_t head_dim,
                    std::int64_t max_position,
                    char const* who)
{
  rope_check_rotation(rotation);
  INFERSCALE_EXPECTS(rotation.head_dim == head_dim,
                     std::string{who} + ": the rotation's head_dim " +
                       std::to_string(rotation.head_dim) + " differs from the store's " +
                       std::to_string(head_dim));
  INFERSCALE_EXPECTS(rotation.rotary_dim > 0 && rotation.rotary_dim % 2 == 0 &&
                       rotation.rotary_dim <= head_dim &&
                       rotation.rotary_dim / 2 <= rope_params::max_pairs,
                     std::string{who} + ": rotary_dim " + std::to_string(rotation.rotary_dim) +
                       " must be even, positive, at most head_dim and at most " +
                       std::to_string(2 * rope_params::max_pairs));
  INFERSCALE_EXPECTS(max_position < rope_table_rows(rotation),
                     std::string{who} + ": position " + std::to_string(max_position) +
                       " is beyond the cos/sin table (" +
                       detail::count_of(rope_table_rows(rotation), "row") + ")");
}

/// @brief Everything inject_host and inject_async check before writing.
template <class Rotation>
void check_injection(kv_store const& store,
                     injection_batch const& batch,
                     paged_kv_cache const& cache,
                     Rotation const& rotation,
                     memory_kind backend,
                     char const* who)
{
  INFERSCALE_EXPECTS(&batch.store() == &store,
                     std::string{who} + ": the batch was built for a different store");
  batch.check_store(who);
  INFERSCALE_EXPECTS(store.memory() == backend,
                     std::string{who} + ": the store's pool is in " + to_string(store.memory()) +
                       " memory, this backend reads " + to_string(backend) + " memory");
  check_store_cache_geometry(store, cache, who);
  INFERSCALE_EXPECTS(batch.max_slot() < cache.num_slots(),
                     std::string{who} + ": slot " + std::to_string(batch.max_slot()) +
                       " is beyond the cache's " + detail::count_of(cache.num_slots(), "slot"));
  check_rotation(rotation, store.geometry().head_dim, batch.max_position(), who);
  if (truncates_to_bfloat16(rotation)) {
    INFERSCALE_EXPECTS(backend == memory_kind::host && cache.cache_dtype == dtype::bfloat16 &&
                         cache.scale_granularity == kv_scale_granularity::none,
                       std::string{who} +
                         ": truncate_to_bfloat16 (vLLM's AVX2 CPU rotary kernel) applies to "
                         "unscaled bfloat16 caches on the host backend; this is a " +
                         to_string(cache.cache_dtype) + " cache on the " + to_string(backend) +
                         " backend");
  }
  // The host backend reads its scales from host memory: check their values. The device backend's
  // scales are device memory the host does not read; its kernel skips and counts a row whose
  // scale is not positive and finite (inject_device_errors).
  if (backend == memory_kind::host) { cache.check_scale_values(who); }
}

/// @brief Offset of dim `d` within a head (the part of paged_kv_layout::offset that depends on d).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::int64_t dim_offset(paged_kv_layout const& layout,
                                                                      std::int32_t d)
{
  // One chunk (every layout but vLLM's legacy keys): d < head_dim, so d / dim_chunk is 0 and no
  // division per element is needed (vLLM's CPU keys, dims block_size apart, take this path).
  if (layout.dim_chunk == layout.head_dim) { return static_cast<std::int64_t>(d) * layout.dim_stride; }
  return static_cast<std::int64_t>(d / layout.dim_chunk) * layout.chunk_stride +
         static_cast<std::int64_t>(d % layout.dim_chunk) * layout.dim_stride;
}

/// @brief True if a head's dims are contiguous in the layout (offset of dim d is d).
inline bool dims_contiguous(paged_kv_layout const& layout)
{
  return layout.dim_stride == 1 && layout.dim_chunk == layout.head_dim;
}

/**
 * @brief Host backend of one (token, layer, head): the same per-element math as the kernel
 * (detail/inject/element.hpp). `ContiguousK`/`ContiguousV`: the head's dims are contiguous in the
 * cache (address of dim d = head address + d, no division per element); `Scaled`: fp8 scales apply;
 * `Halves`/`RoundEach`: the rotation's pairing and vLLM-table rounding, hoisted out of the loops so
 * the common case is a branch-free loop over restrict pointers the compiler can vectorise.
 */
template <bool ContiguousK,
          bool ContiguousV,
          bool Scaled,
          bool Halves,
          bool RoundEach,
          bool Fused,
          class StoreT,
          class CacheT,
          bool Truncate = false>
INFERSCALE_FORCEINLINE void inject_host_head(StoreT const* __restrict k,
                                             StoreT const* __restrict v,
                                             CacheT* __restrict kdst,
                                             CacheT* __restrict vdst,
                                             paged_kv_layout const& key_layout,
                                             paged_kv_layout const& value_layout,
                                             std::int32_t rotary,
                                             rope_cos_sin const* __restrict cos_sin,
                                             float key_scale,
                                             float value_scale,
                                             kv_scale_convention convention)
{
  std::int32_t const dim   = key_layout.head_dim;
  std::int32_t const pairs = rotary / 2;
  auto const kat           = [&](std::int32_t d) -> CacheT& {
    return ContiguousK ? kdst[d] : kdst[dim_offset(key_layout, d)];
  };
  auto const vat = [&](std::int32_t d) -> CacheT& {
    return ContiguousV ? vdst[d] : vdst[dim_offset(value_layout, d)];
  };
  for (std::int32_t p = 0; p < pairs; ++p) {
    std::int32_t const first  = Halves ? p : 2 * p;
    std::int32_t const second = Halves ? p + pairs : 2 * p + 1;
    float x, y;
    if constexpr (Truncate) {
      static_assert(std::is_same_v<CacheT, bfloat16_t> && !Scaled);
      rotate_fp32(to_float(k[first]), to_float(k[second]), cos_sin[p], &x, &y);
      kat(first)  = bfloat16_toward_zero(x);
      kat(second) = bfloat16_toward_zero(y);
      continue;
    } else if constexpr (Fused) {
      rotate_fp32_fused(to_float(k[first]), to_float(k[second]), cos_sin[p], &x, &y);
    } else if constexpr (RoundEach) {
      rotate_stored_pair(k[first], k[second], cos_sin[p], true, &x, &y);
    } else {
      rotate_fp32(to_float(k[first]), to_float(k[second]), cos_sin[p], &x, &y);
    }
    kat(first)  = convert_rotated<CacheT>(x, Scaled, key_scale, convention);
    kat(second) = convert_rotated<CacheT>(y, Scaled, key_scale, convention);
  }
  for (std::int32_t d = rotary; d < dim; ++d) {
    kat(d) = convert_stored<CacheT>(k[d], Scaled, key_scale, convention);
  }
  if constexpr (ContiguousV && !Scaled && std::is_same_v<StoreT, CacheT>) {
    std::memcpy(vdst, v, static_cast<std::size_t>(dim) * sizeof(StoreT));
  } else {
    for (std::int32_t d = 0; d < dim; ++d) {
      vat(d) = convert_stored<CacheT>(v[d], Scaled, value_scale, convention);
    }
  }
}

/// @brief Host backend of injection for element types StoreT (store) and CacheT (cache).
template <bool ContiguousK,
          bool ContiguousV,
          bool Scaled,
          bool Halves,
          bool RoundEach,
          bool Fused,
          class StoreT,
          class CacheT,
          class Rotation,
          bool Truncate = false>
INFERSCALE_FORCEINLINE void inject_host_typed(kv_store_ref const& store,
                                              injection_batch_view const& batch,
                                              paged_kv_cache const& cache,
                                              Rotation const& rotation)
{
  std::int32_t const pairs   = rotation.num_pairs();
  std::int32_t const dim     = store.head_dim;
  auto const* const pool     = static_cast<StoreT const*>(store.pool);
  std::int64_t const n_slots = cache.num_slots();
  std::int32_t const bs      = cache.key_layout.block_size;
  // Tokens in chunks, and within a chunk layer by layer: consecutive tokens of one (layer, head)
  // write neighbouring elements of the cache where a layout interleaves tokens (vLLM's CPU keys,
  // `[head_dim, block_size]` per block: token t of dim d sits beside token t + 1), so they share
  // cache lines instead of each touching head_dim lines the next token's visit no longer finds in
  // cache after a sweep over every layer (bench/vllm/inject_cost.py). The cos/sin rows
  // of a chunk are computed once, shared by its layers and heads. The values written are the same.
  constexpr std::int64_t chunk_tokens = 64;
  std::vector<rope_cos_sin> cos_sin(static_cast<std::size_t>(chunk_tokens * pairs));
  std::vector<std::int64_t> block(static_cast<std::size_t>(chunk_tokens));
  std::vector<std::int32_t> in_block(static_cast<std::size_t>(chunk_tokens));
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk_tokens) {
    std::int64_t const count = std::min(chunk_tokens, batch.num_tokens - first);
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t const slot = batch.slot[first + j];
      if (!slot_in_cache(slot, n_slots)) { continue; }
      block[j]    = slot / bs;
      in_block[j] = static_cast<std::int32_t>(slot % bs);
      detail::rope_cos_sin_row(
        rotation, batch.position[first + j], rope_op::forward, cos_sin.data() + j * pairs);
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      auto* const kbase = static_cast<CacheT*>(cache.key_base[l]);
      auto* const vbase = static_cast<CacheT*>(cache.value_base[l]);
      for (std::int64_t j = 0; j < count; ++j) {
        std::int64_t const i = first + j;
        if (!slot_in_cache(batch.slot[i], n_slots)) { continue; }
        StoreT const* const krow = pool + store.row_offset(batch.store_token[i], l, 0);
        StoreT const* const vrow = pool + store.row_offset(batch.store_token[i], l, 1);
        for (std::int32_t h = 0; h < store.num_heads; ++h) {
          inject_host_head<ContiguousK, ContiguousV, Scaled, Halves, RoundEach, Fused, StoreT,
                           CacheT, Truncate>(
            krow + static_cast<std::int64_t>(h) * dim,
            vrow + static_cast<std::int64_t>(h) * dim,
            kbase + cache.key_layout.offset(block[j], in_block[j], h, 0),
            vbase + cache.value_layout.offset(block[j], in_block[j], h, 0),
            cache.key_layout,
            cache.value_layout,
            rotation.rotary_dim,
            cos_sin.data() + j * pairs,
            cache.scale(l, h, false),
            cache.scale(l, h, true),
            cache.scale_convention);
        }
      }
    }
  }
}

/// @brief True if a layout's keys are token-major within a block: one chunk of dims, token t + 1
/// right after token t (vLLM's CPU keys, `[head_dim, block_size]` per block and head).
inline bool keys_token_major(paged_kv_layout const& layout)
{
  return layout.token_stride == 1 && layout.dim_chunk == layout.head_dim && layout.block_size > 1;
}

#if INFERSCALE_HOST_X86_SIMD
/**
 * @brief inject_host_typed with vLLM's truncating rotation for token-major keys and contiguous
 * values (vLLM's CPU cache) on a CPU with AVX2: runs of eight consecutive slots of one block go
 * through simd::inject8_token_major_truncate (eight tokens per vector, one 16-byte store per dim);
 * any other token through the scalar loop's inject_host_head. The same bits as the scalar loop.
 */
template <bool Halves, class StoreT, class Rotation>
void inject_host_token_major_truncate(kv_store_ref const& store,
                                      injection_batch_view const& batch,
                                      paged_kv_cache const& cache,
                                      Rotation const& rotation)
{
  std::int32_t const pairs   = rotation.num_pairs();
  std::int32_t const dim     = store.head_dim;
  auto const* const pool     = static_cast<StoreT const*>(store.pool);
  std::int64_t const n_slots = cache.num_slots();
  std::int32_t const bs      = cache.key_layout.block_size;
  constexpr std::int64_t chunk_tokens = 64;  // chunks as inject_host_typed's, for the same reason
  std::vector<rope_cos_sin> cos_sin(static_cast<std::size_t>(chunk_tokens * pairs));
  // [token][pair] per token, and [run][pair][8] for the runs of eight.
  std::vector<float> cos(static_cast<std::size_t>(chunk_tokens * pairs));
  std::vector<float> sin(static_cast<std::size_t>(chunk_tokens * pairs));
  std::vector<float> cos8(cos.size()), sin8(sin.size());
  std::vector<std::int64_t> run_start;  // first token (in the chunk) of each run of eight
  std::vector<std::int64_t> single;     // tokens not in a run
  std::vector<StoreT const*> krows(8), vrows(8);
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk_tokens) {
    std::int64_t const count = std::min(chunk_tokens, batch.num_tokens - first);
    run_start.clear();
    single.clear();
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t const slot = batch.slot[first + j];
      if (!slot_in_cache(slot, n_slots)) { continue; }
      rope_cos_sin_row(rotation, batch.position[first + j], rope_op::forward,
                       cos.data() + j * pairs, sin.data() + j * pairs);
      for (std::int32_t p = 0; p < pairs; ++p) {
        cos_sin[static_cast<std::size_t>(j * pairs + p)] = {cos[j * pairs + p], sin[j * pairs + p]};
      }
    }
    for (std::int64_t j = 0; j < count;) {
      std::int64_t const slot = batch.slot[first + j];
      bool run = j + 8 <= count && slot_in_cache(slot, n_slots) && slot % bs + 8 <= bs;
      for (std::int64_t t = 1; run && t < 8; ++t) { run = batch.slot[first + j + t] == slot + t; }
      if (!run) {
        if (slot_in_cache(slot, n_slots)) { single.push_back(j); }
        ++j;
        continue;
      }
      std::size_t const r = run_start.size();
      for (std::int32_t p = 0; p < pairs; ++p) {
        for (std::int64_t t = 0; t < 8; ++t) {
          cos8[r * pairs * 8 + p * 8 + t] = cos[(j + t) * pairs + p];
          sin8[r * pairs * 8 + p * 8 + t] = sin[(j + t) * pairs + p];
        }
      }
      run_start.push_back(j);
      j += 8;
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      auto* const kbase = static_cast<bfloat16_t*>(cache.key_base[l]);
      auto* const vbase = static_cast<bfloat16_t*>(cache.value_base[l]);
      for (std::size_t r = 0; r < run_start.size(); ++r) {
        std::int64_t const i0       = first + run_start[r];
        std::int64_t const block    = batch.slot[i0] / bs;
        std::int32_t const in_block = static_cast<std::int32_t>(batch.slot[i0] % bs);
        for (std::int32_t h = 0; h < store.num_heads; ++h) {
          for (int t = 0; t < 8; ++t) {
            std::int64_t const token = batch.store_token[i0 + t];
            krows[t] = pool + store.row_offset(token, l, 0) + static_cast<std::int64_t>(h) * dim;
            vrows[t] = pool + store.row_offset(token, l, 1) + static_cast<std::int64_t>(h) * dim;
          }
          simd::inject8_token_major_truncate<StoreT>(
            krows.data(),
            vrows.data(),
            kbase + cache.key_layout.offset(block, in_block, h, 0),
            cache.key_layout.dim_stride,
            vbase + cache.value_layout.offset(block, in_block, h, 0),
            cache.value_layout.token_stride,
            dim,
            rotation.rotary_dim,
            Halves,
            cos8.data() + r * pairs * 8,
            sin8.data() + r * pairs * 8);
        }
      }
      for (std::int64_t const j : single) {
        std::int64_t const i        = first + j;
        std::int64_t const block    = batch.slot[i] / bs;
        std::int32_t const in_block = static_cast<std::int32_t>(batch.slot[i] % bs);
        StoreT const* const krow    = pool + store.row_offset(batch.store_token[i], l, 0);
        StoreT const* const vrow    = pool + store.row_offset(batch.store_token[i], l, 1);
        for (std::int32_t h = 0; h < store.num_heads; ++h) {
          inject_host_head<false, true, false, Halves, false, false, StoreT, bfloat16_t, true>(
            krow + static_cast<std::int64_t>(h) * dim,
            vrow + static_cast<std::int64_t>(h) * dim,
            kbase + cache.key_layout.offset(block, in_block, h, 0),
            vbase + cache.value_layout.offset(block, in_block, h, 0),
            cache.key_layout,
            cache.value_layout,
            rotation.rotary_dim,
            cos_sin.data() + j * pairs,
            1.0f,
            1.0f,
            cache.scale_convention);
        }
      }
    }
  }
}
#endif  // INFERSCALE_HOST_X86_SIMD

#if INFERSCALE_HOST_X86_SIMD
namespace simd {

/**
 * @brief One scaling of quantize, prepared for a row: `x / scale` or `x * scale` as the
 * convention says. A division by a power of two whose reciprocal is a normal float is the
 * multiplication by that reciprocal: both are the correctly rounded value of the same real
 * product `x 2^-k` (flush-to-zero and denormals-are-zero modes treat both alike), and a vector
 * multiplication costs a fraction of a division (vLLM's uncalibrated scale is 1).
 */
struct scale_step {
  float factor{1.0f};
  bool divide{false};

  scale_step() = default;
  scale_step(float scale, kv_scale_convention convention)
  {
    std::uint32_t const bits     = float_bits(scale);
    std::uint32_t const exponent = (bits >> 23) & 0xffu;
    bool const power_of_two = (bits & 0x807fffffu) == 0 && exponent >= 1 && exponent <= 253;
    if (convention == kv_scale_convention::multiply) {
      factor = scale;
    } else if (power_of_two) {
      factor = bits_to_float((254u - exponent) << 23);  // 2^-k
    } else {
      factor = scale;
      divide = true;
    }
  }
};

/// @brief Scales (when `Scaled`) fp32 lanes as quantize does, before the rounding to the cache dtype.
template <bool Scaled>
INFERSCALE_TARGET_AVX2 inline __m256 apply_scale(__m256 x, scale_step const& step)
{
  if constexpr (!Scaled) {
    return x;
  } else {
    __m256 const f = _mm256_set1_ps(step.factor);
    return step.divide ? _mm256_div_ps(x, f) : _mm256_mul_ps(x, f);
  }
}

/// @brief `n` stored elements as the cache holds them (convert_stored, eight at a time): bytes
/// copied when the dtypes match and there is no scale.
template <bool Scaled, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX2 inline void convert_row(StoreT const* __restrict src,
                                               CacheT* __restrict dst,
                                               std::int32_t n,
                                               scale_step const& step)
{
  if constexpr (!Scaled && std::is_same_v<StoreT, CacheT>) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(StoreT));
  } else {
    for (std::int32_t d = 0; d < n; d += 8) {
      std::int32_t const count = n - d < 8 ? n - d : 8;
      store_n(dst + d, apply_scale<Scaled>(load_n(src + d, count), step), count);
    }
  }
}

/**
 * @brief The vector form of inject_host_head for contiguous dims and the halves pairing: every
 * head of one token in one layer (keys rotated by `cos`/`sin`, one entry per pair, scaled and
 * converted; values converted). With `Scaled`, `key_steps` / `value_steps` hold the layer's
 * scaling of each head (prepared once per call; unused otherwise).
 */
template <bool Scaled, rotate_mode Mode, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX2 void inject_token(kv_store_ref const& store,
                  std::int64_t store_token,
                  paged_kv_cache const& cache,
                  std::int32_t layer,
                  std::int64_t block,
                  std::int32_t in_block,
                  std::int32_t rotary,
                  float const* cos,
                  float const* sin,
                  scale_step const* key_steps,
                  scale_step const* value_steps)
{
  std::int32_t const dim  = store.head_dim;
  std::int32_t const half = rotary / 2;
  auto const* const pool  = static_cast<StoreT const*>(store.pool);
  {
    std::int32_t const l     = layer;
    StoreT const* const krow = pool + store.row_offset(store_token, l, 0);
    StoreT const* const vrow = pool + store.row_offset(store_token, l, 1);
    auto* const kbase        = static_cast<CacheT*>(cache.key_base[l]);
    auto* const vbase        = static_cast<CacheT*>(cache.value_base[l]);
    for (std::int32_t h = 0; h < store.num_heads; ++h) {
      StoreT const* const k = krow + static_cast<std::int64_t>(h) * dim;
      CacheT* const kdst    = kbase + cache.key_layout.offset(block, in_block, h, 0);
      scale_step const key_scale = Scaled ? key_steps[h] : scale_step{};
      for (std::int32_t p = 0; p < half; p += 8) {
        std::int32_t const n = half - p < 8 ? half - p : 8;
        __m256 x, y;
        rotate8<Mode, StoreT>(
          load_n(k + p, n), load_n(k + half + p, n), load_n(cos + p, n), load_n(sin + p, n), &x, &y);
        store_n(kdst + p, apply_scale<Scaled>(x, key_scale), n);
        store_n(kdst + half + p, apply_scale<Scaled>(y, key_scale), n);
      }
      if (rotary < dim) {
        convert_row<Scaled>(k + rotary, kdst + rotary, dim - rotary, key_scale);
      }
      convert_row<Scaled>(vrow + static_cast<std::int64_t>(h) * dim,
                          vbase + cache.value_layout.offset(block, in_block, h, 0),
                          dim,
                          Scaled ? value_steps[h] : scale_step{});
    }
  }
}

}  // namespace simd

namespace simd512 {

using simd::scale_step;

/// @brief As simd::apply_scale, sixteen lanes.
template <bool Scaled>
INFERSCALE_TARGET_AVX512 inline __m512 apply_scale(__m512 x, scale_step const& step)
{
  if constexpr (!Scaled) {
    return x;
  } else {
    __m512 const f = _mm512_set1_ps(step.factor);
    return step.divide ? _mm512_div_ps(x, f) : _mm512_mul_ps(x, f);
  }
}

/// @brief `n` stored elements as the cache holds them (convert_stored, sixteen at a time): bytes
/// copied when the dtypes match and there is no scale.
template <bool Scaled, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX512 inline void convert_row(StoreT const* __restrict src,
                                               CacheT* __restrict dst,
                                               std::int32_t n,
                                               scale_step const& step)
{
  if constexpr (!Scaled && std::is_same_v<StoreT, CacheT>) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(StoreT));
  } else {
    for (std::int32_t d = 0; d < n; d += 16) {
      std::int32_t const count = n - d < 16 ? n - d : 16;
      store_n(dst + d, simd512::apply_scale<Scaled>(load_n(src + d, count), step), count);
    }
  }
}

/**
 * @brief The vector form of inject_host_head (sixteen lanes) for contiguous dims and the halves
 * pairing: every head of one token in one layer (keys rotated by `cos`/`sin`, one entry per
 * pair, scaled and converted; values converted; `key_steps` / `value_steps` as simd::inject_token).
 */
template <bool Scaled, rotate_mode Mode, class StoreT, class CacheT>
INFERSCALE_TARGET_AVX512 void inject_token(kv_store_ref const& store,
                                           std::int64_t store_token,
                                           paged_kv_cache const& cache,
                                           std::int32_t layer,
                                           std::int64_t block,
                                         std::int32_t in_block,
                                         std::int32_t rotary,
                                         float const* cos,
                                         float const* sin,
                                         scale_step const* key_steps,
                                         scale_step const* value_steps)
{
  std::int32_t const dim  = store.head_dim;
  std::int32_t const half = rotary / 2;
  auto const* const pool  = static_cast<StoreT const*>(store.pool);
  {
    std::int32_t const l     = layer;
    StoreT const* const krow = pool + store.row_offset(store_token, l, 0);
    StoreT const* const vrow = pool + store.row_offset(store_token, l, 1);
    auto* const kbase        = static_cast<CacheT*>(cache.key_base[l]);
    auto* const vbase        = static_cast<CacheT*>(cache.value_base[l]);
    for (std::int32_t h = 0; h < store.num_heads; ++h) {
      StoreT const* const k = krow + static_cast<std::int64_t>(h) * dim;
      CacheT* const kdst    = kbase + cache.key_layout.offset(block, in_block, h, 0);
      scale_step const key_scale = Scaled ? key_steps[h] : scale_step{};
      for (std::int32_t p = 0; p < half; p += 16) {
        std::int32_t const n = half - p < 16 ? half - p : 16;
        __m512 x, y;
        rotate16<Mode, StoreT>(
          load_n(k + p, n), load_n(k + half + p, n), load_n(cos + p, n), load_n(sin + p, n), &x, &y);
        store_n(kdst + p, simd512::apply_scale<Scaled>(x, key_scale), n);
        store_n(kdst + half + p, simd512::apply_scale<Scaled>(y, key_scale), n);
      }
      if (rotary < dim) {
        simd512::convert_row<Scaled>(k + rotary, kdst + rotary, dim - rotary, key_scale);
      }
      simd512::convert_row<Scaled>(vrow + static_cast<std::int64_t>(h) * dim,
                          vbase + cache.value_layout.offset(block, in_block, h, 0),
                          dim,
                          Scaled ? value_steps[h] : scale_step{});
    }
  }
}

}  // namespace simd512

/**
 * @brief inject_host_typed for contiguous dims and the halves pairing on a CPU with AVX-512F or
 * AVX2 (`level`, chosen at run time): cos/sin once per token (shared by every layer and head, as
 * in the scalar loop), then layer by layer over a chunk of tokens, 16 or 8 pairs at a time. Same
 * bits as the scalar loop.
 */
template <bool Scaled, bool RoundEach, bool Fused, class StoreT, class CacheT, class Rotation>
void inject_host_typed_simd(kv_store_ref const& store,
                            injection_batch_view const& batch,
                            paged_kv_cache const& cache,
                            Rotation const& rotation,
                            host_simd level)
{
  using simd::rotate_mode;
  constexpr rotate_mode mode = Fused       ? rotate_mode::fused
                               : RoundEach ? rotate_mode::round_each
                                           : rotate_mode::fp32;
  // Tokens in chunks whose cos/sin (8 bytes per pair) stay in the L2; within a chunk, layer by
  // layer: a fact's tokens sit next to each other in a store page and, in order, in a cache
  // block, so each layer of a chunk reads and writes long runs instead of 2 KiB rows strided by
  // the layer pitch. cos/sin are still computed once per token and pair.
  constexpr std::int64_t chunk = 256;
  std::int32_t const pairs     = rotation.num_pairs();
  std::int64_t const n_slots   = cache.num_slots();
  std::int32_t const bs        = cache.key_layout.block_size;
  std::vector<float> cos(static_cast<std::size_t>(chunk * pairs));
  std::vector<float> sin(static_cast<std::size_t>(chunk * pairs));
  // The scalings of every layer and head, prepared once (keys of layer l at 2 l H, values after).
  std::int32_t const heads = store.num_heads;
  std::vector<simd::scale_step> steps(Scaled ? static_cast<std::size_t>(2 * cache.num_layers * heads)
                                             : 0);
  for (std::int32_t l = 0; Scaled && l < cache.num_layers; ++l) {
    for (std::int32_t h = 0; h < heads; ++h) {
      steps[static_cast<std::size_t>(2 * l * heads + h)] =
        simd::scale_step{cache.scale(l, h, false), cache.scale_convention};
      steps[static_cast<std::size_t>((2 * l + 1) * heads + h)] =
        simd::scale_step{cache.scale(l, h, true), cache.scale_convention};
    }
  }
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk) {
    std::int64_t const last = std::min(batch.num_tokens, first + chunk);
    for (std::int64_t i = first; i < last; ++i) {
      if (!slot_in_cache(batch.slot[i], n_slots)) { continue; }
      std::size_t const row = static_cast<std::size_t>((i - first) * pairs);
      detail::rope_cos_sin_row(
        rotation, batch.position[i], rope_op::forward, cos.data() + row, sin.data() + row);
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      for (std::int64_t i = first; i < last; ++i) {
        std::int64_t const slot = batch.slot[i];
        if (!slot_in_cache(slot, n_slots)) { continue; }
        std::size_t const row       = static_cast<std::size_t>((i - first) * pairs);
        std::int64_t const block    = slot / bs;
        std::int32_t const in_block = static_cast<std::int32_t>(slot % bs);
        if (uses_avx512(level)) {
          simd512::inject_token<Scaled, mode, StoreT, CacheT>(store,
                                                              batch.store_token[i],
                                                              cache,
                                                              l,
                                                              block,
                                                              in_block,
                                                              rotation.rotary_dim,
                                                              cos.data() + row,
                                                              sin.data() + row,
                                                              steps.data() + 2 * l * heads,
                                                              steps.data() + (2 * l + 1) * heads);
        } else {
          simd::inject_token<Scaled, mode, StoreT, CacheT>(store,
                                                           batch.store_token[i],
                                                           cache,
                                                           l,
                                                           block,
                                                           in_block,
                                                           rotation.rotary_dim,
                                                           cos.data() + row,
                                                           sin.data() + row,
                                                           steps.data() + 2 * l * heads,
                                                           steps.data() + (2 * l + 1) * heads);
        }
      }
    }
  }
}
#endif  // INFERSCALE_HOST_X86_SIMD

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__FMA__) && \
  !defined(__CUDA_ARCH__)
#define INFERSCALE_HOST_FMA_DISPATCH 1
/**
 * @brief The fused-multiply-add injection compiled for CPUs with FMA (chosen at run time): without
 * it a baseline x86-64 build computes each `std::fma` by a library call. Same results either way
 * (fma is exactly rounded); only the speed differs.
 */
template <bool ContiguousK,
          bool ContiguousV,
          bool Scaled,
          bool Halves,
          bool RoundEach,
          class StoreT,
          class CacheT,
          class Rotation>
__attribute__((target("fma"))) void inject_host_typed_fma(kv_store_ref const& store,
                                                          injection_batch_view const& batch,
                                                          paged_kv_cache const& cache,
                                                          Rotation const& rotation)
{
  inject_host_typed<ContiguousK, ContiguousV, Scaled, Halves, RoundEach, true, StoreT, CacheT>(
    store, batch, cache, rotation);
}
#else
#define INFERSCALE_HOST_FMA_DISPATCH 0
#endif

/// @brief Calls f(std::true_type) or f(std::false_type) as `value` says; only the latter when
/// the flag cannot be true for these types (`Possible == false`), to instantiate less.
template <bool Possible = true, class F>
void with_flag(bool value, F&& f)
{
  if constexpr (Possible) {
    if (value) {
      f(std::true_type{});
      return;
    }
  }
  f(std::false_type{});
}

template <class Rotation>
struct is_cos_sin_table : std::false_type {
};
template <class U>
struct is_cos_sin_table<rope_cos_sin_table<U>> : std::true_type {
};

/// @brief Turns the host loop's runtime switches into template parameters (one place).
template <class StoreT, class CacheT, class Rotation>
void dispatch_host_inject(kv_store_ref const& store,
                          injection_batch_view const& batch,
                          paged_kv_cache const& cache,
                          Rotation const& rotation)
{
  constexpr bool fp8 =
    std::is_same_v<CacheT, float8_e4m3_t> || std::is_same_v<CacheT, float8_e5m2_t>;
  constexpr bool may_round = is_cos_sin_table<Rotation>::value && !std::is_same_v<StoreT, float>;
  constexpr bool may_fuse  = is_cos_sin_table<Rotation>::value;
  bool const contiguous = dims_contiguous(cache.key_layout) && dims_contiguous(cache.value_layout);
  if constexpr (is_cos_sin_table<Rotation>::value && std::is_same_v<CacheT, bfloat16_t>) {
    if (truncates_to_bfloat16(rotation)) {  // checked: unscaled bfloat16 cache
#if INFERSCALE_HOST_X86_SIMD
      if (!contiguous && keys_token_major(cache.key_layout) &&
          dims_contiguous(cache.value_layout) && store.head_dim % 8 == 0 &&
          store.head_dim <= simd::token_major_max_dim &&
          active_host_simd() != host_simd::scalar) {
        with_flag(rotation.pairing == rope_pairing::halves, [&](auto halves) {
          inject_host_token_major_truncate<decltype(halves)::value, StoreT>(
            store, batch, cache, rotation);
        });
        return;
      }
#endif
      with_flag(contiguous, [&](auto c) {
        with_flag(rotation.pairing == rope_pairing::halves, [&](auto halves) {
          constexpr bool C = decltype(c)::value;
          constexpr bool H = decltype(halves)::value;
          inject_host_typed<C, C, false, H, false, false, StoreT, CacheT, Rotation, true>(
            store, batch, cache, rotation);
        });
      });
      return;
    }
  }
  with_flag(contiguous, [&](auto c) {
    with_flag<fp8>(cache.scale_granularity != kv_scale_granularity::none, [&](auto scaled) {
      with_flag(rotation.pairing == rope_pairing::halves, [&](auto halves) {
        with_flag<may_round>(
          rope_rounds_each_operation<StoreT>(rotation, rope_op::forward), [&](auto round_each) {
            with_flag<may_fuse>(
              rope_fuses_multiply_add(rotation, rope_op::forward), [&](auto fused) {
                constexpr bool C = decltype(c)::value;
                constexpr bool S = decltype(scaled)::value;
                constexpr bool H = decltype(halves)::value;
                constexpr bool R = decltype(round_each)::value;
                constexpr bool F = decltype(fused)::value;
#if INFERSCALE_HOST_X86_SIMD
                if constexpr (C && H) {
                  host_simd const level = active_host_simd();
                  if (level != host_simd::scalar) {
                    inject_host_typed_simd<S, R, F, StoreT, CacheT>(
                      store, batch, cache, rotation, level);
                    return;
                  }
                }
#endif
#if INFERSCALE_HOST_FMA_DISPATCH
                if constexpr (F) {
                  if (__builtin_cpu_supports("fma")) {
                    inject_host_typed_fma<C, C, S, H, R, StoreT, CacheT>(
                      store, batch, cache, rotation);
                    return;
                  }
                }
#endif
                inject_host_typed<C, C, S, H, R, F, StoreT, CacheT>(store, batch, cache, rotation);
              });
          });
      });
    });
  });
}

/// @brief Calls f(type_tag<StoreT>, type_tag<CacheT>) for the runtime dtypes.
template <class F>
void dispatch_store_cache(dtype store_dtype, dtype cache_dtype, F&& f)
{
  dispatch_dtype(store_dtype, [&](auto store_tag) {
    using S = typename decltype(store_tag)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      dispatch_dtype(cache_dtype, [&](auto cache_tag) { f(store_tag, cache_tag); });
    } else {
      INFERSCALE_FAIL(std::string{"store dtype "} + to_string(store_dtype) + " is not supported");
    }
  });
}

}  // namespace detail

/**
 * @brief Host backend: writes every token of `batch` into `cache` (host memory): the key read from
 * the store, rotated to the token's virtual position by `rotation`, scaled and converted to the
 * cache dtype; the value scaled and converted. Tokens with a negative slot are skipped.
 *
 * @param store    a host-memory store (the batch's)
 * @param batch    the step's validated work
 * @param cache    the engine's cache for the store's shard (same layers, heads, head_dim)
 * @param rotation rope_params, or the engine's rope_cos_sin_table (host data)
 * @throw logic_error if the batch is stale or for another store, the store is not in host memory,
 *        geometries differ, a slot is beyond the cache or a position beyond the table; nothing is
 *        written then.
 */
template <class Rotation>
void inject_host(kv_store const& store,
                 injection_batch const& batch,
                 paged_kv_cache const& cache,
                 Rotation const& rotation)
{
  detail::check_injection(store, batch, cache, rotation, memory_kind::host, "inject_host");
  detail::dispatch_store_cache(store.store_dtype(), cache.cache_dtype, [&](auto s, auto c) {
    using S = typename decltype(s)::type;
    using C = typename decltype(c)::type;
    detail::dispatch_host_inject<S, C>(store.ref(), batch.host_view(), cache, rotation);
  });
}

namespace detail {

/// @brief Checks an extraction request; returns nothing, throws on the first problem.
template <class Rotation>
void check_extraction(paged_kv_cache const& cache,
                      std::vector<std::int64_t> const& slots,
                      std::int64_t first_position,
                      Rotation const& rotation,
                      kv_store const& store,
                      std::uint64_t fact_id,
                      std::vector<std::int32_t> const& token_ids,
                      memory_kind backend,
                      char const* who)
{
  INFERSCALE_EXPECTS(store.memory() == backend,
                     std::string{who} + ": the store's pool is in " + to_string(store.memory()) +
                       " memory, this backend writes " + to_string(backend) + " memory");
  check_store_cache_geometry(store, cache, who);
  INFERSCALE_EXPECTS(!token_ids.empty(), std::string{who} + ": no tokens to extract");
  INFERSCALE_EXPECTS(slots.size() == token_ids.size(),
                     std::string{who} + ": " +
                       detail::count_of(static_cast<std::int64_t>(slots.size()), "slot") + " for " +
                       detail::count_of(static_cast<std::int64_t>(token_ids.size()), "token id"));
  for (std::size_t j = 0; j < slots.size(); ++j) {
    INFERSCALE_EXPECTS(slots[j] >= 0 && slots[j] < cache.num_slots(),
                       std::string{who} + ": slot " + std::to_string(slots[j]) + " of token " +
                         std::to_string(j) + " is outside the cache's " +
                         detail::count_of(cache.num_slots(), "slot"));
  }
  INFERSCALE_EXPECTS(
    first_position >= 0 && first_position <= std::numeric_limits<std::int64_t>::max() -
                                               static_cast<std::int64_t>(slots.size()),
    std::string{who} + ": first position must be non-negative, got " +
      std::to_string(first_position));
  check_rotation(rotation,
                 store.geometry().head_dim,
                 first_position + static_cast<std::int64_t>(slots.size()) - 1,
                 who);
  INFERSCALE_EXPECTS(!store.contains(fact_id),
                     std::string{who} + ": fact id " + std::to_string(fact_id) + " already stored");
  INFERSCALE_EXPECTS(store.pages_for(static_cast<std::int64_t>(slots.size())) <= store.free_pages(),
                     std::string{who} + ": fact " + std::to_string(fact_id) + " needs " +
                       detail::count_of(store.pages_for(static_cast<std::int64_t>(slots.size())),
                                        "page") +
                       ", " + std::to_string(store.free_pages()) + " free (capacity exhausted)");
  if (backend == memory_kind::host) { cache.check_scale_values(who); }
}

/// @brief Where a dry run of extraction met the first element it would store as NaN or infinity.
struct extraction_fault {
  bool found{false};
  std::int64_t token{};
  std::int32_t layer{};
  std::int32_t head{};
  bool value{};
  float element{};
};

/**
 * @brief Host backend of extraction: de-rotated key and value of every token, layer and head.
 * `CheckOnly`: a dry run that writes nothing and reports in `fault` the first element that would
 * be stored non-finite (a NaN or infinity in the cache, or a value beyond the store dtype), so
 * extraction refuses such a fact before reserving it, as kv_store::insert does.
 */
template <bool CheckOnly, class StoreT, class CacheT, class Rotation>
void extract_host_typed(paged_kv_cache const& cache,
                        std::int64_t const* slots,
                        std::int64_t const* positions,
                        std::int64_t const* store_tokens,
                        std::int64_t n,
                        Rotation const& rotation,
                        kv_store_ref const& store,
                        extraction_fault* fault = nullptr)
{
  std::int32_t const pairs  = rotation.num_pairs();
  std::int32_t const rotary = rotation.rotary_dim;
  std::int32_t const dim    = store.head_dim;
  auto* const pool          = static_cast<StoreT*>(store.pool);
  std::vector<rope_cos_sin> cos_sin(static_cast<std::size_t>(pairs));
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t const slot = slots[i];
    detail::rope_cos_sin_row(rotation, positions[i], rope_op::inverse, cos_sin.data());
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      StoreT* const krow      = CheckOnly ? nullptr : pool + store.row_offset(store_tokens[i], l, 0);
      StoreT* const vrow      = CheckOnly ? nullptr : pool + store.row_offset(store_tokens[i], l, 1);
      auto const* const kbase = static_cast<CacheT const*>(cache.key_base[l]);
      auto const* const vbase = static_cast<CacheT const*>(cache.value_base[l]);
      for (std::int32_t h = 0; h < store.num_heads; ++h) {
        StoreT* const k = CheckOnly ? nullptr : krow + static_cast<std::int64_t>(h) * dim;
        StoreT* const v = CheckOnly ? nullptr : vrow + static_cast<std::int64_t>(h) * dim;
        float const ks  = cache.scale(l, h, false);
        float const vs  = cache.scale(l, h, true);
        auto const kat  = [&](std::int32_t d) {
          return dequantize(
            kbase[cache.key_layout.slot_offset(slot, h, d)], ks, cache.scale_convention);
        };
        // Stores element d of the key (or value) row, or, in a dry run, checks it.
        auto const put = [&](StoreT* row, std::int32_t d, float x, bool is_value) {
          StoreT const q = from_float<StoreT>(x);
          if constexpr (CheckOnly) {
            if (!fault->found && !std::isfinite(to_float(q))) {
              *fault = extraction_fault{true, i, l, h, is_value, x};
            }
          } else {
            row[d] = q;
          }
        };
        for (std::int32_t p = 0; p < pairs; ++p) {
          std::int32_t first, second;
          pair_elements(rotation.pairing, rotary, p, &first, &second);
          float x, y;
          unrotate_pair(kat(first), kat(second), cos_sin[static_cast<std::size_t>(p)], &x, &y);
          put(k, first, x, false);
          put(k, second, y, false);
        }
        for (std::int32_t d = rotary; d < dim; ++d) {
          put(k, d, kat(d), false);
        }
        for (std::int32_t d = 0; d < dim; ++d) {
          put(v,
              d,
              dequantize(
                vbase[cache.value_layout.slot_offset(slot, h, d)], vs, cache.scale_convention),
              true);
        }
      }
    }
    if (CheckOnly && fault->found) { return; }
  }
}

/// @brief Store tokens of every token of a fact, in order.
inline std::vector<std::int64_t> fact_store_tokens(kv_store const& store, fact_record const& fact)
{
  std::vector<std::int64_t> out(static_cast<std::size_t>(fact.length()));
  for (std::int32_t j = 0; j < fact.length(); ++j) {
    out[static_cast<std::size_t>(j)] = store.store_token(fact, j);
  }
  return out;
}

}  // namespace detail

/**
 * @brief Host backend of extraction: reads the tokens in `slots` (prompt positions
 * `first_position ..`) back from an engine's cache (host memory), dequantizes, de-rotates the keys
 * from their absolute positions, and stores them as a new fact.
 *
 * This gives engines that cannot hook their model a way to capture pre-RoPE KV: prefill the fact
 * (with its context window) normally, then extract its token range.
 *
 * @throw logic_error if the store is not in host memory, geometries differ, the counts differ, a
 *        slot is negative or beyond the cache, a position is beyond the table, the id exists,
 *        capacity is exhausted, an fp8 scale is zero, negative or non-finite, or an element would
 *        be stored as NaN or infinity (non-finite in the cache, or beyond the store dtype); nothing
 *        is changed then.
 */
template <class Rotation>
void extract_host(paged_kv_cache const& cache,
                  std::vector<std::int64_t> const& slots,
                  std::int64_t first_position,
                  Rotation const& rotation,
                  kv_store& store,
                  std::uint64_t fact_id,
                  std::uint64_t namespace_id,
                  std::vector<std::int32_t> token_ids)
{
  detail::check_extraction(cache,
                           slots,
                           first_position,
                           rotation,
                           store,
                           fact_id,
                           token_ids,
                           memory_kind::host,
                           "extract_host");
  std::vector<std::int64_t> positions(slots.size());
  for (std::size_t j = 0; j < slots.size(); ++j) {
    positions[j] = first_position + static_cast<std::int64_t>(j);
  }
  // A dry run first: a NaN or infinity in the cache (or a value the store dtype cannot hold) is
  // refused before anything is reserved or written, as kv_store::insert refuses it.
  detail::extraction_fault fault{};
  detail::dispatch_store_cache(store.store_dtype(), cache.cache_dtype, [&](auto s, auto c) {
    using S = typename decltype(s)::type;
    using C = typename decltype(c)::type;
    detail::extract_host_typed<true, S, C>(cache,
                                           slots.data(),
                                           positions.data(),
                                           nullptr,
                                           static_cast<std::int64_t>(slots.size()),
                                           rotation,
                                           store.ref(),
                                           &fault);
  });
  INFERSCALE_EXPECTS(!fault.found,
                     "extract_host: token " + std::to_string(fault.token) + " (slot " +
                       std::to_string(fault.found ? slots[static_cast<std::size_t>(fault.token)]
                                                  : 0) +
                       ") would store a non-finite " + (fault.value ? "value" : "key") +
                       " element (" + std::to_string(fault.element) + ") at layer " +
                       std::to_string(fault.layer) + ", head " + std::to_string(fault.head) +
                       " in the store dtype " + to_string(store.store_dtype()) +
                       "; NaN, infinities and overflowing values are refused");
  fact_record const& fact = store.reserve(fact_id, namespace_id, std::move(token_ids));
  std::vector<std::int64_t> const store_tokens = detail::fact_store_tokens(store, fact);
  detail::dispatch_store_cache(store.store_dtype(), cache.cache_dtype, [&](auto s, auto c) {
    using S = typename decltype(s)::type;
    using C = typename decltype(c)::type;
    detail::extract_host_typed<false, S, C>(cache,
                                     slots.data(),
                                     positions.data(),
                                     store_tokens.data(),
                                     static_cast<std::int64_t>(slots.size()),
                                     rotation,
                                     store.ref());
  });
}

}  // namespace inferscale
