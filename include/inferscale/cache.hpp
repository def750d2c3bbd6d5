/**
 * @file cache.hpp
 * @brief Descriptors of serving engines' paged KV caches: per-layer base addresses, strides read
 * from the engine's tensors, block size, dtype and optional fp8 scales; and the slot rules.
 *
 * Every supported engine layout reduces to one address rule per element (`reference/engines.md`
 * §0): `base[l] + b*block_stride + t*token_stride + h*head_stride + (d/x)*chunk_stride +
 * (d%x)*dim_stride` for slot `s = b*block_size + t`, where `x = dim_chunk` is `head_dim` except in
 * vLLM's legacy key layout, which splits each key row into 16-byte chunks. The factories
 * (cache_factories.hpp, included at the end of this header) build that rule from the shape and
 * strides the engine reports for its tensors (never assuming contiguity), so a permuted view
 * (vLLM's HND "stride order") is described exactly. The overlap rule of validate() is in
 * detail/cache/overlap.hpp.
 */
#pragma once

#include <inferscale/config.hpp>
#include <inferscale/detail/cache/overlap.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace inferscale {

/**
 * @brief Where element (block, token in block, head, dim) of one layer's K (or V) lies, in elements
 * of the cache dtype from that layer's base address. A value type with constexpr index math.
 */
struct paged_kv_layout {
  std::int64_t num_blocks{};    ///< blocks (pages) in the cache
  std::int32_t block_size{};    ///< tokens per block
  std::int32_t num_heads{};     ///< KV heads held by this cache (a tensor-parallel rank's share)
  std::int32_t head_dim{};      ///< elements per head
  std::int64_t block_stride{};  ///< elements between blocks
  std::int64_t token_stride{};  ///< elements between tokens of a block
  std::int64_t head_stride{};   ///< elements between heads
  std::int64_t dim_stride{1};   ///< elements between consecutive dims of one chunk
  std::int32_t dim_chunk{};     ///< dims per chunk: head_dim, or x = 16 / element size (legacy key)
  std::int64_t chunk_stride{};  ///< elements between chunks (unused when dim_chunk == head_dim)
  /// Tokens per token chunk, 0 for none: token t of a block then lies at (t / token_chunk) *
  /// token_chunk_stride + (t % token_chunk) * token_stride (vLLM's CPU cache under AMX tiles
  /// keys by 16 tokens and pairs values' tokens; make_vllm_cpu_cache). Divides block_size.
  std::int32_t token_chunk{};
  std::int64_t token_chunk_stride{};  ///< elements between token chunks (token_chunk > 0)

  /// The address map's dimensions: blocks, tokens (of a chunk), heads, dims (of a chunk), dim
  /// chunks, token chunks.
  static constexpr int address_dimensions = 6;

  /// @brief Slots addressable: `num_blocks * block_size`.
  INFERSCALE_HOST_DEVICE constexpr std::int64_t num_slots() const noexcept
  {
    return num_blocks * block_size;
  }

  /// @brief Offset of element (block, token, head, dim), in elements.
  INFERSCALE_HOST_DEVICE constexpr std::int64_t offset(std::int64_t block,
                                                       std::int32_t token,
                                                       std::int32_t head,
                                                       std::int32_t dim) const noexcept
  {
    std::int64_t const tokens =
      token_chunk > 0 ? static_cast<std::int64_t>(token / token_chunk) * token_chunk_stride +
                          static_cast<std::int64_t>(token % token_chunk) * token_stride
                      : token * token_stride;
    return block * block_stride + tokens + head * head_stride +
           static_cast<std::int64_t>(dim / dim_chunk) * chunk_stride +
           static_cast<std::int64_t>(dim % dim_chunk) * dim_stride;
  }

