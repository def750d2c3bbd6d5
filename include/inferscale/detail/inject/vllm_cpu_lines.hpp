/**
 * @file detail/inject/vllm_cpu_lines.hpp
 * @brief Host injection into vLLM's CPU cache layouts (make_vllm_cpu_cache, isa `vec` and `amx`)
 * by whole 64-byte lines, for a bfloat16 store, a bfloat16 cache and vLLM's CPU rotation (fp32,
 * then truncated to bf16 as its AVX2 kernel does, or rounded to nearest as its AVX512_BF16 kernel
 * does), halves pairing, on a CPU with AVX-512BW (the avx512_bf16 level).
 *
 * Both layouts interleave tokens: `vec` keys are `[head_dim, block_size]` per (block, head) cell
 * (dim d of 32 consecutive tokens is one line), `amx` keys are tiles of 16 tokens with dims in
 * pairs (dims 2q, 2q + 1 of 16 tokens are one line) and `amx` values strips of 16 dims with tokens
 * in pairs (a token pair's 16 dims are one line). Written a token at a time, every line is
 * touched by 16 or 32 tokens, each storing 2 or 4 bytes of it through a per-element address
 * (bench/vllm/inject_cost.py: 6.6x a copy). Here tokens go in windows of 32 consecutive slots of
 * one block (32-aligned in the block): each token's key row is rotated in registers (sixteen pairs
 * at a time) into a tile of 32 rows, the tile is transposed in registers (32 x 32 16-bit blocks
 * for `vec`, 16 x 16 32-bit blocks for `amx`) and every line leaves as one 64-byte store, masked
 * to the window's tokens when the window is partly filled (a partial last block, a run broken by a
 * skipped slot). `amx` values are interleaved two tokens at a time (one two-source permute per
 * pair of strips); row-major values (`vec`) are copied as rows. Full, aligned lines go out as
 * non-temporal stores (no read-for-ownership of a line that is overwritten whole), followed by one
 * store fence before the call returns.
 *
 * The bits are the scalar loop's (inject_host_head with Truncate): each product rounded once, no
 * contraction, the difference / sum rounded once, then the upper 16 bits (a NaN made quiet).
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/dtype/vector_conversion.hpp>
#include <inferscale/detail/inject/checks.hpp>
#include <inferscale/detail/inject/host_rotation.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace inferscale::detail {

/// @brief How the line path sees a cache's keys (none: it does not take the cache).
enum class line_key_form : std::uint8_t { none, token_major, token_tiles16 };
/// @brief How the line path sees a cache's values.
enum class line_value_form : std::uint8_t { none, rows, dim_strips16 };

/// @brief Largest head_dim the line path takes (its tile of 32 key rows lives on the stack).
inline constexpr std::int32_t line_path_max_dim = 256;

/// @brief The key form of a layout: token-major (`vec`: token t + 1 beside token t, dims apart)
/// or tiles of 16 tokens with dims in pairs (`amx`); head_dim a multiple of 32 either way.
inline line_key_form line_key_form_of(paged_kv_layout const& k) noexcept
{
  if (k.head_dim % 32 != 0 || k.head_dim > line_path_max_dim) { return line_key_form::none; }
  if (k.token_chunk == 0 && k.token_stride == 1 && k.dim_chunk == k.head_dim &&
      k.dim_stride >= 32) {
    return line_key_form::token_major;
  }
  if (k.token_chunk == 16 && k.token_stride == 2 && k.dim_chunk == 2 && k.dim_stride == 1 &&
      k.chunk_stride == 32) {
    return line_key_form::token_tiles16;
  }
  return line_key_form::none;
}

/// @brief The value form of a layout: contiguous dims (rows, any token placement) or strips of 16
/// dims with tokens in pairs (`amx`).
inline line_value_form line_value_form_of(paged_kv_layout const& v) noexcept
{
  if (v.head_dim % 32 != 0 || v.head_dim > line_path_max_dim) { return line_value_form::none; }
  if (v.dim_stride == 1 && v.dim_chunk == v.head_dim) { return line_value_form::rows; }
  if (v.token_chunk == 2 && v.token_stride == 1 && v.token_chunk_stride == 32 &&
      v.dim_chunk == 16 && v.dim_stride == 2) {
    return line_value_form::dim_strips16;
  }
  return line_value_form::none;
}

/// @brief True if the line path takes this cache (one of the forms for keys and for values).
inline bool line_path_takes(paged_kv_cache const& cache) noexcept
{
  return line_key_form_of(cache.key_layout) != line_key_form::none &&
         line_value_form_of(cache.value_layout) != line_value_form::none;
}

#if INFERSCALE_HOST_X86_SIMD

namespace simd_lines {

#define INFERSCALE_TARGET_LINES INFERSCALE_TARGET_AVX512_BF16

/// @brief One 64-byte line: non-temporal when whole and aligned, else a masked store of the
/// 16-bit lanes `mask` selects.
INFERSCALE_TARGET_LINES inline void store_line16(std::uint16_t* p, __m512i v, __mmask32 mask)
{
  if (mask == 0xffffffffu && (reinterpret_cast<std::uintptr_t>(p) & 63u) == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
  } else {
    _mm512_mask_storeu_epi16(p, mask, v);
  }
}

/// @brief As store_line16 with 32-bit lanes.
INFERSCALE_TARGET_LINES inline void store_line32(std::uint16_t* p, __m512i v, __mmask16 mask)
{
  if (mask == 0xffffu && (reinterpret_cast<std::uintptr_t>(p) & 63u) == 0) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
  } else {
    _mm512_mask_storeu_epi32(p, mask, v);
  }
}

/// @brief `x`, hidden from the optimiser (each product rounded on its own, never contracted).
INFERSCALE_TARGET_LINES inline __m512 opaque(__m512 x)
{
  asm("" : "+v"(x));
  return x;
}

/**
 * @brief Sixteen pairs of two 16-bit codes each (32-bit words: `low` and `high` bf16 of every
 * word) rotated: pair (x, y) of the low halves by (`c_low`, `s_low`), of the high halves by
 * (`c_high`, `s_high`), in fp32 (each product and the difference / sum rounded once, no
 * contraction), truncated to bf16 (or rounded to nearest: `Nearest`, bf16_in_upper) and packed as
 * the inputs were: `*out_x` low / high halves are the rotated x of the low / high pairs, `*out_y`
 * the rotated y.
 *
 * Widening a bf16 half is a shift or a mask (its bits become the fp32's upper half), and
 * truncating is taking the upper half back, so no lane moves. A NaN result needs no quieting
 * here: x86 arithmetic returns quiet NaNs only (bit 22 set, bit 6 of the upper half), which is
 * what bfloat16_toward_zero makes of a NaN.
 */
