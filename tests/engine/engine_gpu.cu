// GPU tests of the engine seam (engine.cuh, kv_capture.cuh): a capture stored into a device
// store on a stream and one request injected from a device store through a cache adapter, each
// equal byte for byte to the host seam's result (engine.hpp); the device capture buffer filled
// from engine-dtype device rows and stored on the device against the host capture stored, byte for
// byte; encode_facts with a device model adapter; refusals changing nothing. The fixtures are the
// injection tests' (tests/inject/inject_device_common.hpp). Reported skipped by CTest where no GPU
// is visible; the one case that needs nvcc but no device (store_captured_facts on a stream into a
// host store, tagged [cuda_host]) runs everywhere as engine.cuda_host.
#include "../inject/inject_device_common.hpp"

using namespace inferscale;
using namespace inferscale_inject_device;

namespace {

template <class Pair>
void require_seam_equals_host(engine_layout layout, geometry_case const& g)
{
  CAPTURE(inferscale_test::to_string(layout), g.name);
  scenario<Pair> s(layout, g);
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // 1. A capture's ranges stored on the stream land in the device pool as a host insert writes
  // them into the host pool (the stores share their history, so the same pages; the populated
  // history leaves the free pages out of order, so a fact's pages are not one run).
  kv_capture const capture = make_capture(s.device_store.geometry(), 40);
  std::vector<captured_fact> const captured{
    {201, 7, 0, token_ids(2010, 9)}, {202, 7, 9, token_ids(2020, 17)}, {203, 7, 39, {2030}}};
  store_captured_facts(s.host_store, capture, captured);
  store_captured_facts(s.device_store, capture, captured, ref);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  for (captured_fact const& f : captured) {
    REQUIRE(s.device_store.at(f.fact_id).pages == s.host_store.at(f.fact_id).pages);
    REQUIRE(s.device_store.at(f.fact_id).token_ids == f.token_ids);
  }
  REQUIRE(first_difference(s.device_store.pool_to_host(), s.host_store.pool_to_host()) == -1);

  // Refusals store nothing: an id already stored, a fact beyond the capture, more pages than are
  // free (five 40-token facts), an incomplete capture, a NaN.
  store_state const before = state_of(s.device_store);
  REQUIRE_THROWS_AS(
    store_captured_facts(s.device_store, capture, {{301, 7, 0, {1}}, {11, 7, 1, {2}}}, ref),
    logic_error);
  REQUIRE_THROWS_AS(
    store_captured_facts(s.device_store, capture, {{301, 7, 35, token_ids(0, 6)}}, ref),
    logic_error);
  std::vector<captured_fact> too_many;
  for (std::uint64_t id = 301; id < 306; ++id) {
    too_many.push_back({id, 7, 0, token_ids(0, 40)});
  }
  REQUIRE_THROWS_AS(store_captured_facts(s.device_store, capture, too_many, ref), logic_error);
  kv_capture partial{s.device_store.geometry(), 4};
  REQUIRE_THROWS_AS(
    store_captured_facts(s.device_store, partial, {{301, 7, 0, token_ids(0, 4)}}, ref),
    logic_error);
  kv_capture poisoned = make_capture(s.device_store.geometry(), 40);
  std::vector<float> nan_row(
    static_cast<std::size_t>(s.device_store.geometry().num_kv_heads * g.head_dim), 0.0f);
  nan_row[1] = std::numeric_limits<float>::quiet_NaN();
  poisoned.write_values(0,
                        20,
                        make_token_head_view<float const>(
                          nan_row.data(), 1, s.device_store.geometry().num_kv_heads, g.head_dim));
  REQUIRE_THROWS_AS(
    store_captured_facts(
      s.device_store, poisoned, {{301, 7, 0, token_ids(0, 4)}, {302, 7, 18, token_ids(0, 4)}}, ref),
    logic_error);
  REQUIRE(state_of(s.device_store) == before);

  // 2. One request through a cache adapter: the prefix and the captured facts at p0 = 12, in the
  // blocks no request of make_batch uses; the device cache ends equal to the host's.
  compose_options o{};
  o.first_position                       = 12;
  o.instruction_prefix                   = prefix_id;
  composition const host_plan            = compose(s.host_store, {202, 201, 203, 13}, o);
  composition const device_plan          = compose(s.device_store, {202, 201, 203, 13}, o);
  std::vector<std::int32_t> const blocks = unused_blocks();
  std::vector<std::int64_t> const slots  = slots_from_block_table(
    blocks.data(), static_cast<std::int64_t>(blocks.size()), block_size, 0, host_plan.length());
  slot_adapter host_adapter{s.host_desc, slots};
  slot_adapter device_adapter{s.device_desc, slots};
  injection_workspace workspace(host_plan.length());

  // One request as a step of one: planned (the adapter allocates), run on the device.
  auto const run_one = [&](kv_store const& store,
                           composition const& plan,
                           slot_adapter& adapter,
                           injection_workspace& ws) {
    injection_batch step{store};
    step.add(plan, adapter);
    step.run(adapter.cache(), s.device_rotation, device_context{ws, ref});
  };

  // Refused before anything is written or committed: an empty plan (before the adapter
  // allocates), then, at the run, a host store, a workspace too small, too few slots, a slot
  // beyond the cache, a position beyond the table.
  injection_workspace small(host_plan.length() - 1);
  REQUIRE_THROWS_AS(run_one(s.device_store, composition{}, device_adapter, workspace), logic_error);
  REQUIRE(device_adapter.allocated_at == -1);
  REQUIRE_THROWS_AS(run_one(s.host_store, host_plan, device_adapter, workspace), logic_error);
  REQUIRE_THROWS_AS(run_one(s.device_store, device_plan, device_adapter, small), logic_error);
  device_adapter.short_by = 1;
  REQUIRE_THROWS_AS(run_one(s.device_store, device_plan, device_adapter, workspace), logic_error);
  device_adapter.short_by = 0;
  device_adapter.slots[5] = s.device_desc.num_slots();
  REQUIRE_THROWS_AS(run_one(s.device_store, device_plan, device_adapter, workspace), logic_error);
  device_adapter.slots[5] = slots[5];
  compose_options far     = o;
  far.first_position      = s.device_rotation.max_position - 4;
  REQUIRE_THROWS_AS(
    run_one(
      s.device_store, compose(s.device_store, {202, 201, 203, 13}, far), device_adapter, workspace),
    logic_error);
  REQUIRE(device_adapter.committed.empty());
  REQUIRE(first_difference(s.device_bytes(stream.get()), s.original) == -1);
  REQUIRE(state_of(s.device_store) == before);

  {
    injection_batch host_one{s.host_store};
    host_one.add(host_plan, host_adapter);
    host_one.run(host_adapter.cache(), s.host_rotation);
  }
  run_one(s.device_store, device_plan, device_adapter, workspace);
  REQUIRE(device_adapter.allocated_at == 12);
  REQUIRE(device_adapter.committed == std::vector<std::int64_t>{device_plan.length()});
  REQUIRE(host_adapter.committed == device_adapter.committed);
  bytes const device = s.device_bytes(stream.get());
  REQUIRE(first_difference(s.host_bytes(), s.original) != -1);  // something was written
  REQUIRE(first_difference(device, s.host_bytes()) == -1);

  // 3. One injection step planned three ways — fact 11 at p0 = 300 through a span (block 6), facts
  // {12, 13} at p0 = 40 as prompt tokens 3.. of the block table {10, 11} (the cache's block size),
  // fact 15 at p0 = 7 through an adapter (block 4) — run on the device equals the same step run
  // on the host; each adapter commits once, after its run.
  compose_options p{};
  p.order          = fact_order::as_given;
  auto const plans = [&](kv_store const& st) {
    std::vector<composition> out;
    std::vector<std::pair<std::vector<std::uint64_t>, std::int64_t>> const requests{
      {{11}, 300}, {{12, 13}, 40}, {{15}, 7}};
    for (auto const& [ids, p0] : requests) {
      p.first_position = p0;
      out.push_back(compose(st, ids, p));
    }
    return out;
  };
  std::vector<composition> const hp = plans(s.host_store), dp = plans(s.device_store);
  std::vector<std::int64_t> span_slots;
  for (std::int64_t j = 0; j < 7; ++j) {
    span_slots.push_back(6 * block_size + j);
  }
  std::vector<std::int32_t> const table{10, 11};
  slot_adapter host_step_adapter{s.host_desc, {64, 65, 66, 67, 68}};
  slot_adapter device_step_adapter{s.device_desc, {64, 65, 66, 67, 68}};
  injection_batch host_step(s.host_store), device_step(s.device_store);
  for (auto [step, ps, desc, adapter] :
       {std::tuple{&host_step, &hp, &s.host_desc, &host_step_adapter},
        std::tuple{&device_step, &dp, &s.device_desc, &device_step_adapter}}) {
    step->add((*ps)[0], span_slots);
    step->add((*ps)[1], *desc, table, 3);
    step->add((*ps)[2], *adapter);
  }
  REQUIRE(device_step.slots() == host_step.slots());
  REQUIRE(
    std::vector<std::int64_t>(device_step.slots().begin() + 7, device_step.slots().begin() + 21) ==
    std::vector<std::int64_t>{
      163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 173, 174, 175, 176});
  injection_workspace step_workspace(device_step.num_tokens());
  // A refused device run (a workspace too small) stages, launches and commits nothing.
  injection_workspace tiny(device_step.num_tokens() - 1);
  REQUIRE_THROWS_AS(device_step.run(s.device_desc, s.device_rotation, device_context{tiny, ref}),
                    logic_error);
  REQUIRE(device_step_adapter.committed.empty());
  REQUIRE(first_difference(s.device_bytes(stream.get()), device) == -1);
  host_step.run(s.host_desc, s.host_rotation);
  device_step.run(s.device_desc, s.device_rotation, device_context{step_workspace, ref});
  REQUIRE(device_step_adapter.committed == std::vector<std::int64_t>{5});
  REQUIRE(host_step_adapter.committed == device_step_adapter.committed);
  REQUIRE(step_workspace.read_errors(ref).total() == 0);
  bytes const stepped = s.device_bytes(stream.get());
  REQUIRE(first_difference(stepped, device) != -1);  // the step wrote something
  REQUIRE(first_difference(stepped, s.host_bytes()) == -1);
}

}  // namespace

