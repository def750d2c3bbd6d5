/**
 * @file engine.hpp
 * @brief The engine seam: what a serving engine supplies to embed the whole pipeline — a *model
 * adapter* (KV geometry, rotation, a capture hook handing over pre-RoPE K and V) and a
 * *paged-cache adapter* (slots for a sequence's next tokens, the cache as a paged_kv_cache, and a
 * commit that makes the injected tokens the engine's own prefix) — plus the generic pieces built
 * on them: the capture buffer a hook fills, storing captured token ranges as facts, the request
 * flow that injects a composition through a cache adapter, and a rope_spec read from GGUF
 * metadata. C++17, host only; no engine is included here.
 *
 * ## The request flow (mirrors vLLM's `KVConnectorBase_V1`)
 *
 * | step | vLLM connector | InferScale |
 * |---|---|---|
 * | how many prompt tokens memory provides | `get_num_new_matched_tokens` | `compose()` →
 * `plan.length()` | | the engine allocates slots for them | `update_state_after_alloc` (block ids)
 * | `cache_adapter.allocate(p0, m)` | | the memory is written into those slots | `start_load_kv` /
 * `wait_for_layer_load` | `inject_host` / `inject_async` into `cache_adapter.cache()` | | the
 * engine adopts them as computed | the scheduler counts them as `num_computed_tokens` |
 * `cache_adapter.commit(m)` | | the engine prefills only the rest | normal prefill of the query |
 * normal prefill of the query |
 *
 * inject_memory_host() runs the middle three steps for one request.
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
 *
 * A paged-cache adapter `C`:
 *  - `std::vector<std::int64_t> C::allocate(std::int64_t first_position, std::int64_t tokens)` —
 *    slots for the sequence's next `tokens` tokens at positions `first_position ..` (staged: the
 *    engine does not see them before commit);
 *  - `paged_kv_cache const& C::cache() const` — the cache the slots address;
 *  - `void C::commit(std::int64_t tokens)` — the engine adopts the staged tokens as its prefix.
 *
 * Capture without a hook: prefill the text normally and read the token range back from the
 * engine's cache with extract_host / extract_async (inject.hpp), which de-rotate the keys.
 */
