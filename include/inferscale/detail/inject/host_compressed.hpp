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
#include <inferscale/dtype.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <vector>

namespace inferscale::detail {

/// @brief fp32 values of the 256 e4m3 codes (host decode by table: one load per code).
inline std::array<float, 256> const& e4m3_values()
{
  static std::array<float, 256> const table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) {
      t[static_cast<std::size_t>(c)] = to_float(float8_e4m3_t{static_cast<std::uint8_t>(c)});
    }
    return t;
  }();
  return table;
}

/**
 * @brief One token's row of one (layer, K or V) block, all heads, dequantized into `out`
 * (`heads * head_dim` elements of OutT). `C`: the compression, fixed for the loop.
 */
template <kv_compression C, class OutT>
inline void dequantize_row_host(compressed_block_layout const& b,
                                unsigned char const* block,
                                std::int32_t kv,
                                std::int32_t t,
                                float const* e4m3,
                                OutT* __restrict out)
{
  std::int32_t const d           = b.head_dim;
  unsigned char const* const sc  = block + b.scales_offset();
  unsigned char const* const row = block + static_cast<std::int64_t>(t) * b.row_code_bytes();
  for (std::int32_t h = 0; h < b.num_heads; ++h) {
    unsigned char const* const codes = row + h * b.head_code_bytes();
    OutT* const o                    = out + static_cast<std::int64_t>(h) * d;
    float ks[compressed_max_head_dim];  // the head's scales (head_dim checked by the store)
    if (kv == 0) {
      for (std::int32_t e = 0; e < d; ++e) {
        ks[e] = scale_at(sc, static_cast<std::int64_t>(h) * d + e, C);
      }
    } else {
      float const vs = scale_at(sc, static_cast<std::int64_t>(t) * b.num_heads + h, C);
      for (std::int32_t e = 0; e < d; ++e) {
        ks[e] = vs;
      }
    }
    if constexpr (C == kv_compression::int4) {
      for (std::int32_t e = 0; e < d; e += 2) {
        unsigned const byte = codes[e / 2];
        float const lo      = static_cast<float>(static_cast<int>((byte & 0xFu) ^ 8u) - 8);
        float const hi      = static_cast<float>(static_cast<int>((byte >> 4) ^ 8u) - 8);
        o[e]                = from_float<OutT>(mul_rn(lo, ks[e]));
        o[e + 1]            = from_float<OutT>(mul_rn(hi, ks[e + 1]));
      }
    } else {
      for (std::int32_t e = 0; e < d; ++e) {
        o[e] = from_float<OutT>(mul_rn(e4m3[codes[e]], ks[e]));
      }
    }
  }
}

/**
 * @brief Injects a checked batch view from a compressed store: `inject(scratch_ref, chunk_view)`
 * runs the uncompressed loops of store dtype `S` on each chunk.
 */
template <class S, class Inject>
void inject_host_compressed(kv_store_ref const& store,
                            injection_batch_view const& batch,
                            std::int64_t num_slots,
                            Inject&& inject)
{
  compressed_block_layout const b = store.blocks();
  std::int64_t const row          = store.row_elements();
  std::int64_t const token_elems  = 2 * static_cast<std::int64_t>(store.num_layers) * row;
  // Chunk: at most 64 tokens (the loops' own chunk, so each token's cos/sin is computed once) and
  // about 256 KiB of scratch (an L2's share on both CPUs of this machine kind).
  std::int64_t const chunk = std::clamp<std::int64_t>(
    (std::int64_t{256} << 10) / (token_elems * static_cast<std::int64_t>(sizeof(S))), 1, 64);
  std::vector<S> scratch(static_cast<std::size_t>(chunk * token_elems));
  std::vector<std::int64_t> ids(static_cast<std::size_t>(chunk));
  std::iota(ids.begin(), ids.end(), std::int64_t{0});
  kv_store_ref view       = store;
  view.pool               = scratch.data();
  view.compression        = kv_compression::none;
  view.page_size          = 1;
  view.num_pages          = chunk;
  float const* const e4m3 = e4m3_values().data();
  auto const* const pool  = static_cast<unsigned char const*>(store.pool);
  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk) {
    std::int64_t const count = std::min(chunk, batch.num_tokens - first);
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t const slot = batch.slot[first + j];
      if (slot < 0 || slot >= num_slots) { continue; }  // not written: nothing to dequantize
      std::int64_t const st   = batch.store_token[first + j];
      std::int64_t const page = st / store.page_size;
      auto const t            = static_cast<std::int32_t>(st % store.page_size);
      for (std::int32_t l = 0; l < store.num_layers; ++l) {
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          unsigned char const* const block = pool + store.block_offset(page, l, kv);
          S* const out = scratch.data() + ((j * store.num_layers + l) * 2 + kv) * row;
          if (store.compression == kv_compression::int4) {
            dequantize_row_host<kv_compression::int4>(b, block, kv, t, e4m3, out);
          } else {
            dequantize_row_host<kv_compression::fp8_e4m3>(b, block, kv, t, e4m3, out);
          }
        }
      }
    }
    injection_batch_view const part{ids.data(), batch.position + first, batch.slot + first, count};
    inject(view, part);
  }
}

}  // namespace inferscale::detail
