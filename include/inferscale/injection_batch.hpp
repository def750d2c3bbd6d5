/**
 * @file injection_batch.hpp
 * @brief The injection batch: the validated, flattened work of one scheduler step (every admitted
 * request's composition with its slots, each token resolved to its store page), shared by the
 * host backend (inject.hpp) and the device backend (inject.cuh).
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
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

}  // namespace inferscale
