"""Pre-RoPE K/V capture inside vLLM's worker: a worker extension (``worker_extension_cls``) that
hooks every attention layer of the model for the forwards between ``inferscale_capture_begin`` and
``inferscale_capture_end``.

For a Llama-style vLLM model each layer's attention computes ``q, k = rotary_emb(positions, q, k)``
then ``attn(q, k, v)``: a forward pre-hook on ``rotary_emb`` sees the keys before rotation, one on
``attn`` the values. Both are cloned (vLLM's CPU rotary op may rotate in place). The captured rows
are concatenated over the forwards (chunked prefill), in token order.

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
        if attn is None or not hasattr(attn, "rotary_emb") or not hasattr(attn, "attn"):
            raise RuntimeError(
                f"inferscale_vllm.capture: layer {i} ({type(layer).__name__}) has no "
                "self_attn.rotary_emb / self_attn.attn: not a rotary attention layer")
        out.append((attn.rotary_emb, attn.attn))
    return out


class CaptureWorkerExtension:
    """Methods vLLM adds to its worker class (``worker_extension_cls``)."""

    def inferscale_capture_begin(self) -> int:
        model = self.model_runner.model
        modules = _attention_modules(model)
        self._inferscale_rows = [([], []) for _ in modules]
        self._inferscale_hooks = []
        for i, (rotary, attn) in enumerate(modules):
            keys, values = self._inferscale_rows[i]

            def on_rotary(_module, args, keys=keys):
                keys.append(args[2].detach().clone())

            def on_attn(_module, args, values=values):
                values.append(args[2].detach().clone())

            self._inferscale_hooks.append(rotary.register_forward_pre_hook(on_rotary))
            self._inferscale_hooks.append(attn.register_forward_pre_hook(on_attn))
        return len(modules)

    def inferscale_capture_end(self, path: str) -> tuple:
        import torch

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
        ks, vs = [], []
        for keys, values in rows:
            if not keys or not values:
                raise RuntimeError("inferscale_capture_end: no forward ran while capturing")
            k = torch.cat(keys, 0).float().reshape(-1, heads, head_dim)
            v = torch.cat(values, 0).float().reshape(-1, heads, head_dim)
            ks.append(k.numpy())
            vs.append(v.numpy())
        k = np.stack(ks)  # [layers, tokens, heads, head_dim]
        v = np.stack(vs)
        np.savez(path, k=k, v=v)
        return tuple(k.shape)
