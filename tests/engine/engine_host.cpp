// The engine seam without an engine: the capture buffer, storing captured ranges, the device
// capture's per-element code run on the CPU (detail/capture/block.hpp: every element of a launch,
// against the host capture and kv_store::insert, byte for byte), the adapter traits and request
// flow against small hand-written adapters, the fused-multiply-add rotation, and rope_spec /
// kv_geometry from GGUF metadata and HF config.json. Expected values are written out in the tests
// (formulas, the configs' published numbers).

#include <inferscale/detail/capture/block.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/hf_config.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

using namespace inferscale;

namespace {

kv_geometry const small{2, 2, 4};

/// A value that identifies (layer, token, head, dim) and K or V.
float tag(int kv, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t d)
{
  return static_cast<float>(kv * 10000 + l * 1000 + t * 100 + h * 10 + d) * 0.25f;
}

/// Fills one layer's K or V rows of tokens [first, first + n) into a capture.
void feed(kv_capture& c, int kv, std::int32_t layer, std::int64_t first, std::int64_t n)
{
  std::vector<float> rows(static_cast<std::size_t>(n * 8));
  for (std::int64_t t = 0; t < n; ++t) {
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < 4; ++d) {
        rows[static_cast<std::size_t>(t * 8 + h * 4 + d)] = tag(kv, layer, first + t, h, d);
      }
    }
  }
  auto view = make_token_head_view<float const>(rows.data(), n, 2, 4);
  if (kv == 0) {
    c.write_keys(layer, first, view);
  } else {
    c.write_values(layer, first, view);
  }
}

kv_store host_store(kv_geometry g, dtype t = dtype::float32, std::int64_t pages = 16)
{
  kv_store_config c;
  c.model       = g;
  c.store_dtype = t;
  c.page_size   = 4;
  c.num_pages   = pages;
  c.space       = memory_space::host;
  return kv_store{c};
}

/// K (kv 0) or V of store token row (layer, token of fact), element (h, d), as fp32.
float stored(kv_store const& s, std::uint64_t id, int kv, int l, int t, int h, int d)
{
  std::vector<unsigned char> const pool = s.pool_to_host();
  std::int64_t const st                 = s.store_token(s.at(id), t);
  std::int64_t const off = s.ref().row_offset(st, l, kv) + h * s.geometry().head_dim + d;
  if (s.store_dtype() == dtype::float32) {
    float v;
    std::memcpy(&v, pool.data() + off * 4, 4);
    return v;
  }
  bfloat16_t v;
  std::memcpy(&v, pool.data() + off * 2, 2);
  return to_float(v);
}

/// A model adapter whose "forward" writes tag() values at every layer (pre-RoPE by definition).
struct fake_model {
  kv_geometry geometry() const { return small; }
  rope_params rotation() const
  {
    rope_spec s{};
    s.head_dim = 4;
    return make_rope_params(s);
  }
  void encode(std::vector<std::int32_t> const& tokens, std::int64_t, kv_capture& out)
  {
    ++calls;
    std::int64_t const n = static_cast<std::int64_t>(tokens.size());
    for (std::int32_t l = 0; l < 2; ++l) {
      feed(out, 0, l, 0, n);
      if (!skip_values) { feed(out, 1, l, 0, n); }
    }
  }
  int calls{0};
  bool skip_values{false};
};

/// A cache adapter over a plain host cache of 16 slots with a block table of 4 blocks of 4.
struct fake_cache {
  explicit fake_cache(kv_geometry g) : data(static_cast<std::size_t>(2 * 2 * 16 * 8), 0.0f)
  {
    cache_ = make_contiguous_cache(dtype::float32,
                                   data.data(),
                                   {g.num_layers, 2, 16, g.num_kv_heads, g.head_dim},
                                   {2 * 16 * 8, 16 * 8, 8, 4, 1});
  }
  std::vector<std::int64_t> allocate(std::int64_t first_position, std::int64_t tokens)
  {
    allocated_at = first_position;
    std::vector<std::int64_t> s;
    for (std::int64_t j = 0; j < tokens - short_by; ++j) {
      s.push_back(15 - j);  // slots in reverse: the mapping, not the order, decides
    }
    return s;
  }
  paged_kv_cache const& cache() const { return cache_; }
  void commit(std::int64_t tokens) { committed.push_back(tokens); }
  void release(std::int64_t tokens) noexcept { released.push_back(tokens); }

  std::vector<float> data;
  paged_kv_cache cache_{};
  std::int64_t allocated_at{-1};
  std::int64_t short_by{0};
  std::vector<std::int64_t> committed;
  std::vector<std::int64_t> released;
};

struct not_an_adapter {
  int geometry() const { return 0; }
};

/// allocate, cache and commit without release: a failed step could not give its slots back.
struct no_release {
  std::vector<std::int64_t> allocate(std::int64_t, std::int64_t) { return {}; }
  paged_kv_cache const& cache() const { return cache_; }
  void commit(std::int64_t) {}
  paged_kv_cache cache_{};
};

}  // namespace

static_assert(is_model_adapter_v<fake_model>);
static_assert(is_cache_adapter_v<fake_cache>);
static_assert(!is_model_adapter_v<not_an_adapter>);
static_assert(!is_cache_adapter_v<not_an_adapter>);
static_assert(!is_cache_adapter_v<no_release>);

