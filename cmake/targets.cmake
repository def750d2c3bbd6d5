# Helpers shared by tests, benchmarks and examples: warnings as errors on our own targets.

set(INFERSCALE_CXX_WARNINGS -Wall -Wextra -Wpedantic -Werror)
set(INFERSCALE_CUDA_WARNINGS -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror)

# inferscale_target_defaults(<target> [RAFT [NO_DEVICE_INSTANCES]])
#   Warnings as errors, the build's single CCCL, the CUDA runtime; RAFT targets get raft::raft,
#   C++20 (RAFT needs std::source_location), silence RAFT's own deprecation warnings, and link the
#   build's one compiled RAFT select_k instance (INFERSCALE_EXTERN_DEVICE_INSTANCES, instances.cuh:
#   ~50 s of nvcc once instead of in each RAFT unit); NO_DEVICE_INSTANCES: the object that defines it.
function(inferscale_target_defaults target)
  cmake_parse_arguments(ARG "RAFT;NO_DEVICE_INSTANCES" "" "" ${ARGN})
  target_link_libraries(${target} PRIVATE inferscale::inferscale CCCL::CCCL)
  if(INFERSCALE_HAS_CUDA)
    target_link_libraries(${target} PRIVATE CUDA::cudart)
  else()
    target_compile_definitions(${target} PRIVATE INFERSCALE_HOST_ONLY)  # the runtime's stand-in
  endif()
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${INFERSCALE_CXX_WARNINGS}>
    $<$<COMPILE_LANGUAGE:CUDA>:${INFERSCALE_CUDA_WARNINGS}>)
  if(ARG_RAFT)
    # raft::raft (the header-only target of the 26.10 wheel) does not carry the CUDA math
    # libraries its headers call (only raft::compiled does): gemm needs cuBLAS/cuBLASLt,
    # raft::device_resources creates cuSOLVER/cuSPARSE handles, raft::random uses cuRAND.
    target_link_libraries(${target} PRIVATE raft::raft rmm::rmm CUDA::cublas CUDA::cublasLt
                                            CUDA::cusolver CUDA::cusparse CUDA::curand)
    set_target_properties(${target} PROPERTIES CXX_STANDARD 20 CUDA_STANDARD 20
                                               CXX_STANDARD_REQUIRED ON CUDA_STANDARD_REQUIRED ON)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-Wno-deprecated-declarations>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wno-deprecated-declarations -diag-suppress=1444>)
    target_compile_definitions(${target} PRIVATE INFERSCALE_EXTERN_DEVICE_INSTANCES)
    if(NOT ARG_NO_DEVICE_INSTANCES)
      inferscale_instance_objects(DEVICE)
      target_sources(${target} PRIVATE $<TARGET_OBJECTS:inferscale_device_instances>)
    endif()
  else()
    set_target_properties(${target} PROPERTIES CXX_STANDARD 17 CUDA_STANDARD 17
                                               CXX_STANDARD_REQUIRED ON CUDA_STANDARD_REQUIRED ON)
  endif()
endfunction()

# inferscale_shared_instances(<target> [OWN | OWN_INDEX])
#   The target's units declare the host injection / extraction instances extern
#   (INFERSCALE_EXTERN_TEMPLATES) and link the objects that define them (instances.hpp), so the
#   several hundred dtype x layout x vector-level loops are compiled once per build (for every
#   rotation type at once: detail/inject/host_rotation.hpp) instead of once per unit that injects,
#   and the fact index's members (index.hpp) once instead of once per unit that indexes or serves.
#   OWN: the target compiles those objects itself, with its own flags (tests/contraction checks the
#   host math under -march=native -ffp-contract=fast). OWN_INDEX: the shared injection loops, the
#   index compiled by the target itself (the vLLM extension's units see no CUDA header: the index's
#   device mirror then calls the stand-in runtime, not libcudart, which the shared object calls).
function(inferscale_shared_instances target)
  cmake_parse_arguments(ARG "OWN;OWN_INDEX" "" "" ${ARGN})
  target_compile_definitions(${target} PRIVATE INFERSCALE_EXTERN_TEMPLATES)
  if(ARG_OWN)
    target_sources(${target} PRIVATE ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_loops.cpp
                                     ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_rotations.cpp
                                     ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_index.cpp)
    return()
  endif()
  inferscale_instance_objects(HOST)
  target_sources(${target} PRIVATE $<TARGET_OBJECTS:inferscale_host_instances>)
  if(ARG_OWN_INDEX)
    target_sources(${target} PRIVATE ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_index.cpp)
  else()
    target_sources(${target} PRIVATE $<TARGET_OBJECTS:inferscale_index_instances>)
  endif()
endfunction()

# inferscale_instance_objects([HOST] [DEVICE])
#   Defines the build's shared instance objects once: inferscale_host_instances (the host
#   injection / extraction instances, cmake/host_instances_{loops,rotations}.cpp),
#   inferscale_index_instances (the fact index, cmake/host_instances_index.cpp) and, with RAFT,
#   inferscale_device_instances (cmake/device_instances.cu). An object library compiles with the
#   flags of the folder that defines it, so the top-level CMakeLists.txt calls this before
#   add_subdirectory(tests): the tests' folder lowers its own units' optimisation
#   (tests/CMakeLists.txt), and these objects, shared with the benchmarks, keep the build type's.
function(inferscale_instance_objects)
  cmake_parse_arguments(ARG "HOST;DEVICE" "" "" ${ARGN})
  if(ARG_HOST AND NOT TARGET inferscale_host_instances)
    add_library(inferscale_host_instances OBJECT
                ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_loops.cpp
                ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_rotations.cpp)
    add_library(inferscale_index_instances OBJECT ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/host_instances_index.cpp)
    get_property(_multi GLOBAL PROPERTY GENERATOR_IS_MULTI_CONFIG)
    foreach(_objects inferscale_host_instances inferscale_index_instances)
      inferscale_target_defaults(${_objects})
      target_compile_definitions(${_objects} PRIVATE INFERSCALE_EXTERN_TEMPLATES)
      # Position-independent and hidden, so that a shared module (the vLLM extension) links them
      # as executables do, without exporting them.
      set_target_properties(${_objects} PROPERTIES POSITION_INDEPENDENT_CODE ON
                            CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON)
      if(NOT _multi AND NOT CMAKE_BUILD_TYPE)
        target_compile_options(${_objects} PRIVATE -O3)  # as the benchmarks' fallback
      endif()
    endforeach()
  endif()
  if(ARG_DEVICE AND NOT TARGET inferscale_device_instances)
    add_library(inferscale_device_instances OBJECT ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/device_instances.cu)
    inferscale_target_defaults(inferscale_device_instances RAFT NO_DEVICE_INSTANCES)
    set_target_properties(inferscale_device_instances PROPERTIES POSITION_INDEPENDENT_CODE ON)
  endif()
endfunction()
