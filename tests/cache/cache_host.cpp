// Host tests of the cache descriptors (cache.hpp). Each factory is fed the shapes and strides an
// engine reports for its tensors, taken from the test-side simulators of tests/common/
// engine_caches.hpp (written from reference/engines.md, independently of the library); the
// descriptor must then address exactly the element the simulator's documented formula addresses,
// for every (layer, slot, head, dim). Refusals are checked to name the offending input.
#include "engine_cache_descriptor.hpp"
#include "engine_caches.hpp"

#include <inferscale/cache.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/error.hpp>

#include <catch2/catch.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

using namespace inferscale;
using Catch::Matchers::Contains;
using inferscale_test::describe_engine_cache;
using inferscale_test::engine_cache;
using inferscale_test::engine_layout;
using inferscale_test::tensor_desc;
using inferscale_test::to_array;

namespace {

template <class T>
void* base_of(engine_cache<T>& ec, tensor_desc const& td)
{
  return ec.storage() + td.byte_offset;
}

paged_kv_format expected_format(engine_layout layout)
{
  switch (layout) {
    case engine_layout::vllm_flash_attn_nhd:
    case engine_layout::vllm_flash_attn_hnd:
    case engine_layout::vllm_flash_attn_separate: return paged_kv_format::vllm_flash_attn;
    case engine_layout::vllm_flashinfer_nhd:
    case engine_layout::vllm_flashinfer_hnd: return paged_kv_format::vllm_flashinfer;
    case engine_layout::vllm_legacy: return paged_kv_format::vllm_legacy;
    case engine_layout::sglang_token_pool: return paged_kv_format::sglang_token_pool;
    case engine_layout::tensorrt_llm_pool: return paged_kv_format::tensorrt_llm;
    case engine_layout::contiguous: return paged_kv_format::contiguous;
    case engine_layout::vllm_cpu: return paged_kv_format::vllm_cpu;
  }
  return paged_kv_format::generic;
}

template <class T>
std::byte const* element_address(void* base, std::int64_t offset_elements)
{
  return static_cast<std::byte const*>(base) +
         offset_elements * static_cast<std::int64_t>(sizeof(T));
}

}  // namespace

TEMPLATE_TEST_CASE("every factory addresses exactly the engine's documented element",
                   "[cache]",
                   float,
                   bfloat16_t,
                   float8_e4m3_t)
{
  using T               = TestType;
  auto const layout     = GENERATE(from_range(inferscale_test::all_engine_layouts()));
  auto const block_size = GENERATE(1, 3, 16);
  auto const heads      = GENERATE(1, 3);
  auto const head_dim   = GENERATE(16, 48);  // multiples of x = 16 / element size (legacy)
  int const layers      = 2;
  std::int64_t const nb = 3;
  CAPTURE(inferscale_test::to_string(layout), block_size, heads, head_dim, sizeof(T));

  engine_cache<T> ec(layout, layers, nb, block_size, heads, head_dim);
  paged_kv_cache const cache = describe_engine_cache(ec, ec.storage());

  REQUIRE(cache.cache_dtype == dtype_of_v<T>);
  REQUIRE(cache.format == expected_format(layout));
  REQUIRE(cache.num_layers == layers);
  REQUIRE(cache.num_heads() == heads);
  REQUIRE(cache.head_dim() == head_dim);
  // SGLang's buffers have NB*BS + BS rows (engines.md §4), every one addressable as a slot.
  std::int64_t const rows =
    layout == engine_layout::sglang_token_pool ? nb * block_size + block_size : nb * block_size;
  REQUIRE(cache.num_slots() == rows);
  REQUIRE(cache.scale_granularity == kv_scale_granularity::none);
  REQUIRE(cache.scale(0, 0, false) == 1.0f);

  std::int64_t mismatches = 0;
  std::int64_t checked    = 0;
  for (int l = 0; l < layers; ++l) {
    for (std::int64_t s = 0; s < ec.num_slots(); ++s) {
      for (int h = 0; h < heads; ++h) {
        for (int d = 0; d < head_dim; ++d) {
          auto const* k =
            element_address<T>(cache.key_base[l], cache.key_layout.slot_offset(s, h, d));
          auto const* v =
            element_address<T>(cache.value_base[l], cache.value_layout.slot_offset(s, h, d));
          auto const* ek = reinterpret_cast<std::byte const*>(&ec.key(l, s, h, d));
          auto const* ev = reinterpret_cast<std::byte const*>(&ec.value(l, s, h, d));
          if (k != ek || v != ev) {
            if (mismatches == 0) {
              CAPTURE(l, s, h, d, k - ek, v - ev);
              CHECK(k == ek);
              CHECK(v == ev);
            }
            ++mismatches;
          }
          ++checked;
        }
      }
    }
  }
  REQUIRE(checked == layers * ec.num_slots() * heads * head_dim);
  REQUIRE(mismatches == 0);
}

