// Catch2 runner shared by every test executable.
//
// A test folder builds a host executable (its .cpp files, C++ compiler only) and, where CUDA is
// enabled, a GPU executable (tests/CMakeLists.txt). This runner is compiled once (10 s of CPU:
// Catch2's whole implementation) and linked into both kinds with a one-line unit that names the
// kind (executable_kind.cpp, compiled with INFERSCALE_TEST_GPU_EXECUTABLE 0 or 1: its
// inferscale_test_gpu_executable). It checks, before anything runs, that every test case
// sits in the executable its tags name: a GPU executable holds only cases tagged [gpu] (they need
// a device) or [cuda_host] (compiled by nvcc, run without a device), a host executable none of
// them. A misplaced case fails the run, so no case is left out of both CTest entries.
//
// CTest runs the host executable as "<concept>.host" with the filter "~[gpu]", the GPU executable
// as "<concept>.gpu" with the filter "[gpu]" (and "<concept>.cuda_host" with "[cuda_host]" where a
// folder has such cases). With the filter "[gpu]" and no CUDA device visible, the runner exits
// with INFERSCALE_SKIP_RETURN_CODE, which CTest reports as skipped (SKIP_RETURN_CODE), never as
// passed.
#define CATCH_CONFIG_RUNNER
#include <inferscale/cuda_error.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#ifndef INFERSCALE_SKIP_RETURN_CODE
#define INFERSCALE_SKIP_RETURN_CODE 77
#endif
// Defined by executable_kind.cpp: true in a GPU executable, false in a host one.
extern bool const inferscale_test_gpu_executable;

namespace {

bool has_tag(Catch::TestCaseInfo const& info, char const* tag)
{
  return std::find(info.lcaseTags.begin(), info.lcaseTags.end(), std::string{tag}) !=
         info.lcaseTags.end();
}

/// The number of test cases registered in the wrong kind of executable, each named on stderr.
int misplaced_cases()
{
  bool const gpu_executable = inferscale_test_gpu_executable;
  int misplaced             = 0;
  for (Catch::TestCase const& test : Catch::getRegistryHub().getTestCaseRegistry().getAllTests()) {
    bool const device_side = has_tag(test, "gpu") || has_tag(test, "cuda_host");
    if (device_side != gpu_executable) {
      std::fprintf(
        stderr,
        "misplaced test case (%s:%zu): \"%s\" is %s but is compiled into the %s "
        "executable\n",
        test.lineInfo.file,
        test.lineInfo.line,
        test.name.c_str(),
        device_side ? "tagged [gpu] or [cuda_host]" : "tagged neither [gpu] nor [cuda_host]",
        gpu_executable ? "GPU" : "host");
      ++misplaced;
    }
  }
  return misplaced;
}

}  // namespace

int main(int argc, char* argv[])
{
  if (misplaced_cases() != 0) { return 1; }
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
