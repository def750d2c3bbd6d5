// Host tests of the KV store (inferscale/store.hpp) with host-memory pools. They run everywhere:
// no GPU is needed.
//
// Every expectation is written here, never taken from the code under test:
//  - the pool is read back through read_pool() (tests/common/store_pool.hpp), an accessor written
//    from the documented layout [num_pages][layers][2 (K, V)][page_size][heads][head_dim] and the
//    fact record's page list;
//  - the inputs are read through index arithmetic written here (offset + sum of index * stride),
//    not through the views handed to the store;
//  - half and bfloat16 values are decoded with decoders written out from the formats, and the
//    stored bits expected after a narrowing are round-to-nearest-even references written here
//    (a nearest-value search over every binary16 code; the bit-level bfloat16 rounding), plus
//    literal bit patterns for ties;
//  - page counts ceil(c / page_size) and byte counts 2*L*c*h*d*b are written out;
//  - "unchanged" means the pool byte for byte, free_pages(), num_facts(), version() and every
//    record, and a twin store that never saw the refused call picks the same pages next.
#include "counting_resource.hpp"
#include "float_bits.hpp"
#include "store_pool.hpp"

#include <inferscale/error.hpp>
#include <inferscale/store.hpp>
#include <inferscale/store_slice.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace inferscale;
using inferscale_test::bits_of;
using inferscale_test::bytes_of;
using inferscale_test::float_from_bits;
using inferscale_test::pool_shape;
using inferscale_test::read_pool;

