// GPU tests of injection and extraction: the device backend (inject.cuh) against the host backend
// (inject.hpp), which shares its per-element code, so the two must agree byte for byte over the
// whole storage of an engine's cache (padding included) for every engine layout of
// tests/common/engine_caches.hpp and every store -> cache dtype pair. The rotation is an engine
// cos/sin table (the same values on both sides); with computed rope_params the host's and the
// device's sincos may differ in the last fp32 bit, so that case is compared to one unit in the
// last place of the cache dtype. Also: CUDA-graph capture and replay with restaged positions, the
// raw launch's skipping of out-of-range slots and positions, device extraction against host
// extraction, refused checked launches leaving the cache unchanged, and the injection workspace's
// resources. The device seam (engine.cuh, memory.cuh) is tested in tests/engine/engine_gpu.cu and
// tests/memory/memory_gpu.cu, with the fixtures of inject_device_common.hpp. Reported skipped by
// CTest where no GPU is visible.
#include "inject_device_common.hpp"

using namespace inferscale;
using namespace inferscale_inject_device;

TEMPLATE_TEST_CASE("device injection equals the host injection byte for byte",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3,
                   fp16_to_fp16,
                   fp32_to_e5m2)
{
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g      = GENERATE(from_range(geometry_cases()));
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<TestType> s(layout, g);
  require_device_equals_host(s, false);
}

TEMPLATE_TEST_CASE("device injection from compressed facts equals the host run byte for byte",
                   "[gpu][inject][compression]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3)
{
  // fp8 e4m3 and int4 pages (compression.hpp), dequantized by the kernel's scalar path.
  auto const layout      = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g           = GENERATE(from_range(geometry_cases()));
  auto const compression = GENERATE(kv_compression::fp8_e4m3, kv_compression::int4);
  CAPTURE(inferscale_test::to_string(layout), g.name, to_string(compression));
  scenario<TestType> s(layout, g, default_rows, compression);
  require_device_equals_host(s, false);
}

TEMPLATE_TEST_CASE("device injection with a per-layer rotation equals the host run byte for byte",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32)
{
  // Gemma's shape: two bases, every third layer at the other one. The kernel takes the rotations
  // by value (device_layer_rotation) and its tile holds both; the host run is checked against
  // single rotations and a double-precision reference (inject_simd_host.cpp).
  using S           = typename TestType::store_t;
  using C           = typename TestType::cache_t;
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g      = GENERATE(from_range(geometry_cases()));
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<TestType> s(layout, g);
  rope_params const other = make_params(g, 1000000.0);
  std::vector<S> const t2 = make_rope_cos_sin_values<S>(other, default_rows);
  device_buffer<S> const d2{t2};
  std::vector<std::int32_t> layers(static_cast<std::size_t>(g.layers));
  for (std::int32_t l = 0; l < g.layers; ++l) {
    layers[static_cast<std::size_t>(l)] = l % 3 == 2 ? 0 : 1;
  }
  rope_cos_sin_table<S> const host_tables[2] = {
    s.host_rotation, make_rope_cos_sin_table(other, t2.data(), default_rows, g.round_each)};
  rope_cos_sin_table<S> const device_tables[2] = {
    s.device_rotation, make_rope_cos_sin_table(other, d2.data(), default_rows, g.round_each)};
  per_layer_rotation<rope_cos_sin_table<S>> const host_layers{
    host_tables, 2, layers.data(), g.layers};
  per_layer_rotation<rope_cos_sin_table<S>> const device_layers{
    device_tables, 2, layers.data(), g.layers};
  injection_batch hb = make_batch(s.host_store, 0);
  injection_batch db = make_batch(s.device_store, 0);
  hb.run(s.host_desc, host_layers);
  cuda_stream stream;
  injection_workspace workspace(db.num_tokens());
  db.run<S, C>(
    s.device_desc, device_layers, device_context{workspace, cuda::stream_ref{stream.get()}});
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);
  REQUIRE(first_difference(device, host) == -1);
}