/// @brief fp32 words whose upper halves are the bf16 codes of `v`: truncated (`Nearest` false:
/// the bits as they are) or rounded to nearest even as float_to_bfloat16_bits (a NaN keeps its
/// upper half with the quiet bit set).
template <bool Nearest>
INFERSCALE_TARGET_LINES inline __m512i bf16_in_upper(__m512 v)
{
  __m512i const bits = _mm512_castps_si512(v);
  if constexpr (!Nearest) {
    return bits;
  } else {
    __m512i const lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i const rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 const nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(
      rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  }
}

template <bool Nearest = false>
INFERSCALE_TARGET_LINES inline void rotate_words(__m512i x,
                                                 __m512i y,
                                                 float const* c_low,
                                                 float const* s_low,
                                                 float const* c_high,
                                                 float const* s_high,
                                                 __m512i* out_x,
                                                 __m512i* out_y)
{
  __m512i const upper = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 const x_low  = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  __m512 const y_low  = _mm512_castsi512_ps(_mm512_slli_epi32(y, 16));
  __m512 const x_high = _mm512_castsi512_ps(_mm512_and_si512(x, upper));
  __m512 const y_high = _mm512_castsi512_ps(_mm512_and_si512(y, upper));
  __m512 const cl     = _mm512_loadu_ps(c_low);
  __m512 const sl     = _mm512_loadu_ps(s_low);
  __m512 const ch     = _mm512_loadu_ps(c_high);
  __m512 const sh     = _mm512_loadu_ps(s_high);
  __m512 const rx_low =
    _mm512_sub_ps(opaque(_mm512_mul_ps(x_low, cl)), opaque(_mm512_mul_ps(y_low, sl)));
  __m512 const ry_low =
    _mm512_add_ps(opaque(_mm512_mul_ps(y_low, cl)), opaque(_mm512_mul_ps(x_low, sl)));
  __m512 const rx_high =
    _mm512_sub_ps(opaque(_mm512_mul_ps(x_high, ch)), opaque(_mm512_mul_ps(y_high, sh)));
  __m512 const ry_high =
    _mm512_add_ps(opaque(_mm512_mul_ps(y_high, ch)), opaque(_mm512_mul_ps(x_high, sh)));
  // (low >> 16) | (high & 0xffff0000)
  *out_x = _mm512_ternarylogic_epi32(_mm512_srli_epi32(bf16_in_upper<Nearest>(rx_low), 16),
                                     bf16_in_upper<Nearest>(rx_high),
                                     upper,
                                     0xf8);
  *out_y = _mm512_ternarylogic_epi32(_mm512_srli_epi32(bf16_in_upper<Nearest>(ry_low), 16),
                                     bf16_in_upper<Nearest>(ry_high),
                                     upper,
                                     0xf8);
}

/// @brief Rows 0..7 of `rows` (16-bit, 32 columns from `col`): the three in-lane unpack rounds
/// of an 8 x 8 transpose in each 128-bit lane; out[c] lane q holds column col + 8q + c of the
/// eight rows.
INFERSCALE_TARGET_LINES inline void transpose_in_lanes8(std::uint16_t const* const* rows,
                                                        std::int32_t col,
                                                        __m512i* out)
{
  __m512i r[8];
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_loadu_si512(rows[j] + col);
  }
  __m512i const a0 = _mm512_unpacklo_epi16(r[0], r[1]), a1 = _mm512_unpackhi_epi16(r[0], r[1]);
  __m512i const a2 = _mm512_unpacklo_epi16(r[2], r[3]), a3 = _mm512_unpackhi_epi16(r[2], r[3]);
  __m512i const a4 = _mm512_unpacklo_epi16(r[4], r[5]), a5 = _mm512_unpackhi_epi16(r[4], r[5]);
  __m512i const a6 = _mm512_unpacklo_epi16(r[6], r[7]), a7 = _mm512_unpackhi_epi16(r[6], r[7]);
  __m512i const b0 = _mm512_unpacklo_epi32(a0, a2), b1 = _mm512_unpackhi_epi32(a0, a2);
  __m512i const b2 = _mm512_unpacklo_epi32(a1, a3), b3 = _mm512_unpackhi_epi32(a1, a3);
  __m512i const b4 = _mm512_unpacklo_epi32(a4, a6), b5 = _mm512_unpackhi_epi32(a4, a6);
  __m512i const b6 = _mm512_unpacklo_epi32(a5, a7), b7 = _mm512_unpackhi_epi32(a5, a7);
  out[0] = _mm512_unpacklo_epi64(b0, b4);
  out[1] = _mm512_unpackhi_epi64(b0, b4);
  out[2] = _mm512_unpacklo_epi64(b1, b5);
  out[3] = _mm512_unpackhi_epi64(b1, b5);
  out[4] = _mm512_unpacklo_epi64(b2, b6);
  out[5] = _mm512_unpackhi_epi64(b2, b6);
  out[6] = _mm512_unpacklo_epi64(b3, b7);
  out[7] = _mm512_unpackhi_epi64(b3, b7);
}

