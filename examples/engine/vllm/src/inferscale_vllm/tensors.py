"""torch tensors as the extension's (data pointer, shape, strides, dtype) arguments."""

from __future__ import annotations

from . import _inferscale


def as_tensor_arg(t) -> "_inferscale.Tensor":
    """A CPU torch tensor as an extension Tensor (no copy; the caller keeps `t` alive)."""
    if t.device.type != "cpu":
        raise ValueError(f"inferscale_vllm: expected a CPU tensor, got one on {t.device}")
    return _inferscale.Tensor(t.data_ptr(), list(t.shape), list(t.stride()), str(t.dtype))


def vllm_cpu_cache(kv_caches: dict, layer_names: list[str]) -> "_inferscale.VllmCpuCache":
    """The descriptor of vLLM's CPU paged cache from `register_kv_caches`' tensors, in layer order.

    Every layer's tensor must have one shape, strides and dtype:
    `[num_blocks, num_kv_heads, block_size, 2 * head_size]`.
    """
    tensors = [kv_caches[n] for n in layer_names]
    first = tensors[0]
    for n, t in zip(layer_names, tensors):
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise ValueError(
                f"inferscale_vllm: layer {n} has shape {tuple(t.shape)} / strides {t.stride()} / "
                f"{t.dtype}, layer {layer_names[0]} {tuple(first.shape)} / {first.stride()} / "
                f"{first.dtype}: one descriptor needs one layout")
        if t.device.type != "cpu":
            raise ValueError(f"inferscale_vllm: layer {n} is on {t.device}; this is the CPU path")
    return _inferscale.VllmCpuCache([t.data_ptr() for t in tensors], list(first.shape),
                                    list(first.stride()), str(first.dtype))
