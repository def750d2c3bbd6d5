// The input-hardening battery: bad input thrown at every public entry point a user reaches on the
// host (the store, compose, the injection batch, cache descriptors, rotation specs and HF configs,
// the index, the host run / extract_host). Each case runs in its own process (fork + waitpid), so a
// segmentation fault or an abort fails that case and not the battery. A case passes when the call
// is refused with an inferscale::logic_error whose message holds the expected words and the
// store (catalogue, pool bytes, version, free pages), the cache bytes, the index (size, version,
// search results) and the batch are exactly as before; or, for the inputs the library documents
// as handled rather than refused, when the documented result is observed.
//
// Usage: test_hardening [substring]   (runs the cases whose "class/name" holds the substring)
// Prints one line per failure and the counts by class; exits 1 if any case failed.

#include <inferscale/cache.hpp>
#include <inferscale/compose.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/engine.hpp>
#include <inferscale/error.hpp>
#include <inferscale/extract.hpp>
#include <inferscale/geometry.hpp>
#include <inferscale/hf_config.hpp>
#include <inferscale/index.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/rope.hpp>
#include <inferscale/store.hpp>

#include <cuda/std/span>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace inferscale;
using json = nlohmann::json;

// ------------------------------------------------------------------------------------------------
// Verdicts

/// A case's own failure (thrown in the child, printed, exit code 1).
struct case_failure {
  std::string what;
};

[[noreturn]] void fail(std::string const& what) { throw case_failure{what}; }

void require(bool condition, std::string const& what)
{
  if (!condition) { fail(what); }
}

/// Runs `f`, which must throw inferscale::logic_error with `words` in its message.
template <class F>
void expect_refused(F&& f, char const* words)
{
  try {
    f();
  } catch (logic_error const& e) {
    if (std::strstr(e.what(), words) == nullptr) {
      fail(std::string{"refused, but the message lacks \""} + words + "\": " + e.what());
    }
    return;
  } catch (std::exception const& e) {
    fail(std::string{"threw something other than inferscale::logic_error: "} + e.what());
  }
  fail(std::string{"accepted (expected a refusal mentioning \""} + words + "\")");
}

// ------------------------------------------------------------------------------------------------
// Fixture: a small host store, a host cache, a rotation, an index

constexpr std::int32_t layers   = 2;
constexpr std::int32_t heads    = 2;
constexpr std::int32_t head_dim = 8;
constexpr std::int32_t page     = 4;
constexpr std::int64_t pages    = 8;
constexpr std::int64_t slots    = 64;  // cache tokens
constexpr std::int64_t rows     = 32;  // cos/sin table rows

kv_store_config store_config(dtype t = dtype::bfloat16, std::int64_t num_pages = pages)
{
  kv_store_config c{};
  c.model       = kv_geometry{layers, heads, head_dim};
  c.store_dtype = t;
  c.page_size   = page;
  c.num_pages   = num_pages;
  c.space       = memory_space::host;
  return c;
}

/// `[layers, tokens, heads, head_dim]` fp32 values, finite and distinct per fact.
std::vector<float> kv_values(std::int64_t tokens, float seed, std::int32_t h = heads)
{
  std::vector<float> v(static_cast<std::size_t>(layers * tokens * h * head_dim));
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = std::sin(seed + 0.37f * static_cast<float>(i));
  }
  return v;
}

std::vector<std::int32_t> token_ids(std::int64_t tokens, std::int32_t first = 100)
{
  std::vector<std::int32_t> t(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < t.size(); ++i) {
    t[i] = first + static_cast<std::int32_t>(i);
  }
  return t;
}

fact_kv_view<float const> view_of(std::vector<float> const& v,
                                  std::int64_t tokens,
                                  std::int32_t h = heads,
                                  std::int32_t d = head_dim)
{
  return make_fact_kv_view<float const>(v.data(), layers, tokens, h, d);
}

void insert_fact(kv_store& s, std::uint64_t id, std::uint64_t ns, std::int64_t tokens)
{
  auto const k = kv_values(tokens, static_cast<float>(id));
  auto const v = kv_values(tokens, static_cast<float>(id) + 0.5f);
  s.insert(id, ns, token_ids(tokens), view_of(k, tokens), view_of(v, tokens));
}

/// Facts 1 (5 tokens) and 2 (3 tokens) in namespace 1, fact 3 (7 tokens) in namespace 2: 5 of the
/// 8 pages; fact 9 was inserted and erased, so the free pages are not in order.
kv_store make_store(dtype t = dtype::bfloat16, std::int64_t num_pages = pages)
{
  kv_store s{store_config(t, num_pages)};
  insert_fact(s, 9, 1, 2);
  insert_fact(s, 1, 1, 5);
  insert_fact(s, 2, 1, 3);
  s.erase(9);
  insert_fact(s, 3, 2, 7);
  return s;
}

struct store_state {
  std::vector<unsigned char> pool;
  std::uint64_t version{};
  std::int64_t free_pages{}, num_facts{};
  std::map<std::uint64_t, std::vector<std::uint64_t>> namespaces;
  std::map<std::uint64_t, std::pair<std::vector<std::int32_t>, std::vector<std::int64_t>>> facts;

  bool operator==(store_state const& o) const
  {
    return pool == o.pool && version == o.version && free_pages == o.free_pages &&
           num_facts == o.num_facts && namespaces == o.namespaces && facts == o.facts;
  }
};

store_state state_of(kv_store const& s)
{
  store_state st;
  st.pool       = s.pool_to_host();
  st.version    = s.version();
  st.free_pages = s.free_pages();
  st.num_facts  = s.num_facts();
  for (std::uint64_t ns : {1, 2, 3, 7, 77}) {
    st.namespaces[ns] = s.namespace_fact_ids(ns);
    for (std::uint64_t id : st.namespaces[ns]) {
      st.facts[id] = {s.at(id).token_ids, s.at(id).pages};
    }
  }
  return st;
}

/// Checks after a refusal that the store is exactly as it was.
struct store_guard {
  kv_store const& store;
  store_state before{state_of(store)};
  void check() const { require(state_of(store) == before, "the store changed after a refusal"); }
};

/// A host cache `[layers][2][slots][heads][head_dim]` of T, filled with a fixed pattern.
template <class T>
struct host_cache {
  std::vector<T> data;
  paged_kv_cache desc;

  host_cache() : data(static_cast<std::size_t>(layers * 2 * slots * heads * head_dim)), desc{}
  {
    auto* bytes = reinterpret_cast<unsigned char*>(data.data());
    for (std::size_t i = 0; i < data.size() * sizeof(T); ++i) {
      bytes[i] = static_cast<unsigned char>((i * 37 + 11) & 0x3f);  // small finite values
    }
    desc = make_contiguous_cache(
      dtype_of_v<T>,
      data.data(),
      {layers, 2, slots, heads, head_dim},
      {2 * slots * heads * head_dim, slots * heads * head_dim, heads * head_dim, head_dim, 1});
  }
  std::vector<unsigned char> bytes() const
  {
    auto const* p = reinterpret_cast<unsigned char const*>(data.data());
    return {p, p + data.size() * sizeof(T)};
  }
};

template <class T>
struct cache_guard {
  host_cache<T> const& cache;
  std::vector<unsigned char> before{cache.bytes()};
  void check() const
  {
    require(cache.bytes() == before, "the cache bytes changed after a refusal");
  }
};

rope_spec spec()
{
  rope_spec s{};
  s.head_dim = head_dim;
  s.theta    = 10000.0;
  return s;
}

struct rotation_fixture {
  rope_params params{make_rope_params(spec())};
  std::vector<bfloat16_t> values{make_rope_cos_sin_values<bfloat16_t>(params, rows)};
  rope_cos_sin_table<bfloat16_t> table{make_rope_cos_sin_table(params, values.data(), rows)};
};

