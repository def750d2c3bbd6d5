"""Encoding facts through vLLM itself: one forward over the text, pre-RoPE K/V captured by hooks
(capture.py), stored in a MemoryStore. The LLM must be made with
``worker_extension_cls="inferscale_vllm.capture.CaptureWorkerExtension"``."""

from __future__ import annotations

import os
import tempfile
import uuid

import numpy as np


def capture(llm, token_ids: list[int]) -> dict:
    """Pre-RoPE keys, values and the rotated keys vLLM wrote, of every token of `token_ids` run as
    one prompt from position 0: arrays ``[layers, tokens, kv_heads, head_dim]`` (float32; the
    whole model's heads, from tensor-parallel rank 0's view when TP = 1), and ``slots``, the
    cache slots vLLM wrote them to."""
    from vllm import SamplingParams

    llm.collective_rpc("inferscale_capture_begin")
    path = os.path.join(tempfile.mkdtemp(prefix="inferscale-capture-"), "kv.npz")
    try:
        # A unique salt: the prefix cache must not hand back blocks (the forward must run).
        llm.generate([{"prompt_token_ids": list(token_ids), "cache_salt": uuid.uuid4().hex}],
                     SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    finally:
        llm.collective_rpc("inferscale_capture_end", args=(path,))
    with np.load(path) as z:
        out = {k: z[k] for k in ("k", "v", "k_rotated", "slots")}
    os.remove(path)
    os.rmdir(os.path.dirname(path))
    n = len(token_ids)
    if out["k"].shape[1] != n:
        raise RuntimeError(f"inferscale: captured {out['k'].shape[1]} tokens for a prompt of {n}")
    return out


def extract_from_cache(llm, slots, first_position: int = 0) -> dict:
    """Capture by extraction: the pre-RoPE K/V of the tokens vLLM holds at `slots` (positions
    first_position ..) in its paged cache, de-rotated by InferScale's ``extract`` in the worker
    (no hook on the model: any model vLLM runs with rotary keys; TP = 1). Read it while those
    blocks still hold the tokens (e.g. right after the request that wrote them)."""
    path = os.path.join(tempfile.mkdtemp(prefix="inferscale-extract-"), "kv.npz")
    try:
        llm.collective_rpc("inferscale_extract", args=([int(s) for s in slots],
                                                       int(first_position), path))
        with np.load(path) as z:
            out = {k: z[k] for k in ("k", "v")}
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(os.path.dirname(path))
    return out


def model_description(llm) -> dict:
    """What a memory records of the model (the connector refuses a vLLM model that differs)."""
    mc = llm.llm_engine.model_config
    hf = mc.hf_config
    theta = getattr(hf, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return {"name": mc.model, "num_layers": hf.num_hidden_layers,
            "num_kv_heads": mc.get_total_num_kv_heads(), "head_dim": mc.get_head_size(),
            "rope_theta": float(theta), "dtype": str(mc.dtype)}


def add_fact(memory, llm, user: str, text: str, token_ids: list[int],
             context: list[int] | None = None, *, embed_text: str | None = None) -> int:
    """Encodes `token_ids` (behind `context`, e.g. the shared prefix, whose K/V are dropped) and
    stores them as a fact of `user`; a memory with retrieval also embeds `embed_text` (default:
    `text`)."""
    context = list(context or [])
    kv = capture(llm, context + list(token_ids))
    c = len(context)
    return memory.add_fact(user, text, token_ids, kv["k"][:, c:], kv["v"][:, c:],
                           embed_text=embed_text)


def set_prefix(memory, llm, text: str, token_ids: list[int]) -> int:
    kv = capture(llm, token_ids)
    return memory.set_prefix(text, token_ids, kv["k"], kv["v"])