TEST_CASE(
  "the device seam: a capture stored on a stream and a request injected through a cache "
  "adapter equal the host seam's",
  "[gpu][inject][engine]")
{
  auto const cases = geometry_cases();
  SECTION("vLLM FlashAttention NHD, bf16 -> bf16, heads 1..3 of 4 (the capture is the shard's)")
  {
    require_seam_equals_host<bf16_to_bf16>(engine_layout::vllm_flash_attn_nhd, cases[1]);
  }
  SECTION("vLLM legacy, fp32 -> fp32, scalar path")
  {
    require_seam_equals_host<fp32_to_fp32>(engine_layout::vllm_legacy, cases[2]);
  }
  SECTION("SGLang token pool, bf16 -> fp8 e4m3 per-head scales")
  {
    require_seam_equals_host<bf16_to_e4m3>(engine_layout::sglang_token_pool, cases[0]);
  }
}

namespace {

kv_geometry const capture_geometry{3, 2, 16};

/// A host or device store of `t` with a history (facts inserted and erased): its free pages are
/// out of order and hold stale bytes, the same on either memory space.
kv_store capture_store(dtype t, memory_space where)
{
  kv_store_config c{};
  c.model       = capture_geometry;
  c.store_dtype = t;
  c.page_size   = 8;
  c.num_pages   = 12;
  c.space       = where;
  kv_store s{c};
  std::vector<float> fill(static_cast<std::size_t>(3 * 16 * 2 * 16), 2.5f);
  auto const v = make_fact_kv_view<float const>(fill.data(), 3, 16, 2, 16);
  for (std::uint64_t id = 90; id < 93; ++id) {
    s.insert<float>(id, 1, token_ids(0, 16), v, v);
  }
  s.erase(90);
  s.erase(92);
  return s;
}

/// Writes `rows` (`[tokens, heads, head_dim]`, any strides) as layer `l`'s K (kv 0) or V.
template <class Capture, class View, class... Stream>
void write_rows(Capture& c, int kv, std::int32_t l, std::int64_t first, View rows, Stream... s)
{
  if (kv == 0) {
    c.write_keys(l, first, rows, s...);
  } else {
    c.write_values(l, first, rows, s...);
  }
}

}  // namespace