namespace {

// ------------------------------------------------------------------------------------------------
// Element formats, written out from their specifications.

// IEEE 754 binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; subnormals m * 2^-24.
double decode_half(std::uint16_t bits)
{
  int const e    = (bits >> 10) & 31;
  int const m    = bits & 1023;
  double const v = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
  return (bits & 0x8000u) ? -v : v;
}

// bfloat16: the upper 16 bits of an fp32.
double decode_bf16(std::uint16_t bits) { return float_from_bits(std::uint32_t{bits} << 16); }

// Round to nearest binary16, ties to the even code: search the sorted finite codes for the
// nearest value; overflow (|x| >= 65520, halfway past the largest finite 65504) gives infinity.
std::uint16_t rne_half(double x)
{
  static std::vector<double> const codes = [] {
    std::vector<double> t;
    for (std::uint32_t b = 0; b <= 0x7bffu; ++b) {
      t.push_back(decode_half(std::uint16_t(b)));
    }
    return t;
  }();
  std::uint16_t const sign = std::signbit(x) ? 0x8000u : 0u;
  double const a           = std::fabs(x);
  if (a >= 65520.0) { return std::uint16_t(sign | 0x7c00u); }
  auto const it = std::lower_bound(codes.begin(), codes.end(), a);
  if (it == codes.end()) { return std::uint16_t(sign | 0x7bffu); }
  std::size_t const hi = static_cast<std::size_t>(it - codes.begin());
  if (*it == a || hi == 0) { return std::uint16_t(sign | hi); }
  std::size_t const lo   = hi - 1;
  double const below     = a - codes[lo];
  double const above     = codes[hi] - a;
  std::size_t const pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return std::uint16_t(sign | pick);
}

// Round an fp32 to bfloat16, nearest even, on the bits (finite inputs).
std::uint16_t rne_bf16(float x)
{
  std::uint32_t const b = bits_of(x);
  return std::uint16_t((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// The exact value of an input element.
double value_of(float x) { return x; }
double value_of(half_t x) { return decode_half(x.bits); }
double value_of(bfloat16_t x) { return decode_bf16(x.bits); }

// Encodes a value exactly representable in T (through the references above).
template <class T>
T encode(double v)
{
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(v);
  } else if constexpr (std::is_same_v<T, half_t>) {
    return half_t{rne_half(v)};
  } else {
    return bfloat16_t{rne_bf16(static_cast<float>(v))};
  }
}

// The bits a store of dtype `t` must hold for an input of value v (v is always fp32-exact).
std::uint32_t expected_store_bits(double v, dtype t)
{
  switch (t) {
    case dtype::float32: return bits_of(static_cast<float>(v));
    case dtype::float16: return rne_half(v);
    default: return rne_bf16(static_cast<float>(v));
  }
}

double stored_value(std::uint32_t bits, dtype t)
{
  switch (t) {
    case dtype::float32: return float_from_bits(bits);
    case dtype::float16: return decode_half(std::uint16_t(bits));
    default: return decode_bf16(std::uint16_t(bits));
  }
}

// Values exactly representable in float, half and bfloat16: i * 2^k, |i| <= 120, k in [-4, 3].
template <class T>
T exact_value(std::mt19937_64& rng)
{
  std::uniform_int_distribution<int> i(-120, 120), k(-4, 3);
  double const x = i(rng);
  return encode<T>(std::ldexp(x, k(rng)));
}

// Values that need rounding: fp32 normals times 2^k (k in [-28, 12], into fp16 subnormals);
// random finite half codes; random bfloat16 codes of exponent 2^-28 .. 2^12.
template <class T>
T random_value(std::mt19937_64& rng)
{
  if constexpr (std::is_same_v<T, float>) {
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::uniform_int_distribution<int> k(-28, 12);
    float const x = n(rng);
    return std::ldexp(x, k(rng));
  } else if constexpr (std::is_same_v<T, half_t>) {
    std::uniform_int_distribution<std::uint32_t> sign(0, 1), exponent(0, 30), mantissa(0, 1023);
    std::uint32_t const s = sign(rng), e = exponent(rng), m = mantissa(rng);
    return half_t{std::uint16_t(s << 15 | e << 10 | m)};
  } else {
    std::uniform_int_distribution<std::uint32_t> sign(0, 1), exponent(127 - 28, 127 + 12),
      mantissa(0, 127);
    std::uint32_t const s = sign(rng), e = exponent(rng), m = mantissa(rng);
    return bfloat16_t{std::uint16_t(s << 15 | e << 7 | m)};
  }
}

// ------------------------------------------------------------------------------------------------
// Inputs: a fact's keys and values in a host buffer, laid out with explicit strides.

enum class layout_kind {
  contiguous,        // [layers][tokens][heads][head_dim]
  tokens_outermost,  // [tokens][layers][heads][head_dim]
  reversed,          // [head_dim][heads][tokens][layers] (column-major: nothing unit-stride but e)
  padded,            // contiguous order with padding after every dimension
  interleaved_kv,    // K and V elements alternate in one buffer (element stride 2)
};

char const* name_of(layout_kind k)
{
  switch (k) {
    case layout_kind::contiguous: return "contiguous";
    case layout_kind::tokens_outermost: return "tokens outermost";
    case layout_kind::reversed: return "reversed (column-major)";
    case layout_kind::padded: return "padded";
    case layout_kind::interleaved_kv: return "K and V interleaved";
  }
  return "?";
}

template <class T>
struct kv_input {
  std::array<std::int64_t, 4> extents{};  // layers, tokens, heads, head_dim
  std::array<std::int64_t, 4> strides{};
  std::int64_t key_offset{};
  std::int64_t value_offset{};
  std::vector<T> buffer;

  std::int64_t layers() const { return extents[0]; }
  std::int64_t tokens() const { return extents[1]; }
  std::int64_t heads() const { return extents[2]; }
  std::int64_t head_dim() const { return extents[3]; }

  std::int64_t index(int kv, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t e) const
  {
    return (kv == 0 ? key_offset : value_offset) + l * strides[0] + t * strides[1] +
           h * strides[2] + e * strides[3];
  }
  T const& at(int kv, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t e) const
  {
    return buffer.at(static_cast<std::size_t>(index(kv, l, t, h, e)));
  }
  T& at(int kv, std::int64_t l, std::int64_t t, std::int64_t h, std::int64_t e)
  {
    return buffer.at(static_cast<std::size_t>(index(kv, l, t, h, e)));
  }
  fact_kv_view<T const> keys() const
  {
    return make_fact_kv_view(
      buffer.data() + key_offset, extents[0], extents[1], extents[2], extents[3], strides);
  }
  fact_kv_view<T const> values() const
  {
    return make_fact_kv_view(
      buffer.data() + value_offset, extents[0], extents[1], extents[2], extents[3], strides);
  }
};

// Builds an input of the given extents and layout, every element drawn by `draw` (seeded), every
// other buffer element a sentinel (4096, exact in every type and outside the drawn ranges of the
// exact inputs), so a read of padding shows up.
template <class T, class Draw>
kv_input<T> make_input(std::int64_t layers,
                       std::int64_t tokens,
                       std::int64_t heads,
                       std::int64_t head_dim,
                       layout_kind kind,
                       std::uint64_t seed,
                       Draw draw)
{
  kv_input<T> in;
  in.extents = {layers, tokens, heads, head_dim};
  std::array<int, 4> order{0, 1, 2, 3};  // outermost first
  std::array<std::int64_t, 4> pad{0, 0, 0, 0};
  std::int64_t step = 1;
  switch (kind) {
    case layout_kind::contiguous: break;
    case layout_kind::tokens_outermost: order = {1, 0, 2, 3}; break;
    case layout_kind::reversed: order = {3, 2, 1, 0}; break;
    case layout_kind::padded: pad = {1, 3, 2, 5}; break;
    case layout_kind::interleaved_kv: step = 2; break;
  }
  in.strides[static_cast<std::size_t>(order[3])] = step;
  for (int i = 2; i >= 0; --i) {
    auto const inner = static_cast<std::size_t>(order[static_cast<std::size_t>(i) + 1]);
    in.strides[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] =
      in.strides[inner] * (in.extents[inner] + pad[inner]);
  }
  std::int64_t span = 1;
  for (std::size_t r = 0; r < 4; ++r) {
    span += std::max<std::int64_t>(in.extents[r] - 1, 0) * in.strides[r];
  }
  in.key_offset   = 0;
  in.value_offset = kind == layout_kind::interleaved_kv ? 1 : span + 3;
  in.buffer.assign(static_cast<std::size_t>(in.value_offset + span + 2), encode<T>(4096.0));
  std::mt19937_64 rng(seed);
  for (int kv = 0; kv < 2; ++kv) {
    for (std::int64_t l = 0; l < layers; ++l) {
      for (std::int64_t t = 0; t < tokens; ++t) {
        for (std::int64_t h = 0; h < heads; ++h) {
          for (std::int64_t e = 0; e < head_dim; ++e) {
            in.at(kv, l, t, h, e) = draw(rng);
          }
        }
      }
    }
  }
  return in;
}

template <class T>
kv_input<T> exact_input(std::int64_t layers,
                        std::int64_t tokens,
                        std::int64_t heads,
                        std::int64_t head_dim,
                        std::uint64_t seed,
                        layout_kind kind = layout_kind::contiguous)
{
  return make_input<T>(layers, tokens, heads, head_dim, kind, seed, exact_value<T>);
}

std::vector<std::int32_t> token_ids_for(std::uint64_t id, std::int64_t tokens)
{
  std::vector<std::int32_t> ids;
  for (std::int64_t t = 0; t < tokens; ++t) {
    ids.push_back(
      static_cast<std::int32_t>((id * 7919 + static_cast<std::uint64_t>(t) * 31) % 151936));
  }
  return ids;
}

template <class T>
void insert_fact(kv_store& store, std::uint64_t id, std::uint64_t ns, kv_input<T> const& in)
{
  store.insert(id, ns, token_ids_for(id, in.tokens()), in.keys(), in.values());
}

// ------------------------------------------------------------------------------------------------
// The pool, read from the documented layout (pool_shape and read_pool() of store_pool.hpp).

// Checks every element of a stored fact: pool element (l, kv, t, h, e) holds the rounding of
// input element (kv, l + l0, t, h + h0, e).
template <class T>
void check_fact(std::vector<unsigned char> const& pool,
                pool_shape const& s,
                fact_record const& record,
                kv_input<T> const& in,
                std::int64_t l0 = 0,
                std::int64_t h0 = 0)
{
  REQUIRE(record.length() == in.tokens());
  REQUIRE(static_cast<std::int64_t>(record.pages.size()) ==
          (in.tokens() + s.page_size - 1) / s.page_size);
  std::int64_t mismatches = 0, checked = 0;
  std::string first;
  for (int kv = 0; kv < 2; ++kv) {
    for (std::int64_t l = 0; l < s.layers; ++l) {
      for (std::int64_t t = 0; t < in.tokens(); ++t) {
        for (std::int64_t h = 0; h < s.heads; ++h) {
          for (std::int64_t e = 0; e < s.head_dim; ++e) {
            std::uint32_t const got  = read_pool(pool, s, record.pages, l, kv, t, h, e);
            double const input       = value_of(in.at(kv, l + l0, t, h + h0, e));
            std::uint32_t const want = expected_store_bits(input, s.store);
            ++checked;
            if (got != want && mismatches++ == 0) {
              std::ostringstream os;
              os << "first mismatch: fact " << record.fact_id << " layer " << l << " kv " << kv
                 << " token " << t << " head " << h << " dim " << e << ": input " << input
                 << ", stored bits 0x" << std::hex << got << " (" << stored_value(got, s.store)
                 << "), expected 0x" << want;
              first = os.str();
            }
          }
        }
      }
    }
  }
  INFO(first);
  CHECK(checked == 2 * s.layers * in.tokens() * s.heads * s.head_dim);
  REQUIRE(mismatches == 0);
}

kv_store_config host_config(kv_geometry model, dtype t, std::int32_t page_size, std::int64_t pages)
{
  kv_store_config c;
  c.model       = model;
  c.store_dtype = t;
  c.page_size   = page_size;
  c.num_pages   = pages;
  c.space       = memory_space::host;
  return c;
}

// ------------------------------------------------------------------------------------------------
// Snapshots, to check that refused calls change nothing.

struct record_copy {
  bool present{};
  std::uint64_t namespace_id{};
  std::vector<std::int32_t> token_ids;
  std::vector<std::int64_t> pages;
};

struct store_state {
  std::vector<unsigned char> pool;
  std::int64_t free_pages{};
  std::int64_t num_facts{};
  std::uint64_t version{};
  std::vector<record_copy> records;
};

store_state state_of(kv_store const& s, std::vector<std::uint64_t> const& ids)
{
  store_state st{s.pool_to_host(), s.free_pages(), s.num_facts(), s.version(), {}};
  for (auto id : ids) {
    record_copy r;
    r.present = s.contains(id);
    if (r.present) {
      auto const& f = s.at(id);
      REQUIRE(f.fact_id == id);
      r.namespace_id = f.namespace_id;
      r.token_ids    = f.token_ids;
      r.pages        = f.pages;
    }
    st.records.push_back(std::move(r));
  }
  return st;
}

void require_same_state(store_state const& a, store_state const& b)
{
  REQUIRE(a.free_pages == b.free_pages);
  REQUIRE(a.num_facts == b.num_facts);
  REQUIRE(a.version == b.version);
  REQUIRE(a.pool.size() == b.pool.size());
  REQUIRE(a.pool == b.pool);  // byte for byte
  REQUIRE(a.records.size() == b.records.size());
  for (std::size_t i = 0; i < a.records.size(); ++i) {
    CAPTURE(i);
    REQUIRE(a.records[i].present == b.records[i].present);
    REQUIRE(a.records[i].namespace_id == b.records[i].namespace_id);
    REQUIRE(a.records[i].token_ids == b.records[i].token_ids);
    REQUIRE(a.records[i].pages == b.records[i].pages);
  }
}

}  // namespace

// ================================================================================================

TEST_CASE("insert then at() returns the fact's token ids, namespace, length and pages", "[store]")
{
  auto const page_size = GENERATE(as<std::int32_t>{}, 1, 3, 16);
  auto const tokens    = GENERATE(as<std::int64_t>{}, 1, 2, 15, 16, 17, 33);
  CAPTURE(page_size, tokens);
  kv_geometry const model{2, 3, 4};
  std::int64_t const num_pages = 80;
  kv_store store{host_config(model, dtype::float32, page_size, num_pages)};
  REQUIRE(store.num_facts() == 0);
  REQUIRE(store.free_pages() == num_pages);

  std::uint64_t const id = 0xfedcba9876543210ull, ns = 0xabcdef0123456789ull;
  std::vector<std::int32_t> const ids = [&] {
    std::vector<std::int32_t> v;
    for (std::int64_t t = 0; t < tokens; ++t) {
      v.push_back(std::int32_t(1000 - 97 * t));
    }
    return v;
  }();
  auto const in = exact_input<float>(2, tokens, 3, 4, 11);
  store.insert(id, ns, ids, in.keys(), in.values());

  std::int64_t const pages = (tokens + page_size - 1) / page_size;
  REQUIRE(store.contains(id));
  REQUIRE_FALSE(store.contains(id + 1));
  REQUIRE(store.num_facts() == 1);
  REQUIRE(store.free_pages() == num_pages - pages);
  fact_record const& r = store.at(id);
  REQUIRE(r.fact_id == id);
  REQUIRE(r.namespace_id == ns);
  REQUIRE(r.token_ids == ids);
  REQUIRE(r.length() == tokens);
  REQUIRE(static_cast<std::int64_t>(r.pages.size()) == pages);
  REQUIRE(std::set<std::int64_t>(r.pages.begin(), r.pages.end()).size() == r.pages.size());
  for (auto p : r.pages) {
    REQUIRE(p >= 0);
    REQUIRE(p < num_pages);
  }
  for (std::int32_t j = 0; j < tokens; ++j) {
    REQUIRE(store.store_token(r, j) ==
            r.pages[std::size_t(j / page_size)] * page_size + j % page_size);
  }
  REQUIRE_THROWS_AS(store.at(id + 1), inferscale::logic_error);

  pool_shape const shape{2, 3, 4, page_size, dtype::float32};
  check_fact(store.pool_to_host(), shape, r, in);

  // A second fact takes other pages and leaves the first intact.
  auto const in2 = exact_input<float>(2, tokens + 2, 3, 4, 12);
  insert_fact(store, 7, ns + 1, in2);
  auto const& r2 = store.at(7);
  for (auto p : r2.pages) {
    REQUIRE(std::find(store.at(id).pages.begin(), store.at(id).pages.end(), p) ==
            store.at(id).pages.end());
  }
  auto const pool = store.pool_to_host();
  check_fact(pool, shape, store.at(id), in);
  check_fact(pool, shape, r2, in2);
}

TEMPLATE_TEST_CASE("stored elements equal the input at every (layer, K/V, token, head, dim)",
                   "[store]",
                   float,
                   half_t,
                   bfloat16_t)
{
  // Inputs exactly representable in every store dtype: what the pool holds equals the input.
  auto const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  auto const page_size   = GENERATE(as<std::int32_t>{}, 1, 4, 5);
  CAPTURE(to_string(store_dtype), page_size);
  kv_geometry const model{3, 2, 6};
  kv_store store{host_config(model, store_dtype, page_size, 64)};
  pool_shape const shape{3, 2, 6, page_size, store_dtype};

  std::vector<kv_input<TestType>> inputs;
  std::vector<std::int64_t> const lengths{1, 4, 5, 9, 2};
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    inputs.push_back(exact_input<TestType>(3, lengths[i], 2, 6, 100 + i));
    insert_fact(store, 1000 + i, i % 2, inputs.back());
  }
  auto const pool = store.pool_to_host();
  REQUIRE(pool.size() == std::size_t(64) * 2 * 3 * page_size * 2 * 6 * bytes_of(store_dtype));
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    CAPTURE(i);
    fact_record const& r = store.at(1000 + i);
    check_fact(pool, shape, r, inputs[i]);
    // The same check on values: the decoded stored element equals the input value exactly.
    for (std::int64_t t = 0; t < lengths[i]; ++t) {
      REQUIRE(stored_value(read_pool(pool, shape, r.pages, 2, 1, t, 1, 5), store_dtype) ==
              value_of(inputs[i].at(1, 2, t, 1, 5)));
    }
  }
}

