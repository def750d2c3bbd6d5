/**
 * @file llama_adapter.hpp
 * @brief The reference engine adapter: InferScale's engine seam (inferscale/engine.hpp) for an
 * unmodified llama.cpp (CPU backend), host backend of the library.
 *
 *  - model_adapter: the KV geometry and rotation from the GGUF metadata, the rotation as
 *    llama.cpp forms it (make_ggml_rope_table), and pre-RoPE capture through llama.cpp's graph
 *    callback (`cb_eval`): each layer's `Kcur-<l>` node that feeds the ROPE node (its input,
 *    checked against the ROPE node's `src[0]`) and `Vcur-<l>`.
 *  - sequence_cache: the paged-cache adapter. It stages a sequence-state blob in llama.cpp's
 *    format (`llama_state_seq_get_data`: src/llama-context.cpp and src/llama-kv-cache.cpp of this
 *    version), describes its K and V rows as a paged_kv_cache for inject_host, and commits it with
 *    `llama_state_seq_set_data`: the injected tokens become the sequence's own prefix.
 *  - context: a llama_context with the few calls the examples, tests and benchmarks need
 *    (decode at explicit positions, greedy generation, sequence states).
 *
 * The blob format the context expects (streams, V transposition, layer count, cell types and row
 * sizes) is read from the engine itself when the context is made (a one-token probe in a
 * scratch sequence), and every blob read or written is checked against it.
 */
#pragma once

#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>

#include <ggml-backend.h>
#include <ggml.h>
#include <llama.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

/// @brief llama.cpp refused or failed a call (the message says which and why).
struct engine_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// @brief Silences llama.cpp's log (errors still print to stderr).
inline void quiet_logs()
{
  llama_log_set(
    [](ggml_log_level level, char const* text, void*) {
      if (level == GGML_LOG_LEVEL_ERROR) { std::fputs(text, stderr); }
    },
    nullptr);
}

// ------------------------------------------------------------------------------------------------
// Model

/// @brief A loaded GGUF model (move-only owner of a llama_model).
class model {
 public:
  /// @throw engine_error if the file cannot be opened or loaded.
  explicit model(std::string const& path)
  {
    if (FILE* f = std::fopen(path.c_str(), "rb")) {
      std::fclose(f);
    } else {
      throw engine_error("llama_cpp::model: cannot open the model file '" + path + "'");
    }
    llama_model_params params = llama_model_default_params();
    params.n_gpu_layers       = 0;
    model_.reset(llama_model_load_from_file(path.c_str(), params));
    if (!model_) {
      throw engine_error("llama_cpp::model: llama.cpp could not load '" + path + "'");
    }
  }

  llama_model* get() const noexcept { return model_.get(); }
  llama_vocab const* vocab() const noexcept { return llama_model_get_vocab(model_.get()); }
  std::int32_t vocab_size() const noexcept { return llama_vocab_n_tokens(vocab()); }

  /// @brief A metadata value as text, or nullopt.
  std::optional<std::string> meta(std::string const& key) const
  {
    std::int32_t const n = llama_model_meta_val_str(model_.get(), key.c_str(), nullptr, 0);
    if (n < 0) { return std::nullopt; }
    std::string out(static_cast<std::size_t>(n) + 1, '\0');
    llama_model_meta_val_str(model_.get(), key.c_str(), out.data(), out.size());
    out.resize(static_cast<std::size_t>(n));
    return out;
  }

  /// @brief The KV geometry from the GGUF metadata, cross-checked against llama.cpp's own counts.
  kv_geometry geometry() const
  {
    kv_geometry const g = kv_geometry_from_gguf([this](std::string const& k) { return meta(k); });
    if (g.num_layers != llama_model_n_layer(model_.get()) ||
        g.num_kv_heads != llama_model_n_head_kv(model_.get())) {
      throw engine_error(
        "llama_cpp::model: GGUF metadata and llama.cpp disagree on layers or "
        "KV heads");
    }
    return g;
  }

  /// @brief The rotation from the GGUF metadata, paired as llama.cpp pairs this architecture.
  rope_spec rotation_spec() const
  {
    llama_rope_type const type = llama_model_rope_type(model_.get());
    rope_pairing pairing{};
    if (type == LLAMA_ROPE_TYPE_NORM) {
      pairing = rope_pairing::interleaved;  // adjacent pairs (2i, 2i+1)
    } else if (type == LLAMA_ROPE_TYPE_NEOX) {
      pairing = rope_pairing::halves;
    } else {
      throw engine_error("llama_cpp::model: rope type " + std::to_string(type) +
                         " (M-RoPE, vision or none) is not supported");
    }
    return rope_spec_from_gguf([this](std::string const& k) { return meta(k); }, pairing);
  }

  /// @brief Token ids of `text` (special tokens such as `<|im_start|>` parsed; no BOS added).
  std::vector<std::int32_t> tokenize(std::string const& text) const
  {
    std::int32_t n = -llama_tokenize(vocab(),
                                     text.data(),
                                     static_cast<std::int32_t>(text.size()),
                                     nullptr,
                                     0,
                                     /*add_special*/ false,
                                     /*parse_special*/ true);
    std::vector<llama_token> out(static_cast<std::size_t>(std::max(n, 0)));
    if (n > 0 && llama_tokenize(vocab(),
                                text.data(),
                                static_cast<std::int32_t>(text.size()),
                                out.data(),
                                n,
                                false,
                                true) != n) {
      throw engine_error("llama_cpp::model: tokenization failed");
    }
    return {out.begin(), out.end()};
  }

  /// @brief The text of `tokens` (special tokens rendered).
  std::string detokenize(std::vector<std::int32_t> const& tokens) const
  {
    std::string out;
    char buf[256];
    for (std::int32_t t : tokens) {
      std::int32_t const n = llama_token_to_piece(vocab(), t, buf, sizeof(buf), 0, true);
      if (n > 0) { out.append(buf, static_cast<std::size_t>(n)); }
    }
    return out;
  }

  bool is_end_of_generation(std::int32_t token) const noexcept
  {
    return llama_vocab_is_eog(vocab(), token);
  }

 private:
  struct deleter {
    void operator()(llama_model* m) const noexcept { llama_model_free(m); }
  };
  std::unique_ptr<llama_model, deleter> model_;
};