TEMPLATE_TEST_CASE(
  "the device capture: hook rows written and stored on a stream equal the host "
  "capture stored, byte for byte; refusals change nothing",
  "[gpu][engine][capture]",
  float,
  half_t,
  bfloat16_t)
{
  using T                 = TestType;  // the element type the engine's hooks hand over
  dtype const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(dtype_of_v<T>), to_string(store_dtype));
  kv_geometry const g   = capture_geometry;
  std::int64_t const n  = 29;
  std::int64_t const ld = 40;  // the engine tensors' row stride: [n, H*D] rows padded to 40
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};

  // Each layer's K and V as an engine tensor of T (normal, sd 1.5), padding included.
  std::mt19937_64 rng(0x5eed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<T> engine(static_cast<std::size_t>(2 * g.num_layers * n * ld));
  for (T& x : engine) {
    x = from_float<T>(normal(rng));
  }
  device_buffer<T> const device_rows(engine);
  kv_capture host{g, n};
  device_kv_capture device{g, n, ref};
  std::vector<float> converted(static_cast<std::size_t>(n * 32));
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      std::int64_t const base = (l * 2 + kv) * n * ld;
      for (std::int64_t t = 0; t < n; ++t) {
        for (std::int64_t e = 0; e < 32; ++e) {
          converted[static_cast<std::size_t>(t * 32 + e)] =
            to_float(engine[static_cast<std::size_t>(base + t * ld + e)]);
        }
      }
      write_rows(host, kv, l, 0, make_token_head_view<float const>(converted.data(), n, 2, 16));
      T const* const rows = device_rows.data() + base;
      if (l == 2 && kv == 1) {  // two ubatches: tokens [0, 10), then [10, n)
        write_rows(device, kv, l, 0, make_token_head_view<T const>(rows, 10, 2, 16, ld, 16), ref);
        write_rows(device,
                   kv,
                   l,
                   10,
                   make_token_head_view<T const>(rows + 10 * ld, n - 10, 2, 16, ld, 16),
                   ref);
      } else {
        write_rows(device, kv, l, 0, make_token_head_view<T const>(rows, n, 2, 16, ld, 16), ref);
      }
    }
  }
  REQUIRE(device.complete());

  // Ranges of 9, 17, 1 and 8 tokens (last pages partly used, an overlap under another id).
  std::vector<captured_fact> const facts{{201, 7, 0, token_ids(2010, 9)},
                                         {202, 7, 9, token_ids(2020, 17)},
                                         {203, 7, 28, {2030}},
                                         {204, 7, 3, token_ids(0, 8)}};
  kv_store host_store   = capture_store(store_dtype, memory_space::host);
  kv_store device_store = capture_store(store_dtype, memory_space::device);
  store_captured_facts(host_store, host, facts);
  store_captured_facts(device_store, device, facts, ref);
  REQUIRE(device.faulty_tokens(ref).empty());  // waits for the stream
  for (captured_fact const& f : facts) {
    REQUIRE(device_store.at(f.fact_id).pages == host_store.at(f.fact_id).pages);
    REQUIRE(device_store.at(f.fact_id).token_ids == f.token_ids);
  }
  REQUIRE(first_difference(device_store.pool_to_host(), host_store.pool_to_host()) == -1);

  // Refused before anything is reserved or enqueued: an id already stored, an id twice, a range
  // beyond the capture, more pages than are free (3 left), an incomplete capture, another
  // geometry, a host store.
  store_state const before = state_of(device_store);
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, device, {{301, 7, 0, {1}}, {201, 7, 1, {2}}}, ref),
    logic_error);
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, device, {{301, 7, 0, {1}}, {301, 7, 1, {2}}}, ref),
    logic_error);
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, device, {{301, 7, 25, token_ids(0, 6)}}, ref), logic_error);
  REQUIRE_THROWS_AS(store_captured_facts(
                      device_store, device, {{301, 7, 0, token_ids(0, 29)}, {302, 7, 0, {1}}}, ref),
                    logic_error);
  device_kv_capture partial{g, 4, ref};
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    write_rows(partial, 0, l, 0, make_token_head_view<T const>(device_rows.data(), 4, 2, 16), ref);
    if (l != 1) {
      write_rows(
        partial, 1, l, 0, make_token_head_view<T const>(device_rows.data(), 4, 2, 16), ref);
    }
  }
  REQUIRE_FALSE(partial.complete(0, 1));
  REQUIRE_THROWS_AS(
    store_captured_facts(device_store, partial, {{301, 7, 0, token_ids(0, 4)}}, ref), logic_error);
  device_kv_capture other{kv_geometry{3, 2, 8}, 4, ref};
  REQUIRE_THROWS_AS(store_captured_facts(device_store, other, {{301, 7, 0, {1}}}, ref),
                    logic_error);
  kv_store host_target = capture_store(store_dtype, memory_space::host);
  REQUIRE_THROWS_AS(store_captured_facts(host_target, device, {{301, 7, 0, {1}}}, ref),
                    logic_error);
  REQUIRE(host_target.num_facts() == 1);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  REQUIRE(state_of(device_store) == before);

  // Refused writes record nothing: a layer beyond the geometry, tokens beyond the buffer, rows of
  // another head count, null data.
  device_kv_capture fresh{g, 4, ref};
  auto const rows4 = make_token_head_view<T const>(device_rows.data(), 4, 2, 16);
  REQUIRE_THROWS_AS(fresh.write_keys(3, 0, rows4, ref), logic_error);
  REQUIRE_THROWS_AS(fresh.write_keys(0, 1, rows4, ref), logic_error);
  REQUIRE_THROWS_AS(
    fresh.write_keys(0, 0, make_token_head_view<T const>(device_rows.data(), 4, 1, 32), ref),
    logic_error);
  REQUIRE_THROWS_AS(fresh.write_keys(0, 0, make_token_head_view<T const>(nullptr, 4, 2, 16), ref),
                    logic_error);
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    fresh.write_values(l, 0, rows4, ref);
  }
  REQUIRE_FALSE(fresh.complete(0, 1));
}