TEMPLATE_TEST_CASE("TensorRT-LLM NHD blocks: [tokens, heads, head_dim] within each K or V block",
                   "[cache]",
                   float,
                   bfloat16_t,
                   float8_e4m3_t)
{
  using T               = TestType;
  auto const block_size = GENERATE(1, 5, 16);
  auto const heads      = GENERATE(1, 3);
  int const head_dim    = 16;
  int const layers      = 3;
  std::int64_t const nb = 4;
  CAPTURE(block_size, heads, sizeof(T));

  // The simulator's pool has the engine's shape; only the in-block order differs (engines.md §6:
  // NHD view [pages, 2, page, H, D] of the pool [max_pages, L, 2, page*H*D]).
  engine_cache<T> ec(engine_layout::tensorrt_llm_pool, layers, nb, block_size, heads, head_dim);
  paged_kv_cache const cache = describe_engine_cache(ec, ec.storage(), trtllm_block_order::nhd);
  REQUIRE(cache.format == paged_kv_format::tensorrt_llm);
  std::byte const* pool = ec.storage() + ec.key_tensor(0).byte_offset;
  std::int64_t const L = layers, BS = block_size, H = heads, D = head_dim;
  std::int64_t mismatches = 0;
  for (int l = 0; l < layers; ++l) {
    for (std::int64_t s = 0; s < nb * BS; ++s) {
      std::int64_t const b = s / BS, t = s % BS;
      for (int h = 0; h < heads; ++h) {
        for (int d = 0; d < head_dim; ++d) {
          for (int kv = 0; kv < 2; ++kv) {
            std::int64_t const expected =
              ((b * L + l) * 2 + kv) * BS * H * D + t * H * D + h * D + d;
            auto const* got =
              kv == 0
                ? element_address<T>(cache.key_base[l], cache.key_layout.slot_offset(s, h, d))
                : element_address<T>(cache.value_base[l], cache.value_layout.slot_offset(s, h, d));
            if (got != pool + expected * static_cast<std::int64_t>(sizeof(T))) { ++mismatches; }
          }
        }
      }
    }
  }
  REQUIRE(mismatches == 0);
}

TEST_CASE("the legacy key chunk x is 16 / element size", "[cache]")
{
  // engines.md §3: x = 4 for fp32, 8 for fp16/bf16, 16 for fp8.
  auto const check = [](auto tag, std::int64_t x) {
    using T = typename decltype(tag)::type;
    engine_cache<T> ec(engine_layout::vllm_legacy, 1, 2, 4, 2, 32);
    REQUIRE(ec.key_tensor(0).shape[4] == x);
    paged_kv_cache const cache = describe_engine_cache(ec, ec.storage());
    REQUIRE(cache.key_layout.dim_chunk == x);
    REQUIRE(cache.value_layout.dim_chunk == 32);
  };
  check(type_tag<float>{}, 4);
  check(type_tag<half_t>{}, 8);
  check(type_tag<bfloat16_t>{}, 8);
  check(type_tag<float8_e4m3_t>{}, 16);
  check(type_tag<float8_e5m2_t>{}, 16);
}

