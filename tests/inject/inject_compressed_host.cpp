// Compressed facts (inferscale/compression.hpp): fp8 e4m3 and int4 pages with per-channel key
// scales and per-token value scales, written by kv_store::insert and dequantized by injection.
//
// Every expectation is written here from the documented format, never taken from the code under
// test:
//  - page and block sizes are the file comment's formula, written out;
//  - scales: int4, amax / 7 in fp32 rounded up to bfloat16 (the smallest bfloat16 not below it,
//    found by stepping bit patterns); e4m3, the smallest power of two not below amax / 448 in fp32
//    (frexp); codes: int4, nearbyint(x / scale) clamped to +-7; e4m3, round_to<e4m3>(x / scale)
//    (inject_common.hpp's rounding on the format's values);
//  - the pool is read back by offsets written from the layout, not through the library's
//    accessors;
//  - injection from a compressed store equals injection from an uncompressed store holding the
//    dequantized values, computed here as code * scale rounded to the store dtype (round_to), byte
//    for byte, in every engine layout.
#include "engine_caches.hpp"
#include "inject_common.hpp"

#include <inferscale/compose.hpp>
#include <inferscale/compression.hpp>
#include <inferscale/error.hpp>
#include <inferscale/extract.hpp>
#include <inferscale/inject.hpp>
#include <inferscale/recompute.hpp>
#include <inferscale/snapshot.hpp>
#include <inferscale/store.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace inferscale;
using namespace inferscale_test;
using Catch::Matchers::Contains;