struct batch_state {
  std::vector<std::int64_t> store_tokens, positions, slots, offsets;
  std::int64_t max_slot{}, max_position{};
  bool operator==(batch_state const& o) const
  {
    return store_tokens == o.store_tokens && positions == o.positions && slots == o.slots &&
           offsets == o.offsets && max_slot == o.max_slot && max_position == o.max_position;
  }
};

batch_state state_of(injection_batch const& b)
{
  return {b.store_tokens(),
          b.positions(),
          b.slots(),
          b.request_offsets(),
          b.max_slot(),
          b.max_position()};
}

struct batch_guard {
  injection_batch const& batch;
  batch_state before{state_of(batch)};
  void check() const { require(state_of(batch) == before, "the batch changed after a refusal"); }
};

std::vector<std::int64_t> slot_range(std::int64_t first, std::int64_t n)
{
  std::vector<std::int64_t> s(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    s[static_cast<std::size_t>(j)] = first + j;
  }
  return s;
}

/// A batch holding one request (facts 2 then 1 at positions 4..) in slots 10.. .
injection_batch make_batch(kv_store const& store)
{
  injection_batch b(store);
  compose_options o{};
  o.first_position = 4;
  o.order          = fact_order::as_given;
  auto const plan  = compose(store, {2, 1}, o);
  b.add(plan, slot_range(10, plan.length()));
  return b;
}

/// A cache description whose only use is its block size (what injection_batch::add reads of a
/// block table's cache; the refusals below come before any write).
paged_kv_cache block_size_cache(std::int32_t block_size)
{
  paged_kv_cache c{};
  c.key_layout.block_size   = block_size;
  c.value_layout.block_size = block_size;
  return c;
}

// The index: dim 4, cosine, namespaces 1 (ids 1, 2) and 2 (id 3).
constexpr std::int64_t dim = 4;

graph_index make_index(dtype t = dtype::float32)
{
  index_config c{};
  c.dim          = dim;
  c.vector_dtype = t;
  graph_index index{c};
  std::vector<float> const a{1, 0, 0, 0, 0.5f, 0.5f, 0, 0};
  std::vector<std::uint64_t> const ids_a{1, 2};
  index.add(1,
            make_matrix_view<float const>(a.data(), 2, dim),
            cuda::std::span<std::uint64_t const>{ids_a.data(), ids_a.size()});
  std::vector<float> const b{0, 0, 1, 1};
  std::vector<std::uint64_t> const ids_b{3};
  index.add(2,
            make_matrix_view<float const>(b.data(), 1, dim),
            cuda::std::span<std::uint64_t const>{ids_b.data(), ids_b.size()});
  return index;
}

struct index_state {
  std::uint64_t version{}, total{};
  std::vector<std::uint64_t> namespaces, ids1, ids2, found;
  std::vector<float> distances;
  bool operator==(index_state const& o) const
  {
    return version == o.version && total == o.total && namespaces == o.namespaces &&
           ids1 == o.ids1 && ids2 == o.ids2 && found == o.found && distances == o.distances;
  }
};

index_state state_of(graph_index const& index)
{
  index_state st{
    index.version(), index.total_size(), index.namespaces(), index.ids(1), index.ids(2), {}, {}};
  std::vector<float> const q{1, 0.2f, 0.1f, 0, 0.1f, 0, 1, 0.9f};
  std::vector<std::uint64_t> const ns{1, 2};
  st.found.resize(2 * 3);
  st.distances.resize(2 * 3);
  inferscale::search(index,
                     make_matrix_view<float const>(q.data(), 2, dim),
                     cuda::std::span<std::uint64_t const>{ns.data(), ns.size()},
                     3,
                     search_params{},
                     make_matrix_view<std::uint64_t>(st.found.data(), 2, 3),
                     make_matrix_view<float>(st.distances.data(), 2, 3));
  return st;
}

struct index_guard {
  graph_index const& index;
  index_state before{state_of(index)};
  void check() const { require(state_of(index) == before, "the index changed after a refusal"); }
};

using ids_span = cuda::std::span<std::uint64_t const>;

// ------------------------------------------------------------------------------------------------
// The cases

struct test_case {
  std::string klass, name;
  std::function<void()> run;
};

std::vector<test_case> cases;

void add(char const* klass, std::string name, std::function<void()> run)
{
  cases.push_back({klass, std::move(name), std::move(run)});
}

/// A store refusal: `f(store)` must be refused with `words`, the store unchanged.
void store_case(std::string name,
                char const* words,
                std::function<void(kv_store&)> f,
                dtype t = dtype::bfloat16)
{
  add("store", std::move(name), [=] {
    kv_store s = make_store(t);
    store_guard const g{s};
    expect_refused([&] { f(s); }, words);
    g.check();
  });
}

