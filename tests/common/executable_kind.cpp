// Which kind of test executable this is (catch_main.cpp): compiled once per kind, with
// INFERSCALE_TEST_GPU_EXECUTABLE 1 for the GPU executables and 0 for the host ones.
#ifndef INFERSCALE_TEST_GPU_EXECUTABLE
#error "compile with -DINFERSCALE_TEST_GPU_EXECUTABLE=0 or 1 (tests/CMakeLists.txt)"
#endif

extern bool const inferscale_test_gpu_executable = INFERSCALE_TEST_GPU_EXECUTABLE != 0;