/**
 * @brief The cos/sin table llama.cpp's CPU rope forms (`ggml_rope_cache_init`, `rope_yarn`):
 * the angle of pair i at position p is a running fp32 product starting at `float(p)` and
 * multiplied by `theta_scale = powf(base, -2/n_dims)` once per pair, scaled by `freq_scale`, then
 * `cosf`/`sinf` in fp32. Rows `0 .. rows-1` in rope_cos_sin_table layout
 * (`[cos_0 .. cos_{n-1} | sin_0 .. sin_{n-1}]`).
 *
 * @throw engine_error for YaRN (its extrapolation mix is not reproduced here) or non-positive rows.
 */
inline std::vector<float> make_ggml_rope_table(rope_spec const& spec, std::int64_t rows)
{
  spec.validate();
  if (spec.scaling != rope_scaling::none && spec.scaling != rope_scaling::linear) {
    throw engine_error("make_ggml_rope_table: only unscaled and linear rope are reproduced");
  }
  if (rows <= 0) { throw engine_error("make_ggml_rope_table: rows must be positive"); }
  std::int32_t const n_dims = spec.effective_rotary_dim();
  std::int32_t const pairs  = n_dims / 2;
  float const freq_base     = static_cast<float>(spec.theta);
  float const freq_scale    = static_cast<float>(1.0 / spec.factor);
  float const theta_scale   = std::pow(freq_base, -2.0f / static_cast<float>(n_dims));
  std::vector<float> table(static_cast<std::size_t>(rows) * static_cast<std::size_t>(n_dims));
  for (std::int64_t p = 0; p < rows; ++p) {
    float theta = static_cast<float>(p);
    float* row  = table.data() + p * n_dims;
    for (std::int32_t i = 0; i < pairs; ++i) {
      float const angle = freq_scale * theta;
      row[i]            = std::cos(angle);
      row[pairs + i]    = std::sin(angle);
      theta *= theta_scale;
    }
  }
  return table;
}

// ------------------------------------------------------------------------------------------------
// The sequence-state blob

/// @brief What a context's sequence-state blobs look like (read from the engine by a probe).
struct state_format {
  std::uint32_t n_stream{};
  std::uint32_t v_trans{};
  std::uint32_t n_layer{};
  std::int32_t k_type{};
  std::int32_t v_type{};
  std::uint64_t k_row_bytes{};
  std::uint64_t v_row_bytes{};  ///< v_trans == 0
  std::uint32_t v_el_bytes{};   ///< v_trans == 1
  std::uint32_t n_embd_v{};     ///< v_trans == 1: elements per token row of V

  bool operator==(state_format const& o) const noexcept
  {
    return n_stream == o.n_stream && v_trans == o.v_trans && n_layer == o.n_layer &&
           k_type == o.k_type && v_type == o.v_type && k_row_bytes == o.k_row_bytes &&
           v_row_bytes == o.v_row_bytes && v_el_bytes == o.v_el_bytes && n_embd_v == o.n_embd_v;
  }
};

/// @brief Where the parts of one blob lie (byte offsets into it).
struct state_layout {
  state_format format{};
  std::int32_t seq_id{};
  std::uint32_t stream{};      ///< the one stream holding cells
  std::uint32_t cell_count{};  ///< cells (tokens) of the sequence
  std::vector<std::int32_t> positions;
  std::vector<std::size_t> key_rows;    ///< per layer: offset of its first K row
  std::vector<std::size_t> value_rows;  ///< per layer: offset of its first V row (or V element)
  std::size_t size{};                   ///< bytes in all
};

inline constexpr std::uint32_t state_magic = 0xaf143cd8u;  ///< llama-context.cpp `io_magic`