void store_cases()
{
  auto const k5 = kv_values(5, 40);
  auto const v5 = kv_values(5, 41);
  store_case("insert: null key data", "null key or value data", [=](kv_store& s) {
    s.insert(50,
             1,
             token_ids(5),
             make_fact_kv_view<float const>(nullptr, layers, 5, heads, head_dim),
             view_of(v5, 5));
  });
  store_case("insert: null value data", "null key or value data", [=](kv_store& s) {
    s.insert(50,
             1,
             token_ids(5),
             view_of(k5, 5),
             make_fact_kv_view<float const>(nullptr, layers, 5, heads, head_dim));
  });
  auto const poisoned = [=](float x, bool value, std::size_t at) {
    return [=](kv_store& s) {
      auto k              = k5;
      auto v              = v5;
      (value ? v : k)[at] = x;
      s.insert(50, 1, token_ids(5), view_of(k, 5), view_of(v, 5));
    };
  };
  float const inf = std::numeric_limits<float>::infinity();
  store_case("insert: NaN key",
             "NaN and infinities are refused",
             poisoned(std::numeric_limits<float>::quiet_NaN(), false, 17));
  store_case("insert: +Inf value", "NaN and infinities are refused", poisoned(inf, true, 3));
  store_case("insert: -Inf key in the last layer",
             "NaN and infinities are refused",
             poisoned(-inf, false, k5.size() - 1));
  store_case("insert: 1e6 into a float16 store",
             "overflows the store dtype float16 (largest finite 65504)",
             poisoned(1.0e6f, false, 9),
             dtype::float16);
  store_case("insert: -7e4 value into a float16 store",
             "overflows the store dtype float16",
             poisoned(-7.0e4f, true, 0),
             dtype::float16);
  store_case("insert: FLT_MAX into a bfloat16 store (rounds to infinity)",
             "overflows the store dtype bfloat16",
             poisoned(std::numeric_limits<float>::max(), true, 5));
  store_case("insert: NaN into a float32 store",
             "NaN and infinities",
             poisoned(std::numeric_limits<float>::quiet_NaN(), true, 8),
             dtype::float32);
  store_case("insert: duplicate id", "already stored", [=](kv_store& s) {
    s.insert(1, 1, token_ids(5), view_of(k5, 5), view_of(v5, 5));
  });
  store_case("insert: empty fact", "has no tokens", [=](kv_store& s) {
    s.insert(50, 1, {}, view_of(k5, 0), view_of(v5, 0));
  });
  store_case("insert: 1 token id for 5 tokens (pluralised)",
             "1 token id for 5 tokens of KV",
             [=](kv_store& s) { s.insert(50, 1, token_ids(1), view_of(k5, 5), view_of(v5, 5)); });
  store_case("insert: keys and values of different lengths", "different shapes", [=](kv_store& s) {
    s.insert(50, 1, token_ids(5), view_of(k5, 5), view_of(v5, 4));
  });
  store_case(
    "insert: views with 1 head (pluralised)", "views have 1 head, expected", [=](kv_store& s) {
      auto const k = kv_values(5, 1, 1);
      s.insert(50, 1, token_ids(5), view_of(k, 5, 1), view_of(k, 5, 1));
    });
  store_case("insert: wrong head_dim", "does not match the model's 8", [=](kv_store& s) {
    s.insert(50, 1, token_ids(5), view_of(k5, 5, heads, 4), view_of(v5, 5, heads, 4));
  });
  store_case("insert: negative stride", "is negative", [=](kv_store& s) {
    auto const k =
      make_fact_kv_view<float const>(k5.data() + 8,
                                     layers,
                                     5,
                                     heads,
                                     head_dim,
                                     {5 * heads * head_dim, heads * head_dim, -head_dim, 1});
    s.insert(50, 1, token_ids(5), k, view_of(v5, 5));
  });
  store_case("insert: capacity exhausted", "capacity exhausted", [=](kv_store& s) {
    auto const k = kv_values(20, 3);
    s.insert(50, 1, token_ids(20), view_of(k, 20), view_of(k, 20));
  });
  store_case(
    "insert: device views into a host store", "device views need a device store", [=](kv_store& s) {
      std::vector<bfloat16_t> b(static_cast<std::size_t>(layers * 5 * heads * head_dim));
      auto const v = make_fact_kv_view<bfloat16_t const>(b.data(), layers, 5, heads, head_dim);
      s.insert(50, 1, token_ids(5), v, v, memory_space::device);
    });
  store_case(
    "reserve: duplicate id", "already stored", [](kv_store& s) { s.reserve(3, 1, token_ids(2)); });
  store_case("reserve: empty fact", "has no tokens", [](kv_store& s) { s.reserve(50, 1, {}); });
  store_case("reserve: capacity exhausted", "fact 51 needs 4 pages, 3 free", [](kv_store& s) {
    s.reserve(51, 1, token_ids(16));
  });
  add("store", "reserve: needs 1 page, 0 free (pluralised)", [] {
    kv_store s = make_store(dtype::bfloat16, 5);  // the five pages the fixture fills
    store_guard const g{s};
    require(s.free_pages() == 0, "the fixture should fill a 5-page store");
    expect_refused([&] { s.reserve(51, 1, token_ids(1)); }, "fact 51 needs 1 page, 0 free");
    g.check();
  });
  store_case("erase: unknown id", "unknown fact id 42", [](kv_store& s) { s.erase(42); });
  store_case("at: unknown id", "unknown fact id 42", [](kv_store& s) { (void)s.at(42); });
  add("store", "erase_namespace of an unknown namespace: handled (0 erased, nothing changed)", [] {
    kv_store s = make_store();
    store_guard const g{s};
    require(s.erase_namespace(77) == 0, "erase_namespace(77) did not return 0");
    g.check();
  });
  auto const config_case =
    [](std::string name, char const* words, std::function<void(kv_store_config&)> f) {
      add("store", "config: " + name, [=] {
        kv_store_config c = store_config();
        f(c);
        expect_refused([&] { kv_store s{c}; }, words);
      });
    };
  config_case(
    "page size 0", "page_size must be positive", [](kv_store_config& c) { c.page_size = 0; });
  config_case("negative page count", "num_pages must be non-negative", [](kv_store_config& c) {
    c.num_pages = -1;
  });
  config_case("head range beyond the model", "head range", [](kv_store_config& c) {
    c.first_head = 1;
    c.num_heads  = 2;
  });
  config_case("fp8 store dtype", "store dtype must be", [](kv_store_config& c) {
    c.store_dtype = dtype::float8_e4m3;
  });
  config_case("odd head_dim", "head_dim must be positive and even", [](kv_store_config& c) {
    c.model.head_dim = 7;
  });
  config_case("pool bytes overflow", "overflow", [](kv_store_config& c) {
    c.num_pages = std::numeric_limits<std::int64_t>::max() / 2;
  });
}

void compose_cases()
{
  auto const compose_case =
    [](std::string name, char const* words, std::function<void(kv_store const&)> f) {
      add("compose", std::move(name), [=] {
        kv_store s = make_store();
        store_guard const g{s};
        expect_refused([&] { f(s); }, words);
        g.check();
      });
    };
  compose_case("unknown fact", "unknown fact id 42", [](kv_store const& s) {
    (void)compose(s, {1, 42});
  });
  compose_case("fact twice", "appears twice", [](kv_store const& s) {
    (void)compose(s, {1, 2, 1});
  });
  compose_case("prefix also listed", "appears twice", [](kv_store const& s) {
    compose_options o{};
    o.instruction_prefix = 2;
    (void)compose(s, {1, 2}, o);
  });
  compose_case("unknown prefix", "unknown instruction prefix id 42", [](kv_store const& s) {
    compose_options o{};
    o.instruction_prefix = 42;
    (void)compose(s, {1}, o);
  });
  compose_case("negative p0", "must be non-negative", [](kv_store const& s) {
    compose_options o{};
    o.first_position = -1;
    (void)compose(s, {1}, o);
  });
  compose_case("p0 near INT64_MAX", "below rope_position_limit", [](kv_store const& s) {
    compose_options o{};
    o.first_position = std::numeric_limits<std::int64_t>::max() - 2;
    (void)compose(s, {1}, o);
  });
  compose_case(
    "last position at rope_position_limit", "reaches rope_position_limit", [](kv_store const& s) {
      compose_options o{};
      o.first_position = rope_position_limit - 1;
      (void)compose(s, {1}, o);
    });
}

/// A batch refusal: `f(store, batch)` refused with `words`; store and batch unchanged.
void batch_case(std::string name,
                char const* words,
                std::function<void(kv_store&, injection_batch&)> f)
{
  add("batch", std::move(name), [=] {
    kv_store s        = make_store();
    injection_batch b = make_batch(s);
    store_guard const gs{s};
    batch_guard const gb{b};
    expect_refused([&] { f(s, b); }, words);
    gs.check();
    gb.check();
  });
}

/// A composition built by hand: `m` tokens of fact 1 (offsets 0..), starting at `p0`.
composition hand_plan(std::int64_t p0, std::int32_t m, std::uint64_t fact = 1)
{
  composition c;
  c.first_position = p0;
  c.segments.push_back({fact, 0, m});
  for (std::int32_t j = 0; j < m; ++j) {
    c.token_ids.push_back(100 + j);
    c.sources.push_back({fact, j});
  }
  return c;
}

