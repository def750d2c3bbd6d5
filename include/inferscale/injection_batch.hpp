/**
 * @file injection_batch.hpp
 * @brief The injection step: the one object through which memory is injected. A scheduler step
 * plans it on the host (every admitted request's composition with its slots, each token resolved
 * to its store page and checked), then runs it on the host (`run(cache, rotation)`, inject.hpp) or
 * on the device (`run(cache, rotation, device)` with a device_context, inject.cuh): FlashInfer's
 * plan/run split.
 *
 * Why the batch is the step (and not a second class around it): the batch already was the
 * validated, flattened work of one step that both backends read; a separate step object would be a
 * second way to build the same thing. So a request's slots are given one of three ways, all to
 * `add`: a span of slots (vLLM's slot mapping), a block table read with the target cache's own
 * block size, or a paged-cache adapter (engine.hpp) whose slots the step allocates and commits
 * after a successful run; and `run` is the one call per backend. This header is CUDA-free (the
 * device run is declared here, defined in inject.cuh).
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/device_context.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <cuda/std/span>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
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
 *  - `bad_position`: position negative or at or beyond the cos/sin table's rows (the rotation's
 *    range: detail::rope_table_rows);
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

/// @brief Whether C is a paged-cache adapter (is_cache_adapter_v).
template <class, class = void>
struct is_cache_adapter : std::false_type {
};
template <class C>
struct is_cache_adapter<
  C,
  std::void_t<decltype(std::declval<C&>().allocate(std::int64_t{}, std::int64_t{})),
              decltype(std::declval<C const&>().cache()),
              decltype(std::declval<C&>().commit(std::int64_t{})),
              decltype(std::declval<C&>().release(std::int64_t{}))>>
  : std::conjunction<
      std::is_convertible<decltype(std::declval<C&>().allocate(std::int64_t{}, std::int64_t{})),
                          std::vector<std::int64_t>>,
      std::is_convertible<decltype(std::declval<C const&>().cache()), paged_kv_cache const&>> {
};

/// @brief True when `a` and `b` describe the same cache: the same memory (every layer's K, V and
/// scale addresses), layouts, dtype, format and scale convention.
inline bool same_cache(paged_kv_cache const& a, paged_kv_cache const& b) noexcept
{
  if (a.cache_dtype != b.cache_dtype || a.format != b.format || a.num_layers != b.num_layers ||
      !(a.key_layout == b.key_layout) || !(a.value_layout == b.value_layout) ||
      a.scale_convention != b.scale_convention || a.scale_granularity != b.scale_granularity) {
    return false;
  }
  for (std::int32_t l = 0; l < a.num_layers && l < paged_kv_cache::max_layers; ++l) {
    if (a.key_base[l] != b.key_base[l] || a.value_base[l] != b.value_base[l] ||
        a.key_scale[l] != b.key_scale[l] || a.value_scale[l] != b.value_scale[l]) {
      return false;
    }
  }
  return true;
}
}  // namespace detail

/// @brief True when C provides allocate(p0, n), cache(), commit(n) and release(n) (a paged-cache
/// adapter, engine.hpp).
template <class C>
inline constexpr bool is_cache_adapter_v = detail::is_cache_adapter<C>::value;

/**
 * @brief The injection step: the validated work of one scheduler step — every admitted request's
 * plan and slots, flattened to (store token, position, slot) per memory token — planned on the
 * host with add(), then written by run() on the host (inject.hpp) or the device (inject.cuh).
 *
 * A step is tied to the store state it was planned against: running it after the store changed
 * (insert, erase) is refused, since pages may have been reused. A step that names its cache (a
 * block table or a cache adapter was added) runs only into that cache. Every refusal, at add or
 * at run, leaves the store and the cache as they were, and gives every slot an adapter allocated
 * for it back: an add refused after the adapter's allocate() calls its release(m) and leaves the
 * step unchanged; a run refused (or failed) in a step holding adapters calls release(m) of each
 * and empties the step (clear(): plan it again), since its tokens name the released slots. A
 * refused run in a step without adapters leaves the step as it was.
 * A copy of a step holding adapters holds them too: run only one of the two (each run commits).
 */
