/**
 * @file detail/inject/host_dispatch.hpp
 * @brief The host backend's dispatch: runtime switches (layout, scales, pairing, rounding, the
 * CPU's vector level) and dtypes turned into the template parameters of one loop. The loops read
 * the rotation through host_rotation (its row function), so they are compiled once for each kind
 * of rotation: inject_host_loops<Table> (the three cos/sin tables; rope_params, without the
 * tables' roundings), which a program defining INFERSCALE_EXTERN_TEMPLATES compiles in one unit
 * (instances.hpp); inject_host_view<Rotation> is the few lines of each type.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/detail/inject/host_compressed.hpp>
#include <inferscale/detail/inject/host_loop.hpp>
#include <inferscale/detail/inject/host_rotation.hpp>
#include <inferscale/detail/inject/host_simd.hpp>
#include <inferscale/detail/inject/vllm_cpu_lines.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
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

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__FMA__) && \
  !defined(__CUDA_ARCH__)
#define INFERSCALE_HOST_FMA_DISPATCH 1
/**
 * @brief The fused-multiply-add injection compiled for CPUs with FMA (chosen at run time): without
 * it a baseline x86-64 build computes each `std::fma` by a library call. Same results either way
 * (fma is exactly rounded); only the speed differs.
 */
template <bool ContiguousK,
          bool ContiguousV,
          bool Scaled,
          bool Halves,
          bool RoundEach,
          class StoreT,
          class CacheT>
__attribute__((target("fma"))) void inject_host_typed_fma(kv_store_ref const& store,
                                                          injection_batch_view const& batch,
                                                          paged_kv_cache const& cache,
                                                          host_rotation const& rotation)
{
  inject_host_typed<ContiguousK, ContiguousV, Scaled, Halves, RoundEach, true, StoreT, CacheT>(
    store, batch, cache, rotation);
}
#else
#define INFERSCALE_HOST_FMA_DISPATCH 0
#endif

/// @brief Calls f(std::true_type) or f(std::false_type) as `value` says; only the latter when
/// the flag cannot be true for these types (`Possible == false`), to instantiate less.
template <bool Possible = true, class F>
void with_flag(bool value, F&& f)
{
  if constexpr (Possible) {
    if (value) {
      f(std::true_type{});
      return;
    }
  }
  f(std::false_type{});
}

