// GPU tests of the memory facade's device path (memory.cuh): memory::serve and serve_step from a
// device store inject the host facade's bytes (memory.hpp, tests/memory/memory_host.cpp), in one
// launch per step; a refusal commits nothing. The fixtures are the injection tests'
// (tests/inject/inject_device_common.hpp). Reported skipped by CTest where no GPU is visible.
#include "../inject/inject_device_common.hpp"

using namespace inferscale;
using namespace inferscale_inject_device;

namespace {

namespace mf = inferscale_test::memory_fixtures;

/// The memory of the facade tests (tests/memory/memory_host.cpp) with its store in `where`.
memory make_seam_memory(memory_space where)
{
  return memory{mf::tiny_memory_config(dtype::float32, 64, where)};
}

/// The same deployment with its store on the host and on the device: the prefix, the users
/// added alike, and the engine's own cos/sin table on each side (the same values: computed
/// rope_params may differ in the last bit between the host's and the device's sincos).
struct seam_memories {
  memory host_memory   = make_seam_memory(memory_space::host);
  memory device_memory = make_seam_memory(memory_space::device);
  inferscale_test::fake::branching_model model;
  mf::word_embedder embedder;
  encoding_options o;
  std::vector<float> values = make_rope_cos_sin_values<float>(model.rotation(), 256);
  device_buffer<float> device_values{values};
  rope_cos_sin_table<float> host_table =
    make_rope_cos_sin_table(model.rotation(), values.data(), 256);
  rope_cos_sin_table<float> device_table =
    make_rope_cos_sin_table(model.rotation(), device_values.data(), 256);

  explicit seam_memories(std::vector<std::pair<std::uint64_t, mf::user_data const*>> const& users)
  {
    o.window = 3;
    for (memory* m : {&host_memory, &device_memory}) {
      m->set_instruction_prefix(model, {11, 12, 13}, 1, 0);
      for (auto const& [ns, u] : users) {
        m->add_conversation(model, embedder, ns, u->c, u->facts, u->texts, o);
      }
    }
  }
};

}  // namespace

TEST_CASE(
  "memory::serve from a device store injects the host serve's bytes; a refusal commits "
  "nothing",
  "[gpu][memory]")
{
  mf::user_data const user = mf::make_user(7, 100, 9);
  seam_memories s({{7, &user}});
  memory& host_memory         = s.host_memory;
  memory& device_memory       = s.device_memory;
  mf::word_embedder& embedder = s.embedder;
  auto const& host_table      = s.host_table;
  auto const& device_table    = s.device_table;

  mf::host_cache host_cache;  // 2 layers x (K, V) x 256 slots x 1 head x 4, every element -1
  device_buffer<float> device_storage{host_cache.data};
  slot_adapter device_adapter{
    make_contiguous_cache(
      dtype::float32, device_storage.data(), {2, 2, 256, 1, 4}, {2 * 256 * 4, 256 * 4, 4, 4, 1}),
    {}};
  for (std::int64_t j = 0; j < 256; ++j) {
    device_adapter.slots.push_back(j);
  }
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  injection_workspace small(2);
  REQUIRE_THROWS_AS(
    device_memory.serve(
      embedder, 7, user.texts[4], 2, 5, device_adapter, device_table, device_context{small, ref}),
    logic_error);
  REQUIRE(device_adapter.committed.empty());
  REQUIRE(device_storage.to_host() == host_cache.data);  // untouched: every element still -1

  injection_workspace workspace(64);
  memory_request const h =
    host_memory.serve(embedder, 7, user.texts[4], 2, 5, host_cache, host_table);
  memory_request const d = device_memory.serve(
    embedder, 7, user.texts[4], 2, 5, device_adapter, device_table, device_context{workspace, ref});
  REQUIRE(d.fact_ids == h.fact_ids);
  REQUIRE(d.plan.token_ids == h.plan.token_ids);
  REQUIRE(device_adapter.allocated_at == 5);
  REQUIRE(device_adapter.committed == host_cache.committed);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  std::vector<float> const device = device_storage.to_host();
  REQUIRE(device != std::vector<float>(device.size(), -1.0f));
  REQUIRE(std::memcmp(device.data(), host_cache.data.data(), device.size() * sizeof(float)) == 0);

  // inject() of a prepared plan: the same bytes again, into slots 100 ..
  composition const plan = device_memory.prepare(d.fact_ids, 5);
  for (std::int64_t j = 0; j < 256; ++j) {
    device_adapter.slots[static_cast<std::size_t>(j)] = (j + 100) % 256;
  }
  device_memory.inject(plan, device_adapter, device_table, device_context{workspace, ref});
  mf::host_cache shifted{1, 100};
  host_memory.inject(host_memory.prepare(h.fact_ids, 5), shifted, host_table);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  std::vector<float> const again = device_storage.to_host();
  for (std::int64_t l = 0; l < 2; ++l) {
    for (std::int64_t slot = 100; slot < 100 + plan.length(); ++slot) {
      for (std::int64_t d4 = 0; d4 < 4; ++d4) {
        std::size_t const v = static_cast<std::size_t>(((l * 2 + 1) * 256 + slot) * 4 + d4);
        CAPTURE(l, slot, d4);
        REQUIRE(again[v] == shifted.data[v]);
        REQUIRE(again[v - 256 * 4] == shifted.data[v - 256 * 4]);  // the rotated key
      }
    }
  }
}

