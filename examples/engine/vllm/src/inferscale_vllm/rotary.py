"""The rotation of the model vLLM built, read from the model itself (issue 48, item 2).

The connector's two directions both need the rotation vLLM applies to the keys before it writes
them to its cache: injection rotates stored pre-RoPE keys with it, capture undoes it. Nothing of it
is assumed: the worker finds the model vLLM loaded (the model runner that registers the KV
caches), the rotary module beside each of its attention layers, and reads from that module the
pairing (``is_neox_style``: NeoX halves or GPT-J interleaved pairs), the rotary dims
(``rotary_dim``: partial rotary leaves the rest of each head unrotated) and the table
(``cos_sin_cache``: any scaling vLLM computes into it — linear, dynamic NTK, Llama 3, YaRN with
its attention factor, Gemma's proportional frequencies — is in its rows). The library's Rotation
is exactly that: row p of the table rotates the pairs of the first rotary_dim dims of a key at
position p. ``model_rotary`` refuses, with the reason, a model whose rotation is not that:

- a rotary module whose class computes its rotation in a forward of its own instead of vLLM's
  ``RotaryEmbedding`` one (LongRoPE, whose table switches with the sequence's length; multimodal
  M-RoPE with 3-D positions; dual-chunk attention; DeepSeek's and Fourier variants): the library
  cannot be shown to reproduce it;
- layers with different rotations (e.g. Gemma 3's local and global layers): the binding holds
  one table for every layer;
- an attention layer with no rotary module beside it (no rotary keys to undo or apply).

The rounding of the rotation (vLLM's kernel on this machine) is then found by running the model's
own module (``connector.rotation_matching_vllm``), which also checks the whole rotation bit for
bit on random keys at random positions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# The methods through which vLLM's RotaryEmbedding rotates: a subclass that keeps all of them
# rotates with its table row per position, whatever its table holds.
_FORWARD_METHODS = ("forward", "forward_native", "forward_static", "forward_cpu", "forward_cuda",
                    "forward_hip", "forward_xpu")


@dataclass
class ModelRotary:
    module: object  # the model's rotary module (shared by every layer)
    neox: bool
    rotary_dim: int
    head_size: int
    description: str


def find_model_runner(max_depth: int = 12):
    """The vLLM model runner that is calling us (``register_kv_caches`` is called by the runner's
    ``initialize_kv_cache``, vllm/v1/worker/gpu_model_runner.py, which the CPU runner inherits), or
    None."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, GPUModelRunner):
            return obj
        frame = frame.f_back
    return None


def _parents_of_attention(model, layer_names):
    """{layer name: the module holding that attention layer (its `layer_name`) as a child}."""
    found = {}
    wanted = set(layer_names)
    for parent in model.modules():
        for child in parent.children():
            name = getattr(child, "layer_name", None)
            if name in wanted and name not in found:
                found[name] = parent
    return found


def _rotary_children(parent):
    """The rotary modules among `parent`'s children (a cos/sin table, or a rotary class)."""
    out = []
    for child in parent.children():
        cls = type(child).__name__
        if hasattr(child, "cos_sin_cache") or "Rotary" in cls or "RoPE" in cls:
            out.append(child)
    return out


