// GPU tests of the KV store (inferscale/store.hpp) with device-memory pools: inserts from host
// views and from device views (contiguous, and with padded token rows) equal the same inserts into
// a host store byte for byte, and read back (through read_pool() of store_pool.hpp, written from
// the documented layout [num_pages][layers][2][page_size][heads][head_dim]) as the input bits;
// refused calls leave the device pool unchanged; an insert on a non-blocking stream is ordered on
// that stream alone. Reported skipped by CTest where no GPU is visible.
#include "counting_resource.hpp"
#include "device_memory.hpp"
#include "store_pool.hpp"

#include <inferscale/cuda_error.hpp>
#include <inferscale/error.hpp>
#include <inferscale/memory_resource.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

using namespace inferscale;

namespace {

using inferscale_test::device_buffer;
using inferscale_test::pool_shape;
using inferscale_test::read_pool;

// Element bits written directly (no conversion involved): the store holds them unchanged when the
// views already hold the store dtype. Values: random finite codes of moderate magnitude.
template <class T>
T random_element(std::mt19937_64& rng)
{
  std::uniform_int_distribution<std::uint32_t> sign(0, 1), mantissa(0, 1023), small(0, 127);
  std::uniform_int_distribution<std::uint32_t> e16(1, 29), ebf(120, 134), e32(120, 134);
  std::uint32_t const s = sign(rng);
  if constexpr (std::is_same_v<T, float>) {
    std::uint32_t const e = e32(rng), m = mantissa(rng) << 13 | small(rng);
    std::uint32_t const bits = s << 31 | e << 23 | m;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  } else if constexpr (std::is_same_v<T, half_t>) {
    std::uint32_t const e = e16(rng), m = mantissa(rng);
    return half_t{std::uint16_t(s << 15 | e << 10 | m)};
  } else {
    std::uint32_t const e = ebf(rng), m = small(rng);
    return bfloat16_t{std::uint16_t(s << 15 | e << 7 | m)};
  }
}

template <class T>
std::uint32_t bits_of_element(T x)
{
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof(T));
  return bits;
}

// A fact's keys and values in one host buffer: [kv][layers][tokens][row], row = heads * head_dim
// + pad elements, so token rows may be padded (strided) while each token's [heads, head_dim] stays
// contiguous, as device views need.
template <class T>
struct kv_input {
  std::int64_t layers{}, tokens{}, heads{}, head_dim{}, row{};
  std::vector<T> buffer;

  std::int64_t layer_stride() const { return tokens * row + 3; }
  std::int64_t kv_stride() const { return layers * layer_stride(); }
  std::int64_t index(int kv, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t e) const
  {
    return kv * kv_stride() + l * layer_stride() + t * row + h * head_dim + e;
  }
  T const& at(int kv, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t e) const
  {
    return buffer.at(static_cast<std::size_t>(index(kv, l, t, h, e)));
  }
  std::array<std::int64_t, 4> strides() const { return {layer_stride(), row, head_dim, 1}; }
  // Views over `base`: the host buffer, or a device copy of it.
  fact_kv_view<T const> keys(T const* base) const
  {
    return make_fact_kv_view(base, layers, tokens, heads, head_dim, strides());
  }
  fact_kv_view<T const> values(T const* base) const
  {
    return make_fact_kv_view(base + kv_stride(), layers, tokens, heads, head_dim, strides());
  }
};

template <class T>
kv_input<T> make_input(std::int64_t layers,
                       std::int64_t tokens,
                       std::int64_t heads,
                       std::int64_t head_dim,
                       std::int64_t pad,
                       std::uint64_t seed)
{
  kv_input<T> in{layers, tokens, heads, head_dim, heads * head_dim + pad, {}};
  std::mt19937_64 rng(seed);
  in.buffer.resize(static_cast<std::size_t>(2 * in.kv_stride()));
  for (auto& x : in.buffer) {
    x = random_element<T>(rng);
  }  // padding too: must not be read
  return in;
}

std::vector<std::int32_t> token_ids_for(std::uint64_t id, std::int64_t tokens)
{
  std::vector<std::int32_t> ids;
  for (std::int64_t t = 0; t < tokens; ++t) {
    ids.push_back(std::int32_t(id * 1000 + t));
  }
  return ids;
}

