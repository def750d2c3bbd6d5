/**
 * @file detail/inject/block.hpp
 * @brief The injection and extraction kernels' per-block and per-thread code, and the host side
 * that resolves a launch (path, tiling, grid) without any CUDA call: __host__ __device__ functions
 * that kernels.cuh wraps in __global__ shells, and that a plain C++ compiler compiles too (the
 * emulation test runs every block and thread of a launch on the CPU with them).
 *
 * inject_block: block (x, y) takes `tile_tokens` tokens and `tile_layers` layers. Its threads
 * first compute the tile's cos/sin (one per token and pair; for a per-layer rotation, one per
 * rotation, token and pair) into shared memory, shared by every layer and head of the tile, then
 * walk the tile's work units: a unit is `pairs_per_unit` rotary
 * pairs of one head's key, or a run of elements of its pass-through dims or of its value. On the
 * vectorized path a unit reads 16 bytes of the store per run (for halves pairing, 16 bytes of the
 * first half and the matching 16 bytes of the second) and writes the same elements to the cache
 * as one aligned vector per run.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/config.hpp>
#include <inferscale/detail/inject/element.hpp>
#include <inferscale/detail/inject/tuning.hpp>
#include <inferscale/detail/math.hpp>
#include <inferscale/error.hpp>
#include <inferscale/injection_batch.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/rope_layers.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace inferscale::detail {
/// @brief Everything inject_kernel reads; trivially copyable, passed as __grid_constant__.
template <class Rotation>
struct inject_kernel_args {
  kv_store_ref store;
  paged_kv_cache cache;
  Rotation rotation;
  injection_batch_view batch;  ///< device arrays
  std::int64_t table_rows;     ///< positions must be below it (detail::rope_table_rows)
  std::int32_t tile_tokens;
  std::int32_t tile_layers;
  std::int32_t rotary_units;     ///< key units that rotate, per head
  std::int32_t key_units;        ///< rotary + pass-through units, per head
  std::int32_t units_per_head;   ///< key_units + value units
  bool round_each;               ///< vLLM-table per-operation rounding (16-bit store)
  bool fused;                    ///< fused multiply-add rotation (llama.cpp's CPU rope)
  inject_device_errors* errors;  ///< skipped work is counted here (device memory); may be null
};

/// @brief N elements of T moved as one aligned access.
template <class T, int N>
struct alignas(sizeof(T) * N) inject_vector {
  T values[N];
};

template <int N, bool Vectorized, class T>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void load_run(T const* src, T (&out)[N])
{
  if constexpr (Vectorized) {
    auto const v = *reinterpret_cast<inject_vector<T, N> const*>(src);
    INFERSCALE_UNROLL
    for (int e = 0; e < N; ++e) {
      out[e] = v.values[e];
    }
  } else {
    INFERSCALE_UNROLL
    for (int e = 0; e < N; ++e) {
      out[e] = src[e];
    }
  }
}

/// @brief Writes N converted elements to dims `dim .. dim+N-1` of (slot, head) of one layer.
template <int N, bool Vectorized, class CacheT>
INFERSCALE_HOST_DEVICE INFERSCALE_FORCEINLINE void store_run(CacheT* base,
                                                             paged_kv_layout const& layout,
                                                             std::int64_t block,
                                                             std::int32_t token,
                                                             std::int32_t head,
                                                             std::int32_t dim,
                                                             CacheT const (&values)[N])
{
  if constexpr (Vectorized) {
    inject_vector<CacheT, N> v;
    INFERSCALE_UNROLL
    for (int e = 0; e < N; ++e) {
      v.values[e] = values[e];
    }
    *reinterpret_cast<inject_vector<CacheT, N>*>(base + layout.offset(block, token, head, dim)) = v;
  } else {
    INFERSCALE_UNROLL
    for (int e = 0; e < N; ++e) {
      base[layout.offset(block, token, head, dim + e)] = values[e];
    }
  }
}

/// @brief A block's tile state (shared memory on the device; plain arrays in the host emulation).
struct inject_tile_state {
  rope_cos_sin* cos_sin;   ///< [tile tokens][pairs], swizzled (cos_sin_swizzle)
  std::int64_t* slot;      ///< -1: skip the token
  std::int64_t* block;     ///< slot / block_size, divided once per token
  std::int32_t* in_block;  ///< slot % block_size
  std::int64_t* source;    ///< offset of the store token's layer-0 key row
};

/**
 * @brief One block of inject_kernel, as two phases separated by a block barrier: prepare (each
 * thread fills part of the tile state) and work (each thread takes every `threads`-th unit). The
 * kernel runs them on the device; the host emulation (tests) runs the same code on the CPU.
 *
 * @tparam Vectorized true: every run is whole 16-byte store vectors and aligned cache vectors
 *         (checked by make_inject_launch); false: runs of one element / one pair.
 */