TEST_CASE(
  "the device capture refuses facts whose K/V is not finite in the store dtype before storing "
  "anything",
  "[gpu][engine][capture]")
{
  kv_geometry const g = capture_geometry;
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  // 6 tokens of ones; the odd rows (K of layer 1, V of layer 0) hold 1e6 at token 2 (beyond
  // float16, within bfloat16) and a NaN at token 5.
  std::vector<float> rows(static_cast<std::size_t>(6 * 32), 1.0f);
  device_buffer<float> const ones(rows);
  rows[2 * 32 + 3]  = 1e6f;
  rows[5 * 32 + 17] = std::numeric_limits<float>::quiet_NaN();
  device_buffer<float> const odd(rows);
  device_kv_capture made{g, 6, ref};
  device_kv_capture capture = std::move(made);  // a moved buffer is the same buffer
  for (std::int32_t l = 0; l < g.num_layers; ++l) {
    capture.write_keys(
      l, 0, make_token_head_view<float const>(l == 1 ? odd.data() : ones.data(), 6, 2, 16), ref);
    capture.write_values(
      l, 0, make_token_head_view<float const>(l == 0 ? odd.data() : ones.data(), 6, 2, 16), ref);
  }
  REQUIRE(capture.faulty_tokens(ref).empty());  // no check yet

  // A NaN: refused in any dtype, the store unchanged (no page reserved, no fact recorded).
  kv_store bf16_store           = capture_store(dtype::bfloat16, memory_space::device);
  store_state const bf16_before = state_of(bf16_store);
  std::vector<captured_fact> nan_facts{{1, 1, 0, token_ids(0, 2)}, {2, 1, 4, token_ids(0, 2)}};
  REQUIRE_THROWS_WITH(
    store_captured_facts(bf16_store, capture, nan_facts, ref),
    Catch::Contains("fact 2 holds a NaN") && Catch::Contains("at token 1 (captured token 5)"));
  REQUIRE(capture.faulty_tokens(ref) == std::vector<std::int64_t>{5});
  REQUIRE(state_of(bf16_store) == bf16_before);
  // 1e6 is within bfloat16: the first 5 tokens are stored.
  store_captured_facts(bf16_store, capture, {{1, 1, 0, token_ids(0, 5)}}, ref);
  REQUIRE(capture.faulty_tokens(ref).empty());  // the last check's flags
  REQUIRE(bf16_store.contains(1));
  REQUIRE(bf16_store.num_facts() == bf16_before.facts + 1);

  // Beyond float16: refused with every faulty token listed, the store unchanged.
  kv_store half_store           = capture_store(dtype::float16, memory_space::device);
  store_state const half_before = state_of(half_store);
  REQUIRE_THROWS_AS(store_captured_facts(half_store, capture, {{1, 1, 0, token_ids(0, 6)}}, ref),
                    logic_error);
  REQUIRE(capture.faulty_tokens(ref) == std::vector<std::int64_t>{2, 5});
  REQUIRE(state_of(half_store) == half_before);
  store_captured_facts(half_store, capture, {{1, 1, 0, token_ids(0, 2)}, {2, 1, 3, {7}}}, ref);
  REQUIRE(half_store.num_facts() == half_before.facts + 2);
}

