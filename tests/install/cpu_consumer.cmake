# The CPU-only consumer (issue 29, item 4): compiles cpu_consumer/main.cpp -- the memory facade
# serving a request into a host cache -- with the host compiler alone, seeing no CUDA headers, and
# links it without any CUDA library; then runs it.
# "Sees no CUDA headers": the compiler's default include directories are taken from `-E -v`, and
# every one that holds cuda_runtime_api.h (this machine links the toolkit's headers into
# /usr/local/include) is dropped under -nostdinc; the only other directories are InferScale's
# include/ and CCCL's headers (header-only; must hold no CUDA runtime header either). The program
# itself static_asserts that the headers chose their CPU-only runtime stand-in.
# "Links no CUDA library": no CUDA library is named, and the executable must need no libcuda*.so
# and leave no cuda* symbol undefined.
# Arguments: CXX_COMPILER, INCLUDE_DIR, CCCL_DIRS (|-separated, generator expressions allowed), SOURCE,
# WORK_DIR.
cmake_minimum_required(VERSION 3.25)

foreach(var CXX_COMPILER INCLUDE_DIR CCCL_DIRS SOURCE WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "cpu_consumer.cmake: ${var} is not set")
  endif()
endforeach()
file(MAKE_DIRECTORY "${WORK_DIR}")

# CCCL: the directory (of those given) that holds cuda/std/mdspan.
set(cccl "")
string(REPLACE "|" ";" CCCL_DIRS "${CCCL_DIRS}")
foreach(dir IN LISTS CCCL_DIRS)
  string(REGEX REPLACE "^\\$<BUILD_INTERFACE:(.*)>$" "\\1" dir "${dir}")
  if(dir MATCHES "^\\$<" OR dir STREQUAL "")
    continue()
  endif()
  if(EXISTS "${dir}/cuda/std/mdspan" AND cccl STREQUAL "")
    set(cccl "${dir}")
  endif()
endforeach()
if(cccl STREQUAL "")
  message(FATAL_ERROR "cpu_consumer: no CCCL header directory (cuda/std/mdspan) in '${CCCL_DIRS}'")
endif()
if(EXISTS "${cccl}/cuda_runtime_api.h")
  message(FATAL_ERROR "cpu_consumer: the CCCL directory ${cccl} also holds the CUDA runtime headers")
endif()

# The compiler's own include directories, less those holding CUDA runtime headers.
execute_process(COMMAND "${CXX_COMPILER}" -std=c++17 -x c++ -E -v /dev/null
                OUTPUT_QUIET ERROR_VARIABLE verbose RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cpu_consumer: '${CXX_COMPILER} -E -v' failed:\n${verbose}")
endif()
string(REGEX MATCH "#include <\\.\\.\\.> search starts here:\n(.*)\nEnd of search list" _ "${verbose}")
string(REPLACE "\n" ";" default_dirs "${CMAKE_MATCH_1}")
set(flags -std=c++17 -O1 -Wall -Wextra -Werror -nostdinc)
set(kept "")
foreach(dir IN LISTS default_dirs)
  string(STRIP "${dir}" dir)
  if(dir STREQUAL "")
    continue()
  endif()
  if(EXISTS "${dir}/cuda_runtime_api.h" OR EXISTS "${dir}/cuda_runtime.h" OR EXISTS "${dir}/cuda.h")
    message(STATUS "cpu_consumer: leaving out ${dir} (it holds CUDA headers)")
    continue()
  endif()
  list(APPEND flags -isystem "${dir}")
  list(APPEND kept "${dir}")
endforeach()
if(kept STREQUAL "")
  message(FATAL_ERROR "cpu_consumer: no default include directory found in:\n${verbose}")
endif()

set(exe "${WORK_DIR}/inferscale_cpu_consumer")
execute_process(COMMAND "${CXX_COMPILER}" ${flags} -I "${INCLUDE_DIR}" -I "${cccl}" "${SOURCE}"
                        -o "${exe}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cpu_consumer: the CPU-only build failed (no CUDA headers, CCCL ${cccl}):\n"
                      "${out}${err}")
endif()

# No CUDA library needed, no CUDA symbol left undefined.
find_program(READELF readelf REQUIRED)
execute_process(COMMAND "${READELF}" -d -W "${exe}" OUTPUT_VARIABLE dynamic RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR dynamic MATCHES "NEEDED[^\n]*libcuda")
  message(FATAL_ERROR "cpu_consumer: the executable needs a CUDA library:\n${dynamic}")
endif()
execute_process(COMMAND "${READELF}" -s -W --dyn-syms "${exe}" OUTPUT_VARIABLE symbols)
string(REGEX MATCH "UND[ \t]+cuda[A-Za-z_]*" cuda_symbol "${symbols}")
if(NOT cuda_symbol STREQUAL "")
  message(FATAL_ERROR "cpu_consumer: the executable refers to a CUDA symbol: ${cuda_symbol}")
endif()

execute_process(COMMAND "${exe}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cpu_consumer: the program failed (exit ${rc})")
endif()