  /// @brief Offset of element (head, dim) of the token in slot `slot` (slot >= 0).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t slot_offset(std::int64_t slot,
                                                            std::int32_t head,
                                                            std::int32_t dim) const noexcept
  {
    detail::index_quotient const d = detail::index_divmod(slot, block_size);
    return offset(d.quotient, static_cast<std::int32_t>(d.remainder), head, dim);
  }

  /**
   * @brief The address map's `address_dimensions` dimensions (blocks, tokens within a token
   * chunk, heads, dims within a chunk, dim chunks, token chunks) with strides in bytes for elements
   * of `element_bytes` bytes.
   */
  void dimensions(std::int64_t element_bytes, detail::stride_dimension* out) const noexcept
  {
    bool const chunked = token_chunk > 0;
    out[0]             = {num_blocks, block_stride * element_bytes};
    out[1]             = {chunked ? token_chunk : block_size, token_stride * element_bytes};
    out[2]             = {num_heads, head_stride * element_bytes};
    out[3]             = {dim_chunk, dim_stride * element_bytes};
    out[4]             = {dim_chunk > 0 ? head_dim / dim_chunk : 0, chunk_stride * element_bytes};
    out[5]             = {chunked ? block_size / token_chunk : 1,
              chunked ? token_chunk_stride * element_bytes : 0};
  }

  /**
   * @brief Checks every field (positive sizes, non-negative strides, chunk dividing head_dim) and
   * that no two (block, token, head, dim) share memory (detail::strides_disjoint: sorted by
   * stride, each stride exceeds the reach of the smaller ones), for elements of `element_bytes`.
   * @throw logic_error naming the field; `what` prefixes the message.
   */
  void validate(std::string const& what, std::int64_t element_bytes = 1) const
  {
    INFERSCALE_EXPECTS(num_blocks > 0 && block_size > 0 && num_heads > 0 && head_dim > 0,
                       what + ": blocks, block size, heads and head_dim must be positive, got " +
                         std::to_string(num_blocks) + ", " + std::to_string(block_size) + ", " +
                         std::to_string(num_heads) + ", " + std::to_string(head_dim));
    INFERSCALE_EXPECTS(block_stride >= 0 && token_stride >= 0 && head_stride >= 0 &&
                         dim_stride >= 0 && chunk_stride >= 0 && token_chunk_stride >= 0,
                       what + ": strides must be non-negative");
    INFERSCALE_EXPECTS(dim_chunk > 0 && head_dim % dim_chunk == 0,
                       what + ": dim_chunk " + std::to_string(dim_chunk) +
                         " must divide head_dim " + std::to_string(head_dim));
    INFERSCALE_EXPECTS(token_chunk >= 0 && (token_chunk == 0 || block_size % token_chunk == 0),
                       what + ": token_chunk " + std::to_string(token_chunk) +
                         " must be 0 (none) or divide block_size " + std::to_string(block_size));
    constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 16;
    INFERSCALE_EXPECTS(block_stride <= limit && token_stride <= limit && head_stride <= limit &&
                         dim_stride <= limit && chunk_stride <= limit &&
                         token_chunk_stride <= limit,
                       what + ": a stride exceeds 2^59 elements");
    detail::stride_dimension dims[address_dimensions];
    dimensions(element_bytes, dims);
    std::int64_t reach = 0;
    INFERSCALE_EXPECTS(
      detail::strides_disjoint(dims, address_dimensions, element_bytes, &reach),
      what + ": elements overlap in memory (or the span overflows 64 bits): block, token, head, " +
        "dim and chunk strides " + std::to_string(block_stride) + ", " +
        std::to_string(token_stride) + ", " + std::to_string(head_stride) + ", " +
        std::to_string(dim_stride) + ", " + std::to_string(chunk_stride) + " for extents " +
        std::to_string(num_blocks) + ", " + std::to_string(block_size) + ", " +
        std::to_string(num_heads) + ", " + std::to_string(dim_chunk) + ", " +
        std::to_string(head_dim / dim_chunk) + " (token chunks " + std::to_string(token_chunk) +
        " apart by " + std::to_string(token_chunk_stride) +
        ") must nest (sorted by stride, each larger than the span of the smaller ones) so that "
        "heads, tokens and blocks never share an element");
  }

  /// @brief Bytes from an element's base to the last byte the layout touches, plus one.
  std::int64_t span_bytes(std::int64_t element_bytes) const noexcept
  {
    detail::stride_dimension dims[address_dimensions];
    dimensions(element_bytes, dims);
    std::int64_t reach = 0;
    return detail::strides_disjoint(dims, address_dimensions, element_bytes, &reach) ? reach + 1
                                                                                     : -1;
  }

  friend constexpr bool operator==(paged_kv_layout const& a, paged_kv_layout const& b) noexcept
  {
    return a.num_blocks == b.num_blocks && a.block_size == b.block_size &&
           a.num_heads == b.num_heads && a.head_dim == b.head_dim &&
           a.block_stride == b.block_stride && a.token_stride == b.token_stride &&
           a.head_stride == b.head_stride && a.dim_stride == b.dim_stride &&
           a.dim_chunk == b.dim_chunk && a.chunk_stride == b.chunk_stride &&
           a.token_chunk == b.token_chunk && a.token_chunk_stride == b.token_chunk_stride;
  }
};