TEMPLATE_TEST_CASE("device injection of a batch larger than a wave equals the host injection",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   bf16_to_e4m3)
{
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  CAPTURE(inferscale_test::to_string(layout));
  scenario<TestType> s(layout, large_case());
  require_device_equals_host(s, true);
}

TEMPLATE_TEST_CASE("device injection with computed rope_params is within one unit of the host's",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3)
{
  using S           = typename TestType::store_t;
  using C           = typename TestType::cache_t;
  auto const layout = GENERATE(engine_layout::vllm_flash_attn_nhd, engine_layout::vllm_legacy);
  auto const g      = GENERATE(from_range(geometry_cases()));
  auto const mode   = GENERATE(rope_angle_mode::fp32, rope_angle_mode::exact);
  CAPTURE(inferscale_test::to_string(layout), g.name, static_cast<int>(mode));
  scenario<TestType> s(layout, g);
  rope_params params = s.params;
  params.angle_mode  = mode;
  // Positions near 90000: large angles, where the two sincos implementations differ most.
  injection_batch hb = make_batch(s.host_store, 90000);
  injection_batch db = make_batch(s.device_store, 90000);
  hb.run(s.host_desc, params);
  cuda_stream stream;
  injection_workspace workspace(db.num_tokens());
  db.run<S, C>(s.device_desc, params, device_context{workspace, cuda::stream_ref{stream.get()}});
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);
  std::size_t const n = host.size() / sizeof(C);
  std::vector<C> h(n), d(n);
  std::memcpy(h.data(), host.data(), n * sizeof(C));
  std::memcpy(d.data(), device.data(), n * sizeof(C));
  // Only the rotated dims of written keys may differ; everything else is copied or converted
  // without cos/sin and must be identical.
  std::vector<bool> rotated(n, false);
  for (std::int64_t slot : hb.slots()) {
    if (slot < 0) { continue; }
    for (std::int32_t l = 0; l < g.layers; ++l) {
      for (std::int32_t head = 0; head < g.heads; ++head) {
        for (std::int32_t dim = 0; dim < g.rotary_dim; ++dim) {
          rotated[element_index(s.cache, s.cache.key(l, slot, head, dim))] = true;
        }
      }
    }
  }
  float const unit      = std::ldexp(1.0f, -mantissa_bits<C>());
  std::size_t differing = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&h[i], &d[i], sizeof(C)) == 0) { continue; }
    ++differing;
    float const a = to_float(h[i]), b = to_float(d[i]);
    CAPTURE(i, a, b);
    REQUIRE(rotated[i]);
    // cos/sin differ by an fp32 ulp or two, |x| + |y| < 16: below 1e-5 before the final rounding,
    // which then moves a result by at most one unit of the cache dtype.
    REQUIRE(std::fabs(a - b) <= unit * std::max({1.0f, std::fabs(a), std::fabs(b)}) + 1e-5f);
  }
  INFO(differing << " of " << n << " elements differ");
  SUCCEED();
}