TEST_CASE("factories refuse malformed engine tensors", "[cache]")
{
  using T        = bfloat16_t;
  dtype const dt = dtype::bfloat16;
  int const L    = 2;

  SECTION("vLLM FlashAttention: dimension 0 must be 2")
  {
    engine_cache<T> ec(engine_layout::vllm_flash_attn_nhd, L, 3, 4, 2, 16);
    std::vector<void*> t{base_of(ec, ec.key_tensor(0)), base_of(ec, ec.key_tensor(1))};
    auto shape   = to_array<5>(ec.key_tensor(0).shape);
    auto strides = to_array<5>(ec.key_tensor(0).strides);
    REQUIRE_NOTHROW(make_vllm_flash_attn_cache(dt, t, shape, strides));
    shape[0] = 3;
    REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, t, shape, strides),
                        Contains("dimension 0 must be 2"));
    shape[0] = 1;
    REQUIRE_THROWS_AS(make_vllm_flash_attn_cache(dt, t, shape, strides), logic_error);
  }
  SECTION("FlashInfer and contiguous: dimension 1 must be 2; TensorRT-LLM: dimension 2")
  {
    engine_cache<T> fi(engine_layout::vllm_flashinfer_hnd, L, 3, 4, 2, 16);
    std::vector<void*> t{base_of(fi, fi.key_tensor(0)), base_of(fi, fi.key_tensor(1))};
    auto shape   = to_array<5>(fi.key_tensor(0).shape);
    auto strides = to_array<5>(fi.key_tensor(0).strides);
    REQUIRE_NOTHROW(make_vllm_flashinfer_cache(dt, t, shape, strides));
    shape[1] = 1;
    REQUIRE_THROWS_WITH(make_vllm_flashinfer_cache(dt, t, shape, strides),
                        Contains("dimension 1 must be 2"));

    engine_cache<T> cc(engine_layout::contiguous, L, 3, 4, 2, 16);
    auto cshape   = to_array<5>(cc.key_tensor(0).shape);
    auto cstrides = to_array<5>(cc.key_tensor(0).strides);
    void* cbase   = base_of(cc, cc.key_tensor(0));
    REQUIRE_NOTHROW(make_contiguous_cache(dt, cbase, cshape, cstrides));
    cshape[1] = 4;
    REQUIRE_THROWS_WITH(make_contiguous_cache(dt, cbase, cshape, cstrides),
                        Contains("dimension 1 must be 2"));

    engine_cache<T> tr(engine_layout::tensorrt_llm_pool, L, 3, 4, 2, 16);
    auto tshape   = to_array<4>(tr.key_tensor(0).shape);
    auto tstrides = to_array<4>(tr.key_tensor(0).strides);
    void* tbase   = base_of(tr, tr.key_tensor(0));
    REQUIRE_NOTHROW(
      make_tensorrt_llm_cache(dt, tbase, tshape, tstrides, 4, 2, 16, trtllm_block_order::hnd));
    tshape[2] = 3;
    REQUIRE_THROWS_WITH(
      make_tensorrt_llm_cache(dt, tbase, tshape, tstrides, 4, 2, 16, trtllm_block_order::hnd),
      Contains("dimension 2 must be 2"));
    tshape[2] = 2;
    // The block must factor as tokens_per_block * heads * head_dim.
    REQUIRE_THROWS_WITH(
      make_tensorrt_llm_cache(dt, tbase, tshape, tstrides, 4, 3, 16, trtllm_block_order::nhd),
      Contains("dimension 3"));
  }
  SECTION("vLLM CPU: an even last dimension, the last two dense, K and V apart in each cell")
  {
    engine_cache<T> ec(engine_layout::vllm_cpu, L, 3, 4, 2, 16);
    std::vector<void*> t{base_of(ec, ec.key_tensor(0)), base_of(ec, ec.key_tensor(1))};
    auto shape   = to_array<4>(ec.key_tensor(0).shape);
    auto strides = to_array<4>(ec.key_tensor(0).strides);
    REQUIRE_NOTHROW(make_vllm_cpu_cache(dt, t, shape, strides));
    auto odd = shape;
    odd[3]   = 31;
    REQUIRE_THROWS_WITH(make_vllm_cpu_cache(dt, t, odd, strides), Contains("(even)"));
    auto padded = strides;
    padded[2] += 8;  // rows padded: the transposed key region would not be [head_dim, block_size]
    REQUIRE_THROWS_WITH(make_vllm_cpu_cache(dt, t, shape, padded), Contains("must be dense"));
    // Heads stride smaller than a (block, head) cell: cells overlap.
    auto tight = strides;
    tight[1]   = strides[2] * 2;
    REQUIRE_THROWS_AS(make_vllm_cpu_cache(dt, t, shape, tight), logic_error);
    // Both layers at one base: layer 0's K meets layer 1's K.
    std::vector<void*> same{t[0], t[0]};
    REQUIRE_THROWS_WITH(make_vllm_cpu_cache(dt, same, shape, strides), Contains("overlap"));
    // Blocks padded apart (a strided view of a larger tensor) are fine.
    auto spread = strides;
    spread[0] += 64;
    shape[0] = 2;
    REQUIRE_NOTHROW(make_vllm_cpu_cache(dt, t, shape, spread));
  }
  SECTION("legacy: x must be 16 / element size, the value shape must match")
  {
    engine_cache<T> ec(engine_layout::vllm_legacy, L, 3, 4, 2, 16);
    std::vector<void*> k{base_of(ec, ec.key_tensor(0)), base_of(ec, ec.key_tensor(1))};
    std::vector<void*> v{base_of(ec, ec.value_tensor(0)), base_of(ec, ec.value_tensor(1))};
    auto ks  = to_array<5>(ec.key_tensor(0).shape);
    auto kst = to_array<5>(ec.key_tensor(0).strides);
    auto vs  = to_array<4>(ec.value_tensor(0).shape);
    auto vst = to_array<4>(ec.value_tensor(0).strides);
    REQUIRE(ks[4] == 8);
    REQUIRE_NOTHROW(make_vllm_legacy_cache(dt, k, v, ks, kst, vs, vst));
    // Described as fp32 (x = 4) or fp8 (x = 16), the same bf16 shape (x = 8) is refused.
    REQUIRE_THROWS_WITH(make_vllm_legacy_cache(dtype::float32, k, v, ks, kst, vs, vst),
                        Contains("x = 16 / element size = 4"));
    REQUIRE_THROWS_WITH(make_vllm_legacy_cache(dtype::float8_e4m3, k, v, ks, kst, vs, vst),
                        Contains("x = 16 / element size = 16"));
    // x = 4 with a consistent head_dim (4 chunks of 4) is still not 16 / 2.
    auto ks4 = ks;
    ks4[2]   = 4;
    ks4[4]   = 4;
    REQUIRE_THROWS_WITH(make_vllm_legacy_cache(dt, k, v, ks4, kst, vs, vst),
                        Contains("must be x = 16 / element size = 8"));
    auto vs_bad = vs;
    vs_bad[2]   = 24;
    REQUIRE_THROWS_WITH(make_vllm_legacy_cache(dt, k, v, ks, kst, vs_bad, vst),
                        Contains("value shape"));
  }
  SECTION("negative strides and zero dimensions")
  {
    engine_cache<T> ec(engine_layout::vllm_flash_attn_separate, L, 3, 4, 2, 16);
    std::vector<void*> k{base_of(ec, ec.key_tensor(0)), base_of(ec, ec.key_tensor(1))};
    std::vector<void*> v{base_of(ec, ec.value_tensor(0)), base_of(ec, ec.value_tensor(1))};
    auto const shape   = to_array<4>(ec.key_tensor(0).shape);
    auto const strides = to_array<4>(ec.key_tensor(0).strides);
    REQUIRE_NOTHROW(make_vllm_flash_attn_cache(dt, k, v, shape, strides, strides));
    for (std::size_t i = 0; i < 4; ++i) {
      CAPTURE(i);
      auto neg = strides;
      neg[i]   = -neg[i] - 1;
      REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, k, v, shape, neg, strides),
                          Contains("must be non-negative"));
      REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, k, v, shape, strides, neg),
                          Contains("must be non-negative"));
      auto zero = shape;
      zero[i]   = 0;
      REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, k, v, zero, strides, strides),
                          Contains("must be positive"));
    }
    engine_cache<T> sg(engine_layout::sglang_token_pool, L, 3, 4, 2, 16);
    std::vector<void*> sk{base_of(sg, sg.key_tensor(0)), base_of(sg, sg.key_tensor(1))};
    std::vector<void*> sv{base_of(sg, sg.value_tensor(0)), base_of(sg, sg.value_tensor(1))};
    auto sshape         = to_array<3>(sg.key_tensor(0).shape);
    auto const sstrides = to_array<3>(sg.key_tensor(0).strides);
    REQUIRE_NOTHROW(make_sglang_cache(dt, sk, sv, sshape, sstrides, sstrides));
    sshape[2] = 0;
    REQUIRE_THROWS_AS(make_sglang_cache(dt, sk, sv, sshape, sstrides, sstrides), logic_error);
    auto sneg = sstrides;
    sneg[0]   = -1;
    REQUIRE_THROWS_AS(
      make_sglang_cache(dt, sk, sv, to_array<3>(sg.key_tensor(0).shape), sstrides, sneg),
      logic_error);
  }
  SECTION("layer counts: 1 .. 128, as many value tensors as key tensors")
  {
    engine_cache<T> ec(engine_layout::vllm_flash_attn_separate, 128, 3, 4, 2, 16);
    void* kb           = base_of(ec, ec.key_tensor(0));
    void* vb           = base_of(ec, ec.value_tensor(0));
    auto const shape   = to_array<4>(ec.key_tensor(0).shape);
    auto const strides = to_array<4>(ec.key_tensor(0).strides);
    // 128 layers are accepted, 129 refused (the count is checked before the tensors; aliased
    // layers would be refused as overlapping).
    std::vector<void*> k128, v128, k129(129, kb), v129(129, vb);
    for (int l = 0; l < 128; ++l) {
      k128.push_back(base_of(ec, ec.key_tensor(l)));
      v128.push_back(base_of(ec, ec.value_tensor(l)));
    }
    REQUIRE(make_vllm_flash_attn_cache(dt, k128, v128, shape, strides, strides).num_layers == 128);
    REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, k129, v129, shape, strides, strides),
                        Contains("129"));
    REQUIRE_THROWS_AS(make_vllm_flash_attn_cache(
                        dt, std::vector<void*>{}, std::vector<void*>{}, shape, strides, strides),
                      logic_error);
    std::vector<void*> k2(2, kb), v3(3, vb);
    REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, k2, v3, shape, strides, strides),
                        Contains("2 key tensors but 3 value tensors"));

    // Single-tensor layouts: 129 per-layer tensors.
    engine_cache<T> fa(engine_layout::vllm_flash_attn_nhd, 1, 3, 4, 2, 16);
    std::vector<void*> t129(129, base_of(fa, fa.key_tensor(0)));
    REQUIRE_THROWS_AS(
      make_vllm_flash_attn_cache(
        dt, t129, to_array<5>(fa.key_tensor(0).shape), to_array<5>(fa.key_tensor(0).strides)),
      logic_error);
    // Pools whose layer count is a dimension: TensorRT-LLM dim 1, contiguous dim 0.
    engine_cache<T> tr(engine_layout::tensorrt_llm_pool, 1, 3, 4, 2, 16);
    auto tshape = to_array<4>(tr.key_tensor(0).shape);
    tshape[1]   = 129;
    REQUIRE_THROWS_WITH(make_tensorrt_llm_cache(dt,
                                                base_of(tr, tr.key_tensor(0)),
                                                tshape,
                                                to_array<4>(tr.key_tensor(0).strides),
                                                4,
                                                2,
                                                16,
                                                trtllm_block_order::hnd),
                        Contains("129"));
    engine_cache<T> cc(engine_layout::contiguous, 1, 3, 4, 2, 16);
    auto cshape = to_array<5>(cc.key_tensor(0).shape);
    cshape[0]   = 129;
    REQUIRE_THROWS_WITH(
      make_contiguous_cache(
        dt, base_of(cc, cc.key_tensor(0)), cshape, to_array<5>(cc.key_tensor(0).strides)),
      Contains("129"));
  }
  SECTION("null base addresses")
  {
    engine_cache<T> ec(engine_layout::vllm_flash_attn_separate, L, 3, 4, 2, 16);
    std::vector<void*> k{base_of(ec, ec.key_tensor(0)), base_of(ec, ec.key_tensor(1))};
    std::vector<void*> v{base_of(ec, ec.value_tensor(0)), base_of(ec, ec.value_tensor(1))};
    auto const shape   = to_array<4>(ec.key_tensor(0).shape);
    auto const strides = to_array<4>(ec.key_tensor(0).strides);
    auto kn            = k;
    kn[1]              = nullptr;
    REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, kn, v, shape, strides, strides),
                        Contains("null base address for layer 1"));
    auto vn = v;
    vn[0]   = nullptr;
    REQUIRE_THROWS_WITH(make_vllm_flash_attn_cache(dt, k, vn, shape, strides, strides),
                        Contains("null base address for layer 0"));

    engine_cache<T> fa(engine_layout::vllm_flashinfer_nhd, L, 3, 4, 2, 16);
    std::vector<void*> t{base_of(fa, fa.key_tensor(0)), nullptr};
    REQUIRE_THROWS_AS(
      make_vllm_flashinfer_cache(
        dt, t, to_array<5>(fa.key_tensor(0).shape), to_array<5>(fa.key_tensor(0).strides)),
      logic_error);
    engine_cache<T> tr(engine_layout::tensorrt_llm_pool, L, 3, 4, 2, 16);
    REQUIRE_THROWS_AS(make_tensorrt_llm_cache(dt,
                                              nullptr,
                                              to_array<4>(tr.key_tensor(0).shape),
                                              to_array<4>(tr.key_tensor(0).strides),
                                              4,
                                              2,
                                              16,
                                              trtllm_block_order::hnd),
                      logic_error);
    engine_cache<T> cc(engine_layout::contiguous, L, 3, 4, 2, 16);
    REQUIRE_THROWS_AS(
      make_contiguous_cache(
        dt, nullptr, to_array<5>(cc.key_tensor(0).shape), to_array<5>(cc.key_tensor(0).strides)),
      logic_error);
  }
}