TEST_CASE("kv_capture: rows land where written, completeness is tracked, refusals change nothing",
          "[engine]")
{
  kv_capture c{small, 5};
  CHECK_FALSE(c.complete());
  feed(c, 0, 0, 0, 3);
  feed(c, 0, 0, 3, 2);  // two ubatches of one layer
  feed(c, 1, 0, 0, 5);
  CHECK(c.complete(0, 5) == false);  // layer 1 missing
  feed(c, 0, 1, 0, 5);
  feed(c, 1, 1, 0, 4);
  CHECK(c.complete(0, 4));
  CHECK_FALSE(c.complete(0, 5));
  CHECK_FALSE(c.complete(3, 3));  // beyond the buffer
  feed(c, 1, 1, 4, 1);
  CHECK(c.complete());
  for (int l = 0; l < 2; ++l) {
    for (int t = 0; t < 5; ++t) {
      for (int h = 0; h < 2; ++h) {
        for (int d = 0; d < 4; ++d) {
          CHECK(c.keys()(l, t, h, d) == tag(0, l, t, h, d));
          CHECK(c.values()(l, t, h, d) == tag(1, l, t, h, d));
        }
      }
    }
  }
  auto const slice = c.keys(2, 2);
  CHECK(slice.extent(1) == 2);
  CHECK(slice(1, 1, 1, 3) == tag(0, 1, 3, 1, 3));

  std::vector<float> rows(2 * 8, 1.0f);
  CHECK_THROWS_AS(c.write_keys(2, 0, make_token_head_view<float const>(rows.data(), 2, 2, 4)),
                  logic_error);
  CHECK_THROWS_AS(c.write_keys(0, 4, make_token_head_view<float const>(rows.data(), 2, 2, 4)),
                  logic_error);
  CHECK_THROWS_AS(c.write_keys(0, 0, make_token_head_view<float const>(rows.data(), 2, 4, 2)),
                  logic_error);
  CHECK(c.keys()(0, 4, 0, 0) == tag(0, 0, 4, 0, 0));  // the refused writes wrote nothing
  CHECK_THROWS_AS(c.keys(4, 2), logic_error);
  CHECK_THROWS_AS(c.keys(0, 0), logic_error);
  CHECK_THROWS_AS((kv_capture{small, 0}), logic_error);
}

TEST_CASE("store_captured_facts / encode_facts: ranges become facts, all or none", "[engine]")
{
  dtype const t = GENERATE(dtype::float32, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_store store = host_store(small, t);
  fake_model model;
  std::vector<std::int32_t> const tokens{10, 11, 12, 13, 14, 15};
  std::vector<captured_fact> const facts{{1, 9, 0, {10, 11}}, {2, 9, 2, {12, 13, 14, 15}}};
  encode_facts(model, store, tokens, 0, facts);
  CHECK(model.calls == 1);
  REQUIRE(store.num_facts() == 2);
  CHECK(store.at(2).token_ids == std::vector<std::int32_t>{12, 13, 14, 15});
  for (int l = 0; l < 2; ++l) {
    for (int j = 0; j < 4; ++j) {
      float const expected_k = tag(0, l, 2 + j, 1, 3);  // fact 2 starts at token 2
      float const expected_v = tag(1, l, 2 + j, 0, 1);
      float const rounded_k =
        t == dtype::float32 ? expected_k : to_float(from_float<bfloat16_t>(expected_k));
      float const rounded_v =
        t == dtype::float32 ? expected_v : to_float(from_float<bfloat16_t>(expected_v));
      CHECK(stored(store, 2, 0, l, j, 1, 3) == rounded_k);
      CHECK(stored(store, 2, 1, l, j, 0, 1) == rounded_v);
    }
  }

  std::uint64_t const version = store.version();
  // A range whose ids differ from the encoded tokens, one outside them, a duplicate id, an id
  // already stored: refused before the forward runs or before anything is stored.
  CHECK_THROWS_AS(encode_facts(model, store, tokens, 0, {{3, 9, 0, {10, 99}}}), logic_error);
  CHECK_THROWS_AS(encode_facts(model, store, tokens, 0, {{3, 9, 5, {15, 16}}}), logic_error);
  CHECK_THROWS_AS(encode_facts(model, store, tokens, 0, {{3, 9, 0, {10}}, {3, 9, 1, {11}}}),
                  logic_error);
  CHECK_THROWS_AS(encode_facts(model, store, tokens, 0, {{4, 9, 0, {10}}, {1, 9, 1, {11}}}),
                  logic_error);
  CHECK(model.calls == 3);   // the last two ran the forward and were refused at storing
  model.skip_values = true;  // an adapter whose hook misses V: refused, nothing stored
  CHECK_THROWS_AS(encode_facts(model, store, tokens, 0, {{5, 9, 0, {10}}}), logic_error);
  kv_store tiny     = host_store(small, t, 1);
  model.skip_values = false;
  CHECK_THROWS_AS(encode_facts(model, tiny, tokens, 0, {{1, 9, 0, {10, 11}}, {2, 9, 2, {12}}}),
                  logic_error);  // two facts need two pages, one is free
  CHECK(tiny.num_facts() == 0);
  CHECK(store.version() == version);
  CHECK(store.num_facts() == 2);
}

namespace {

/// Runs every element of a device capture write on the CPU (what capture_write_kernel's threads
/// do): `count` tokens of a strided view into a zeroed fp32 buffer of `count * 2 * 4` elements.
template <class T>
std::vector<float> emulate_write(T const* src,
                                 std::int64_t count,
                                 std::int64_t token_stride,
                                 std::int64_t head_stride,
                                 std::int64_t dim_stride)
{
  std::vector<float> rows(static_cast<std::size_t>(count * 8), 0.0f);
  detail::capture_write_args<T> const a{
    rows.data(), src, count, 2, 4, token_stride, head_stride, dim_stride};
  for (std::int64_t i = 0; i < detail::capture_write_elements(a); ++i) {
    detail::capture_write_element(a, i);
  }
  return rows;
}

/// Runs every element of the device capture's finiteness check on the CPU (what
/// capture_check_kernel's threads do) over the facts' tokens: one flag per captured token.
template <class S>
std::vector<std::uint32_t> emulate_check(kv_capture const& capture,
                                         std::vector<captured_fact> const& facts)
{
  std::vector<detail::capture_token_range> ranges;
  for (captured_fact const& f : facts) {
    ranges.push_back({f.begin, static_cast<std::int64_t>(f.token_ids.size())});
  }
  std::vector<std::uint32_t> faults(static_cast<std::size_t>(capture.num_tokens()), 0u);
  detail::capture_check_args const a{capture.keys().data_handle(),
                                     capture.values().data_handle(),
                                     capture.num_tokens(),
                                     capture.geometry().num_layers,
                                     capture.geometry().elements_per_token_layer(),
                                     ranges.data(),
                                     static_cast<std::int64_t>(ranges.size()),
                                     faults.data()};
  for (std::int64_t r = 0; r < a.num_ranges; ++r) {
    for (std::int64_t e = 0; e < detail::capture_check_elements(a, r); ++e) {
      detail::capture_check_element<S>(a, r, e);
    }
  }
  return faults;
}

/// Stores `facts` of `capture` as store_captured_facts(store, device_kv_capture, ...) does, with
/// the check kernel's and the scatter kernel's every element run on the CPU over a host store's
/// pool (a host kv_capture's keys and values have the device buffer's layout): the ranges
/// checked, the check's flags refused (refuse_faulty_facts), then the facts reserved and
/// scattered.
template <class S>
void emulate_store(kv_store& store,
                   kv_capture const& capture,
                   std::vector<captured_fact> const& facts)
{
  detail::check_captured_ranges(store, capture, facts);
  if (facts.empty()) { return; }
  detail::refuse_faulty_facts(store.store_dtype(), facts, emulate_check<S>(capture, facts));
  std::vector<detail::capture_scatter_page> pages;
  for (captured_fact const& f : facts) {
    detail::append_scatter_pages(
      pages, store.reserve(f.fact_id, f.namespace_id, f.token_ids), f.begin, store.page_size());
  }
  detail::capture_scatter_args const a{store.ref(),
                                       capture.keys().data_handle(),
                                       capture.values().data_handle(),
                                       capture.num_tokens(),
                                       pages.data(),
                                       static_cast<std::int64_t>(pages.size())};
  for (std::int64_t p = 0; p < a.num_pages; ++p) {
    for (std::int64_t e = 0; e < detail::capture_page_elements(a.store); ++e) {
      detail::capture_scatter_element<S>(a, p, e);
    }
  }
}

/// A store of `t` whose free pages are out of order and hold stale bytes: facts inserted and
/// erased again (pages 0..5 written, 1 and 4 freed last).
kv_store dirty_store(dtype t)
{
  kv_store s = host_store(small, t, 8);
  std::vector<float> ones(static_cast<std::size_t>(2 * 8 * 8), 3.0f);
  auto const v = make_fact_kv_view<float const>(ones.data(), 2, 8, 2, 4);
  for (std::uint64_t id = 90; id < 93; ++id) {
    s.insert<float>(id, 1, std::vector<std::int32_t>(8, 1), v, v);
  }
  s.erase(90);
  s.erase(92);
  return s;
}

}  // namespace

TEST_CASE("device capture write, emulated: each element is the source element as fp32",
          "[engine][capture]")
{
  // 3 tokens of a bf16 view with padded strides (token 40, head 12, dim 2): element (t, h, d)
  // sits at t*40 + h*12 + d*2.
  std::vector<bfloat16_t> src(120);
  for (std::size_t i = 0; i < src.size(); ++i) {
    src[i] = from_float<bfloat16_t>(static_cast<float>(i) * 0.5f - 7.0f);
  }
  std::vector<float> const rows = emulate_write(src.data(), 3, 40, 12, 2);
  for (int t = 0; t < 3; ++t) {
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < 4; ++d) {
        CAPTURE(t, h, d);
        CHECK(rows[static_cast<std::size_t>(t * 8 + h * 4 + d)] ==
              static_cast<float>(t * 40 + h * 12 + d * 2) * 0.5f - 7.0f);
      }
    }
  }
}