TEMPLATE_TEST_CASE("a captured CUDA graph of the raw injection replays restaged positions",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   bf16_to_e4m3)
{
  auto const layout = GENERATE(engine_layout::vllm_flash_attn_nhd,
                               engine_layout::vllm_legacy,
                               engine_layout::tensorrt_llm_pool);
  auto const g      = geometry_cases()[0];
  CAPTURE(inferscale_test::to_string(layout));
  scenario<TestType> s(layout, g, 4096);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Captured with the batch at its first positions; replayed after restaging the same tokens and
  // slots at positions shifted by 700, then by 1900.
  injection_batch const first  = make_batch(s.device_store, 0);
  injection_batch const second = make_batch(s.device_store, 700);
  injection_batch const third  = make_batch(s.device_store, 1900);
  REQUIRE(second.slots() == first.slots());
  REQUIRE(third.slots() == first.slots());
  REQUIRE(second.positions() != first.positions());
  injection_workspace workspace(first.num_tokens());
  workspace.stage(first, ref);

  struct graph_owner {
    cudaGraph_t graph{};
    cudaGraphExec_t exec{};
    ~graph_owner()
    {
      if (exec) { (void)cudaGraphExecDestroy(exec); }
      if (graph) { (void)cudaGraphDestroy(graph); }
    }
  } owner;
  INFERSCALE_CUDA_TRY(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  try {
    detail::inject_view_async<typename TestType::store_t, typename TestType::cache_t>(
      s.device_store.ref(), workspace.view(), s.device_desc, s.device_rotation, nullptr, ref);
  } catch (...) {
    (void)cudaStreamEndCapture(stream.get(), &owner.graph);
    throw;
  }
  INFERSCALE_CUDA_TRY(cudaStreamEndCapture(stream.get(), &owner.graph));
  INFERSCALE_CUDA_TRY(cudaGraphInstantiate(&owner.exec, owner.graph, 0));
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);  // nothing ran yet

  bytes after_second;
  for (auto const* batch : {&second, &third}) {
    std::int64_t const shift = batch == &second ? 700 : 1900;
    CAPTURE(shift);
    workspace.stage(*batch, ref);
    INFERSCALE_CUDA_TRY(cudaGraphLaunch(owner.exec, stream.get()));
    make_batch(s.host_store, shift).run(s.host_desc, s.host_rotation);
    bytes const device = s.device_bytes(stream.get());
    REQUIRE(first_difference(device, s.host_bytes()) == -1);
    if (batch == &second) {
      after_second = device;
    } else {
      REQUIRE(first_difference(device, after_second) != -1);  // the new positions took effect
    }
  }
}

namespace {
/// Holds a stream for about `cycles` SM clock cycles (a launch that is still to come behind it).
__global__ void hold_stream(long long cycles)
{
  long long const start = clock64();
  while (clock64() - start < cycles) {}
}
}  // namespace

TEST_CASE("staging on another stream waits for the launch still to read the previous arrays",
          "[gpu][inject]")
{
  // Stream A: stage the first batch, hold, then the raw injection that reads the staged arrays
  // (marked as their user). Stream B stages a second batch (same slots, positions + 700) while A
  // still holds. Without the device-side wait, B's copy would land first and A would inject the
  // second batch's positions.
  auto const g = geometry_cases()[0];
  scenario<bf16_to_bf16> s(engine_layout::vllm_flash_attn_nhd, g, 4096);
  cuda_stream a, b;
  injection_batch const first  = make_batch(s.device_store, 0);
  injection_batch const second = make_batch(s.device_store, 700);
  REQUIRE(second.positions() != first.positions());
  injection_workspace workspace(first.num_tokens());
  workspace.stage(first, cuda::stream_ref{a.get()});
  hold_stream<<<1, 1, 0, a.get()>>>(200'000'000ll);  // about 0.1 s
  INFERSCALE_CUDA_TRY(cudaGetLastError());
  detail::inject_view_async<bfloat16_t, bfloat16_t>(s.device_store.ref(),
                                                    workspace.view(),
                                                    s.device_desc,
                                                    s.device_rotation,
                                                    nullptr,
                                                    cuda::stream_ref{a.get()});
  workspace.mark_used(cuda::stream_ref{a.get()});
  workspace.stage(second, cuda::stream_ref{b.get()});
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(b.get()));

  make_batch(s.host_store, 0).run(s.host_desc, s.host_rotation);
  REQUIRE(first_difference(s.device_bytes(a.get()), s.host_bytes()) == -1);
}

