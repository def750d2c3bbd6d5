# Issue 13, item 1: a consumer's --use_fast_math must not change the device math of the rotation
# and injection kernels. The kernels of fast_math_kernels.cu are compiled to PTX with and without
# --use_fast_math; with the flushing of subnormals (`.ftz`, what -ftz=true asks for and no header
# can refuse) taken out, the two must be the same instructions, line for line: no approximate sin,
# cos, division or square root (`.approx`, `div.full`), no contraction the normal build does not
# make. (Headers that called sincosf, `/` or sqrt on floats gave 32 sin.approx, 32 cos.approx,
# 487 div.approx and 2 sqrt.approx here.)
#
# Inputs: CUDA_COMPILER, INCLUDE_DIR, SOURCE, WORK_DIR, ARCH (e.g. 90).
cmake_policy(VERSION 3.20)
foreach(var CUDA_COMPILER INCLUDE_DIR SOURCE WORK_DIR ARCH)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "fast_math_ptx.cmake: ${var} is not set")
  endif()
endforeach()
get_filename_component(toolkit_bin "${CUDA_COMPILER}" DIRECTORY)
get_filename_component(toolkit "${toolkit_bin}/.." ABSOLUTE)
file(MAKE_DIRECTORY "${WORK_DIR}")

function(compile_ptx flags output)
  execute_process(
    COMMAND "${CUDA_COMPILER}" -std=c++17 ${flags} "-arch=sm_${ARCH}" -ptx
            "-I${INCLUDE_DIR}" "-I${toolkit}/include/cccl" "-I${toolkit}/include"
            "${SOURCE}" -o "${output}"
    RESULT_VARIABLE rc
    ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "fast_math_ptx: nvcc ${flags} failed:\n${err}")
  endif()
endfunction()

compile_ptx("" "${WORK_DIR}/plain.ptx")
compile_ptx("--use_fast_math" "${WORK_DIR}/fast.ptx")

# The PTX without comment lines (they name the compiler and its options).
function(read_ptx path out)
  file(STRINGS "${path}" lines)
  list(FILTER lines EXCLUDE REGEX "^//")
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()
read_ptx("${WORK_DIR}/plain.ptx" plain)
read_ptx("${WORK_DIR}/fast.ptx" fast)

string(REGEX MATCHALL "\\.entry" entries "${plain}")
list(LENGTH entries entry_count)
if(entry_count LESS 10)
  message(FATAL_ERROR "fast_math_ptx: only ${entry_count} kernels in the PTX; expected the rope "
                      "and injection kernels of every dtype")
endif()
foreach(pattern "\\.approx" "div\\.full")
  string(REGEX MATCHALL "[a-z0-9.]*${pattern}[a-z0-9.]*" found "${fast}")
  if(found)
    list(REMOVE_DUPLICATES found)
    message(FATAL_ERROR "fast_math_ptx: --use_fast_math gives approximate instructions: ${found}")
  endif()
endforeach()
string(REGEX MATCHALL "\\.ftz" flushes "${fast}")
list(LENGTH flushes flush_count)
string(REPLACE ".ftz" "" fast_unflushed "${fast}")
if(NOT fast_unflushed STREQUAL plain)
  file(WRITE "${WORK_DIR}/plain.txt" "${plain}")
  file(WRITE "${WORK_DIR}/fast-unflushed.txt" "${fast_unflushed}")
  message(FATAL_ERROR "fast_math_ptx: with .ftz removed, the --use_fast_math PTX differs from the "
                      "normal build's (compare ${WORK_DIR}/plain.txt and fast-unflushed.txt)")
endif()
message(STATUS "fast_math_ptx: ${entry_count} kernels; --use_fast_math PTX equals the normal "
               "build's but for ${flush_count} .ftz (subnormal flushing)")