#pragma once

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/error.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace inferscale {

/**
 * @brief Host buffer a capture hook fills during one encoding forward: pre-RoPE K and V of every
 * layer and token as fp32, `[layers, tokens, heads, head_dim]` contiguous, with a record of which
 * (layer, token) rows were written, so an incomplete capture is refused instead of stored.
 */
class kv_capture {
 public:
  /**
   * @brief A buffer for `num_tokens` tokens of a model with geometry `geometry`.
   * @throw logic_error if the geometry is invalid or `num_tokens` is not positive.
   */
  kv_capture(kv_geometry const& geometry, std::int64_t num_tokens)
    : geometry_{geometry}, num_tokens_{num_tokens}
  {
    geometry.validate();
    INFERSCALE_EXPECTS(
      num_tokens > 0,
      "kv_capture: token count must be positive, got " + std::to_string(num_tokens));
    std::size_t const n = static_cast<std::size_t>(geometry.num_layers) *
                          static_cast<std::size_t>(num_tokens) *
                          static_cast<std::size_t>(geometry.elements_per_token_layer());
    keys_.assign(n, 0.0f);
    values_.assign(n, 0.0f);
    std::size_t const rows =
      static_cast<std::size_t>(geometry.num_layers) * static_cast<std::size_t>(num_tokens);
    key_written_.assign(rows, 0);
    value_written_.assign(rows, 0);
  }

  kv_geometry geometry() const noexcept { return geometry_; }
  std::int64_t num_tokens() const noexcept { return num_tokens_; }

  /**
   * @brief Copies the pre-RoPE keys of tokens `first_token .. first_token + rows.extent(0) - 1` of
   * layer `layer` (`rows` is `[tokens, heads, head_dim]` with any strides, fp32 host memory).
   * @throw logic_error if the layer or token range is outside the buffer or the heads/head_dim
   *        differ from the geometry; nothing is written then.
   */
  void write_keys(std::int32_t layer, std::int64_t first_token, token_head_view<float const> rows)
  {
    write(keys_, key_written_, layer, first_token, rows, "kv_capture::write_keys");
  }

  /// @brief As write_keys, for the values.
  void write_values(std::int32_t layer, std::int64_t first_token, token_head_view<float const> rows)
  {
    write(values_, value_written_, layer, first_token, rows, "kv_capture::write_values");
  }

  /// @brief True when K and V of tokens `[begin, begin + count)` were written in every layer.
  bool complete(std::int64_t begin, std::int64_t count) const noexcept
  {
    if (begin < 0 || count < 0 || begin > num_tokens_ - count) { return false; }
    for (std::int32_t l = 0; l < geometry_.num_layers; ++l) {
      for (std::int64_t t = begin; t < begin + count; ++t) {
        std::size_t const r = row(l, t);
        if (!key_written_[r] || !value_written_[r]) { return false; }
      }
    }
    return true;
  }
  /// @brief True when every token of every layer was written.
  bool complete() const noexcept { return complete(0, num_tokens_); }

  /// @brief Keys of tokens `[begin, begin + count)` as a `[layers, count, heads, head_dim]` view.
  fact_kv_view<float const> keys(std::int64_t begin, std::int64_t count) const
  {
    return slice(keys_, begin, count, "kv_capture::keys");
  }
  /// @brief Values of tokens `[begin, begin + count)`.
  fact_kv_view<float const> values(std::int64_t begin, std::int64_t count) const
  {
    return slice(values_, begin, count, "kv_capture::values");
  }
  fact_kv_view<float const> keys() const { return keys(0, num_tokens_); }
  fact_kv_view<float const> values() const { return values(0, num_tokens_); }

 private:
  std::size_t row(std::int32_t layer, std::int64_t token) const noexcept
  {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_tokens_) +
           static_cast<std::size_t>(token);
  }

  void write(std::vector<float>& dst,
             std::vector<unsigned char>& written,
             std::int32_t layer,
             std::int64_t first_token,
             token_head_view<float const> rows,
             char const* who)
  {
    std::int64_t const count = rows.extent(0);
    INFERSCALE_EXPECTS(layer >= 0 && layer < geometry_.num_layers,
                       std::string{who} + ": layer " + std::to_string(layer) + " is outside [0, " +
                         std::to_string(geometry_.num_layers) + ")");
    INFERSCALE_EXPECTS(first_token >= 0 && count >= 0 && first_token <= num_tokens_ - count,
                       std::string{who} + ": tokens [" + std::to_string(first_token) + ", " +
                         std::to_string(first_token + count) + ") are outside the buffer's " +
                         detail::count_of(num_tokens_, "token"));
    INFERSCALE_EXPECTS(
      rows.extent(1) == geometry_.num_kv_heads && rows.extent(2) == geometry_.head_dim,
      std::string{who} + ": rows of " + detail::count_of(rows.extent(1), "head") + " x " +
        detail::count_of(rows.extent(2), "dim") + ", the geometry has " +
        std::to_string(geometry_.num_kv_heads) + " x " + std::to_string(geometry_.head_dim));
    INFERSCALE_EXPECTS(count == 0 || rows.data_handle() != nullptr,
                       std::string{who} + ": null data");
    std::int64_t const heads = geometry_.num_kv_heads;
    std::int64_t const dim   = geometry_.head_dim;
    for (std::int64_t t = 0; t < count; ++t) {
      float* out = dst.data() + row(layer, first_token + t) * static_cast<std::size_t>(heads * dim);
      for (std::int64_t h = 0; h < heads; ++h) {
        for (std::int64_t d = 0; d < dim; ++d) {
          out[h * dim + d] = rows(t, h, d);
        }
      }
      written[row(layer, first_token + t)] = 1;
    }
  }

  fact_kv_view<float const> slice(std::vector<float> const& src,
                                  std::int64_t begin,
                                  std::int64_t count,
                                  char const* who) const
  {
    INFERSCALE_EXPECTS(begin >= 0 && count > 0 && begin <= num_tokens_ - count,
                       std::string{who} + ": tokens [" + std::to_string(begin) + ", " +
                         std::to_string(begin + count) + ") are not a non-empty range of the " +
                         std::to_string(num_tokens_) + " captured tokens");
    std::int64_t const row_elements = geometry_.elements_per_token_layer();
    return make_fact_kv_view(src.data() + begin * row_elements,
                             geometry_.num_layers,
                             count,
                             geometry_.num_kv_heads,
                             geometry_.head_dim,
                             {num_tokens_ * row_elements, row_elements, geometry_.head_dim, 1});
  }

  kv_geometry geometry_;
  std::int64_t num_tokens_;
  std::vector<float> keys_;
  std::vector<float> values_;
  std::vector<unsigned char> key_written_;
  std::vector<unsigned char> value_written_;
};

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