TEST_CASE("vLLM CPU under AMX: keys in tiles of 16 tokens, values in strips of 16 dims", "[cache]")
{
  // The layout vLLM 0.32's cpu_attn_reshape_and_cache writes with isa 'amx' (bfloat16), written
  // out from its measurement (make_vllm_cpu_cache's comment): per (block, head) cell of
  // 2 * B * D elements, key (t, d) at (t / 16) * 16 D + (d / 2) * 32 + (t % 16) * 2 + d % 2, value
  // (t, d) at B D + (d / 16) * 16 B + (t / 2) * 32 + (d % 16) * 2 + t % 2.
  for (auto const& [block, dim] : {std::pair<std::int64_t, std::int64_t>{32, 64},
                                   std::pair<std::int64_t, std::int64_t>{128, 64},
                                   std::pair<std::int64_t, std::int64_t>{64, 128}}) {
    CAPTURE(block, dim);
    std::int64_t const blocks = 3, heads = 2;
    std::array<std::int64_t, 4> const shape{blocks, heads, block, 2 * dim};
    std::array<std::int64_t, 4> const strides{heads * block * 2 * dim, block * 2 * dim, 2 * dim, 1};
    std::vector<std::uint16_t> memory(static_cast<std::size_t>(blocks * strides[0]));
    std::vector<void*> layers{memory.data()};
    paged_kv_cache const c =
      make_vllm_cpu_cache(dtype::bfloat16, layers, shape, strides, vllm_cpu_isa::amx);
    REQUIRE(c.format == paged_kv_format::vllm_cpu);
    REQUIRE(c.num_slots() == blocks * block);
    std::vector<int> touched(memory.size(), 0);
    for (std::int64_t slot = 0; slot < blocks * block; ++slot) {
      std::int64_t const b = slot / block, t = slot % block;
      for (std::int32_t h = 0; h < heads; ++h) {
        std::int64_t const cell = b * strides[0] + h * strides[1];
        for (std::int32_t d = 0; d < dim; ++d) {
          std::int64_t const key = cell + (t / 16) * 16 * dim + (d / 2) * 32 + (t % 16) * 2 + d % 2;
          std::int64_t const value =
            cell + block * dim + (d / 16) * 16 * block + (t / 2) * 32 + (d % 16) * 2 + t % 2;
          REQUIRE(c.key_layout.slot_offset(slot, h, d) == key);
          // values are addressed from the values' base, block * dim elements after the layer's
          REQUIRE(c.value_layout.slot_offset(slot, h, d) + block * dim == value);
          ++touched[static_cast<std::size_t>(key)];
          ++touched[static_cast<std::size_t>(value)];
        }
      }
    }
    // every element of every cell is one key or one value, exactly once
    for (int n : touched) {
      REQUIRE(n == 1);
    }
  }
  // refused where the tiles do not fit, naming why
  std::vector<std::uint16_t> memory(2 * 2 * 32 * 2 * 40);
  std::vector<void*> layers{memory.data()};
  CHECK_THROWS_WITH(
    make_vllm_cpu_cache(
      dtype::bfloat16, layers, {2, 2, 32, 80}, {2 * 32 * 80, 32 * 80, 80, 1}, vllm_cpu_isa::amx),
    Catch::Contains("multiples of 16"));
  // token_chunk must divide the block
  paged_kv_layout l =
    make_vllm_cpu_cache(
      dtype::bfloat16, layers, {2, 2, 32, 64}, {2 * 32 * 64, 32 * 64, 64, 1}, vllm_cpu_isa::amx)
      .key_layout;
  l.token_chunk = 24;
  CHECK_THROWS_WITH(l.validate("amx key"), Catch::Contains("token_chunk 24 must be 0"));
  CHECK(std::string{to_string(vllm_cpu_isa::amx)} == "amx");
}

