# Dependencies of InferScale's own tests, benchmarks and examples (never of the INTERFACE target).
# Nothing is downloaded: the CUDA toolkit and Debian's catch2 / libbenchmark-dev come from the
# machine, RAFT/RMM from their PyPI C++ wheels (.ci/setup installs them into .venv).

set(INFERSCALE_HAS_CUDA OFF)
if(INFERSCALE_WITH_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    # Explicit architectures, never "native": 90 = H100/H200 (see README for other values).
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  set(INFERSCALE_HAS_CUDA ON)

  # 12.1: the injection and extraction kernels take 4.4-5.4 KB of parameters (the 4 KB limit
  # before it); include/inferscale/config.hpp refuses older nvcc versions in consumers' builds too.
  if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.1)
    message(FATAL_ERROR "InferScale needs CUDA 12.1 or newer (kernel parameters above 4 KB), found "
                        "${CMAKE_CUDA_COMPILER_VERSION}")
  endif()
else()
  # The CPU-only build (preset cpu): no nvcc, no CUDA runtime. Every target of ours compiles the
  # headers' runtime stand-in (INFERSCALE_HOST_ONLY, detail/cuda_runtime.hpp), even where the
  # toolkit's headers are on the default include path; the .cu tests, benchmarks and examples and
  # everything RAFT-based are left out.
  if(INFERSCALE_WITH_RAFT)
    message(STATUS "InferScale: INFERSCALE_WITH_CUDA=OFF turns INFERSCALE_WITH_RAFT off")
    set(INFERSCALE_WITH_RAFT OFF CACHE BOOL "" FORCE)
  endif()
  message(STATUS "InferScale: CPU-only build (INFERSCALE_WITH_CUDA=OFF): host targets only")
endif()

# Debian's Platform/Linux.cmake switches off the lib64 search; every RAPIDS wheel keeps its CMake
# config under <prefix>/lib64/cmake.
set_property(GLOBAL PROPERTY FIND_LIBRARY_USE_LIB64_PATHS TRUE)

set(INFERSCALE_HAS_RAFT OFF)
if(INFERSCALE_WITH_RAFT)
  if(CMAKE_VERSION VERSION_LESS 4.0)
    message(FATAL_ERROR
      "INFERSCALE_WITH_RAFT needs CMake >= 4.0 (the RAFT/RMM 26.10 configs require it); this is "
      "${CMAKE_VERSION}. Run .ci/setup and use .venv/bin/cmake, or pass -DINFERSCALE_WITH_RAFT=OFF.")
  endif()
  # rmm first: its dependency file points CCCL at the copy bundled in the wheels (CCCL >= 3.3),
  # which then serves every translation unit of this build (librmm.so was built with it).
  find_package(rmm 26.10 REQUIRED)
  find_package(raft 26.10 REQUIRED)
  set(INFERSCALE_HAS_RAFT ON)
elseif(INFERSCALE_HAS_CUDA)
  # Without RAFT every translation unit uses the toolkit's own CCCL.
  find_package(CCCL REQUIRED CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake")
else()
  # CPU-only: CCCL's headers only (libcu++'s cuda/std, header-only). Its CMake config where one is
  # found (a toolkit in /usr/local/cuda or CUDA_PATH, nvcc on PATH or not; CCCL_DIR); otherwise
  # INFERSCALE_CCCL_INCLUDE_DIR, a folder holding cuda/std/mdspan (`pip install nvidia-cuda-cccl`).
  find_package(CCCL CONFIG QUIET HINTS "$ENV{CUDA_PATH}/lib/cmake" "$ENV{CUDA_PATH}/lib64/cmake"
               /usr/local/cuda/lib/cmake /usr/local/cuda/lib64/cmake)
  if(NOT TARGET CCCL::CCCL)
    find_path(INFERSCALE_CCCL_INCLUDE_DIR cuda/std/mdspan PATH_SUFFIXES cccl
              DOC "CCCL's headers (a folder holding cuda/std/mdspan) for a CPU-only build")
    if(NOT INFERSCALE_CCCL_INCLUDE_DIR)
      message(FATAL_ERROR "InferScale: a CPU-only build needs CCCL's headers: none found. Pass "
                          "-DCCCL_DIR=<folder of cccl-config.cmake> or "
                          "-DINFERSCALE_CCCL_INCLUDE_DIR=<folder holding cuda/std/mdspan> (the "
                          "nvidia-cuda-cccl wheel has one).")
    endif()
    add_library(CCCL::CCCL INTERFACE IMPORTED)
    target_include_directories(CCCL::CCCL SYSTEM INTERFACE "${INFERSCALE_CCCL_INCLUDE_DIR}")
    set(_libcudacxx_INCLUDE_DIR "${INFERSCALE_CCCL_INCLUDE_DIR}")
    set(CCCL_VERSION "(headers)")
    set(CCCL_DIR "${INFERSCALE_CCCL_INCLUDE_DIR}")
  endif()
endif()
if(NOT TARGET CCCL::CCCL)
  message(FATAL_ERROR "No CCCL::CCCL target was found")
endif()
get_target_property(_inferscale_cccl_inc CCCL::CCCL INTERFACE_INCLUDE_DIRECTORIES)
message(STATUS "InferScale: CCCL ${CCCL_VERSION} (${CCCL_DIR}); RAFT: ${INFERSCALE_HAS_RAFT}; CUDA: ${INFERSCALE_HAS_CUDA}")

if(INFERSCALE_BUILD_TESTS)
  find_package(Catch2 2.13 REQUIRED)
endif()
if(INFERSCALE_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()

# hiredis (Debian's libhiredis-dev 0.14, through pkg-config): optional. redis_source.hpp, the Redis
# tier, is usable only with it; without it the Redis tests are registered as failing, naming what
# is missing (never skipped), and bench_fact_tiers measures no Redis figures.
set(INFERSCALE_HAS_HIREDIS OFF)
find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(INFERSCALE_HIREDIS QUIET IMPORTED_TARGET hiredis>=0.14)
  if(INFERSCALE_HIREDIS_FOUND)
    set(INFERSCALE_HAS_HIREDIS ON)
  endif()
endif()
message(STATUS "InferScale: hiredis ${INFERSCALE_HIREDIS_VERSION} found: ${INFERSCALE_HAS_HIREDIS}")
