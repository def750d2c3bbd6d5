/**
 * @file detail/inject/host_compressed.hpp
 * @brief The host backend's injection from a compressed store (compression.hpp): tokens in
 * chunks small enough for the core's L2, each chunk's rows dequantized to the store dtype into a
 * scratch store laid out as an uncompressed one (page_size 1, one token per page), then injected
 * by the uncompressed loops. The fact's codes are read once from memory and the cache written
 * once; the scratch rows stay in cache between the two halves. Each dequantized element is the
 * compression.hpp definition (`to_store_dtype(code * scale)`), so the cache holds exactly what an
 * uncompressed store of those values gives.
 */
#pragma once

#include <inferscale/compression.hpp>
#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

namespace inferscale::detail {

/// @brief The fp32 scales of a block: `count` scales from `scales` (compression.hpp's encoding).
template <kv_compression C>
inline void block_scales(unsigned char const* scales, std::int64_t count, float* out)
{
  for (std::int64_t i = 0; i < count; ++i) {
    out[i] = scale_at(scales, i, C);
  }
}

#if INFERSCALE_HOST_X86_SIMD
/// @brief block_scales with AVX2, eight at a time (count a multiple of 8): bfloat16 widened
/// exactly; E8M0 byte e as the float bits e << 23 (e = 0: 2^-127, the bits 0x00400000).
template <kv_compression C>
INFERSCALE_TARGET_AVX2 void block_scales_avx2(unsigned char const* scales,
                                              std::int64_t count,
                                              float* out)
{
  for (std::int64_t i = 0; i < count; i += 8) {
    __m256 v;
    if constexpr (C == kv_compression::int4) {
      v = simd::load8(reinterpret_cast<bfloat16_t const*>(scales) + i);
    } else {
      __m256i const e =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(scales + i)));
      __m256i const bits = _mm256_slli_epi32(e, 23);
      __m256i const zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
      v = _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), zero));
    }
    _mm256_storeu_ps(out + i, v);
  }
}
#endif

/**
 * @brief Dequantizes `count` codes from `codes` (int4: `count / 2` bytes) times their scales
 * (`scales[e]`, or `scale` for every element when `scales` is null) to OutT: `from_float(value *
 * scale)`, one rounded product, as compression.hpp's decode.
 */
template <kv_compression C, class OutT>
inline void dequantize_codes(unsigned char const* __restrict codes,
                             float const* __restrict scales,
                             float scale,
                             std::int64_t count,
                             OutT* __restrict out)
{
  for (std::int64_t e = 0; e < count; ++e) {
    out[e] = from_float<OutT>(
      decode(code_at(codes, e, C), scales != nullptr ? scales[e] : scale, C));  // one rounding
  }
}

#if INFERSCALE_HOST_X86_SIMD
/// @brief dequantize_codes with AVX2, eight codes at a time (count a multiple of 8): the same
/// decode (e4m3 widened exactly, int4 nibbles sign-extended), one product, from_float's rounding.
template <kv_compression C, class OutT>
INFERSCALE_TARGET_AVX2 void dequantize_codes_avx2(unsigned char const* __restrict codes,
                                                  float const* __restrict scales,
                                                  float scale,
                                                  std::int64_t count,
                                                  OutT* __restrict out)
{
  __m256 const broadcast = _mm256_set1_ps(scale);
  __m256i const shifts   = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  for (std::int64_t e = 0; e < count; e += 8) {
    __m256 v;
    if constexpr (C == kv_compression::int4) {
      std::int32_t four;
      std::memcpy(&four, codes + e / 2, sizeof four);
      __m128i const bytes = _mm_cvtsi32_si128(four);
      __m256i const lanes = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
      __m256i const nibble =
        _mm256_and_si256(_mm256_srlv_epi32(lanes, shifts), _mm256_set1_epi32(0xF));
      v = _mm256_cvtepi32_ps(
        _mm256_sub_epi32(_mm256_xor_si256(nibble, _mm256_set1_epi32(8)), _mm256_set1_epi32(8)));
    } else {
      v = simd::load8(reinterpret_cast<float8_e4m3_t const*>(codes + e));
    }
    __m256 const s = scales != nullptr ? _mm256_loadu_ps(scales + e) : broadcast;
    simd::store8(out + e, _mm256_mul_ps(v, s));
  }
}
#endif