TEST_CASE("the generic factory checks that the key and value layouts agree", "[cache]")
{
  engine_cache<float> ec(engine_layout::vllm_flash_attn_separate, 2, 3, 4, 2, 16);
  std::vector<void*> k{base_of(ec, ec.key_tensor(0)), base_of(ec, ec.key_tensor(1))};
  std::vector<void*> v{base_of(ec, ec.value_tensor(0)), base_of(ec, ec.value_tensor(1))};
  // (blocks, block size, heads, head_dim) = (3, 4, 2, 16), contiguous [NB, BS, H, D].
  paged_kv_layout layout{};
  layout.num_blocks          = 3;
  layout.block_size          = 4;
  layout.num_heads           = 2;
  layout.head_dim            = 16;
  layout.block_stride        = 4 * 2 * 16;
  layout.token_stride        = 2 * 16;
  layout.head_stride         = 16;
  layout.dim_stride          = 1;
  layout.dim_chunk           = 16;
  paged_kv_cache const cache = make_paged_kv_cache(dtype::float32, k, v, layout, layout);
  REQUIRE(cache.format == paged_kv_format::generic);
  REQUIRE(&static_cast<float*>(cache.value_base[1])[layout.slot_offset(7, 1, 3)] ==
          &ec.value(1, 7, 1, 3));
  for (int field = 0; field < 4; ++field) {
    CAPTURE(field);
    paged_kv_layout other = layout;
    if (field == 0) { other.num_blocks = 2; }
    if (field == 1) { other.block_size = 2; }
    if (field == 2) { other.num_heads = 1; }
    if (field == 3) { other.head_dim = 8; }
    if (field == 3) { other.dim_chunk = 8; }
    REQUIRE_THROWS_WITH(make_paged_kv_cache(dtype::float32, k, v, layout, other),
                        Contains("disagree"));
  }
  paged_kv_layout bad_chunk = layout;
  bad_chunk.dim_chunk       = 5;  // does not divide 16
  REQUIRE_THROWS_WITH(make_paged_kv_cache(dtype::float32, k, v, bad_chunk, bad_chunk),
                      Contains("must divide head_dim"));
}

