/**
 * @file engine.cuh
 * @brief The engine seam, device backend (engine.hpp is the seam itself): what a GPU engine calls
 * where a CPU engine calls the host functions of engine.hpp, with a stream added — storing a
 * capture's facts into a device store (store_captured_facts: from a host kv_capture, or from a
 * device_kv_capture (kv_capture.cuh) converted and scattered on the device, the GPU engine's
 * path; encode_facts runs a device model adapter's forward into one); the injection itself is the
 * step's device run (injection_batch::run with a device_context, inject.cuh). Stream-ordered:
 * nothing here synchronises the device, and only the device capture's store (and so its
 * encode_facts) waits for its stream, once, to refuse a NaN or an infinity before anything is
 * stored.
 */
#pragma once

#include <inferscale/compose.hpp>
#include <inferscale/cuda_error.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/error.hpp>
#include <inferscale/inject.cuh>
#include <inferscale/injection_batch.hpp>
#include <inferscale/kv_capture.cuh>
#include <inferscale/store.hpp>

#include <cuda/stream_ref>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace inferscale {

/**
 * @brief Stores token ranges of a capture as facts, as store_captured_facts(store, capture, facts)
 * does, writing a device store's pool on `stream`: each fact's pages are packed on the host
 * (converted to the store dtype, a last page's unused rows zeroed, as kv_store::insert does) and
 * copied with cudaMemcpyAsync, one copy per run of consecutive pages. A host store is written on
 * the host, as the host overload does (`stream` is not used).
 *
 * The facts are in the store's catalogue when the call returns; their K/V is there for work
 * enqueued after it on `stream` (work on another stream waits on an event recorded on `stream`).
 * Erasing one of them before `stream` has run its copies frees pages a late copy still writes:
 * order the erase after them (as for any page a kernel still reads).
 *
 * @throw logic_error as the host overload (nothing is stored, nothing enqueued); cuda_error if a
 *        copy cannot be enqueued (the facts are then erased again).
 * @note Never synchronises the device. The copies are from pageable host memory, for which the
 *       runtime returns once it has taken the bytes (the staging is freed at return) and may first
 *       wait for the work already on `stream`.
 */
inline void store_captured_facts(kv_store& store,
                                 kv_capture const& capture,
                                 std::vector<captured_fact> const& facts,
                                 cuda::stream_ref stream)
{
  // A compressed pool is written by kv_store::insert (quantized on the host, then copied).
  if (store.space() != memory_space::device || store.compression() != kv_compression::none) {
    store_captured_facts(store, capture, facts);
    return;
  }
  detail::check_captured_facts(store, capture, facts);
  dispatch_dtype(store.store_dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      kv_geometry const g      = store.geometry();
      std::int64_t const ps    = store.page_size();
      std::int64_t const row   = static_cast<std::int64_t>(g.num_kv_heads) * g.head_dim;
      std::int64_t const pages = 2 * static_cast<std::int64_t>(g.num_layers) * ps * row;
      // Pack every fact first (pages zeroed, as a host insert leaves them), then record them all
      // and enqueue the copies: nothing is recorded before all the packing is done.
      std::vector<std::vector<S>> packed(facts.size());
      for (std::size_t i = 0; i < facts.size(); ++i) {
        captured_fact const& f   = facts[i];
        std::int64_t const count = static_cast<std::int64_t>(f.token_ids.size());
        std::vector<S>& out      = packed[i];
        out.assign(static_cast<std::size_t>(store.pages_for(count) * pages), S{});
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          auto const src = kv == 0 ? capture.keys(f.begin, count) : capture.values(f.begin, count);
          for (std::int64_t t = 0; t < count; ++t) {
            std::int64_t const page = t / ps;
            for (std::int32_t l = 0; l < g.num_layers; ++l) {
              S* const dst = out.data() + page * pages + ((l * 2 + kv) * ps + t % ps) * row;
              for (std::int32_t h = 0; h < g.num_kv_heads; ++h) {
                for (std::int32_t e = 0; e < g.head_dim; ++e) {
                  dst[static_cast<std::int64_t>(h) * g.head_dim + e] =
                    from_float<S>(src(l, t, h, e));
                }
              }
            }
          }
        }
      }
      std::size_t recorded = 0;
      try {
        for (std::size_t i = 0; i < facts.size(); ++i) {
          captured_fact const& f    = facts[i];
          fact_record const& record = store.reserve(f.fact_id, f.namespace_id, f.token_ids);
          ++recorded;
          std::size_t const n = record.pages.size();
          for (std::size_t first = 0; first < n;) {
            std::size_t last = first + 1;  // a run of consecutive pool pages: one copy
            while (last < n && record.pages[last] == record.pages[last - 1] + 1) {
              ++last;
            }
            INFERSCALE_CUDA_TRY(
              cudaMemcpyAsync(static_cast<S*>(store.ref().pool) + record.pages[first] * pages,
                              packed[i].data() + static_cast<std::int64_t>(first) * pages,
                              static_cast<std::size_t>((last - first) * pages) * sizeof(S),
                              cudaMemcpyHostToDevice,
                              stream.get()));
            first = last;
          }
        }
      } catch (...) {
        for (std::size_t i = 0; i < recorded; ++i) {
          store.erase(facts[i].fact_id);
        }
        throw;
      }
    }
  });
}