TEMPLATE_TEST_CASE("inputs are rounded to the store dtype to nearest, ties to even",
                   "[store]",
                   float,
                   half_t,
                   bfloat16_t)
{
  auto const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  auto const seed        = GENERATE(as<std::uint64_t>{}, 1, 2, 3);
  CAPTURE(to_string(store_dtype), seed);
  kv_geometry const model{2, 3, 8};
  kv_store store{host_config(model, store_dtype, 4, 16)};
  auto const in =
    make_input<TestType>(2, 11, 3, 8, layout_kind::contiguous, seed, [](std::mt19937_64& rng) {
      return random_value<TestType>(rng);
    });
  insert_fact(store, 5, 0, in);
  check_fact(store.pool_to_host(), pool_shape{2, 3, 8, 4, store_dtype}, store.at(5), in);
}

TEST_CASE("float inputs at rounding ties are stored with the literal RNE bits", "[store]")
{
  // Literal values and the codes the formats' specifications give for them.
  struct tie_case {
    float x;
    std::uint16_t bf16;
    std::uint16_t fp16;
  };
  float const u8 = std::ldexp(1.0f, -8), u11 = std::ldexp(1.0f, -11);
  std::vector<tie_case> const cases{
    {1.0f + u8, 0x3f80, 0x3c04},                          // bf16 tie -> even (1.0)
    {1.0f + 3 * u8, 0x3f82, 0x3c0c},                      // bf16 tie -> even (mantissa 2)
    {-(1.0f + u8), 0xbf80, 0xbc04},                       // sign kept
    {1.0f + u8 + std::ldexp(1.0f, -20), 0x3f81, 0x3c04},  // above the bf16 tie: up
    {1.0f + u11, 0x3f80, 0x3c00},                         // fp16 tie -> even (1.0)
    {1.0f + 3 * u11, 0x3f80, 0x3c02},                     // fp16 tie -> even (mantissa 2)
    {std::ldexp(1.0f, -25), 0x3300, 0x0000},              // half the least fp16 subnormal -> 0
    {3 * std::ldexp(1.0f, -25), 0x33c0, 0x0002},          // 1.5 subnormal units -> 2 (even)
    {65504.0f, 0x4780, 0x7bff},                           // largest fp16 (bf16: 65536)
    {65519.0f, 0x4780, 0x7bff},                           // just below the fp16 overflow tie
    {0.0f, 0x0000, 0x0000},
    {-0.0f, 0x8000, 0x8000},
  };
  auto const store_dtype = GENERATE(dtype::bfloat16, dtype::float16);
  CAPTURE(to_string(store_dtype));
  std::int64_t const d = static_cast<std::int64_t>(cases.size());  // 12, even
  kv_store store{host_config(kv_geometry{1, 1, std::int32_t(d)}, store_dtype, 2, 2)};
  std::vector<float> keys, values;
  for (auto const& c : cases) {
    keys.push_back(c.x);
  }
  for (auto const& c : cases) {
    values.push_back(-c.x);
  }
  store.insert(1,
               0,
               {42},
               make_fact_kv_view<float const>(keys.data(), 1, 1, 1, d),
               make_fact_kv_view<float const>(values.data(), 1, 1, 1, d));
  auto const pool = store.pool_to_host();
  pool_shape const shape{1, 1, d, 2, store_dtype};
  for (std::int64_t e = 0; e < d; ++e) {
    auto const& c            = cases[std::size_t(e)];
    std::uint32_t const want = store_dtype == dtype::bfloat16 ? c.bf16 : c.fp16;
    CAPTURE(e, c.x);
    REQUIRE(read_pool(pool, shape, store.at(1).pages, 0, 0, 0, 0, e) == want);
    REQUIRE(read_pool(pool, shape, store.at(1).pages, 0, 1, 0, 0, e) == (want ^ 0x8000u));
    // The references agree with the literal table.
    REQUIRE(expected_store_bits(c.x, store_dtype) == want);
  }
  // 65520, the fp16 overflow tie, rounds to infinity in fp16: insert refuses it there (a stored
  // infinity would be injected); bf16 holds it (0x4780 = 65536).
  REQUIRE(expected_store_bits(65520.0f, dtype::float16) == 0x7c00u);
  std::vector<float> const tie(static_cast<std::size_t>(d), 65520.0f);
  auto const insert_tie = [&](kv_store& s) {
    s.insert(2,
             0,
             {43},
             make_fact_kv_view<float const>(tie.data(), 1, 1, 1, d),
             make_fact_kv_view<float const>(tie.data(), 1, 1, 1, d));
  };
  if (store_dtype == dtype::float16) {
    REQUIRE_THROWS_WITH(insert_tie(store), Catch::Contains("overflows the store dtype float16"));
    REQUIRE_FALSE(store.contains(2));
    REQUIRE(store.pool_to_host() == pool);
  } else {
    insert_tie(store);
    auto const after = store.pool_to_host();
    REQUIRE(read_pool(after, shape, store.at(2).pages, 0, 0, 0, 0, 0) == 0x4780u);
  }
}

