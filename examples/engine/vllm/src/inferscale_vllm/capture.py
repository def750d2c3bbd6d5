"""Pre-RoPE K/V capture inside vLLM's worker: a worker extension (``worker_extension_cls``) that
hooks every attention layer of the model for the forwards between ``inferscale_capture_begin`` and
``inferscale_capture_end``.

For a Llama-style vLLM model each layer's attention computes ``qkv = qkv_proj(h)``, splits it into
q, k, v, rotates ``q, k = rotary_emb(positions, q, k)`` and calls ``attn(q, k, v)``. A forward hook
on the layer's own ``qkv_proj`` takes k (before rotation) and v from its output; a pre-hook on its
``attn`` takes the rotated keys the cache write receives. (``rotary_emb`` itself cannot be hooked
per layer: vLLM shares one rotary module between layers of equal shape.) Everything is cloned (the
CPU rotary op rotates in place); rows are concatenated over the forwards (chunked prefill).

Use (offline, one capture request in flight):
    llm = LLM(..., worker_extension_cls="inferscale_vllm.capture.CaptureWorkerExtension")
    llm.collective_rpc("inferscale_capture_begin")
    llm.generate({"prompt_token_ids": ids, "cache_salt": unique}, SamplingParams(max_tokens=1))
    llm.collective_rpc("inferscale_capture_end", args=(path,))   # writes path (npz): k, v
"""

from __future__ import annotations

import numpy as np


def _attention_modules(model):
    """(rotary_emb, attn) of every decoder layer, in layer order."""
    layers = None
    for path in ("model.layers", "language_model.model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        layers = obj
        break
    if layers is None:
        raise RuntimeError(
            f"inferscale_vllm.capture: {type(model).__name__} has no model.layers; capture by hook "
            "supports Llama-style decoders (use extraction from the cache instead)")
    out = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, a) for a in
                                   ("rotary_emb", "attn", "qkv_proj", "q_size", "kv_size")):
            raise RuntimeError(
                f"inferscale_vllm.capture: layer {i} ({type(layer).__name__}) has no "
                "self_attn.qkv_proj / rotary_emb / attn: not a Llama-style rotary attention layer")
        out.append(attn)
    return out


class CaptureWorkerExtension:
    """Methods vLLM adds to its worker class (``worker_extension_cls``)."""

    def inferscale_token_classes(self):
        """This worker's connector's token classes (token_classes.py, as measured at start-up:
        TokenClasses.to_list()), or None (not measured, or no InferScale connector)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return None
        classes = getattr(get_kv_transfer_group(), "_worker_classes", None)
        return None if classes is None else classes.to_list()

    def inferscale_capture_begin(self) -> int:
        model = self.model_runner.model
        modules = _attention_modules(model)
        self._inferscale_rows = [([], [], []) for _ in modules]
        self._inferscale_slots = []
        self._inferscale_hooks = []
        for i, attn in enumerate(modules):
            keys, values, rotated = self._inferscale_rows[i]
            q, kv = attn.q_size, attn.kv_size

            def on_qkv(_module, _args, output, keys=keys, values=values, q=q, kv=kv):
                qkv = output[0] if isinstance(output, tuple) else output
                keys.append(qkv[..., q:q + kv].detach().clone())
                values.append(qkv[..., q + kv:q + 2 * kv].detach().clone())

            def on_attn(module, args, rotated=rotated, first=(i == 0)):
                rotated.append(args[1].detach().clone())  # what the cache write receives
                if first:  # the slots vLLM writes this forward's tokens to (one layer tells)
                    self._inferscale_slots.append(_slots_of(module))

            self._inferscale_hooks.append(attn.qkv_proj.register_forward_hook(on_qkv))
            self._inferscale_hooks.append(attn.attn.register_forward_pre_hook(on_attn))
        return len(modules)

    def inferscale_capture_end(self, path: str) -> tuple:
        """Writes this rank's rows to ``path`` (TP = 1) or ``path.tp<rank>.npz`` (its KV heads,
        ``[rank * h, (rank + 1) * h)``, under tensor parallelism); returns (the file, rank, TP)."""
        import torch
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)

        for h in getattr(self, "_inferscale_hooks", []):
            h.remove()
        self._inferscale_hooks = []
        rows = getattr(self, "_inferscale_rows", None)
        if not rows:
            raise RuntimeError("inferscale_capture_end without inferscale_capture_begin")
        self._inferscale_rows = None
        config = self.model_runner.model_config
        heads = config.get_num_kv_heads(self.model_runner.parallel_config)
        head_dim = config.get_head_size()
        ks, vs, rs = [], [], []
        for keys, values, rotated in rows:
            if not keys or not values:
                raise RuntimeError("inferscale_capture_end: no forward ran while capturing")
            ks.append(torch.cat(keys, 0).float().reshape(-1, heads, head_dim).numpy())
            vs.append(torch.cat(values, 0).float().reshape(-1, heads, head_dim).numpy())
            rs.append(torch.cat(rotated, 0).float().reshape(-1, heads, head_dim).numpy())
        slots = torch.cat(self._inferscale_slots).numpy().astype(np.int64)
        self._inferscale_slots = []
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if tp > 1:
            path = f"{path}.tp{rank}.npz"
        # [layers, tokens, heads, head_dim] each, float32 (exact for a bf16 model); slots [tokens]
        np.savez(path, k=np.stack(ks), v=np.stack(vs), k_rotated=np.stack(rs), slots=slots,
                 dtype=str(keys[0].dtype))
        return path, rank, tp

    def inferscale_extract(self, slots: list, first_position: int, path: str) -> tuple:
        """Capture by extraction: reads the tokens at `slots` (positions first_position ..) back
        from vLLM's paged cache on this rank, de-rotates the keys with the model's own rotary
        table (fp32, the exact inverse up to rounding), and writes ``k``, ``v`` (float32,
        ``[layers, tokens, heads, head_dim]``) to `path` (npz)."""
        import torch

        from . import _inferscale
        from .tensors import vllm_cpu_cache, vllm_cpu_isa

        modules = _attention_modules(self.model_runner.model)
        caches = {a.attn.layer_name: c for a, c in zip(modules, self.model_runner.kv_caches)}
        names = [a.attn.layer_name for a in modules]
        first = caches[names[0]]
        # read in the layout vLLM's kernels wrote (its ISA for the cache's dtype)
        cache = vllm_cpu_cache(caches, names, vllm_cpu_isa(first.dtype, first))
        rope = modules[0].rotary_emb
        table = rope.cos_sin_cache.float().contiguous()
        dim = cache.head_dim
        rotation = _inferscale.Rotation(table, dim, bool(rope.is_neox_style), False, False)
        n = len(slots)
        store = _inferscale.Store(cache.num_layers, cache.num_heads, dim, "float32",
                                  (n + 15) // 16 + 1)
        _inferscale.extract(store, cache, rotation, [int(s) for s in slots], int(first_position),
                            1, 0, list(range(n)))
        k = torch.empty(cache.num_layers, n, cache.num_heads, dim)
        v = torch.empty_like(k)
        store.read(1, k, v)
        np.savez(path, k=k.numpy(), v=v.numpy())
        return tuple(k.shape)


def _slots_of(attn) -> "torch.Tensor":
    """The slot mapping of the running forward for vLLM attention layer `attn` (CPU backend)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        metadata = metadata[0]
    m = metadata[attn.layer_name]
    return m.slot_mapping[: m.num_actual_tokens].detach().clone()