/**
 * @brief Stores token ranges of a capture as facts (pre-RoPE K and V, converted to the store
 * dtype).
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
                    to_string(store.store_dtype()) + " at layer " + std::to_string(l) +
                    ", token " + std::to_string(t) + ", head " + std::to_string(h) + ", dim " +
                    std::to_string(e) + "; none of the facts is stored");
              }
            }
          }
        }
      }
    }
  });
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

template <class, class = void>
struct is_cache_adapter : std::false_type {
};
template <class C>
struct is_cache_adapter<
  C,
  std::void_t<decltype(std::declval<C&>().allocate(std::int64_t{}, std::int64_t{})),
              decltype(std::declval<C const&>().cache()),
              decltype(std::declval<C&>().commit(std::int64_t{}))>>
  : std::conjunction<
      std::is_convertible<decltype(std::declval<C&>().allocate(std::int64_t{}, std::int64_t{})),
                          std::vector<std::int64_t>>,
      std::is_convertible<decltype(std::declval<C const&>().cache()), paged_kv_cache const&>> {
};
}  // namespace detail

/// @brief True when M provides geometry(), rotation() and encode(tokens, p0, kv_capture&).
template <class M>
inline constexpr bool is_model_adapter_v = detail::is_model_adapter<M>::value;
/// @brief True when C provides allocate(p0, n), cache() and commit(n).
template <class C>
inline constexpr bool is_cache_adapter_v = detail::is_cache_adapter<C>::value;

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
  kv_capture capture{model.geometry(), static_cast<std::int64_t>(tokens.size())};
  model.encode(tokens, first_position, capture);
  store_captured_facts(store, capture, facts);
}

/**
 * @brief One request's memory through a paged-cache adapter, host backend: allocate slots for the
 * plan's `m` tokens at its positions, inject the composed K/V (keys rotated by `rotation`), and
 * commit them as the sequence's prefix. The engine then prefills only the query.
 *
 * @throw logic_error as injection_batch::add and inject_host (unknown fact, too few slots, a slot
 *        outside the cache, geometry or dtype mismatch); nothing is committed then, and the
 *        engine's sequence is unchanged. Whatever the adapter throws.
 */
template <class CacheAdapter, class Rotation>
void inject_memory_host(kv_store const& store,
                        composition const& plan,
                        CacheAdapter& cache_adapter,
                        Rotation const& rotation)
{
  static_assert(is_cache_adapter_v<CacheAdapter>,
                "inject_memory_host: CacheAdapter needs allocate(first_position, tokens), "
                "cache() and commit(tokens) (see engine.hpp)");
  INFERSCALE_EXPECTS(plan.length() > 0, std::string{"inject_memory_host: the plan is empty"});
  std::vector<std::int64_t> const slots =
    cache_adapter.allocate(plan.first_position, plan.length());
  INFERSCALE_EXPECTS(static_cast<std::int64_t>(slots.size()) == plan.length(),
                     "inject_memory_host: the cache adapter allocated " +
                       detail::count_of(static_cast<std::int64_t>(slots.size()), "slot") + " for " +
                       detail::count_of(plan.length(), "token"));
  injection_batch batch{store};
  batch.add(plan, slots);
  inject_host(store, batch, cache_adapter.cache(), rotation);
  cache_adapter.commit(plan.length());
}