namespace detail {
/**
 * @brief The device capture's finiteness check, before anything is stored: on `stream`, zeroes the
 * capture's fault flags, runs one kernel over every element of K and V of the facts' tokens
 * (capture_check_element: NaN or infinite as captured, or beyond the store dtype's range), copies
 * the flags back and waits for `stream`; then refuses the facts if one of their tokens is flagged
 * (refuse_faulty_facts, engine.hpp). The range list (16 bytes per fact) goes to the device in a
 * stream-ordered allocation, freed on `stream` before the wait.
 * @pre check_captured_ranges passed, `facts` is not empty, the store is a device store
 * @throw logic_error naming the faulty facts (nothing stored); cuda_error on a CUDA failure.
 * @note Waits for `stream` (cudaStreamSynchronize: that stream only, never the device).
 */
inline void check_device_captured_finite(kv_store const& store,
                                         device_kv_capture const& capture,
                                         std::vector<captured_fact> const& facts,
                                         cuda::stream_ref stream)
{
  std::vector<capture_token_range> ranges;
  std::int64_t longest = 0;
  for (captured_fact const& f : facts) {
    auto const count = static_cast<std::int64_t>(f.token_ids.size());
    ranges.push_back({f.begin, count});
    longest = std::max(longest, count);
  }
  std::vector<std::uint32_t> faults(static_cast<std::size_t>(capture.num_tokens()), 0u);
  std::size_t const bytes   = ranges.size() * sizeof(capture_token_range);
  capture_token_range* list = nullptr;
  INFERSCALE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&list), bytes, stream.get()));
  try {
    INFERSCALE_CUDA_TRY(cudaMemsetAsync(
      capture.fault_flags(), 0, faults.size() * sizeof(std::uint32_t), stream.get()));
    INFERSCALE_CUDA_TRY(
      cudaMemcpyAsync(list, ranges.data(), bytes, cudaMemcpyHostToDevice, stream.get()));
    kv_geometry const g = store.geometry();
    capture_check_args const args{capture.keys().data_handle(),
                                  capture.values().data_handle(),
                                  capture.num_tokens(),
                                  g.num_layers,
                                  g.elements_per_token_layer(),
                                  list,
                                  static_cast<std::int64_t>(ranges.size()),
                                  capture.fault_flags()};
    // x covers the longest range's elements (grid-stride), y strides over the ranges, as the
    // scatter's grid.
    std::int64_t const x = std::clamp<std::int64_t>(
      (2 * g.num_layers * longest * args.row_elements + capture_threads - 1) / capture_threads,
      1,
      std::int64_t{1} << 16);
    std::int64_t const y =
      std::clamp<std::int64_t>(std::min(args.num_ranges, (std::int64_t{1} << 20) / x), 1, 65535);
    dim3 const grid{static_cast<unsigned>(x), static_cast<unsigned>(y)};
    dispatch_dtype(store.store_dtype(), [&](auto tag) {
      using S = typename decltype(tag)::type;
      if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                    std::is_same_v<S, bfloat16_t>) {
        capture_check_kernel<S><<<grid, capture_threads, 0, stream.get()>>>(args);
        INFERSCALE_CHECK_LAUNCH();
      }
    });
    INFERSCALE_CUDA_TRY(cudaMemcpyAsync(faults.data(),
                                        capture.fault_flags(),
                                        faults.size() * sizeof(std::uint32_t),
                                        cudaMemcpyDeviceToHost,
                                        stream.get()));
    capture_token_range* const done = list;
    list                            = nullptr;
    INFERSCALE_CUDA_TRY(cudaFreeAsync(done, stream.get()));
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  } catch (...) {
    if (list != nullptr) { (void)cudaFreeAsync(list, stream.get()); }
    throw;
  }
  refuse_faulty_facts(store.store_dtype(), facts, faults);
}
}  // namespace detail

