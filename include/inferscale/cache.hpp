/**
 * @file cache.hpp
 * @brief Descriptors of serving engines' paged KV caches: per-layer base addresses, strides read
 * from the engine's tensors, block size, dtype and optional fp8 scales; and the slot rules.
 *
 * Every supported engine layout reduces to one address rule per element (`reference/engines.md`
 * §0): `base[l] + b*block_stride + t*token_stride + h*head_stride + (d/x)*chunk_stride +
 * (d%x)*dim_stride` for slot `s = b*block_size + t`, where `x = dim_chunk` is `head_dim` except in
 * vLLM's legacy key layout, which splits each key row into 16-byte chunks. The factories below
 * build that rule from the shape and strides the engine reports for its tensors (never assuming
 * contiguity), so a permuted view (vLLM's HND "stride order") is described exactly.
 */
#pragma once

#include <inferscale/config.hpp>
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

namespace detail {
/// @brief One dimension of a strided address map: `extent` indices, `stride` bytes apart.
struct stride_dimension {
  std::int64_t extent{};
  std::int64_t stride{};
};

/**
 * @brief Whether a strided map of elements of `element_bytes` bytes touches every byte at most
 * once, by a sufficient rule: take the dimensions of extent > 1 by increasing stride; each
 * stride must exceed the reach of all smaller ones (`element_bytes - 1 + sum stride * (extent -
 * 1)` over them), so that, as in a mixed-radix number, no two index tuples give overlapping
 * elements. Every padded or permuted nesting of dimensions passes; a zero stride, or strides that
 * interleave (e.g. a token stride smaller than heads * head_dim with head stride head_dim), fail.
 * @param reach set to the byte offset of the last byte the map touches (when it passes)
 * @return false if the rule fails or the reach overflows 64 bits
 */
inline bool strides_disjoint(stride_dimension* dims,
                             int count,
                             std::int64_t element_bytes,
                             std::int64_t* reach)
{
  // Insertion sort: at most six dimensions.
  for (int i = 1; i < count; ++i) {
    for (int j = i; j > 0 && dims[j].stride < dims[j - 1].stride; --j) {
      stride_dimension const t = dims[j];
      dims[j]                  = dims[j - 1];
      dims[j - 1]              = t;
    }
  }
  std::int64_t r = element_bytes - 1;
  for (int i = 0; i < count; ++i) {
    if (dims[i].extent <= 1) { continue; }
    if (dims[i].stride <= r) { return false; }
    std::int64_t const n = dims[i].extent - 1;
    if (dims[i].stride > (std::numeric_limits<std::int64_t>::max() - r) / n) { return false; }
    r += dims[i].stride * n;
  }
  *reach = r;
  return true;
}
/**
 * @brief Whether two regions with different layouts but the same blocks and heads (same extents
 * and strides: K and V sharing each (block, head) cell, as in vLLM's CPU cache) touch disjoint
 * bytes, by a sufficient rule: within one cell each region's tokens and dims reach an interval
 * `[base, base + inner span)`; the two intervals must not meet, and the blocks and heads must nest
 * over the union of both (each cell's stride beyond the union's span).
 * @param a, b  the layouts (each already valid); `base_a`, `base_b` their base addresses in bytes
 */
template <class Layout>
inline bool interleaved_blocks_disjoint(Layout const& a,
                                        std::int64_t base_a,
                                        Layout const& b,
                                        std::int64_t base_b,
                                        std::int64_t element_bytes)
{
  if (a.num_blocks != b.num_blocks || a.block_stride != b.block_stride ||
      a.num_heads != b.num_heads || a.head_stride != b.head_stride) {
    return false;
  }
  auto const inner_span = [element_bytes](Layout const& l) -> std::int64_t {
    stride_dimension dims[5];
    l.dimensions(element_bytes, dims);
    stride_dimension inner[3] = {dims[1], dims[3], dims[4]};  // tokens, dims, chunks
    std::int64_t reach        = 0;
    return strides_disjoint(inner, 3, element_bytes, &reach) ? reach + 1 : -1;
  };
  std::int64_t const na = inner_span(a);
  std::int64_t const nb = inner_span(b);
  if (na <= 0 || nb <= 0) { return false; }
  constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 4;
  if (base_a > limit || base_b > limit || na > limit || nb > limit) { return false; }
  if (!(base_a + na <= base_b || base_b + nb <= base_a)) { return false; }
  std::int64_t const lo     = std::min(base_a, base_b);
  std::int64_t const union_ = std::max(base_a + na, base_b + nb) - lo;
  stride_dimension outer[2] = {{a.num_blocks, a.block_stride * element_bytes},
                               {a.num_heads, a.head_stride * element_bytes}};
  std::int64_t reach        = 0;
  return strides_disjoint(outer, 2, union_, &reach);
}

/// @brief "the key of layer 3" / "the value of layer 0" for messages about region `r` (K, V of
/// layer r / 2).
inline std::string cache_region_name(std::int32_t r)
{
  return std::string{r % 2 == 0 ? "the key" : "the value"} + " of layer " + std::to_string(r / 2);
}

}  // namespace detail

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
    return block * block_stride + token * token_stride + head * head_stride +
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
   * @brief The address map's five dimensions (blocks, tokens, heads, dims within a chunk,
   * chunks) with strides in bytes for elements of `element_bytes` bytes.
   */
  void dimensions(std::int64_t element_bytes, detail::stride_dimension* out) const noexcept
  {
    out[0] = {num_blocks, block_stride * element_bytes};
    out[1] = {block_size, token_stride * element_bytes};
    out[2] = {num_heads, head_stride * element_bytes};
    out[3] = {dim_chunk, dim_stride * element_bytes};
    out[4] = {dim_chunk > 0 ? head_dim / dim_chunk : 0, chunk_stride * element_bytes};
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
                         dim_stride >= 0 && chunk_stride >= 0,
                       what + ": strides must be non-negative");
    INFERSCALE_EXPECTS(dim_chunk > 0 && head_dim % dim_chunk == 0,
                       what + ": dim_chunk " + std::to_string(dim_chunk) +
                         " must divide head_dim " + std::to_string(head_dim));
    constexpr std::int64_t limit = std::numeric_limits<std::int64_t>::max() / 16;
    INFERSCALE_EXPECTS(block_stride <= limit && token_stride <= limit && head_stride <= limit &&
                         dim_stride <= limit && chunk_stride <= limit,
                       what + ": a stride exceeds 2^59 elements");
    detail::stride_dimension dims[5];
    dimensions(element_bytes, dims);
    std::int64_t reach = 0;
    INFERSCALE_EXPECTS(
      detail::strides_disjoint(dims, 5, element_bytes, &reach),
      what + ": elements overlap in memory (or the span overflows 64 bits): block, token, head, " +
        "dim and chunk strides " + std::to_string(block_stride) + ", " +
        std::to_string(token_stride) + ", " + std::to_string(head_stride) + ", " +
        std::to_string(dim_stride) + ", " + std::to_string(chunk_stride) + " for extents " +
        std::to_string(num_blocks) + ", " + std::to_string(block_size) + ", " +
        std::to_string(num_heads) + ", " + std::to_string(dim_chunk) + ", " +
        std::to_string(head_dim / dim_chunk) +
        " must nest (sorted by stride, each larger than the span of the smaller ones) so that "
        "heads, tokens and blocks never share an element");
  }

  /// @brief Bytes from an element's base to the last byte the layout touches, plus one.
  std::int64_t span_bytes(std::int64_t element_bytes) const noexcept
  {
    detail::stride_dimension dims[5];
    dimensions(element_bytes, dims);
    std::int64_t reach = 0;
    return detail::strides_disjoint(dims, 5, element_bytes, &reach) ? reach + 1 : -1;
  }

  friend constexpr bool operator==(paged_kv_layout const& a, paged_kv_layout const& b) noexcept
  {
    return a.num_blocks == b.num_blocks && a.block_size == b.block_size &&
           a.num_heads == b.num_heads && a.head_dim == b.head_dim &&
           a.block_stride == b.block_stride && a.token_stride == b.token_stride &&
           a.head_stride == b.head_stride && a.dim_stride == b.dim_stride &&
           a.dim_chunk == b.dim_chunk && a.chunk_stride == b.chunk_stride;
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
 * choice of backend (inject_host / inject_async).
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
   * the memory the backend reads: host for inject_host, device for inject_async).
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
                               std::to_string(l) + (count > 1 ? ", head " + std::to_string(h) : "") +
                               " is " + std::to_string(s[h]) +
                               "; fp8 scales must be positive and finite");
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
      std::int64_t const b = base(r);
      std::int64_t const n = r % 2 == 0 ? key_span : value_span;
      ranges[static_cast<std::size_t>(r)] = {
        b, n <= std::numeric_limits<std::int64_t>::max() - b ? b + n
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
          detail::stride_dimension dims[6];
          layout(i).dimensions(element_bytes, dims);
          dims[5]            = {2, difference < 0 ? -difference : difference};
          std::int64_t reach = 0;
          disjoint = difference != 0 && detail::strides_disjoint(dims, 6, element_bytes, &reach);
        } else {
          disjoint = detail::interleaved_blocks_disjoint(
            layout(i), base(i), layout(j), base(j), element_bytes);
        }
        INFERSCALE_EXPECTS(disjoint,
                           "paged_kv_cache: " + detail::cache_region_name(i) + " and " +
                             detail::cache_region_name(j) +
                             " overlap in memory (bases " + std::to_string(base(j) - base(i)) +
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

namespace detail {

inline void expect_cache_dtype(dtype t, char const* who)
{
  (void)size_of(t);  // rejects values outside the enum
  INFERSCALE_EXPECTS(t == dtype::float32 || t == dtype::float16 || t == dtype::bfloat16 ||
                       t == dtype::float8_e4m3 || t == dtype::float8_e5m2,
                     std::string{who} + ": unsupported cache dtype");
}

template <std::size_t N>
inline void expect_shape(std::array<std::int64_t, N> const& shape,
                         std::array<std::int64_t, N> const& strides,
                         char const* who)
{
  for (std::size_t i = 0; i < N; ++i) {
    INFERSCALE_EXPECTS(shape[i] > 0,
                       std::string{who} + ": dimension " + std::to_string(i) +
                         " of the shape must be positive, got " + std::to_string(shape[i]));
    INFERSCALE_EXPECTS(strides[i] >= 0,
                       std::string{who} + ": stride " + std::to_string(i) +
                         " must be non-negative, got " + std::to_string(strides[i]));
  }
}

inline void expect_layers(std::size_t n, std::size_t m, char const* who)
{
  INFERSCALE_EXPECTS(n > 0 && n <= static_cast<std::size_t>(paged_kv_cache::max_layers),
                     std::string{who} + ": between 1 and " +
                       std::to_string(paged_kv_cache::max_layers) + " layers, got " +
                       std::to_string(n));
  INFERSCALE_EXPECTS(n == m,
                     std::string{who} + ": " +
                       detail::count_of(static_cast<std::int64_t>(n), "key tensor") + " but " +
                       detail::count_of(static_cast<std::int64_t>(m), "value tensor"));
}

inline void* advance(void* base, std::int64_t elements, dtype t)
{
  return static_cast<unsigned char*>(base) + elements * static_cast<std::int64_t>(size_of(t));
}

inline std::int32_t narrow_dim(std::int64_t v, char const* who, char const* what)
{
  INFERSCALE_EXPECTS(v > 0 && v <= (std::int64_t{1} << 30),
                     std::string{who} + ": " + what + " out of range: " + std::to_string(v));
  return static_cast<std::int32_t>(v);
}

}  // namespace detail

/**
 * @brief Describes any cache given per-layer K and V base addresses and the two layouts.
 * @throw logic_error if the descriptor is invalid (see paged_kv_cache::validate).
 */
inline paged_kv_cache make_paged_kv_cache(dtype cache_dtype,
                                          std::vector<void*> const& key_bases,
                                          std::vector<void*> const& value_bases,
                                          paged_kv_layout const& key_layout,
                                          paged_kv_layout const& value_layout)
{
  detail::expect_cache_dtype(cache_dtype, "make_paged_kv_cache");
  detail::expect_layers(key_bases.size(), value_bases.size(), "make_paged_kv_cache");
  paged_kv_cache cache{};
  cache.cache_dtype  = cache_dtype;
  cache.num_layers   = static_cast<std::int32_t>(key_bases.size());
  cache.key_layout   = key_layout;
  cache.value_layout = value_layout;
  // expect_layers bounds the count; the min tells the compiler so too (it cannot see the throw).
  std::size_t const count =
    std::min(key_bases.size(), static_cast<std::size_t>(paged_kv_cache::max_layers));
  for (std::size_t l = 0; l < count; ++l) {
    cache.key_base[l]   = key_bases[l];
    cache.value_base[l] = value_bases[l];
  }
  cache.validate();
  return cache;
}

namespace detail {
/// @brief Layout of a `[blocks, tokens, heads, dim]`-indexed tensor given its four strides.
inline paged_kv_layout block_token_head_dim_layout(std::int64_t num_blocks,
                                                   std::int64_t block_size,
                                                   std::int64_t heads,
                                                   std::int64_t head_dim,
                                                   std::int64_t block_stride,
                                                   std::int64_t token_stride,
                                                   std::int64_t head_stride,
                                                   std::int64_t dim_stride,
                                                   char const* who)
{
  paged_kv_layout layout{};
  layout.num_blocks   = num_blocks;
  layout.block_size   = narrow_dim(block_size, who, "block size");
  layout.num_heads    = narrow_dim(heads, who, "heads");
  layout.head_dim     = narrow_dim(head_dim, who, "head_dim");
  layout.block_stride = block_stride;
  layout.token_stride = token_stride;
  layout.head_stride  = head_stride;
  layout.dim_stride   = dim_stride;
  layout.dim_chunk    = layout.head_dim;
  layout.chunk_stride = 0;
  return layout;
}
}  // namespace detail

/**
 * @brief vLLM FlashAttention backend, one tensor per layer of logical shape
 * `(2, num_blocks, block_size, heads, head_dim)` (`kv_cache.unbind(0)` gives K, V), NHD or HND:
 * pass the tensor's `shape()` and `stride()` as vLLM reports them for the logical order.
 *
 * @param layer_tensors `data_ptr()` of each layer's tensor, in layer order
 * @throw logic_error if shapes or strides are invalid or there are too many layers.
 */
inline paged_kv_cache make_vllm_flash_attn_cache(dtype cache_dtype,
                                                 std::vector<void*> const& layer_tensors,
                                                 std::array<std::int64_t, 5> const& shape,
                                                 std::array<std::int64_t, 5> const& strides)
{
  char const* who = "make_vllm_flash_attn_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, strides, who);
  INFERSCALE_EXPECTS(
    shape[0] == 2,
    std::string{who} + ": dimension 0 must be 2 (K, V), got " + std::to_string(shape[0]));
  auto const layout = detail::block_token_head_dim_layout(
    shape[1], shape[2], shape[3], shape[4], strides[1], strides[2], strides[3], strides[4], who);
  std::vector<void*> values;
  for (void* base : layer_tensors) {
    values.push_back(base ? detail::advance(base, strides[0], cache_dtype) : nullptr);
  }
  auto cache   = make_paged_kv_cache(cache_dtype, layer_tensors, values, layout, layout);
  cache.format = paged_kv_format::vllm_flash_attn;
  return cache;
}

/**
 * @brief vLLM's CPU attention backend (`CPU_ATTN`, ISA `vec`; `reference/vllm-cpu.md`): one tensor
 * per layer of shape `(num_blocks, heads, block_size, 2 * head_dim)`. Each (block, head) holds
 * `2 * block_size * head_dim` elements: first the block's keys stored transposed, `[head_dim,
 * block_size]` (key (t, d) at `d * block_size + t`), then its values row-major, `[block_size,
 * head_dim]` (value (t, d) at `block_size * head_dim + t * head_dim + d`).
 *
 * The last two dimensions must be dense (stride of dimension 3 = s, of dimension 2 = 2 * head_dim
 * * s), since the transposed key region reinterprets them; blocks and heads may have any strides.
 * Other ISAs of that backend (`amx`, `neon`) are not described by this factory.
 *
 * @param layer_tensors `data_ptr()` of each layer's tensor, in layer order
 * @throw logic_error if shapes or strides are invalid, the last dimension is odd or the last two
 *        dimensions are not dense.
 */
inline paged_kv_cache make_vllm_cpu_cache(dtype cache_dtype,
                                          std::vector<void*> const& layer_tensors,
                                          std::array<std::int64_t, 4> const& shape,
                                          std::array<std::int64_t, 4> const& strides)
{
  char const* who = "make_vllm_cpu_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, strides, who);
  INFERSCALE_EXPECTS(shape[3] % 2 == 0,
                     std::string{who} + ": dimension 3 must be 2 * head_dim (even), got " +
                       std::to_string(shape[3]));
  std::int64_t const head_dim = shape[3] / 2;
  std::int64_t const s        = strides[3];
  INFERSCALE_EXPECTS(s > 0 && shape[3] <= std::numeric_limits<std::int64_t>::max() / 16 / s &&
                       strides[2] == shape[3] * s,
                     std::string{who} +
                       ": the last two dimensions must be dense (the key region is read "
                       "transposed): stride 2 must be dimension 3 * stride 3 = " +
                       std::to_string(shape[3]) + " * " + std::to_string(s) + ", got " +
                       std::to_string(strides[2]));
  std::int64_t const block_size = shape[2];
  // K: token t at t * s, dim d at d * block_size * s. V: after the block_size * head_dim keys.
  auto const k = detail::block_token_head_dim_layout(
    shape[0], block_size, shape[1], head_dim, strides[0], s, strides[1], block_size * s, who);
  auto const v = detail::block_token_head_dim_layout(
    shape[0], block_size, shape[1], head_dim, strides[0], head_dim * s, strides[1], s, who);
  std::vector<void*> values;
  for (void* base : layer_tensors) {
    values.push_back(base ? detail::advance(base, block_size * head_dim * s, cache_dtype)
                          : nullptr);
  }
  auto cache   = make_paged_kv_cache(cache_dtype, layer_tensors, values, k, v);
  cache.format = paged_kv_format::vllm_cpu;
  return cache;
}

/**
 * @brief vLLM FlashAttention with separate K and V tensors per layer, each of logical shape
 * `(num_blocks, block_size, heads, head_dim)` with their own strides.
 * @throw logic_error if shapes or strides are invalid or K and V disagree.
 */
inline paged_kv_cache make_vllm_flash_attn_cache(dtype cache_dtype,
                                                 std::vector<void*> const& key_tensors,
                                                 std::vector<void*> const& value_tensors,
                                                 std::array<std::int64_t, 4> const& shape,
                                                 std::array<std::int64_t, 4> const& key_strides,
                                                 std::array<std::int64_t, 4> const& value_strides)
{
  char const* who = "make_vllm_flash_attn_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, key_strides, who);
  detail::expect_shape(shape, value_strides, who);
  auto const k = detail::block_token_head_dim_layout(shape[0],
                                                     shape[1],
                                                     shape[2],
                                                     shape[3],
                                                     key_strides[0],
                                                     key_strides[1],
                                                     key_strides[2],
                                                     key_strides[3],
                                                     who);
  auto const v = detail::block_token_head_dim_layout(shape[0],
                                                     shape[1],
                                                     shape[2],
                                                     shape[3],
                                                     value_strides[0],
                                                     value_strides[1],
                                                     value_strides[2],
                                                     value_strides[3],
                                                     who);
  auto cache   = make_paged_kv_cache(cache_dtype, key_tensors, value_tensors, k, v);
  cache.format = paged_kv_format::vllm_flash_attn;
  return cache;
}

/**
 * @brief vLLM FlashInfer and Triton backends: one tensor per layer of logical shape
 * `(num_blocks, 2, block_size, heads, head_dim)` (`kv_cache[:, 0]` is K), NHD or HND by strides.
 * Also FlashInfer's own single-tensor NHD layout `[P, 2, page, H, D]`; its HND `[P, 2, H, page, D]`
 * is the same logical order with HND strides.
 * @throw logic_error if shapes or strides are invalid.
 */
inline paged_kv_cache make_vllm_flashinfer_cache(dtype cache_dtype,
                                                 std::vector<void*> const& layer_tensors,
                                                 std::array<std::int64_t, 5> const& shape,
                                                 std::array<std::int64_t, 5> const& strides)
{
  char const* who = "make_vllm_flashinfer_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, strides, who);
  INFERSCALE_EXPECTS(
    shape[1] == 2,
    std::string{who} + ": dimension 1 must be 2 (K, V), got " + std::to_string(shape[1]));
  auto const layout = detail::block_token_head_dim_layout(
    shape[0], shape[2], shape[3], shape[4], strides[0], strides[2], strides[3], strides[4], who);
  std::vector<void*> values;
  for (void* base : layer_tensors) {
    values.push_back(base ? detail::advance(base, strides[1], cache_dtype) : nullptr);
  }
  auto cache   = make_paged_kv_cache(cache_dtype, layer_tensors, values, layout, layout);
  cache.format = paged_kv_format::vllm_flashinfer;
  return cache;
}

/**
 * @brief vLLM's legacy paged-attention layout: per layer a key tensor of logical shape
 * `(num_blocks, heads, head_dim / x, block_size, x)` with `x = 16 / element size`, and a value
 * tensor `(num_blocks, heads, head_dim, block_size)` (token-fastest).
 * @throw logic_error if shapes or strides are invalid or x is not 16 / element size.
 */
inline paged_kv_cache make_vllm_legacy_cache(dtype cache_dtype,
                                             std::vector<void*> const& key_tensors,
                                             std::vector<void*> const& value_tensors,
                                             std::array<std::int64_t, 5> const& key_shape,
                                             std::array<std::int64_t, 5> const& key_strides,
                                             std::array<std::int64_t, 4> const& value_shape,
                                             std::array<std::int64_t, 4> const& value_strides)
{
  char const* who = "make_vllm_legacy_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(key_shape, key_strides, who);
  detail::expect_shape(value_shape, value_strides, who);
  std::int64_t const x = 16 / static_cast<std::int64_t>(size_of(cache_dtype));
  INFERSCALE_EXPECTS(key_shape[4] == x,
                     std::string{who} + ": key dimension 4 must be x = 16 / element size = " +
                       std::to_string(x) + ", got " + std::to_string(key_shape[4]));
  std::int64_t const head_dim = key_shape[2] * x;
  INFERSCALE_EXPECTS(value_shape[0] == key_shape[0] && value_shape[1] == key_shape[1] &&
                       value_shape[2] == head_dim && value_shape[3] == key_shape[3],
                     std::string{who} +
                       ": value shape must be (blocks, heads, head_dim, "
                       "block_size) matching the key shape");
  paged_kv_layout k{};
  k.num_blocks   = key_shape[0];
  k.num_heads    = detail::narrow_dim(key_shape[1], who, "heads");
  k.head_dim     = detail::narrow_dim(head_dim, who, "head_dim");
  k.block_size   = detail::narrow_dim(key_shape[3], who, "block size");
  k.block_stride = key_strides[0];
  k.head_stride  = key_strides[1];
  k.chunk_stride = key_strides[2];
  k.token_stride = key_strides[3];
  k.dim_stride   = key_strides[4];
  k.dim_chunk    = static_cast<std::int32_t>(x);
  auto const v   = detail::block_token_head_dim_layout(value_shape[0],
                                                     value_shape[3],
                                                     value_shape[1],
                                                     value_shape[2],
                                                     value_strides[0],
                                                     value_strides[3],
                                                     value_strides[1],
                                                     value_strides[2],
                                                     who);
  auto cache     = make_paged_kv_cache(cache_dtype, key_tensors, value_tensors, k, v);
  cache.format   = paged_kv_format::vllm_legacy;
  return cache;
}

/**
 * @brief SGLang `MHATokenToKVPool`: per layer `k_buffer[l]` and `v_buffer[l]` of logical shape
 * `(rows, heads, head_dim)`; a slot is a token location `loc` (row), so the block size is 1 and
 * slots address rows `0 .. rows-1` (row 0 / the first page being SGLang's padding dummy).
 * @throw logic_error if shapes or strides are invalid.
 */
inline paged_kv_cache make_sglang_cache(dtype cache_dtype,
                                        std::vector<void*> const& key_buffers,
                                        std::vector<void*> const& value_buffers,
                                        std::array<std::int64_t, 3> const& shape,
                                        std::array<std::int64_t, 3> const& key_strides,
                                        std::array<std::int64_t, 3> const& value_strides)
{
  char const* who = "make_sglang_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, key_strides, who);
  detail::expect_shape(shape, value_strides, who);
  auto const k = detail::block_token_head_dim_layout(
    shape[0], 1, shape[1], shape[2], key_strides[0], 0, key_strides[1], key_strides[2], who);
  auto const v = detail::block_token_head_dim_layout(
    shape[0], 1, shape[1], shape[2], value_strides[0], 0, value_strides[1], value_strides[2], who);
  auto cache   = make_paged_kv_cache(cache_dtype, key_buffers, value_buffers, k, v);
  cache.format = paged_kv_format::sglang_token_pool;
  return cache;
}

/// @brief Order of a TensorRT-LLM block's `page * heads * head_dim` elements.
enum class trtllm_block_order : std::uint8_t {
  hnd,  ///< `[heads, tokens_per_block, head_dim]` (native KVBlockArray kernels)
  nhd,  ///< `[tokens_per_block, heads, head_dim]`
};

/**
 * @brief TensorRT-LLM's PyTorch-flow pool `[max_pages, layers, 2, tokens_per_block*heads*head_dim]`
 * (`resource_manager.get_buffers`): page `p` of layer `l` holds K at `[p, l, 0]` and V at
 * `[p, l, 1]`, each ordered as `order` says.
 *
 * @param pool    `data_ptr()` of the pool
 * @param shape   its shape (`max_pages, layers, 2, tokens_per_block*heads*head_dim`)
 * @param strides its strides (innermost must be 1)
 * @throw logic_error if shapes or strides are invalid or the block size does not factor.
 */
inline paged_kv_cache make_tensorrt_llm_cache(dtype cache_dtype,
                                              void* pool,
                                              std::array<std::int64_t, 4> const& shape,
                                              std::array<std::int64_t, 4> const& strides,
                                              std::int32_t tokens_per_block,
                                              std::int32_t heads,
                                              std::int32_t head_dim,
                                              trtllm_block_order order)
{
  char const* who = "make_tensorrt_llm_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, strides, who);
  INFERSCALE_EXPECTS(
    shape[2] == 2,
    std::string{who} + ": dimension 2 must be 2 (K, V), got " + std::to_string(shape[2]));
  INFERSCALE_EXPECTS(
    tokens_per_block > 0 && heads > 0 && head_dim > 0 &&
      shape[3] == static_cast<std::int64_t>(tokens_per_block) * heads * head_dim,
    std::string{who} +
      ": dimension 3 must equal tokens_per_block * heads * "
      "head_dim = " +
      std::to_string(static_cast<std::int64_t>(tokens_per_block) * heads * head_dim) + ", got " +
      std::to_string(shape[3]));
  std::int64_t const e            = strides[3];
  std::int64_t const token_stride = order == trtllm_block_order::hnd
                                      ? head_dim * e
                                      : static_cast<std::int64_t>(heads) * head_dim * e;
  std::int64_t const head_stride  = order == trtllm_block_order::hnd
                                      ? static_cast<std::int64_t>(tokens_per_block) * head_dim * e
                                      : head_dim * e;
  auto const layout               = detail::block_token_head_dim_layout(
    shape[0], tokens_per_block, heads, head_dim, strides[0], token_stride, head_stride, e, who);
  INFERSCALE_EXPECTS(shape[1] <= paged_kv_cache::max_layers,
                     std::string{who} + ": at most " + std::to_string(paged_kv_cache::max_layers) +
                       " layers, got " + std::to_string(shape[1]));
  std::vector<void*> keys, values;
  for (std::int64_t l = 0; l < shape[1]; ++l) {
    void* const k = pool ? detail::advance(pool, l * strides[1], cache_dtype) : nullptr;
    keys.push_back(k);
    values.push_back(k ? detail::advance(k, strides[2], cache_dtype) : nullptr);
  }
  auto cache   = make_paged_kv_cache(cache_dtype, keys, values, layout, layout);
  cache.format = paged_kv_format::tensorrt_llm;
  return cache;
}

/**
 * @brief A plain contiguous cache `(layers, 2, tokens, heads, head_dim)` with the given strides;
 * slot = token index (block size 1).
 * @throw logic_error if shapes or strides are invalid.
 */
inline paged_kv_cache make_contiguous_cache(dtype cache_dtype,
                                            void* data,
                                            std::array<std::int64_t, 5> const& shape,
                                            std::array<std::int64_t, 5> const& strides)
{
  char const* who = "make_contiguous_cache";
  detail::expect_cache_dtype(cache_dtype, who);
  detail::expect_shape(shape, strides, who);
  INFERSCALE_EXPECTS(
    shape[1] == 2,
    std::string{who} + ": dimension 1 must be 2 (K, V), got " + std::to_string(shape[1]));
  INFERSCALE_EXPECTS(shape[0] <= paged_kv_cache::max_layers,
                     std::string{who} + ": at most " + std::to_string(paged_kv_cache::max_layers) +
                       " layers, got " + std::to_string(shape[0]));
  auto const layout = detail::block_token_head_dim_layout(
    shape[2], 1, shape[3], shape[4], strides[2], 0, strides[3], strides[4], who);
  std::vector<void*> keys, values;
  for (std::int64_t l = 0; l < shape[0]; ++l) {
    void* const k = data ? detail::advance(data, l * strides[0], cache_dtype) : nullptr;
    keys.push_back(k);
    values.push_back(k ? detail::advance(k, strides[1], cache_dtype) : nullptr);
  }
  auto cache   = make_paged_kv_cache(cache_dtype, keys, values, layout, layout);
  cache.format = paged_kv_format::contiguous;
  return cache;
}

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
                       std::to_string(num_tokens) + " tokens, or " +
                       std::to_string(num_block_ids) + " blocks of " +
                       std::to_string(block_size) + ", overflow 64 bits");
  INFERSCALE_EXPECTS(start_position + num_tokens <= num_block_ids * block_size,
                     "slots_from_block_table: tokens " + std::to_string(start_position) + " .. " +
                       std::to_string(start_position + num_tokens) + " need " +
                       detail::count_of((start_position + num_tokens + block_size - 1) / block_size,
                                        "block") +
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