#if INFERSCALE_HOST_X86_SIMD
/**
 * @brief dequantize_codes with AVX-512, sixteen codes at a time (count a multiple of 16); at the
 * avx512_bf16 level a bf16 result is rounded by VCVTNEPS2BF16 (the same bits, subnormal inputs
 * excepted and rounded by the integer path). Same values as the scalar loop.
 */
template <kv_compression C, class OutT, bool NativeBf16>
INFERSCALE_TARGET_AVX512_BF16 void dequantize_codes_avx512(unsigned char const* __restrict codes,
                                                           float const* __restrict scales,
                                                           float scale,
                                                           std::int64_t count,
                                                           OutT* __restrict out)
{
  __m512 const broadcast = _mm512_set1_ps(scale);
  __m512i const shifts   = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  for (std::int64_t e = 0; e < count; e += 16) {
    __m512 v;
    if constexpr (C == kv_compression::int4) {
      __m128i const bytes = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(codes + e / 2));
      __m512i const lanes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes));
      __m512i const nibble =
        _mm512_and_si512(_mm512_srlv_epi32(lanes, shifts), _mm512_set1_epi32(0xF));
      v = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_xor_si512(nibble, _mm512_set1_epi32(8)), _mm512_set1_epi32(8)));
    } else {
      v = simd512::load16(reinterpret_cast<float8_e4m3_t const*>(codes + e));
    }
    __m512 const s       = scales != nullptr ? _mm512_loadu_ps(scales + e) : broadcast;
    __m512 const product = _mm512_mul_ps(v, s);
    if constexpr (NativeBf16 && std::is_same_v<OutT, bfloat16_t>) {
      // VCVTNEPS2BF16 rounds as from_float for every input but a subnormal (it reads one as
      // zero): those take the integer rounding. Tested on the inputs themselves, not on a zero
      // result as simd512bf16::fp32_to_bf16 must, since int4 codes give many exact zeros.
      __m512 const magnitude = _mm512_abs_ps(product);
      __mmask16 const subnormal =
        _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ) &
        _mm512_cmp_ps_mask(magnitude, _mm512_setzero_ps(), _CMP_GT_OQ);
      __m256i const bits = subnormal != 0 ? simd512::fp32_to_bf16(product)
                                          : reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(product));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), bits);
    } else {
      simd512::store16(out + e, product);
    }
  }
}

#endif

/// @brief dequantize_codes at the host's vector level (AVX2 where the CPU has it and count
/// allows; the scalar loop otherwise): the same values either way.
template <kv_compression C, class OutT>
inline void dequantize_codes_at(host_simd level,
                                unsigned char const* codes,
                                float const* scales,
                                float scale,
                                std::int64_t count,
                                OutT* out)
{
#if INFERSCALE_HOST_X86_SIMD
  if (uses_avx512(level) && count % 16 == 0) {
    if (level == host_simd::avx512_bf16) {
      dequantize_codes_avx512<C, OutT, true>(codes, scales, scale, count, out);
    } else {
      dequantize_codes_avx512<C, OutT, false>(codes, scales, scale, count, out);
    }
    return;
  }
  if (level != host_simd::scalar && count % 8 == 0) {
    dequantize_codes_avx2<C>(codes, scales, scale, count, out);
    return;
  }
#endif
  (void)level;
  dequantize_codes<C>(codes, scales, scale, count, out);
}

/**
 * @brief Injects a checked batch view from a compressed store: `inject(scratch_ref, chunk_view)`
 * runs the uncompressed loops of store dtype `S` on each chunk.
 */
/**
 * @brief inject_host_compressed for compression C: per chunk of tokens, layer by layer, each
 * token's K and V rows dequantized into the scratch store (a page's key scales converted once
 * for the consecutive tokens that share it), then the chunk injected by `inject`.
 */