struct shard {
  std::int32_t first_layer, num_layers, first_head, num_heads;
};

kv_store_config make_config(dtype t, memory_space m, shard const& s)
{
  kv_store_config c;
  c.model       = kv_geometry{3, 4, 8};
  c.store_dtype = t;
  c.page_size   = 3;
  c.num_pages   = 20;
  c.space       = m;
  c.first_layer = s.first_layer;
  c.num_layers  = s.num_layers;
  c.first_head  = s.first_head;
  c.num_heads   = s.num_heads;
  return c;
}

// cudaMalloc does not clear memory; the comparisons with a host store (whose pool starts zeroed)
// start from a cleared device pool.
void clear_device_pool(kv_store const& s)
{
  INFERSCALE_CUDA_TRY(cudaMemset(s.ref().pool, 0, s.pool_bytes()));
  INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());
}

template <class T>
struct other_type {
  using type = float;
};
template <>
struct other_type<float> {
  using type = half_t;
};

}  // namespace

TEMPLATE_TEST_CASE("a device store holds what a host store holds, byte for byte",
                   "[gpu][store]",
                   float,
                   half_t,
                   bfloat16_t)
{
  auto const s = GENERATE(shard{0, 0, 0, 0}, shard{1, 2, 1, 2}, shard{2, 1, 3, 1});
  CAPTURE(s.first_layer, s.num_layers, s.first_head, s.num_heads);
  std::int64_t const L  = s.num_layers == 0 ? 3 : s.num_layers;  // the shard's, written out
  std::int64_t const H  = s.num_heads == 0 ? 4 : s.num_heads;
  std::int64_t const D  = 8;
  std::int64_t const ps = 3;
  dtype const t         = dtype_of_v<TestType>;
  pool_shape const shape{L, H, D, ps, t};
  kv_store device{make_config(t, memory_space::device, s)};
  kv_store host{make_config(t, memory_space::host, s)};
  clear_device_pool(device);
  REQUIRE(device.space() == memory_space::device);
  REQUIRE(device.pool_to_host() == host.pool_to_host());

  // 1. Float host views (converted on the host), padded token rows, whole-model shape, 7 tokens.
  auto const f1 = make_input<float>(3, 7, 4, 8, 5, 1);
  device.insert(1, 0, token_ids_for(1, 7), f1.keys(f1.buffer.data()), f1.values(f1.buffer.data()));
  host.insert(1, 0, token_ids_for(1, 7), f1.keys(f1.buffer.data()), f1.values(f1.buffer.data()));

  // 2. Contiguous device views of the store dtype, whole-model shape, 5 tokens.
  auto const f2 = make_input<TestType>(3, 5, 4, 8, 0, 2);
  device_buffer<TestType> d2(f2.buffer);
  device.insert(
    2, 0, token_ids_for(2, 5), f2.keys(d2.data()), f2.values(d2.data()), memory_space::device);
  host.insert(2, 0, token_ids_for(2, 5), f2.keys(f2.buffer.data()), f2.values(f2.buffer.data()));

  // 3. Device views with padded token rows (token stride 4 * 8 + 6), whole-model shape, 4 tokens.
  auto const f3 = make_input<TestType>(3, 4, 4, 8, 6, 3);
  device_buffer<TestType> d3(f3.buffer);
  device.insert(
    3, 1, token_ids_for(3, 4), f3.keys(d3.data()), f3.values(d3.data()), memory_space::device);
  host.insert(3, 1, token_ids_for(3, 4), f3.keys(f3.buffer.data()), f3.values(f3.buffer.data()));

  // 4. Shard-shaped device views with padded rows, 6 tokens (two full pages).
  auto const f4 = make_input<TestType>(L, 6, H, 8, 2, 4);
  device_buffer<TestType> d4(f4.buffer);
  device.insert(
    4, 1, token_ids_for(4, 6), f4.keys(d4.data()), f4.values(d4.data()), memory_space::device);
  host.insert(4, 1, token_ids_for(4, 6), f4.keys(f4.buffer.data()), f4.values(f4.buffer.data()));

  // 5. Shard-shaped host views of the store dtype, 1 token.
  auto const f5 = make_input<TestType>(L, 1, H, 8, 1, 5);
  device.insert(5, 2, token_ids_for(5, 1), f5.keys(f5.buffer.data()), f5.values(f5.buffer.data()));
  host.insert(5, 2, token_ids_for(5, 1), f5.keys(f5.buffer.data()), f5.values(f5.buffer.data()));

  REQUIRE(device.num_facts() == 5);
  REQUIRE(device.free_pages() == host.free_pages());
  for (std::uint64_t id = 1; id <= 5; ++id) {
    CAPTURE(id);
    REQUIRE(device.at(id).pages == host.at(id).pages);
    REQUIRE(device.at(id).token_ids == host.at(id).token_ids);
  }
  auto const pool = device.pool_to_host();
  REQUIRE(pool == host.pool_to_host());

  // Independently of the host store: the facts inserted from views of the store dtype hold the
  // input bits (the shard's slice of whole-model views).
  struct stored {
    std::uint64_t id;
    kv_input<TestType> const* in;
    std::int64_t l0, h0;
  };
  for (auto const& f : {stored{2, &f2, s.first_layer, s.first_head},
                        stored{3, &f3, s.first_layer, s.first_head},
                        stored{4, &f4, 0, 0},
                        stored{5, &f5, 0, 0}}) {
    CAPTURE(f.id);
    auto const& pages       = device.at(f.id).pages;
    std::int64_t mismatches = 0;
    for (int kv = 0; kv < 2; ++kv) {
      for (std::int64_t l = 0; l < L; ++l) {
        for (std::int64_t tok = 0; tok < f.in->tokens; ++tok) {
          for (std::int64_t h = 0; h < H; ++h) {
            for (std::int64_t e = 0; e < D; ++e) {
              std::uint32_t const got = read_pool(pool, shape, pages, l, kv, tok, h, e);
              if (got != bits_of_element(f.in->at(kv, l + f.l0, tok, h + f.h0, e))) {
                ++mismatches;
              }
            }
          }
        }
      }
    }
    REQUIRE(mismatches == 0);
  }

  // Erase, then insert from device views into the freed pages (full pages only, see below).
  device.erase(2);
  host.erase(2);
  auto const f6 = make_input<TestType>(3, 6, 4, 8, 3, 6);
  device_buffer<TestType> d6(f6.buffer);
  device.insert(
    6, 0, token_ids_for(6, 6), f6.keys(d6.data()), f6.values(d6.data()), memory_space::device);
  host.insert(6, 0, token_ids_for(6, 6), f6.keys(f6.buffer.data()), f6.values(f6.buffer.data()));
  REQUIRE(device.at(6).pages == host.at(6).pages);
  REQUIRE(device.pool_to_host() == host.pool_to_host());
}

