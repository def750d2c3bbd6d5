/**
 * @file llama_state.hpp
 * @brief The sequence-state blob in llama.cpp's format (`llama_state_seq_get_data`:
 * src/llama-context.cpp and src/llama-kv-cache.cpp of this version): what a context's blobs look
 * like (state_format), where the parts of one lie (state_layout), parsing and checking a blob
 * (parse_state), laying one out (make_state), and its K and V rows as a paged_kv_cache for
 * inject_host (describe_state).
 *
 * A blob is the magic and the sequence id, then one section per KV cache of the model
 * (`llama_kv_cache::state_write`): one for most models; two for a model with sliding-window
 * layers (`llama_kv_cache_iswa::state_write`: the global layers' cache, then the sliding-window
 * layers'). Each section holds the sequence's cells and the K and V rows of its own layers.
 */
#pragma once

#include "llama_model.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/cache_factories.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/geometry.hpp>

#include <ggml.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace inferscale::llama_cpp {

// ------------------------------------------------------------------------------------------------
// The sequence-state blob

/// @brief What a context's sequence-state blobs look like (read from the engine by a probe).
/// Every section has the same streams, V transposition, cell types and row sizes.
struct state_format {
  std::uint32_t n_stream{};
  std::uint32_t v_trans{};
  std::uint32_t n_layer{};  ///< layers in all sections
  std::int32_t k_type{};
  std::int32_t v_type{};
  std::uint64_t k_row_bytes{};
  std::uint64_t v_row_bytes{};  ///< v_trans == 0
  std::uint32_t v_el_bytes{};   ///< v_trans == 1
  std::uint32_t n_embd_v{};     ///< v_trans == 1: elements per token row of V
  /// Layers of each section, in blob order (one entry per KV cache of the model).
  std::vector<std::uint32_t> section_layers;
  /// The model layer of each layer record, in blob order (section after section): the identity
  /// for one section; for a sliding-window model, read off the engine by the context's probe.
  std::vector<std::int32_t> layer_order;

  bool operator==(state_format const& o) const noexcept
  {
    return n_stream == o.n_stream && v_trans == o.v_trans && n_layer == o.n_layer &&
           k_type == o.k_type && v_type == o.v_type && k_row_bytes == o.k_row_bytes &&
           v_row_bytes == o.v_row_bytes && v_el_bytes == o.v_el_bytes && n_embd_v == o.n_embd_v &&
           section_layers == o.section_layers && layer_order == o.layer_order;
  }
};

/// @brief Where the parts of one blob lie (byte offsets into it). Every section holds the same
/// cells (parse_state refuses a blob whose sections differ).
struct state_layout {
  state_format format{};
  std::int32_t seq_id{};
  std::uint32_t stream{};      ///< the one stream holding cells
  std::uint32_t cell_count{};  ///< cells (tokens) of the sequence
  std::vector<std::int32_t> positions;
  std::vector<std::size_t> key_rows;    ///< per model layer: offset of its first K row
  std::vector<std::size_t> value_rows;  ///< per model layer: offset of its first V row (or element)
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
    default: {
      // ggml_type_name indexes a table: only ids below GGML_TYPE_COUNT may be named.
      char const* name = ggml_type_id >= 0 && ggml_type_id < GGML_TYPE_COUNT
                           ? ggml_type_name(static_cast<ggml_type>(ggml_type_id))
                           : nullptr;
      throw engine_error("sequence state: cell type " + std::to_string(ggml_type_id) + " (" +
                         (name != nullptr ? name : "unknown") +
                         ") is not supported (f32, f16, bf16 are)");
    }
  }
}

}  // namespace detail