class injection_batch {
 public:
  /// @brief An empty step over facts of `store`.
  explicit injection_batch(kv_store const& store)
    : store_{&store}, store_identity_{store.identity()}, store_version_{store.version()}
  {
  }

  /// @brief Room for `tokens` tokens without reallocation (an engine keeps one step object per
  /// step loop: reserve once, clear() every step).
  void reserve(std::int64_t tokens)
  {
    auto const n = static_cast<std::size_t>(std::max<std::int64_t>(tokens, 0));
    store_token_.reserve(n);
    position_.reserve(n);
    slot_.reserve(n);
  }

  /// @brief Empties the step, keeping its memory, and ties it to the store's current state. The
  /// target cache is forgotten; adapters added and not yet run are dropped uncommitted.
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
    has_target_     = false;
    pending_.clear();
  }

  /**
   * @brief Adds a request whose memory tokens go to `slot_mapping[0 .. m-1]` (vLLM slot mapping;
   * entries past m belong to the query tokens the engine prefills and are not read; a negative
   * slot skips its token). A std::vector converts to the span.
   *
   * @throw logic_error if the store changed since the step was planned, a fact of the plan is not
   *        in the store (or shorter than the plan says), the plan's sources and tokens disagree,
   *        its first position is negative or its last is at or beyond rope_position_limit (2^53,
   *        whatever the model: no overflow), the mapping is null or has fewer than m entries, or
   *        a slot repeats within the step; the step is unchanged then. (Slots beyond the cache and
   *        positions beyond a table or the model's range, rope_params::max_position, are refused
   *        at run, which knows the cache and the rotation.)
   */
  void add(composition const& plan, cuda::std::span<std::int64_t const> slot_mapping)
  {
    add_slots(plan, slot_mapping, "injection_batch::add");
  }

  /**
   * @brief Adds a request whose memory tokens are prompt tokens `start_position ..
   * start_position + m - 1` of a request with block table `block_table` in `cache`: slot
   * `block_table[p / B] * B + p % B`, with `B` the cache's own block size (slots_from_block_table).
   * The step then targets `cache`: run() refuses any other.
   * @throw logic_error as add(plan, slot_mapping), if the table is too short or holds a negative
   *        block id, or if the step already targets another cache; the step is unchanged then.
   */
  void add(composition const& plan,
           paged_kv_cache const& cache,
           cuda::std::span<std::int32_t const> block_table,
           std::int64_t start_position)
  {
    check_target(cache, "injection_batch::add");
    std::vector<std::int64_t> const slots =
      slots_from_block_table(block_table.data(),
                             static_cast<std::int64_t>(block_table.size()),
                             cache.key_layout.block_size,
                             start_position,
                             plan.length());
    add_slots(plan, slots, "injection_batch::add");
    target(cache);
  }

  /**
   * @brief Adds a request through a paged-cache adapter (engine.hpp): `adapter.allocate(p0, m)`
   * gives the slots of the plan's `m` tokens at its positions, the step targets
   * `adapter.cache()`, and a successful run() calls `adapter.commit(m)` (the engine adopts the
   * tokens as the sequence's prefix); a failed run calls `adapter.release(m)` instead. The adapter
   * must outlive the run.
   * @throw logic_error if the plan is empty, the step targets another cache than the adapter's
   *        or its positions reach rope_position_limit (all before allocate()), the adapter
   *        allocates other than `m` slots, or as add(plan, slot_mapping); nothing is committed
   *        then, and the step is unchanged (a refusal after allocate() calls `release(m)` first).
   *        Whatever the adapter's allocate throws.
   * @note The model's range is checked at run, after allocate(): call
   *       `rope_check_positions(rotation, plan.first_position, plan.length())` first to refuse
   *       before the adapter allocates (memory::inject does).
   */
  template <class CacheAdapter, std::enable_if_t<is_cache_adapter_v<CacheAdapter>, int> = 0>
  void add(composition const& plan, CacheAdapter& adapter)
  {
    char const* const who = "injection_batch::add";
    INFERSCALE_EXPECTS(plan.length() > 0,
                       std::string{who} + ": the plan is empty (nothing to allocate or commit)");
    paged_kv_cache const& cache = adapter.cache();
    check_target(cache, who);
    check_plan_positions(plan, who);
    std::vector<std::int64_t> const slots = adapter.allocate(plan.first_position, plan.length());
    pending_commit const pending{
      static_cast<void*>(&adapter),
      [](void* a, std::int64_t tokens) { static_cast<CacheAdapter*>(a)->commit(tokens); },
      [](void* a, std::int64_t tokens) { static_cast<CacheAdapter*>(a)->release(tokens); },
      plan.length()};
    try {
      INFERSCALE_EXPECTS(static_cast<std::int64_t>(slots.size()) == plan.length(),
                         std::string{who} + ": the cache adapter allocated " +
                           detail::count_of(static_cast<std::int64_t>(slots.size()), "slot") +
                           " for " + detail::count_of(plan.length(), "token"));
      pending_.reserve(pending_.size() + 1);  // the only allocation after the add: before it
      add_slots(plan, slots, who);
    } catch (...) {
      release_one(pending);
      throw;
    }
    target(cache);
    pending_.push_back(pending);
  }

  /**
   * @brief Host run: writes every token into `cache` (host memory) from the store (host memory):
   * the key read from the store, rotated to the token's virtual position by `rotation`
   * (rope_params, or the engine's rope_cos_sin_table over host data), scaled and converted to the
   * cache dtype; the value scaled and converted. Then commits the adapters added, in order (each
   * once: a second run commits nothing more).
   * @throw logic_error if the step is stale, the store is not in host memory, the step targets
   *        another cache, geometries differ, a slot is beyond the cache or a position beyond the
   *        table or the model's range (rope_params::max_position, unless
   *        rope_params::allow_beyond_max_position); nothing is written or committed then, and the
   *        adapters' slots are released (release_pending). Whatever an adapter's commit throws.
   * @note Defined in inject.hpp (include it).
   */
  template <class Rotation>
  void run(paged_kv_cache const& cache, Rotation const& rotation);

  /**
   * @brief Device run: the same checks as the host run (the store in device memory), then stages
   * the step's arrays into `device.workspace()` and enqueues one fused launch for all layers on
   * `device.stream()`; then commits the adapters, in order. `StoreT, CacheT` (both or neither)
   * name the element types, to compile only that pair's kernels (a mismatch is refused before
   * staging). Rows with an unusable fp8 scale (device memory) are skipped and counted in the
   * workspace's counters (injection_workspace::read_errors).
   * @throw logic_error as the host run, if the context has no workspace, or if the step exceeds
   *        the workspace (nothing staged, launched or committed); cuda_error on a CUDA failure.
   *        Either way the adapters' slots are released (release_pending).
   * @note Defined in inject.cuh (include it; nvcc). Never waits for the kernel; staging may wait
   *       for the workspace's previous staging copy.
   */
  template <class StoreT = void, class CacheT = void, class Rotation>
  void run(paged_kv_cache const& cache, Rotation const& rotation, device_context const& device);

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

  /// @brief Adapters added and not yet committed by a run.
  std::int64_t num_pending_commits() const noexcept
  {
    return static_cast<std::int64_t>(pending_.size());
  }

  /// @brief Throws unless the step may run into `cache`: it names no cache yet, or this one.
  void check_target(paged_kv_cache const& cache, char const* who) const
  {
    INFERSCALE_EXPECTS(!has_target_ || detail::same_cache(target_, cache),
                       std::string{who} +
                         ": this injection step targets another cache (the one its block tables "
                         "or cache adapters name)");
  }

  /// @brief Commits the adapters added since the last run, in order (called by run() after the
  /// write succeeded; each adapter once, even if a commit throws).
  void commit_pending()
  {
    std::vector<pending_commit> pending;
    pending.swap(pending_);
    for (pending_commit const& p : pending) {
      p.commit(p.adapter, p.tokens);
    }
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
  bool has_target_{false};
  paged_kv_cache target_{};
  struct pending_commit {
    void* adapter;
    void (*commit)(void*, std::int64_t);
    void (*release)(void*, std::int64_t);
    std::int64_t tokens;
  };

  static void release_one(pending_commit const& p) noexcept
  {
    try {
      p.release(p.adapter, p.tokens);
    } catch (...) {
      // The step's own error is what the caller gets (the contract: release does not throw).
    }
  }
  std::vector<pending_commit> pending_;

  /**
   * @brief After a failed run: calls `release(m)` of every adapter added and not committed, in
   * order, then empties the step (clear()) when it held any, since its tokens name the released
   * slots. A step without adapters is left as it was. Each adapter is released once; a release
   * that throws does not stop the others (its exception is dropped: the run's own error is the
   * one the caller gets).
   */
  void release_pending()
  {
    if (pending_.empty()) { return; }
    std::vector<pending_commit> pending;
    pending.swap(pending_);
    for (pending_commit const& p : pending) {
      release_one(p);
    }
    clear();
  }

  /// @brief Runs `write` (a run's checks and writes), then commits the adapters; if `write`
  /// throws, releases them (release_pending) and rethrows.
  template <class Write>
  void run_and_commit(Write&& write)
  {
    try {
      write();
    } catch (...) {
      release_pending();
      throw;
    }
    commit_pending();
  }

  void target(paged_kv_cache const& cache) noexcept
  {
    if (!has_target_) {
      target_     = cache;
      has_target_ = true;
    }
  }

  void add_slots(composition const& plan,
                 cuda::std::span<std::int64_t const> slot_mapping,
                 char const* who);

  /// @brief A hand-built plan can hold any p0: its positions p0 .. p0 + m - 1 must be
  /// non-negative and below rope_position_limit (so p0 + m - 1 cannot overflow) before they reach
  /// an adapter, a rotation or an engine's cos/sin table.
  static void check_plan_positions(composition const& plan, char const* who)
  {
    std::int64_t const m = plan.length();
    INFERSCALE_EXPECTS(
      m == 0 || (plan.first_position >= 0 && plan.first_position < rope_position_limit &&
                 m - 1 < rope_position_limit - plan.first_position),
      std::string{who} + ": the plan's positions " + std::to_string(plan.first_position) +
        " .. p0 + " + std::to_string(m - 1) + " must be non-negative and below " +
        detail::rope_position_limit_text() + "), whatever the model");
  }
};