TEMPLATE_TEST_CASE(
  "refused inserts leave the device pool unchanged", "[gpu][store]", float, half_t, bfloat16_t)
{
  using other   = typename other_type<TestType>::type;
  dtype const t = dtype_of_v<TestType>;
  kv_store device{make_config(t, memory_space::device, shard{0, 0, 0, 0})};
  auto const f1 = make_input<TestType>(3, 8, 4, 8, 0, 1);
  device_buffer<TestType> d1(f1.buffer);
  device.insert(
    1, 0, token_ids_for(1, 8), f1.keys(d1.data()), f1.values(d1.data()), memory_space::device);
  auto const f2 = make_input<float>(3, 5, 4, 8, 2, 2);
  device.insert(2, 0, token_ids_for(2, 5), f2.keys(f2.buffer.data()), f2.values(f2.buffer.data()));
  device.erase(1);

  auto const pool        = device.pool_to_host();
  auto const free_before = device.free_pages();
  auto const facts       = device.num_facts();
  auto const version     = device.version();
  auto const pages2      = device.at(2).pages;
  auto unchanged         = [&](char const* what) {
    CAPTURE(what);
    REQUIRE(device.pool_to_host() == pool);
    REQUIRE(device.free_pages() == free_before);
    REQUIRE(device.num_facts() == facts);
    REQUIRE(device.version() == version);
    REQUIRE(device.at(2).pages == pages2);
    REQUIRE_FALSE(device.contains(3));
  };

  auto const good = make_input<TestType>(3, 4, 4, 8, 0, 3);
  device_buffer<TestType> dg(good.buffer);

  // Device views of another element type than the store's.
  auto const wrong = make_input<other>(3, 4, 4, 8, 0, 4);
  device_buffer<other> dw(wrong.buffer);
  REQUIRE_THROWS_AS(device.insert(3,
                                  0,
                                  token_ids_for(3, 4),
                                  wrong.keys(dw.data()),
                                  wrong.values(dw.data()),
                                  memory_space::device),
                    inferscale::logic_error);
  unchanged("device views of another dtype");

  // Device views whose heads are not contiguous within a token (head stride 2 * head_dim).
  {
    auto const k = make_fact_kv_view<TestType const>(dg.data(), 3, 2, 4, 8, {2 * 64, 64, 16, 1});
    REQUIRE_THROWS_AS(device.insert(3, 0, token_ids_for(3, 2), k, k, memory_space::device),
                      inferscale::logic_error);
    unchanged("device views with strided heads");
  }
  // Device views with a non-unit element stride (heads innermost: element stride 4).
  {
    auto const k = make_fact_kv_view<TestType const>(dg.data(), 3, 1, 4, 8, {32, 32, 1, 4});
    REQUIRE_THROWS_AS(device.insert(3, 0, token_ids_for(3, 1), k, k, memory_space::device),
                      inferscale::logic_error);
    unchanged("device views with strided elements");
  }
  // Capacity: 20 pages, 2 used; 57 tokens need 19.
  {
    auto const big = make_input<TestType>(3, 57, 4, 8, 0, 5);
    device_buffer<TestType> db(big.buffer);
    REQUIRE_THROWS_AS(device.insert(3,
                                    0,
                                    token_ids_for(3, 57),
                                    big.keys(db.data()),
                                    big.values(db.data()),
                                    memory_space::device),
                      inferscale::logic_error);
    unchanged("capacity exhausted");
  }
  // Duplicate id, token count mismatch, keys/values shape mismatch, wrong layers.
  REQUIRE_THROWS_AS(device.insert(2,
                                  0,
                                  token_ids_for(2, 4),
                                  good.keys(dg.data()),
                                  good.values(dg.data()),
                                  memory_space::device),
                    inferscale::logic_error);
  unchanged("duplicate id");
  REQUIRE_THROWS_AS(device.insert(3,
                                  0,
                                  token_ids_for(3, 3),
                                  good.keys(dg.data()),
                                  good.values(dg.data()),
                                  memory_space::device),
                    inferscale::logic_error);
  unchanged("token id count");
  {
    auto const v = make_fact_kv_view<TestType const>(dg.data(), 3, 3, 4, 8, good.strides());
    REQUIRE_THROWS_AS(
      device.insert(3, 0, token_ids_for(3, 4), good.keys(dg.data()), v, memory_space::device),
      inferscale::logic_error);
    unchanged("keys and values of different shapes");
  }
  {
    auto const k = make_fact_kv_view<TestType const>(dg.data(), 2, 4, 4, 8, good.strides());
    REQUIRE_THROWS_AS(device.insert(3, 0, token_ids_for(3, 4), k, k, memory_space::device),
                      inferscale::logic_error);
    unchanged("layers neither the model's nor the shard's");
  }
  // Host views too.
  REQUIRE_THROWS_AS(
    device.insert(
      3, 0, token_ids_for(3, 5), good.keys(good.buffer.data()), good.values(good.buffer.data())),
    inferscale::logic_error);
  unchanged("host views, token id count");

  // And the store still works.
  device.insert(
    3, 0, token_ids_for(3, 4), good.keys(dg.data()), good.values(dg.data()), memory_space::device);
  REQUIRE(device.num_facts() == 2);
}