namespace detail {
struct reader {
  std::uint8_t const* data;
  std::size_t size;
  std::size_t at{0};
  template <class T>
  T get(char const* what)
  {
    if (size - at < sizeof(T)) {
      throw engine_error(std::string{"sequence state: truncated at "} + what + " (byte " +
                         std::to_string(at) + " of " + std::to_string(size) + ")");
    }
    T v;
    std::memcpy(&v, data + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  void skip(std::uint64_t bytes, char const* what)
  {
    if (bytes > size - at) {
      throw engine_error(std::string{"sequence state: truncated in "} + what + " (needs " +
                         std::to_string(bytes) + " bytes at " + std::to_string(at) + ", " +
                         std::to_string(size - at) + " left)");
    }
    at += static_cast<std::size_t>(bytes);
  }
};

inline dtype cache_dtype_of(std::int32_t ggml_type_id)
{
  switch (ggml_type_id) {
    case GGML_TYPE_F32: return dtype::float32;
    case GGML_TYPE_F16: return dtype::float16;
    case GGML_TYPE_BF16: return dtype::bfloat16;
    default:
      throw engine_error("sequence state: cell type " + std::to_string(ggml_type_id) + " (" +
                         ggml_type_name(static_cast<ggml_type>(ggml_type_id)) +
                         ") is not supported (f32, f16, bf16 are)");
  }
}

}  // namespace detail

/**
 * @brief Parses a sequence-state blob, checking everything: magic, one non-empty stream, cells of
 * exactly one sequence without the M-RoPE cell extension, the V transposition, the layer count,
 * supported cell types with the row sizes `geometry` implies, and that the blob ends where its
 * contents do. With `expected`, the format must equal it.
 * @throw engine_error naming the first problem.
 */
inline state_layout parse_state(std::uint8_t const* data,
                                std::size_t size,
                                kv_geometry const& geometry,
                                state_format const* expected = nullptr)
{
  detail::reader in{data, size};
  state_layout out;
  std::uint32_t const magic = in.get<std::uint32_t>("magic");
  if (magic != state_magic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "0x%08x (expected 0x%08x)", magic, state_magic);
    throw engine_error(std::string{"sequence state: unknown magic "} + buf);
  }
  out.seq_id          = in.get<std::int32_t>("seq_id");
  out.format.n_stream = in.get<std::uint32_t>("n_stream");
  if (out.format.n_stream == 0 || out.format.n_stream > 4096) {
    throw engine_error("sequence state: implausible stream count " +
                       std::to_string(out.format.n_stream));
  }
  std::uint64_t const row_elements =
    static_cast<std::uint64_t>(geometry.elements_per_token_layer());
  bool seen = false;
  for (std::uint32_t s = 0; s < out.format.n_stream; ++s) {
    std::uint32_t const cells = in.get<std::uint32_t>("cell_count");
    if (cells == 0) { continue; }
    if (seen) { throw engine_error("sequence state: more than one stream holds cells"); }
    seen           = true;
    out.stream     = s;
    out.cell_count = cells;
    out.positions.resize(cells);
    for (std::uint32_t c = 0; c < cells; ++c) {
      out.positions[c]             = in.get<std::int32_t>("cell position");
      std::uint32_t const n_seq_id = in.get<std::uint32_t>("cell n_seq_id");
      if (n_seq_id != 1) {
        throw engine_error("sequence state: cell " + std::to_string(c) + " belongs to " +
                           std::to_string(n_seq_id) + " sequences (one expected)");
      }
      (void)in.get<std::int32_t>("cell seq_id");
    }
    out.format.v_trans = in.get<std::uint32_t>("v_trans");
    if (out.format.v_trans > 1) {
      throw engine_error("sequence state: V transposition flag " +
                         std::to_string(out.format.v_trans) +
                         " (the cells may carry an M-RoPE extension, which is not supported)");
    }
    out.format.n_layer = in.get<std::uint32_t>("n_layer");
    if (out.format.n_layer != static_cast<std::uint32_t>(geometry.num_layers)) {
      throw engine_error("sequence state: " + std::to_string(out.format.n_layer) +
                         " layers, the model has " + std::to_string(geometry.num_layers));
    }
    for (std::uint32_t l = 0; l < out.format.n_layer; ++l) {
      std::int32_t const type  = in.get<std::int32_t>("k_type");
      std::uint64_t const rows = in.get<std::uint64_t>("k_row_bytes");
      dtype const t            = detail::cache_dtype_of(type);
      if (rows != row_elements * size_of(t)) {
        throw engine_error("sequence state: layer " + std::to_string(l) + " K rows of " +
                           std::to_string(rows) + " bytes, expected " +
                           std::to_string(row_elements * size_of(t)));
      }
      if (l > 0 && (type != out.format.k_type || rows != out.format.k_row_bytes)) {
        throw engine_error("sequence state: layers with different K cell types");
      }
      out.format.k_type      = type;
      out.format.k_row_bytes = rows;
      out.key_rows.push_back(in.at);
      in.skip(rows * cells, "K rows");
    }
    for (std::uint32_t l = 0; l < out.format.n_layer; ++l) {
      std::int32_t const type = in.get<std::int32_t>("v_type");
      dtype const t           = detail::cache_dtype_of(type);
      if (l > 0 && type != out.format.v_type) {
        throw engine_error("sequence state: layers with different V cell types");
      }
      out.format.v_type = type;
      if (out.format.v_trans == 0) {
        std::uint64_t const rows = in.get<std::uint64_t>("v_row_bytes");
        if (rows != row_elements * size_of(t)) {
          throw engine_error("sequence state: layer " + std::to_string(l) + " V rows of " +
                             std::to_string(rows) + " bytes, expected " +
                             std::to_string(row_elements * size_of(t)));
        }
        out.format.v_row_bytes = rows;
        out.value_rows.push_back(in.at);
        in.skip(rows * cells, "V rows");
      } else {
        std::uint32_t const el = in.get<std::uint32_t>("v_el_bytes");
        std::uint32_t const n  = in.get<std::uint32_t>("n_embd_v_gqa");
        if (el != size_of(t) || n != row_elements) {
          throw engine_error("sequence state: layer " + std::to_string(l) + " transposed V of " +
                             std::to_string(n) + " x " + std::to_string(el) +
                             "-byte elements, expected " + std::to_string(row_elements) + " x " +
                             std::to_string(size_of(t)));
        }
        out.format.v_el_bytes = el;
        out.format.n_embd_v   = n;
        out.value_rows.push_back(in.at);
        in.skip(static_cast<std::uint64_t>(el) * n * cells, "transposed V");
      }
    }
  }
  if (!seen) { throw engine_error("sequence state: no stream holds cells (empty sequence)"); }
  if (in.at != size) {
    throw engine_error("sequence state: " + std::to_string(size - in.at) +
                       " trailing bytes after the contents");
  }
  if (expected && !(out.format == *expected)) {
    throw engine_error(
      "sequence state: the blob's format (streams " + std::to_string(out.format.n_stream) +
      ", v_trans " + std::to_string(out.format.v_trans) + ", K type " +
      std::to_string(out.format.k_type) + ", V type " + std::to_string(out.format.v_type) +
      ") differs from the context's (streams " + std::to_string(expected->n_stream) + ", v_trans " +
      std::to_string(expected->v_trans) + ", K type " + std::to_string(expected->k_type) +
      ", V type " + std::to_string(expected->v_type) + ")");
  }
  out.size = size;
  return out;
}

/**
 * @brief Lays out in `out` a blob of `positions.size()` cells of sequence `seq_id` at those
 * positions, in `format`; `layout` receives where its rows lie. The K and V rows are not cleared
 * (bytes `out` already held stay, new bytes are zero): injection overwrites every row, and reusing
 * one buffer per sequence keeps a request from allocating and zeroing megabytes.
 */
inline void make_state(state_format const& format,
                       kv_geometry const& geometry,
                       std::int32_t seq_id,
                       std::vector<std::int32_t> const& positions,
                       state_layout& layout,
                       std::vector<std::uint8_t>& out)
{
  if (positions.empty()) { throw engine_error("make_state: no cells"); }
  std::uint32_t const cells = static_cast<std::uint32_t>(positions.size());
  std::uint64_t const row_elements =
    static_cast<std::uint64_t>(geometry.elements_per_token_layer());
  std::uint64_t const v_bytes =
    format.v_trans ? std::uint64_t{format.v_el_bytes} * row_elements : format.v_row_bytes;
  std::uint64_t const v_header = 12;  // type + (u64 row bytes | u32 element bytes + u32 n_embd)
  std::size_t const total      = 12 + 4 * format.n_stream + 12 * std::size_t{cells} + 8 +
                            format.n_layer * (12 + format.k_row_bytes * cells) +
                            format.n_layer * (v_header + v_bytes * cells);
  out.resize(total);
  std::size_t at = 0;
  auto const put = [&](auto v) {
    std::memcpy(out.data() + at, &v, sizeof(v));
    at += sizeof(v);
  };
  layout            = state_layout{};
  layout.format     = format;
  layout.seq_id     = seq_id;
  layout.stream     = 0;
  layout.cell_count = cells;
  layout.positions  = positions;
  put(state_magic);
  put(seq_id);
  put(format.n_stream);
  for (std::uint32_t s = 0; s < format.n_stream; ++s) {
    put(s == 0 ? cells : std::uint32_t{0});
    if (s != 0) { continue; }
    for (std::int32_t p : positions) {
      put(p);
      put(std::uint32_t{1});
      put(seq_id);
    }
    put(format.v_trans);
    put(format.n_layer);
    for (std::uint32_t l = 0; l < format.n_layer; ++l) {
      put(format.k_type);
      put(format.k_row_bytes);
      layout.key_rows.push_back(at);
      at += static_cast<std::size_t>(format.k_row_bytes * cells);
    }
    for (std::uint32_t l = 0; l < format.n_layer; ++l) {
      put(format.v_type);
      if (format.v_trans == 0) {
        put(format.v_row_bytes);
      } else {
        put(format.v_el_bytes);
        put(format.n_embd_v);
      }
      layout.value_rows.push_back(at);
      at += static_cast<std::size_t>(v_bytes * cells);
    }
  }
  if (at != total) { throw engine_error("make_state: internal size mismatch"); }
  layout.size = total;
}

/**
 * @brief The K and V rows of a blob as a paged_kv_cache (one block of `cell_count` slots; slot j
 * is cell j). K: `[cell][head][dim]`; V likewise, or transposed `[head*dim][cell]` when v_trans.
 */
inline paged_kv_cache describe_state(std::uint8_t* blob,
                                     state_layout const& layout,
                                     kv_geometry const& geometry)
{
  dtype const k_dtype = detail::cache_dtype_of(layout.format.k_type);
  dtype const v_dtype = detail::cache_dtype_of(layout.format.v_type);
  if (k_dtype != v_dtype) {
    throw engine_error("sequence state: K and V cells of different types are not supported");
  }
  std::int64_t const cells = layout.cell_count;
  std::int32_t const heads = geometry.num_kv_heads;
  std::int32_t const dim   = geometry.head_dim;
  paged_kv_layout key{};
  key.num_blocks        = 1;
  key.block_size        = static_cast<std::int32_t>(cells);
  key.num_heads         = heads;
  key.head_dim          = dim;
  key.block_stride      = 0;
  key.token_stride      = static_cast<std::int64_t>(heads) * dim;
  key.head_stride       = dim;
  key.dim_stride        = 1;
  key.dim_chunk         = dim;
  key.chunk_stride      = 0;
  paged_kv_layout value = key;
  if (layout.format.v_trans) {
    value.token_stride = 1;
    value.head_stride  = static_cast<std::int64_t>(dim) * cells;
    value.dim_stride   = cells;
  }
  std::vector<void*> keys, values;
  for (std::size_t l = 0; l < layout.key_rows.size(); ++l) {
    keys.push_back(blob + layout.key_rows[l]);
    values.push_back(blob + layout.value_rows[l]);
  }
  return make_paged_kv_cache(k_dtype, keys, values, key, value);
}

// ------------------------------------------------------------------------------------------------
// Context

/// @brief How a context is made.
struct context_options {
  std::uint32_t n_ctx{2048};
  std::uint32_t n_batch{512};
  std::int32_t n_threads{1};   ///< one thread: 2 OpenMP threads on shared cores can collapse
  bool flash_attention{true};  ///< on: V rows as tokens; off: V stored transposed
  std::uint32_t n_seq_max{2};  ///< the last sequence is the adapter's scratch sequence
  /// Extra sequences (ids n_seq_max .. n_seq_max + n_branch_seq - 1) for model_adapter's
  /// encode_branches: that many facts branch off a trunk per forward; 0 = no branching.
  std::uint32_t n_branch_seq{0};
};

/**
 * @brief A llama_context with capture support (owner; not movable, the graph callback holds its
 * address).
 */
class context {
 public:
  context(model const& m, context_options const& options = {})
    : model_{&m}, options_{options}, geometry_{m.geometry()}
  {
    if (options.n_seq_max < 2) {
      throw engine_error("llama_cpp::context: n_seq_max must be at least 2 (one scratch sequence)");
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx                = options.n_ctx;
    params.n_batch              = options.n_batch;
    params.n_ubatch             = options.n_batch;
    if (options.n_seq_max + options.n_branch_seq > 256) {  // LLAMA_MAX_SEQ in llama-cparams.h
      throw engine_error("llama_cpp::context: n_seq_max + n_branch_seq = " +
                         std::to_string(options.n_seq_max + options.n_branch_seq) +
                         " exceeds llama.cpp's 256 sequences");
    }
    params.n_seq_max            = options.n_seq_max + options.n_branch_seq;
    params.n_threads            = options.n_threads;
    params.n_threads_batch      = options.n_threads;
    params.flash_attn_type =
      options.flash_attention ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    params.kv_unified        = true;
    params.cb_eval           = &context::eval_callback;
    params.cb_eval_user_data = this;
    params.no_perf           = true;
    ctx_.reset(llama_init_from_model(m.get(), params));
    if (!ctx_) { throw engine_error("llama_cpp::context: llama_init_from_model failed"); }
    probe_format();
  }
  context(context const&)            = delete;
  context& operator=(context const&) = delete;

  llama_context* get() const noexcept { return ctx_.get(); }
  model const& owner() const noexcept { return *model_; }
  kv_geometry geometry() const noexcept { return geometry_; }
  state_format const& format() const noexcept { return format_; }
  context_options const& options() const noexcept { return options_; }
  std::int32_t scratch_sequence() const noexcept
  {
    return static_cast<std::int32_t>(options_.n_seq_max) - 1;
  }

  /// @brief First of the options().n_branch_seq branch sequences.
  std::int32_t first_branch_sequence() const noexcept
  {
    return static_cast<std::int32_t>(options_.n_seq_max);
  }

  /// @brief Sequence `to` gets the cells of `from` at positions [p0, p1) (shared, not copied: the
  /// cache is unified).
  void copy_sequence(std::int32_t from, std::int32_t to, std::int64_t p0, std::int64_t p1)
  {
    llama_memory_seq_cp(llama_get_memory(ctx_.get()), from, to, static_cast<llama_pos>(p0),
                        static_cast<llama_pos>(p1));
  }

  /**
   * @brief One llama_decode of tokens of several sequences: token i of `seqs[i]` at
   * `positions[i]` (at most n_batch tokens); logits for the last token only.
   * @throw engine_error if llama.cpp refuses the batch or the capture hook failed.
   */
  void decode_tokens(std::vector<std::int32_t> const& tokens,
                     std::vector<std::int64_t> const& positions,
                     std::vector<std::int32_t> const& seqs)
  {
    std::size_t const n = tokens.size();
    if (n == 0 || positions.size() != n || seqs.size() != n || n > options_.n_batch) {
      throw engine_error("llama_cpp::context::decode_tokens: " + std::to_string(n) +
                         " tokens (at most n_batch = " + std::to_string(options_.n_batch) +
                         ", one position and sequence each)");
    }
    llama_batch batch = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
    batch.n_tokens    = static_cast<std::int32_t>(n);
    for (std::size_t i = 0; i < n; ++i) {
      batch.token[i]     = tokens[i];
      batch.pos[i]       = static_cast<llama_pos>(positions[i]);
      batch.n_seq_id[i]  = 1;
      batch.seq_id[i][0] = seqs[i];
      batch.logits[i]    = i + 1 == n ? 1 : 0;
    }
    run_batch(batch, "a batch of " + std::to_string(n) + " tokens of several sequences");
  }

  /// @brief Removes every cell of sequence `seq`.
  void clear(std::int32_t seq) { llama_memory_seq_rm(llama_get_memory(ctx_.get()), seq, -1, -1); }

  /// @brief Highest position held by `seq` (-1 when empty).
  std::int32_t max_position(std::int32_t seq) const
  {
    return llama_memory_seq_pos_max(llama_get_memory(ctx_.get()), seq);
  }

  /**
   * @brief Runs `tokens` of sequence `seq` at positions `first_position ..` (one llama_decode,
   * split into ubatches by llama.cpp); logits are kept for the last token.
   * @throw engine_error if llama.cpp refuses the batch or the capture hook failed.
   */
  void decode(std::int32_t seq,
              std::vector<std::int32_t> const& tokens,
              std::int64_t first_position)
  {
    if (tokens.empty()) { throw engine_error("llama_cpp::context::decode: no tokens"); }
    std::size_t done = 0;
    while (done < tokens.size()) {
      std::size_t const n = std::min<std::size_t>(tokens.size() - done, options_.n_batch);
      llama_batch batch   = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
      batch.n_tokens      = static_cast<std::int32_t>(n);
      for (std::size_t i = 0; i < n; ++i) {
        batch.token[i] = tokens[done + i];
        batch.pos[i] = static_cast<llama_pos>(first_position + static_cast<std::int64_t>(done + i));
        batch.n_seq_id[i]  = 1;
        batch.seq_id[i][0] = seq;
        batch.logits[i]    = (done + i + 1 == tokens.size()) ? 1 : 0;
      }
      run_batch(batch, std::to_string(n) + " tokens of sequence " + std::to_string(seq) +
                         " at position " +
                         std::to_string(first_position + static_cast<std::int64_t>(done)));
      done += n;
    }
  }

  /**
   * @brief Runs `tokens` of `seq` at `first_position ..` (at most n_batch tokens, one
   * llama_decode) and returns the logits after each of the last `last_n` of them (oldest first):
   * row i predicts the token after `tokens[size - last_n + i]`.
   */
  std::vector<std::vector<float>> decode_logits(std::int32_t seq,
                                                std::vector<std::int32_t> const& tokens,
                                                std::int64_t first_position,
                                                std::size_t last_n)
  {
    std::size_t const n = tokens.size();
    if (n == 0 || n > options_.n_batch || last_n == 0 || last_n > n) {
      throw engine_error("llama_cpp::context::decode_logits: " + std::to_string(n) +
                         " tokens (1 .. n_batch = " + std::to_string(options_.n_batch) +
                         "), logits for the last " + std::to_string(last_n));
    }
    llama_batch batch = llama_batch_init(static_cast<std::int32_t>(n), 0, 1);
    batch.n_tokens    = static_cast<std::int32_t>(n);
    for (std::size_t i = 0; i < n; ++i) {
      batch.token[i]     = tokens[i];
      batch.pos[i]       = static_cast<llama_pos>(first_position + static_cast<std::int64_t>(i));
      batch.n_seq_id[i]  = 1;
      batch.seq_id[i][0] = seq;
      batch.logits[i]    = i + last_n >= n ? 1 : 0;
    }
    run_batch(batch, std::to_string(n) + " tokens of sequence " + std::to_string(seq));
    std::vector<std::vector<float>> out;
    for (std::size_t i = n - last_n; i < n; ++i) {
      float const* l = llama_get_logits_ith(ctx_.get(), static_cast<std::int32_t>(i));
      if (!l) { throw engine_error("llama_cpp::context::decode_logits: no logits"); }
      out.emplace_back(l, l + model_->vocab_size());
    }
    return out;
  }

  /// @brief Removes the cells of `seq` at positions >= `from`.
  void truncate(std::int32_t seq, std::int64_t from)
  {
    llama_memory_seq_rm(llama_get_memory(ctx_.get()), seq, static_cast<llama_pos>(from), -1);
  }

  /// @brief Logits of the last decoded token (a copy).
  std::vector<float> last_logits() const
  {
    float const* l = llama_get_logits_ith(ctx_.get(), -1);
    if (!l) { throw engine_error("llama_cpp::context: no logits"); }
    return {l, l + model_->vocab_size()};
  }

  /// @brief The highest-scoring token of the last decoded token's logits (lowest id on ties).
  std::int32_t greedy_token() const
  {
    float const* l = llama_get_logits_ith(ctx_.get(), -1);
    if (!l) { throw engine_error("llama_cpp::context: no logits"); }
    std::int32_t const n = model_->vocab_size();
    return static_cast<std::int32_t>(std::max_element(l, l + n) - l);
  }

  /**
   * @brief Greedy generation after a prefill: takes the token the last logits choose, decodes it at
   * `next_position`, and so on, `max_tokens` tokens or (with `stop_at_end`) until an
   * end-of-generation token.
   * @param logits_out if given, receives each step's logits (before choosing).
   */
  std::vector<std::int32_t> generate(std::int32_t seq,
                                     std::int64_t next_position,
                                     std::int32_t max_tokens,
                                     std::vector<std::vector<float>>* logits_out = nullptr,
                                     bool stop_at_end                            = true)
  {
    std::vector<std::int32_t> out;
    for (std::int32_t i = 0; i < max_tokens; ++i) {
      if (logits_out) { logits_out->push_back(last_logits()); }
      std::int32_t const token = greedy_token();
      out.push_back(token);
      if (stop_at_end && model_->is_end_of_generation(token)) { break; }
      decode(seq, {token}, next_position + i);
    }
    return out;
  }

  /// @brief The sequence-state blob of `seq` (llama_state_seq_get_data).
  std::vector<std::uint8_t> state(std::int32_t seq) const
  {
    std::size_t const n = llama_state_seq_get_size(ctx_.get(), seq);
    std::vector<std::uint8_t> out(n);
    if (n == 0 || llama_state_seq_get_data(ctx_.get(), out.data(), n, seq) != n) {
      throw engine_error("llama_state_seq_get_data failed for sequence " + std::to_string(seq));
    }
    return out;
  }

  /**
   * @brief Replaces sequence `seq` with a blob after checking it against the context's format;
   * a refused blob leaves the context unchanged.
   * @throw engine_error if the blob is malformed, of another format, or llama.cpp refuses it.
   */
  void set_state(std::int32_t seq, std::vector<std::uint8_t> const& blob)
  {
    (void)parse_state(blob.data(), blob.size(), geometry_, &format_);
    if (llama_state_seq_set_data(ctx_.get(), blob.data(), blob.size(), seq) != blob.size()) {
      throw engine_error("llama_state_seq_set_data refused the blob for sequence " +
                         std::to_string(seq));
    }
  }

  /// @brief While set, the graph callback copies pre-RoPE K and V of every forward into it, the
  /// first token of the next forward to row `first_row`, the following ones after it.
  void begin_capture(kv_capture& capture, std::int64_t first_row = 0)
  {
    if (!(capture.geometry() == geometry_)) {
      throw engine_error("llama_cpp capture: the buffer's geometry differs from the model's");
    }
    capture_ = &capture;
    key_tokens_.assign(static_cast<std::size_t>(geometry_.num_layers), first_row);
    value_tokens_.assign(static_cast<std::size_t>(geometry_.num_layers), first_row);
    last_key_.assign(static_cast<std::size_t>(geometry_.num_layers), nullptr);
    capture_error_.clear();
  }
  void end_capture() noexcept { capture_ = nullptr; }

 private:
  /// @brief llama_decode of `batch` (freed here).
  /// @throw engine_error if the capture hook failed or llama.cpp refused `what`.
  void run_batch(llama_batch batch, std::string const& what)
  {
    std::int32_t const rc = llama_decode(ctx_.get(), batch);
    llama_batch_free(batch);
    if (!capture_error_.empty()) {
      std::string const e = capture_error_;
      capture_error_.clear();
      throw engine_error("llama_cpp capture: " + e);
    }
    if (rc != 0) {
      throw engine_error("llama_decode returned " + std::to_string(rc) + " for " + what);
    }
  }

  void probe_format()
  {
    std::int32_t const seq = scratch_sequence();
    std::int32_t const bos = llama_vocab_bos(model_->vocab());
    decode(seq, {bos >= 0 ? bos : 0}, 0);
    std::vector<std::uint8_t> const blob = state(seq);
    clear(seq);
    format_ = parse_state(blob.data(), blob.size(), geometry_).format;
    if (format_.k_type != format_.v_type) {
      throw engine_error("llama_cpp::context: K and V cells of different types");
    }
  }

  /// @brief Layer number of a node named `<prefix>-<l>`, or -1.
  static int layer_of(char const* name, char const* prefix)
  {
    std::size_t const n = std::strlen(prefix);
    if (std::strncmp(name, prefix, n) != 0 || name[n] != '-') { return -1; }
    char* end    = nullptr;
    long const l = std::strtol(name + n + 1, &end, 10);
    return (end && *end == '\0' && end != name + n + 1) ? static_cast<int>(l) : -1;
  }

  bool is_head_view(ggml_tensor const* t) const noexcept
  {
    return t->type == GGML_TYPE_F32 && t->ne[0] == geometry_.head_dim &&
           t->ne[1] == geometry_.num_kv_heads && t->ne[3] == 1;
  }

  static bool eval_callback(ggml_tensor* t, bool ask, void* user)
  {
    auto* self = static_cast<context*>(user);
    if (!self->capture_) { return ask ? false : true; }
    return self->on_tensor(t, ask);
  }

  bool on_tensor(ggml_tensor* t, bool ask)
  {
    char const* name = ggml_get_name(t);
    int const k      = layer_of(name, "Kcur");
    int const v      = layer_of(name, "Vcur");
    int const layer  = k >= 0 ? k : v;
    if (layer < 0 || layer >= geometry_.num_layers) { return ask ? false : true; }
    if (ask) {
      if (k >= 0 && t->op == GGML_OP_ROPE) {
        // The ROPE node's input must be the K we took for this layer.
        if (t->src[0] != last_key_[static_cast<std::size_t>(k)]) {
          capture_error_ = "layer " + std::to_string(k) +
                           ": the K captured is not the input of the ROPE node (a k-norm or "
                           "another op sits between them in this architecture)";
          return true;  // asked, so the callback below can stop the graph
        }
        return false;
      }
      return t->op != GGML_OP_ROPE && is_head_view(t);
    }
    if (!capture_error_.empty()) { return false; }  // stop the graph
    try {
      if (!ggml_is_contiguous(t)) {
        capture_error_ = std::string{name} + " is not contiguous";
        return false;
      }
      std::int64_t const tokens = t->ne[2];
      std::vector<float> buf(static_cast<std::size_t>(ggml_nelements(t)));
      ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
      auto const rows = make_token_head_view<float const>(
        buf.data(), tokens, geometry_.num_kv_heads, geometry_.head_dim);
      auto& counter = (k >= 0 ? key_tokens_ : value_tokens_)[static_cast<std::size_t>(layer)];
      if (k >= 0) {
        capture_->write_keys(layer, counter, rows);
        last_key_[static_cast<std::size_t>(layer)] = t;
      } else {
        capture_->write_values(layer, counter, rows);
      }
      counter += tokens;
    } catch (std::exception const& e) {
      capture_error_ = e.what();
      return false;
    }
    return true;
  }

  struct deleter {
    void operator()(llama_context* c) const noexcept { llama_free(c); }
  };
  model const* model_;
  context_options options_;
  kv_geometry geometry_;
  state_format format_{};
  std::unique_ptr<llama_context, deleter> ctx_;
  kv_capture* capture_{nullptr};
  std::vector<std::int64_t> key_tokens_;
  std::vector<std::int64_t> value_tokens_;
  std::vector<ggml_tensor const*> last_key_;
  std::string capture_error_;
};

// ------------------------------------------------------------------------------------------------
// The two adapters of engine.hpp

/**
 * @brief Model adapter (engine.hpp): geometry, llama.cpp's own rotation table, and encode() —
 * one forward in the context's scratch sequence with the graph callback capturing pre-RoPE K/V.
 *
 * @note Bit-exact fidelity holds for a forward over the same tokens at the same positions in an
 *       otherwise empty context: llama.cpp's CPU attention visits the masked cells of other
 *       sequences in its unified cache and rounds differently when they are there (measured: the
 *       keys of layers >= 1 then differ from a prefill in an empty context by up to ~0.1).
 */
class model_adapter {
 public:
  /// @param table_rows positions the rotation table covers (default: the context length)
  explicit model_adapter(context& ctx, std::int64_t table_rows = 0)
    : ctx_{&ctx},
      spec_{ctx.owner().rotation_spec()},
      table_values_{make_ggml_rope_table(
        spec_,
        table_rows > 0 ? table_rows
                       : std::max<std::int64_t>(ctx.options().n_ctx, spec_.max_position))}
  {
    rope_params const params = make_rope_params(spec_);
    table_ =
      make_rope_cos_sin_table(params,
                              table_values_.data(),
                              static_cast<std::int64_t>(table_values_.size()) / params.rotary_dim,
                              /*round_each_operation*/ false);
    // ggml's CPU rope computes x0*cos - x1*sin in fp32, which GCC contracts into FMAs in the
    // x86-64 build (FMA enabled with GGML_NATIVE=OFF): measured bit-exact only in this form.
    table_.fused_multiply_add = true;
  }

