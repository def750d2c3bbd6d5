/**
 * @file kv_capture.cuh
 * @brief The device capture buffer: the device twin of kv_capture (kv_capture.hpp) for a GPU
 * engine, whose K and V are already in device memory. The hooks write rows with stream-ordered
 * kernels (no copy to the host), the written-rows record stays on the host, and
 * store_captured_facts (engine.cuh) checks the facts' rows finite in the store dtype and converts
 * and scatters them into a device store's pages on the device.
 *
 * Which engines' hooks it serves, and how: every GPU engine whose pre-RoPE K and V a hook sees as
 * device tensors, on the stream the forward runs on —
 *  - **vLLM**: a forward hook on each attention layer's `rotary_emb` input (`positions, q, k`; k
 *    is pre-RoPE, `[T, H*D]`) and the layer's value input, on `torch.cuda.current_stream()`;
 *  - **SGLang**: the same at `RadixAttention`'s rotary call;
 *  - **TensorRT-LLM**: the attention plugin's K and V before `applyRoPE`, on the plugin's stream.
 * A CPU engine (the llama.cpp example's `cb_eval` on the CPU backend) keeps the host kv_capture.
 *
 * @code
 * // One encoding forward of n tokens on `stream`; in attention layer l, before the rotation,
 * // k and v are bf16 device tensors [n, H*D] with row strides k_ld and v_ld (in elements):
 * device_kv_capture capture{model_geometry, n, stream};
 * ...
 * capture.write_keys(l, 0, make_token_head_view<bfloat16_t const>(k, n, H, D, k_ld, D), stream);
 * capture.write_values(l, 0, make_token_head_view<bfloat16_t const>(v, n, H, D, v_ld, D), stream);
 * ...
 * // engine.cuh: waits for `stream` once (the finiteness check), then enqueues the scatter.
 * try {
 *   store_captured_facts(device_store, capture, facts, stream);
 * } catch (logic_error const&) {  // e.g. a NaN: nothing stored
 *   for (std::int64_t t : capture.faulty_tokens(stream)) { ... drop the facts covering t ... }
 * }
 * @endcode
 */
#pragma once