/// @brief How an fp8 cache's scale relates stored and real values (`reference/engines.md` §9).
enum class kv_scale_convention : std::uint8_t {
  divide,    ///< stored = fp8(x / scale), real = stored * scale (vLLM, SGLang)
  multiply,  ///< stored = fp8(x * scale), real = stored / scale (FlashInfer, TensorRT-LLM)
};

/// @brief How many scales a layer has.
enum class kv_scale_granularity : std::uint8_t {
  none,        ///< no scaling (scale 1)
  per_tensor,  ///< one fp32 scale per layer for K and one for V (vLLM `layer._k_scale` of shape
               ///< [1])
  per_head,    ///< one fp32 scale per KV head (shape [heads])
};

/// @brief The engine layouts the factories below describe (recorded for messages and tests).
enum class paged_kv_format : std::uint8_t {
  generic,
  vllm_flash_attn,
  vllm_flashinfer,
  vllm_legacy,
  sglang_token_pool,
  tensorrt_llm,
  contiguous,
  vllm_cpu,
};

/// @brief Name of a format.
inline char const* to_string(paged_kv_format f) noexcept
{
  switch (f) {
    case paged_kv_format::generic: return "generic";
    case paged_kv_format::vllm_flash_attn: return "vllm_flash_attn";
    case paged_kv_format::vllm_flashinfer: return "vllm_flashinfer";
    case paged_kv_format::vllm_legacy: return "vllm_legacy";
    case paged_kv_format::sglang_token_pool: return "sglang_token_pool";
    case paged_kv_format::tensorrt_llm: return "tensorrt_llm";
    case paged_kv_format::contiguous: return "contiguous";
    case paged_kv_format::vllm_cpu: return "vllm_cpu";
  }
  return "unknown";
}

/**
 * @brief A non-owning, trivially copyable description of an engine's paged KV cache for the layers
 * one rank holds: per-layer K and V base addresses, the K and V layouts, the dtype and optional fp8
 * scales. Kernels take it by value. Build it with the `make_*_cache` factories.
 *
 * The memory it points to is the engine's; whether that is host or device memory is the caller's
 * choice of backend (injection_batch::run on the host or the device).
 */
struct paged_kv_cache {
  static constexpr std::int32_t max_layers = 128;  ///< Llama-3.1-405B has 126

  dtype cache_dtype{dtype::bfloat16};
  paged_kv_format format{paged_kv_format::generic};
  std::int32_t num_layers{};
  paged_kv_layout key_layout{};
  paged_kv_layout value_layout{};
  void* key_base[max_layers]{};
  void* value_base[max_layers]{};
  kv_scale_convention scale_convention{kv_scale_convention::divide};
  kv_scale_granularity scale_granularity{kv_scale_granularity::none};
  float const* key_scale[max_layers]{};    ///< per layer: 1 or num_heads fp32 values
  float const* value_scale[max_layers]{};  ///< per layer: 1 or num_heads fp32 values

  /// @brief Slots addressable (the smaller of the K and V layouts' counts).
  INFERSCALE_HOST_DEVICE constexpr std::int64_t num_slots() const noexcept
  {
    return key_layout.num_slots() < value_layout.num_slots() ? key_layout.num_slots()
                                                             : value_layout.num_slots();
  }
  INFERSCALE_HOST_DEVICE constexpr std::int32_t num_heads() const noexcept
  {
    return key_layout.num_heads;
  }
  INFERSCALE_HOST_DEVICE constexpr std::int32_t head_dim() const noexcept
  {
    return key_layout.head_dim;
  }