template <class Policy, class StoreT, class CacheT, class Rotation, bool Vectorized>
struct inject_block {
  /// Elements per run: 16 bytes of the store dtype, or one element.
  static constexpr int run =
    Vectorized ? Policy::vector_bytes / static_cast<int>(sizeof(StoreT)) : 1;

  INFERSCALE_HOST_DEVICE static std::int32_t tile_tokens(inject_kernel_args<Rotation> const& args,
                                                         std::int64_t block_x)
  {
    std::int64_t const first_token = block_x * args.tile_tokens;
    return static_cast<std::int32_t>(args.batch.num_tokens - first_token < args.tile_tokens
                                       ? args.batch.num_tokens - first_token
                                       : args.tile_tokens);
  }

  /// @brief Phase 1: the tile's slots (divided once) and cos/sin (once per token and pair).
  INFERSCALE_HOST_DEVICE static void prepare(inject_kernel_args<Rotation> const& args,
                                             std::int64_t block_x,
                                             std::int32_t block_y,
                                             std::int32_t thread,
                                             std::int32_t threads,
                                             inject_tile_state const& tile)
  {
    std::int32_t const pairs       = args.rotation.num_pairs();
    std::int64_t const num_slots   = args.cache.num_slots();
    std::int64_t const first_token = block_x * args.tile_tokens;
    std::int32_t const tokens      = tile_tokens(args, block_x);
    std::int64_t const pool_tokens = args.store.num_pages * args.store.page_size;
    for (std::int32_t t = thread; t < tokens; t += threads) {
      std::int64_t const slot        = args.batch.slot[first_token + t];
      std::int64_t const position    = args.batch.position[first_token + t];
      std::int64_t const store_token = args.batch.store_token[first_token + t];
      // The host cannot see device arrays: a slot outside the cache, a position outside the
      // table or a store token outside the pool skips the token rather than reading or writing
      // out of bounds, and is counted (inject_device_errors); a negative slot is a plain skip.
      bool const slot_ok     = slot_in_cache(slot, num_slots);
      bool const position_ok = position >= 0 && position < args.table_rows;
      bool const token_ok    = store_token >= 0 && store_token < pool_tokens;
      bool const ok          = slot_ok && position_ok && token_ok;
      // Every layer group (block_y) prepares the same tokens: the first one counts them.
      if (!ok && slot >= 0 && block_y == 0 && args.errors != nullptr) {
        count_device_error(!slot_ok       ? &args.errors->bad_slot
                           : !position_ok ? &args.errors->bad_position
                                          : &args.errors->bad_store_token);
      }
      index_quotient const in_cache = index_divmod(ok ? slot : 0, args.cache.key_layout.block_size);
      tile.slot[t]                  = ok ? slot : -1;
      tile.block[t]                 = in_cache.quotient;
      tile.in_block[t]              = static_cast<std::int32_t>(in_cache.remainder);
      // Offset of the token's layer-0 key row: the page division is done once per token. A
      // compressed store (scalar path only): the store token itself, its blocks found per unit.
      tile.source[t] = !ok ? 0
                       : args.store.compression == kv_compression::none
                         ? args.store.row_offset(store_token, 0, 0)
                         : store_token;
    }
    // Rotation r's entries of token t start at (r * tile_tokens + t) * pairs (work() reads them).
    std::int32_t const per_rotation = tokens * pairs;
    std::int32_t const entries      = rotation_count(args.rotation) * per_rotation;
    for (std::int32_t i = thread; i < entries; i += threads) {
      // One rotation: no division (a single rotation's count is the constant 1).
      std::int32_t const r    = is_device_layer_rotation<Rotation>::value ? i / per_rotation : 0;
      std::int32_t const rest = i - r * per_rotation;
      std::int32_t const t    = rest / pairs;
      std::int64_t const position = args.batch.position[first_token + t];
      tile.cos_sin[cos_sin_swizzle(r * args.tile_tokens * pairs + rest)] =
        (position >= 0 && position < args.table_rows)
          ? rope_angle_cos_sin(
              rotation_at(args.rotation, r), position, rest - t * pairs, rope_op::forward)
          : rope_cos_sin{1.0f, 0.0f};
    }
  }