TEST_CASE(
  "memory::serve_step from a device store injects the host step's bytes in one launch; a refusal "
  "commits nothing",
  "[gpu][memory]")
{
  mf::user_data const a = mf::make_user(7, 100, 9);
  mf::user_data const b = mf::make_user(8, 200, 6, 2);
  seam_memories s({{7, &a}, {8, &b}});
  memory& host_memory         = s.host_memory;
  memory& device_memory       = s.device_memory;
  mf::word_embedder& embedder = s.embedder;
  auto const& host_table      = s.host_table;
  auto const& device_table    = s.device_table;

  // Three sequences of one cache on each side; sequence i's tokens go to slots 3 j + i.
  mf::host_cache host_cache;
  device_buffer<float> device_storage{host_cache.data};
  paged_kv_cache const device_desc = make_contiguous_cache(
    dtype::float32, device_storage.data(), {2, 2, 256, 1, 4}, {2 * 256 * 4, 256 * 4, 4, 4, 1});
  std::vector<slot_adapter> host_sequences;
  std::vector<slot_adapter> device_sequences;
  for (std::int64_t i = 0; i < 3; ++i) {
    std::vector<std::int64_t> slots;
    for (std::int64_t j = 0; j < 60; ++j) {
      slots.push_back(3 * j + i);
    }
    host_sequences.emplace_back(host_cache.cache(), slots);
    device_sequences.emplace_back(device_desc, slots);
  }
  struct ask {
    std::uint64_t ns;
    std::string query;
    std::int64_t p0;
  };
  std::vector<ask> const asks{{7, a.texts[4], 5}, {8, b.texts[2], 0}, {7, a.texts[6], 9}};
  std::vector<memory_step_request<slot_adapter>> host_requests;
  std::vector<memory_step_request<slot_adapter>> device_requests;
  for (std::size_t i = 0; i < asks.size(); ++i) {
    host_requests.push_back({asks[i].ns, asks[i].query, asks[i].p0, &host_sequences[i]});
    device_requests.push_back({asks[i].ns, asks[i].query, asks[i].p0, &device_sequences[i]});
  }
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Refused before any sequence allocates: a workspace too small for the step's tokens (3 + 2 x 3,
  // 3 + 2 x 2 and 3 + 2 x 3), a host store.
  injection_workspace small(20);
  REQUIRE_THROWS_AS(device_memory.serve_step(
                      embedder, device_requests, 2, device_table, device_context{small, ref}),
                    logic_error);
  injection_workspace workspace(64);
  REQUIRE_THROWS_AS(
    host_memory.serve_step(embedder, host_requests, 2, host_table, device_context{workspace, ref}),
    logic_error);
  for (slot_adapter const& seq : device_sequences) {
    REQUIRE(seq.allocated_at == -1);
    REQUIRE(seq.committed.empty());
  }
  REQUIRE(device_storage.to_host() == host_cache.data);  // untouched: every element still -1

  std::vector<memory_request> const h =
    host_memory.serve_step(embedder, host_requests, 2, host_table);
  std::uint64_t const searches        = device_memory.searches();
  std::vector<memory_request> const d = device_memory.serve_step(
    embedder, device_requests, 2, device_table, device_context{workspace, ref});
  REQUIRE(device_memory.searches() == searches + 1);
  REQUIRE(d.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    REQUIRE(d[i].fact_ids == h[i].fact_ids);
    REQUIRE(d[i].plan.token_ids == h[i].plan.token_ids);
    REQUIRE(device_sequences[i].allocated_at == asks[i].p0);
    REQUIRE(device_sequences[i].committed == std::vector<std::int64_t>{d[i].plan.length()});
    REQUIRE(host_sequences[i].committed == device_sequences[i].committed);
  }
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  std::vector<float> const device = device_storage.to_host();
  REQUIRE(host_cache.data != std::vector<float>(host_cache.data.size(), -1.0f));
  REQUIRE(std::memcmp(device.data(), host_cache.data.data(), device.size() * sizeof(float)) == 0);

  // Forgetting user 8 on the stream: its pages zeroed there (no wait), as the host call does.
  std::vector<std::int64_t> pages;
  for (std::uint64_t id : device_memory.store().namespace_fact_ids(8)) {
    auto const& p = device_memory.store().at(id).pages;
    pages.insert(pages.end(), p.begin(), p.end());
  }
  REQUIRE_FALSE(pages.empty());
  REQUIRE(device_memory.store().pool_to_host() == host_memory.store().pool_to_host());
  REQUIRE(device_memory.erase_namespace(8, ref) == host_memory.erase_namespace(8));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  bytes const pool = device_memory.store().pool_to_host();
  std::size_t const page =
    pool.size() / static_cast<std::size_t>(device_memory.store().num_pages());
  for (std::int64_t p : pages) {
    REQUIRE(std::all_of(pool.begin() + static_cast<std::ptrdiff_t>(p * page),
                        pool.begin() + static_cast<std::ptrdiff_t>((p + 1) * page),
                        [](auto x) { return x == 0; }));
  }
  REQUIRE(pool == host_memory.store().pool_to_host());
  // Adding the user again reuses those pages: the facade's write waits for the zeroing first.
  for (memory* m : {&host_memory, &device_memory}) {
    m->add_conversation(s.model, embedder, 8, b.c, b.facts, b.texts, s.o);
  }
  REQUIRE(device_memory.store().pool_to_host() == host_memory.store().pool_to_host());
}
