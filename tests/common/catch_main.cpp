// Catch2 runner shared by every test executable.
//
// Each executable holds host tests and GPU tests (tagged [gpu]). CTest runs it twice: with the
// filter "~[gpu]" (runs everywhere) and with "[gpu]"; in the second form, when no CUDA device is
// visible, the runner exits with INFERSCALE_SKIP_RETURN_CODE, which CTest reports as skipped
// (SKIP_RETURN_CODE), never as passed.
#define CATCH_CONFIG_RUNNER
#include <inferscale/cuda_error.hpp>

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>

#ifndef INFERSCALE_SKIP_RETURN_CODE
#define INFERSCALE_SKIP_RETURN_CODE 77
#endif

int main(int argc, char* argv[])
{
  bool gpu_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "[gpu]") == 0) { gpu_only = true; }
  }
  if (gpu_only && inferscale::visible_device_count() == 0) {
    std::printf("no CUDA device visible: GPU tests skipped\n");
    return INFERSCALE_SKIP_RETURN_CODE;
  }
  return Catch::Session().run(argc, argv);
}