void batch_cases()
{
  batch_case("hand-built plan at position -3",
             "must be non-negative and below rope_position_limit",
             [](kv_store&, injection_batch& b) { b.add(hand_plan(-3, 4), slot_range(30, 4)); });
  batch_case("hand-built plan whose last position overflows",
             "must be non-negative and below rope_position_limit",
             [](kv_store&, injection_batch& b) {
               b.add(hand_plan(std::numeric_limits<std::int64_t>::max() - 1, 4), slot_range(30, 4));
             });
  batch_case("plan with 1 source for 5 tokens (pluralised)",
             "the plan has 1 source for 5 tokens",
             [](kv_store&, injection_batch& b) {
               composition c = hand_plan(0, 5);
               c.sources.resize(1);
               b.add(c, slot_range(30, 5));
             });
  batch_case("plan naming an unknown fact",
             "unknown fact id 42",
             [](kv_store&, injection_batch& b) { b.add(hand_plan(0, 2, 42), slot_range(30, 2)); });
  batch_case("plan reading beyond a fact",
             "reads offset 5 of fact 1, which has 5 tokens",
             [](kv_store&, injection_batch& b) { b.add(hand_plan(0, 6), slot_range(30, 6)); });
  batch_case("too few slots (pluralised)",
             "has 5 tokens but only 1 slot were given",
             [](kv_store& s, injection_batch& b) { b.add(compose(s, {1}), slot_range(30, 1)); });
  batch_case("null slot mapping", "null slot mapping", [](kv_store& s, injection_batch& b) {
    b.add(compose(s, {1}),
          cuda::std::span<std::int64_t const>{static_cast<std::int64_t const*>(nullptr), 5});
  });
  batch_case("slot repeated within a request",
             "slot 31 is written twice",
             [](kv_store& s, injection_batch& b) {
               b.add(compose(s, {1}), std::vector<std::int64_t>{30, 31, 32, 31, 34});
             });
  batch_case("slot of an earlier request reused",
             "slot 12 is written twice",
             [](kv_store& s, injection_batch& b) { b.add(compose(s, {3}), slot_range(12, 7)); });
  add("batch", "store changed since the batch was made", [] {
    kv_store s        = make_store();
    injection_batch b = make_batch(s);
    insert_fact(s, 60, 3, 1);  // a legitimate change of the store, then back
    s.erase(60);
    batch_guard const gb{b};
    store_guard const gs{s};
    expect_refused([&] { b.add(compose(s, {3}), slot_range(40, 7)); }, "the store changed");
    host_cache<bfloat16_t> c;
    cache_guard<bfloat16_t> const gc{c};
    rotation_fixture r;
    expect_refused([&] { b.run(c.desc, r.params); }, "the store changed");
    gb.check();
    gs.check();
    gc.check();
  });
  batch_case("null block table", "null block table", [](kv_store& s, injection_batch& b) {
    b.add(compose(s, {1}),
          block_size_cache(16),
          cuda::std::span<std::int32_t const>{static_cast<std::int32_t const*>(nullptr), 2},
          0);
  });
  batch_case("block table too short (pluralised)",
             "need 1 block, the table has 0",
             [](kv_store& s, injection_batch& b) {
               std::int32_t const blocks[] = {1};
               b.add(compose(s, {1}), block_size_cache(16), {blocks, std::size_t{0}}, 0);
             });
  batch_case("negative block id", "negative block id -2", [](kv_store& s, injection_batch& b) {
    std::int32_t const blocks[] = {3, -2};
    b.add(compose(s, {3}), block_size_cache(4), blocks, 0);
  });
  batch_case(
    "block table start overflows", "overflow 64 bits", [](kv_store& s, injection_batch& b) {
      std::int32_t const blocks[] = {3, 1};
      b.add(
        compose(s, {1}), block_size_cache(4), blocks, std::numeric_limits<std::int64_t>::max() - 2);
    });
  batch_case("block count times block size overflows",
             "overflow 64 bits",
             [](kv_store& s, injection_batch& b) {
               std::int32_t const blocks[] = {3, 1};
               b.add(
                 compose(s, {1}),
                 block_size_cache(16),
                 {blocks, static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max() / 2)},
                 0);
             });
  add("batch", "negative slots: handled (the token is skipped, nothing refused)", [] {
    kv_store s        = make_store();
    injection_batch b = make_batch(s);
    b.add(compose(s, {3}), std::vector<std::int64_t>{-1, 40, -1, 41, 42, 43, -5});
    require(b.num_tokens() == 8 + 7 && b.max_slot() == 43, "negative slots were not kept as skips");
  });
}

/// A capture of 8 tokens, every row written with finite values; `poison` sets one key element.
kv_capture make_capture(std::int64_t poison_token = -1, float poison = 0.0f)
{
  kv_capture capture(kv_geometry{layers, heads, head_dim}, 8);
  std::vector<float> rowsv(static_cast<std::size_t>(8 * heads * head_dim));
  for (std::size_t i = 0; i < rowsv.size(); ++i) {
    rowsv[i] = 0.01f * static_cast<float>(i % 97);
  }
  for (std::int32_t l = 0; l < layers; ++l) {
    std::vector<float> k = rowsv;
    if (l == 1 && poison_token >= 0) {
      k[static_cast<std::size_t>(poison_token * heads * head_dim + 3)] = poison;
    }
    capture.write_keys(l, 0, make_token_head_view<float const>(k.data(), 8, heads, head_dim));
    capture.write_values(l, 0, make_token_head_view<float const>(rowsv.data(), 8, heads, head_dim));
  }
  return capture;
}

void engine_cases()
{
  auto const captured =
    [](std::string name, char const* words, std::int64_t poison_token, float poison, dtype t) {
      add("store", "store_captured_facts: " + name, [=] {
        kv_store s = make_store(t);
        store_guard const g{s};
        kv_capture const capture = make_capture(poison_token, poison);
        // fact 20 (tokens 0..2) is clean; fact 21 (tokens 3..7) holds the poisoned element
        std::vector<captured_fact> const facts{{20, 1, 0, token_ids(3)}, {21, 1, 3, token_ids(5)}};
        expect_refused([&] { store_captured_facts(s, capture, facts); }, words);
        g.check();
      });
    };
  captured("NaN in the second fact: none stored",
           "none of the facts is stored",
           5,
           std::numeric_limits<float>::quiet_NaN(),
           dtype::bfloat16);
  captured("1e5 into float16 in the second fact: none stored",
           "beyond the store dtype float16",
           6,
           1e5f,
           dtype::float16);
}

/// An injection refusal: the store, the cache and the batch unchanged.
struct no_setup {
  template <class... A>
  void operator()(A&...) const
  {
  }
};

/// `setup` prepares legitimate state (a batch entry, a cache element) before the snapshots.
template <class T = bfloat16_t, class F, class Setup = no_setup>
void inject_case(std::string name, char const* words, F f, Setup setup = {})
{
  add("inject", std::move(name), [=] {
    kv_store s        = make_store();
    injection_batch b = make_batch(s);
    host_cache<T> cache;
    rotation_fixture r;
    setup(s, b, cache, r);
    store_guard const gs{s};
    batch_guard const gb{b};
    cache_guard<T> const gc{cache};
    expect_refused([&] { f(s, b, cache, r); }, words);
    gs.check();
    gb.check();
    gc.check();
  });
}

using e4m3 = float8_e4m3_t;

void set_scales(paged_kv_cache& c, float const* k, float const* v)
{
  c.set_fp8_scales(
    kv_scale_convention::divide, kv_scale_granularity::per_tensor, {k, k + 1}, {v, v + 1});
}