TEST_CASE("moving a device store keeps its pool", "[gpu][store]")
{
  kv_store a{make_config(dtype::bfloat16, memory_space::device, shard{0, 0, 0, 0})};
  auto const f = make_input<bfloat16_t>(3, 5, 4, 8, 0, 1);
  device_buffer<bfloat16_t> d(f.buffer);
  a.insert(1, 0, token_ids_for(1, 5), f.keys(d.data()), f.values(d.data()), memory_space::device);
  auto const pool = a.pool_to_host();
  void* const raw = a.ref().pool;
  kv_store b{std::move(a)};
  REQUIRE(b.ref().pool == raw);
  REQUIRE(b.pool_to_host() == pool);
  kv_store c{make_config(dtype::bfloat16, memory_space::device, shard{0, 0, 0, 0})};
  c = std::move(b);
  REQUIRE(c.pool_to_host() == pool);
  REQUIRE(c.at(1).token_ids == token_ids_for(1, 5));
}

// Whole-pool equality with a host store: both pools start zeroed and every insert (from host or
// device views) zeroes the unused rows of a fact's last page, so after erase + a shorter insert
// into reused pages the tail rows hold zeros on both.
TEST_CASE("device and host pools are byte-for-byte equal from a fresh store, through page reuse",
          "[gpu][store]")
{
  kv_store device{make_config(dtype::bfloat16, memory_space::device, shard{0, 0, 0, 0})};
  kv_store host{make_config(dtype::bfloat16, memory_space::host, shard{0, 0, 0, 0})};
  auto const f1 = make_input<bfloat16_t>(3, 9, 4, 8, 0, 1);  // 3 full pages
  device.insert(1, 0, token_ids_for(1, 9), f1.keys(f1.buffer.data()), f1.values(f1.buffer.data()));
  host.insert(1, 0, token_ids_for(1, 9), f1.keys(f1.buffer.data()), f1.values(f1.buffer.data()));
  device.erase(1);
  host.erase(1);
  auto const f2 = make_input<bfloat16_t>(3, 4, 4, 8, 0, 2);  // 2 pages, the last holds 1 token
  device_buffer<bfloat16_t> d2(f2.buffer);
  device.insert(
    2, 0, token_ids_for(2, 4), f2.keys(d2.data()), f2.values(d2.data()), memory_space::device);
  host.insert(2, 0, token_ids_for(2, 4), f2.keys(f2.buffer.data()), f2.values(f2.buffer.data()));
  REQUIRE(device.at(2).pages == host.at(2).pages);
  REQUIRE(device.pool_to_host() == host.pool_to_host());
}