/**
 * @brief A 32 x 32 block of 16-bit codes transposed: rows[0..31] (one pointer per row), columns
 * col .. col + 31; out[c] holds column col + c of the 32 rows (16-bit lane j = row j).
 */
INFERSCALE_TARGET_LINES inline void transpose32x32_u16(std::uint16_t const* const* rows,
                                                       std::int32_t col,
                                                       __m512i* out)
{
  __m512i s[4][8];  // s[g][c] lane q: column col + 8q + c of rows 8g .. 8g + 7
  for (int g = 0; g < 4; ++g) {
    transpose_in_lanes8(rows + 8 * g, col, s[g]);
  }
  for (int c = 0; c < 8; ++c) {  // 4 x 4 transpose of the 128-bit lanes of s[0..3][c]
    __m512i const a0 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0x44);
    __m512i const a1 = _mm512_shuffle_i32x4(s[0][c], s[1][c], 0xee);
    __m512i const a2 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0x44);
    __m512i const a3 = _mm512_shuffle_i32x4(s[2][c], s[3][c], 0xee);
    out[c]           = _mm512_shuffle_i32x4(a0, a2, 0x88);
    out[8 + c]       = _mm512_shuffle_i32x4(a0, a2, 0xdd);
    out[16 + c]      = _mm512_shuffle_i32x4(a1, a3, 0x88);
    out[24 + c]      = _mm512_shuffle_i32x4(a1, a3, 0xdd);
  }
}

