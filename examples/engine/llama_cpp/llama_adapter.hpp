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
 *
 * One header per concept, all included here:
 *  - llama_model.hpp: the model (model, make_ggml_rope_table, quiet_logs, engine_error);
 *  - llama_state.hpp: the sequence-state blob tied to llama.cpp's internals (state_format,
 *    state_layout, parse_state, make_state, describe_state);
 *  - llama_context.hpp: the context (context_options, context);
 *  - llama_adapters.hpp: the two adapters of engine.hpp (model_adapter, sequence_cache).
 */
#pragma once

#include "llama_adapters.hpp"
#include "llama_context.hpp"
#include "llama_model.hpp"
#include "llama_state.hpp"

#include <inferscale/encoding.hpp>
#include <inferscale/engine.hpp>