// kv_store_config::resource: the device pool is allocated (once, on the null stream, the pool's
// bytes) and freed through the given resource, and holds what a host store holds. Both CUDA
// resources serve as upstream: cudaMalloc's and the stream-ordered cudaMallocAsync.
TEST_CASE("a device pool comes from the configured memory resource and goes back to it",
          "[gpu][store][memory_resource]")
{
  cuda_async_memory_resource async;
  bool const stream_ordered = GENERATE(false, true);
  CAPTURE(stream_ordered);
  inferscale_test::counting_resource resource{stream_ordered ? static_cast<memory_resource*>(&async)
                                                             : default_device_resource()};
  auto cfg     = make_config(dtype::bfloat16, memory_space::device, shard{0, 0, 0, 0});
  cfg.resource = &resource;
  {
    kv_store device{cfg};
    kv_store host{make_config(dtype::bfloat16, memory_space::host, shard{0, 0, 0, 0})};
    REQUIRE(resource.allocations.size() == 1);
    REQUIRE(resource.allocations[0].bytes == device.pool_bytes());
    REQUIRE(resource.allocations[0].stream == nullptr);
    REQUIRE(device.ref().pool == resource.allocations[0].pointer);
    auto const f = make_input<bfloat16_t>(3, 9, 4, 8, 0, 3);
    device.insert(1, 0, token_ids_for(1, 9), f.keys(f.buffer.data()), f.values(f.buffer.data()));
    host.insert(1, 0, token_ids_for(1, 9), f.keys(f.buffer.data()), f.values(f.buffer.data()));
    REQUIRE(device.pool_to_host() == host.pool_to_host());
    REQUIRE(resource.deallocations.empty());
  }
  REQUIRE(resource.deallocations.size() == 1);
  REQUIRE(resource.deallocations[0].pointer == resource.allocations[0].pointer);
  INFERSCALE_CUDA_TRY(cudaDeviceSynchronize());  // the stream-ordered free completes
}