TEST_CASE("strided host views are read element by element", "[store]")
{
  auto const kind      = GENERATE(layout_kind::contiguous,
                             layout_kind::tokens_outermost,
                             layout_kind::reversed,
                             layout_kind::padded,
                             layout_kind::interleaved_kv);
  auto const tokens    = GENERATE(as<std::int64_t>{}, 1, 3, 8);
  auto const page_size = GENERATE(as<std::int32_t>{}, 1, 3);
  CAPTURE(name_of(kind), tokens, page_size);
  kv_geometry const model{3, 2, 4};
  kv_store store{host_config(model, dtype::bfloat16, page_size, 32)};
  auto const in = exact_input<float>(3, tokens, 2, 4, 77, kind);
  if (kind != layout_kind::contiguous) {
    // Really non-contiguous: some stride differs from the packed one.
    REQUIRE(in.strides != (std::array<std::int64_t, 4>{tokens * 8, 8, 4, 1}));
  }
  insert_fact(store, 3, 0, in);
  check_fact(
    store.pool_to_host(), pool_shape{3, 2, 4, page_size, dtype::bfloat16}, store.at(3), in);
}

TEST_CASE("a shard store keeps only its layers and heads", "[store]")
{
  struct shard_case {
    std::int32_t first_layer, num_layers, first_head, num_heads;
    std::int64_t layers, heads;  // what the store must hold, written out
  };
  // Model: 4 layers, 4 KV heads, head_dim 6.
  auto const c = GENERATE(shard_case{0, 0, 0, 0, 4, 4},   // whole model
                          shard_case{0, 4, 0, 4, 4, 4},   // whole model, explicit
                          shard_case{1, 2, 0, 0, 2, 4},   // layers 1..2
                          shard_case{2, 0, 1, 2, 2, 2},   // layers 2..3 (to the end), heads 1..2
                          shard_case{3, 1, 3, 1, 1, 1},   // last layer, last head
                          shard_case{0, 1, 0, 3, 1, 3},   // first layer, heads 0..2
                          shard_case{1, 3, 2, 0, 3, 2});  // layers 1..3, heads 2..3
  CAPTURE(c.first_layer, c.num_layers, c.first_head, c.num_heads);
  kv_geometry const model{4, 4, 6};
  auto const store_dtype = GENERATE(dtype::float32, dtype::bfloat16);
  CAPTURE(to_string(store_dtype));
  auto cfg        = host_config(model, store_dtype, 3, 24);
  cfg.first_layer = c.first_layer;
  cfg.num_layers  = c.num_layers;
  cfg.first_head  = c.first_head;
  cfg.num_heads   = c.num_heads;
  kv_store store{cfg};
  REQUIRE(store.geometry() == (kv_geometry{std::int32_t(c.layers), std::int32_t(c.heads), 6}));
  std::int64_t const b = std::int64_t(bytes_of(store_dtype));
  REQUIRE(store.pool_bytes() == std::size_t(24 * 2 * c.layers * 3 * c.heads * 6 * b));
  REQUIRE(store.fact_bytes(7) == 2 * c.layers * 7 * c.heads * 6 * b);
  pool_shape const shape{c.layers, c.heads, 6, 3, store_dtype};

  // Whole-model views: the store takes the shard's slice.
  auto const full = exact_input<float>(4, 7, 4, 6, 5, layout_kind::padded);
  insert_fact(store, 1, 9, full);
  // Shard-shaped views: taken as they are.
  auto const part = exact_input<float>(c.layers, 5, c.heads, 6, 6);
  insert_fact(store, 2, 9, part);
  auto const pool = store.pool_to_host();
  check_fact(pool, shape, store.at(1), full, c.first_layer, c.first_head);
  check_fact(pool, shape, store.at(2), part);
  REQUIRE(store.namespace_bytes(9) == 2 * c.layers * (7 + 5) * c.heads * 6 * b);

  // Any other count of layers or heads is refused, and nothing changes.
  auto const before = state_of(store, {1, 2, 3});
  for (std::int64_t layers = 0; layers <= 5; ++layers) {
    for (std::int64_t heads = 0; heads <= 5; ++heads) {
      bool const layers_ok = layers == 4 || layers == c.layers;
      bool const heads_ok  = heads == 4 || heads == c.heads;
      if (layers_ok && heads_ok) { continue; }
      CAPTURE(layers, heads);
      auto const bad = exact_input<float>(layers, 2, heads, 6, 8);
      REQUIRE_THROWS_AS(insert_fact(store, 3, 9, bad), inferscale::logic_error);
    }
  }
  require_same_state(before, state_of(store, {1, 2, 3}));
}

TEST_CASE("slice_store copies a rank's heads and a stage's layers of the named facts", "[store]")
{
  struct slice_case {
    store_slice slice;
    std::int64_t layers, heads;  // what the slice must hold, written out
  };
  // Model: 4 layers, 4 KV heads, head_dim 6; the source holds all of them.
  auto const c = GENERATE(slice_case{{0, 0, 0, 0}, 4, 4},   // everything
                          slice_case{{1, 2, 0, 0}, 2, 4},   // layers 1..2, every head
                          slice_case{{2, 0, 1, 2}, 2, 2},   // layers 2..3, heads 1..2
                          slice_case{{3, 1, 3, 1}, 1, 1},   // last layer, last head
                          slice_case{{0, 1, 0, 3}, 1, 3},   // first layer, heads 0..2
                          slice_case{{1, 3, 2, 0}, 3, 2});  // layers 1..3, heads 2..3
  CAPTURE(c.slice.first_layer, c.slice.num_layers, c.slice.first_head, c.slice.num_heads);
  auto const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(store_dtype));
  kv_geometry const model{4, 4, 6};
  kv_store full{host_config(model, store_dtype, 3, 24)};
  std::vector<kv_input<float>> inputs;
  std::int64_t const tokens[]  = {7, 5, 3, 2};
  std::uint64_t const spaces[] = {9, 4, 9, 4};
  for (std::uint64_t id = 1; id <= 4; ++id) {
    inputs.push_back(exact_input<float>(4, tokens[id - 1], 4, 6, 40 + id));
    insert_fact(full, id, spaces[id - 1], inputs.back());
  }
  auto const full_before = state_of(full, {1, 2, 3, 4});

  kv_store const out = slice_store(full, c.slice, {3, 1, 2});
  REQUIRE(out.space() == memory_space::host);
  REQUIRE(out.store_dtype() == store_dtype);
  REQUIRE(out.page_size() == 3);
  REQUIRE(out.geometry() == (kv_geometry{std::int32_t(c.layers), std::int32_t(c.heads), 6}));
  REQUIRE(out.config().model == (kv_geometry{std::int32_t(c.layers), 4, 6}));
  REQUIRE(out.config().first_layer == 0);
  REQUIRE(out.config().first_head == c.slice.first_head);
  REQUIRE(out.num_pages() == 1 + 3 + 2);  // ceil(3/3) + ceil(7/3) + ceil(5/3): exactly the facts'
  REQUIRE(out.free_pages() == 0);
  REQUIRE(out.num_facts() == 3);
  REQUIRE_FALSE(out.contains(4));
  REQUIRE(out.namespace_fact_ids(9) == std::vector<std::uint64_t>{3, 1});
  REQUIRE(out.namespace_fact_ids(4) == std::vector<std::uint64_t>{2});
  pool_shape const shape{c.layers, c.heads, 6, 3, store_dtype};
  auto const pool = out.pool_to_host();
  for (std::uint64_t id : {1, 2, 3}) {
    CAPTURE(id);
    REQUIRE(out.at(id).token_ids == full.at(id).token_ids);
    REQUIRE(out.at(id).namespace_id == spaces[id - 1]);
    // every element against the input's (layer + first_layer, head + first_head) rounded
    check_fact(pool, shape, out.at(id), inputs[id - 1], c.slice.first_layer, c.slice.first_head);
  }
  // the unused rows of fact 1's last page (tokens 7 and 8 of pages of 3) are zero
  for (std::int64_t l = 0; l < c.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (std::int64_t t : {7, 8}) {
        for (std::int64_t h = 0; h < c.heads; ++h) {
          for (std::int64_t e = 0; e < 6; ++e) {
            REQUIRE(read_pool(pool, shape, out.at(1).pages, l, kv, t, h, e) == 0u);
          }
        }
      }
    }
  }
  require_same_state(full_before, state_of(full, {1, 2, 3, 4}));  // the source is only read
}