  kv_geometry geometry() const { return ctx_->geometry(); }
  rope_spec const& spec() const noexcept { return spec_; }
  /// @brief llama.cpp's rotation as a table (host memory; valid while the adapter lives).
  rope_cos_sin_table<float> rotation() const noexcept { return table_; }

  /// @brief One forward over `tokens` at `first_position ..` in the scratch sequence (cleared
  /// before and after); the graph callback hands every layer's pre-RoPE K and V to `out`.
  void encode(std::vector<std::int32_t> const& tokens, std::int64_t first_position, kv_capture& out)
  {
    if (static_cast<std::int64_t>(tokens.size()) != out.num_tokens()) {
      throw engine_error("model_adapter::encode: " + std::to_string(tokens.size()) +
                         " tokens for a capture of " + std::to_string(out.num_tokens()));
    }
    std::int32_t const seq = ctx_->scratch_sequence();
    ctx_->clear(seq);
    ctx_->begin_capture(out);
    try {
      ctx_->decode(seq, tokens, first_position);
    } catch (...) {
      ctx_->end_capture();
      ctx_->clear(seq);
      throw;
    }
    ctx_->end_capture();
    ctx_->clear(seq);
    if (!out.complete()) {
      throw engine_error(
        "model_adapter::encode: the graph callback did not deliver K and V of "
        "every layer and token");
    }
  }

