/**
 * @file memory_setup.hpp
 * @brief The demo memory (memory_data.hpp) stored through the llama.cpp adapter: the instruction
 * prefix and every fact encoded once, each in its own forward behind the prefix (pre-RoPE K/V
 * captured by the graph callback), into a host kv_store; and the same memory as plain prompt text
 * for the baseline that re-prefills it. Shared by the demo and the TTFT benchmark.
 */
#pragma once

#include "llama_adapter.hpp"
#include "memory_data.hpp"

#include <inferscale/compose.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/store.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace inferscale::llama_cpp::demo {

inline constexpr std::uint64_t prefix_id = 1;  ///< fact id of the instruction prefix
inline constexpr std::uint64_t user_id   = 7;  ///< the demo user's namespace

/// @brief Fact id of demo fact `i` (0-based).
inline std::uint64_t fact_id(std::size_t i) { return 100 + i; }

/// @brief A host store sized for the demo memory (fp32: the hook's K/V as captured).
inline kv_store make_memory_store(kv_geometry const& geometry)
{
  kv_store_config config;
  config.model       = geometry;
  config.store_dtype = dtype::float32;
  config.page_size   = 16;
  config.num_pages   = 512;
  config.space       = memory_space::host;
  return kv_store{config};
}

/// @brief How store_memory() encodes each fact.
enum class fact_encoding {
  /// Behind the instruction prefix: one forward of prefix + fact at positions 0 .., the fact's
  /// rows kept. The fact sees the prefix, as in the re-prefilled text, and no longer carries an
  /// attention sink of its own (measured: KL to the re-prefill 0.25 -> 0.10 at k = 5; the
  /// default).
  behind_prefix,
  /// Alone: its own forward at position 0 (each fact starts a sequence, sink and all).
  alone,
};

/**
 * @brief Encodes the prefix (alone, at position 0: it opens every memory segment) and the first
 * `num_facts` facts into `store`, each fact in its own forward (a fact stored pre-RoPE carries no
 * position).
 */
inline void store_memory(model const& m,
                         model_adapter& adapter,
                         kv_store& store,
                         std::size_t num_facts,
                         fact_encoding encoding = fact_encoding::behind_prefix)
{
  std::vector<std::int32_t> const prefix = m.tokenize(instruction_prefix);
  encode_facts(adapter, store, prefix, 0, {{prefix_id, user_id, 0, prefix}});
  for (std::size_t i = 0; i < num_facts; ++i) {
    std::vector<std::int32_t> const fact = m.tokenize(facts[i]);
    if (encoding == fact_encoding::alone) {
      encode_facts(adapter, store, fact, 0, {{fact_id(i), user_id, 0, fact}});
    } else {
      std::vector<std::int32_t> sequence = prefix;
      sequence.insert(sequence.end(), fact.begin(), fact.end());
      encode_facts(adapter,
                   store,
                   sequence,
                   0,
                   {{fact_id(i), user_id, static_cast<std::int64_t>(prefix.size()), fact}});
    }
  }
}

/// @brief The composition of the prefix and facts `0 .. k-1` at position 0.
inline composition compose_memory(kv_store const& store, std::size_t k)
{
  std::vector<std::uint64_t> ids;
  for (std::size_t i = 0; i < k; ++i) {
    ids.push_back(fact_id(i));
  }
  compose_options options;
  options.first_position     = 0;
  options.order              = fact_order::as_given;
  options.instruction_prefix = prefix_id;
  return compose(store, ids, options);
}

/// @brief The baseline's prompt: the same prefix and facts as text tokens, then the question.
inline std::vector<std::int32_t> prompt_with_memory(model const& m,
                                                    std::size_t k,
                                                    std::vector<std::int32_t> const& question)
{
  std::vector<std::int32_t> out = m.tokenize(instruction_prefix);
  for (std::size_t i = 0; i < k; ++i) {
    std::vector<std::int32_t> const t = m.tokenize(facts[i]);
    out.insert(out.end(), t.begin(), t.end());
  }
  out.insert(out.end(), question.begin(), question.end());
  return out;
}

}  // namespace inferscale::llama_cpp::demo