/**
 * @brief A 16 x 16 block of 32-bit words transposed: rows[0..15] (one pointer per row of 16-bit
 * codes), words w .. w + 15 (codes 2w .. 2w + 31); out[c] holds word w + c of the 16 rows (lane
 * j = row j).
 */
INFERSCALE_TARGET_LINES inline void transpose16x16_u32(std::uint16_t const* const* rows,
                                                       std::int32_t w,
                                                       __m512i* out)
{
  __m512i r[16], t[16];
  for (int j = 0; j < 16; ++j) {
    r[j] = _mm512_loadu_si512(rows[j] + 2 * w);
  }
  for (int j = 0; j < 8; ++j) {  // rows 2j, 2j + 1 interleaved by words in each lane
    t[2 * j]     = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; ++j) {  // four rows of one word per lane
    r[4 * j]     = _mm512_unpacklo_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 1] = _mm512_unpackhi_epi64(t[4 * j], t[4 * j + 2]);
    r[4 * j + 2] = _mm512_unpacklo_epi64(t[4 * j + 1], t[4 * j + 3]);
    r[4 * j + 3] = _mm512_unpackhi_epi64(t[4 * j + 1], t[4 * j + 3]);
  }
  // r[4g + c] lane q: word w + 4q + c of rows 4g .. 4g + 3; a 4 x 4 transpose of lanes per c.
  for (int c = 0; c < 4; ++c) {
    __m512i const a0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    __m512i const a1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
    __m512i const a2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    __m512i const a3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    out[c]           = _mm512_shuffle_i32x4(a0, a2, 0x88);
    out[4 + c]       = _mm512_shuffle_i32x4(a0, a2, 0xdd);
    out[8 + c]       = _mm512_shuffle_i32x4(a1, a3, 0x88);
    out[12 + c]      = _mm512_shuffle_i32x4(a1, a3, 0xdd);
  }
}

/// @brief A run: `count` consecutive slots of one block from `in_block`, batch tokens `first` ..
/// `first + count - 1` of the chunk, inside one 32-aligned window of the block.
struct line_run {
  std::int64_t first;
  std::int32_t count;
  std::int32_t in_block;
  std::int64_t block;
};

/**
 * @brief The line path (see the file comment): a bfloat16 store into a bfloat16 cache whose keys
 * and values have line forms (line_path_takes), vLLM's CPU rotation (fp32, then truncated to
 * bf16, or rounded to nearest with `Nearest`), halves pairing, rotary_dim a multiple of 4.
 *
 * Keys are transposed before they are rotated (each transposed vector holds one dim, or one pair
 * of dims, of the window's tokens), so the rotation runs on whole lines and needs cos/sin by lane:
 * per run and pair 32 entries, in the lane order of the key form (token_major: the even tokens,
 * then the odd ones, as a line's 32-bit words split them; token_tiles16: tokens 0..15, 16..31).
 */
