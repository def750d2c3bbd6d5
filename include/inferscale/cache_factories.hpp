/**
 * @file cache_factories.hpp
 * @brief The factories that describe an engine's paged KV cache as a paged_kv_cache (cache.hpp):
 * any cache from its base addresses and layouts, and the vLLM (FlashAttention, CPU, FlashInfer /
 * Triton, legacy), SGLang, TensorRT-LLM and contiguous layouts from the shapes and strides the
 * engine reports for its tensors (never assuming contiguity).
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace inferscale {

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

/// @brief The kernel family ("ISA") vLLM's CPU attention backend picked for a layer
/// (`cpu_attn._get_attn_isa`): it decides how the layer's cache cells are laid out.
enum class vllm_cpu_isa : std::uint8_t {
  vec,  ///< the portable vector kernels (AVX-512 / AVX2 without AMX)
  amx,  ///< Intel AMX tiles (bfloat16 on a CPU with AMX-BF16)
};

/// @brief Name of an ISA, as vLLM spells it ("vec", "amx").
inline char const* to_string(vllm_cpu_isa isa) noexcept
{
  return isa == vllm_cpu_isa::amx ? "amx" : "vec";
}

/**
 * @brief vLLM's CPU attention backend (`CPU_ATTN`; `reference/vllm-cpu.md`): one tensor per layer
 * of shape `(num_blocks, heads, block_size, 2 * head_dim)`. Each (block, head) cell holds
 * `2 * block_size * head_dim` elements: first the block's keys, then its values, laid out as the
 * layer's ISA writes them (`cpu_attn_reshape_and_cache`):
 *  - `vec`: keys transposed, `[head_dim, block_size]` (key (t, d) at `d * block_size + t`), values
 *    row-major `[block_size, head_dim]` (value (t, d) at `block_size * head_dim + t * head_dim +
 *    d`);
 *  - `amx` (bfloat16 on an AMX CPU): keys in tiles of 16 tokens with dims paired, key (t, d) at
 *    `(t / 16) * 16 * head_dim + (d / 2) * 32 + (t % 16) * 2 + d % 2`; values in strips of 16
 *    dims with tokens paired, value (t, d) at `block_size * head_dim + (d / 16) * 16 * block_size
 *    + (t / 2) * 32 + (d % 16) * 2 + t % 2` (measured on an AMX Xeon with vLLM 0.32.0's own op for
 *    block sizes 32 and 128 and head sizes 64 and 128: `bench/results/2026-12-05-vllm-amx.md`).
 *    Needs head_dim a multiple of 16 and block_size of 16.
 *
 * The last two dimensions must be dense (stride of dimension 3 = s, of dimension 2 = 2 * head_dim
 * * s), since the cell is reinterpreted; blocks and heads may have any strides. Other ISAs of
 * that backend (`vec16`, `neon`) are not described by this factory: refuse them before calling it.
 *
 * @param layer_tensors `data_ptr()` of each layer's tensor, in layer order
 * @throw logic_error if shapes or strides are invalid, the last dimension is odd, the last two
 *        dimensions are not dense, or (amx) head_dim is not a multiple of 16 or block_size of 16.
 */
inline paged_kv_cache make_vllm_cpu_cache(dtype cache_dtype,
                                          std::vector<void*> const& layer_tensors,
                                          std::array<std::int64_t, 4> const& shape,
                                          std::array<std::int64_t, 4> const& strides,
                                          vllm_cpu_isa isa = vllm_cpu_isa::vec)
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
                       ": the last two dimensions must be dense (the cell is reinterpreted): "
                       "stride 2 must be dimension 3 * stride 3 = " +
                       std::to_string(shape[3]) + " * " + std::to_string(s) + ", got " +
                       std::to_string(strides[2]));
  std::int64_t const block_size = shape[2];
  paged_kv_layout k{}, v{};
  if (isa == vllm_cpu_isa::amx) {
    INFERSCALE_EXPECTS(head_dim % 16 == 0 && block_size % 16 == 0,
                       std::string{who} +
                         ": the amx layout needs head_dim and block_size "
                         "multiples of 16, got " +
                         std::to_string(head_dim) + " and " + std::to_string(block_size));
    // K: tiles of 16 tokens (16 * head_dim apart), a token's dims in pairs 32 apart.
    k = detail::block_token_head_dim_layout(
      shape[0], block_size, shape[1], head_dim, strides[0], 2 * s, strides[1], s, who);
    k.token_chunk        = 16;
    k.token_chunk_stride = 16 * head_dim * s;
    k.dim_chunk          = 2;
    k.chunk_stride       = 32 * s;
    // V: strips of 16 dims (16 * block_size apart), tokens in pairs 32 apart.
    v = detail::block_token_head_dim_layout(
      shape[0], block_size, shape[1], head_dim, strides[0], s, strides[1], 2 * s, who);
    v.token_chunk        = 2;
    v.token_chunk_stride = 32 * s;
    v.dim_chunk          = 16;
    v.chunk_stride       = 16 * block_size * s;
  } else {
    // K: token t at t * s, dim d at d * block_size * s. V: after the block_size * head_dim keys.
    k = detail::block_token_head_dim_layout(
      shape[0], block_size, shape[1], head_dim, strides[0], s, strides[1], block_size * s, who);
    v = detail::block_token_head_dim_layout(
      shape[0], block_size, shape[1], head_dim, strides[0], head_dim * s, strides[1], s, who);
  }
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

}  // namespace inferscale