void inject_cases()
{
  using cache_t = host_cache<bfloat16_t>;
  inject_case(
    "slot beyond the cache (pluralised)",
    "slot 64 is beyond the cache's 64 slots",
    [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) { b.run(c.desc, r.params); },
    [](kv_store& s, injection_batch& b, cache_t&, rotation_fixture&) {
      b.add(compose(s, {3}), std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 64});
    });
  inject_case(
    "position beyond the engine's cos/sin table",
    "is beyond the cos/sin table (32 rows)",
    [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) { b.run(c.desc, r.table); },
    [](kv_store& s, injection_batch& b, cache_t&, rotation_fixture&) {
      compose_options o{};
      o.first_position = 30;
      b.add(compose(s, {3}, o), slot_range(40, 7));
    });
  inject_case(
    "position beyond the model's max_position (rope_params)",
    "position 36 is beyond the model's range (max_position 32; set "
    "rope_params::allow_beyond_max_position to opt in)",
    [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) {
      rope_params p  = r.params;
      p.max_position = 32;
      b.run(c.desc, p);
    },
    [](kv_store& s, injection_batch& b, cache_t&, rotation_fixture&) {
      compose_options o{};
      o.first_position = 30;
      b.add(compose(s, {3}, o), slot_range(40, 7));
    });
  inject_case("hand-built plan near INT64_MAX refused with the opt-in",
              "below rope_position_limit",
              [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) {
                rope_params p               = r.params;
                p.allow_beyond_max_position = true;
                b.add(hand_plan(std::numeric_limits<std::int64_t>::max() - 3, 3),
                      slot_range(40, 3));
                b.run(c.desc, p);
              });
  inject_case("hand-built plan at a negative position never reaches the table",
              "must be non-negative",
              [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) {
                b.add(hand_plan(-2, 3), slot_range(40, 3));
                b.run(c.desc, r.table);
              });
  inject_case("cache of 1 layer for a store of 2 (pluralised)",
              "the store holds 2 layers x 2 heads x 8, the cache 1 x 2 x 8",
              [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) {
                paged_kv_cache one = c.desc;
                one.num_layers     = 1;
                b.run(one, r.params);
              });
  inject_case("rotation for another head_dim",
              "differs from the store's 8",
              [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture&) {
                rope_spec sp = spec();
                sp.head_dim  = 16;
                b.run(c.desc, make_rope_params(sp));
              });
  inject_case("cos/sin table with null data",
              "data is null",
              [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) {
                auto t = r.table;
                t.data = nullptr;
                b.run(c.desc, t);
              });
  inject_case("cos/sin table rows shorter than rotary_dim",
              "row_stride 4 is shorter",
              [](kv_store&, injection_batch& b, cache_t& c, rotation_fixture& r) {
                auto t       = r.table;
                t.row_stride = 4;
                b.run(c.desc, t);
              });
  auto const scale_case = [](std::string name, float bad, char const* words) {
    inject_case<e4m3>("fp8 scale " + name,
                      words,
                      [=](kv_store&, injection_batch& b, host_cache<e4m3>& c, rotation_fixture& r) {
                        static float k[2], v[2];
                        k[0] = 1.0f;
                        k[1] = 0.5f;
                        v[0] = 2.0f;
                        v[1] = bad;
                        set_scales(c.desc, k, v);
                        b.run(c.desc, r.params);
                      });
  };
  scale_case("zero", 0.0f, "the value scale of layer 1 is 0.000000; fp8 scales must be positive");
  scale_case("negative", -0.5f, "fp8 scales must be positive and finite");
  scale_case(
    "NaN", std::numeric_limits<float>::quiet_NaN(), "fp8 scales must be positive and finite");
  scale_case(
    "+Inf", std::numeric_limits<float>::infinity(), "fp8 scales must be positive and finite");
  inject_case<e4m3>(
    "fp8 per-head scale zero for head 1",
    "the key scale of layer 0, head 1",
    [](kv_store&, injection_batch& b, host_cache<e4m3>& c, rotation_fixture& r) {
      static float k[2][2] = {{1.0f, 0.0f}, {1.0f, 1.0f}};
      static float v[2][2] = {{1.0f, 1.0f}, {1.0f, 1.0f}};
      c.desc.set_fp8_scales(
        kv_scale_convention::multiply, kv_scale_granularity::per_head, {k[0], k[1]}, {v[0], v[1]});
      b.run(c.desc, r.params);
    });

  // Extraction (host): the store, the cache and the batch unchanged.
  inject_case("extract: slot beyond the cache",
              "slot 64 of token 1 is outside the cache's 64 slots",
              [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
                extract_host(c.desc, {3, 64}, 0, r.params, s, 50, 1, token_ids(2));
              });
  inject_case("extract: 2 slots for 3 token ids",
              "2 slots for 3 token ids",
              [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
                extract_host(c.desc, {3, 4}, 0, r.params, s, 50, 1, token_ids(3));
              });
  inject_case("extract: negative first position",
              "first position must be non-negative",
              [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
                extract_host(c.desc, {3, 4}, -1, r.params, s, 50, 1, token_ids(2));
              });
  inject_case("extract: position beyond the table",
              "beyond the cos/sin table",
              [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
                extract_host(c.desc, {3, 4}, 31, r.table, s, 50, 1, token_ids(2));
              });
  inject_case("extract: existing id",
              "fact id 1 already stored",
              [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
                extract_host(c.desc, {3, 4}, 0, r.params, s, 1, 1, token_ids(2));
              });
  inject_case("extract: capacity exhausted",
              "capacity exhausted",
              [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
                extract_host(c.desc, slot_range(0, 20), 0, r.params, s, 50, 1, token_ids(20));
              });
  inject_case(
    "extract: NaN in the cache",
    "would store a non-finite key element",
    [](kv_store& s, injection_batch&, cache_t& c, rotation_fixture& r) {
      extract_host(c.desc, {4, 5, 6}, 0, r.params, s, 50, 1, token_ids(3));
    },
    [](kv_store&, injection_batch&, cache_t& c, rotation_fixture&) {
      // layer 1, K, slot 5, head 1, dim 2 holds a NaN
      c.data[static_cast<std::size_t>(((1 * 2 + 0) * slots + 5) * heads * head_dim + head_dim +
                                      2)] = bfloat16_t{0x7fc0};
    });
  inject_case<float>(
    "extract: fp32 cache value beyond bfloat16",
    "would store a non-finite value element",
    [](kv_store& s, injection_batch&, host_cache<float>& c, rotation_fixture& r) {
      extract_host(c.desc, {7}, 0, r.params, s, 50, 1, token_ids(1));
    },
    [](kv_store&, injection_batch&, host_cache<float>& c, rotation_fixture&) {
      c.data[static_cast<std::size_t>(((0 * 2 + 1) * slots + 7) * heads * head_dim)] =
        std::numeric_limits<float>::max();
    });
  inject_case<e4m3>("extract: fp8 scale zero",
                    "fp8 scales must be positive",
                    [](kv_store& s, injection_batch&, host_cache<e4m3>& c, rotation_fixture& r) {
                      static float k[2] = {1.0f, 1.0f}, v[2] = {0.0f, 1.0f};
                      set_scales(c.desc, k, v);
                      extract_host(c.desc, {3, 4}, 0, r.params, s, 50, 1, token_ids(2));
                    });
}

/// A descriptor refusal (nothing to keep unchanged but the engine's buffer, never written).
void cache_case(std::string name, char const* words, std::function<void(host_cache<bfloat16_t>&)> f)
{
  add("cache", std::move(name), [=] {
    host_cache<bfloat16_t> c;
    cache_guard<bfloat16_t> const g{c};
    expect_refused([&] { f(c); }, words);
    g.check();
  });
}

paged_kv_layout nhd_layout()
{
  paged_kv_layout l{};
  l.num_blocks   = 4;
  l.block_size   = 16;
  l.num_heads    = heads;
  l.head_dim     = head_dim;
  l.block_stride = 16 * heads * head_dim;
  l.token_stride = heads * head_dim;
  l.head_stride  = head_dim;
  l.dim_stride   = 1;
  l.dim_chunk    = head_dim;
  return l;
}