// Stream-ordered inserts (store.hpp, insert's `stream`): on a non-blocking stream, with every
// step enqueued on that stream only and no device-wide synchronisation, the pool read back on the
// stream holds each fact's input bits. The device views are produced on the stream without a
// wait (the finiteness check must read them after that), and overwritten on the stream right
// after the insert (the copies into the pool must have been ordered before that).
TEST_CASE("an insert on a non-default stream is ordered on that stream", "[gpu][store][stream]")
{
  inferscale_test::cuda_stream stream;
  cudaStream_t const s = stream.get();
  dtype const t        = dtype::bfloat16;
  pool_shape const shape{3, 4, 8, 3, t};
  kv_store device{make_config(t, memory_space::device, shard{0, 0, 0, 0})};
  kv_store host{make_config(t, memory_space::host, shard{0, 0, 0, 0})};

  // 1. Device views (padded token rows, 7 tokens: the last page holds 1 of 3 rows).
  auto const f1 = make_input<bfloat16_t>(3, 7, 4, 8, 2, 11);
  device_buffer<bfloat16_t> d1(f1.buffer.size());
  INFERSCALE_CUDA_TRY(cudaMemcpyAsync(
    d1.data(), f1.buffer.data(), f1.buffer.size() * sizeof(bfloat16_t), cudaMemcpyHostToDevice, s));
  device.insert(
    1, 0, token_ids_for(1, 7), f1.keys(d1.data()), f1.values(d1.data()), memory_space::device, s);
  // The source is overwritten on the same stream after the insert: not what the pool holds.
  INFERSCALE_CUDA_TRY(cudaMemsetAsync(d1.data(), 0x7f, d1.bytes(), s));
  host.insert(1, 0, token_ids_for(1, 7), f1.keys(f1.buffer.data()), f1.values(f1.buffer.data()));

  // 2. Host views of the store dtype on the same stream (staged through pinned memory), 5 tokens.
  auto const f2 = make_input<bfloat16_t>(3, 5, 4, 8, 1, 12);
  device.insert(2,
                0,
                token_ids_for(2, 5),
                f2.keys(f2.buffer.data()),
                f2.values(f2.buffer.data()),
                memory_space::host,
                s);
  host.insert(2, 0, token_ids_for(2, 5), f2.keys(f2.buffer.data()), f2.values(f2.buffer.data()));

  // Read back on the stream only, then wait for that stream.
  std::vector<unsigned char> pool(device.pool_bytes());
  INFERSCALE_CUDA_TRY(
    cudaMemcpyAsync(pool.data(), device.ref().pool, pool.size(), cudaMemcpyDeviceToHost, s));
  INFERSCALE_CUDA_TRY(cudaStreamSynchronize(s));

  for (auto const& [id, in] : {std::pair<std::uint64_t, kv_input<bfloat16_t> const*>{1, &f1},
                               std::pair<std::uint64_t, kv_input<bfloat16_t> const*>{2, &f2}}) {
    CAPTURE(id);
    auto const& pages       = device.at(id).pages;
    std::int64_t mismatches = 0;
    for (int kv = 0; kv < 2; ++kv) {
      for (std::int64_t l = 0; l < 3; ++l) {
        for (std::int64_t tok = 0; tok < in->tokens; ++tok) {
          for (std::int64_t h = 0; h < 4; ++h) {
            for (std::int64_t e = 0; e < 8; ++e) {
              if (read_pool(pool, shape, pages, l, kv, tok, h, e) !=
                  bits_of_element(in->at(kv, l, tok, h, e))) {
                ++mismatches;
              }
            }
          }
        }
      }
    }
    REQUIRE(mismatches == 0);
  }
  // The whole pool, unused rows of last pages included (zeroed), equals the host store's.
  REQUIRE(device.at(1).pages == host.at(1).pages);
  REQUIRE(device.at(2).pages == host.at(2).pages);
  REQUIRE(pool == host.pool_to_host());
}
