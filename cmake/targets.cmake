# Helpers shared by tests, benchmarks and examples: warnings as errors on our own targets.

set(INFERSCALE_CXX_WARNINGS -Wall -Wextra -Wpedantic -Werror)
set(INFERSCALE_CUDA_WARNINGS -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror)

# inferscale_target_defaults(<target> [RAFT])
#   Warnings as errors, the build's single CCCL, the CUDA runtime; RAFT targets get raft::raft,
#   C++20 (RAFT needs std::source_location) and silence RAFT's own deprecation warnings.
function(inferscale_target_defaults target)
  cmake_parse_arguments(ARG "RAFT" "" "" ${ARGN})
  target_link_libraries(${target} PRIVATE inferscale::inferscale CCCL::CCCL CUDA::cudart)
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
  else()
    set_target_properties(${target} PROPERTIES CXX_STANDARD 17 CUDA_STANDARD 17
                                               CXX_STANDARD_REQUIRED ON CUDA_STANDARD_REQUIRED ON)
  endif()
endfunction()