template <bool Nearest = false, class Rotation>
INFERSCALE_TARGET_LINES void inject_host_lines(kv_store_ref const& store,
                                               injection_batch_view const& batch,
                                               paged_kv_cache const& cache,
                                               Rotation const& rotation)
{
  constexpr std::int32_t window = 32;
  std::int32_t const pairs      = rotation.num_pairs();
  std::int32_t const dim        = store.head_dim;
  std::int32_t const rotary     = rotation.rotary_dim;
  std::int32_t const half       = rotary / 2;
  std::int32_t const heads      = store.num_heads;
  auto const* const pool        = static_cast<std::uint16_t const*>(store.pool);
  std::int64_t const n_slots    = cache.num_slots();
  paged_kv_layout const& kl     = cache.key_layout;
  paged_kv_layout const& vl     = cache.value_layout;
  std::int32_t const bs         = kl.block_size;
  bool const token_major        = line_key_form_of(kl) == line_key_form::token_major;
  bool const value_rows         = line_value_form_of(vl) == line_value_form::rows;
  // Tokens in chunks (their cos/sin computed once, shared by every layer and head), within a
  // chunk layer by layer, run by run: a window's lines are written together.
  constexpr std::int64_t chunk_tokens = 128;
  std::int64_t const rows             = chunk_tokens * pairs;
  std::size_t const all_rows          = static_cast<std::size_t>(rotation.num_rotations * rows);
  std::vector<float> cos(all_rows), sin(all_rows);
  // Per run, rotation and pair: 32 cos then 32 sin in lane order.
  std::int64_t const lane_table = static_cast<std::int64_t>(pairs) * 2 * window;
  std::vector<float> lane_cos_sin;
  std::vector<std::int64_t> row_base(static_cast<std::size_t>(chunk_tokens));
  std::vector<line_run> runs;
  std::int64_t const kv_pitch = static_cast<std::int64_t>(store.page_size) * store.row_elements();
  // The rotated and transposed keys of one head: token_major a dim per vector, token_tiles16 a
  // pair of dims (of one tile) per vector.
  __m512i lines[line_path_max_dim];
  std::uint16_t const* key_rows[window];
  // Where token `t` of a block lies, without the dims (offset(b, t, h, 0) less its division).
  auto const token_offset = [](paged_kv_layout const& layout, std::int32_t t) -> std::int64_t {
    return layout.token_chunk > 0
             ? static_cast<std::int64_t>(t / layout.token_chunk) * layout.token_chunk_stride +
                 static_cast<std::int64_t>(t % layout.token_chunk) * layout.token_stride
             : static_cast<std::int64_t>(t) * layout.token_stride;
  };
  // amx values: lane 2k <- dim k of the even token, 2k + 1 <- dim k of the odd one (low strip),
  // dims 16 + k for the high strip.
  alignas(64) std::uint16_t low_index[32], high_index[32];
  for (int k = 0; k < 16; ++k) {
    low_index[2 * k]      = static_cast<std::uint16_t>(k);
    low_index[2 * k + 1]  = static_cast<std::uint16_t>(32 + k);
    high_index[2 * k]     = static_cast<std::uint16_t>(16 + k);
    high_index[2 * k + 1] = static_cast<std::uint16_t>(48 + k);
  }
  __m512i const interleave_low  = _mm512_load_si512(low_index);
  __m512i const interleave_high = _mm512_load_si512(high_index);

  for (std::int64_t first = 0; first < batch.num_tokens; first += chunk_tokens) {
    std::int64_t const count = std::min(chunk_tokens, batch.num_tokens - first);
    runs.clear();
    for (std::int64_t j = 0; j < count; ++j) {
      std::int64_t const slot = batch.slot[first + j];
      if (!slot_in_cache(slot, n_slots)) { continue; }
      chunk_token_rows(
        store, batch, rotation, first, j, rows, row_base.data(), cos.data(), sin.data());
      std::int64_t const block    = slot / bs;
      std::int32_t const in_block = static_cast<std::int32_t>(slot % bs);
      if (!runs.empty()) {
        line_run& last = runs.back();
        if (last.first + last.count == j && last.block == block &&
            last.in_block + last.count == in_block && in_block % window != 0) {
          ++last.count;
          continue;
        }
      }
      runs.push_back({j, 1, in_block, block});
    }
    // cos/sin by lane for every run (lanes of tokens outside the run: zero, never stored)
    std::int64_t const per_run = rotation.num_rotations * lane_table;
    lane_cos_sin.assign(static_cast<std::size_t>(runs.size() * per_run), 0.0f);
    for (std::size_t r = 0; r < runs.size(); ++r) {
      line_run const& run   = runs[r];
      std::int32_t const lo = run.in_block % window;
      for (std::int32_t t = 0; t < run.count; ++t) {
        std::int32_t const token = lo + t;  // in the window
        std::int32_t const lane  = token_major ? (token % 2) * (window / 2) + token / 2 : token;
        std::int64_t const j     = run.first + t;
        for (std::int32_t w = 0; w < rotation.num_rotations; ++w) {
          float* const table = lane_cos_sin.data() + r * per_run + w * lane_table;
          for (std::int32_t p = 0; p < pairs; ++p) {
            table[p * 2 * window + lane] = cos[static_cast<std::size_t>(w * rows + j * pairs + p)];
            table[p * 2 * window + window + lane] =
              sin[static_cast<std::size_t>(w * rows + j * pairs + p)];
          }
        }
      }
    }
    for (std::int32_t l = 0; l < cache.num_layers; ++l) {
      auto* const kbase          = static_cast<std::uint16_t*>(cache.key_base[l]);
      auto* const vbase          = static_cast<std::uint16_t*>(cache.value_base[l]);
      std::int64_t const krow_at = 2 * static_cast<std::int64_t>(l) * kv_pitch;
      // Run by run, then head by head (a head's windows in turn measured no faster here: the
      // lines of one window, every head, already leave together).
      for (std::size_t r = 0; r < runs.size(); ++r) {
        for (std::int32_t h = 0; h < heads; ++h) {
          std::int64_t const head_at = static_cast<std::int64_t>(h) * dim;
          line_run const& run        = runs[r];
          std::int32_t const lo      = run.in_block % window;  // the run's first lane
          std::int32_t const w0      = run.in_block - lo;  // the window's first token in the block
          std::uint64_t const lanes  = ((1ull << run.count) - 1ull) << lo;  // lo + count <= 32
          float const* const table =
            lane_cos_sin.data() + r * per_run + rotation.of_layer(l) * lane_table;
          // the window's key rows; tokens outside the run read the run's first row (not stored)
          for (std::int32_t t = 0; t < window; ++t) {
            std::int32_t const in_run = t >= lo && t < lo + run.count ? t - lo : 0;
            key_rows[t] =
              pool + row_base[static_cast<std::size_t>(run.first + in_run)] + krow_at + head_at;
          }
          std::uint16_t* const kcell =
            kbase + run.block * kl.block_stride + static_cast<std::int64_t>(h) * kl.head_stride;
          if (token_major) {
            // lines[d]: dim d of the window's 32 tokens (word i: tokens 2i, 2i + 1)
            for (std::int32_t c0 = 0; c0 < dim; c0 += 32) {
              transpose32x32_u16(key_rows, c0, lines + c0);
            }
            for (std::int32_t p = 0; p < half; ++p) {
              float const* const cs = table + p * 2 * window;
              rotate_words<Nearest>(lines[p],
                                    lines[p + half],
                                    cs,
                                    cs + window,
                                    cs + 16,
                                    cs + window + 16,
                                    &lines[p],
                                    &lines[p + half]);
            }
            // dim d of window token j at kcell + d * dim_stride + w0 + j
            auto const mask = static_cast<__mmask32>(lanes);
            for (std::int32_t d = 0; d < dim; ++d) {
              store_line16(kcell + d * kl.dim_stride + w0, lines[d], mask);
            }
          } else {
            // tile of 16 tokens: dims (2q, 2q + 1) of its token i at tile base + 32 q + 2 i
            for (int tile = 0; tile < 2; ++tile) {
              auto const mask = static_cast<__mmask16>(lanes >> (16 * tile));
              if (mask == 0) { continue; }
              for (std::int32_t q0 = 0; q0 < dim / 2; q0 += 16) {
                transpose16x16_u32(key_rows + 16 * tile, q0, lines + q0);
              }
              // word q: pairs 2q and 2q + 1 (x), word q + half / 2: their y
              for (std::int32_t q = 0; q < half / 2; ++q) {
                float const* const even = table + 2 * q * 2 * window + 16 * tile;
                float const* const odd  = even + 2 * window;
                rotate_words<Nearest>(lines[q],
                                      lines[q + half / 2],
                                      even,
                                      even + window,
                                      odd,
                                      odd + window,
                                      &lines[q],
                                      &lines[q + half / 2]);
              }
              std::uint16_t* const tbase =
                kcell + static_cast<std::int64_t>((w0 + 16 * tile) / 16) * kl.token_chunk_stride;
              for (std::int32_t q = 0; q < dim / 2; ++q) {
                store_line32(tbase + q * 32, lines[q], mask);
              }
            }
          }
          // values
          std::uint16_t* const vcell =
            vbase + run.block * vl.block_stride + static_cast<std::int64_t>(h) * vl.head_stride;
          std::int64_t const vrow_at = krow_at + kv_pitch + head_at;
          if (value_rows) {
            for (std::int32_t t = 0; t < run.count; ++t) {
              std::uint16_t const* const v =
                pool + row_base[static_cast<std::size_t>(run.first + t)] + vrow_at;
              std::uint16_t* const out = vcell + token_offset(vl, run.in_block + t);
              for (std::int32_t d = 0; d < dim; d += 32) {
                store_line16(out + d, _mm512_loadu_si512(v + d), 0xffffffffu);
              }
            }
          } else {
            // token pair (2u, 2u + 1) of the block, strip s: dim 16 s + k of token 2u + e at
            // vcell + s * chunk_stride + 32 u + 2 k + e
            std::int32_t const t_end = run.in_block + run.count;
            for (std::int32_t t0 = run.in_block - run.in_block % 2; t0 < t_end; t0 += 2) {
              bool const has_even = t0 >= run.in_block;
              bool const has_odd  = t0 + 1 < t_end;
              std::uint16_t const* const even =
                pool +
                row_base[static_cast<std::size_t>(run.first + (has_even ? t0 : t0 + 1) -
                                                  run.in_block)] +
                vrow_at;
              std::uint16_t const* const odd =
                has_odd
                  ? pool + row_base[static_cast<std::size_t>(run.first + t0 + 1 - run.in_block)] +
                      vrow_at
                  : even;
              __mmask32 const mask      = static_cast<__mmask32>((has_even ? 0x55555555u : 0u) |
                                                            (has_odd ? 0xaaaaaaaau : 0u));
              std::uint16_t* const pair = vcell + static_cast<std::int64_t>(t0 / 2) * 32;
              for (std::int32_t d = 0; d < dim; d += 32) {
                __m512i const a          = _mm512_loadu_si512(even + d);
                __m512i const b          = _mm512_loadu_si512(odd + d);
                std::int64_t const strip = d / 16;
                store_line16(pair + strip * vl.chunk_stride,
                             _mm512_permutex2var_epi16(a, interleave_low, b),
                             mask);
                store_line16(pair + (strip + 1) * vl.chunk_stride,
                             _mm512_permutex2var_epi16(a, interleave_high, b),
                             mask);
              }
            }
          }
        }
      }
    }
  }
  _mm_sfence();  // the non-temporal stores are visible before the call returns
}

#undef INFERSCALE_TARGET_LINES

}  // namespace simd_lines

#endif  // INFERSCALE_HOST_X86_SIMD

}  // namespace inferscale::detail