TEST_CASE("device capture scatter, emulated: the pool equals the host capture's, byte for byte",
          "[engine][capture]")
{
  dtype const t = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(t));
  kv_capture c{small, 11};
  for (std::int32_t l = 0; l < 2; ++l) {
    feed(c, 0, l, 0, 11);
    feed(c, 1, l, 0, 11);
  }
  // Ranges of 5, 4 and 1 tokens (a last page partly used), overlapping ranges under two ids.
  std::vector<captured_fact> const facts{
    {1, 9, 0, {1, 2, 3, 4, 5}}, {2, 9, 6, {7, 8, 9, 10}}, {3, 4, 10, {11}}, {4, 9, 1, {2, 3}}};
  kv_store by_host    = dirty_store(t);
  kv_store by_emulate = dirty_store(t);
  store_captured_facts(by_host, c, facts);
  std::vector<std::uint32_t> faults;
  dispatch_dtype(t, [&](auto tag_type) {
    using S = typename decltype(tag_type)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      faults = emulate_check<S>(c, facts);
      emulate_store<S>(by_emulate, c, facts);
    }
  });
  for (captured_fact const& f : facts) {
    REQUIRE(by_emulate.at(f.fact_id).pages == by_host.at(f.fact_id).pages);
  }
  CHECK(by_emulate.version() == by_host.version());
  CHECK(by_emulate.pool_to_host() == by_host.pool_to_host());
  CHECK(faults == std::vector<std::uint32_t>(11, 0u));
  // Written out: fact 1's token 4 is page 1's row 0; V of layer 1, head 0, dim 2 is captured
  // token 4's, at element (((page * 2 + 1) * 2 + 1) * 4 + 0) * 8 + 2 of the pool.
  if (t == dtype::float32) {
    std::vector<unsigned char> const pool = by_emulate.pool_to_host();
    std::int64_t const page               = by_emulate.at(1).pages[1];
    float v;
    std::memcpy(&v, pool.data() + ((((page * 2 + 1) * 2 + 1) * 4 + 0) * 8 + 2) * 4, 4);
    CHECK(v == tag(1, 1, 4, 0, 2));
    // Its unused rows 1..3 (stale 3.0 before) are zero.
    for (std::int64_t e = 8; e < 32; ++e) {
      std::memcpy(&v, pool.data() + ((((page * 2 + 1) * 2 + 1) * 4) * 8 + e) * 4, 4);
      CHECK(v == 0.0f);
    }
  }
}

