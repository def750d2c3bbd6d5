/**
 * @file detail/store/config.inl
 * @brief Definitions for store.hpp: the checks of a kv_store_config (geometry, shard ranges,
 * dtype, compression, placement, capacity and the pool's byte count) and the resolution of its
 * 0 layer and head counts, before anything is allocated.
 */
#pragma once

#include <inferscale/compression.hpp>
#include <inferscale/error.hpp>
#include <inferscale/store.hpp>

#include <cstdint>
#include <limits>
#include <string>

namespace inferscale {

inline kv_store_config kv_store::resolve(kv_store_config c)
{
  c.model.validate();
  INFERSCALE_EXPECTS(c.first_layer >= 0 && c.first_layer < c.model.num_layers,
                     "kv_store: first_layer " + std::to_string(c.first_layer) +
                       " outside the model's " + std::to_string(c.model.num_layers) + " layers");
  if (c.num_layers == 0) { c.num_layers = c.model.num_layers - c.first_layer; }
  INFERSCALE_EXPECTS(c.num_layers > 0 && c.first_layer + c.num_layers <= c.model.num_layers,
                     "kv_store: layer range [" + std::to_string(c.first_layer) + ", " +
                       std::to_string(c.first_layer + c.num_layers) + ") outside the model's " +
                       std::to_string(c.model.num_layers) + " layers");
  INFERSCALE_EXPECTS(c.first_head >= 0 && c.first_head < c.model.num_kv_heads,
                     "kv_store: first_head " + std::to_string(c.first_head) +
                       " outside the model's " + std::to_string(c.model.num_kv_heads) +
                       " KV heads");
  if (c.num_heads == 0) { c.num_heads = c.model.num_kv_heads - c.first_head; }
  INFERSCALE_EXPECTS(c.num_heads > 0 && c.first_head + c.num_heads <= c.model.num_kv_heads,
                     "kv_store: head range [" + std::to_string(c.first_head) + ", " +
                       std::to_string(c.first_head + c.num_heads) + ") outside the model's " +
                       std::to_string(c.model.num_kv_heads) + " KV heads");
  INFERSCALE_EXPECTS(c.store_dtype == dtype::float32 || c.store_dtype == dtype::float16 ||
                       c.store_dtype == dtype::bfloat16,
                     std::string{"kv_store: store dtype must be float32, float16 or bfloat16, "
                                 "got "} +
                       to_string(c.store_dtype));
  INFERSCALE_EXPECTS(!c.pinned || c.space == memory_space::host,
                     "kv_store: pinned applies to host pools only");
  INFERSCALE_EXPECTS(c.resource == nullptr || c.space == memory_space::device || c.pinned,
                     "kv_store: a memory resource applies to device and pinned pools only");
  INFERSCALE_EXPECTS(c.page_size > 0,
                     "kv_store: page_size must be positive, got " + std::to_string(c.page_size));
  INFERSCALE_EXPECTS(
    c.num_pages >= 0,
    "kv_store: num_pages must be non-negative, got " + std::to_string(c.num_pages));
  kv_geometry const shard{c.num_layers, c.num_heads, c.model.head_dim};
  // The pool's byte count must fit: bytes(num_pages * page_size tokens).
  INFERSCALE_EXPECTS(
    c.num_pages == 0 || c.page_size <= std::numeric_limits<std::int64_t>::max() / c.num_pages,
    "kv_store: num_pages * page_size overflows");
  (void)shard.bytes(c.num_pages * c.page_size, c.store_dtype);
  INFERSCALE_EXPECTS(
    c.compression == kv_compression::none || c.compression == kv_compression::fp8_e4m3 ||
      c.compression == kv_compression::int4,
    "kv_store: unknown compression value " + std::to_string(static_cast<int>(c.compression)));
  if (c.compression != kv_compression::none) {
    INFERSCALE_EXPECTS(c.model.head_dim <= compressed_max_head_dim,
                       "kv_store: a compressed store takes head_dim up to " +
                         std::to_string(compressed_max_head_dim) + ", got " +
                         std::to_string(c.model.head_dim));
    compressed_block_layout const b{c.page_size, c.num_heads, c.model.head_dim, c.compression};
    std::int64_t const page = b.layer_bytes() * c.num_layers;  // a few MiB at most per page
    INFERSCALE_EXPECTS(
      c.num_pages == 0 || page <= std::numeric_limits<std::int64_t>::max() / c.num_pages,
      "kv_store: the compressed pool's byte count overflows");
  }
  return c;
}

}  // namespace inferscale