  /// @brief Phase 2: every unit of the tile's (layer, token) rows, tokens fastest (adjacent store
  /// rows and, usually, adjacent slots).
  INFERSCALE_HOST_DEVICE static void work(inject_kernel_args<Rotation> const& args,
                                          std::int64_t block_x,
                                          std::int32_t block_y,
                                          std::int32_t thread,
                                          std::int32_t threads,
                                          inject_tile_state const& tile)
  {
    std::int32_t const pairs         = args.rotation.num_pairs();
    std::int32_t const rotary_dim    = args.rotation.rotary_dim;
    std::int32_t const head_dim      = args.store.head_dim;
    std::int32_t const heads         = args.store.num_heads;
    bool const halves                = args.rotation.pairing == rope_pairing::halves;
    bool const scaled                = args.cache.scale_granularity != kv_scale_granularity::none;
    std::int32_t const tokens        = tile_tokens(args, block_x);
    std::int32_t const first_layer   = block_y * args.tile_layers;
    std::int32_t const layers        = args.cache.num_layers - first_layer < args.tile_layers
                                         ? args.cache.num_layers - first_layer
                                         : args.tile_layers;
    std::int32_t const units_per_row = heads * args.units_per_head;
    std::int32_t const total         = tokens * layers * units_per_row;
    auto const* const pool           = static_cast<StoreT const*>(args.store.pool);
    // Elements between the rows of one store token in consecutive (layer, K/V): a page holds
    // [layers][2][page_size][heads][head_dim].
    std::int64_t const row_stride = args.store.page_size * args.store.row_elements();
    // A compressed store (compression.hpp) is read on the scalar path: each load dequantizes
    // (code * scale, rounded to StoreT), a uniform branch for the whole launch.
    bool const compressed = !Vectorized && args.store.compression != kv_compression::none;

    for (std::int32_t w = thread; w < total; w += threads) {
      std::int32_t const row  = w / units_per_row;
      std::int32_t const unit = w - row * units_per_row;
      std::int32_t const t    = row % tokens;
      std::int32_t const l    = first_layer + row / tokens;
      if (tile.slot[t] < 0) { continue; }
      std::int64_t const block    = tile.block[t];
      std::int32_t const in_block = tile.in_block[t];
      std::int32_t const h        = unit / args.units_per_head;
      std::int32_t const u        = unit - h * args.units_per_head;
      std::int64_t const source   = tile.source[t];
      float const scale           = scaled ? args.cache.scale(l, h, u >= args.key_units) : 1.0f;
      if (scaled && !scale_usable(scale)) {
        // A zero, negative or non-finite fp8 scale (device memory the host does not read): the
        // row is left as it was, and counted once, by its first unit.
        if ((u == 0 || u == args.key_units) && args.errors != nullptr) {
          count_device_error(&args.errors->bad_scale);
        }
        continue;
      }

      // Loads `count` elements of head h's key (kv 0) or value (kv 1) row of layer l from dim d0.
      auto const load = [&](std::int32_t kv, std::int32_t d0, auto& out) {
        constexpr int count = static_cast<int>(sizeof(out) / sizeof(out[0]));
        if constexpr (!Vectorized) {
          if (compressed) {
            index_quotient const at = index_divmod(source, args.store.page_size);
            auto const* const block = static_cast<unsigned char const*>(args.store.pool) +
                                      args.store.block_offset(at.quotient, l, kv);
            dequantize_run(args.store.blocks(),
                           block,
                           kv,
                           static_cast<std::int32_t>(at.remainder),
                           h,
                           d0,
                           count,
                           out);
            return;
          }
        }
        load_run<count, Vectorized>(
          pool + source + row_stride * (2 * l + kv) + static_cast<std::int64_t>(h) * head_dim + d0,
          out);
      };

      if (u < args.rotary_units) {
        // Key: rotate. Halves: a run of `run` pairs (elements p.. and p+R/2..). Interleaved: a run
        // of `run` elements, i.e. run/2 adjacent pairs (a single pair on the scalar path).
        auto* const dst = static_cast<CacheT*>(args.cache.key_base[l]);
        // the token's first cos/sin entry for this layer's rotation
        std::int32_t const cos_sin_row =
          (rotation_of_layer(args.rotation, l) * args.tile_tokens + t) * pairs;
        auto const cos_sin = [&](std::int32_t pair) -> rope_cos_sin const& {
          return tile.cos_sin[cos_sin_swizzle(cos_sin_row + pair)];
        };
        if (halves) {
          std::int32_t const p0 = u * run;
          StoreT x[run], y[run];
          load(0, p0, x);
          load(0, p0 + rotary_dim / 2, y);
          CacheT qx[run], qy[run];
          INFERSCALE_UNROLL
          for (int e = 0; e < run; ++e) {
            float rx, ry;
            rotate_stored_pair(x[e], y[e], cos_sin(p0 + e), args.round_each, args.fused, &rx, &ry);
            qx[e] = convert_rotated<CacheT>(rx, scaled, scale, args.cache.scale_convention);
            qy[e] = convert_rotated<CacheT>(ry, scaled, scale, args.cache.scale_convention);
          }
          store_run<run, Vectorized>(dst, args.cache.key_layout, block, in_block, h, p0, qx);
          store_run<run, Vectorized>(
            dst, args.cache.key_layout, block, in_block, h, p0 + rotary_dim / 2, qy);
        } else {
          constexpr int elements = Vectorized ? run : 2;
          std::int32_t const d0  = u * elements;
          StoreT v[elements];
          load(0, d0, v);
          CacheT q[elements];
          INFERSCALE_UNROLL
          for (int e = 0; e < elements; e += 2) {
            float rx, ry;
            rotate_stored_pair(
              v[e], v[e + 1], cos_sin((d0 + e) / 2), args.round_each, args.fused, &rx, &ry);
            q[e]     = convert_rotated<CacheT>(rx, scaled, scale, args.cache.scale_convention);
            q[e + 1] = convert_rotated<CacheT>(ry, scaled, scale, args.cache.scale_convention);
          }
          store_run<elements, Vectorized>(dst, args.cache.key_layout, block, in_block, h, d0, q);
        }
      } else {
        // Key pass-through dims (rotary_dim .. head_dim) or value: convert a run.
        bool const value = u >= args.key_units;
        std::int32_t const d0 =
          value ? (u - args.key_units) * run : rotary_dim + (u - args.rotary_units) * run;
        auto* const dst =
          static_cast<CacheT*>(value ? args.cache.value_base[l] : args.cache.key_base[l]);
        StoreT v[run];
        load(value ? 1 : 0, d0, v);
        CacheT q[run];
        INFERSCALE_UNROLL
        for (int e = 0; e < run; ++e) {
          q[e] = convert_stored<CacheT>(v[e], scaled, scale, args.cache.scale_convention);
        }
        store_run<run, Vectorized>(
          dst, value ? args.cache.value_layout : args.cache.key_layout, block, in_block, h, d0, q);
      }
    }
  }
};

