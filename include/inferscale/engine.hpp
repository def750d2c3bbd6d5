/**
 * @file engine.hpp
 * @brief The engine seam: what a serving engine supplies to embed the whole pipeline — a *model
 * adapter* (KV geometry, rotation, a capture hook handing over pre-RoPE K and V) and a
 * *paged-cache adapter* (slots for a sequence's next tokens, the cache as a paged_kv_cache, and a
 * commit that makes the injected tokens the engine's own prefix) — plus the generic pieces built
 * on them: storing captured token ranges as facts and the request flow that injects a composition
 * through a cache adapter. The capture buffer a hook fills (kv_capture.hpp) and the rope_spec and
 * kv_geometry read from GGUF metadata (gguf_config.hpp) have their own headers, included here.
 * C++17, host only; no engine is included here.
 *
 * ## The request flow (mirrors vLLM's `KVConnectorBase_V1`)
 *
 * - how many prompt tokens memory provides: vLLM `get_num_new_matched_tokens`; InferScale
 *   `compose()` → `plan.length()`;
 * - the engine allocates slots for them: `update_state_after_alloc` (block ids);
 *   `step.add(plan, cache_adapter)` calls `cache_adapter.allocate(p0, m)`;
 * - the memory is written into those slots: `start_load_kv` / `wait_for_layer_load`;
 *   `step.run(cache_adapter.cache(), rotation)` (host) or `step.run(cache_adapter.cache(),
 *   rotation, device)` with a device_context (device); a failed step calls
 *   `cache_adapter.release(m)` instead of commit (its slots given back);
 * - the engine adopts them as computed: the scheduler counts them as `num_computed_tokens`; the
 *   run calls `cache_adapter.commit(m)`;
 * - the engine prefills only the rest: the normal prefill of the query, in both.
 *
 * The injection step (injection_batch, injection_batch.hpp) runs the middle three steps for every
 * request of a scheduler step (a request alone is a step of one). engine.cuh's store_captured_facts
 * overload stores a capture into a
 * device store on a stream: a GPU engine calls the same functions as a CPU engine, with a
 * workspace and a stream added. A GPU engine's hooks fill a
 * device_kv_capture (kv_capture.cuh) from device rows instead of a kv_capture, so its K/V never
 * goes through the host; encode_facts has a device twin there too (engine.cuh), for a model
 * adapter whose encode fills a device_kv_capture on a stream.
 *
 * ## How engines map onto the two adapters
 *
 * - **vLLM**: the model adapter is a forward hook on each attention layer's `rotary_emb` input
 *   (`positions, q, k`: k there is pre-RoPE, v is the layer's value input), the rotation is
 *   `rotary_emb.cos_sin_cache` (rope_cos_sin_table); the cache adapter is a KV connector whose
 *   allocate() turns the request's block ids into slots (slots_from_block_table), whose cache()
 *   is `make_vllm_flash_attn_cache` / `make_vllm_flashinfer_cache` over `kv_caches`, and whose
 *   commit() returns the matched token count from `get_num_new_matched_tokens`.
 * - **SGLang**: pre-RoPE K at `RadixAttention`'s rotary call; the cache is the
 *   `MHATokenToKVPool` (`make_sglang_cache`, slots are `req_to_token` entries); commit inserts the
 *   memory tokens into the request's prefix length (and keeps them out of the radix tree: composed
 *   blocks are not an exact prefix of any text).
 * - **TensorRT-LLM**: K before `applyRoPE` of the attention plugin (or extraction by de-rotation,
 *   below, where the kernel cannot be hooked); the cache is the KV block pool
 *   (`make_tensorrt_llm_cache`, slots from the sequence's block offsets); commit advances the
 *   sequence's context length by `m` before the context phase of the query.
 * - **llama.cpp** (`examples/engine/llama_cpp/`): the graph callback `cb_eval` captures the input
 * of each layer's `Kcur` ROPE node and `Vcur`; the cache adapter stages a sequence-state blob
 *   (`llama_state_seq_get_data` format) and commits it with `llama_state_seq_set_data`.
 *
 * ## The adapter requirements (checked at compile time by the traits below)
 *
 * A model adapter `M`:
 *  - `kv_geometry M::geometry() const` — layers, KV heads, head_dim of the engine's cache;
 *  - `R M::rotation() const` — `rope_params` or `rope_cos_sin_table<T>`: the engine's rotation;
 *  - `void M::encode(std::vector<std::int32_t> const& tokens, std::int64_t first_position,
 *    kv_capture& out)` — runs one forward over `tokens` at positions `first_position ..` in a
 *    scratch sequence and hands every layer's pre-RoPE K and V of every token to `out`.
 * A GPU engine's model adapter (is_device_model_adapter_v, engine.cuh) has instead, or as well,
 *  - `void M::encode(tokens, first_position, device_kv_capture& out, cuda::stream_ref stream)` —
 *    the same forward, its hooks writing `out` on `stream` (encode_facts with a stream).
 *
 * A paged-cache adapter `C`:
 *  - `std::vector<std::int64_t> C::allocate(std::int64_t first_position, std::int64_t tokens)` —
 *    slots for the sequence's next `tokens` tokens at positions `first_position ..` (staged: the
 *    engine does not see them before commit);
 *  - `paged_kv_cache const& C::cache() const` — the cache the slots address;
 *  - `void C::commit(std::int64_t tokens)` — the engine adopts the staged tokens as its prefix;
 *  - `void C::release(std::int64_t tokens)` — the engine frees the `tokens` slots the last
 *    allocate() staged, uncommitted: the library calls it instead of commit when the step fails
 *    after allocate() (a refused add or run, a failed launch, another request of the step
 *    refused), so a failed step leaves the sequence as it was. It must not throw (the library
 *    drops what it throws: the step's own error reaches the caller).
 *
 * Capture without a hook: prefill the text normally and read the token range back from the
 * engine's cache with extract_host (extract.hpp) / extract (inject.cuh), which de-rotate the keys.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/gguf_config.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/kv_capture.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief A token range of one encoding forward to keep as a fact: tokens `[begin, begin + length)`
 * of the encoded sequence, with their token ids (what the engine's prompt will hold for them).
 */