  /// @brief The scale of layer `layer`, head `head` for K (`value == false`) or V; 1 if none.
  INFERSCALE_HOST_DEVICE float scale(std::int32_t layer, std::int32_t head, bool value) const
  {
    if (scale_granularity == kv_scale_granularity::none) { return 1.0f; }
    float const* s = value ? value_scale[layer] : key_scale[layer];
    return scale_granularity == kv_scale_granularity::per_head ? s[head] : s[0];
  }

  /**
   * @brief Sets fp8 scales, one pointer per layer for K and for V (1 or num_heads floats each, in
   * the memory the backend reads: host for the host run, device for the device run).
   * @throw logic_error if the cache is not fp8, the counts differ from num_layers or a pointer is
   *        null.
   */
  void set_fp8_scales(kv_scale_convention convention,
                      kv_scale_granularity granularity,
                      std::vector<float const*> const& key_scales,
                      std::vector<float const*> const& value_scales)
  {
    INFERSCALE_EXPECTS(
      cache_dtype == dtype::float8_e4m3 || cache_dtype == dtype::float8_e5m2,
      std::string{"paged_kv_cache::set_fp8_scales: scales apply to fp8 caches, this one is "} +
        to_string(cache_dtype));
    if (granularity == kv_scale_granularity::none) {
      scale_convention  = convention;
      scale_granularity = granularity;
      return;
    }
    INFERSCALE_EXPECTS(static_cast<std::int64_t>(key_scales.size()) == num_layers &&
                         static_cast<std::int64_t>(value_scales.size()) == num_layers,
                       "paged_kv_cache::set_fp8_scales: expected " + std::to_string(num_layers) +
                         " key and value scale pointers (one per layer), got " +
                         std::to_string(key_scales.size()) + " and " +
                         std::to_string(value_scales.size()));
    for (std::int32_t l = 0; l < num_layers; ++l) {
      INFERSCALE_EXPECTS(
        key_scales[l] != nullptr && value_scales[l] != nullptr,
        "paged_kv_cache::set_fp8_scales: null scale pointer for layer " + std::to_string(l));
    }
    scale_convention  = convention;
    scale_granularity = granularity;
    for (std::int32_t l = 0; l < num_layers; ++l) {
      key_scale[l]   = key_scales[l];
      value_scale[l] = value_scales[l];
    }
  }