/// @brief Everything extract_kernel reads.
template <class Rotation>
struct extract_kernel_args {
  kv_store_ref store;
  paged_kv_cache cache;
  Rotation rotation;
  injection_batch_view tokens;  ///< store_token = destination, position = absolute, slot = source
  std::int32_t units_per_head;  ///< pairs + pass-through dims + value dims
};

/// @brief Work units of one token of an extraction: layers x heads x units_per_head (the launch
/// checks that it fits 31 bits).
template <class Rotation>
INFERSCALE_HOST_DEVICE std::int64_t extract_units_per_token(
  extract_kernel_args<Rotation> const& args)
{
  return static_cast<std::int64_t>(args.cache.num_layers) * args.store.num_heads *
         args.units_per_head;
}

/// @brief Units of an extraction: tokens x layers x heads x units_per_head.
template <class Rotation>
INFERSCALE_HOST_DEVICE std::int64_t extract_units(extract_kernel_args<Rotation> const& args)
{
  return args.tokens.num_tokens * extract_units_per_token(args);
}

/**
 * @brief Extraction of unit `w` (layer, head, unit; unit = a key pair, a key pass-through dim or a
 * value dim) of token `i`. Shared by extract_kernel and the host emulation. The unit index is
 * 32-bit, so its divisions are 32-bit ones; the slot and store-token divisions take index_divmod.
 * @pre 0 <= w < extract_units_per_token(args) < 2^31
 */