TEST_CASE("fp8 scales: only on fp8 caches, one pointer per layer", "[cache]")
{
  int const L = 3, H = 2;
  std::vector<float> per_tensor_k(L, 0.5f), per_tensor_v(L, 0.25f);
  std::vector<float> per_head_k(L * H), per_head_v(L * H);
  for (int i = 0; i < L * H; ++i) {
    per_head_k[i] = 0.1f * float(i + 1);
    per_head_v[i] = 0.01f * float(i + 1);
  }
  std::vector<float const*> kt, vt, kh, vh;
  for (int l = 0; l < L; ++l) {
    kt.push_back(&per_tensor_k[l]);
    vt.push_back(&per_tensor_v[l]);
    kh.push_back(&per_head_k[l * H]);
    vh.push_back(&per_head_v[l * H]);
  }

  SECTION("a non-fp8 cache refuses scales")
  {
    engine_cache<bfloat16_t> ec(engine_layout::contiguous, L, 2, 4, H, 16);
    paged_kv_cache cache = describe_engine_cache(ec, ec.storage());
    REQUIRE_THROWS_WITH(
      cache.set_fp8_scales(kv_scale_convention::divide, kv_scale_granularity::per_tensor, kt, vt),
      Contains("scales apply to fp8 caches"));
    REQUIRE(cache.scale_granularity == kv_scale_granularity::none);
    engine_cache<float> ef(engine_layout::contiguous, L, 2, 4, H, 16);
    paged_kv_cache fcache = describe_engine_cache(ef, ef.storage());
    REQUIRE_THROWS_AS(
      fcache.set_fp8_scales(kv_scale_convention::multiply, kv_scale_granularity::per_head, kh, vh),
      logic_error);
  }
  SECTION("fp8: counts must equal the layers, pointers non-null; a refusal changes nothing")
  {
    engine_cache<float8_e5m2_t> ec(engine_layout::vllm_flash_attn_hnd, L, 2, 4, H, 16);
    paged_kv_cache cache = describe_engine_cache(ec, ec.storage());
    auto kshort          = kt;
    kshort.pop_back();
    REQUIRE_THROWS_WITH(
      cache.set_fp8_scales(
        kv_scale_convention::divide, kv_scale_granularity::per_tensor, kshort, vt),
      Contains("expected 3 key and value scale pointers"));
    auto vlong = vt;
    vlong.push_back(vt[0]);
    REQUIRE_THROWS_AS(cache.set_fp8_scales(
                        kv_scale_convention::divide, kv_scale_granularity::per_tensor, kt, vlong),
                      logic_error);
    auto vnull = vt;
    vnull[2]   = nullptr;
    REQUIRE_THROWS_WITH(cache.set_fp8_scales(
                          kv_scale_convention::divide, kv_scale_granularity::per_tensor, kt, vnull),
                        Contains("null scale pointer for layer 2"));
    REQUIRE(cache.scale_granularity == kv_scale_granularity::none);
    REQUIRE(cache.scale(1, 1, true) == 1.0f);

    cache.set_fp8_scales(kv_scale_convention::multiply, kv_scale_granularity::per_tensor, kt, vt);
    REQUIRE(cache.scale_convention == kv_scale_convention::multiply);
    REQUIRE(cache.scale(2, 1, false) == 0.5f);
    REQUIRE(cache.scale(2, 1, true) == 0.25f);

    cache.set_fp8_scales(kv_scale_convention::divide, kv_scale_granularity::per_head, kh, vh);
    for (int l = 0; l < L; ++l) {
      for (int h = 0; h < H; ++h) {
        CAPTURE(l, h);
        REQUIRE(cache.scale(l, h, false) == per_head_k[l * H + h]);
        REQUIRE(cache.scale(l, h, true) == per_head_v[l * H + h]);
      }
    }
  }
}