void cache_cases()
{
  auto const make = [](host_cache<bfloat16_t>& c,
                       paged_kv_layout const& k,
                       paged_kv_layout const& v,
                       std::int64_t value_offset,
                       std::int64_t layer_offset) {
    bfloat16_t* const base = c.data.data();
    (void)make_paged_kv_cache(dtype::bfloat16,
                              {base, base + layer_offset},
                              {base + value_offset, base + layer_offset + value_offset},
                              k,
                              v);
  };
  std::int64_t const span = 4 * 16 * heads * head_dim;  // one NHD tensor: 1024 elements
  cache_case("heads overlap (head stride 0)", "elements overlap in memory", [=](auto& c) {
    auto l        = nhd_layout();
    l.head_stride = 0;
    make(c, l, l, span, 2 * span);
  });
  cache_case(
    "tokens overlap heads (token stride = head_dim)", "elements overlap in memory", [=](auto& c) {
      auto l         = nhd_layout();
      l.token_stride = head_dim;
      make(c, l, l, span, 2 * span);
    });
  cache_case("blocks overlap (block stride smaller than a block)",
             "elements overlap in memory",
             [=](auto& c) {
               auto l         = nhd_layout();
               l.block_stride = 8 * heads * head_dim;
               make(c, l, l, span, 2 * span);
             });
  cache_case("dims overlap (dim stride 0)", "elements overlap in memory", [=](auto& c) {
    auto l       = nhd_layout();
    l.dim_stride = 0;
    make(c, l, l, span, 2 * span);
  });
  cache_case("K and V at the same address",
             "the key of layer 0 and the value of layer 0 overlap",
             [=](auto& c) { make(c, nhd_layout(), nhd_layout(), 0, 2 * span); });
  cache_case("V starts inside K (same layout)",
             "the key of layer 0 and the value of layer 0 overlap",
             [=](auto& c) { make(c, nhd_layout(), nhd_layout(), 8, 2 * span); });
  cache_case("V half an element after K (misaligned)", "overlap in memory", [=](auto& c) {
    auto* base = reinterpret_cast<unsigned char*>(c.data.data());
    (void)make_paged_kv_cache(dtype::bfloat16, {base}, {base + 1}, nhd_layout(), nhd_layout());
  });
  cache_case("layers aliased", "the key of layer 0 and the key of layer 1 overlap", [=](auto& c) {
    make(c, nhd_layout(), nhd_layout(), span, 0);
  });
  cache_case("V of layer 0 inside K of layer 1 (different layouts)",
             "the value of layer 0 and the key of layer 1 overlap",
             [=](auto& c) {
               auto v         = nhd_layout();
               v.head_stride  = 16 * 4 * head_dim;  // HND-like strides: a different layout
               v.token_stride = head_dim;
               v.block_stride = 16 * head_dim;
               make(c, nhd_layout(), v, 2 * span, 2 * span - 64);
             });
  cache_case("dim chunk not dividing head_dim", "must divide head_dim", [=](auto& c) {
    auto l      = nhd_layout();
    l.dim_chunk = 3;
    make(c, l, l, span, 2 * span);
  });
  cache_case("stride beyond 2^59 elements", "exceeds 2^59", [=](auto& c) {
    auto l         = nhd_layout();
    l.block_stride = std::int64_t{1} << 60;
    make(c, l, l, span, 2 * span);
  });
  cache_case("span overflows 64 bits", "overflows 64 bits", [=](auto& c) {
    auto l         = nhd_layout();
    l.num_blocks   = std::int64_t{1} << 40;
    l.block_stride = std::int64_t{1} << 58;
    make(c, l, l, span, 2 * span);
  });
  cache_case("negative stride from a factory", "must be non-negative", [](auto& c) {
    (void)make_contiguous_cache(
      dtype::bfloat16,
      c.data.data(),
      {layers, 2, slots, heads, head_dim},
      {2 * slots * heads * head_dim, slots * heads * head_dim, -heads * head_dim, head_dim, 1});
  });
  cache_case("null base", "null base address for layer 0", [](auto&) {
    (void)make_contiguous_cache(
      dtype::bfloat16,
      nullptr,
      {layers, 2, slots, heads, head_dim},
      {2 * slots * heads * head_dim, slots * heads * head_dim, heads * head_dim, head_dim, 1});
  });
  cache_case("1 key tensor but 2 value tensors (pluralised)",
             "1 key tensor but 2 value tensors",
             [](auto& c) {
               bfloat16_t* const base = c.data.data();
               (void)make_paged_kv_cache(
                 dtype::bfloat16, {base}, {base + 1024, base + 2048}, nhd_layout(), nhd_layout());
             });
  cache_case("129 layers", "between 1 and 128 layers, got 129", [](auto& c) {
    std::vector<void*> k(129, c.data.data()), v(129, c.data.data());
    (void)make_paged_kv_cache(dtype::bfloat16, k, v, nhd_layout(), nhd_layout());
  });
  cache_case("K and V layouts disagree on heads", "disagree", [=](auto& c) {
    auto v      = nhd_layout();
    v.num_heads = 1;
    make(c, nhd_layout(), v, span, 2 * span);
  });
  cache_case("fp8 scales on a bfloat16 cache", "scales apply to fp8 caches", [](auto& c) {
    static float s[2] = {1, 1};
    set_scales(c.desc, s, s);
  });
  add("cache", "set_fp8_scales: null pointer / wrong count", [] {
    host_cache<e4m3> c;
    paged_kv_cache const before = c.desc;
    static float s[2]           = {1, 1};
    expect_refused(
      [&] {
        c.desc.set_fp8_scales(
          kv_scale_convention::divide, kv_scale_granularity::per_tensor, {s, nullptr}, {s, s});
      },
      "null scale pointer for layer 1");
    expect_refused(
      [&] {
        c.desc.set_fp8_scales(
          kv_scale_convention::divide, kv_scale_granularity::per_tensor, {s}, {s, s});
      },
      "expected 2 key and value scale pointers");
    require(std::memcmp(&before, &c.desc, sizeof before) == 0, "the descriptor changed");
  });
  add("cache",
      "interleaved K/V (FlashInfer) and layers in pages (TensorRT-LLM): handled (accepted)",
      [] {
        std::vector<bfloat16_t> pool(
          static_cast<std::size_t>(4 * layers * 2 * 16 * heads * head_dim));
        // FlashInfer-style [blocks, 2, page, heads, dim] per layer: K and V interleave by block.
        std::int64_t const inner = 16 * heads * head_dim;
        auto const fi =
          make_vllm_flashinfer_cache(dtype::bfloat16,
                                     {pool.data(), pool.data() + 4 * 2 * inner},
                                     {2, 2, 16, heads, head_dim},
                                     {4 * inner, inner, heads * head_dim, head_dim, 1});
        require(fi.num_layers == 2, "FlashInfer layout refused");
        auto const trt = make_tensorrt_llm_cache(dtype::bfloat16,
                                                 pool.data(),
                                                 {4, layers, 2, inner},
                                                 {layers * 2 * inner, 2 * inner, inner, 1},
                                                 16,
                                                 heads,
                                                 head_dim,
                                                 trtllm_block_order::hnd);
        require(trt.num_layers == layers, "TensorRT-LLM pool refused");
      });
}

void rope_case(std::string name, char const* words, std::function<void()> f)
{
  add("rope", std::move(name), [=] { expect_refused(f, words); });
}