  /**
   * @brief Context-window encoding with branching (encoding.hpp's has_encode_branches_v): the
   * trunk runs once in the scratch sequence (not captured); then up to `n_branch_seq` facts per
   * forward, each in its own branch sequence that shares the trunk's cells at positions
   * `[first_position, first_position + attach)` (llama_memory_seq_cp), so it sees those and
   * itself only. The branches' pre-RoPE K/V go to `out`, branch 0's tokens first.
   * With `n_branch_seq == 0` every branch is its own forward over `trunk[0, attach) + fact`.
   *
   * @note K/V agree with a separate forward per fact to llama.cpp's rounding, not bit for bit:
   *       its CPU attention rounds differently when other sequences' cells are present.
   */
  void encode_branches(std::vector<std::int32_t> const& trunk,
                       std::int64_t first_position,
                       std::vector<encoding_branch> const& branches,
                       kv_capture& out)
  {
    std::int64_t rows = 0;
    std::int64_t longest = 0;
    for (encoding_branch const& b : branches) {
      if (b.attach < 0 || b.attach > static_cast<std::int64_t>(trunk.size()) ||
          b.token_ids.empty() || b.position != first_position + b.attach) {
        throw engine_error("model_adapter::encode_branches: fact " + std::to_string(b.fact_id) +
                           " does not attach inside the trunk at its position");
      }
      rows += static_cast<std::int64_t>(b.token_ids.size());
      longest = std::max(longest, static_cast<std::int64_t>(b.token_ids.size()));
    }
    if (rows != out.num_tokens()) {
      throw engine_error("model_adapter::encode_branches: " + std::to_string(rows) +
                         " branch tokens for a capture of " + std::to_string(out.num_tokens()));
    }
    context_options const& o = ctx_->options();
    if (o.n_branch_seq == 0) {
      std::int64_t row = 0;
      for (encoding_branch const& b : branches) {
        std::vector<std::int32_t> tokens(trunk.begin(), trunk.begin() + b.attach);
        tokens.insert(tokens.end(), b.token_ids.begin(), b.token_ids.end());
        kv_capture one{geometry(), static_cast<std::int64_t>(tokens.size())};
        encode(tokens, first_position, one);
        std::int64_t const n = static_cast<std::int64_t>(b.token_ids.size());
        for (std::int32_t l = 0; l < geometry().num_layers; ++l) {
          out.write_keys(l, row, layer_rows(one.keys(b.attach, n), l));
          out.write_values(l, row, layer_rows(one.values(b.attach, n), l));
        }
        row += n;
      }
      return;
    }
    if (static_cast<std::int64_t>(trunk.size()) + static_cast<std::int64_t>(o.n_batch) >
        static_cast<std::int64_t>(o.n_ctx)) {
      throw engine_error("model_adapter::encode_branches: a trunk of " +
                         std::to_string(trunk.size()) + " tokens and a batch of " +
                         std::to_string(o.n_batch) + " branch tokens exceed the context's " +
                         std::to_string(o.n_ctx) + " cells");
    }
    if (longest > static_cast<std::int64_t>(o.n_batch)) {
      throw engine_error("model_adapter::encode_branches: a fact of " + std::to_string(longest) +
                         " tokens exceeds n_batch = " + std::to_string(o.n_batch));
    }
    std::int32_t const scratch = ctx_->scratch_sequence();
    std::int32_t const first   = ctx_->first_branch_sequence();
    auto clear_all             = [&] {
      ctx_->clear(scratch);
      for (std::uint32_t i = 0; i < o.n_branch_seq; ++i) {
        ctx_->clear(first + static_cast<std::int32_t>(i));
      }
    };
    clear_all();
    try {
      if (!trunk.empty()) { ctx_->decode(scratch, trunk, first_position); }
      std::int64_t row = 0;
      std::size_t next = 0;
      while (next < branches.size()) {
        std::vector<std::int32_t> tokens, seqs;
        std::vector<std::int64_t> positions;
        std::uint32_t used = 0;
        while (next < branches.size() && used < o.n_branch_seq &&
               tokens.size() + branches[next].token_ids.size() <= o.n_batch) {
          encoding_branch const& b = branches[next];
          std::int32_t const seq   = first + static_cast<std::int32_t>(used);
          if (b.attach > 0) {
            ctx_->copy_sequence(scratch, seq, first_position, first_position + b.attach);
          }
          for (std::size_t j = 0; j < b.token_ids.size(); ++j) {
            tokens.push_back(b.token_ids[j]);
            positions.push_back(b.position + static_cast<std::int64_t>(j));
            seqs.push_back(seq);
          }
          ++used;
          ++next;
        }
        ctx_->begin_capture(out, row);
        ctx_->decode_tokens(tokens, positions, seqs);
        ctx_->end_capture();
        row += static_cast<std::int64_t>(tokens.size());
        for (std::uint32_t i = 0; i < used; ++i) {
          ctx_->clear(first + static_cast<std::int32_t>(i));
        }
      }
    } catch (...) {
      ctx_->end_capture();
      clear_all();
      throw;
    }
    clear_all();
    if (!out.complete()) {
      throw engine_error(
        "model_adapter::encode_branches: the graph callback did not deliver K and V of every "
        "layer and branch token");
    }
  }