TEST_CASE("slots from a block table: block_ids[p / BS] * BS + p % BS", "[cache]")
{
  std::int32_t const table[] = {5, 2, 7};
  SECTION("block size 4, prompt tokens 3 .. 8")
  {
    // p = 3: block 5 offset 3; p = 4..7: block 2; p = 8: block 7 offset 0.
    std::vector<std::int64_t> const expected{23, 8, 9, 10, 11, 28};
    REQUIRE(slots_from_block_table(table, 3, 4, 3, 6) == expected);
  }
  SECTION("block size 1 and odd sizes")
  {
    REQUIRE(slots_from_block_table(table, 3, 1, 0, 3) == (std::vector<std::int64_t>{5, 2, 7}));
    REQUIRE(slots_from_block_table(table, 3, 1, 2, 1) == (std::vector<std::int64_t>{7}));
    // block size 3: p = 1..7 -> 5*3+1, 5*3+2, 2*3+0, 7, 8, 7*3+0, 22
    REQUIRE(slots_from_block_table(table, 3, 3, 1, 7) ==
            (std::vector<std::int64_t>{16, 17, 6, 7, 8, 21, 22}));
    REQUIRE(slots_from_block_table(table, 3, 4, 5, 0).empty());
  }
  SECTION("a table shorter than the tokens is refused")
  {
    // 3 blocks of 4 cover tokens 0 .. 11.
    REQUIRE(slots_from_block_table(table, 3, 4, 0, 12).size() == 12);
    REQUIRE_THROWS_WITH(slots_from_block_table(table, 3, 4, 3, 10), Contains("the table has 3"));
    REQUIRE_THROWS_AS(slots_from_block_table(table, 3, 4, 12, 1), logic_error);
    REQUIRE_THROWS_AS(slots_from_block_table(table, 2, 4, 0, 9), logic_error);
  }
  SECTION("negative block ids, block sizes and starts are refused")
  {
    std::int32_t const bad[] = {1, -1};
    REQUIRE_THROWS_WITH(slots_from_block_table(bad, 2, 4, 0, 8), Contains("negative block id"));
    REQUIRE(slots_from_block_table(bad, 2, 4, 0, 4).size() == 4);
    REQUIRE_THROWS_AS(slots_from_block_table(table, 3, 0, 0, 1), logic_error);
    REQUIRE_THROWS_AS(slots_from_block_table(table, 3, 4, -1, 1), logic_error);
  }
}