namespace {
/// What a refused call must leave as it was: the catalogue, the free pages (count and the order
/// the next reservation takes them in), the version and the pool's bytes.
struct store_state {
  std::int64_t facts;
  std::int64_t free_pages;
  std::uint64_t version;
  std::vector<unsigned char> pool;
  bool operator==(store_state const& o) const
  {
    return facts == o.facts && free_pages == o.free_pages && version == o.version && pool == o.pool;
  }
};
store_state state_of(kv_store const& s)
{
  return {s.num_facts(), s.free_pages(), s.version(), s.pool_to_host()};
}
}  // namespace

TEST_CASE(
  "device capture check, emulated: a NaN, an infinity or a value beyond the store dtype in a "
  "fact's tokens is refused before anything is stored",
  "[engine][capture]")
{
  // 6 tokens of tags; token 2 holds 1e6 in K of layer 1 (beyond float16's 65504, within
  // bfloat16), token 3 the largest float in V of layer 1 (rounds to +inf in bfloat16, beyond
  // float16 too), token 5 a NaN in V of layer 0 and token 4 +inf in K of layer 0.
  kv_capture c{small, 6};
  for (std::int32_t l = 0; l < 2; ++l) {
    feed(c, 0, l, 0, 6);
    feed(c, 1, l, 0, 6);
  }
  std::vector<float> row(8, 1.0f);
  row[3] = 1e6f;
  c.write_keys(1, 2, make_token_head_view<float const>(row.data(), 1, 2, 4));
  row[3] = std::numeric_limits<float>::max();
  c.write_values(1, 3, make_token_head_view<float const>(row.data(), 1, 2, 4));
  row[3] = std::numeric_limits<float>::infinity();
  c.write_keys(0, 4, make_token_head_view<float const>(row.data(), 1, 2, 4));
  row[3] = std::nanf("");
  c.write_values(0, 5, make_token_head_view<float const>(row.data(), 1, 2, 4));
  std::vector<captured_fact> const all{{1, 1, 0, {1, 2, 3, 4, 5, 6}}};
  // Written out: the flags of each store dtype over all 6 tokens.
  CHECK(emulate_check<float>(c, all) == std::vector<std::uint32_t>{0, 0, 0, 0, 1, 1});
  CHECK(emulate_check<half_t>(c, all) == std::vector<std::uint32_t>{0, 0, 1, 1, 1, 1});
  CHECK(emulate_check<bfloat16_t>(c, all) == std::vector<std::uint32_t>{0, 0, 0, 1, 1, 1});
  // Only the facts' tokens are checked.
  CHECK(emulate_check<half_t>(c, {{1, 1, 0, {1, 2}}, {2, 1, 4, {5}}}) ==
        std::vector<std::uint32_t>{0, 0, 0, 0, 1, 0});

  struct refusal {
    char const* what;
    dtype store_dtype;
    std::int64_t begin;
    std::int64_t count;
    std::int64_t faulty;  // the first faulty captured token of the range
    char const* message;  // the first faulty token, relative and captured
  };
  for (refusal const& r :
       {refusal{"NaN",
                dtype::bfloat16,
                5,
                1,
                5,
                "fact 7 holds a NaN, an infinity or a value beyond "
                "the store dtype bfloat16 at token 0 (captured token "
                "5); so does fact 8; none of the facts is stored"},
        refusal{"+inf", dtype::float32, 3, 2, 4, "at token 1 (captured token 4)"},
        refusal{"1e6 in float16", dtype::float16, 1, 3, 2, "at token 1 (captured token 2)"},
        refusal{
          "FLT_MAX in bfloat16", dtype::bfloat16, 3, 1, 3, "at token 0 (captured token 3)"}}) {
    CAPTURE(r.what);
    // A finite fact first in the list, refused with the faulty ones; fact 8 is the faulty token
    // alone.
    std::vector<captured_fact> facts{{6, 1, 0, {1}}, {7, 1, r.begin, {}}, {8, 1, r.faulty, {1}}};
    facts[1].token_ids.assign(static_cast<std::size_t>(r.count), 1);
    kv_store store           = dirty_store(r.store_dtype);
    store_state const before = state_of(store);
    dispatch_dtype(r.store_dtype, [&](auto tag_type) {
      using S = typename decltype(tag_type)::type;
      if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                    std::is_same_v<S, bfloat16_t>) {
        CHECK_THROWS_WITH(emulate_store<S>(store, c, facts),
                          Catch::Contains(r.message) && Catch::Contains("; so does fact 8;") &&
                            Catch::Contains("fact 7 holds"));
      }
    });
    CHECK(state_of(store) == before);
    // The host capture's path refuses the same facts, the store unchanged too.
    CHECK_THROWS_AS(store_captured_facts(store, c, facts), logic_error);
    CHECK(state_of(store) == before);
  }

  // Finite facts are stored: 1e6 within bfloat16, and the faulty tokens outside the facts.
  kv_store bf16_store = dirty_store(dtype::bfloat16);
  kv_store bf16_host  = dirty_store(dtype::bfloat16);
  std::vector<captured_fact> const finite{{1, 1, 0, {1, 2, 3}}};
  emulate_store<bfloat16_t>(bf16_store, c, finite);
  store_captured_facts(bf16_host, c, finite);
  CHECK(bf16_store.num_facts() == 2);  // fact 91 of dirty_store, and fact 1
  CHECK(bf16_store.pool_to_host() == bf16_host.pool_to_host());
  kv_store half_store = dirty_store(dtype::float16);
  emulate_store<half_t>(half_store, c, {{1, 1, 0, {1, 2}}});
  CHECK(half_store.contains(1));
}