template <kv_compression C, class S, class Inject>
void inject_host_compressed_as(kv_store_ref const& store,
                               injection_batch_view const& batch,
                               std::int64_t num_slots,
                               Inject& inject)
{
  compressed_block_layout const b = store.blocks();
  std::int64_t const row          = store.row_elements();
  std::int32_t const L            = store.num_layers;
  std::int32_t const D            = store.head_dim;
  std::int64_t const token_elems  = 2 * static_cast<std::int64_t>(L) * row;
  // Chunk: at most 64 tokens (the loops' own chunk, so each token's cos/sin is computed once) and
  // about 256 KiB of scratch (an L2's share on both CPUs of this machine kind).
  std::int64_t const chunk = std::clamp<std::int64_t>(
    (std::int64_t{256} << 10) / (token_elems * static_cast<std::int64_t>(sizeof(S))), 1, 64);
  std::vector<S> scratch(static_cast<std::size_t>(chunk * token_elems));
  std::vector<std::int64_t> ids(static_cast<std::size_t>(chunk));
  std::iota(ids.begin(), ids.end(), std::int64_t{0});
  // Each layer's key scales of the page its last token read: converted once per page and layer
  // (a page's tokens share them), whatever the chunking.
  std::vector<float> key_scales(static_cast<std::size_t>(L * row));
  std::vector<unsigned char const*> scales_of(static_cast<std::size_t>(L), nullptr);
  kv_store_ref view      = store;
  view.pool              = scratch.data();
  view.compression       = kv_compression::none;
  view.page_size         = 1;
  view.num_pages         = chunk;
  host_simd const level  = active_host_simd();
  auto const* const pool = static_cast<unsigned char const*>(store.pool);
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk) {
    std::int64_t const count = std::min(chunk, batch.num_tokens - first);
    for (std::int32_t l = 0; l < L; ++l) {
      float* const layer_scales = key_scales.data() + static_cast<std::int64_t>(l) * row;
      for (std::int64_t j = 0; j < count; ++j) {
        std::int64_t const slot = batch.slot[first + j];
        if (slot < 0 || slot >= num_slots) { continue; }  // not written: nothing to dequantize
        std::int64_t const st             = batch.store_token[first + j];
        std::int64_t const page           = st / store.page_size;
        auto const t                      = static_cast<std::int32_t>(st % store.page_size);
        unsigned char const* const kblock = pool + store.block_offset(page, l, 0);
        unsigned char const* const vblock = kblock + b.block_bytes(0);
        if (kblock != scales_of[static_cast<std::size_t>(l)]) {
#if INFERSCALE_HOST_X86_SIMD
          if (level != host_simd::scalar && row % 8 == 0) {
            block_scales_avx2<C>(kblock + b.scales_offset(), row, layer_scales);
          } else {
            block_scales<C>(kblock + b.scales_offset(), row, layer_scales);
          }
#else
          block_scales<C>(kblock + b.scales_offset(), row, layer_scales);
#endif
          scales_of[static_cast<std::size_t>(l)] = kblock;
        }
        S* const kout = scratch.data() + ((j * L + l) * 2) * row;
        S* const vout = kout + row;
        dequantize_codes_at<C>(level,
                               kblock + static_cast<std::int64_t>(t) * b.row_code_bytes(),
                               layer_scales,
                               0.0f,
                               row,
                               kout);
        for (std::int32_t h = 0; h < store.num_heads; ++h) {
          float const vs =
            scale_at(vblock + b.scales_offset(), static_cast<std::int64_t>(t) * b.num_heads + h, C);
          dequantize_codes_at<C>(
            level,
            vblock + static_cast<std::int64_t>(t) * b.row_code_bytes() + h * b.head_code_bytes(),
            nullptr,
            vs,
            D,
            vout + static_cast<std::int64_t>(h) * D);
        }
      }
    }
    injection_batch_view const part{ids.data(), batch.position + first, batch.slot + first, count};
    inject(view, part);
  }
}

template <class S, class Inject>
void inject_host_compressed(kv_store_ref const& store,
                            injection_batch_view const& batch,
                            std::int64_t num_slots,
                            Inject&& inject)
{
  if (store.compression == kv_compression::int4) {
    inject_host_compressed_as<kv_compression::int4, S>(store, batch, num_slots, inject);
  } else {
    inject_host_compressed_as<kv_compression::fp8_e4m3, S>(store, batch, num_slots, inject);
  }
}

}  // namespace inferscale::detail
