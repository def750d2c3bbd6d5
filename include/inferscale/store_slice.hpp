/**
 * @file store_slice.hpp
 * @brief The part of a store one tensor-parallel rank (its KV heads) or one pipeline stage (its
 * layers) injects from, copied byte for byte into a store of its own.
 *
 * A serving engine that shards attention over ranks hands each rank a cache of its own KV heads
 * (and, under pipeline parallelism, of its own layers). A rank's injection reads only those
 * heads and layers, so it serves from a store that holds only them (kv_store_config's
 * first_head / num_heads and first_layer / num_layers). slice_store builds that store from a
 * whole-model store (a loaded snapshot, typically) by copying the pool's rows of the slice, page
 * by page: no conversion, no rounding, no pass through another element type.
 *
 * Plain C++17; host stores only (a device slice is a host slice copied to the device).
 */
#pragma once

#include <inferscale/error.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_set>
#include <vector>

namespace inferscale {

/// @brief Which layers and KV heads of the model a slice holds (model coordinates).
struct store_slice {
  std::int32_t first_layer{0};  ///< the model's layer the slice starts at
  std::int32_t num_layers{0};   ///< 0: through the last layer the source store holds
  std::int32_t first_head{0};   ///< the model's KV head the slice starts at
  std::int32_t num_heads{0};    ///< 0: through the last head the source store holds
};

/**
 * @brief A new host store holding, of each fact in `fact_ids` (in that order), the layers and KV
 * heads `slice` names, byte for byte as `full` holds them.
 *
 * The result's model has `num_layers` layers and `full`'s KV heads and head_dim; it holds the
 * heads [first_head, first_head + num_heads) of every one of its layers: the slice's layer 0 is
 * the model's layer `first_layer` (a pipeline stage counts its caches from its own first layer).
 * Same store dtype and page size as `full`; capacity exactly the facts' pages (at least one).
 * Each fact keeps its id, namespace and token ids, and its pages' unused rows stay zero; a
 * namespace lists its facts in `fact_ids` order. Costs one pass over the slice's bytes of the
 * facts (`full`'s other rows are not read).
 *
 * @throw logic_error before anything is allocated if `full` is not a host store or is
 *        compressed (its blocks are scaled per page and head: slice the uncompressed store), if
 *        the slice reaches outside the layers or heads `full` holds, or if an id is unknown or
 *        repeated.
 */
inline kv_store slice_store(kv_store const& full,
                            store_slice const& slice,
                            std::vector<std::uint64_t> const& fact_ids)
{
  kv_store_config const& from = full.config();
  INFERSCALE_EXPECTS(full.space() == memory_space::host,
                     "slice_store: the store is in device memory (slice its host copy)");
  INFERSCALE_EXPECTS(full.compression() == kv_compression::none,
                     std::string{"slice_store: the store is compressed ("} +
                       to_string(full.compression()) + "); slice an uncompressed store");
  kv_geometry const held = full.geometry();
  std::int64_t const layer_end =
    static_cast<std::int64_t>(from.first_layer) + held.num_layers;  // one past the last held
  std::int64_t const head_end = static_cast<std::int64_t>(from.first_head) + held.num_kv_heads;
  std::int64_t const num_layers =
    slice.num_layers == 0 ? layer_end - slice.first_layer : slice.num_layers;
  std::int64_t const num_heads =
    slice.num_heads == 0 ? head_end - slice.first_head : slice.num_heads;
  // [first, first + count) inside [held_first, held_end), count resolved from a 0
  auto const check_range = [](char const* what,
                              std::int64_t first,
                              std::int64_t asked,
                              std::int64_t count,
                              std::int64_t held_first,
                              std::int64_t held_end) {
    INFERSCALE_EXPECTS(first >= held_first && asked >= 0 && count >= 1 && first + count <= held_end,
                       std::string{"slice_store: "} + what + " [" + std::to_string(first) + ", " +
                         std::to_string(first + count) + ") are not inside the store's [" +
                         std::to_string(held_first) + ", " + std::to_string(held_end) + ")");
  };
  check_range(
    "layers", slice.first_layer, slice.num_layers, num_layers, from.first_layer, layer_end);
  check_range("KV heads", slice.first_head, slice.num_heads, num_heads, from.first_head, head_end);
  std::int64_t pages = 0;
  {
    std::unordered_set<std::uint64_t> seen;
    for (std::uint64_t const id : fact_ids) {
      INFERSCALE_EXPECTS(full.contains(id), "slice_store: unknown fact id " + std::to_string(id));
      INFERSCALE_EXPECTS(seen.insert(id).second,
                         "slice_store: fact id " + std::to_string(id) + " is named twice");
      pages += static_cast<std::int64_t>(full.at(id).pages.size());
    }
  }

  kv_store_config to;
  to.model = kv_geometry{
    static_cast<std::int32_t>(num_layers), from.model.num_kv_heads, from.model.head_dim};
  to.first_layer = 0;
  to.num_layers  = static_cast<std::int32_t>(num_layers);
  to.first_head  = slice.first_head;
  to.num_heads   = static_cast<std::int32_t>(num_heads);
  to.store_dtype = from.store_dtype;
  to.page_size   = from.page_size;
  to.num_pages   = std::max<std::int64_t>(1, pages);
  to.space       = memory_space::host;
  kv_store out{to};

  kv_store_ref const src         = full.ref();
  kv_store_ref const dst         = out.ref();
  std::size_t const elem         = size_of(from.store_dtype);
  std::int32_t const layer_shift = slice.first_layer - from.first_layer;
  std::int64_t const head_shift  = slice.first_head - from.first_head;
  std::int64_t const page_size   = from.page_size;
  std::size_t const row_bytes    = static_cast<std::size_t>(num_heads * held.head_dim) * elem;
  bool const whole_rows          = num_heads == held.num_kv_heads;  // a page's rows contiguous
  auto const* src_pool           = static_cast<unsigned char const*>(src.pool);
  auto* dst_pool                 = static_cast<unsigned char*>(dst.pool);
  for (std::uint64_t const id : fact_ids) {
    fact_record const& record = full.at(id);
    fact_record const& copy   = out.reserve(id, record.namespace_id, record.token_ids);
    for (std::size_t p = 0; p < record.pages.size(); ++p) {
      std::int64_t const from_token = record.pages[p] * page_size;
      std::int64_t const to_token   = copy.pages[p] * page_size;
      for (std::int32_t l = 0; l < num_layers; ++l) {
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          std::int64_t const s0 = src.row_offset(from_token, l + layer_shift, kv);
          std::int64_t const d0 = dst.row_offset(to_token, l, kv);
          if (whole_rows) {  // the page's page_size rows of this layer and K/V in one run
            std::memcpy(dst_pool + static_cast<std::size_t>(d0) * elem,
                        src_pool + static_cast<std::size_t>(s0) * elem,
                        static_cast<std::size_t>(page_size) * row_bytes);
            continue;
          }
          for (std::int64_t t = 0; t < page_size; ++t) {
            std::size_t const s =
              static_cast<std::size_t>(s0 + t * src.row_elements() + head_shift * held.head_dim);
            std::size_t const d = static_cast<std::size_t>(d0 + t * dst.row_elements());
            std::memcpy(dst_pool + d * elem, src_pool + s * elem, row_bytes);
          }
        }
      }
    }
  }
  return out;
}

}  // namespace inferscale