// ------------------------------------------------------------------------------------------------
// Rotation and geometry from GGUF metadata

namespace detail {
inline double gguf_number(std::string const& key, std::string const& text)
{
  char* end             = nullptr;
  double const value    = std::strtod(text.c_str(), &end);
  bool const parsed_all = end != text.c_str() && *end == '\0';
  INFERSCALE_EXPECTS(parsed_all && std::isfinite(value),
                     "GGUF metadata " + key + " = '" + text + "' is not a finite number");
  return value;
}

template <class Lookup>
std::optional<double> gguf_optional_number(Lookup const& lookup, std::string const& key)
{
  std::optional<std::string> v = lookup(key);
  if (!v) { return std::nullopt; }
  return gguf_number(key, *v);
}

template <class Lookup>
double gguf_required_number(Lookup const& lookup, std::string const& key)
{
  std::optional<double> v = gguf_optional_number(lookup, key);
  INFERSCALE_EXPECTS(v.has_value(), "GGUF metadata " + key + " is missing");
  return *v;
}

template <class Lookup>
std::string gguf_architecture(Lookup const& lookup)
{
  std::optional<std::string> arch = lookup(std::string{"general.architecture"});
  INFERSCALE_EXPECTS(arch && !arch->empty(),
                     std::string{"GGUF metadata general.architecture is missing"});
  return *arch;
}

inline std::int32_t gguf_positive_int(std::string const& key, double v)
{
  INFERSCALE_EXPECTS(
    v >= 1 && v <= std::numeric_limits<std::int32_t>::max() && v == std::floor(v),
    "GGUF metadata " + key + " = " + std::to_string(v) + " is not a positive integer");
  return static_cast<std::int32_t>(v);
}
}  // namespace detail

/**
 * @brief The KV geometry of a GGUF model from its metadata (`<arch>.block_count`,
 * `<arch>.attention.head_count_kv` (default: head_count), `<arch>.attention.key_length` (default:
 * embedding_length / head_count)).
 *
 * @param lookup callable `std::optional<std::string>(std::string const& key)` returning a metadata
 *        value as text (llama.cpp: `llama_model_meta_val_str`), or nullopt when absent
 * @throw logic_error naming a missing or malformed key, or when K and V head sizes differ.
 */
template <class Lookup>
kv_geometry kv_geometry_from_gguf(Lookup const& lookup)
{
  using namespace detail;
  std::string const arch = gguf_architecture(lookup);
  auto const key         = [&](char const* k) { return arch + "." + k; };
  std::int32_t const layers =
    gguf_positive_int(key("block_count"), gguf_required_number(lookup, key("block_count")));
  std::int32_t const heads = gguf_positive_int(
    key("attention.head_count"), gguf_required_number(lookup, key("attention.head_count")));
  std::optional<double> const kv = gguf_optional_number(lookup, key("attention.head_count_kv"));
  std::int32_t const kv_heads = kv ? gguf_positive_int(key("attention.head_count_kv"), *kv) : heads;
  std::optional<double> const key_length =
    gguf_optional_number(lookup, key("attention.key_length"));
  std::int32_t head_dim{};
  if (key_length) {
    head_dim = gguf_positive_int(key("attention.key_length"), *key_length);
  } else {
    std::int32_t const embd = gguf_positive_int(
      key("embedding_length"), gguf_required_number(lookup, key("embedding_length")));
    INFERSCALE_EXPECTS(embd % heads == 0,
                       "GGUF metadata: embedding_length " + std::to_string(embd) +
                         " is not a multiple of head_count " + std::to_string(heads));
    head_dim = embd / heads;
  }
  if (std::optional<double> const value_length =
        gguf_optional_number(lookup, key("attention.value_length"))) {
    INFERSCALE_EXPECTS(*value_length == head_dim,
                       "GGUF metadata: value_length " + std::to_string(*value_length) +
                         " differs from key_length " + std::to_string(head_dim) +
                         " (K and V heads of different sizes are not supported)");
  }
  kv_geometry g{layers, kv_heads, head_dim};
  g.validate();
  return g;
}