struct captured_fact {
  std::uint64_t fact_id{};
  std::uint64_t namespace_id{};
  std::int64_t begin{};
  std::vector<std::int32_t> token_ids;  ///< its length is the range's length
};

namespace detail {
/**
 * @brief What store_captured_facts checks of the facts before it stores anything, for a capture
 * of either kind (kv_capture, or device_kv_capture of kv_capture.cuh): the geometry, every range
 * (inside the capture, completely captured, ids new and distinct) and the free pages for all of
 * them.
 */
template <class Capture>
void check_captured_ranges(kv_store const& store,
                           Capture const& capture,
                           std::vector<captured_fact> const& facts)
{
  INFERSCALE_EXPECTS(capture.geometry() == store.geometry(),
                     std::string{"store_captured_facts: the capture's geometry differs from the "
                                 "store's model geometry"});
  std::int64_t pages = 0;
  for (std::size_t i = 0; i < facts.size(); ++i) {
    captured_fact const& f   = facts[i];
    std::int64_t const count = static_cast<std::int64_t>(f.token_ids.size());
    std::string const which  = "store_captured_facts: fact " + std::to_string(f.fact_id);
    INFERSCALE_EXPECTS(count > 0, which + " has no tokens");
    INFERSCALE_EXPECTS(f.begin >= 0 && f.begin <= capture.num_tokens() - count,
                       which + ": tokens [" + std::to_string(f.begin) + ", " +
                         std::to_string(f.begin + count) + ") are outside the " +
                         std::to_string(capture.num_tokens()) + " captured tokens");
    INFERSCALE_EXPECTS(capture.complete(f.begin, count),
                       which +
                         ": the capture hook did not deliver K and V of every layer for "
                         "its tokens");
    INFERSCALE_EXPECTS(!store.contains(f.fact_id), which + " is already stored");
    for (std::size_t j = 0; j < i; ++j) {
      INFERSCALE_EXPECTS(facts[j].fact_id != f.fact_id, which + " appears twice");
    }
    pages += store.pages_for(count);
  }
  INFERSCALE_EXPECTS(pages <= store.free_pages(),
                     "store_captured_facts: the facts need " + detail::count_of(pages, "page") +
                       ", " + std::to_string(store.free_pages()) + " free (capacity exhausted)");
}

/**
 * @brief Everything store_captured_facts checks of a host capture before it stores anything:
 * check_captured_ranges, and every element finite in the store dtype.
 */
inline void check_captured_facts(kv_store const& store,
                                 kv_capture const& capture,
                                 std::vector<captured_fact> const& facts)
{
  check_captured_ranges(store, capture, facts);
  // kv_store::insert refuses NaN, infinities and values beyond the store dtype; check every fact
  // first, so that a model that produced one stores none of them rather than some.
  dispatch_dtype(store.store_dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    for (captured_fact const& f : facts) {
      std::int64_t const count = static_cast<std::int64_t>(f.token_ids.size());
      for (auto const& kv : {capture.keys(f.begin, count), capture.values(f.begin, count)}) {
        for (std::int64_t l = 0; l < kv.extent(0); ++l) {
          for (std::int64_t t = 0; t < kv.extent(1); ++t) {
            for (std::int64_t h = 0; h < kv.extent(2); ++h) {
              for (std::int64_t e = 0; e < kv.extent(3); ++e) {
                float const x = kv(l, t, h, e);
                INFERSCALE_EXPECTS(
                  std::isfinite(x) && std::isfinite(to_float(from_float<S>(x))),
                  "store_captured_facts: fact " + std::to_string(f.fact_id) +
                    " holds a NaN, an infinity or a value beyond the store dtype " +
                    to_string(store.store_dtype()) + " at layer " + std::to_string(l) + ", token " +
                    std::to_string(t) + ", head " + std::to_string(h) + ", dim " +
                    std::to_string(e) + "; none of the facts is stored");
              }
            }
          }
        }
      }
    }
  });
}