TEST_CASE("slice_store of a shard store, and its refusals", "[store]")
{
  kv_geometry const model{4, 4, 6};
  auto cfg        = host_config(model, dtype::bfloat16, 4, 8);
  cfg.first_layer = 1;  // holds layers 1..3 and heads 1..3
  cfg.first_head  = 1;
  kv_store shard{cfg};
  auto const in = exact_input<float>(4, 6, 4, 6, 77);  // whole-model views: the shard's slice
  insert_fact(shard, 5, 2, in);
  auto const before = state_of(shard, {5});

  // a slice of the shard, in model coordinates
  kv_store const out = slice_store(shard, store_slice{2, 2, 2, 1}, {5});
  REQUIRE(out.geometry() == (kv_geometry{2, 1, 6}));
  check_fact(out.pool_to_host(), pool_shape{2, 1, 6, 4, dtype::bfloat16}, out.at(5), in, 2, 2);
  // 0 counts run to the last layer and head the shard holds
  REQUIRE(slice_store(shard, store_slice{2, 0, 2, 0}, {5}).geometry() == (kv_geometry{2, 2, 6}));
  // no facts: an empty store of one page
  kv_store const none = slice_store(shard, store_slice{1, 0, 1, 0}, {});
  REQUIRE(none.num_facts() == 0);
  REQUIRE(none.num_pages() == 1);

  auto const refused = [&](store_slice s, std::vector<std::uint64_t> ids, char const* what) {
    CAPTURE(s.first_layer, s.num_layers, s.first_head, s.num_heads);
    REQUIRE_THROWS_WITH(slice_store(shard, s, ids), Catch::Contains(what));
  };
  refused({0, 1, 1, 1}, {5}, "layers [0, 1) are not inside the store's [1, 4)");
  refused({3, 2, 1, 1}, {5}, "layers [3, 5) are not inside the store's [1, 4)");
  refused({1, -1, 1, 1}, {5}, "are not inside the store's");
  refused({4, 0, 1, 1}, {5}, "are not inside the store's [1, 4)");
  refused({1, 1, 0, 1}, {5}, "KV heads [0, 1) are not inside the store's [1, 4)");
  refused({1, 1, 2, 3}, {5}, "KV heads [2, 5) are not inside the store's [1, 4)");
  refused({1, 1, 1, 1}, {6}, "unknown fact id 6");
  refused({1, 1, 1, 1}, {5, 5}, "fact id 5 is named twice");
  require_same_state(before, state_of(shard, {5}));

  auto ccfg        = host_config(model, dtype::bfloat16, 16, 4);
  ccfg.compression = kv_compression::fp8_e4m3;
  kv_store compressed{ccfg};
  REQUIRE_THROWS_WITH(slice_store(compressed, store_slice{}, {}),
                      Catch::Contains("the store is compressed (fp8_e4m3)"));
}

TEMPLATE_TEST_CASE("namespaces account 2*L*c*h*d*b bytes and ceil(c / page_size) pages",
                   "[store]",
                   float,
                   bfloat16_t)
{
  // A shard: layers 1..2 of 4, heads 1..2 of 3, head_dim 4; so L = 2, h = 2.
  auto const store_dtype = GENERATE(dtype::float32, dtype::float16, dtype::bfloat16);
  CAPTURE(to_string(store_dtype));
  std::int64_t const L = 2, h = 2, d = 4, b = std::int64_t(bytes_of(store_dtype)), ps = 4;
  auto cfg        = host_config(kv_geometry{4, 3, 4}, store_dtype, std::int32_t(ps), 40);
  cfg.first_layer = 1;
  cfg.num_layers  = 2;
  cfg.first_head  = 1;
  cfg.num_heads   = 2;
  kv_store store{cfg};

  struct fact {
    std::uint64_t id, ns;
    std::int64_t tokens;
  };
  std::vector<fact> const facts{{10, 7, 1}, {11, 9, 3}, {12, 7, 5}, {13, 7, 16}, {14, 7, 17}};
  std::vector<kv_input<TestType>> inputs;
  for (auto const& f : facts) {
    inputs.push_back(exact_input<TestType>(4, f.tokens, 3, 4, f.id));  // whole-model views
    insert_fact(store, f.id, f.ns, inputs.back());
  }
  auto pages_of = [&](std::int64_t c) { return (c + ps - 1) / ps; };
  // ns 7: 1 + 5 + 16 + 17 = 39 tokens, 1 + 2 + 4 + 5 = 12 pages.
  REQUIRE(store.namespace_facts(7) == 4);
  REQUIRE(store.namespace_pages(7) == 12);
  REQUIRE(store.namespace_bytes(7) == 2 * L * 39 * h * d * b);
  REQUIRE(store.namespace_fact_ids(7) == std::vector<std::uint64_t>{10, 12, 13, 14});
  REQUIRE(store.namespace_facts(9) == 1);
  REQUIRE(store.namespace_pages(9) == pages_of(3));
  REQUIRE(store.namespace_bytes(9) == 2 * L * 3 * h * d * b);
  REQUIRE(store.namespace_fact_ids(9) == std::vector<std::uint64_t>{11});
  REQUIRE(store.namespace_facts(8) == 0);
  REQUIRE(store.namespace_pages(8) == 0);
  REQUIRE(store.namespace_bytes(8) == 0);
  REQUIRE(store.namespace_fact_ids(8).empty());
  for (auto const& f : facts) {
    REQUIRE(store.fact_bytes(f.tokens) == 2 * L * f.tokens * h * d * b);
  }
  REQUIRE(store.free_pages() == 40 - 12 - 1);

  // Erasing one fact of ns 7 (id 12: 5 tokens, 2 pages).
  store.erase(12);
  REQUIRE(store.namespace_facts(7) == 3);
  REQUIRE(store.namespace_pages(7) == 10);
  REQUIRE(store.namespace_bytes(7) == 2 * L * 34 * h * d * b);
  REQUIRE(store.namespace_fact_ids(7) == std::vector<std::uint64_t>{10, 13, 14});
  REQUIRE(store.free_pages() == 40 - 11);

  // The others are untouched.
  auto const pool = store.pool_to_host();
  pool_shape const shape{L, h, d, ps, store_dtype};
  for (std::size_t i : {std::size_t(0), std::size_t(1), std::size_t(3), std::size_t(4)}) {
    check_fact(pool, shape, store.at(facts[i].id), inputs[i], 1, 1);
  }

  // Erasing the namespace returns all its pages.
  REQUIRE(store.erase_namespace(7) == 3);
  REQUIRE(store.namespace_facts(7) == 0);
  REQUIRE(store.namespace_pages(7) == 0);
  REQUIRE(store.namespace_bytes(7) == 0);
  REQUIRE(store.namespace_fact_ids(7).empty());
  REQUIRE(store.free_pages() == 40 - 1);
  REQUIRE(store.num_facts() == 1);
  for (std::uint64_t id : {10u, 12u, 13u, 14u}) {
    REQUIRE_FALSE(store.contains(id));
  }
  REQUIRE(store.contains(11));
  REQUIRE(store.namespace_facts(9) == 1);
  check_fact(store.pool_to_host(), shape, store.at(11), inputs[1], 1, 1);
  REQUIRE(store.erase_namespace(7) == 0);
  REQUIRE(store.erase_namespace(12345) == 0);
}

