/**
 * @file detail/inject/host_loop.hpp
 * @brief The host backend's scalar injection loop (any layout, any rotation, any dtype pair), and
 * the driver of the token-major vector path (detail/inject/token_major_keys.hpp) for vLLM's CPU
 * keys.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/checks.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/detail/inject/host_rotation.hpp>
#include <inferscale/detail/inject/token_major_keys.hpp>
#include <inferscale/detail/rope/rotate_simd.hpp>
#include <inferscale/injection_batch.hpp>
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

namespace inferscale::detail {

/// @brief Offset of dim `d` within a head (the part of paged_kv_layout::offset that depends on d).
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE std::int64_t dim_offset(paged_kv_layout const& layout,
                                                                      std::int32_t d)
{
  // One chunk (every layout but vLLM's legacy keys): d < head_dim, so d / dim_chunk is 0 and no
  // division per element is needed (vLLM's CPU keys, dims block_size apart, take this path).
  if (layout.dim_chunk == layout.head_dim) {
    return static_cast<std::int64_t>(d) * layout.dim_stride;
  }
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
  // A per-layer rotation: the rows of each of its rotations, `rows` apart; layer l reads its own.
  constexpr std::int64_t chunk_tokens = 64;
  std::int64_t const rows             = chunk_tokens * pairs;
  std::vector<rope_cos_sin> cos_sin(static_cast<std::size_t>(rotation.num_rotations * rows));
  std::vector<std::int64_t> block(static_cast<std::size_t>(chunk_tokens));
  std::vector<std::int32_t> in_block(static_cast<std::size_t>(chunk_tokens));
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk_tokens) {
    std::int64_t const count = std::min(chunk_tokens, batch.num_tokens - first);
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t const slot = batch.slot[first + j];
      if (!slot_in_cache(slot, n_slots)) { continue; }
      block[j]    = slot / bs;
      in_block[j] = static_cast<std::int32_t>(slot % bs);
      for (std::int32_t r = 0; r < rotation.num_rotations; ++r) {
        detail::rope_cos_sin_row(rotation,
                                 r,
                                 batch.position[first + j],
                                 rope_op::forward,
                                 cos_sin.data() + r * rows + j * pairs);
      }
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      rope_cos_sin const* const layer_cos_sin = cos_sin.data() + rotation.of_layer(l) * rows;
      auto* const kbase                       = static_cast<CacheT*>(cache.key_base[l]);
      auto* const vbase                       = static_cast<CacheT*>(cache.value_base[l]);
      for (std::int64_t j = 0; j < count; ++j) {
        std::int64_t const i = first + j;
        if (!slot_in_cache(batch.slot[i], n_slots)) { continue; }
        StoreT const* const krow = pool + store.row_offset(batch.store_token[i], l, 0);
        StoreT const* const vrow = pool + store.row_offset(batch.store_token[i], l, 1);
        for (std::int32_t h = 0; h < store.num_heads; ++h) {
          inject_host_head<ContiguousK,
                           ContiguousV,
                           Scaled,
                           Halves,
                           RoundEach,
                           Fused,
                           StoreT,
                           CacheT,
                           Truncate>(krow + static_cast<std::int64_t>(h) * dim,
                                     vrow + static_cast<std::int64_t>(h) * dim,
                                     kbase + cache.key_layout.offset(block[j], in_block[j], h, 0),
                                     vbase + cache.value_layout.offset(block[j], in_block[j], h, 0),
                                     cache.key_layout,
                                     cache.value_layout,
                                     rotation.rotary_dim,
                                     layer_cos_sin + j * pairs,
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
  return layout.token_stride == 1 && layout.token_chunk == 0 &&
         layout.dim_chunk == layout.head_dim && layout.block_size > 1;
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
  std::int32_t const pairs            = rotation.num_pairs();
  std::int32_t const dim              = store.head_dim;
  auto const* const pool              = static_cast<StoreT const*>(store.pool);
  std::int64_t const n_slots          = cache.num_slots();
  std::int32_t const bs               = cache.key_layout.block_size;
  constexpr std::int64_t chunk_tokens = 64;  // chunks as inject_host_typed's, for the same reason
  // Each rotation of a per-layer one has its rows, `rows` apart (layer l reads its own).
  std::int64_t const rows    = chunk_tokens * pairs;
  std::size_t const all_rows = static_cast<std::size_t>(rotation.num_rotations * rows);
  std::vector<rope_cos_sin> cos_sin(all_rows);
  // [token][pair] per token, and [run][pair][8] for the runs of eight.
  std::vector<float> cos(all_rows);
  std::vector<float> sin(all_rows);
  std::vector<float> cos8(cos.size()), sin8(sin.size());
  std::vector<std::int64_t> run_start;  // first token (in the chunk) of each run of eight
  std::vector<std::int64_t> single;     // tokens not in a run
  std::vector<StoreT const*> krows(8), vrows(8);
  // Store rows without a division per row: row_offset(token, l, kv) is row_offset(token, 0, 0)
  // (one division per token and chunk) plus (2 l + kv) page_size row_elements.
  std::vector<std::int64_t> row_base(static_cast<std::size_t>(chunk_tokens));
  std::int64_t const kv_pitch = static_cast<std::int64_t>(store.page_size) * store.row_elements();
  // A head's first key or value in the cache: offset(block, in_block, h, 0) without its division.
  auto const head_offset =
    [](paged_kv_layout const& layout, std::int64_t block, std::int32_t in_block, std::int32_t h) {
      return block * layout.block_stride + in_block * layout.token_stride + h * layout.head_stride;
    };
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk_tokens) {
    std::int64_t const count = std::min(chunk_tokens, batch.num_tokens - first);
    run_start.clear();
    single.clear();
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t const slot = batch.slot[first + j];
      if (!slot_in_cache(slot, n_slots)) { continue; }
      chunk_token_rows(
        store, batch, rotation, first, j, rows, row_base.data(), cos.data(), sin.data());
      for (std::int32_t r = 0; r < rotation.num_rotations; ++r) {
        std::int64_t const at = r * rows + j * pairs;
        for (std::int32_t p = 0; p < pairs; ++p) {
          cos_sin[static_cast<std::size_t>(at + p)] = {cos[at + p], sin[at + p]};
        }
      }
    }
    for (std::int64_t j = 0; j < count;) {
      std::int64_t const slot = batch.slot[first + j];
      bool run = j + 8 <= count && slot_in_cache(slot, n_slots) && slot % bs + 8 <= bs;
      for (std::int64_t t = 1; run && t < 8; ++t) {
        run = batch.slot[first + j + t] == slot + t;
      }
      if (!run) {
        if (slot_in_cache(slot, n_slots)) { single.push_back(j); }
        ++j;
        continue;
      }
      std::size_t const r = run_start.size();
      for (std::int32_t w = 0; w < rotation.num_rotations; ++w) {
        for (std::int32_t p = 0; p < pairs; ++p) {
          for (std::int64_t t = 0; t < 8; ++t) {
            cos8[w * rows + r * pairs * 8 + p * 8 + t] = cos[w * rows + (j + t) * pairs + p];
            sin8[w * rows + r * pairs * 8 + p * 8 + t] = sin[w * rows + (j + t) * pairs + p];
          }
        }
      }
      run_start.push_back(j);
      j += 8;
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      std::int64_t const own = rotation.of_layer(l) * rows;  // this layer's rotation's rows
      auto* const kbase      = static_cast<bfloat16_t*>(cache.key_base[l]);
      auto* const vbase      = static_cast<bfloat16_t*>(cache.value_base[l]);
      for (std::size_t r = 0; r < run_start.size(); ++r) {
        std::int64_t const i0         = first + run_start[r];
        std::int64_t const block      = batch.slot[i0] / bs;
        std::int32_t const in_block   = static_cast<std::int32_t>(batch.slot[i0] % bs);
        std::int64_t const layer_rows = 2 * static_cast<std::int64_t>(l) * kv_pitch;
        for (std::int32_t h = 0; h < store.num_heads; ++h) {
          for (int t = 0; t < 8; ++t) {
            krows[t] = pool + row_base[static_cast<std::size_t>(run_start[r] + t)] + layer_rows +
                       static_cast<std::int64_t>(h) * dim;
            vrows[t] = krows[t] + kv_pitch;
          }
          simd::inject8_token_major_truncate<StoreT>(
            krows.data(),
            vrows.data(),
            kbase + head_offset(cache.key_layout, block, in_block, h),
            cache.key_layout.dim_stride,
            vbase + head_offset(cache.value_layout, block, in_block, h),
            cache.value_layout.token_stride,
            dim,
            rotation.rotary_dim,
            Halves,
            cos8.data() + own + r * pairs * 8,
            sin8.data() + own + r * pairs * 8);
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
            cos_sin.data() + own + j * pairs,
            1.0f,
            1.0f,
            cache.scale_convention);
        }
      }
    }
  }
}
#endif  // INFERSCALE_HOST_X86_SIMD

}  // namespace inferscale::detail