  /**
   * @brief Reads the fp8 scales (host memory: the host backend's, or a host copy) and refuses a
   * zero, negative or non-finite one: dividing by it (or multiplying) would store infinities or
   * NaN in the engine's cache, or zero every element.
   * @throw logic_error naming the layer, head and value; `who` prefixes the message.
   */
  void check_scale_values(std::string const& who) const
  {
    if (scale_granularity == kv_scale_granularity::none) { return; }
    std::int32_t const count =
      scale_granularity == kv_scale_granularity::per_head ? key_layout.num_heads : 1;
    for (std::int32_t l = 0; l < num_layers; ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        float const* const s = kv == 0 ? key_scale[l] : value_scale[l];
        INFERSCALE_EXPECTS(s != nullptr,
                           who + ": null scale pointer for layer " + std::to_string(l));
        for (std::int32_t h = 0; h < count; ++h) {
          INFERSCALE_EXPECTS(std::isfinite(s[h]) && s[h] > 0.0f,
                             who + ": the " + (kv == 0 ? "key" : "value") + " scale of layer " +
                               std::to_string(l) +
                               (count > 1 ? ", head " + std::to_string(h) : "") + " is " +
                               std::to_string(s[h]) + "; fp8 scales must be positive and finite");
        }
      }
    }
  }

  /// @brief The overlap rule of validate() over the K and V regions of every layer.
  void check_regions_disjoint(std::int64_t element_bytes) const
  {
    std::int32_t const regions = 2 * num_layers;
    auto const base            = [&](std::int32_t r) {
      return static_cast<std::int64_t>(
        reinterpret_cast<std::uintptr_t>(r % 2 == 0 ? key_base[r / 2] : value_base[r / 2]));
    };
    auto const layout = [&](std::int32_t r) -> paged_kv_layout const& {
      return r % 2 == 0 ? key_layout : value_layout;
    };
    std::int64_t const key_span   = key_layout.span_bytes(element_bytes);
    std::int64_t const value_span = value_layout.span_bytes(element_bytes);
    // Fast path: byte ranges sorted by start; if none meets the next, all are disjoint.
    struct range {
      std::int64_t begin, end;
    };
    std::vector<range> ranges(static_cast<std::size_t>(regions));
    for (std::int32_t r = 0; r < regions; ++r) {
      std::int64_t const b                = base(r);
      std::int64_t const n                = r % 2 == 0 ? key_span : value_span;
      ranges[static_cast<std::size_t>(r)] = {b,
                                             n <= std::numeric_limits<std::int64_t>::max() - b
                                               ? b + n
                                               : std::numeric_limits<std::int64_t>::max()};
    }
    std::vector<range> sorted = ranges;
    std::sort(sorted.begin(), sorted.end(), [](range a, range b) { return a.begin < b.begin; });
    bool meet = false;
    for (std::size_t i = 1; i < sorted.size() && !meet; ++i) {
      meet = sorted[i].begin < sorted[i - 1].end;
    }
    if (!meet) { return; }
    for (std::int32_t i = 0; i < regions; ++i) {
      for (std::int32_t j = i + 1; j < regions; ++j) {
        range const a = ranges[static_cast<std::size_t>(i)];
        range const b = ranges[static_cast<std::size_t>(j)];
        if (a.end <= b.begin || b.end <= a.begin) { continue; }
        bool disjoint = false;
        if (layout(i) == layout(j)) {
          std::int64_t const difference = base(j) - base(i);
          detail::stride_dimension dims[paged_kv_layout::address_dimensions + 1];
          layout(i).dimensions(element_bytes, dims);
          dims[paged_kv_layout::address_dimensions] = {2,
                                                       difference < 0 ? -difference : difference};
          std::int64_t reach                        = 0;
          disjoint                                  = difference != 0 &&
                     detail::strides_disjoint(
                       dims, paged_kv_layout::address_dimensions + 1, element_bytes, &reach);
        } else {
          disjoint = detail::interleaved_blocks_disjoint(
            layout(i), base(i), layout(j), base(j), element_bytes);
        }
        INFERSCALE_EXPECTS(disjoint,
                           "paged_kv_cache: " + detail::cache_region_name(i) + " and " +
                             detail::cache_region_name(j) + " overlap in memory (bases " +
                             std::to_string(base(j) - base(i)) +
                             " bytes apart); every layer's K and V must be disjoint");
      }
    }
  }

  /**
   * @brief Checks the descriptor: dtype, layer count, both layouts, matching heads/head_dim/block
   * size, non-null bases, and that nothing the injection writes shares memory.
   *
   * The overlap rule: each layout alone must pass paged_kv_layout::validate (heads, tokens and
   * blocks nest, so no two of them share an element); and the 2 * num_layers regions (the K and
   * the V of every layer, each the byte set its base and layout address) must be pairwise
   * disjoint. Two regions with the same layout are disjoint when the layout extended by one more
   * dimension, of extent 2 and stride |base difference|, still nests (K and V interleaved by
   * blocks, as vLLM's FlashInfer layout, or layers interleaved in pages, as TensorRT-LLM's pool,
   * pass); regions with different layouts must lie in disjoint byte ranges `[base, base + span)`,
   * or share blocks and heads with disjoint intervals inside each (block, head) cell
   * (detail::interleaved_blocks_disjoint: vLLM's CPU cache, keys then values in each cell).
   * @throw logic_error naming what is wrong.
   */
  void validate() const
  {
    INFERSCALE_EXPECTS(num_layers > 0 && num_layers <= max_layers,
                       "paged_kv_cache: num_layers must be in [1, " + std::to_string(max_layers) +
                         "], got " + std::to_string(num_layers));
    auto const element_bytes = static_cast<std::int64_t>(size_of(cache_dtype));
    INFERSCALE_EXPECTS(element_bytes > 0, std::string{"paged_kv_cache: unknown cache dtype"});
    key_layout.validate("paged_kv_cache key layout", element_bytes);
    value_layout.validate("paged_kv_cache value layout", element_bytes);
    INFERSCALE_EXPECTS(key_layout.num_heads == value_layout.num_heads &&
                         key_layout.head_dim == value_layout.head_dim &&
                         key_layout.block_size == value_layout.block_size &&
                         key_layout.num_blocks == value_layout.num_blocks,
                       "paged_kv_cache: key and value layouts disagree on blocks, block size, "
                       "heads or head_dim");
    for (std::int32_t l = 0; l < num_layers; ++l) {
      INFERSCALE_EXPECTS(key_base[l] != nullptr && value_base[l] != nullptr,
                         "paged_kv_cache: null base address for layer " + std::to_string(l));
    }
    check_regions_disjoint(element_bytes);
    if (scale_granularity != kv_scale_granularity::none) {
      INFERSCALE_EXPECTS(cache_dtype == dtype::float8_e4m3 || cache_dtype == dtype::float8_e5m2,
                         std::string{"paged_kv_cache: scales apply to fp8 caches, this one is "} +
                           to_string(cache_dtype));
      for (std::int32_t l = 0; l < num_layers; ++l) {
        INFERSCALE_EXPECTS(key_scale[l] != nullptr && value_scale[l] != nullptr,
                           "paged_kv_cache: null scale pointer for layer " + std::to_string(l));
      }
    }
  }
};