template <class StoreT, class CacheT, class Rotation>
INFERSCALE_HOST_DEVICE void extract_unit(extract_kernel_args<Rotation> const& args,
                                         std::int64_t i,
                                         std::int32_t w)
{
  std::int32_t const pairs     = args.rotation.num_pairs();
  std::int32_t const rotary    = args.rotation.rotary_dim;
  std::int32_t const head_dim  = args.store.head_dim;
  std::int32_t const heads     = args.store.num_heads;
  std::int32_t const per_layer = heads * args.units_per_head;
  auto* const pool             = static_cast<StoreT*>(args.store.pool);
  std::int32_t const l         = w / per_layer;
  std::int32_t const rest      = w - l * per_layer;
  std::int32_t const h         = rest / args.units_per_head;
  std::int32_t const u         = rest - h * args.units_per_head;
  std::int64_t const slot      = args.tokens.slot[i];
  std::int32_t const key_units = pairs + (head_dim - rotary);
  bool const value             = u >= key_units;
  float const scale            = args.cache.scale(l, h, value);
  StoreT* const dst = pool + args.store.row_offset(args.tokens.store_token[i], l, value ? 1 : 0) +
                      static_cast<std::int64_t>(h) * head_dim;
  if (u < pairs) {
    auto const* const src = static_cast<CacheT const*>(args.cache.key_base[l]);
    std::int32_t first, second;
    pair_elements(args.rotation.pairing, rotary, u, &first, &second);
    rope_cos_sin const cs =
      rope_angle_cos_sin(rotation_at(args.rotation, rotation_of_layer(args.rotation, l)),
                         args.tokens.position[i],
                         u,
                         rope_op::inverse);
    float x, y;
    unrotate_pair(
      dequantize(
        src[args.cache.key_layout.slot_offset(slot, h, first)], scale, args.cache.scale_convention),
      dequantize(src[args.cache.key_layout.slot_offset(slot, h, second)],
                 scale,
                 args.cache.scale_convention),
      cs,
      &x,
      &y);
    dst[first]  = from_float<StoreT>(x);
    dst[second] = from_float<StoreT>(y);
  } else {
    std::int32_t const d = value ? u - key_units : rotary + (u - pairs);
    auto const* const src =
      static_cast<CacheT const*>(value ? args.cache.value_base[l] : args.cache.key_base[l]);
    auto const& layout = value ? args.cache.value_layout : args.cache.key_layout;
    dst[d]             = from_float<StoreT>(
      dequantize(src[layout.slot_offset(slot, h, d)], scale, args.cache.scale_convention));
  }
}

/// @brief Whether the vectorized path applies: whole 16-byte store runs, aligned cache runs.
template <class StoreT, class CacheT, class Rotation>
bool inject_vectorizable(kv_store_ref const& store,
                         paged_kv_cache const& cache,
                         Rotation const& rotation)
{
  constexpr std::int64_t run = 16 / static_cast<std::int64_t>(sizeof(StoreT));
  std::int64_t const rotary  = rotation.rotary_dim;
  std::int64_t const dim     = store.head_dim;
  bool const pairs_fit =
    rotation.pairing == rope_pairing::halves ? (rotary / 2) % run == 0 : rotary % run == 0;
  if (!pairs_fit || rotary % run != 0 || dim % run != 0) { return false; }
  if (reinterpret_cast<std::uintptr_t>(store.pool) % 16 != 0) { return false; }
  if (store.compression != kv_compression::none) { return false; }  // dequantized per element
  std::uintptr_t const align = static_cast<std::uintptr_t>(run) * sizeof(CacheT);
  auto const layout_ok       = [&](paged_kv_layout const& l) {
    return l.dim_stride == 1 && l.dim_chunk % run == 0 && l.block_stride % run == 0 &&
           l.token_stride % run == 0 && l.head_stride % run == 0 && l.chunk_stride % run == 0 &&
           l.token_chunk_stride % run == 0;
  };
  if (!layout_ok(cache.key_layout) || !layout_ok(cache.value_layout)) { return false; }
  for (std::int32_t l = 0; l < cache.num_layers; ++l) {
    if (reinterpret_cast<std::uintptr_t>(cache.key_base[l]) % align != 0 ||
        reinterpret_cast<std::uintptr_t>(cache.value_base[l]) % align != 0) {
      return false;
    }
  }
  return true;
}

/// @brief A launch of inject_kernel, fully resolved on the host (no CUDA call): the kernel's
/// arguments, grid and dynamic shared memory, and which path it takes.
template <class Rotation>
struct inject_launch_config {
  inject_kernel_args<Rotation> args{};
  std::int64_t grid_x{};  ///< token tiles
  std::int32_t grid_y{};  ///< layer groups
  std::size_t shared_bytes{};
  bool vectorized{};
};