TEST_CASE(
  "an injection step of one request through a cache adapter: allocate, inject rotated "
  "keys into the adapter's slots, commit",
  "[engine]")
{
  kv_store store = host_store(small);
  fake_model model;
  encode_facts(model, store, {1, 2, 3}, 0, {{7, 0, 0, {1, 2}}, {8, 0, 2, {3}}});
  compose_options opts;
  opts.first_position    = 40;
  opts.order             = fact_order::as_given;
  composition const plan = compose(store, {7, 8}, opts);
  fake_cache cache{small};
  // The one-request step: planned (the adapter allocates), run, committed.
  auto const inject = [&](rope_params const& rotation) {
    injection_batch step{store};
    step.add(plan, cache);
    step.run(cache.cache(), rotation);
  };
  inject(model.rotation());
  CHECK(cache.allocated_at == 40);
  CHECK(cache.committed == std::vector<std::int64_t>{3});
  CHECK(cache.released.empty());
  // Token j went to slot 15 - j at position 40 + j: K rotated (adjacent... halves here: pairs
  // (0, 2), (1, 3) with inv_freq 1 and 1e-2 for theta 1e4, head_dim 4), V copied.
  for (int j = 0; j < 3; ++j) {
    for (int l = 0; l < 2; ++l) {
      for (int h = 0; h < 2; ++h) {
        float const* k = cache.data.data() + l * 256 + (15 - j) * 8 + h * 4;
        float const* v = k + 128;
        for (int i = 0; i < 2; ++i) {
          double const inv = std::pow(10000.0, -2.0 * i / 4.0);
          double const a   = static_cast<float>(40 + j) * static_cast<float>(inv);
          double const x = tag(0, l, j, h, i), y = tag(0, l, j, h, i + 2);
          CAPTURE(j, l, h, i);
          CHECK(k[i] == Approx(x * std::cos(a) - y * std::sin(a)).epsilon(1e-5).margin(1e-4));
          CHECK(k[i + 2] == Approx(y * std::cos(a) + x * std::sin(a)).epsilon(1e-5).margin(1e-4));
        }
        for (int d = 0; d < 4; ++d) {
          CHECK(v[d] == tag(1, l, j, h, d));
        }
      }
    }
  }
  // Too few slots: refused before anything is written or committed; the 2 slots the adapter
  // handed out for the plan's 3 tokens are given back (release of the 3 it was asked for).
  std::vector<float> const before = cache.data;
  cache.short_by                  = 1;
  CHECK_THROWS_WITH(inject(model.rotation()),
                    Catch::Matchers::Contains("the cache adapter allocated 2 slots for 3 tokens"));
  CHECK(cache.data == before);
  CHECK(cache.committed.size() == 1);
  CHECK(cache.released == std::vector<std::int64_t>{3});

  // Beyond the model's range (positions 40 .. 42, max_position 42): the run refuses it naming the
  // position and the range, after the adapter allocated, before anything is written or
  // committed, and the adapter's slots are released; the opt-in accepts it.
  cache.short_by      = 0;
  cache.allocated_at  = -1;
  rope_params ranged  = model.rotation();
  ranged.max_position = 42;
  CHECK_THROWS_WITH(inject(ranged),
                    Catch::Matchers::Contains("injection_batch::run: position 42 is beyond the "
                                              "model's range (max_position 42"));
  CHECK(cache.allocated_at == 40);
  CHECK(cache.data == before);
  CHECK(cache.committed.size() == 1);
  CHECK(cache.released == (std::vector<std::int64_t>{3, 3}));
  ranged.max_position = 43;  // the boundary: the last position 42 is the last allowed
  CHECK_NOTHROW(inject(ranged));
  CHECK(cache.allocated_at == 40);
  CHECK(cache.committed.size() == 2);
  ranged.max_position              = 42;
  ranged.allow_beyond_max_position = true;
  CHECK_NOTHROW(inject(ranged));
  CHECK(cache.committed.size() == 3);
  CHECK(cache.released.size() == 2);  // the successful steps released nothing
}