/**
 * @brief Parses a sequence-state blob, checking everything: magic, then section after section
 * until the model's layers are covered: one non-empty stream, cells of exactly one sequence
 * without the M-RoPE cell extension (the same cells in every section), the V transposition,
 * supported cell types with the row sizes `geometry` implies (the same in every section); and that
 * the blob ends where its contents do. With `expected`, the format must equal it, and its
 * layer_order says which model layer each record holds; without, records are taken in the model's
 * order.
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
  out.seq_id = in.get<std::int32_t>("seq_id");
  std::uint64_t const row_elements =
    static_cast<std::uint64_t>(geometry.elements_per_token_layer());
  std::uint32_t const model_layers = static_cast<std::uint32_t>(geometry.num_layers);
  std::vector<std::size_t> key_records, value_records;  // in blob order
  for (std::uint32_t section = 0; out.format.n_layer < model_layers; ++section) {
    std::string const where =
      section == 0 ? std::string{} : " (section " + std::to_string(section) + ")";
    if (section > 0 && in.at == size) {
      throw engine_error("sequence state: " + std::to_string(out.format.n_layer) +
                         " layers, the model has " + std::to_string(geometry.num_layers));
    }
    std::uint32_t const n_stream = in.get<std::uint32_t>("n_stream");
    if (n_stream == 0 || n_stream > 4096) {
      throw engine_error("sequence state: implausible stream count " + std::to_string(n_stream) +
                         where);
    }
    if (section > 0 && n_stream != out.format.n_stream) {
      throw engine_error("sequence state: sections with different stream counts");
    }
    out.format.n_stream = n_stream;
    bool seen           = false;
    for (std::uint32_t s = 0; s < n_stream; ++s) {
      std::uint32_t const cells = in.get<std::uint32_t>("cell_count");
      if (cells == 0) { continue; }
      if (seen) { throw engine_error("sequence state: more than one stream holds cells" + where); }
      seen = true;
      if (section > 0 && (s != out.stream || cells != out.cell_count)) {
        throw engine_error("sequence state: section " + std::to_string(section) + " holds " +
                           std::to_string(cells) + " cells in stream " + std::to_string(s) +
                           ", the first " + std::to_string(out.cell_count) + " in stream " +
                           std::to_string(out.stream) +
                           " (a sliding-window cache saves only the cells inside its window: a "
                           "sequence longer than the window is not read back)");
      }
      out.stream     = s;
      out.cell_count = cells;
      // 12 bytes per cell (position, n_seq_id = 1, seq_id): a count the blob cannot hold is
      // refused before it sizes anything.
      if (cells > (size - in.at) / 12) {
        throw engine_error("sequence state: truncated: " + std::to_string(cells) + " cells need " +
                           std::to_string(std::uint64_t{cells} * 12) + " bytes at byte " +
                           std::to_string(in.at) + ", " + std::to_string(size - in.at) + " left");
      }
      out.positions.resize(cells);
      for (std::uint32_t c = 0; c < cells; ++c) {
        std::int32_t const position = in.get<std::int32_t>("cell position");
        if (section > 0 && position != out.positions[c]) {
          throw engine_error("sequence state: cell " + std::to_string(c) + " is at position " +
                             std::to_string(position) + " in section " + std::to_string(section) +
                             ", at " + std::to_string(out.positions[c]) + " in the first");
        }
        out.positions[c]             = position;
        std::uint32_t const n_seq_id = in.get<std::uint32_t>("cell n_seq_id");
        if (n_seq_id != 1) {
          throw engine_error("sequence state: cell " + std::to_string(c) + " belongs to " +
                             std::to_string(n_seq_id) + " sequences (one expected)");
        }
        (void)in.get<std::int32_t>("cell seq_id");
      }
      std::uint32_t const v_trans = in.get<std::uint32_t>("v_trans");
      if (v_trans > 1) {
        throw engine_error("sequence state: V transposition flag " + std::to_string(v_trans) +
                           " (the cells may carry an M-RoPE extension, which is not supported)");
      }
      if (section > 0 && v_trans != out.format.v_trans) {
        throw engine_error("sequence state: sections with different V transpositions");
      }
      out.format.v_trans          = v_trans;
      std::uint32_t const n_layer = in.get<std::uint32_t>("n_layer");
      if (n_layer == 0 || n_layer > model_layers - out.format.n_layer) {
        throw engine_error(
          "sequence state: " + std::to_string(out.format.n_layer + n_layer) + " layers" +
          (section > 0 ? " in " + std::to_string(section + 1) + " sections" : std::string{}) +
          ", the model has " + std::to_string(geometry.num_layers));
      }
      out.format.section_layers.push_back(n_layer);
      for (std::uint32_t l = 0; l < n_layer; ++l) {
        std::int32_t const type  = in.get<std::int32_t>("k_type");
        std::uint64_t const rows = in.get<std::uint64_t>("k_row_bytes");
        dtype const t            = detail::cache_dtype_of(type);
        if (rows != row_elements * size_of(t)) {
          throw engine_error("sequence state: layer " + std::to_string(l) + where + " K rows of " +
                             std::to_string(rows) + " bytes, expected " +
                             std::to_string(row_elements * size_of(t)));
        }
        if (!key_records.empty() && (type != out.format.k_type || rows != out.format.k_row_bytes)) {
          throw engine_error("sequence state: layers with different K cell types");
        }
        out.format.k_type      = type;
        out.format.k_row_bytes = rows;
        key_records.push_back(in.at);
        in.skip(rows * cells, "K rows");
      }
      for (std::uint32_t l = 0; l < n_layer; ++l) {
        std::int32_t const type = in.get<std::int32_t>("v_type");
        dtype const t           = detail::cache_dtype_of(type);
        if (!value_records.empty() && type != out.format.v_type) {
          throw engine_error("sequence state: layers with different V cell types");
        }
        out.format.v_type = type;
        if (out.format.v_trans == 0) {
          std::uint64_t const rows = in.get<std::uint64_t>("v_row_bytes");
          if (rows != row_elements * size_of(t)) {
            throw engine_error("sequence state: layer " + std::to_string(l) + where +
                               " V rows of " + std::to_string(rows) + " bytes, expected " +
                               std::to_string(row_elements * size_of(t)));
          }
          out.format.v_row_bytes = rows;
          value_records.push_back(in.at);
          in.skip(rows * cells, "V rows");
        } else {
          std::uint32_t const el = in.get<std::uint32_t>("v_el_bytes");
          std::uint32_t const n  = in.get<std::uint32_t>("n_embd_v_gqa");
          if (el != size_of(t) || n != row_elements) {
            throw engine_error("sequence state: layer " + std::to_string(l) + where +
                               " transposed V of " + std::to_string(n) + " x " +
                               std::to_string(el) + "-byte elements, expected " +
                               std::to_string(row_elements) + " x " + std::to_string(size_of(t)));
          }
          out.format.v_el_bytes = el;
          out.format.n_embd_v   = n;
          value_records.push_back(in.at);
          in.skip(static_cast<std::uint64_t>(el) * n * cells, "transposed V");
        }
      }
      out.format.n_layer += n_layer;
    }
    if (!seen) {
      throw engine_error("sequence state: no stream holds cells (empty sequence)" + where);
    }
  }
  if (in.at != size) {
    throw engine_error("sequence state: " + std::to_string(size - in.at) +
                       " trailing bytes after the contents");
  }
  if (expected) {
    out.format.layer_order = expected->layer_order;
  } else {
    for (std::uint32_t l = 0; l < out.format.n_layer; ++l) {
      out.format.layer_order.push_back(static_cast<std::int32_t>(l));
    }
  }
  if (expected && !(out.format == *expected)) {
    throw engine_error(
      "sequence state: the blob's format (streams " + std::to_string(out.format.n_stream) +
      ", v_trans " + std::to_string(out.format.v_trans) + ", K type " +
      std::to_string(out.format.k_type) + ", V type " + std::to_string(out.format.v_type) +
      ", sections " + std::to_string(out.format.section_layers.size()) +
      ") differs from the context's (streams " + std::to_string(expected->n_stream) + ", v_trans " +
      std::to_string(expected->v_trans) + ", K type " + std::to_string(expected->k_type) +
      ", V type " + std::to_string(expected->v_type) + ", sections " +
      std::to_string(expected->section_layers.size()) + ")");
  }
  out.key_rows.assign(out.format.n_layer, 0);
  out.value_rows.assign(out.format.n_layer, 0);
  for (std::size_t r = 0; r < key_records.size(); ++r) {
    std::size_t const layer = static_cast<std::size_t>(out.format.layer_order[r]);
    out.key_rows[layer]     = key_records[r];
    out.value_rows[layer]   = value_records[r];
  }
  out.size = size;
  return out;
}

/**
 * @brief Which model layer each layer record of a blob holds, for a blob of several sections: the
 * blob of one token at position 0 (where the rotation is the identity), `layout` its parse in
 * record order (parse_state without a format), `keys[l]` layer l's ROPE output for that token. The
 * record whose K row equals layer l's keys to the cell type's rounding is layer l's.
 * @throw engine_error (prefixed by `who`) if a record matches no layer, or several, or two records
 *        the same layer.
 */