/// @brief Turns the host loop's runtime switches into template parameters (one place).
/// `Table`: the rotation is a cos/sin table (is_cos_sin_table), the only kind whose switches
/// (round each operation, fused multiply-adds, bfloat16 truncation) may be set.
template <bool Table, class StoreT, class CacheT>
void dispatch_host_inject(kv_store_ref const& store,
                          injection_batch_view const& batch,
                          paged_kv_cache const& cache,
                          host_rotation const& rotation)
{
  constexpr bool fp8 =
    std::is_same_v<CacheT, float8_e4m3_t> || std::is_same_v<CacheT, float8_e5m2_t>;
  // float stores never round each operation
  constexpr bool may_round = Table && !std::is_same_v<StoreT, float>;
  constexpr bool may_fuse  = Table;
  bool const contiguous = dims_contiguous(cache.key_layout) && dims_contiguous(cache.value_layout);
  if constexpr (Table && std::is_same_v<CacheT, bfloat16_t>) {
#if INFERSCALE_HOST_X86_SIMD
    // vLLM's CPU layouts (vec and amx) by whole 64-byte lines: bf16 store, halves pairing,
    // AVX-512BW (detail/inject/vllm_cpu_lines.hpp), for vLLM's truncating rotation (its AVX2
    // kernel) and its rotation rounded to nearest (its AVX512_BF16 kernel).
    bool const lines = std::is_same_v<StoreT, bfloat16_t> &&
                       rotation.pairing == rope_pairing::halves && rotation.rotary_dim % 4 == 0 &&
                       line_path_takes(cache) && active_host_simd() == host_simd::avx512_bf16;
#endif
    if (rotation.truncate_to_bfloat16) {  // checked: unscaled bfloat16 cache
#if INFERSCALE_HOST_X86_SIMD
      if (lines) {
        simd_lines::inject_host_lines<false>(store, batch, cache, rotation);
        return;
      }
      if (!contiguous && keys_token_major(cache.key_layout) &&
          dims_contiguous(cache.value_layout) && store.head_dim % 8 == 0 &&
          store.head_dim <= simd::token_major_max_dim && active_host_simd() != host_simd::scalar) {
        with_flag(rotation.pairing == rope_pairing::halves, [&](auto halves) {
          inject_host_token_major_truncate<decltype(halves)::value, StoreT>(
            store, batch, cache, rotation);
        });
        return;
      }
#endif
      with_flag(contiguous, [&](auto c) {
        with_flag(rotation.pairing == rope_pairing::halves, [&](auto halves) {
          constexpr bool C = decltype(c)::value;
          constexpr bool H = decltype(halves)::value;
          inject_host_typed<C, C, false, H, false, false, StoreT, CacheT, host_rotation, true>(
            store, batch, cache, rotation);
        });
      });
      return;
    }
#if INFERSCALE_HOST_X86_SIMD
    // Rounded to nearest at the end (fp32 products and sums, no per-operation rounding, no
    // fusion: the connector's "fp32_nearest"), into an unscaled bfloat16 cache.
    if (lines && !rotation.round_each && !rotation.fused &&
        cache.scale_granularity == kv_scale_granularity::none) {
      simd_lines::inject_host_lines<true>(store, batch, cache, rotation);
      return;
    }
#endif
  }
  with_flag(contiguous, [&](auto c) {
    with_flag<fp8>(cache.scale_granularity != kv_scale_granularity::none, [&](auto scaled) {
      with_flag(rotation.pairing == rope_pairing::halves, [&](auto halves) {
        with_flag<may_round>(rotation.round_each, [&](auto round_each) {
          with_flag<may_fuse>(rotation.fused, [&](auto fused) {
            constexpr bool C = decltype(c)::value;
            constexpr bool S = decltype(scaled)::value;
            constexpr bool H = decltype(halves)::value;
            constexpr bool F = decltype(fused)::value;
            // A fused rotation does not round each operation (the loops test Fused first):
            // (R, F) = (1, 1) is the (0, 1) loop, one instance instead of two of each.
            constexpr bool R = decltype(round_each)::value && !F;
#if INFERSCALE_HOST_X86_SIMD
            // Interleaved pairs (llama.cpp's rotation of Llama-family models) take the vector
            // path unscaled and without per-operation rounding (what llama.cpp's caches and
            // tables need); the scaled fp8 caches and vLLM's bf16 tables are rotated in halves.
            if constexpr (C && (H || (!S && !R))) {
              host_simd const level = active_host_simd();
              if (level != host_simd::scalar) {
                inject_host_typed_simd<S, R, F, H, StoreT, CacheT>(
                  store, batch, cache, rotation, level);
                return;
              }
            }
#endif
#if INFERSCALE_HOST_FMA_DISPATCH
            if constexpr (F) {
              if (__builtin_cpu_supports("fma")) {
                inject_host_typed_fma<C, C, S, H, R, StoreT, CacheT>(store, batch, cache, rotation);
                return;
              }
            }
#endif
            inject_host_typed<C, C, S, H, R, F, StoreT, CacheT>(store, batch, cache, rotation);
          });
        });
      });
    });
  });
}

/// @brief Calls f(type_tag<StoreT>, type_tag<CacheT>) for the runtime dtypes.
template <class F>
void dispatch_store_cache(dtype store_dtype, dtype cache_dtype, F&& f)
{
  dispatch_dtype(store_dtype, [&](auto store_tag) {
    using S = typename decltype(store_tag)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      dispatch_dtype(cache_dtype, [&](auto cache_tag) { f(store_tag, cache_tag); });
    } else {
      INFERSCALE_FAIL(std::string{"store dtype "} + to_string(store_dtype) + " is not supported");
    }
  });
}

/**
 * @brief The host injection of a checked batch view for any rotation of its kind (`Table`: a
 * cos/sin table, else rope_params): the runtime dtypes, then the loop. Compiled once per program
 * where it defines INFERSCALE_EXTERN_TEMPLATES (instances.hpp: `<false>` and `<true>`).
 */
template <bool Table>
void inject_host_loops(kv_store_ref const& store,
                       injection_batch_view const& batch,
                       paged_kv_cache const& cache,
                       host_rotation const& rotation)
{
  dispatch_store_cache(store.store_dtype, cache.cache_dtype, [&](auto s, auto c) {
    using S = typename decltype(s)::type;
    using C = typename decltype(c)::type;
    if (store.compression != kv_compression::none) {
      inject_host_compressed<S>(store,
                                batch,
                                cache.num_slots(),
                                [&](kv_store_ref const& rows, injection_batch_view const& part) {
                                  dispatch_host_inject<Table, S, C>(rows, part, cache, rotation);
                                });
      return;
    }
    dispatch_host_inject<Table, S, C>(store, batch, cache, rotation);
  });
}

/**
 * @brief The host injection of a checked batch view: the one place the host run
 * (injection_batch::run) and the tiered host run (tiered_store::run) reach the loops through
 * (inject_host_loops, with `rotation` erased).
 */
template <class Rotation>
void inject_host_view(kv_store_ref const& store,
                      injection_batch_view const& batch,
                      paged_kv_cache const& cache,
                      Rotation const& rotation)
{
  inject_host_loops<is_cos_sin_table<Rotation>::value>(
    store, batch, cache, erase_host_rotation(rotation));
}

}  // namespace inferscale::detail