TEST_CASE("erase and erase_namespace return pages, which later inserts reuse", "[store]")
{
  std::int64_t const ps = 4, num_pages = 10;
  kv_store store{host_config(kv_geometry{2, 2, 2}, dtype::float16, std::int32_t(ps), num_pages)};
  pool_shape const shape{2, 2, 2, ps, dtype::float16};
  // 8, 12, 5, 9 tokens: 2 + 3 + 2 + 3 = 10 pages, the whole capacity.
  std::vector<std::int64_t> const lengths{8, 12, 5, 9};
  std::vector<kv_input<float>> inputs;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    inputs.push_back(exact_input<float>(2, lengths[i], 2, 2, 50 + i));
    insert_fact(store, i, i < 2 ? 1 : 2, inputs.back());
  }
  REQUIRE(store.free_pages() == 0);
  {
    std::set<std::int64_t> all;
    for (std::uint64_t i = 0; i < 4; ++i) {
      all.insert(store.at(i).pages.begin(), store.at(i).pages.end());
    }
    REQUIRE(all.size() == std::size_t(num_pages));  // no page handed out twice
  }
  auto const one = exact_input<float>(2, 1, 2, 2, 60);
  REQUIRE_THROWS_AS(insert_fact(store, 99, 1, one), inferscale::logic_error);  // full

  // Erase fact 1 (12 tokens, 3 pages): exactly its pages come free, and a new 3-page fact
  // takes them.
  auto const freed = store.at(1).pages;
  store.erase(1);
  REQUIRE(store.free_pages() == 3);
  REQUIRE_FALSE(store.contains(1));
  REQUIRE_THROWS_AS(store.at(1), inferscale::logic_error);
  REQUIRE_THROWS_AS(store.erase(1), inferscale::logic_error);
  auto const newer = exact_input<float>(2, 10, 2, 2, 61);
  insert_fact(store, 4, 1, newer);
  REQUIRE(store.free_pages() == 0);
  auto const taken = store.at(4).pages;
  REQUIRE(std::set<std::int64_t>(taken.begin(), taken.end()) ==
          std::set<std::int64_t>(freed.begin(), freed.end()));
  auto pool = store.pool_to_host();
  check_fact(pool, shape, store.at(4), newer);
  for (std::uint64_t i : {0u, 2u, 3u}) {
    check_fact(pool, shape, store.at(i), inputs[i]);
  }

  // erase_namespace(2): facts 2 and 3, 5 pages.
  REQUIRE(store.erase_namespace(2) == 2);
  REQUIRE(store.free_pages() == 5);
  REQUIRE(store.num_facts() == 2);
  // erase the rest: the whole pool is free, and one fact of 40 tokens takes every page.
  REQUIRE(store.erase_namespace(1) == 2);
  REQUIRE(store.free_pages() == num_pages);
  REQUIRE(store.num_facts() == 0);
  auto const whole = exact_input<float>(2, 40, 2, 2, 62);
  insert_fact(store, 5, 3, whole);
  REQUIRE(store.free_pages() == 0);
  auto const& r = store.at(5);
  REQUIRE(std::set<std::int64_t>(r.pages.begin(), r.pages.end()).size() == std::size_t(num_pages));
  check_fact(store.pool_to_host(), shape, r, whole);
}

namespace {

struct refusal {
  char const* name;
  std::function<void(kv_store&)> call;
};

// The store of the refusal test: model 3 layers, 2 heads, head_dim 4; bf16; 4 tokens a page;
// 8 pages. Both stores of the twin check get the same history.
void refusal_history(kv_store& s)
{
  insert_fact(s, 1, 1, exact_input<float>(3, 6, 2, 4, 1));  // 2 pages
  insert_fact(s, 2, 1, exact_input<float>(3, 9, 2, 4, 2));  // 3 pages
  s.erase(1);                                               // 5 free, a non-trivial free list
}

std::vector<refusal> refusals()
{
  auto ok = [](std::int64_t tokens) { return exact_input<float>(3, tokens, 2, 4, 3); };
  return {
    {"capacity exhausted (6 pages needed, 5 free)",
     [=](kv_store& s) { insert_fact(s, 3, 1, ok(21)); }},
    {"duplicate id, same namespace", [=](kv_store& s) { insert_fact(s, 2, 1, ok(2)); }},
    {"duplicate id, other namespace", [=](kv_store& s) { insert_fact(s, 2, 5, ok(2)); }},
    {"empty fact",
     [=](kv_store& s) {
       auto const in = ok(0);
       s.insert(3, 1, {}, in.keys(), in.values());
     }},
    {"fewer token ids than tokens",
     [=](kv_store& s) {
       auto const in = ok(5);
       s.insert(3, 1, token_ids_for(3, 4), in.keys(), in.values());
     }},
    {"more token ids than tokens",
     [=](kv_store& s) {
       auto const in = ok(5);
       s.insert(3, 1, token_ids_for(3, 6), in.keys(), in.values());
     }},
    {"keys and values with different token counts",
     [=](kv_store& s) {
       auto const k = ok(5);
       auto const v = ok(6);
       s.insert(3, 1, token_ids_for(3, 5), k.keys(), v.values());
     }},
    {"keys and values with different head counts",
     [=](kv_store& s) {
       auto const k = ok(5);
       auto const v = exact_input<float>(3, 5, 1, 4, 4);
       s.insert(3, 1, token_ids_for(3, 5), k.keys(), v.values());
     }},
    {"keys and values with different layer counts",
     [=](kv_store& s) {
       auto const k = exact_input<float>(2, 5, 2, 4, 4);
       auto const v = ok(5);
       s.insert(3, 1, token_ids_for(3, 5), k.keys(), v.values());
     }},
    {"keys and values with different head_dim",
     [=](kv_store& s) {
       auto const k = ok(5);
       auto const v = exact_input<float>(3, 5, 2, 6, 4);
       s.insert(3, 1, token_ids_for(3, 5), k.keys(), v.values());
     }},
    {"head_dim other than the model's",
     [=](kv_store& s) { insert_fact(s, 3, 1, exact_input<float>(3, 5, 2, 6, 4)); }},
    {"head_dim other than the model's (smaller)",
     [=](kv_store& s) { insert_fact(s, 3, 1, exact_input<float>(3, 5, 2, 2, 4)); }},
    {"layers neither the model's nor the shard's",
     [=](kv_store& s) { insert_fact(s, 3, 1, exact_input<float>(2, 5, 2, 4, 4)); }},
    {"heads neither the model's nor the shard's",
     [=](kv_store& s) { insert_fact(s, 3, 1, exact_input<float>(3, 5, 3, 4, 4)); }},
    {"device views of another dtype into a host store",
     [=](kv_store& s) {
       auto const in = ok(5);
       s.insert(3, 1, token_ids_for(3, 5), in.keys(), in.values(), memory_space::device);
     }},
    {"device views of the store dtype into a host store",
     [=](kv_store& s) {
       auto const in = exact_input<bfloat16_t>(3, 5, 2, 4, 4);
       s.insert(3, 1, token_ids_for(3, 5), in.keys(), in.values(), memory_space::device);
     }},
    {"erase of an unknown id", [](kv_store& s) { s.erase(1); }},
    {"reserve of a duplicate id",
     [](kv_store& s) {
       s.reserve(2, 1, {1, 2});
     }},
    {"reserve of an empty fact", [](kv_store& s) { s.reserve(3, 1, {}); }},
    {"reserve beyond capacity",
     [](kv_store& s) { s.reserve(3, 1, std::vector<std::int32_t>(21, 5)); }},
  };
}

}  // namespace

TEST_CASE("refused calls throw logic_error and leave the store byte-for-byte unchanged", "[store]")
{
  auto const cases = refusals();
  auto const which = GENERATE(range(0, 20));
  REQUIRE(cases.size() == 20);
  auto const& c = cases[std::size_t(which)];
  CAPTURE(c.name);
  auto const cfg = host_config(kv_geometry{3, 2, 4}, dtype::bfloat16, 4, 8);
  kv_store store{cfg}, twin{cfg};
  refusal_history(store);
  refusal_history(twin);
  std::vector<std::uint64_t> const ids{1, 2, 3};
  auto const before = state_of(store, ids);
  REQUIRE(before.free_pages == 5);

  REQUIRE_THROWS_AS(c.call(store), inferscale::logic_error);
  require_same_state(before, state_of(store, ids));

  // The free list too: the next insert takes the pages the twin (which never saw the refused
  // call) takes, and both pools end up identical.
  auto const next = exact_input<float>(3, 13, 2, 4, 9);  // 4 pages
  insert_fact(store, 3, 1, next);
  insert_fact(twin, 3, 1, next);
  REQUIRE(store.at(3).pages == twin.at(3).pages);
  REQUIRE(store.pool_to_host() == twin.pool_to_host());
  check_fact(store.pool_to_host(), pool_shape{3, 2, 4, 4, dtype::bfloat16}, store.at(3), next);
}

TEST_CASE("a store with no free page refuses every insert", "[store]")
{
  auto const num_pages = GENERATE(as<std::int64_t>{}, 0, 1);
  CAPTURE(num_pages);
  kv_store store{host_config(kv_geometry{1, 1, 2}, dtype::float32, 2, num_pages)};
  REQUIRE(store.pool_bytes() == std::size_t(num_pages * 2 * 1 * 2 * 1 * 2 * 4));
  if (num_pages == 1) { insert_fact(store, 1, 0, exact_input<float>(1, 2, 1, 2, 1)); }
  REQUIRE(store.free_pages() == 0);
  auto const before = state_of(store, {1, 2});
  REQUIRE_THROWS_AS(insert_fact(store, 2, 0, exact_input<float>(1, 1, 1, 2, 2)),
                    inferscale::logic_error);
  REQUIRE_THROWS_AS(store.reserve(2, 0, {1}), inferscale::logic_error);
  require_same_state(before, state_of(store, {1, 2}));
}

