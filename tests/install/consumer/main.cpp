// Uses the installed headers the way a downstream engine would, and checks the byte accounting
// against the formula written out here (2 * layers * kv_heads * head_dim * bytes per element).
#include <inferscale/config.hpp>
#include <inferscale/dtype.hpp>
#include <inferscale/geometry.hpp>

#include <cstdint>
#include <cstdio>

static_assert(INFERSCALE_VERSION_MAJOR == 0, "unexpected InferScale major version");

int main()
{
  int failures = 0;
  auto expect  = [&](bool ok, char const* what) {
    if (!ok) {
      std::fprintf(stderr, "FAILED: %s\n", what);
      ++failures;
    }
  };

  // Llama-3-8B-like geometry: 32 layers, 8 KV heads, head dim 128.
  inferscale::kv_geometry const g{32, 8, 128};
  g.validate();
  expect(g.bytes_per_token(inferscale::dtype::bfloat16) == 2LL * 32 * 8 * 128 * 2,
         "bf16 bytes per token == 2*L*h*d*2 (131072)");
  expect(g.bytes_per_token(inferscale::dtype::float32) == 2LL * 32 * 8 * 128 * 4,
         "fp32 bytes per token == 2*L*h*d*4");
  expect(g.bytes_per_token(inferscale::dtype::float8_e4m3) == 2LL * 32 * 8 * 128 * 1,
         "fp8 bytes per token == 2*L*h*d*1");
  expect(g.bytes(1000, inferscale::dtype::float16) == 1000LL * 2 * 32 * 8 * 128 * 2,
         "fp16 bytes of 1000 tokens");

  bool threw = false;
  try {
    (void)g.bytes(-1, inferscale::dtype::float16);
  } catch (inferscale::logic_error const&) {
    threw = true;
  }
  expect(threw, "a negative token count throws inferscale::logic_error");

  // bf16 round trip through the host conversion routines: 1.5 is exact in bf16 (0x3FC0).
  auto const h = inferscale::from_float<inferscale::bfloat16_t>(1.5f);
  expect(h.bits == 0x3FC0, "from_float<bfloat16_t>(1.5f) has bits 0x3FC0");
  expect(inferscale::to_float(h) == 1.5f, "to_float(bfloat16 1.5) == 1.5f");

  if (failures != 0) { return 1; }
  std::printf("inferscale consumer: OK (bf16 bytes per token = %lld)\n",
              static_cast<long long>(g.bytes_per_token(inferscale::dtype::bfloat16)));
  return 0;
}