TEST_CASE("fused multiply-add rotation: fma(x, c, -(y s)), fma(x, s, y c) on a flagged table",
          "[engine][rope]")
{
  // Values where the fused and the separately rounded forms differ in fp32.
  std::vector<float> table(2 * 4);
  float const c = 0.8414709568f, s = 0.5403022766f;
  table = {1, 1, 0, 0, c, c, s, s};  // row 0 identity, row 1 (cos, cos | sin, sin)
  rope_params base{};
  base.head_dim            = 4;
  base.rotary_dim          = 4;
  base.pairing             = rope_pairing::interleaved;
  auto fused               = make_rope_cos_sin_table(base, table.data(), 2, false);
  fused.fused_multiply_add = true;
  auto plain               = fused;
  plain.fused_multiply_add = false;
  int differ               = 0;
  for (int trial = 0; trial < 200; ++trial) {
    float x[4];
    for (int e = 0; e < 4; ++e) {
      x[e] = std::ldexp(1.0f + 0.0137f * static_cast<float>(trial * 4 + e), trial % 7 - 3);
    }
    float a[4], b[4];
    std::memcpy(a, x, sizeof x);
    std::memcpy(b, x, sizeof x);
    std::int64_t const pos = 1;
    rope_apply_host(make_token_head_view(a, 1, 1, 4), &pos, 1, fused, rope_op::forward);
    rope_apply_host(make_token_head_view(b, 1, 1, 4), &pos, 1, plain, rope_op::forward);
    for (int p = 0; p < 2; ++p) {
      float const x0 = x[2 * p], x1 = x[2 * p + 1];
      CHECK(a[2 * p] == std::fma(x0, c, -(x1 * s)));
      CHECK(a[2 * p + 1] == std::fma(x0, s, x1 * c));
      float const s0 = x0 * c, s1 = x1 * s;  // separately rounded
      CHECK(b[2 * p] == s0 - s1);
      differ += a[2 * p] != b[2 * p] || a[2 * p + 1] != b[2 * p + 1];
    }
  }
  CHECK(differ > 0);  // the flag changes results: it is not a no-op

  // The injection path computes the same fused products.
  kv_geometry const g{1, 1, 4};
  kv_store store = host_store(g);
  std::vector<float> k{1.37f, -2.11f, 0.093f, 5.5f}, v{1, 2, 3, 4};
  store.insert<float>(1,
                      0,
                      {5},
                      make_fact_kv_view<float const>(k.data(), 1, 1, 1, 4),
                      make_fact_kv_view<float const>(v.data(), 1, 1, 1, 4));
  std::vector<float> out(2 * 4 * 2, 0.0f);
  paged_kv_cache cache =
    make_contiguous_cache(dtype::float32, out.data(), {1, 2, 2, 1, 4}, {16, 8, 4, 4, 1});
  compose_options opts;
  opts.first_position = 1;
  injection_batch batch{store};
  batch.add(compose(store, {1}, opts), std::vector<std::int64_t>{0});
  batch.run(cache, fused);
  CHECK(out[0] == std::fma(k[0], c, -(k[1] * s)));
  CHECK(out[1] == std::fma(k[0], s, k[1] * c));
  CHECK(out[2] == std::fma(k[2], c, -(k[3] * s)));
  CHECK(out[3] == std::fma(k[2], s, k[3] * c));
}

TEST_CASE("kv_geometry / rope_spec from GGUF metadata", "[engine][rope]")
{
  // SmolLM2-135M-Instruct's keys (as llama.cpp's llama_model_meta_val_str prints them).
  std::map<std::string, std::string> meta{{"general.architecture", "llama"},
                                          {"llama.block_count", "30"},
                                          {"llama.embedding_length", "576"},
                                          {"llama.attention.head_count", "9"},
                                          {"llama.attention.head_count_kv", "3"},
                                          {"llama.rope.freq_base", "100000.000000"},
                                          {"llama.rope.dimension_count", "64"},
                                          {"llama.context_length", "8192"}};
  auto lookup = [&](std::string const& k) -> std::optional<std::string> {
    auto it = meta.find(k);
    if (it == meta.end()) { return std::nullopt; }
    return it->second;
  };
  CHECK(kv_geometry_from_gguf(lookup) == kv_geometry{30, 3, 64});
  rope_spec spec = rope_spec_from_gguf(lookup, rope_pairing::interleaved);
  CHECK(spec.head_dim == 64);
  CHECK(spec.effective_rotary_dim() == 64);
  CHECK(spec.theta == 100000.0);
  CHECK(spec.scaling == rope_scaling::none);
  CHECK(spec.pairing == rope_pairing::interleaved);
  CHECK(spec.max_position == 8192);
  CHECK(make_rope_params(spec).max_position == 8192);  // <arch>.context_length: the model's range
  CHECK(make_rope_params(spec).position_bound() == 8192);

  meta["llama.rope.dimension_count"] = "32";  // partial rotary
  CHECK(rope_spec_from_gguf(lookup, rope_pairing::halves).effective_rotary_dim() == 32);
  meta["llama.rope.scaling.type"]   = "linear";
  meta["llama.rope.scaling.factor"] = "4.0";
  spec                              = rope_spec_from_gguf(lookup, rope_pairing::halves);
  CHECK(spec.scaling == rope_scaling::linear);
  CHECK(spec.factor == 4.0);
  meta["llama.rope.scaling.type"]                    = "yarn";
  meta["llama.rope.scaling.original_context_length"] = "2048";
  spec = rope_spec_from_gguf(lookup, rope_pairing::halves);
  CHECK(spec.scaling == rope_scaling::yarn);
  CHECK(spec.original_max_position == 2048);
  CHECK(spec.beta_fast == 32.0);
  // A length that no int64 holds is refused, not converted (found by tests/fuzz: the cast of
  // 3.2e65 was undefined behaviour).
  meta["llama.rope.scaling.original_context_length"] = "3.2e65";
  CHECK_THROWS_WITH(rope_spec_from_gguf(lookup, rope_pairing::halves),
                    Catch::Matchers::Contains("original_context_length") &&
                      Catch::Matchers::Contains("is not a positive integer"));
  meta["llama.rope.scaling.original_context_length"] = "2048.5";
  CHECK_THROWS_AS(rope_spec_from_gguf(lookup, rope_pairing::halves), logic_error);
  meta["llama.rope.scaling.original_context_length"] = "2048";
  meta["llama.rope.scaling.type"] = "longrope";  // factors live in tensors: refused
  CHECK_THROWS_AS(rope_spec_from_gguf(lookup, rope_pairing::halves), logic_error);
  meta.erase("llama.rope.scaling.type");
  meta.erase("llama.rope.scaling.factor");
  meta["llama.attention.key_length"] = "96";
  CHECK(kv_geometry_from_gguf(lookup).head_dim == 96);
  meta["llama.attention.value_length"] = "64";
  CHECK_THROWS_AS(kv_geometry_from_gguf(lookup), logic_error);
  meta.erase("llama.attention.value_length");
  meta["llama.block_count"] = "thirty";
  CHECK_THROWS_AS(kv_geometry_from_gguf(lookup), logic_error);
  meta.erase("llama.block_count");
  CHECK_THROWS_AS(kv_geometry_from_gguf(lookup), logic_error);
  meta.erase("general.architecture");
  CHECK_THROWS_AS(rope_spec_from_gguf(lookup, rope_pairing::halves), logic_error);
}