TEST_CASE("invalid configurations are refused", "[store]")
{
  struct bad_config {
    char const* name;
    std::function<void(kv_store_config&)> edit;
  };
  std::vector<bad_config> const cases{
    {"no layers", [](kv_store_config& c) { c.model.num_layers = 0; }},
    {"no heads", [](kv_store_config& c) { c.model.num_kv_heads = 0; }},
    {"head_dim 0", [](kv_store_config& c) { c.model.head_dim = 0; }},
    {"odd head_dim", [](kv_store_config& c) { c.model.head_dim = 5; }},
    {"store dtype float8_e4m3", [](kv_store_config& c) { c.store_dtype = dtype::float8_e4m3; }},
    {"store dtype float8_e5m2", [](kv_store_config& c) { c.store_dtype = dtype::float8_e5m2; }},
    {"page_size 0", [](kv_store_config& c) { c.page_size = 0; }},
    {"page_size -1", [](kv_store_config& c) { c.page_size = -1; }},
    {"num_pages -1", [](kv_store_config& c) { c.num_pages = -1; }},
    {"first_layer -1", [](kv_store_config& c) { c.first_layer = -1; }},
    {"first_layer = layers", [](kv_store_config& c) { c.first_layer = 4; }},
    {"num_layers -1", [](kv_store_config& c) { c.num_layers = -1; }},
    {"layers past the end",
     [](kv_store_config& c) {
       c.first_layer = 1;
       c.num_layers  = 4;
     }},
    {"too many layers", [](kv_store_config& c) { c.num_layers = 5; }},
    {"first_head -1", [](kv_store_config& c) { c.first_head = -1; }},
    {"first_head = heads", [](kv_store_config& c) { c.first_head = 3; }},
    {"num_heads -2", [](kv_store_config& c) { c.num_heads = -2; }},
    {"heads past the end",
     [](kv_store_config& c) {
       c.first_head = 2;
       c.num_heads  = 2;
     }},
    {"num_pages * page_size overflows",
     [](kv_store_config& c) {
       c.page_size = 1 << 30;
       c.num_pages = std::numeric_limits<std::int64_t>::max() / 4;
     }},
  };
  auto const which = GENERATE(range(0, 19));
  REQUIRE(cases.size() == 19);
  CAPTURE(cases[std::size_t(which)].name);
  auto cfg = host_config(kv_geometry{4, 3, 8}, dtype::bfloat16, 16, 4);
  cases[std::size_t(which)].edit(cfg);
  REQUIRE_THROWS_AS(kv_store{cfg}, inferscale::logic_error);
}

TEST_CASE("valid edge configurations are accepted and resolved", "[store]")
{
  auto cfg = host_config(kv_geometry{4, 3, 8}, dtype::float16, 1, 0);
  SECTION("zero pages")
  {
    kv_store s{cfg};
    REQUIRE(s.num_pages() == 0);
    REQUIRE(s.pool_bytes() == 0);
    REQUIRE(s.pool_to_host().empty());
    REQUIRE(s.geometry() == (kv_geometry{4, 3, 8}));
  }
  SECTION("last layer and last head, counts defaulted")
  {
    cfg.first_layer = 3;
    cfg.first_head  = 2;
    cfg.num_pages   = 2;
    kv_store s{cfg};
    REQUIRE(s.geometry() == (kv_geometry{1, 1, 8}));
    REQUIRE(s.config().num_layers == 1);
    REQUIRE(s.config().num_heads == 1);
    REQUIRE(s.pool_bytes() == std::size_t(2 * 2 * 1 * 1 * 1 * 8 * 2));
  }
  SECTION("ref() describes the documented layout")
  {
    cfg.first_layer = 1;
    cfg.num_layers  = 2;
    cfg.first_head  = 1;
    cfg.num_heads   = 2;
    cfg.page_size   = 3;
    cfg.num_pages   = 5;
    kv_store s{cfg};
    auto const r = s.ref();
    REQUIRE(r.pool != nullptr);
    REQUIRE(r.store_dtype == dtype::float16);
    REQUIRE(r.num_layers == 2);
    REQUIRE(r.num_heads == 2);
    REQUIRE(r.head_dim == 8);
    REQUIRE(r.page_size == 3);
    REQUIRE(r.num_pages == 5);
    REQUIRE(r.row_elements() == 16);
    for (std::int64_t token = 0; token < 15; ++token) {
      for (std::int32_t l = 0; l < 2; ++l) {
        for (std::int32_t kv = 0; kv < 2; ++kv) {
          std::int64_t const page = token / 3, slot = token % 3;
          REQUIRE(r.row_offset(token, l, kv) == (((page * 2 + l) * 2 + kv) * 3 + slot) * 2 * 8);
        }
      }
    }
  }
}

TEST_CASE("version() changes on every successful mutation and never on a refused one", "[store]")
{
  kv_store store{host_config(kv_geometry{2, 1, 2}, dtype::float32, 2, 6)};
  std::set<std::uint64_t> seen{store.version()};
  auto changed = [&](char const* what) {
    CAPTURE(what);
    REQUIRE(seen.insert(store.version()).second);  // new, never an earlier state's
  };
  auto unchanged = [&](std::uint64_t before, char const* what) {
    CAPTURE(what);
    REQUIRE(store.version() == before);
  };
  auto const a = exact_input<float>(2, 3, 1, 2, 1);
  insert_fact(store, 1, 1, a);
  changed("insert");
  insert_fact(store, 2, 1, exact_input<float>(2, 1, 1, 2, 2));
  changed("second insert");
  auto v = store.version();
  REQUIRE_THROWS_AS(insert_fact(store, 1, 1, a), inferscale::logic_error);
  unchanged(v, "refused insert (duplicate)");
  REQUIRE_THROWS_AS(insert_fact(store, 3, 1, exact_input<float>(2, 20, 1, 2, 3)),
                    inferscale::logic_error);
  unchanged(v, "refused insert (capacity)");
  (void)store.at(1);
  (void)store.pool_to_host();
  (void)store.namespace_bytes(1);
  (void)store.contains(2);
  unchanged(v, "reads");
  store.reserve(3, 2, {4, 5});
  changed("reserve");
  v = store.version();
  REQUIRE_THROWS_AS(store.reserve(3, 2, {4}), inferscale::logic_error);
  unchanged(v, "refused reserve");
  store.erase(2);
  changed("erase");
  v = store.version();
  REQUIRE_THROWS_AS(store.erase(2), inferscale::logic_error);
  unchanged(v, "refused erase");
  insert_fact(store, 4, 2, exact_input<float>(2, 2, 1, 2, 4));
  changed("insert into reused pages");
  REQUIRE(store.erase_namespace(2) == 2);
  changed("erase_namespace");
  insert_fact(store, 2, 1, exact_input<float>(2, 1, 1, 2, 5));
  changed("re-insert of an erased id");
}

TEST_CASE("reserve makes a fact visible with pages of its own", "[store]")
{
  kv_store store{host_config(kv_geometry{1, 2, 2}, dtype::bfloat16, 3, 5)};
  fact_record const& r = store.reserve(8, 4, {9, 8, 7, 6});
  REQUIRE(r.fact_id == 8);
  REQUIRE(r.namespace_id == 4);
  REQUIRE(r.token_ids == (std::vector<std::int32_t>{9, 8, 7, 6}));
  REQUIRE(r.pages.size() == 2);
  REQUIRE(store.contains(8));
  REQUIRE(store.free_pages() == 3);
  REQUIRE(store.namespace_pages(4) == 2);
  REQUIRE(store.namespace_bytes(4) == 2 * 1 * 4 * 2 * 2 * 2);
  store.erase(8);
  REQUIRE(store.free_pages() == 5);
}