inline std::vector<std::int32_t> match_state_layers(std::uint8_t const* blob,
                                                    state_layout const& layout,
                                                    kv_geometry const& geometry,
                                                    std::vector<std::vector<float>> const& keys,
                                                    std::string const& who)
{
  std::size_t const layers = static_cast<std::size_t>(geometry.num_layers);
  std::size_t const row    = static_cast<std::size_t>(geometry.elements_per_token_layer());
  dtype const cell         = detail::cache_dtype_of(layout.format.k_type);
  std::vector<std::int32_t> order(layers, -1);
  std::vector<bool> taken(layers, false);
  std::vector<float> cells(row);
  for (std::size_t r = 0; r < layers; ++r) {
    std::uint8_t const* k = blob + layout.key_rows[r];  // record r, taken as layer r by the parse
    for (std::size_t e = 0; e < row; ++e) {
      if (cell == dtype::float32) {
        std::memcpy(&cells[e], k + 4 * e, 4);
      } else if (cell == dtype::float16) {
        half_t h;
        std::memcpy(&h, k + 2 * e, 2);
        cells[e] = to_float(h);
      } else {
        bfloat16_t b;
        std::memcpy(&b, k + 2 * e, 2);
        cells[e] = to_float(b);
      }
    }
    std::int32_t found = -1;
    for (std::size_t l = 0; l < layers && l < keys.size(); ++l) {
      bool same = keys[l].size() == row;
      for (std::size_t e = 0; same && e < row; ++e) {
        // the cell type's rounding: a relative 2^-8 covers bfloat16's half ulp
        same = std::fabs(cells[e] - keys[l][e]) <= std::ldexp(std::fabs(keys[l][e]), -8) + 1e-30f;
      }
      if (!same) { continue; }
      if (found >= 0) {
        throw engine_error(who + ": layers " + std::to_string(found) + " and " + std::to_string(l) +
                           " have the same probe keys: the blob's layer records cannot be "
                           "matched to the model's layers");
      }
      found = static_cast<std::int32_t>(l);
    }
    if (found < 0 || taken[static_cast<std::size_t>(found)]) {
      throw engine_error(who + ": the state blob's layer record " + std::to_string(r) +
                         " matches no layer's keys one to one; refused");
    }
    taken[static_cast<std::size_t>(found)] = true;
    order[r]                               = found;
  }
  return order;
}

