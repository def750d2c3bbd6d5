// Device stores and snapshots: a device store saves the same bytes as a host store with the same
// history, and a snapshot loaded into device memory (as saved, or converted) holds the same pool
// and catalogue as the same snapshot loaded into host memory. Reported skipped by CTest where no
// GPU is visible.
#include "snapshot_common.hpp"

#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

using namespace inferscale;
using namespace inferscale_test::snapshot;

TEST_CASE("snapshot: device stores save and load the bytes host stores do", "[gpu][snapshot]")
{
  scratch_dir dir;
  dtype const t = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_store const host   = scrambled_store(t, memory_space::host);
  kv_store const device = scrambled_store(t, memory_space::device);
  save_store(host, dir.file("host.iskv"));
  save_store(device, dir.file("device.iskv"));
  REQUIRE(read_bytes(dir.file("host.iskv")) == read_bytes(dir.file("device.iskv")));

  for (dtype to : {dtype::float32, dtype::float16, dtype::bfloat16}) {
    CAPTURE(to_string(to));
    store_load_options on_host;
    on_host.store_dtype          = to;
    store_load_options on_device = on_host;
    on_device.space              = memory_space::device;
    kv_store const a             = load_store(dir.file("host.iskv"), on_host);
    kv_store const b             = load_store(dir.file("host.iskv"), on_device);
    CHECK(b.space() == memory_space::device);
    CHECK(a.pool_to_host() == b.pool_to_host());
    for (std::uint64_t id : scrambled_ids) {
      CHECK(a.at(id).pages == b.at(id).pages);
      CHECK(a.at(id).token_ids == b.at(id).token_ids);
    }
    save_store(a, dir.file("a.iskv"));
    save_store(b, dir.file("b.iskv"));
    CHECK(read_bytes(dir.file("a.iskv")) == read_bytes(dir.file("b.iskv")));
  }
}