TEST_CASE("rope_spec / kv_geometry from HF config.json", "[engine][rope]")
{
  using nlohmann::json;
  // meta-llama/Llama-3.1-8B-Instruct (the fields rope reads).
  json const llama = json::parse(R"({
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}})");
  CHECK(kv_geometry_from_hf_config(llama) == kv_geometry{32, 8, 128});
  rope_spec const s = rope_spec_from_hf_config(llama);
  rope_spec const p = rope_presets::llama_3_1_8b();
  CHECK(s.scaling == rope_scaling::llama3);
  CHECK(s.theta == p.theta);
  CHECK(s.factor == p.factor);
  CHECK(s.original_max_position == p.original_max_position);
  CHECK(s.inverse_frequencies() == p.inverse_frequencies());
  // The model's range, max_position_embeddings, reaches rope_params.
  CHECK(s.max_position == 131072);
  CHECK(make_rope_params(s).max_position == 131072);
  CHECK_FALSE(make_rope_params(s).allow_beyond_max_position);
  {
    // the same config read from a config.json file
    std::string const path =
      (std::filesystem::temp_directory_path() / "inferscale-engine-host-positions-config.json")
        .string();
    {
      std::ofstream out(path);
      out << llama.dump();
    }
    rope_spec const from_file = rope_spec_from_hf_config(read_hf_config(path));
    std::remove(path.c_str());
    CHECK(make_rope_params(from_file).max_position == 131072);
    CHECK_THROWS_WITH(rope_check_positions(make_rope_params(from_file), 131000, 73, "t"),
                      Catch::Matchers::Contains("t: position 131000 + 72 = 131072 is beyond the "
                                                "model's range (max_position 131072"));
  }

  // HuggingFaceTB/SmolLM2-135M-Instruct.
  json const smol = json::parse(R"({"hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "num_hidden_layers": 30, "max_position_embeddings": 8192,
    "rope_theta": 100000, "rope_scaling": null, "rope_interleaved": false})");
  CHECK(kv_geometry_from_hf_config(smol) == kv_geometry{30, 3, 64});
  CHECK(rope_spec_from_hf_config(smol).inverse_frequencies() ==
        rope_presets::smollm2_135m().inverse_frequencies());

  // YaRN without a factor: HF derives it from the two lengths; mscale 0 means absent.
  json const yarn   = json::parse(R"({"head_dim": 128, "num_attention_heads": 32,
    "num_hidden_layers": 2, "max_position_embeddings": 131072, "rope_theta": 10000,
    "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32768,
                     "mscale": 0, "mscale_all_dim": 0}})");
  rope_spec const y = rope_spec_from_hf_config(yarn);
  CHECK(y.factor == 4.0);
  CHECK_FALSE(y.mscale.has_value());
  CHECK(y.attention_scaling() == Approx(0.1 * std::log(4.0) + 1.0));

  // transformers v5: rope_parameters holds rope_theta.
  json const v5     = json::parse(R"({"head_dim": 64, "num_attention_heads": 4,
    "num_hidden_layers": 2, "partial_rotary_factor": 0.5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})");
  rope_spec const q = rope_spec_from_hf_config(v5);
  CHECK(q.theta == 1000000.0);
  CHECK(q.effective_rotary_dim() == 32);

  // microsoft/Phi-3.5-mini-instruct: LongRoPE, original_max_position_embeddings at the top level
  // (its factor lists as published, held by the preset).
  rope_spec const phi = rope_presets::phi_3_5_mini();
  json const phi_config{
    {"hidden_size", 3072},
    {"num_attention_heads", 32},
    {"num_key_value_heads", 32},
    {"num_hidden_layers", 32},
    {"max_position_embeddings", 131072},
    {"original_max_position_embeddings", 4096},
    {"rope_theta", 10000.0},
    {"rope_scaling",
     {{"type", "longrope"}, {"short_factor", phi.short_factor}, {"long_factor", phi.long_factor}}}};
  rope_spec const l = rope_spec_from_hf_config(phi_config);
  CHECK(kv_geometry_from_hf_config(phi_config) == kv_geometry{32, 32, 96});
  CHECK(l.scaling == rope_scaling::longrope);
  CHECK(l.original_max_position == 4096);
  for (std::int64_t length : {100, 5000}) {
    CHECK(l.inverse_frequencies(length) == phi.inverse_frequencies(length));
  }
  // sqrt(1 + ln(131072 / 4096) / ln 4096), the attention factor LongRoPE derives.
  CHECK(l.attention_scaling() == Approx(std::sqrt(1.0 + std::log(32.0) / std::log(4096.0))));

  CHECK_THROWS_AS(rope_spec_from_hf_config(
                    json::parse(R"({"head_dim": 64, "rope_scaling": {"rope_type": "su-per"}})")),
                  logic_error);
  // Position counts are non-negative integers up to 2^53: refused rather than converted (found by
  // tests/fuzz: the casts of 1e300 and -1e30 to int64 were undefined behaviour, 4096.5 was
  // truncated). 2^53 itself and a whole number written as 8192.0 are taken.
  for (char const* bad : {R"({"head_dim": 64, "max_position_embeddings": 1e300})",
                          R"({"head_dim": 64, "max_position_embeddings": -1})",
                          R"({"head_dim": 64, "max_position_embeddings": 4096.5})",
                          R"({"head_dim": 64, "max_position_embeddings": 9007199254740994})",
                          R"({"head_dim": 64, "max_position_embeddings": 4096, "rope_scaling":
                              {"rope_type": "yarn", "factor": 2,
                               "original_max_position_embeddings": -1e30}})",
                          R"({"head_dim": 64, "max_position_embeddings": 4096,
                              "original_max_position_embeddings": 1e19, "rope_scaling":
                              {"type": "longrope", "short_factor": [1], "long_factor": [1]}})"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH(rope_spec_from_hf_config(json::parse(bad)),
                      Catch::Matchers::Contains("must be a non-negative integer (at most 2^53)"));
  }
  CHECK(rope_spec_from_hf_config(
          json::parse(R"({"head_dim": 64, "max_position_embeddings": 9007199254740992})"))
          .max_position == (std::int64_t{1} << 53));
  CHECK(
    rope_spec_from_hf_config(json::parse(R"({"head_dim": 64, "max_position_embeddings": 8192.0})"))
      .max_position == 8192);
  CHECK_THROWS_AS(kv_geometry_from_hf_config(json::parse(R"({"hidden_size": 10})")), logic_error);
  CHECK_THROWS_AS(read_hf_config("/nonexistent/config.json"), logic_error);
}

