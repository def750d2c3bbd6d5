# cmake -DCMAKE_COMMAND_TO_USE=<cmake> -DSOURCE_DIR=<project> -DBUILD_DIR=<dir> -DINCLUDE_DIR=<include>
#       -DGENERATOR=<gen> -DCXX_COMPILER=<g++> -DCUDA_COMPILER=<nvcc> -DCUDA_ARCHITECTURES=<archs>
#       [-DJOBS=<n>] -P check.cmake
# Configures (which globs the headers and writes one TU per header) and builds the nested project.
foreach(var CMAKE_COMMAND_TO_USE SOURCE_DIR BUILD_DIR INCLUDE_DIR GENERATOR CXX_COMPILER
            CUDA_COMPILER CUDA_ARCHITECTURES)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "check.cmake: ${var} is not set")
  endif()
endforeach()

# Drop a cache made by another generator (the build tree is reused between runs otherwise).
if(EXISTS "${BUILD_DIR}/CMakeCache.txt")
  file(STRINGS "${BUILD_DIR}/CMakeCache.txt" cached_generator REGEX "^CMAKE_GENERATOR:")
  if(NOT cached_generator STREQUAL "CMAKE_GENERATOR:INTERNAL=${GENERATOR}")
    file(REMOVE_RECURSE "${BUILD_DIR}")
  endif()
endif()

execute_process(
  COMMAND "${CMAKE_COMMAND_TO_USE}" -S "${SOURCE_DIR}" -B "${BUILD_DIR}" -G "${GENERATOR}"
          -DINFERSCALE_INCLUDE_DIR=${INCLUDE_DIR}
          -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
          -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}
          "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}"
          -DCMAKE_BUILD_TYPE=
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the header check failed (${rc})")
endif()

# JOBS: parallel compiles (default: one per logical core).
if(NOT JOBS)
  cmake_host_system_information(RESULT JOBS QUERY NUMBER_OF_LOGICAL_CORES)
endif()
execute_process(COMMAND "${CMAKE_COMMAND_TO_USE}" --build "${BUILD_DIR}" --parallel ${JOBS}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "a header does not compile on its own (see the compiler output above)")
endif()