namespace {

/// fake::plain_model (tests/common/fake_model.hpp) as a GPU engine's model adapter as well: its
/// device encode runs the host forward, uploads each plane and hands every layer's rows to the
/// device capture's write kernels on the stream, as a GPU engine's hooks would. `nan_at` puts a
/// NaN into V of layer 1 at that token.
struct device_plain_model : inferscale_test::fake::plain_model {
  using plain_model::encode;
  void encode(std::vector<std::int32_t> const& tokens,
              std::int64_t first_position,
              device_kv_capture& out,
              cuda::stream_ref stream)
  {
    kv_geometry const g  = geometry();
    std::int64_t const n = static_cast<std::int64_t>(tokens.size());
    kv_capture host{g, n};
    plain_model::encode(tokens, first_position, host);
    std::int64_t const row = g.elements_per_token_layer();
    for (int kv = 0; kv < 2; ++kv) {
      float const* const plane = kv == 0 ? host.keys().data_handle() : host.values().data_handle();
      std::vector<float> rows(plane, plane + g.num_layers * n * row);
      if (kv == 1 && nan_at >= 0) {
        rows[static_cast<std::size_t>((n + nan_at) * row + 2)] =
          std::numeric_limits<float>::quiet_NaN();
      }
      uploads.emplace_back(rows);  // kept until the writes have run
      for (std::int32_t l = 0; l < g.num_layers; ++l) {
        auto const view = make_token_head_view<float const>(
          uploads.back().data() + l * n * row, n, g.num_kv_heads, g.head_dim);
        if (kv == 0) {
          out.write_keys(l, 0, view, stream);
        } else {
          out.write_values(l, 0, view, stream);
        }
      }
    }
  }
  std::int64_t nan_at{-1};
  std::vector<device_buffer<float>> uploads;
};

static_assert(is_device_model_adapter_v<device_plain_model>);
static_assert(is_model_adapter_v<device_plain_model>);
static_assert(!is_device_model_adapter_v<inferscale_test::fake::plain_model>);

kv_store encode_store(dtype t, memory_space where)
{
  kv_store_config c{};
  c.model       = inferscale_test::fake::tiny;
  c.store_dtype = t;
  c.page_size   = 4;
  c.num_pages   = 16;
  c.space       = where;
  return kv_store{c};
}

}  // namespace