/**
 * @brief Slots of prompt tokens `start_position .. start_position + num_tokens - 1` of a request
 * from its block table: `block_ids[p / block_size] * block_size + p % block_size` (vLLM connector,
 * LMCache, SGLang paged mode).
 *
 * @throw logic_error if the table is null (with tokens to map) or covers fewer than
 *        `start_position + num_tokens` tokens (the plan is longer than the slots given), a block id
 *        is negative, the block size is not positive, or the counts overflow 64 bits.
 */
inline std::vector<std::int64_t> slots_from_block_table(std::int32_t const* block_ids,
                                                        std::int64_t num_block_ids,
                                                        std::int32_t block_size,
                                                        std::int64_t start_position,
                                                        std::int64_t num_tokens)
{
  INFERSCALE_EXPECTS(
    block_size > 0,
    "slots_from_block_table: block size must be positive, got " + std::to_string(block_size));
  INFERSCALE_EXPECTS(start_position >= 0 && num_tokens >= 0 && num_block_ids >= 0,
                     "slots_from_block_table: start, token count and block count must be "
                     "non-negative");
  INFERSCALE_EXPECTS(num_tokens == 0 || block_ids != nullptr,
                     std::string{"slots_from_block_table: null block table"});
  INFERSCALE_EXPECTS(start_position <= std::numeric_limits<std::int64_t>::max() - num_tokens &&
                       num_block_ids <= std::numeric_limits<std::int64_t>::max() / block_size,
                     "slots_from_block_table: start " + std::to_string(start_position) + " + " +
                       std::to_string(num_tokens) + " tokens, or " + std::to_string(num_block_ids) +
                       " blocks of " + std::to_string(block_size) + ", overflow 64 bits");
  INFERSCALE_EXPECTS(
    start_position + num_tokens <= num_block_ids * block_size,
    "slots_from_block_table: tokens " + std::to_string(start_position) + " .. " +
      std::to_string(start_position + num_tokens) + " need " +
      detail::count_of(detail::ceil_div(start_position + num_tokens, block_size), "block") +
      ", the table has " + std::to_string(num_block_ids));
  std::vector<std::int64_t> slots(static_cast<std::size_t>(num_tokens));
  for (std::int64_t j = 0; j < num_tokens; ++j) {
    std::int64_t const p     = start_position + j;
    std::int32_t const block = block_ids[p / block_size];
    INFERSCALE_EXPECTS(block >= 0,
                       "slots_from_block_table: negative block id " + std::to_string(block) +
                         " at table index " + std::to_string(p / block_size));
    slots[static_cast<std::size_t>(j)] =
      static_cast<std::int64_t>(block) * block_size + p % block_size;
  }
  return slots;
}

}  // namespace inferscale

#include <inferscale/cache_factories.hpp>  // the factories were declared here before the split