namespace {

/// Raw launch over device arrays the host never checked: tokens whose slot lies outside the cache
/// or whose position lies outside the table (beyond it, or negative) are skipped.
template <class Pair>
void require_raw_launch_skips(engine_layout layout, geometry_case const& g)
{
  using S = typename Pair::store_t;
  using C = typename Pair::cache_t;
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<Pair> s(layout, g);
  std::vector<request> const requests = make_requests(s.host_store, 0);
  std::vector<std::int64_t> store_tokens, positions, device_slots;
  std::vector<std::vector<std::int64_t>> host_slots;  // per request; -1 where the device skips
  {
    injection_batch const batch = make_batch(s.host_store, 0);
    store_tokens                = batch.store_tokens();
    positions                   = batch.positions();
    device_slots                = batch.slots();
  }
  std::int64_t const n = static_cast<std::int64_t>(store_tokens.size());
  std::vector<std::int64_t> free_slots;  // slots no request writes: must stay untouched
  for (std::int32_t b : unused_blocks()) {
    for (std::int32_t t = 0; t < block_size; ++t) {
      free_slots.push_back(std::int64_t{b} * block_size + t);
    }
  }
  std::int64_t const rows      = s.device_rotation.max_position;
  std::int64_t const num_slots = s.device_desc.num_slots();
  std::size_t next_free        = 0;
  std::int64_t i               = 0;  // token of the batch
  for (request const& r : requests) {
    std::vector<std::int64_t> slots = r.slots();
    for (std::int64_t j = 0; j < r.plan.length(); ++j, ++i) {
      auto const k = static_cast<std::size_t>(i);
      REQUIRE(device_slots[k] == slots[static_cast<std::size_t>(j)]);
      switch (i % 6) {
        case 1:  // position beyond the table, a writable slot
          positions[k]    = rows + 13 * i;
          device_slots[k] = free_slots.at(next_free++);
          break;
        case 3:  // negative position, a writable slot
          positions[k]    = -1 - i;
          device_slots[k] = free_slots.at(next_free++);
          break;
        case 5:  // slot beyond the cache
          device_slots[k] = i % 12 == 5 ? num_slots + i : std::numeric_limits<std::int64_t>::max();
          break;
        default: continue;
      }
      slots[static_cast<std::size_t>(j)] = -1;
    }
    host_slots.push_back(std::move(slots));
  }
  REQUIRE(i == n);
  std::vector<std::int64_t> arrays = store_tokens;
  arrays.insert(arrays.end(), positions.begin(), positions.end());
  arrays.insert(arrays.end(), device_slots.begin(), device_slots.end());
  device_buffer<std::int64_t> device_arrays(arrays);
  INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
  injection_batch_view const view{
    device_arrays.data(), device_arrays.data() + n, device_arrays.data() + 2 * n, n};
  cuda_stream stream;
  device_buffer<inject_device_errors> errors(std::vector<inject_device_errors>(1));
  detail::inject_view_async<S, C>(s.device_store.ref(),
                                  view,
                                  s.device_desc,
                                  s.device_rotation,
                                  errors.data(),
                                  cuda::stream_ref{stream.get()});
  inject_device_errors counted{};
  INFERSCALE_CUDA_TRY(cudaMemcpy(&counted, errors.data(), sizeof counted, cudaMemcpyDeviceToHost));
  // Every corrupted token is counted once: i % 6 == 1 or 3 (positions), i % 6 == 5 (slots).
  unsigned long long bad_positions = 0, bad_slots = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    bad_positions += (t % 6 == 1 || t % 6 == 3) ? 1 : 0;
    bad_slots += t % 6 == 5 ? 1 : 0;
  }
  CHECK(counted.bad_position == bad_positions);
  CHECK(counted.bad_slot == bad_slots);
  CHECK(counted.bad_store_token == 0);
  CHECK(counted.bad_scale == 0);