TEST_CASE(
  "encode_facts with a device model adapter: the device store equals the host adapter's, byte "
  "for byte; refusals change nothing",
  "[gpu][engine][capture]")
{
  dtype const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(store_dtype));
  cuda_stream stream;
  cuda::stream_ref const ref{stream.get()};
  device_plain_model model;
  std::vector<std::int32_t> const tokens{11, 12, 13, 14, 15, 16, 17};
  // Ranges of 5, 1 and 2 tokens (last pages partly used), overlapping.
  std::vector<captured_fact> const facts{
    {1, 5, 1, {12, 13, 14, 15, 16}}, {2, 5, 6, {17}}, {3, 5, 0, {11, 12}}};
  kv_store host_store   = encode_store(store_dtype, memory_space::host);
  kv_store device_store = encode_store(store_dtype, memory_space::device);
  encode_facts(model, host_store, tokens, 3, facts);
  encode_facts(model, device_store, tokens, 3, facts, ref);
  REQUIRE(model.forwards == 2);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  for (captured_fact const& f : facts) {
    REQUIRE(device_store.at(f.fact_id).pages == host_store.at(f.fact_id).pages);
    REQUIRE(device_store.at(f.fact_id).token_ids == f.token_ids);
  }
  REQUIRE(first_difference(device_store.pool_to_host(), host_store.pool_to_host()) == -1);

  // Refused before the forward: token ids that differ from the encoded ones, a host store.
  store_state const before = state_of(device_store);
  REQUIRE_THROWS_WITH(encode_facts(model, device_store, tokens, 3, {{4, 5, 0, {11, 99}}}, ref),
                      Catch::Contains("token ids differ"));
  kv_store host_target = encode_store(store_dtype, memory_space::host);
  REQUIRE_THROWS_AS(encode_facts(model, host_target, tokens, 3, {{4, 5, 0, {11}}}, ref),
                    logic_error);
  REQUIRE(model.forwards == 2);
  // Refused after the forward: a NaN in one fact's tokens stores none of them.
  model.nan_at = 4;
  REQUIRE_THROWS_WITH(
    encode_facts(model, device_store, tokens, 3, {{4, 5, 0, {11}}, {5, 5, 3, {14, 15}}}, ref),
    Catch::Contains("fact 5 holds a NaN") && Catch::Contains("at token 1 (captured token 4)"));
  REQUIRE(model.forwards == 3);
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(stream.get()));
  REQUIRE(state_of(device_store) == before);
  REQUIRE(host_target.num_facts() == 0);
}