def check_rotary_module(module, where: str = "") -> str | None:
    """None when `module` rotates as vLLM's RotaryEmbedding does (a table row per position), else
    the reason it cannot be reproduced."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    cls = type(module)
    if not isinstance(module, RotaryEmbedding):
        return (f"its rotary module {cls.__name__}{where} is not vLLM's RotaryEmbedding (a "
                f"cos/sin table row per position): the library's Rotation cannot reproduce it "
                f"(LongRoPE switches tables with the sequence length, M-RoPE takes 3-D "
                f"positions, dual-chunk attention rotates per chunk)")
    overridden = [m for m in _FORWARD_METHODS
                  if getattr(cls, m, None) is not getattr(RotaryEmbedding, m, None)]
    if overridden:
        return (f"its rotary module {cls.__name__}{where} rotates in its own "
                f"{', '.join(overridden)}, not with RotaryEmbedding's table row per position: "
                f"the library's Rotation is not known to reproduce it")
    table = getattr(module, "cos_sin_cache", None)
    if table is None or table.dim() != 2:
        return f"its rotary module {cls.__name__}{where} has no 2-D cos_sin_cache"
    rotary_dim, head_size = int(module.rotary_dim), int(module.head_size)
    if table.shape[1] != rotary_dim or rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        return (f"its rotary module {cls.__name__}{where} has rotary_dim {rotary_dim} of head "
                f"size {head_size} and a cos_sin_cache of {table.shape[1]} columns (expected "
                f"rotary_dim, even, at most the head size)")
    return None


def _same_rotation(a, b) -> bool:
    import torch

    if a is b:
        return True
    return (type(a) is type(b) and bool(a.is_neox_style) == bool(b.is_neox_style)
            and int(a.rotary_dim) == int(b.rotary_dim) and int(a.head_size) == int(b.head_size)
            and a.cos_sin_cache.shape == b.cos_sin_cache.shape
            and torch.equal(a.cos_sin_cache.float().cpu(), b.cos_sin_cache.float().cpu()))


def model_rotary(model, layer_names, head_size: int, hf_config=None) -> ModelRotary:
    """The one rotation of the attention layers `layer_names` of `model` (vLLM's nn.Module), read
    from their rotary modules. Raises ValueError with the reason for a rotation the library cannot
    reproduce."""
    parents = _parents_of_attention(model, layer_names)
    missing = [n for n in layer_names if n not in parents]
    if missing:
        raise ValueError(f"inferscale: the model {type(model).__name__} has no attention module "
                         f"named {missing[0]!r} (of the KV caches vLLM registered)")
    modules = []
    for name in layer_names:
        rotary = _rotary_children(parents[name])
        if len(rotary) != 1:
            raise ValueError(
                f"inferscale: the attention of layer {name!r} has "
                f"{'no rotary module' if not rotary else f'{len(rotary)} rotary modules'} beside "
                f"it ({type(parents[name]).__name__}): InferScale needs one rotary embedding "
                f"per attention layer (a model without rotary positions cannot be served)")
        reason = check_rotary_module(rotary[0], f" (layer {name!r})")
        if reason:
            raise ValueError(f"inferscale: this model's rotation cannot be reproduced: {reason}")
        modules.append((name, rotary[0]))
    first_name, first = modules[0]
    for name, m in modules[1:]:
        if not _same_rotation(first, m):
            raise ValueError(
                f"inferscale: this model's rotation cannot be reproduced: layers {first_name!r} "
                f"and {name!r} rotate differently ({type(first).__name__}, rotary_dim "
                f"{first.rotary_dim}, {tuple(first.cos_sin_cache.shape)} table vs "
                f"{type(m).__name__}, {m.rotary_dim}, {tuple(m.cos_sin_cache.shape)}): the "
                f"connector holds one rotation for every layer")
    if int(first.head_size) != head_size:
        raise ValueError(f"inferscale: the rotary module's head size is {first.head_size}, the "
                         f"model's {head_size}")
    params = {}
    if hf_config is not None:
        params = (getattr(hf_config, "rope_parameters", None)
                  or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    description = (f"{type(first).__name__} (rope_type {rope_type!r}), "
                   f"{'NeoX halves' if first.is_neox_style else 'GPT-J interleaved'} pairing, "
                   f"rotary_dim {first.rotary_dim} of {first.head_size}, table "
                   f"{tuple(first.cos_sin_cache.shape)} {first.cos_sin_cache.dtype}")
    return ModelRotary(first, bool(first.is_neox_style), int(first.rotary_dim),
                       int(first.head_size), description)