#include <inferscale/cuda_error.hpp>
#include <inferscale/detail/capture/kernels.cuh>
#include <inferscale/detail/capture/rows_written.hpp>
#include <inferscale/device_buffer.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/memory_resource.hpp>
#include <inferscale/views.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief Device buffer a GPU engine's capture hooks fill during one encoding forward: pre-RoPE K
 * and V of every layer and token as **fp32** (whatever the engine's dtype: float, half_t and
 * bfloat16_t rows convert exactly, and the conversion to the store dtype happens once, when the
 * rows are stored, with the same rounding as the host path), `[layers, tokens, heads, head_dim]`
 * contiguous for K and for V: `8 * layers * tokens * heads * head_dim` bytes, plus 4 per token for
 * the fault flags. The host records which (layer, token) rows a write was enqueued for, so an
 * incomplete capture is refused instead of stored.
 *
 * Stream-ordered: the buffer is allocated and zeroed on the stream given at construction
 * (cudaMallocAsync) and freed on it at destruction (cudaFreeAsync), so neither waits. Work on
 * another stream that uses the buffer (a hook's write, a store) must be ordered before the
 * destruction (an event recorded there, waited on by the construction stream), and the stream
 * must outlive the buffer. Move-only.
 */
class device_kv_capture {
 public:
  /**
   * @brief A buffer for `num_tokens` tokens of a model with geometry `geometry` (the store's
   * shard geometry when the store holds a shard), allocated and zeroed on `stream`.
   * @throw logic_error if the geometry is invalid or `num_tokens` is not positive; cuda_error if
   *        the allocation cannot be enqueued.
   */
  device_kv_capture(kv_geometry const& geometry, std::int64_t num_tokens, cuda::stream_ref stream)
    : rows_{geometry, num_tokens, "device_kv_capture"}, stream_{stream.get()}
  {
    std::size_t const rows =
      static_cast<std::size_t>(geometry.num_layers) * static_cast<std::size_t>(num_tokens);
    buffer_ = device_buffer<float>(
      2 * rows * static_cast<std::size_t>(geometry.elements_per_token_layer()) +
        static_cast<std::size_t>(num_tokens),
      stream_,
      async_device_resource());
    INFERSCALE_CUDA_TRY(
      cudaMemsetAsync(buffer_.data(), 0, buffer_.size() * sizeof(float), stream_));
  }

  device_kv_capture(device_kv_capture&&) noexcept            = default;
  device_kv_capture& operator=(device_kv_capture&&) noexcept = default;
  device_kv_capture(device_kv_capture const&)                = delete;
  device_kv_capture& operator=(device_kv_capture const&)     = delete;

  kv_geometry geometry() const noexcept { return rows_.geometry(); }
  std::int64_t num_tokens() const noexcept { return rows_.num_tokens(); }
  /// @brief The stream the buffer was allocated on and is freed on.
  cuda::stream_ref stream() const noexcept { return cuda::stream_ref{stream_}; }

  /**
   * @brief Enqueues on `stream` the copy of the pre-RoPE keys of tokens `first_token ..
   * first_token + rows.extent(0) - 1` of layer `layer` (`rows`: `[tokens, heads, head_dim]` in
   * device memory, element type float, half_t or bfloat16_t, any non-negative strides, converted
   * to fp32) and records the rows as written. Never waits.
   * @throw logic_error if the layer or token range is outside the buffer, the heads/head_dim
   *        differ from the geometry, the data is null or a stride negative: nothing is enqueued or
   *        recorded then. cuda_error if the kernel cannot be launched (nothing recorded).
   */
  template <class T>
  void write_keys(std::int32_t layer,
                  std::int64_t first_token,
                  token_head_view<T const> rows,
                  cuda::stream_ref stream)
  {
    write(0, layer, first_token, rows, stream, "device_kv_capture::write_keys");
  }

  /// @brief As write_keys, for the values.
  template <class T>
  void write_values(std::int32_t layer,
                    std::int64_t first_token,
                    token_head_view<T const> rows,
                    cuda::stream_ref stream)
  {
    write(1, layer, first_token, rows, stream, "device_kv_capture::write_values");
  }

  /// @brief True when writes of K and V of tokens `[begin, begin + count)` were enqueued in
  /// every layer.
  bool complete(std::int64_t begin, std::int64_t count) const noexcept
  {
    return rows_.complete(begin, count);
  }
  /// @brief True when every token of every layer was written.
  bool complete() const noexcept { return complete(0, num_tokens()); }

  /// @brief Keys of tokens `[begin, begin + count)` as a `[layers, count, heads, head_dim]` view of
  /// device memory (valid for work ordered after the writes).
  fact_kv_view<float const> keys(std::int64_t begin, std::int64_t count) const
  {
    return slice(0, begin, count, "device_kv_capture::keys");
  }
  /// @brief Values of tokens `[begin, begin + count)` (device memory).
  fact_kv_view<float const> values(std::int64_t begin, std::int64_t count) const
  {
    return slice(1, begin, count, "device_kv_capture::values");
  }
  fact_kv_view<float const> keys() const { return keys(0, num_tokens()); }
  fact_kv_view<float const> values() const { return values(0, num_tokens()); }

  /**
   * @brief The fault flags (device memory, one per token, zeroed at construction): the check
   * store_captured_facts runs before it stores anything zeroes them and sets the flag of each of
   * the facts' tokens with an element that is NaN or infinite in the store dtype (captured so, or
   * beyond the dtype's range), then refuses the facts if one is set; faulty_tokens reads them back.
   */
  std::uint32_t* fault_flags() const noexcept
  {
    return reinterpret_cast<std::uint32_t*>(buffer_.data() + 2 * plane_elements());
  }

  /**
   * @brief The tokens the last finiteness check of store_captured_facts on this buffer found
   * faulty (among its facts' tokens), ascending: a fact covering one of them holds a NaN or an
   * infinity and was refused with the others of that call (the exception names the first faulty
   * token only; this lists all, so that the caller can store the other facts again). Empty after
   * a call that stored its facts, and before any check (a call refused before its check, by its
   * ranges, leaves the previous check's flags).
   * @throw cuda_error on a CUDA failure.
   * @note Waits for `stream` (which must be ordered after the store to be read).
   */
  std::vector<std::int64_t> faulty_tokens(cuda::stream_ref stream) const
  {
    std::vector<std::uint32_t> flags(static_cast<std::size_t>(num_tokens()));
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(flags.data(),
                                        fault_flags(),
                                        flags.size() * sizeof(std::uint32_t),
                                        cudaMemcpyDeviceToHost,
                                        stream.get()));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    std::vector<std::int64_t> out;
    for (std::size_t t = 0; t < flags.size(); ++t) {
      if (flags[t] != 0) { out.push_back(static_cast<std::int64_t>(t)); }
    }
    return out;
  }

 private:
  /// @brief Elements of the K (or V) plane: layers * tokens * heads * head_dim.
  std::int64_t plane_elements() const noexcept
  {
    return static_cast<std::int64_t>(rows_.geometry().num_layers) * num_tokens() *
           rows_.geometry().elements_per_token_layer();
  }

  template <class T>
  void write(int kv,
             std::int32_t layer,
             std::int64_t first_token,
             token_head_view<T const> rows,
             cuda::stream_ref stream,
             char const* who)
  {
    static_assert(
      std::is_same_v<T, float> || std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>,
      "device_kv_capture: rows hold float, half_t or bfloat16_t");
    std::int64_t const count = rows.extent(0);
    rows_.check_write(
      layer, first_token, count, rows.extent(1), rows.extent(2), rows.data_handle(), who);
    for (int r = 0; r < 3; ++r) {
      INFERSCALE_EXPECTS(rows.stride(r) >= 0,
                         std::string{who} + ": stride " + std::to_string(r) + " is negative (" +
                           std::to_string(rows.stride(r)) + ")");
    }
    if (count == 0) { return; }
    kv_geometry const& g            = rows_.geometry();
    std::int64_t const row_elements = g.elements_per_token_layer();
    detail::capture_write_args<T> const args{
      buffer_.data() + kv * plane_elements() +
        (static_cast<std::int64_t>(layer) * num_tokens() + first_token) * row_elements,
      rows.data_handle(),
      count,
      g.num_kv_heads,
      g.head_dim,
      rows.stride(0),
      rows.stride(1),
      rows.stride(2)};
    std::int64_t const blocks = std::clamp<std::int64_t>(
      (detail::capture_write_elements(args) + detail::capture_threads - 1) /
        detail::capture_threads,
      1,
      std::int64_t{1} << 16);
    detail::capture_write_kernel<T>
      <<<static_cast<unsigned>(blocks), detail::capture_threads, 0, stream.get()>>>(args);
    INFERSCALE_CHECK_LAUNCH();
    rows_.mark(kv, layer, first_token, count);
  }

  fact_kv_view<float const> slice(int kv,
                                  std::int64_t begin,
                                  std::int64_t count,
                                  char const* who) const
  {
    return rows_.slice(buffer_.data() + kv * plane_elements(), begin, count, who);
  }

  detail::rows_written rows_;
  cudaStream_t stream_{};
  device_buffer<float> buffer_;  ///< K plane, V plane, then num_tokens() fault flags (uint32)
};

}  // namespace inferscale