TEST_CASE("index_divmod: the device's 32-bit division equals the 64-bit one wherever it is taken",
          "[cache][divmod]")
{
  std::vector<std::int64_t> const values{0,           1,           2,
                                         3,           7,           16,
                                         255,         4096,        65535,
                                         65536,       1000003,     0x7fffffff,
                                         0x80000000,  0xfffffffe,  0xffffffff,
                                         0x100000000, 0x100000001, 0x7fffffffffffffff,
                                         -1,          -16,         -0x80000000LL};
  std::mt19937_64 rng(11);
  std::vector<std::int64_t> samples = values;
  for (int i = 0; i < 600; ++i) {
    samples.push_back(static_cast<std::int64_t>(rng() >> (rng() % 64)));
  }
  std::size_t narrow = 0, wrong = 0;
  for (std::int64_t a : samples) {
    for (std::int64_t b : samples) {
      if (b == 0 || (a == INT64_MIN && b == -1)) { continue; }
      detail::index_quotient const wide = detail::index_divmod(a, b);  // the host's: 64-bit
      bool const fits = a >= 0 && b >= 0 && a <= 0xffffffffLL && b <= 0xffffffffLL;
      bool bad        = wide.quotient != a / b || wide.remainder != a % b ||
                 detail::index_divmod_narrow_ok(a, b) != fits;
      if (fits) {
        ++narrow;
        detail::index_quotient const d = detail::index_divmod_narrow(a, b);
        bad                            = bad || d.quotient != a / b || d.remainder != a % b;
      }
      if (bad && wrong++ == 0) { FAIL_CHECK("index_divmod(" << a << ", " << b << ") differs"); }
    }
  }
  CHECK(wrong == 0);
  CHECK(narrow > 50000);
}