TEST_CASE("store_captured_facts on a stream writes a host store on the host, as the host call does",
          "[inject][engine][cuda_host]")
{
  // Runs without a GPU: a host store never reaches the CUDA runtime, whatever the stream.
  kv_store_config c{};
  c.model       = kv_geometry{2, 2, 8};
  c.store_dtype = dtype::bfloat16;
  c.page_size   = 4;
  c.num_pages   = 8;
  c.space       = memory_space::host;
  kv_store by_host{c};
  kv_store by_stream{c};
  kv_capture const capture = make_capture(c.model, 12);
  std::vector<captured_fact> const captured{{1, 3, 0, token_ids(10, 5)},
                                            {2, 3, 5, token_ids(20, 7)}};
  cuda::stream_ref const no_stream{cudaStream_t{}};
  store_captured_facts(by_host, capture, captured);
  store_captured_facts(by_stream, capture, captured, no_stream);
  REQUIRE(by_stream.num_facts() == 2);
  REQUIRE(by_stream.at(2).token_ids == token_ids(20, 7));
  REQUIRE(first_difference(by_stream.pool_to_host(), by_host.pool_to_host()) == -1);
  // Element (layer 1, token 3 of fact 2, head 1, dim 5) of V, written out: the capture's value
  // rounded to bfloat16.
  std::int64_t const row =
    by_stream.ref().row_offset(by_stream.store_token(by_stream.at(2), 3), 1, 1);
  bytes const pool = by_stream.pool_to_host();
  bfloat16_t stored;
  std::memcpy(&stored, pool.data() + (row + 1 * 8 + 5) * 2, 2);
  REQUIRE(to_float(stored) == to_float(from_float<bfloat16_t>(capture.values()(1, 5 + 3, 1, 5))));

  store_state const before = state_of(by_stream);
  REQUIRE_THROWS_AS(
    store_captured_facts(by_stream, capture, {{3, 3, 10, token_ids(0, 3)}}, no_stream),
    logic_error);  // beyond the 12 captured tokens
  REQUIRE_THROWS_AS(
    store_captured_facts(by_stream, capture, {{3, 3, 0, {1}}, {3, 3, 1, {2}}}, no_stream),
    logic_error);  // an id twice
  REQUIRE(state_of(by_stream) == before);
}
