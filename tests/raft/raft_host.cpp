/**
 * @file raft_host.cpp
 * @brief The RAFT pieces InferScale builds on that need no device, compiled by the C++ compiler:
 * the pinned release's version macros and raft::resources' lazy, per-copy stream settings
 * (raft_gpu.cu holds the device checks).
 */
#include <raft/core/device_resources.hpp>
#include <raft/core/resource/cuda_stream.hpp>
#include <raft/core/resources.hpp>
#include <raft/version_config.hpp>

#include <catch2/catch.hpp>

#include <string>

static_assert(RAFT_VERSION_MAJOR == 26 && RAFT_VERSION_MINOR == 10,
              "InferScale is pinned to RAFT 26.10 (the libraft-cu13==26.10.* wheel)");

TEST_CASE("RAFT version macros name the pinned release", "[raft]")
{
  CHECK(RAFT_VERSION_MAJOR == 26);
  CHECK(RAFT_VERSION_MINOR == 10);
  CHECK(std::string{RAFT_VERSION}.rfind("26.10.", 0) == 0);
}

// raft::resources is lazy: building one and setting or reading its stream touches no device,
// so this runs everywhere. Explicit settings stay local to a copy (the 26.08+ contract the index
// relies on when it hands copies of the caller's handle around).
TEST_CASE("raft::resources: lazy construction and per-copy stream settings", "[raft]")
{
  raft::resources res;
  raft::resource::set_cuda_stream(res, cuda::stream_ref{cudaStreamPerThread});
  CHECK(raft::resource::get_cuda_stream(res).get() == cudaStreamPerThread);

  raft::resources copy = res;
  CHECK(raft::resource::get_cuda_stream(copy).get() == cudaStreamPerThread);
  raft::resource::set_cuda_stream(copy, cuda::stream_ref{cudaStreamLegacy});
  CHECK(raft::resource::get_cuda_stream(copy).get() == cudaStreamLegacy);
  CHECK(raft::resource::get_cuda_stream(res).get() == cudaStreamPerThread);

  raft::device_resources device_res{cuda::stream_ref{cudaStreamPerThread}};
  CHECK(raft::resource::get_cuda_stream(device_res).get() == cudaStreamPerThread);
}