/**
 * @brief Refuses the facts when one of their tokens is flagged in `faults` (one flag per captured
 * token, as the device capture's finiteness check leaves them: detail/capture/block.hpp): a
 * logic_error naming the first faulty fact, its first faulty token, and every other faulty fact.
 * Plain host code, so that the host test runs it on flags the check's per-element code computed
 * on the CPU.
 * @pre every fact's range is inside `faults` (check_captured_ranges passed)
 */
inline void refuse_faulty_facts(dtype store_dtype,
                                std::vector<captured_fact> const& facts,
                                std::vector<std::uint32_t> const& faults)
{
  std::string first;
  std::vector<std::uint64_t> others;
  for (captured_fact const& f : facts) {
    auto const count = static_cast<std::int64_t>(f.token_ids.size());
    for (std::int64_t t = 0; t < count; ++t) {
      if (faults[static_cast<std::size_t>(f.begin + t)] == 0u) { continue; }
      if (first.empty()) {
        first = "store_captured_facts: fact " + std::to_string(f.fact_id) +
                " holds a NaN, an infinity or a value beyond the store dtype " +
                to_string(store_dtype) + " at token " + std::to_string(t) + " (captured token " +
                std::to_string(f.begin + t) + ")";
      } else {
        others.push_back(f.fact_id);
      }
      break;
    }
  }
  std::string also;
  for (std::size_t i = 0; i < others.size(); ++i) {
    also += (i == 0 ? (others.size() == 1 ? "; so does fact " : "; so do facts ") : ", ") +
            std::to_string(others[i]);
  }
  INFERSCALE_EXPECTS(first.empty(), first + also + "; none of the facts is stored");
}

/**
 * @brief What encode_facts checks before the forward runs: tokens to encode, a non-negative first
 * position, every fact's range inside the tokens with the encoded token ids there.
 */