namespace {

std::int64_t round16(std::int64_t n) { return (n + 15) / 16 * 16; }

/// The file comment's block sizes: codes padded to 16, then the scales padded to 16.
struct ref_layout {
  std::int64_t P, H, D, bits, scale_bytes;
  std::int64_t codes() const { return round16(P * H * D * bits / 8); }
  std::int64_t k_block() const { return codes() + round16(H * D * scale_bytes); }
  std::int64_t v_block() const { return codes() + round16(P * H * scale_bytes); }
  std::int64_t layer() const { return k_block() + v_block(); }
};

ref_layout layout_of(kv_compression c, std::int64_t P, std::int64_t H, std::int64_t D)
{
  return c == kv_compression::int4 ? ref_layout{P, H, D, 4, 2} : ref_layout{P, H, D, 8, 1};
}

kv_store make_store(int L, int H, int D, dtype t, kv_compression c, int page_size, int pages)
{
  kv_store_config cfg{};
  cfg.model       = kv_geometry{L, H, D};
  cfg.store_dtype = t;
  cfg.compression = c;
  cfg.page_size   = page_size;
  cfg.num_pages   = pages;
  cfg.space       = memory_space::host;
  return kv_store{cfg};
}

double bf16_value(std::uint16_t bits) { return float_from_bits(std::uint32_t{bits} << 16); }

/// int4 scale: the smallest bfloat16 >= fp32(amax / 7) (0 for amax 0).
double ref_int4_scale(float amax)
{
  if (amax == 0.0f) { return 0.0; }
  float const q = amax / 7.0f;
  std::uint32_t u;
  std::memcpy(&u, &q, 4);
  auto b = static_cast<std::uint16_t>(u >> 16);  // truncated: <= q
  while (bf16_value(b) < q) {
    ++b;
  }
  return bf16_value(b);
}

/// e4m3 scale: the smallest power of two >= fp32(amax / 448) (2^-127 for amax 0).
double ref_fp8_scale(float amax)
{
  float const q = amax / 448.0f;
  if (q <= std::ldexp(1.0, -127)) { return std::ldexp(1.0, -127); }
  int e;
  double const m = std::frexp(double(q), &e);  // q = m 2^e, m in [0.5, 1)
  return m == 0.5 ? double(q) : std::ldexp(1.0, e);
}

double ref_scale(kv_compression c, float amax)
{
  return c == kv_compression::int4 ? ref_int4_scale(amax) : ref_fp8_scale(amax);
}

/// The value a code of x stands for, times its scale: what injection must read.
double ref_dequantized(kv_compression c, float x, double scale)
{
  if (c == kv_compression::int4) {
    if (scale == 0) { return 0.0; }
    double q = std::nearbyint(double(float(x / float(scale))));
    q        = std::max(-7.0, std::min(7.0, q));
    return q == 0 ? 0.0 : q * scale;  // an integer code: no negative zero
  }
  return round_to<float8_e4m3_t>(double(float(x / float(scale)))) * scale;
}

/// A fact whose key channel 3 of every head is an outlier (x 20), as pre-RoPE keys have.
fact_data outlier_fact(std::uint64_t id, int L, int c, int H, int D, std::uint64_t seed)
{
  fact_data f(id, L, c, H, D, seed);
  for (int l = 0; l < L; ++l) {
    for (int j = 0; j < c; ++j) {
      for (int h = 0; h < H; ++h) {
        f.k[f.index(l, j, h, 3)] *= 20.0f;
        f.v[f.index(l, j, h, 5)] = 0.0f;  // zeros still encode as 0
      }
    }
  }
  return f;
}

/// Per element of `f`, the dequantized value (as a compressed store of page size P holds it).
struct dequantized_fact {
  std::vector<float> k, v;
};

dequantized_fact reference_dequantized(fact_data const& f, kv_compression c, int P, dtype t)
{
  dequantized_fact out{f.k, f.v};
  for (int l = 0; l < f.layers; ++l) {
    for (int page0 = 0; page0 < f.tokens; page0 += P) {
      int const n = std::min(P, f.tokens - page0);
      for (int h = 0; h < f.heads; ++h) {
        for (int d = 0; d < f.head_dim; ++d) {  // keys: per channel over the page's tokens
          float amax = 0;
          for (int j = page0; j < page0 + n; ++j) {
            amax = std::max(amax, std::fabs(f.key(l, j, h, d)));
          }
          double const s = ref_scale(c, amax);
          for (int j = page0; j < page0 + n; ++j) {
            out.k[f.index(l, j, h, d)] =
              float(stored_value(t, float(ref_dequantized(c, f.key(l, j, h, d), s))));
          }
        }
        for (int j = page0; j < page0 + n; ++j) {  // values: per token and head
          float amax = 0;
          for (int d = 0; d < f.head_dim; ++d) {
            amax = std::max(amax, std::fabs(f.value(l, j, h, d)));
          }
          double const s = ref_scale(c, amax);
          for (int d = 0; d < f.head_dim; ++d) {
            out.v[f.index(l, j, h, d)] =
              float(stored_value(t, float(ref_dequantized(c, f.value(l, j, h, d), s))));
          }
        }
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("compressed pages: sizes as the layout says, fewer bytes than bfloat16", "[compression]")
{
  for (auto c : {kv_compression::fp8_e4m3, kv_compression::int4}) {
    CAPTURE(to_string(c));
    kv_store const s   = make_store(2, 3, 16, dtype::bfloat16, c, 4, 5);
    ref_layout const r = layout_of(c, 4, 3, 16);
    CHECK(s.page_bytes() == std::size_t(2 * r.layer()));
    CHECK(s.ref().layer_bytes() == r.layer());
    CHECK(s.ref().block_offset(3, 1, 1) == (3 * 2 + 1) * r.layer() + r.k_block());
    CHECK(s.fact_bytes(9) == 3 * 2 * r.layer());  // three pages
  }
  // Llama-3.1-8B's geometry (32 layers, 8 KV heads, head_dim 128), pages of 16 and 32 tokens.
  for (std::int64_t P : {16, 32}) {
    double const bf16 = 2.0 * P * 8 * 128 * 2;
    double const fp8  = double(layout_of(kv_compression::fp8_e4m3, P, 8, 128).layer());
    double const int4 = double(layout_of(kv_compression::int4, P, 8, 128).layer());
    kv_store const s8 =
      make_store(32, 8, 128, dtype::bfloat16, kv_compression::fp8_e4m3, int(P), 1);
    kv_store const s4 = make_store(32, 8, 128, dtype::bfloat16, kv_compression::int4, int(P), 1);
    CHECK(double(s8.page_bytes()) == 32 * fp8);
    CHECK(double(s4.page_bytes()) == 32 * int4);
    CHECK(bf16 / fp8 >= 1.9);  // issue 52's targets, from the formula
    CHECK(bf16 / int4 >= 3.5);
  }
}

TEST_CASE("kv_store::insert quantizes: scales and codes as the format defines them",
          "[compression]")
{
  int const L = 2, H = 2, D = 16, P = 4, C = 7;  // two pages, the second partly filled
  for (auto c : {kv_compression::fp8_e4m3, kv_compression::int4}) {
    CAPTURE(to_string(c));
    kv_store s        = make_store(L, H, D, dtype::float32, c, P, 4);
    fact_data const f = outlier_fact(9, L, C, H, D, 99);
    f.insert_into(s);
    ref_layout const r                    = layout_of(c, P, H, D);
    std::vector<unsigned char> const pool = s.pool_to_host();
    fact_record const& rec                = s.at(9);
    REQUIRE(rec.pages.size() == 2);
    auto const code_of = [&](unsigned char const* block, int t, int h, int d) -> int {
      std::int64_t const e = (std::int64_t(t) * H + h) * D + d;
      if (c == kv_compression::int4) {
        int const nib = (block[e / 2] >> ((e % 2) * 4)) & 0xF;
        return nib >= 8 ? nib - 16 : nib;
      }
      return block[e];
    };
    auto const scale_of = [&](unsigned char const* block, std::int64_t i) -> double {
      unsigned char const* sc = block + r.codes();
      if (c == kv_compression::int4) {
        return bf16_value(std::uint16_t(sc[2 * i] | sc[2 * i + 1] << 8));
      }
      return sc[i] == 0 ? std::ldexp(1.0, -127) : std::ldexp(1.0, int(sc[i]) - 127);
    };
    for (int pi = 0; pi < 2; ++pi) {
      int const n = std::min(P, C - pi * P);
      for (int l = 0; l < L; ++l) {
        unsigned char const* kb = pool.data() + rec.pages[pi] * 2 * r.layer() + l * r.layer();
        unsigned char const* vb = kb + r.k_block();
        for (int h = 0; h < H; ++h) {
          for (int d = 0; d < D; ++d) {
            float amax = 0;
            for (int t = 0; t < n; ++t) {
              amax = std::max(amax, std::fabs(f.key(l, pi * P + t, h, d)));
            }
            double const ks = ref_scale(c, amax);
            REQUIRE(scale_of(kb, h * D + d) == ks);
            for (int t = 0; t < P; ++t) {
              if (t >= n) {
                REQUIRE(code_of(kb, t, h, d) == 0);  // rows past the fact's end
                continue;
              }
              float const x    = f.key(l, pi * P + t, h, d);
              double const deq = ref_dequantized(c, x, ks);
              double const got = c == kv_compression::int4
                                   ? code_of(kb, t, h, d) * ks
                                   : decode(float8_e4m3_t{std::uint8_t(code_of(kb, t, h, d))}) * ks;
              REQUIRE(got == deq);
              // The error bound of the format: half a step for int4, half an e4m3 ulp for fp8.
              double const bound = c == kv_compression::int4
                                     ? ks / 2
                                     : ulp_at<float8_e4m3_t>(std::fabs(x / ks)) * ks / 2;
              REQUIRE(std::fabs(got - x) <= bound * (1 + 1e-6));
            }
          }
          for (int t = 0; t < n; ++t) {
            float amax = 0;
            for (int d = 0; d < D; ++d) {
              amax = std::max(amax, std::fabs(f.value(l, pi * P + t, h, d)));
            }
            double const vs = ref_scale(c, amax);
            REQUIRE(scale_of(vb, t * H + h) == vs);
            for (int d = 0; d < D; ++d) {
              float const x    = f.value(l, pi * P + t, h, d);
              double const got = c == kv_compression::int4
                                   ? code_of(vb, t, h, d) * vs
                                   : decode(float8_e4m3_t{std::uint8_t(code_of(vb, t, h, d))}) * vs;
              REQUIRE(got == ref_dequantized(c, x, vs));
            }
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("injecting a compressed fact is injecting its dequantized values",
                   "[compression][inject]",
                   float,
                   bfloat16_t,
                   float8_e4m3_t)
{
  using T           = TestType;
  auto const layout = GENERATE(from_range(all_engine_layouts()));
  auto const c      = GENERATE(kv_compression::fp8_e4m3, kv_compression::int4);
  auto const sd     = GENERATE(dtype::float32, dtype::bfloat16);
  int const L = 2, H = 3, D = 16, P = 4, BS = 4, NB = 16;
  CAPTURE(to_string(layout), to_string(c), to_string(sd), sizeof(T));

  kv_store compressed = make_store(L, H, D, sd, c, P, 16);
  kv_store plain      = make_store(L, H, D, sd, kv_compression::none, P, 16);
  std::vector<fact_data> facts;
  for (std::uint64_t id : {1, 2, 3}) {
    facts.push_back(outlier_fact(id, L, int(3 + 2 * id), H, D, 100 + id));
  }
  for (fact_data const& f : facts) {
    f.insert_into(compressed);
    dequantized_fact const dq = reference_dequantized(f, c, P, sd);
    plain.insert(f.id,
                 0,
                 f.token_ids,
                 make_fact_kv_view(dq.k.data(), L, f.tokens, H, D),
                 make_fact_kv_view(dq.v.data(), L, f.tokens, H, D));
  }
  engine_cache<T> a(layout, L, NB, BS, H, D), b(layout, L, NB, BS, H, D);
  a.fill_random(5);
  b.fill_random(5);
  ref_rope const rope{D, D, 10000.0, false, true};
  compose_options o;
  o.first_position = 17;
  std::vector<std::int64_t> slots;
  for (std::int64_t i = 0; i < 5 + 7 + 9; ++i) {
    slots.push_back(i == 4 ? -1 : 60 - i);
  }
  injection_batch bb(plain);
  bb.add(compose(plain, {3, 1, 2}, o), slots);
  bb.run(describe_cache(b), rope.params());
  // Every vector level of the host's dequantization (AVX2, AVX-512, AVX-512 BF16: those the CPU
  // has) and the scalar one; the batch is re-added for each run (a run commits its step).
  for (auto cap : {detail::host_simd::scalar,
                   detail::host_simd::avx2,
                   detail::host_simd::avx512,
                   detail::host_simd::avx512_bf16}) {
    CAPTURE(static_cast<int>(cap));
    detail::set_host_simd_cap(cap);
    a.fill_random(5);
    injection_batch run{compressed};
    run.add(compose(compressed, {3, 1, 2}, o), slots);
    run.run(describe_cache(a), rope.params());
    REQUIRE(storage_bytes(a) == storage_bytes(b));
  }
  detail::set_host_simd_cap(detail::host_simd::avx512_bf16);
}

TEST_CASE("compressed stores: snapshots round-trip; damage and conversions are refused",
          "[compression][snapshot]")
{
  namespace fs = std::filesystem;
  fs::path const dir =
    fs::temp_directory_path() / ("inferscale-compressed-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::string const path = (dir / "store.iskv").string();
  for (auto c : {kv_compression::fp8_e4m3, kv_compression::int4}) {
    CAPTURE(to_string(c));
    kv_store s = make_store(2, 2, 16, dtype::bfloat16, c, 4, 6);
    outlier_fact(4, 2, 6, 2, 16, 4).insert_into(s, 7);
    outlier_fact(5, 2, 3, 2, 16, 5).insert_into(s, 8);
    save_store(s, path);
    kv_store const back = load_store(path, store_load_options{memory_space::host});
    CHECK(back.compression() == c);
    CHECK(back.pool_to_host() == s.pool_to_host());
    CHECK(back.at(4).pages == s.at(4).pages);
    // The incremental load takes the unchanged facts from the previous store: the same bytes.
    kv_store_config target = s.config();
    kv_store const again   = load_store(path, target, back);
    CHECK(again.pool_to_host() == s.pool_to_host());

    store_load_options other{memory_space::host};
    other.store_dtype = dtype::float32;
    CHECK_THROWS_WITH(load_store(path, other), Contains("loads in its own dtype"));
    kv_store_config plain = s.config();
    plain.compression     = kv_compression::none;
    CHECK_THROWS_WITH(load_store(path, plain), Contains("compression is"));

    // A NaN code in the first page in use, with every checksum fixed up by re-saving would be
    // the file's own; here only the pool byte changes, so the checksum names the damage first.
    {
      std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
      io.seekg(0, std::ios::end);
      auto const size = static_cast<std::streamoff>(io.tellg());
      io.seekp(size - 8 - 2 * static_cast<std::streamoff>(s.page_bytes()) + 1);
      char const nan = 0x7F;
      io.write(&nan, 1);
    }
    CHECK_THROWS_WITH(load_store(path, store_load_options{memory_space::host}),
                      Contains("checksum mismatch"));

    // A pool holding a code the store never writes (e4m3 NaN, int4 -8) is not saved.
    std::string const second                    = (dir / "second.iskv").string();
    auto* const pool                            = static_cast<unsigned char*>(s.ref().pool);
    pool[s.at(5).pages[0] * s.page_bytes() + 1] = c == kv_compression::int4 ? 0x08 : 0x7F;
    CHECK_THROWS_WITH(save_store(s, second), Contains("holds a code or a scale the store never"));
    CHECK_FALSE(fs::exists(second));
  }
  fs::remove_all(dir);
}

TEST_CASE("compressed stores refuse what they cannot hold, and extraction into them",
          "[compression]")
{
  kv_store_config cfg{};
  cfg.model       = kv_geometry{1, 1, 1024};
  cfg.compression = kv_compression::int4;
  cfg.num_pages   = 1;
  cfg.space       = memory_space::host;
  CHECK_THROWS_WITH(kv_store{cfg}, Contains("head_dim up to 512"));
  cfg.model       = kv_geometry{1, 1, 16};
  cfg.compression = static_cast<kv_compression>(7);
  CHECK_THROWS_WITH(kv_store{cfg}, Contains("unknown compression value 7"));

  int const L = 1, H = 1, D = 16;
  kv_store s = make_store(L, H, D, dtype::float32, kv_compression::fp8_e4m3, 4, 4);
  engine_cache<float> ec(engine_layout::vllm_flash_attn_nhd, L, 4, 4, H, D);
  ec.fill_random(1);
  ref_rope const rope{D, D, 10000.0, false, true};
  auto const before = s.pool_to_host();
  CHECK_THROWS_WITH(extract_host(describe_cache(ec), {0, 1}, 0, rope.params(), s, 3, 0, {5, 6}),
                    Contains("the store is compressed (fp8_e4m3)"));
  CHECK(s.num_facts() == 0);
  CHECK(s.pool_to_host() == before);
}

TEST_CASE("kv_deviation reads a compressed store's rows as injection does", "[compression]")
{
  int const L = 2, H = 2, D = 16, C = 6;
  kv_store s        = make_store(L, H, D, dtype::float32, kv_compression::int4, 4, 4);
  fact_data const f = outlier_fact(1, L, C, H, D, 8);
  f.insert_into(s);
  dequantized_fact const dq = reference_dequantized(f, kv_compression::int4, 4, dtype::float32);
  composition const comp    = compose(s, {1}, compose_options{});
  for (int l = 0; l < L; ++l) {
    // In-context rows equal to the dequantized fact: no deviation; equal to the original: the
    // quantization error, summed here.
    std::vector<float> const dev_zero = kv_deviation(
      s,
      comp,
      l,
      make_token_head_view<float const>(dq.k.data() + std::size_t(l) * C * H * D, C, H, D),
      make_token_head_view<float const>(dq.v.data() + std::size_t(l) * C * H * D, C, H, D));
    std::vector<float> const dev = kv_deviation(
      s,
      comp,
      l,
      make_token_head_view<float const>(f.k.data() + std::size_t(l) * C * H * D, C, H, D),
      make_token_head_view<float const>(f.v.data() + std::size_t(l) * C * H * D, C, H, D));
    for (int j = 0; j < C; ++j) {
      CHECK(dev_zero[j] == 0.0f);
      double want = 0;
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          double const dk = double(dq.k[f.index(l, j, h, d)]) - f.key(l, j, h, d);
          double const dv = double(dq.v[f.index(l, j, h, d)]) - f.value(l, j, h, d);
          want += dk * dk + dv * dv;
        }
      }
      CHECK(dev[j] == Approx(want).epsilon(1e-6));
    }
  }
}