/**
 * @brief Lays out in `out` a blob of `positions.size()` cells of sequence `seq_id` at those
 * positions, in `format` (every section holding those cells); `layout` receives where its rows
 * lie. The K and V rows are not cleared (bytes `out` already held stay, new bytes are zero):
 * injection overwrites every row, and reusing one buffer per sequence keeps a request from
 * allocating and zeroing megabytes.
 */
inline void make_state(state_format const& format,
                       kv_geometry const& geometry,
                       std::int32_t seq_id,
                       std::vector<std::int32_t> const& positions,
                       state_layout& layout,
                       std::vector<std::uint8_t>& out)
{
  if (positions.empty()) { throw engine_error("make_state: no cells"); }
  if (format.layer_order.size() != format.n_layer || format.section_layers.empty()) {
    throw engine_error("make_state: the format's layer order does not cover its layers");
  }
  std::uint32_t const cells = static_cast<std::uint32_t>(positions.size());
  std::uint64_t const row_elements =
    static_cast<std::uint64_t>(geometry.elements_per_token_layer());
  std::uint64_t const v_bytes =
    format.v_trans ? std::uint64_t{format.v_el_bytes} * row_elements : format.v_row_bytes;
  std::uint64_t const v_header = 12;  // type + (u64 row bytes | u32 element bytes + u32 n_embd)
  std::size_t const sections   = format.section_layers.size();
  // magic and seq_id; per section: n_stream, the streams' cell counts, the cells, v_trans and
  // n_layer
  std::size_t const total = 8 + sections * (4 + 4 * format.n_stream + 12 * std::size_t{cells} + 8) +
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
  layout.key_rows.assign(format.n_layer, 0);
  layout.value_rows.assign(format.n_layer, 0);
  put(state_magic);
  put(seq_id);
  std::size_t record = 0;  // the first layer record of the section
  for (std::uint32_t const n_layer : format.section_layers) {
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
      put(n_layer);
      for (std::uint32_t l = 0; l < n_layer; ++l) {
        put(format.k_type);
        put(format.k_row_bytes);
        layout.key_rows[static_cast<std::size_t>(format.layer_order[record + l])] = at;
        at += static_cast<std::size_t>(format.k_row_bytes * cells);
      }
      for (std::uint32_t l = 0; l < n_layer; ++l) {
        put(format.v_type);
        if (format.v_trans == 0) {
          put(format.v_row_bytes);
        } else {
          put(format.v_el_bytes);
          put(format.n_embd_v);
        }
        layout.value_rows[static_cast<std::size_t>(format.layer_order[record + l])] = at;
        at += static_cast<std::size_t>(v_bytes * cells);
      }
    }
    record += n_layer;
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

}  // namespace inferscale::llama_cpp
