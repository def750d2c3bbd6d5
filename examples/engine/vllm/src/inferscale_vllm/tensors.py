"""vLLM's paged KV cache tensors as the extension's cache descriptors (the tensors themselves
cross as DLPack arrays: the descriptor holds them, no address is passed)."""

from __future__ import annotations

from . import _inferscale


def vllm_cpu_cache(kv_caches: dict, layer_names: list[str],
                   isa: str = "vec") -> "_inferscale.VllmCpuCache":
    """The descriptor of vLLM's CPU paged cache from `register_kv_caches`' tensors, in layer order.

    Every layer's tensor must have one shape, strides and dtype:
    `[num_blocks, num_kv_heads, block_size, 2 * head_size]`. `isa`: the kernels vLLM's CPU
    attention uses for these layers (`vllm_cpu_isa`), which decide how each cell is laid out.
    """
    tensors, first = _one_layout(kv_caches, layer_names)
    if first.device.type != "cpu":
        raise ValueError(f"inferscale_vllm: layer {layer_names[0]} is on {first.device}; this is "
                         f"the CPU path")
    return _inferscale.VllmCpuCache(tensors, isa)


def vllm_cpu_isa(model_dtype, cache_tensor, kv_cache_dtype: str = "auto") -> str:
    """The kernels ("ISA") vLLM's CPU attention picks for a layer whose cache is `cache_tensor`
    (`[num_blocks, num_kv_heads, block_size, 2 * head_size]`), asked of vLLM itself
    (`cpu_attn._get_attn_isa`, what its metadata builder sets on the layers): "amx" for bfloat16 on
    a CPU with AMX tiles, "vec" on other x86 CPUs, "vec16" for head sizes not a multiple of 32, ...
    Only "vec" and "amx" are described by the library (`make_vllm_cpu_cache`); a ValueError names
    any other, before anything is injected."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block_size, head_size = int(cache_tensor.shape[2]), int(cache_tensor.shape[3]) // 2
    isa = _get_attn_isa(model_dtype, block_size, head_size, kv_cache_dtype)
    if isa not in ("vec", "amx"):
        raise ValueError(
            f"inferscale: vLLM's CPU attention uses its '{isa}' kernels here (dtype {model_dtype}, "
            f"block size {block_size}, head size {head_size}), whose cache layout InferScaleConnector "
            f"does not describe (supported: 'vec', 'amx')")
    return isa


def _one_layout(kv_caches: dict, layer_names: list[str]):
    tensors = [kv_caches[n] for n in layer_names]
    if not tensors:
        raise ValueError("inferscale_vllm: no KV cache layers were registered")
    first = tensors[0]
    for n, t in zip(layer_names, tensors):
        if (t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
                or t.device != first.device):
            raise ValueError(
                f"inferscale_vllm: layer {n} has shape {tuple(t.shape)} / strides {t.stride()} / "
                f"{t.dtype} / {t.device}, layer {layer_names[0]} {tuple(first.shape)} / "
                f"{first.stride()} / {first.dtype} / {first.device}: one descriptor needs one "
                f"layout")
    return tensors, first


def vllm_gpu_cache(kv_caches: dict, layer_names: list[str]) -> "_inferscale.VllmFlashAttnCache":
    """The descriptor of vLLM's GPU paged cache from `register_kv_caches`' CUDA tensors, in layer
    order (the device path; needs the extension built with INFERSCALE_VLLM_CUDA=ON).

    Every layer's tensor must have one shape, strides, dtype and device, either vLLM 0.32's
    `(num_blocks, num_kv_heads, block_size, 2 * head_size)` (K = `[..., :head_size]`, V the rest;
    any strides, e.g. the NHD memory order) or earlier FlashAttention's
    `(2, num_blocks, block_size, num_kv_heads, head_size)`.
    """
    if not getattr(_inferscale, "HAS_CUDA", False):
        raise ValueError("inferscale_vllm: vLLM's KV caches are CUDA tensors but this extension was "
                         "built without CUDA; rebuild it with the CMake option "
                         "INFERSCALE_VLLM_CUDA=ON (pip: -C cmake.define.INFERSCALE_VLLM_CUDA=ON)")
    tensors, first = _one_layout(kv_caches, layer_names)
    if first.device.type != "cuda":
        raise ValueError(f"inferscale_vllm: layer {layer_names[0]} is on {first.device}; this is "
                         f"the GPU path")
    return _inferscale.VllmFlashAttnCache(tensors)


def kv_cache_descriptor(kv_caches: dict, layer_names: list[str], model_dtype=None,
                        kv_cache_dtype: str = "auto"):
    """(on_device, descriptor): the device path's VllmFlashAttnCache when vLLM's caches are CUDA
    tensors, else the host path's VllmCpuCache in the layout of the ISA vLLM picks for the model's
    dtype (`vllm_cpu_isa`; the caches' dtype when `model_dtype` is None)."""
    _, first = _one_layout(kv_caches, layer_names)
    if first.device.type == "cuda":
        return True, vllm_gpu_cache(kv_caches, layer_names)
    isa = vllm_cpu_isa(model_dtype if model_dtype is not None else first.dtype, first,
                       kv_cache_dtype)
    return False, vllm_cpu_cache(kv_caches, layer_names, isa)