inline void injection_batch::add_slots(composition const& plan,
                                       cuda::std::span<std::int64_t const> slot_mapping,
                                       char const* who)
{
  check_store(who);
  std::int64_t const num_slots = static_cast<std::int64_t>(slot_mapping.size());
  std::int64_t const m         = plan.length();
  INFERSCALE_EXPECTS(static_cast<std::int64_t>(plan.sources.size()) == m,
                     std::string{who} + ": the plan has " +
                       detail::count_of(static_cast<std::int64_t>(plan.sources.size()), "source") +
                       " for " + detail::count_of(m, "token"));
  INFERSCALE_EXPECTS(num_slots >= m,
                     std::string{who} + ": the plan has " + detail::count_of(m, "token") +
                       " but only " + detail::count_of(num_slots, "slot") + " were given");
  INFERSCALE_EXPECTS(m == 0 || slot_mapping.data() != nullptr,
                     std::string{who} + ": null slot mapping");
  check_plan_positions(plan, who);

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
                         std::string{who} + ": unknown fact id " + std::to_string(src.fact_id) +
                           " (token " + std::to_string(j) + " of the plan)");
      cached    = &store_->at(src.fact_id);
      cached_id = src.fact_id;
    }
    INFERSCALE_EXPECTS(src.offset >= 0 && src.offset < cached->length(),
                       std::string{who} + ": token " + std::to_string(j) + " reads offset " +
                         std::to_string(src.offset) + " of fact " + std::to_string(src.fact_id) +
                         ", which has " + detail::count_of(cached->length(), "token"));
    store_tokens[static_cast<std::size_t>(j)] = store_->store_token(*cached, src.offset);
    std::int64_t const slot                   = slot_mapping[static_cast<std::size_t>(j)];
    if (slot >= 0) {
      INFERSCALE_EXPECTS(
        slots_.insert(slot),
        std::string{who} + ": slot " + std::to_string(slot) + " is written twice in this batch");
      new_slots.push_back(slot);
      max_slot = std::max(max_slot, slot);
    }
  }
  std::int64_t const last_position = m > 0 ? plan.position(m - 1) : -1;

  // Commit.
  store_token_.insert(store_token_.end(), store_tokens.begin(), store_tokens.end());
  slot_.insert(slot_.end(), slot_mapping.data(), slot_mapping.data() + m);
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

}  // namespace inferscale