/**
 * @brief Stores token ranges of a device capture as facts of a device store, on the device: one
 * kernel converts the captured fp32 rows to the store dtype and scatters them into the facts'
 * pool pages (a last page's unused rows zeroed, as kv_store::insert leaves them), so the pool
 * ends byte for byte as store_captured_facts(store, capture, facts) leaves it from a host capture
 * of the same values. The K/V never leaves the device; the host sends only the range list (16
 * bytes per fact) and the page list (`(pool page, first captured token, rows)` per page, 24
 * bytes), from pageable memory in stream-ordered allocations, and reads back the fault flags (4
 * bytes per captured token).
 *
 * Every range is checked first on the host (a device store; the capture's geometry the store's;
 * each fact non-empty, inside the capture and completely captured; ids new and distinct; enough
 * free pages for all of them), then on the device, as the host capture's path refuses them: a
 * check kernel flags every fact token with an element that is NaN or infinite in the store dtype
 * (captured so, or beyond the dtype's range), the host waits for `stream` and refuses the facts if
 * one is flagged. A refused call stores nothing (no page reserved, no fact recorded; only the
 * capture's fault flags are rewritten). The facts are in the catalogue when the call returns and
 * their K/V is there for work enqueued after it on `stream`, as for the host-capture overload
 * above (the capture's writes must be ordered before it: the same stream, or an event).
 *
 * @throw logic_error on a refused call: as the host path for a range, and naming the faulty facts
 *        and the first faulty token for a non-finite element (nothing is stored). cuda_error if the
 *        check fails (nothing stored), or if the page list cannot be allocated or copied or the
 *        kernel cannot be launched (the reserved facts are erased again, nothing was written), or
 *        if freeing the page list after the launch fails (the kernel is enqueued then, and the
 *        facts stay stored).
 * @note Synchronises `stream` once (cudaStreamSynchronize, after the check: that stream only,
 *       never the device), so the call returns after the work already on `stream` (the capture's
 *       writes, the engine's forward) has run; the scatter is then enqueued and not waited for.
 *       device_kv_capture::faulty_tokens lists every faulty token the last check found.
 */
inline void store_captured_facts(kv_store& store,
                                 device_kv_capture const& capture,
                                 std::vector<captured_fact> const& facts,
                                 cuda::stream_ref stream)
{
  INFERSCALE_EXPECTS(store.space() == memory_space::device,
                     std::string{"store_captured_facts: a device capture is stored into a device "
                                 "store; this store's pool is in "} +
                       to_string(store.space()) + " memory (a host store takes a kv_capture)");
  INFERSCALE_EXPECTS(store.compression() == kv_compression::none,
                     std::string{"store_captured_facts: the device store is compressed ("} +
                       to_string(store.compression()) +
                       "); the capture's scatter writes uncompressed pools: store a compressed "
                       "fact with kv_store::insert (host or device views), which quantizes it");
  detail::check_captured_ranges(store, capture, facts);
  if (facts.empty()) { return; }
  detail::check_device_captured_finite(store, capture, facts, stream);
  std::size_t recorded               = 0;
  detail::capture_scatter_page* list = nullptr;
  bool launched                      = false;
  try {
    std::vector<detail::capture_scatter_page> pages;
    for (captured_fact const& f : facts) {
      fact_record const& record = store.reserve(f.fact_id, f.namespace_id, f.token_ids);
      ++recorded;
      detail::append_scatter_pages(pages, record, f.begin, store.page_size());
    }
    std::size_t const bytes = pages.size() * sizeof(detail::capture_scatter_page);
    INFERSCALE_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&list), bytes, stream.get()));
    INFERSCALE_CUDA_TRY(
      cudaMemcpyAsync(list, pages.data(), bytes, cudaMemcpyHostToDevice, stream.get()));
    detail::capture_scatter_args const args{store.ref(),
                                            capture.keys().data_handle(),
                                            capture.values().data_handle(),
                                            capture.num_tokens(),
                                            list,
                                            static_cast<std::int64_t>(pages.size())};
    // x covers a page's elements (grid-stride), y strides over the pages: about 2^20 blocks at
    // most.
    std::int64_t const x = std::clamp<std::int64_t>(
      (detail::capture_page_elements(args.store) + detail::capture_threads - 1) /
        detail::capture_threads,
      1,
      std::int64_t{1} << 16);
    std::int64_t const y =
      std::clamp<std::int64_t>(std::min(args.num_pages, (std::int64_t{1} << 20) / x), 1, 65535);
    dim3 const grid{static_cast<unsigned>(x), static_cast<unsigned>(y)};
    dispatch_dtype(store.store_dtype(), [&](auto tag) {
      using S = typename decltype(tag)::type;
      if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                    std::is_same_v<S, bfloat16_t>) {
        detail::capture_scatter_kernel<S><<<grid, detail::capture_threads, 0, stream.get()>>>(args);
        INFERSCALE_CHECK_LAUNCH();
      }
    });
    launched                                 = true;
    detail::capture_scatter_page* const done = list;
    list                                     = nullptr;
    INFERSCALE_CUDA_TRY(cudaFreeAsync(done, stream.get()));
  } catch (...) {
    if (!launched) {
      if (list != nullptr) { (void)cudaFreeAsync(list, stream.get()); }
      for (std::size_t i = 0; i < recorded; ++i) {
        store.erase(facts[i].fact_id);
      }
    }
    throw;
  }
}