TEST_CASE(
  "capture of the smallest shapes: one layer, one head, head_dim 6 (not a whole 16-byte "
  "run), one token, pages of one token - host, the device kernels' code and the "
  "written-out pool agree",
  "[engine][capture][degenerate]")
{
  dtype const t = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(t));
  constexpr int D = 6;  // head_dim: even (rotary pairs), 24 / 12 bytes
  kv_geometry const g{1, 1, D};
  // three tokens' K and V, values exact in every store dtype (quarters up to 9), so the pool must
  // hold them as written
  std::vector<float> k(3 * D), v(3 * D);
  for (int i = 0; i < 3 * D; ++i) {
    k[static_cast<std::size_t>(i)] = 0.25f * static_cast<float>(i - 7);
    v[static_cast<std::size_t>(i)] = -0.5f * static_cast<float>(i + 1);
  }
  // the device capture write of one head (strides 8, 7, 1 over a padded source)
  std::vector<float> padded(3 * 8, -99.0f);
  for (int j = 0; j < 3; ++j) {
    for (int d = 0; d < D; ++d) {
      padded[static_cast<std::size_t>(j * 8 + d)] = k[static_cast<std::size_t>(j * D + d)];
    }
  }
  for (std::int64_t count : {1, 3}) {
    CAPTURE(count);
    std::vector<float> rows(static_cast<std::size_t>(count * D), 0.0f);
    detail::capture_write_args<float> const a{rows.data(), padded.data(), count, 1, D, 8, 7, 1};
    REQUIRE(detail::capture_write_elements(a) == count * D);
    for (std::int64_t i = 0; i < detail::capture_write_elements(a); ++i) {
      detail::capture_write_element(a, i);
    }
    CHECK(rows == std::vector<float>(k.begin(), k.begin() + count * D));
  }
  kv_capture c{g, 3};
  for (std::int64_t j = 0; j < 3; ++j) {  // one token per write, as a one-token forward gives
    c.write_keys(0, j, make_token_head_view<float const>(k.data() + j * D, 1, 1, D));
    c.write_values(0, j, make_token_head_view<float const>(v.data() + j * D, 1, 1, D));
  }
  REQUIRE(c.complete());
  // facts of one token (the first, the last) and of three, over pages of one token
  std::vector<captured_fact> const facts{{1, 9, 0, {11}}, {2, 9, 2, {13}}, {3, 9, 0, {11, 12, 13}}};
  kv_store_config sc;
  sc.model       = g;
  sc.store_dtype = t;
  sc.page_size   = 1;
  sc.num_pages   = 8;
  sc.space       = memory_space::host;
  kv_store by_host{sc};
  kv_store by_emulate{sc};
  store_captured_facts(by_host, c, facts);
  dispatch_dtype(t, [&](auto tag_type) {
    using S = typename decltype(tag_type)::type;
    if constexpr (std::is_same_v<S, float> || std::is_same_v<S, half_t> ||
                  std::is_same_v<S, bfloat16_t>) {
      emulate_store<S>(by_emulate, c, facts);
    }
  });
  CHECK(by_emulate.pool_to_host() == by_host.pool_to_host());
  // Written out: the pool is [pages][layers][2][page_size][heads][head_dim], so with one layer,
  // one head and pages of one token, K of a fact's token j is elements page * 2D + 0..D-1, V
  // page * 2D + D..2D-1.
  std::vector<unsigned char> const pool = by_host.pool_to_host();
  std::size_t const bytes               = size_of(t);
  auto read                             = [&](std::int64_t element) {
    float x                = 0;
    unsigned char const* p = pool.data() + static_cast<std::size_t>(element) * bytes;
    if (t == dtype::float32) { std::memcpy(&x, p, 4); }
    if (t == dtype::float16) {
      half_t h;
      std::memcpy(&h, p, 2);
      x = to_float(h);
    }
    if (t == dtype::bfloat16) {
      bfloat16_t b;
      std::memcpy(&b, p, 2);
      x = to_float(b);
    }
    return x;
  };
  for (captured_fact const& f : facts) {
    fact_record const& r = by_host.at(f.fact_id);
    REQUIRE(r.pages.size() == f.token_ids.size());
    for (std::size_t j = 0; j < f.token_ids.size(); ++j) {
      std::int64_t const token = f.begin + static_cast<std::int64_t>(j);
      for (int d = 0; d < D; ++d) {
        CAPTURE(f.fact_id, j, d);
        CHECK(read(r.pages[j] * 2 * D + d) == k[static_cast<std::size_t>(token * D + d)]);
        CHECK(read(r.pages[j] * 2 * D + D + d) == v[static_cast<std::size_t>(token * D + d)]);
      }
    }
  }
}