/**
 * @brief The rotation of a GGUF model from its metadata: `<arch>.rope.freq_base` (default 10000,
 * llama.cpp's), `<arch>.rope.dimension_count` (default: head_dim), `<arch>.rope.scaling.type`
 * (none / linear / yarn), `<arch>.rope.scaling.factor` (or the older `rope.scale_linear`),
 * `<arch>.rope.scaling.original_context_length`, `yarn_beta_fast` / `yarn_beta_slow`,
 * `<arch>.context_length`.
 *
 * GGUF does not say which elements pair up: llama.cpp decides by architecture
 * (`llama_model_rope_type`: NORM = adjacent pairs for llama-family GGUFs, whose Q/K rows the
 * converter permuted; NEOX = halves), so the caller passes `pairing`.
 *
 * @note llama3-type scaling is stored by the converter as a `rope_freqs` tensor, not as metadata,
 *       and LongRoPE's factors likewise: those models need the engine's own cos/sin table
 *       (rope_cos_sin_table) — they are refused here rather than rotated wrongly.
 * @throw logic_error on a missing or malformed key, an unsupported scaling type, or a spec that
 *        fails rope_spec::validate().
 */
template <class Lookup>
rope_spec rope_spec_from_gguf(Lookup const& lookup, rope_pairing pairing)
{
  using namespace detail;
  std::string const arch     = gguf_architecture(lookup);
  auto const key             = [&](char const* k) { return arch + "." + k; };
  kv_geometry const geometry = kv_geometry_from_gguf(lookup);
  rope_spec spec{};
  spec.head_dim = geometry.head_dim;
  spec.pairing  = pairing;
  spec.theta    = gguf_optional_number(lookup, key("rope.freq_base")).value_or(10000.0);
  if (std::optional<double> dims = gguf_optional_number(lookup, key("rope.dimension_count"))) {
    spec.rotary_dim = gguf_positive_int(key("rope.dimension_count"), *dims);
    if (spec.rotary_dim == spec.head_dim) { spec.rotary_dim = 0; }
  }
  if (std::optional<double> ctx = gguf_optional_number(lookup, key("context_length"))) {
    spec.max_position = gguf_positive_int(key("context_length"), *ctx);
  }
  INFERSCALE_EXPECTS(!lookup(key("rope.scaling.alpha")),
                     "GGUF metadata " + key("rope.scaling.alpha") +
                       ": NTK-alpha scaling is not supported; pass the engine's cos/sin table");
  std::string type             = lookup(key("rope.scaling.type")).value_or("");
  std::optional<double> factor = gguf_optional_number(lookup, key("rope.scaling.factor"));
  if (!factor) { factor = gguf_optional_number(lookup, key("rope.scale_linear")); }
  if (type.empty()) { type = (factor && *factor != 1.0) ? "linear" : "none"; }
  if (type == "none") {
    spec.scaling = rope_scaling::none;
  } else if (type == "linear") {
    spec.scaling = rope_scaling::linear;
    spec.factor  = factor.value_or(1.0);
  } else if (type == "yarn") {
    spec.scaling               = rope_scaling::yarn;
    spec.factor                = factor.value_or(1.0);
    spec.original_max_position = static_cast<std::int64_t>(
      gguf_required_number(lookup, key("rope.scaling.original_context_length")));
    spec.beta_fast =
      gguf_optional_number(lookup, key("rope.scaling.yarn_beta_fast")).value_or(32.0);
    spec.beta_slow = gguf_optional_number(lookup, key("rope.scaling.yarn_beta_slow")).value_or(1.0);
    INFERSCALE_EXPECTS(!lookup(key("rope.scaling.attn_factor")),
                       "GGUF metadata " + key("rope.scaling.attn_factor") +
                         ": a YaRN attention factor from metadata is not supported; pass the "
                         "engine's cos/sin table");
  } else {
    INFERSCALE_FAIL("GGUF metadata " + key("rope.scaling.type") + " = '" + type +
                    "' is not supported from metadata (llama3 and LongRoPE factors live in "
                    "tensors): pass the engine's cos/sin table");
  }
  spec.validate();
  return spec;
}

}  // namespace inferscale
