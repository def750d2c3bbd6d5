// The rotation and injection kernels, instantiated for tests/headers/fast_math_ptx.cmake, which
// compiles this file to PTX twice (with and without --use_fast_math) and compares the two.
#include <inferscale/inject.cuh>
#include <inferscale/rope.cuh>

using namespace inferscale;

void fast_math_rope(token_head_view<bfloat16_t> keys,
                    token_head_view<float> fp32_keys,
                    std::int64_t const* positions,
                    rope_params const& params,
                    rope_cos_sin_table<bfloat16_t> const& table,
                    cuda::stream_ref stream)
{
  rope_apply_async(keys, positions, 1, params, rope_op::forward, stream);
  rope_apply_async(keys, positions, 1, params, rope_op::inverse, stream);
  rope_apply_async(fp32_keys, positions, 1, table, rope_op::shift, stream);
  rope_apply_async(fp32_keys, positions, 1, table, rope_op::inverse, stream);
}

void fast_math_inject(kv_store_ref const& store,
                      injection_batch_view const& batch,
                      paged_kv_cache const& cache,
                      rope_params const& params,
                      rope_cos_sin_table<float> const& table,
                      cuda::stream_ref stream)
{
  // every store x cache dtype, fp8 scales
  detail::inject_view_async(store, batch, cache, params, nullptr, stream);
  detail::inject_view_async(store, batch, cache, table, nullptr, stream);
}