// ------------------------------------------------------------------------------------------------
// The device model adapter

namespace detail {
template <class, class = void>
struct is_device_model_adapter : std::false_type {
};
template <class M>
struct is_device_model_adapter<
  M,
  std::void_t<decltype(std::declval<M const&>().geometry()),
              decltype(std::declval<M const&>().rotation()),
              decltype(std::declval<M&>().encode(std::declval<std::vector<std::int32_t> const&>(),
                                                 std::int64_t{},
                                                 std::declval<device_kv_capture&>(),
                                                 std::declval<cuda::stream_ref>()))>>
  : std::is_same<decltype(std::declval<M const&>().geometry()), kv_geometry> {
};
}  // namespace detail

/**
 * @brief True when M provides geometry(), rotation() and encode(tokens, p0, device_kv_capture&,
 * stream): a GPU engine's model adapter, whose hooks write the forward's pre-RoPE K and V into a
 * device capture on `stream` (is_model_adapter_v, engine.hpp, is the host one's).
 */
template <class M>
inline constexpr bool is_device_model_adapter_v = detail::is_device_model_adapter<M>::value;

/**
 * @brief Encodes one token sequence through a device model adapter (one forward at positions
 * `first_position ..`, its hooks writing a device_kv_capture on `stream`) and stores the given
 * token ranges of it as facts of a device store: the device twin of encode_facts(model, store,
 * tokens, first_position, facts) (engine.hpp), with the same checks in the same order, the
 * capture and its store on the device (store_captured_facts with a device capture).
 *
 * A device model adapter `M` has geometry() and rotation() as a model adapter (engine.hpp) and
 *  - `void M::encode(std::vector<std::int32_t> const& tokens, std::int64_t first_position,
 *    device_kv_capture& out, cuda::stream_ref stream)` — runs one forward over `tokens` and
 *    enqueues, ordered before work enqueued after it on `stream`, the writes of every layer's
 *    pre-RoPE K and V of every token to `out` (device_kv_capture::write_keys / write_values).
 *
 * @param model          the device model adapter
 * @param store          a device store; receives the facts (pre-RoPE, any store dtype)
 * @param tokens         the sequence the forward runs over (e.g. context window + facts)
 * @param first_position position of `tokens[0]`
 * @param facts          the ranges to keep; each range's token ids must equal `tokens` there
 * @param stream         the stream the capture is allocated, written, checked and stored on
 * @throw logic_error if a range's token ids differ from the encoded tokens or the store is not a
 *        device store (before the forward runs), or as store_captured_facts (a NaN or an infinity
 *        included); the store is then unchanged. cuda_error on a CUDA failure; whatever the
 *        adapter throws.
 * @note Synchronises `stream` once, as store_captured_facts with a device capture does; the
 *       capture buffer (`8 * layers * tokens * heads * head_dim` bytes) is allocated and freed on
 *       `stream` (stream-ordered).
 */
template <class ModelAdapter>
void encode_facts(ModelAdapter& model,
                  kv_store& store,
                  std::vector<std::int32_t> const& tokens,
                  std::int64_t first_position,
                  std::vector<captured_fact> const& facts,
                  cuda::stream_ref stream)
{
  static_assert(is_device_model_adapter_v<ModelAdapter>,
                "encode_facts: ModelAdapter needs geometry(), rotation() and "
                "encode(tokens, first_position, device_kv_capture&, stream) (see engine.cuh)");
  detail::check_encoded_ranges(tokens, first_position, facts);
  INFERSCALE_EXPECTS(store.space() == memory_space::device,
                     std::string{"encode_facts: a device capture is stored into a device store; "
                                 "this store's pool is in "} +
                       to_string(store.space()) + " memory (a host store takes a kv_capture)");
  device_kv_capture capture{model.geometry(), static_cast<std::int64_t>(tokens.size()), stream};
  model.encode(tokens, first_position, capture, stream);
  store_captured_facts(store, capture, facts, stream);
}

}  // namespace inferscale