/**
 * @brief Resolves a launch: path (vectorized when inject_vectorizable), units per head, token tile,
 * and layers per block (as many as keep the grid at `min_blocks_per_sm` blocks per SM, so a tile's
 * cos/sin serve several layers without starving the GPU).
 * @param sm_count multiprocessors of the device the kernel will run on
 */
template <class StoreT, class CacheT, class Rotation>
inject_launch_config<kernel_rotation_t<Rotation>> make_inject_launch(
  kv_store_ref const& store,
  injection_batch_view const& batch,
  paged_kv_cache const& cache,
  Rotation const& rotation_source,
  int sm_count,
  inject_device_errors* errors = nullptr)
{
  using policy = inject_policy_sm90;
  inject_launch_config<kernel_rotation_t<Rotation>> config{};
  // A per-layer rotation's rotations share their shape and roundings: the first one speaks for all.
  auto const& rotation = rotation_at(rotation_source, 0);
  config.vectorized    = inject_vectorizable<StoreT, CacheT>(store, cache, rotation);
  std::int32_t const run =
    config.vectorized ? policy::vector_bytes / static_cast<std::int32_t>(sizeof(StoreT)) : 1;
  std::int32_t const rotary = rotation.rotary_dim;
  std::int32_t const dim    = store.head_dim;
  std::int32_t const count  = rotation_count(rotation_source);

  auto& args      = config.args;
  args.store      = store;
  args.cache      = cache;
  args.rotation   = to_kernel_rotation(rotation_source);
  args.batch      = batch;
  args.table_rows = rope_table_rows(rotation);
  for (std::int32_t r = 1; r < count; ++r) {  // positions every rotation holds
    args.table_rows = std::min(args.table_rows, rope_table_rows(rotation_at(rotation_source, r)));
  }
  args.round_each = rope_rounds_each_operation<StoreT>(rotation, rope_op::forward);
  args.fused      = rope_fuses_multiply_add(rotation, rope_op::forward);
  args.errors     = errors;
  args.rotary_units =
    config.vectorized ? (rotation.pairing == rope_pairing::halves ? rotary / 2 / run : rotary / run)
                      : rotary / 2;
  args.key_units      = args.rotary_units + (dim - rotary) / run;
  args.units_per_head = args.key_units + dim / run;
  args.tile_tokens    = policy::tile_tokens;

  std::int64_t const token_tiles = ceil_div(batch.num_tokens, policy::tile_tokens);
  INFERSCALE_EXPECTS(
    token_tiles <= std::int64_t{0x7fffffff},
    "inject (device launch): " + std::to_string(batch.num_tokens) + " tokens exceed a grid");
  std::int32_t tile_layers = std::min(policy::max_tile_layers, cache.num_layers);
  while (tile_layers > 1 && token_tiles * ceil_div(cache.num_layers, tile_layers) <
                              static_cast<std::int64_t>(sm_count) * policy::min_blocks_per_sm) {
    tile_layers /= 2;
  }
  args.tile_layers    = tile_layers;
  config.grid_x       = token_tiles;
  config.grid_y       = ceil_div(cache.num_layers, tile_layers);
  config.shared_bytes = static_cast<std::size_t>(cos_sin_tile_entries(
                          std::int64_t{count} * policy::tile_tokens * rotation.num_pairs())) *
                        sizeof(rope_cos_sin);
  // The default dynamic shared memory of a block (no opt-in attribute is set): a per-layer
  // rotation of many distinct rotations over wide heads could exceed it.
  INFERSCALE_EXPECTS(config.shared_bytes <= 48 * 1024,
                     "inject (device launch): the tile's cos/sin of " + std::to_string(count) +
                       " rotations need " + std::to_string(config.shared_bytes) +
                       " bytes of shared memory, more than 48 KiB");
  return config;
}

/// @brief Arguments of extract_kernel for `tokens` (device arrays).
template <class Rotation>
extract_kernel_args<kernel_rotation_t<Rotation>> make_extract_args(
  kv_store_ref const& store,
  paged_kv_cache const& cache,
  Rotation const& rotation,
  injection_batch_view const& tokens)
{
  extract_kernel_args<kernel_rotation_t<Rotation>> args{};
  args.store          = store;
  args.cache          = cache;
  args.rotation       = to_kernel_rotation(rotation);
  args.tokens         = tokens;
  auto const& first   = rotation_at(rotation, 0);
  args.units_per_head = first.num_pairs() + (store.head_dim - first.rotary_dim) + store.head_dim;
  return args;
}

}  // namespace inferscale::detail