void rope_cases()
{
  rope_case("odd rotary_dim", "must be even", [] {
    rope_spec s  = spec();
    s.rotary_dim = 5;
    (void)make_rope_params(s);
  });
  rope_case("theta 1", "greater than 1", [] {
    rope_spec s = spec();
    s.theta     = 1.0;
    (void)make_rope_params(s);
  });
  rope_case("linear factor 0.5", "must be >= 1", [] {
    rope_spec s = spec();
    s.scaling   = rope_scaling::linear;
    s.factor    = 0.5;
    (void)make_rope_params(s);
  });
  rope_case("yarn factor 0 (absent) without lengths", "derives it as max_position / original", [] {
    rope_spec s             = spec();
    s.scaling               = rope_scaling::yarn;
    s.factor                = 0.0;
    s.original_max_position = 4096;
    (void)make_rope_params(s);
  });
  rope_case("yarn negative mscale", "must be finite and non-negative", [] {
    rope_spec s             = spec();
    s.scaling               = rope_scaling::yarn;
    s.factor                = 4.0;
    s.original_max_position = 4096;
    s.mscale                = -1.0;
    s.mscale_all_dim        = 1.0;
    (void)make_rope_params(s);
  });
  rope_case("longrope lists of the wrong size", "4 entries each, got 3 and 4", [] {
    rope_spec s             = spec();
    s.scaling               = rope_scaling::longrope;
    s.original_max_position = 4096;
    s.max_position          = 131072;
    s.short_factor          = {1, 1, 1};
    s.long_factor           = {1, 2, 3, 4};
    (void)make_rope_params(s);
  });
  rope_case("rotary_dim above 512", "exceeds the supported 512", [] {
    rope_spec s = spec();
    s.head_dim  = 1024;
    (void)make_rope_params(s);
  });
  add("rope", "yarn without factor: handled (f = Lmax / L0, as HF)", [] {
    rope_spec derived             = spec();
    derived.scaling               = rope_scaling::yarn;
    derived.factor                = 0.0;
    derived.max_position          = 16384;
    derived.original_max_position = 4096;
    rope_spec explicit_factor     = derived;
    explicit_factor.factor        = 4.0;
    require(derived.inverse_frequencies() == explicit_factor.inverse_frequencies(),
            "frequencies differ from factor 4");
    require(std::abs(derived.attention_scaling() - (0.1 * std::log(4.0) + 1.0)) < 1e-15,
            "attention factor is not 0.1 ln 4 + 1");
  });
  add("rope", "yarn mscale 0: handled (absent, as HF's `if mscale and mscale_all_dim`)", [] {
    rope_spec s             = spec();
    s.scaling               = rope_scaling::yarn;
    s.factor                = 8.0;
    s.original_max_position = 4096;
    s.mscale                = 0.0;
    s.mscale_all_dim        = 0.707;
    require(std::abs(s.attention_scaling() - (0.1 * std::log(8.0) + 1.0)) < 1e-15,
            "mscale 0 was not read as absent");
  });
  auto const host_case = [](std::string name,
                            char const* words,
                            std::int64_t position,
                            rope_op op,
                            bool null_positions,
                            bool null_data) {
    add("rope", "rope_apply_host: " + name, [=] {
      rotation_fixture r;
      std::vector<bfloat16_t> keys(static_cast<std::size_t>(2 * heads * head_dim),
                                   bfloat16_t{0x3f80});
      std::vector<bfloat16_t> const before = keys;
      std::int64_t const positions[]       = {3, position};
      auto const x =
        make_token_head_view<bfloat16_t>(null_data ? nullptr : keys.data(), 2, heads, head_dim);
      expect_refused(
        [&] { rope_apply_host(x, null_positions ? nullptr : positions, 2, r.table, op); }, words);
      require(std::memcmp(keys.data(), before.data(), keys.size() * sizeof(bfloat16_t)) == 0,
              "the keys changed after a refusal");
    });
  };
  host_case("shift of INT64_MIN",
            "shift -9223372036854775808",
            std::numeric_limits<std::int64_t>::min(),
            rope_op::shift,
            false,
            false);
  host_case(
    "shift beyond the table", "is beyond the cos/sin table", -32, rope_op::shift, false, false);
  host_case("position beyond the table", "must be in [0, 32)", 32, rope_op::forward, false, false);
  host_case("negative position", "must be in [0, 32)", -1, rope_op::inverse, false, false);
  host_case("null positions", "null positions", 0, rope_op::forward, true, false);
  host_case("null data", "null data", 0, rope_op::forward, false, true);

  // HF configs.
  auto const hf = [](std::string name, char const* words, char const* text) {
    add("rope", "config.json: " + name, [=] {
      expect_refused([&] { (void)rope_spec_from_hf_config(json::parse(text)); }, words);
    });
  };
  hf("unknown rope type",
     "is not supported",
     R"({"head_dim": 64, "rope_scaling": {"rope_type": "su-per"}})");
  hf("partial_rotary_factor 0",
     "partial_rotary_factor must be in (0, 1]",
     R"({"head_dim": 64, "partial_rotary_factor": 0})");
  hf("theta not a number", "rope_theta must be a number", R"({"head_dim": 64, "rope_theta": "x"})");
  hf("yarn without factor nor lengths",
     "YaRN without factor needs",
     R"({"head_dim": 64, "rope_scaling": {"rope_type": "yarn"}})");
  hf("longrope negative factor",
     "factor of LongRoPE must be positive",
     R"({"head_dim": 8, "max_position_embeddings": 8192, "rope_scaling": {"rope_type": "longrope",
        "original_max_position_embeddings": 4096, "factor": -2, "short_factor": [1,1,1,1],
        "long_factor": [1,1,1,1]}})");
  add("rope", "config.json: yarn beta_fast 0, mscale 0: handled (HF defaults)", [] {
    rope_spec const s = rope_spec_from_hf_config(json::parse(
      R"({"head_dim": 64, "max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn",
          "factor": 4, "original_max_position_embeddings": 8192, "beta_fast": 0, "beta_slow": 0,
          "mscale": 0, "mscale_all_dim": 1}})"));
    require(s.beta_fast == 32.0 && s.beta_slow == 1.0, "beta 0 did not take HF's defaults");
    require(!s.mscale.has_value() && s.attention_scaling() == 0.1 * std::log(4.0) + 1.0,
            "mscale 0 was not read as absent");
  });
  add("rope", "config.json: LongRoPE explicit factor: handled (a = sqrt(1 + ln f / ln L0))", [] {
    rope_spec const s     = rope_spec_from_hf_config(json::parse(
      R"({"head_dim": 8, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "longrope",
          "original_max_position_embeddings": 4096, "factor": 8, "short_factor": [1,1,1,1],
          "long_factor": [1,2,3,4]}})"));
    double const expected = std::sqrt(1.0 + std::log(8.0) / std::log(4096.0));
    require(std::abs(s.attention_scaling() - expected) < 1e-15,
            "LongRoPE's factor 8 did not give sqrt(1 + ln 8 / ln 4096)");
  });
}

/// An index refusal: the index unchanged (size, version, namespaces, search results).
void index_case(std::string name,
                char const* words,
                std::function<void(graph_index&)> f,
                dtype t = dtype::float32)
{
  add("index", std::move(name), [=] {
    graph_index index = make_index(t);
    index_guard const g{index};
    expect_refused([&] { f(index); }, words);
    g.check();
  });
}

void add_rows(graph_index& index,
              std::vector<float> const& rows_data,
              std::vector<std::uint64_t> const& ids,
              std::int64_t n,
              std::int64_t d    = dim,
              float const* data = nullptr)
{
  index.add(7,
            make_matrix_view<float const>(data ? data : rows_data.data(), n, d),
            ids_span{ids.data(), ids.size()});
}

void search_one(graph_index const& index,
                std::vector<float> const& q,
                std::uint64_t ns,
                std::uint32_t k,
                search_params p       = {},
                std::int64_t out_cols = -1,
                bool null_query       = false)
{
  std::vector<std::uint64_t> found(8);
  std::vector<float> dist(8);
  std::int64_t const cols = out_cols < 0 ? k : out_cols;
  inferscale::search(index,
                     make_matrix_view<float const>(null_query ? nullptr : q.data(), 1, dim),
                     ids_span{&ns, 1},
                     k,
                     p,
                     make_matrix_view<std::uint64_t>(found.data(), 1, cols),
                     make_matrix_view<float>(dist.data(), 1, cols));
}