  // Expected: the host backend on the same requests with the skipped tokens' slots negative.
  injection_batch expected(s.host_store);
  for (std::size_t r = 0; r < requests.size(); ++r) {
    expected.add(requests[r].plan, host_slots[r]);
  }
  REQUIRE(expected.store_tokens() == store_tokens);
  expected.run(s.host_desc, s.host_rotation);
  bytes const device = s.device_bytes(stream.get());
  bytes const host   = s.host_bytes();
  REQUIRE(first_difference(host, s.original) != -1);
  REQUIRE(first_difference(device, host) == -1);
  // The free slots given to skipped tokens are untouched (also implied by the equality above).
  for (std::size_t j = 0; j < next_free; ++j) {
    for (std::int32_t l = 0; l < g.layers; ++l) {
      for (std::int32_t h = 0; h < g.heads; ++h) {
        for (std::int32_t d = 0; d < g.head_dim; ++d) {
          std::size_t const ko =
            element_index(s.cache, s.cache.key(l, free_slots[j], h, d)) * sizeof(C);
          std::size_t const vo =
            element_index(s.cache, s.cache.value(l, free_slots[j], h, d)) * sizeof(C);
          REQUIRE(std::memcmp(&device[ko], &s.original[ko], sizeof(C)) == 0);
          REQUIRE(std::memcmp(&device[vo], &s.original[vo], sizeof(C)) == 0);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("the raw device injection skips slots beyond the cache and positions beyond the table",
          "[gpu][inject]")
{
  auto const cases = geometry_cases();
  SECTION("vLLM FlashAttention NHD, bf16 -> bf16, vectorized")
  {
    require_raw_launch_skips<bf16_to_bf16>(engine_layout::vllm_flash_attn_nhd, cases[0]);
  }
  SECTION("vLLM legacy, bf16 -> fp8 e4m3 per-head scales, scalar")
  {
    require_raw_launch_skips<bf16_to_e4m3>(engine_layout::vllm_legacy, cases[2]);
  }
  SECTION("SGLang token pool, fp32 -> fp32")
  {
    require_raw_launch_skips<fp32_to_fp32>(engine_layout::sglang_token_pool, cases[1]);
  }
}

TEMPLATE_TEST_CASE("device extraction equals host extraction",
                   "[gpu][inject]",
                   bf16_to_bf16,
                   fp32_to_fp32,
                   bf16_to_e4m3,
                   fp16_to_fp16,
                   fp32_to_e5m2)
{
  auto const layout = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const g      = GENERATE(from_range(geometry_cases()));
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<TestType> s(layout, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Inject first, so that one extracted span holds injected keys (request A's 27 tokens at their
  // positions 12..); the other is 19 random tokens in unused blocks at positions 777...
  injection_batch hb = make_batch(s.host_store, 0);
  injection_batch db = make_batch(s.device_store, 0);
  hb.run(s.host_desc, s.host_rotation);
  injection_workspace workspace(db.num_tokens());
  using S = typename TestType::store_t;
  using C = typename TestType::cache_t;
  db.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref});
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);

  std::vector<std::int32_t> const blocks = unused_blocks();
  struct span {
    std::uint64_t id;
    std::vector<std::int64_t> slots;
    std::int64_t first_position;
  };
  std::vector<span> const spans{
    {500, slots_from_block_table(blocks.data(), 2, block_size, 5, 19), 777},
    {501, std::vector<std::int64_t>(hb.slots().begin(), hb.slots().begin() + 27), 12}};
  for (auto const& sp : spans) {
    std::vector<std::int32_t> ids(sp.slots.size());
    for (std::size_t j = 0; j < ids.size(); ++j) {
      ids[j] = 7000 + static_cast<std::int32_t>(j);
    }
    extract_host(
      s.host_desc, sp.slots, sp.first_position, s.host_rotation, s.host_store, sp.id, 3, ids);
    extract<S, C>(s.device_desc,
                  sp.slots,
                  sp.first_position,
                  s.device_rotation,
                  s.device_store,
                  sp.id,
                  3,
                  ids,
                  ref);
  }
  // The new facts' pages, byte for byte (the other rows of their last pages are the same on both
  // sides too: both pools start zeroed and saw the same inserts).
  bytes const host_pool        = s.host_store.pool_to_host();
  bytes const device_pool      = s.device_store.pool_to_host();
  std::size_t const page_bytes = host_pool.size() / static_cast<std::size_t>(store_pages);
  for (auto const& sp : spans) {
    fact_record const& hf = s.host_store.at(sp.id);
    fact_record const& df = s.device_store.at(sp.id);
    REQUIRE(hf.pages == df.pages);
    REQUIRE(df.token_ids == hf.token_ids);
    for (std::int64_t page : hf.pages) {
      CAPTURE(sp.id, page);
      std::size_t const at = static_cast<std::size_t>(page) * page_bytes;
      REQUIRE(std::memcmp(&host_pool[at], &device_pool[at], page_bytes) == 0);
    }
  }
  REQUIRE(first_difference(host_pool, device_pool) == -1);
  // Extraction reads the cache only.
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);
}

namespace {

/// Every refusal of the checked device run leaves the device cache as it was.
template <class Pair>
void require_refusals_leave_cache_unchanged(engine_layout layout, geometry_case const& g)
{
  using S = typename Pair::store_t;
  using C = typename Pair::cache_t;
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<Pair> s(layout, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  injection_workspace workspace(256);
  auto const unchanged = [&] {
    REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);
  };
  std::vector<std::int32_t> const blocks = unused_blocks();
  compose_options near{};
  near.first_position    = 40;
  near.order             = fact_order::as_given;
  composition const plan = compose(s.device_store, {11, 13}, near);  // 8 tokens
  auto const free_slots  = slots_from_block_table(blocks.data(), 1, block_size, 0, plan.length());

  SECTION("a slot beyond the cache")
  {
    injection_batch batch(s.device_store);
    auto slots = free_slots;
    slots[5]   = s.device_desc.num_slots();
    batch.add(plan, slots);
    REQUIRE_THROWS_AS(
      (batch.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
  }
  SECTION("a position beyond the table")
  {
    compose_options far{};
    far.first_position = s.device_rotation.max_position - 4;
    far.order          = fact_order::as_given;
    injection_batch batch(s.device_store);
    batch.add(compose(s.device_store, {11, 13}, far), free_slots);
    REQUIRE_THROWS_AS(
      (batch.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
  }
  SECTION("a workspace too small for the batch")
  {
    injection_batch batch = make_batch(s.device_store, 0);
    injection_workspace small(batch.num_tokens() - 1);
    REQUIRE_THROWS_AS(
      (batch.run<S, C>(s.device_desc, s.device_rotation, device_context{small, ref})), logic_error);
    unchanged();
  }
  SECTION("a batch of a host store")
  {
    injection_batch host_batch = make_batch(s.host_store, 0);
    REQUIRE_THROWS_AS(
      (host_batch.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
  }
  SECTION("a stale batch, then a fresh one is accepted")
  {
    injection_batch stale = make_batch(s.device_store, 0);
    insert_fact(s.device_store, 900, 2, 3, g);
    insert_fact(s.host_store, 900, 2, 3, g);
    REQUIRE_THROWS_AS(
      (stale.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
      logic_error);
    unchanged();
    injection_batch fresh = make_batch(s.device_store, 0);
    fresh.run<S, C>(s.device_desc, s.device_rotation, device_context{workspace, ref});
    make_batch(s.host_store, 0).run(s.host_desc, s.host_rotation);
    REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);
  }
}

}  // namespace

TEST_CASE("a refused checked device injection leaves the cache unchanged", "[gpu][inject]")
{
  auto const cases = geometry_cases();
  SECTION("vLLM FlashAttention HND, bf16 -> fp8 e4m3")
  {
    require_refusals_leave_cache_unchanged<bf16_to_e4m3>(engine_layout::vllm_flash_attn_hnd,
                                                         cases[0]);
  }
  SECTION("vLLM legacy, fp32 -> fp32")
  {
    require_refusals_leave_cache_unchanged<fp32_to_fp32>(engine_layout::vllm_legacy, cases[2]);
  }
}

TEST_CASE(
  "the dtype dispatch and a named dtype pair launch the same kernels; a wrong pair is "
  "refused",
  "[gpu][inject]")
{
  // Every other test here names its pair (run<S, C>, extract<S, C>), which compiles only
  // that pair's kernels; this one goes through the run-time dispatch (all fifteen pairs compiled
  // for the bfloat16 table) and checks it lands on the same bytes as the host.
  auto const g = geometry_cases()[0];
  scenario<bf16_to_bf16> s(engine_layout::vllm_flash_attn_nhd, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  injection_batch db = make_batch(s.device_store, 0);
  injection_workspace workspace(db.num_tokens());

  // A pair other than the store's and the cache's: refused before staging, cache unchanged.
  REQUIRE_THROWS_AS(
    (db.run<float, float>(s.device_desc, s.device_rotation, device_context{workspace, ref})),
    logic_error);
  REQUIRE_THROWS_AS((db.run<bfloat16_t, float8_e4m3_t>(
                      s.device_desc, s.device_rotation, device_context{workspace, ref})),
                    logic_error);
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);

  db.run(s.device_desc, s.device_rotation, device_context{workspace, ref});
  make_batch(s.host_store, 0).run(s.host_desc, s.host_rotation);
  REQUIRE(first_difference(s.host_bytes(), s.original) != -1);
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.host_bytes()) == -1);

  // Extraction through the dispatch: the first 27 injected tokens back into both stores.
  std::vector<std::int64_t> const slots(db.slots().begin(), db.slots().begin() + 27);
  std::vector<std::int32_t> ids(slots.size(), 7);
  REQUIRE_THROWS_AS(
    (extract<float, bfloat16_t>(
      s.device_desc, slots, 12, s.device_rotation, s.device_store, 600, 3, ids, ref)),
    logic_error);
  REQUIRE_FALSE(s.device_store.contains(600));
  extract_host(s.host_desc, slots, 12, s.host_rotation, s.host_store, 600, 3, ids);
  extract(s.device_desc, slots, 12, s.device_rotation, s.device_store, 600, 3, ids, ref);
  REQUIRE(s.host_store.at(600).pages == s.device_store.at(600).pages);
  REQUIRE(first_difference(s.host_store.pool_to_host(), s.device_store.pool_to_host()) == -1);
}

// injection_workspace's resources: the device arrays ([3][capacity] int64 and the error counters)
// come from the device resource, the staging ([3][capacity] int64) from the pinned one, all on
// the null stream, and each goes back on destruction; staged arrays read back as staged.
TEST_CASE("an injection workspace allocates through the resources it is given",
          "[gpu][inject][memory_resource]")
{
  inferscale_test::counting_resource device{default_device_resource()};
  inferscale_test::counting_resource pinned{pinned_host_resource()};
  std::int64_t const capacity = 5;
  std::vector<std::int64_t> const tokens{7, 8, 9}, positions{100, 101, 102}, slots{3, -1, 40};
  {
    injection_workspace workspace(capacity, &device, &pinned);
    REQUIRE(device.allocations.size() == 2);
    REQUIRE(device.allocations[0].bytes == 3 * 5 * sizeof(std::int64_t));
    REQUIRE(device.allocations[1].bytes == sizeof(inject_device_errors));
    REQUIRE(pinned.allocations.size() == 1);
    REQUIRE(pinned.allocations[0].bytes == 3 * 5 * sizeof(std::int64_t));
    for (auto const& a : device.allocations) {
      REQUIRE(a.stream == nullptr);
    }
    REQUIRE(workspace.view().store_token == device.allocations[0].pointer);
    REQUIRE(workspace.device_errors() == device.allocations[1].pointer);

    cuda_stream stream;
    workspace.stage(injection_batch_view{tokens.data(), positions.data(), slots.data(), 3},
                    cuda::stream_ref{stream.get()});
    INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
    injection_batch_view const v = workspace.view();
    REQUIRE(v.num_tokens == 3);
    auto const back = [&](std::int64_t const* p) {
      std::vector<std::int64_t> out(3);
      INFERSCALE_CUDA_TRY(
        cudaMemcpy(out.data(), p, 3 * sizeof(std::int64_t), cudaMemcpyDeviceToHost));
      return out;
    };
    REQUIRE(back(v.store_token) == tokens);
    REQUIRE(back(v.position) == positions);
    REQUIRE(back(v.slot) == slots);
    REQUIRE(workspace.read_errors(cuda::stream_ref{stream.get()}).total() == 0);  // zeroed
    injection_workspace moved{std::move(workspace)};  // no second free of anything
    REQUIRE(device.deallocations.empty());
    REQUIRE(pinned.deallocations.empty());
  }
  REQUIRE(device.deallocations.size() == 2);
  REQUIRE(pinned.deallocations.size() == 1);
  REQUIRE(pinned.deallocations[0].pointer == pinned.allocations[0].pointer);
}
