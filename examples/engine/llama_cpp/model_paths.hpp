/**
 * @file model_paths.hpp
 * @brief Where the reference engine's models are: the environment (`INFERSCALE_SMOLLM2_GGUF`,
 * `INFERSCALE_GEMMA3_GGUF`, `INFERSCALE_MINILM_GGUF`) wins, else the paths .ci/engine installed,
 * compiled in by cmake/llama_cpp.cmake (`INFERSCALE_*_GGUF_DEFAULT`); empty when neither is set.
 */
#pragma once

#include <cstdlib>
#include <string>

namespace inferscale::llama_cpp {

namespace detail {
inline std::string path_from_env(char const* variable, char const* compiled)
{
  if (char const* p = std::getenv(variable)) { return p; }
  return compiled ? compiled : "";
}
}  // namespace detail

/// @brief SmolLM2-135M-Instruct Q4_1 GGUF.
inline std::string smollm2_path()
{
#ifdef INFERSCALE_SMOLLM2_GGUF_DEFAULT
  return detail::path_from_env("INFERSCALE_SMOLLM2_GGUF", INFERSCALE_SMOLLM2_GGUF_DEFAULT);
#else
  return detail::path_from_env("INFERSCALE_SMOLLM2_GGUF", nullptr);
#endif
}

/// @brief Gemma 3 270M Q4_K_M GGUF (the adapter tests' second model family).
inline std::string gemma3_path()
{
#ifdef INFERSCALE_GEMMA3_GGUF_DEFAULT
  return detail::path_from_env("INFERSCALE_GEMMA3_GGUF", INFERSCALE_GEMMA3_GGUF_DEFAULT);
#else
  return detail::path_from_env("INFERSCALE_GEMMA3_GGUF", nullptr);
#endif
}

/// @brief all-MiniLM-L6-v2 F32 GGUF (converted by minilm_gguf.py).
inline std::string minilm_path()
{
#ifdef INFERSCALE_MINILM_GGUF_DEFAULT
  return detail::path_from_env("INFERSCALE_MINILM_GGUF", INFERSCALE_MINILM_GGUF_DEFAULT);
#else
  return detail::path_from_env("INFERSCALE_MINILM_GGUF", nullptr);
#endif
}

}  // namespace inferscale::llama_cpp