void index_cases()
{
  float const nan = std::numeric_limits<float>::quiet_NaN();
  float const inf = std::numeric_limits<float>::infinity();
  index_case("add: NaN", "has a NaN or infinite element at 2", [=](graph_index& i) {
    add_rows(i, {1, 0, nan, 0}, {10}, 1);
  });
  index_case("add: -Inf", "NaN or infinite", [=](graph_index& i) {
    add_rows(i, {1, 0, 0, 1, 0, -inf, 0, 0}, {10, 11}, 2);
  });
  index_case("add: zero vector under cosine", "is zero, which has no cosine", [](graph_index& i) {
    add_rows(i, {0, 0, 0, 0}, {10}, 1);
  });
  // cosine (the default) takes any finite non-zero vector as a direction (issue 49)
  index_case(
    "add: squared norm above 1e30 (squared L2)", "squared norm above 1e30", [](graph_index&) {
      index_config c{};
      c.dim    = dim;
      c.metric = distance_metric::squared_l2;
      graph_index l2{c};
      std::vector<float> const v{1e16f, 0, 0, 0};
      std::vector<std::uint64_t> const id{1};
      l2.add(1, make_matrix_view<float const>(v.data(), 1, dim), ids_span{id.data(), 1});
    });
  index_case(
    "add: 3 dimensions (pluralised)", "vectors have 3 dimensions, the index 4", [](graph_index& i) {
      add_rows(i, {1, 0, 0}, {10}, 1, 3);
    });
  index_case("add: 1 id for 2 vectors (pluralised)", "1 id for 2 vectors", [](graph_index& i) {
    add_rows(i, {1, 0, 0, 0, 0, 1, 0, 0}, {10}, 2);
  });
  index_case("add: id already indexed", "fact id 3 is already indexed", [](graph_index& i) {
    add_rows(i, {1, 0, 0, 0}, {3}, 1);
  });
  index_case("add: id given twice", "fact id 10 given twice", [](graph_index& i) {
    add_rows(i, {1, 0, 0, 0, 0, 1, 0, 0}, {10, 10}, 2);
  });
  index_case("add: reserved id 2^64-1", "is reserved", [](graph_index& i) {
    add_rows(i, {1, 0, 0, 0}, {std::numeric_limits<std::uint64_t>::max()}, 1);
  });
  index_case("add: null vector data", "null vector data", [](graph_index& i) {
    static float const dummy = 0;
    (void)dummy;
    i.add(7,
          make_matrix_view<float const>(nullptr, 1, dim),
          ids_span{std::vector<std::uint64_t>{10}.data(), 1});
  });
  index_case(
    "add: float16 overflow (squared L2)", "overflows float16 at element 0", [](graph_index&) {
      index_config c{};
      c.dim          = dim;
      c.metric       = distance_metric::squared_l2;
      c.vector_dtype = dtype::float16;
      graph_index half{c};
      std::vector<float> const v{1e5f, 0, 0, 0};
      std::vector<std::uint64_t> const id{1};
      half.add(1, make_matrix_view<float const>(v.data(), 1, dim), ids_span{id.data(), 1});
    });
  index_case("build: NaN", "NaN or infinite", [=](graph_index& i) {
    std::vector<float> const v{1, nan, 0, 0};
    std::vector<std::uint64_t> const id{1};
    i.build(1, make_matrix_view<float const>(v.data(), 1, dim), ids_span{id.data(), 1});
  });
  index_case("search: NaN query", "query 0 has a NaN", [=](graph_index& i) {
    search_one(i, {nan, 0, 0, 1}, 1, 2);
  });
  index_case("search: zero query under cosine", "is a zero vector", [](graph_index& i) {
    search_one(i, {0, 0, 0, 0}, 1, 2);
  });
  index_case("search: unknown namespace", "unknown namespace 9", [](graph_index& i) {
    search_one(i, {1, 0, 0, 0}, 9, 2);
  });
  index_case("search: k = 0", "k must be at least 1", [](graph_index& i) {
    search_one(i, {1, 0, 0, 0}, 1, 0);
  });
  index_case(
    "search: outputs of the wrong shape", "outputs must be [queries=1][k=2]", [](graph_index& i) {
      search_one(i, {1, 0, 0, 0}, 1, 2, {}, 3);
    });
  index_case("search: search_width 0", "search_width must be in 1..64", [](graph_index& i) {
    search_params p{};
    p.search_width = 0;
    search_one(i, {1, 0, 0, 0}, 1, 2, p);
  });
  index_case("search: itopk above 1024", "at most 1024", [](graph_index& i) {
    search_params p{};
    p.itopk_size = 2000;
    search_one(i, {1, 0, 0, 0}, 1, 2, p);
  });
  index_case("search: null query data", "null query data", [](graph_index& i) {
    search_one(i, {1, 0, 0, 0}, 1, 2, {}, -1, true);
  });
  index_case("erase: unknown id", "unknown fact id 99", [](graph_index& i) {
    std::vector<std::uint64_t> const ids{1, 99};
    i.erase(ids_span{ids.data(), ids.size()});
  });
  index_case("erase: id given twice", "fact id 2 given twice", [](graph_index& i) {
    std::vector<std::uint64_t> const ids{2, 2};
    i.erase(ids_span{ids.data(), ids.size()});
  });
  index_case("erase: null ids", "null ids", [](graph_index& i) {
    i.erase(ids_span{static_cast<std::uint64_t const*>(nullptr), 2});
  });
  index_case("namespace_of: unknown id", "unknown fact id 99", [](graph_index& i) {
    (void)i.namespace_of(99);
  });
}

// ------------------------------------------------------------------------------------------------
// The driver

/// Runs one case in a child process; returns "" on success, else why it failed.
std::string run_isolated(test_case const& c)
{
  std::fflush(stdout);
  std::fflush(stderr);
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) { return "pipe() failed"; }
  pid_t const pid = fork();
  if (pid < 0) { return "fork() failed"; }
  if (pid == 0) {
    close(pipe_fds[0]);
    alarm(60);  // a hang fails the case
    std::string why;
    try {
      c.run();
    } catch (case_failure const& f) {
      why = f.what;
    } catch (std::exception const& e) {
      why = std::string{"escaped exception: "} + e.what();
    } catch (...) {
      why = "escaped non-standard exception";
    }
    if (!why.empty()) { (void)!write(pipe_fds[1], why.data(), why.size()); }
    close(pipe_fds[1]);
    _exit(why.empty() ? 0 : 1);
  }
  close(pipe_fds[1]);
  std::string message;
  char buffer[512];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof buffer)) > 0;) {
    message.append(buffer, static_cast<std::size_t>(n));
  }
  close(pipe_fds[0]);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) { return "waitpid() failed"; }
  if (WIFSIGNALED(status)) {
    return std::string{"crashed: signal "} + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return message.empty() ? "exited with status " + std::to_string(WEXITSTATUS(status)) : message;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv)
{
  store_cases();
  engine_cases();
  compose_cases();
  batch_cases();
  inject_cases();
  cache_cases();
  rope_cases();
  index_cases();

  char const* filter = argc > 1 ? argv[1] : "";
  std::map<std::string, std::pair<int, int>> by_class;  // passed, failed
  int failed = 0, ran = 0;
  for (auto const& c : cases) {
    std::string const full = c.klass + "/" + c.name;
    if (full.find(filter) == std::string::npos) { continue; }
    ++ran;
    std::string const why = run_isolated(c);
    auto& counts          = by_class[c.klass];
    if (why.empty()) {
      ++counts.first;
    } else {
      ++counts.second;
      ++failed;
      std::printf("FAILED %s: %s\n", full.c_str(), why.c_str());
    }
  }
  std::printf("hardening battery: %d cases, %d passed, %d failed\n", ran, ran - failed, failed);
  for (auto const& [klass, counts] : by_class) {
    std::printf("  %-8s %3d cases  %3d passed  %3d failed\n",
                klass.c_str(),
                counts.first + counts.second,
                counts.first,
                counts.second);
  }
  return failed == 0 && ran > 0 ? 0 : 1;
}