TEST_CASE("moving a store keeps its contents", "[store]")
{
  auto const cfg = host_config(kv_geometry{2, 2, 4}, dtype::float16, 3, 12);
  pool_shape const shape{2, 2, 4, 3, dtype::float16};
  kv_store a{cfg};
  auto const f1 = exact_input<float>(2, 4, 2, 4, 1);
  auto const f2 = exact_input<float>(2, 7, 2, 4, 2);
  insert_fact(a, 1, 10, f1);
  insert_fact(a, 2, 11, f2);
  std::vector<std::uint64_t> const ids{1, 2, 3};
  auto const before   = state_of(a, ids);
  auto const identity = a.identity();

  kv_store b{std::move(a)};
  require_same_state(before, state_of(b, ids));
  REQUIRE(b.identity() == identity);
  REQUIRE(b.geometry() == (kv_geometry{2, 2, 4}));
  REQUIRE(b.page_size() == 3);
  REQUIRE(b.num_pages() == 12);
  REQUIRE(b.space() == memory_space::host);
  REQUIRE(b.namespace_fact_ids(10) == std::vector<std::uint64_t>{1});
  check_fact(b.pool_to_host(), shape, b.at(2), f2);

  // Assignment over a store with contents of its own.
  kv_store c{cfg};
  insert_fact(c, 3, 12, exact_input<float>(2, 2, 2, 4, 3));
  REQUIRE(c.identity() != identity);
  c = std::move(b);
  require_same_state(before, state_of(c, ids));
  REQUIRE(c.identity() == identity);
  REQUIRE_FALSE(c.contains(3));
  REQUIRE(c.namespace_facts(12) == 0);

  // Still fully usable.
  auto const f3 = exact_input<float>(2, 5, 2, 4, 4);
  insert_fact(c, 3, 10, f3);
  c.erase(1);
  auto const pool = c.pool_to_host();
  check_fact(pool, shape, c.at(2), f2);
  check_fact(pool, shape, c.at(3), f3);
  REQUIRE(c.free_pages() == 12 - 3 - 2);
}

TEST_CASE("host allocations are zeroed, writable to the last byte, and 2 MiB-aligned when large",
          "[store][memory]")
{
  using inferscale::detail::host_allocation;
  constexpr std::size_t mib = std::size_t{1} << 20;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{100}, 2 * mib - 1, 2 * mib, 5 * mib + 3}) {
    CAPTURE(bytes);
    host_allocation a{bytes};
    REQUIRE(a.data() != nullptr);
    std::size_t const n = bytes == 0 ? 1 : bytes;
    REQUIRE(std::all_of(a.bytes(), a.bytes() + n, [](unsigned char c) { return c == 0; }));
    for (std::size_t i = 0; i < n; ++i) {
      a.bytes()[i] = static_cast<unsigned char>(i * 7 + 1);
    }
    host_allocation b{std::move(a)};  // moves the memory, not its bytes
    REQUIRE(a.data() == nullptr);
    bool intact = true;
    for (std::size_t i = 0; i < n; ++i) {
      intact = intact && b.bytes()[i] == static_cast<unsigned char>(i * 7 + 1);
    }
    REQUIRE(intact);
    if (b.huge_page_advised()) {
      REQUIRE(reinterpret_cast<std::uintptr_t>(b.data()) % (2 * mib) == 0);
    }
#if defined(__linux__)
    // On Linux every allocation of at least one huge page is mapped at a 2 MiB boundary.
    if (bytes >= 2 * mib) { REQUIRE(reinterpret_cast<std::uintptr_t>(b.data()) % (2 * mib) == 0); }
#endif
  }
}

TEST_CASE("a large host store pool starts at a 2 MiB boundary (Linux) and reads as zero",
          "[store][memory]")
{
  // 2 layers * 2 (K, V) * 16 tokens * 4 heads * 128 dims * 2 B = 64 KiB a page: 18.75 MiB
  inferscale::kv_store store{host_config({2, 4, 128}, dtype::bfloat16, 16, 300)};
  REQUIRE(store.pool_bytes() == std::size_t{300} * 2 * 2 * 16 * 4 * 128 * 2);
  auto const* const pool = static_cast<unsigned char const*>(store.ref().pool);
  REQUIRE(std::all_of(pool, pool + store.pool_bytes(), [](unsigned char c) { return c == 0; }));
#if defined(__linux__)
  REQUIRE(reinterpret_cast<std::uintptr_t>(pool) % (std::size_t{2} << 20) == 0);
#endif
}

TEST_CASE("a pinned pool is allocated from the configured resource, and returned to it",
          "[store][memory_resource]")
{
  // The recording resource serves host memory, so the pinned store runs without a GPU.
  inferscale_test::counting_resource resource;
  std::int64_t const ps = 4, num_pages = 3;
  auto cfg     = host_config(kv_geometry{2, 2, 2}, dtype::float16, std::int32_t(ps), num_pages);
  cfg.pinned   = true;
  cfg.resource = &resource;
  // [3 pages][2 layers][K, V][4 tokens][2 heads][2 dims] of 2-byte elements
  std::size_t const expected_bytes = 3 * 2 * 2 * 4 * 2 * 2 * 2;
  pool_shape const shape{2, 2, 2, ps, dtype::float16};
  {
    kv_store store{cfg};
    REQUIRE(resource.allocations.size() == 1);
    REQUIRE(resource.allocations[0].bytes == expected_bytes);
    REQUIRE(resource.allocations[0].stream == nullptr);
    REQUIRE(store.ref().pool == resource.allocations[0].pointer);
    auto const* const bytes = static_cast<unsigned char const*>(store.ref().pool);
    REQUIRE(std::all_of(bytes, bytes + expected_bytes, [](unsigned char c) { return c == 0; }));
    auto const input = exact_input<float>(2, 6, 2, 2, 70);
    insert_fact(store, 1, 1, input);
    check_fact(store.pool_to_host(), shape, store.at(1), input);
    kv_store moved{std::move(store)};  // the pool moves with the store: no second free
    REQUIRE(resource.deallocations.empty());
  }
  REQUIRE(resource.deallocations.size() == 1);
  REQUIRE(resource.deallocations[0].pointer == resource.allocations[0].pointer);
  REQUIRE(resource.deallocations[0].bytes == expected_bytes);
}

TEST_CASE("a plain host pool takes no memory resource", "[store][memory_resource]")
{
  inferscale_test::counting_resource resource;
  auto cfg     = host_config(kv_geometry{2, 2, 2}, dtype::float16, 4, 3);
  cfg.resource = &resource;
  REQUIRE_THROWS_WITH(kv_store{cfg}, Catch::Matchers::Contains("device and pinned pools only"));
  REQUIRE(resource.allocations.empty());
}

TEST_CASE("scrub_pages zeroes exactly the named pages; a page outside the pool changes nothing",
          "[store][scrub]")
{
  std::int64_t const ps = 4, num_pages = 6;
  kv_store store{host_config(kv_geometry{2, 2, 2}, dtype::float32, std::int32_t(ps), num_pages)};
  // one page: 2 layers x (K, V) x 4 tokens x 2 heads x 2 dims x 4 bytes
  std::size_t const page_bytes = 2 * 2 * 4 * 2 * 2 * 4;
  REQUIRE(store.page_bytes() == page_bytes);
  pool_shape const shape{2, 2, 2, ps, dtype::float32};
  auto const a = exact_input<float>(2, 8, 2, 2, 80);  // 2 pages
  auto const b = exact_input<float>(2, 5, 2, 2, 81);  // 2 pages
  insert_fact(store, 1, 1, a);
  insert_fact(store, 2, 1, b);
  auto const pages_a = store.at(1).pages;

  auto const before = store.pool_to_host();
  REQUIRE_THROWS_AS(store.scrub_pages({pages_a[0], num_pages}), inferscale::logic_error);
  REQUIRE_THROWS_AS(store.scrub_pages({-1}), inferscale::logic_error);
  REQUIRE(store.pool_to_host() == before);  // refused before any page was zeroed

  store.erase(1);
  store.scrub_pages(pages_a);
  auto const after = store.pool_to_host();
  for (std::int64_t p = 0; p < num_pages; ++p) {
    bool const scrubbed = std::find(pages_a.begin(), pages_a.end(), p) != pages_a.end();
    auto const first    = static_cast<std::ptrdiff_t>(std::size_t(p) * page_bytes);
    auto const last     = first + static_cast<std::ptrdiff_t>(page_bytes);
    CAPTURE(p, scrubbed);
    if (scrubbed) {
      REQUIRE(std::all_of(
        after.begin() + first, after.begin() + last, [](unsigned char c) { return c == 0; }));
    } else {
      REQUIRE(std::equal(after.begin() + first, after.begin() + last, before.begin() + first));
    }
  }
  check_fact(after, shape, store.at(2), b);
  // fact 1 held nonzero data (exact_input's values), so the scrub did change its pages
  REQUIRE(after != before);
}