inline void check_encoded_ranges(std::vector<std::int32_t> const& tokens,
                                 std::int64_t first_position,
                                 std::vector<captured_fact> const& facts)
{
  INFERSCALE_EXPECTS(!tokens.empty(), std::string{"encode_facts: no tokens to encode"});
  INFERSCALE_EXPECTS(
    first_position >= 0,
    "encode_facts: first position must be non-negative, got " + std::to_string(first_position));
  for (captured_fact const& f : facts) {
    auto const n = static_cast<std::int64_t>(f.token_ids.size());
    INFERSCALE_EXPECTS(
      f.begin >= 0 && n > 0 && f.begin <= static_cast<std::int64_t>(tokens.size()) - n,
      "encode_facts: fact " + std::to_string(f.fact_id) + " range [" + std::to_string(f.begin) +
        ", " + std::to_string(f.begin + n) + ") is outside the " + std::to_string(tokens.size()) +
        " encoded tokens");
    INFERSCALE_EXPECTS(std::equal(f.token_ids.begin(), f.token_ids.end(), tokens.begin() + f.begin),
                       "encode_facts: fact " + std::to_string(f.fact_id) +
                         "'s token ids differ from the encoded tokens at its range");
  }
}
}  // namespace detail

/**
 * @brief Stores token ranges of a capture as facts (pre-RoPE K and V, converted to the store
 * dtype), in a store of any memory space (a device pool is written with synchronous copies; a GPU
 * engine passes its stream to the overload in engine.cuh instead).
 *
 * Every range is checked first (inside the capture and completely captured, ids new and
 * distinct, enough free pages for all of them, every element finite in the store dtype), so a
 * refused call stores none of them.
 * @throw logic_error naming the first problem; the store is then unchanged.
 */
inline void store_captured_facts(kv_store& store,
                                 kv_capture const& capture,
                                 std::vector<captured_fact> const& facts)
{
  detail::check_captured_facts(store, capture, facts);
  for (captured_fact const& f : facts) {
    std::int64_t const count = static_cast<std::int64_t>(f.token_ids.size());
    store.insert<float>(f.fact_id,
                        f.namespace_id,
                        f.token_ids,
                        capture.keys(f.begin, count),
                        capture.values(f.begin, count));
  }
}

// ------------------------------------------------------------------------------------------------
// Adapter traits

namespace detail {
template <class, class = void>
struct is_model_adapter : std::false_type {
};
template <class M>
struct is_model_adapter<
  M,
  std::void_t<decltype(std::declval<M const&>().geometry()),
              decltype(std::declval<M const&>().rotation()),
              decltype(std::declval<M&>().encode(std::declval<std::vector<std::int32_t> const&>(),
                                                 std::int64_t{},
                                                 std::declval<kv_capture&>()))>>
  : std::is_same<decltype(std::declval<M const&>().geometry()), kv_geometry> {
};

}  // namespace detail

/// @brief True when M provides geometry(), rotation() and encode(tokens, p0, kv_capture&).
template <class M>
inline constexpr bool is_model_adapter_v = detail::is_model_adapter<M>::value;
// is_cache_adapter_v (allocate(p0, n), cache(), commit(n)) is in injection_batch.hpp: the
// injection step takes cache adapters.

/**
 * @brief Encodes one token sequence through a model adapter (one forward at positions
 * `first_position ..`) and stores the given token ranges of it as facts.
 *
 * @param model          the model adapter
 * @param store          receives the facts (pre-RoPE, any store dtype)
 * @param tokens         the sequence the forward runs over (e.g. context window + facts)
 * @param first_position position of `tokens[0]`
 * @param facts          the ranges to keep; each range's token ids must equal `tokens` there
 * @throw logic_error if a range's token ids differ from the encoded tokens, or as
 *        store_captured_facts; the store is then unchanged. Whatever the adapter throws.
 */
template <class ModelAdapter>
void encode_facts(ModelAdapter& model,
                  kv_store& store,
                  std::vector<std::int32_t> const& tokens,
                  std::int64_t first_position,
                  std::vector<captured_fact> const& facts)
{
  static_assert(is_model_adapter_v<ModelAdapter>,
                "encode_facts: ModelAdapter needs geometry(), rotation() and "
                "encode(tokens, first_position, kv_capture&) (see engine.hpp)");
  detail::check_encoded_ranges(tokens, first_position, facts);
  kv_capture capture{model.geometry(), static_cast<std::int64_t>(tokens.size())};
  model.encode(tokens, first_position, capture);
  store_captured_facts(store, capture, facts);
}

}  // namespace inferscale