 private:
  static token_head_view<float const> layer_rows(fact_kv_view<float const> v, std::int32_t l)
  {
    return make_token_head_view<float const>(v.data_handle() + v.mapping()(l, 0, 0, 0), v.extent(1), v.extent(2), v.extent(3),
                                             v.stride(1), v.stride(2), v.stride(3));
  }

  context* ctx_;
  rope_spec spec_;
  std::vector<float> table_values_;
  rope_cos_sin_table<float> table_{};
};

/**
 * @brief Paged-cache adapter (engine.hpp) for one llama.cpp sequence: allocate() stages a blob of
 * the context's format with cells at the requested positions (slots 0 .. n-1), cache() describes
 * its rows, commit() hands it to llama_state_seq_set_data, replacing the sequence.
 */
class sequence_cache {
 public:
  sequence_cache(context& ctx, std::int32_t seq) : ctx_{&ctx}, seq_{seq}
  {
    if (seq < 0 || seq >= ctx.scratch_sequence()) {
      throw engine_error("sequence_cache: sequence " + std::to_string(seq) +
                         " is not a serving sequence of this context (0 .. " +
                         std::to_string(ctx.scratch_sequence() - 1) + ")");
    }
  }

  std::vector<std::int64_t> allocate(std::int64_t first_position, std::int64_t tokens)
  {
    if (tokens <= 0 || first_position < 0 ||
        first_position > std::numeric_limits<std::int32_t>::max() - tokens ||
        tokens > static_cast<std::int64_t>(ctx_->options().n_ctx)) {
      throw engine_error("sequence_cache::allocate: " + std::to_string(tokens) +
                         " tokens at position " + std::to_string(first_position) +
                         " do not fit the context (" + std::to_string(ctx_->options().n_ctx) +
                         " cells)");
    }
    std::vector<std::int32_t> positions(static_cast<std::size_t>(tokens));
    for (std::int64_t j = 0; j < tokens; ++j) {
      positions[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(first_position + j);
    }
    make_state(ctx_->format(), ctx_->geometry(), seq_, positions, layout_, blob_);
    cache_ = describe_state(blob_.data(), layout_, ctx_->geometry());
    std::vector<std::int64_t> slots(static_cast<std::size_t>(tokens));
    for (std::int64_t j = 0; j < tokens; ++j) {
      slots[static_cast<std::size_t>(j)] = j;
    }
    staged_ = tokens;
    return slots;
  }

  paged_kv_cache const& cache() const noexcept { return cache_; }

  void commit(std::int64_t tokens)
  {
    if (tokens != staged_ || staged_ == 0) {
      throw engine_error("sequence_cache::commit: " + std::to_string(tokens) + " tokens, " +
                         std::to_string(staged_) + " staged");
    }
    ctx_->set_state(seq_, blob_);
    staged_ = 0;
  }

  /// @brief The staged blob (for tests).
  std::vector<std::uint8_t> const& blob() const noexcept { return blob_; }

 private:
  context* ctx_;
  std::int32_t seq_;
  std::vector<std::uint8_t> blob_;
  state_layout layout_;
  paged_kv_cache cache_{};
  std::int64_t staged_{0};
};

static_assert(is_model_adapter_v<model_adapter>);
static_assert(has_encode_branches_v<model_adapter>);
static_assert(is_cache_adapter_v<sequence_cache>);

}  // namespace inferscale::llama_cpp
