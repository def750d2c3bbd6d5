// The library's cache descriptor (inferscale/cache.hpp) of a simulated engine cache
// (engine_caches.hpp), built as a connector builds it from torch tensors: the factory for the
// engine's layout fed the tensors' data pointers, shapes and strides. Test setup code shared by
// several test executables; free of Catch macros (malformed input throws std::invalid_argument).
#pragma once

#include "engine_caches.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/dtype.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace inferscale_test {

/// @brief A tensor_desc's shape or strides as the fixed-rank array a factory takes; throws
/// std::invalid_argument when the rank is not N.
template <std::size_t N>
std::array<std::int64_t, N> to_array(std::vector<std::int64_t> const& v)
{
  if (v.size() != N) { throw std::invalid_argument("to_array: tensor_desc rank mismatch"); }
  std::array<std::int64_t, N> a{};
  for (std::size_t i = 0; i < N; ++i) {
    a[i] = v[i];
  }
  return a;
}

/**
 * @brief The descriptor of `ec` whose storage starts at `base`: ec.storage() for the simulator's
 * host memory, or the base of a copy of that storage (e.g. on the device). Each tensor's data
 * pointer is base + its byte_offset; TensorRT-LLM pools are described in block order `order`.
 */
template <class T>
inferscale::paged_kv_cache describe_engine_cache(
  engine_cache<T> const& ec,
  std::byte* base,
  inferscale::trtllm_block_order order = inferscale::trtllm_block_order::hnd)
{
  using namespace inferscale;
  dtype const dt = dtype_of_v<T>;
  std::vector<void*> keys, values;
  for (int l = 0; l < ec.num_layers(); ++l) {
    keys.push_back(base + ec.key_tensor(l).byte_offset);
    values.push_back(base + ec.value_tensor(l).byte_offset);
  }
  tensor_desc const k = ec.key_tensor(0);
  tensor_desc const v = ec.value_tensor(0);
  switch (ec.layout()) {
    case engine_layout::vllm_flash_attn_nhd:
    case engine_layout::vllm_flash_attn_hnd:
      return make_vllm_flash_attn_cache(dt, keys, to_array<5>(k.shape), to_array<5>(k.strides));
    case engine_layout::vllm_flash_attn_separate:
      return make_vllm_flash_attn_cache(
        dt, keys, values, to_array<4>(k.shape), to_array<4>(k.strides), to_array<4>(v.strides));
    case engine_layout::vllm_flashinfer_nhd:
    case engine_layout::vllm_flashinfer_hnd:
      return make_vllm_flashinfer_cache(dt, keys, to_array<5>(k.shape), to_array<5>(k.strides));
    case engine_layout::vllm_legacy:
      return make_vllm_legacy_cache(dt,
                                    keys,
                                    values,
                                    to_array<5>(k.shape),
                                    to_array<5>(k.strides),
                                    to_array<4>(v.shape),
                                    to_array<4>(v.strides));
    case engine_layout::sglang_token_pool:
      return make_sglang_cache(
        dt, keys, values, to_array<3>(k.shape), to_array<3>(k.strides), to_array<3>(v.strides));
    case engine_layout::tensorrt_llm_pool:
      return make_tensorrt_llm_cache(dt,
                                     keys[0],
                                     to_array<4>(k.shape),
                                     to_array<4>(k.strides),
                                     ec.block_size(),
                                     ec.num_heads(),
                                     ec.head_dim(),
                                     order);
    case engine_layout::contiguous:
      return make_contiguous_cache(dt, keys[0], to_array<5>(k.shape), to_array<5>(k.strides));
    case engine_layout::vllm_cpu:
      return make_vllm_cpu_cache(dt, keys, to_array<4>(k.shape), to_array<4>(k.strides));
  }
  throw std::invalid_argument("describe_engine_cache: unknown layout");
}

}  // namespace inferscale_test
