# cmake -DCMAKE_COMMAND_TO_USE=<cmake> -DSOURCE_DIR=<repository> -DBINARY_DIR=<scratch>
#       -DUNIT=<a build target of the cpu tree> -P cpu_preset.cmake
# Configures the cpu preset into BINARY_DIR with nvcc hidden (PATH without the folders that hold
# it, CUDACXX unset), checks that the CUDA language stayed off, then builds UNIT.
cmake_minimum_required(VERSION 3.25)

foreach(var CMAKE_COMMAND_TO_USE SOURCE_DIR BINARY_DIR UNIT)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "cpu_preset.cmake: ${var} is not set")
  endif()
endforeach()

# nvcc hidden: every PATH entry holding it dropped.
string(REPLACE ":" ";" entries "$ENV{PATH}")
set(kept "")
foreach(entry IN LISTS entries)
  if(EXISTS "${entry}/nvcc")
    message(STATUS "build.cpu_preset: ${entry} left out of PATH (it holds nvcc)")
  else()
    list(APPEND kept "${entry}")
  endif()
endforeach()
list(JOIN kept ":" path)
set(ENV{PATH} "${path}")
unset(ENV{CUDACXX})
find_program(nvcc_left nvcc NO_CACHE)
if(nvcc_left)
  message(FATAL_ERROR "build.cpu_preset: nvcc is still found at ${nvcc_left}")
endif()

file(REMOVE "${BINARY_DIR}/CMakeCache.txt")
execute_process(COMMAND "${CMAKE_COMMAND_TO_USE}" --preset cpu -S "${SOURCE_DIR}" -B "${BINARY_DIR}"
                WORKING_DIRECTORY "${SOURCE_DIR}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "build.cpu_preset: `cmake --preset cpu` failed without nvcc (${rc})")
endif()
file(STRINGS "${BINARY_DIR}/CMakeCache.txt" cuda_compiler REGEX "^CMAKE_CUDA_COMPILER:")
file(STRINGS "${BINARY_DIR}/CMakeCache.txt" with_cuda REGEX "^INFERSCALE_WITH_CUDA:")
if(NOT cuda_compiler STREQUAL "" OR NOT with_cuda MATCHES "=OFF$")
  message(FATAL_ERROR "build.cpu_preset: the cpu preset enabled CUDA ('${cuda_compiler}', "
                      "'${with_cuda}')")
endif()

execute_process(COMMAND "${CMAKE_COMMAND_TO_USE}" --build "${BINARY_DIR}" --target "${UNIT}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "build.cpu_preset: ${UNIT} does not build in the cpu preset (${rc})")
endif()
message(STATUS "build.cpu_preset: configured without nvcc, ${UNIT} built")
