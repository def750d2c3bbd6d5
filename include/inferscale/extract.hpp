/**
 * @file extract.hpp
 * @brief Extraction, host backend: the inverse of injection. Reads tokens from an engine's paged
 * KV cache, de-rotates the keys to pre-RoPE and stores them as a fact (capture from an engine that
 * has already prefilled the text).
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/checks.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/detail/inject/host_dispatch.hpp>
#include <inferscale/detail/inject/host_loop.hpp>
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
#include <vector>

namespace inferscale {

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
                      memory_space backend,
                      char const* who)
{
  INFERSCALE_EXPECTS(store.space() == backend,
                     std::string{who} + ": the store's pool is in " + to_string(store.space()) +
                       " memory, this backend writes " + to_string(backend) + " memory");
  check_store_cache_geometry(store, cache, who);
  INFERSCALE_EXPECTS(store.compression() == kv_compression::none,
                     std::string{who} + ": the store is compressed (" +
                       to_string(store.compression()) +
                       "); extract into an uncompressed store and insert the fact's rows into "
                       "the compressed one (kv_store::insert quantizes them)");
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
  check_rotation_layers(rotation, cache.num_layers, who);
  INFERSCALE_EXPECTS(!store.contains(fact_id),
                     std::string{who} + ": fact id " + std::to_string(fact_id) + " already stored");
  INFERSCALE_EXPECTS(
    store.pages_for(static_cast<std::int64_t>(slots.size())) <= store.free_pages(),
    std::string{who} + ": fact " + std::to_string(fact_id) + " needs " +
      detail::count_of(store.pages_for(static_cast<std::int64_t>(slots.size())), "page") + ", " +
      std::to_string(store.free_pages()) + " free (capacity exhausted)");
  if (backend == memory_space::host) { cache.check_scale_values(who); }
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
  // A per-layer rotation: the inverse rows of each of its rotations, layer l reading its own.
  auto const& first_rotation = rotation_at(rotation, 0);
  std::int32_t const pairs   = first_rotation.num_pairs();
  std::int32_t const rotary  = first_rotation.rotary_dim;
  std::int32_t const dim     = store.head_dim;
  auto* const pool           = static_cast<StoreT*>(store.pool);
  std::int32_t const count   = rotation_count(rotation);
  std::vector<rope_cos_sin> rows(static_cast<std::size_t>(count * pairs));
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t const slot = slots[i];
    for (std::int32_t r = 0; r < count; ++r) {
      detail::rope_cos_sin_row(
        rotation_at(rotation, r), positions[i], rope_op::inverse, rows.data() + r * pairs);
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      rope_cos_sin const* const cos_sin = rows.data() + rotation_of_layer(rotation, l) * pairs;
      StoreT* const krow = CheckOnly ? nullptr : pool + store.row_offset(store_tokens[i], l, 0);
      StoreT* const vrow = CheckOnly ? nullptr : pool + store.row_offset(store_tokens[i], l, 1);
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
          pair_elements(first_rotation.pairing, rotary, p, &first, &second);
          float x, y;
          unrotate_pair(kat(first), kat(second), cos_sin[p], &x, &y);
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

/// @brief extract_host_typed for the runtime dtypes: the one place extract_host reaches the loop
/// through (compiled once under INFERSCALE_EXTERN_TEMPLATES, see instances.hpp).
template <bool CheckOnly, class Rotation>
void extract_host_view(paged_kv_cache const& cache,
                       std::int64_t const* slots,
                       std::int64_t const* positions,
                       std::int64_t const* store_tokens,
                       std::int64_t n,
                       Rotation const& rotation,
                       kv_store_ref const& store,
                       extraction_fault* fault)
{
  dispatch_store_cache(store.store_dtype, cache.cache_dtype, [&](auto s, auto c) {
    using S = typename decltype(s)::type;
    using C = typename decltype(c)::type;
    extract_host_typed<CheckOnly, S, C>(
      cache, slots, positions, store_tokens, n, rotation, store, fault);
  });
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
                           memory_space::host,
                           "extract_host");
  std::vector<std::int64_t> positions(slots.size());
  for (std::size_t j = 0; j < slots.size(); ++j) {
    positions[j] = first_position + static_cast<std::int64_t>(j);
  }
  // A dry run first: a NaN or infinity in the cache (or a value the store dtype cannot hold) is
  // refused before anything is reserved or written, as kv_store::insert refuses it.
  detail::extraction_fault fault{};
  detail::extract_host_view<true>(cache,
                                  slots.data(),
                                  positions.data(),
                                  nullptr,
                                  static_cast<std::int64_t>(slots.size()),
                                  rotation,
                                  store.ref(),
                                  &fault);
  INFERSCALE_EXPECTS(
    !fault.found,
    "extract_host: token " + std::to_string(fault.token) + " (slot " +
      std::to_string(fault.found ? slots[static_cast<std::size_t>(fault.token)] : 0) +
      ") would store a non-finite " + (fault.value ? "value" : "key") + " element (" +
      std::to_string(fault.element) + ") at layer " + std::to_string(fault.layer) + ", head " +
      std::to_string(fault.head) + " in the store dtype " + to_string(store.store_dtype()) +
      "; NaN, infinities and overflowing values are refused");
  fact_record const& fact = store.reserve(fact_id, namespace_id, std::move(token_ids));
  std::vector<std::int64_t> const store_tokens = detail::fact_store_tokens(store, fact);
  detail::extract_host_view<false>(cache,
                                   slots.data(),
                                   positions.data(),
                                   store_tokens.data(),
                                   static_cast<std::int64_t>(slots.size()),
                                   rotation,
                                   store.ref(),
                                   nullptr);
}

}  // namespace inferscale

#include <inferscale/detail/inject/instances.hpp>
#if defined(INFERSCALE_EXTERN_TEMPLATES)
// Compiled once, in the program's unit that includes <inferscale/instances.hpp>.
INFERSCALE_EXTRACT_HOST_INSTANCES(extern)
#endif
