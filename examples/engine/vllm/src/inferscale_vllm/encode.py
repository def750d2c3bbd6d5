"""Encoding facts through vLLM itself: one forward over the text, pre-RoPE K/V captured by hooks
(capture.py), stored in a Memory (memory.py). The LLM must be made with
``worker_extension_cls="inferscale_vllm.capture.CaptureWorkerExtension"``."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import numpy as np


def capture(llm, token_ids: list[int]) -> dict:
    """Pre-RoPE keys, values and the rotated keys vLLM wrote, of every token of `token_ids` run as
    one prompt from position 0: arrays ``[layers, tokens, kv_heads, head_dim]`` (float32; the
    whole model's heads: under tensor parallelism each rank's heads, put side by side in rank
    order, as that engine computed them), and ``slots``, the cache slots vLLM wrote them to.
    Pipeline parallelism is refused (each stage holds only its layers): encode with PP = 1."""
    from vllm import SamplingParams

    parallel = llm.llm_engine.vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"inferscale: capture needs every layer in one stage; this engine has "
                         f"pipeline_parallel_size = {parallel.pipeline_parallel_size}")
    llm.collective_rpc("inferscale_capture_begin")
    directory = tempfile.mkdtemp(prefix="inferscale-capture-")
    try:
        path = os.path.join(directory, "kv.npz")
        try:
            # A unique salt: the prefix cache must not hand back blocks (the forward must run).
            llm.generate([{"prompt_token_ids": list(token_ids), "cache_salt": uuid.uuid4().hex}],
                         SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        finally:
            written = llm.collective_rpc("inferscale_capture_end", args=(path,))
        ranks = sorted(written, key=lambda w: w[1])
        if [w[1] for w in ranks] != list(range(len(ranks))) or any(w[2] != len(ranks)
                                                                   for w in ranks):
            raise RuntimeError(f"inferscale: capture got files from ranks {written}")
        parts = []
        for file, _, _ in ranks:
            with np.load(file) as z:
                parts.append({k: z[k] for k in ("k", "v", "k_rotated", "slots")})
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = {k: np.concatenate([p[k] for p in parts], axis=2) for k in ("k", "v", "k_rotated")}
    if any(not np.array_equal(p["slots"], parts[0]["slots"]) for p in parts):
        raise RuntimeError("inferscale: the tensor-parallel ranks wrote different slots")
    out["slots"] = parts[0]["slots"]
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
    """What a memory records of the model (memory.describe_model: geometry, rotation, dtype and
    weights' digest; the connector refuses a vLLM model that differs)."""
    from .memory import describe_model

    return describe_model(llm.llm_engine.model_config)


def add_fact(memory, llm, user: str, text: str, token_ids: list[int],
             context: list[int] | None = None, *, embed_text: str | None = None) -> int:
    """Encodes `token_ids` (behind `context`, e.g. the shared prefix, whose K/V are dropped) and
    stores them as a fact of `user`; a memory with retrieval also embeds `embed_text` (default:
    `text`)."""
    context = list(context or [])
    kv = capture(llm, context + list(token_ids))
    return memory.add_fact(user, text, token_ids, kv["k"], kv["v"], context=context,
                           embed_text=embed_text)


def set_prefix(memory, llm, text: str, token_ids: list[int]) -> int:
    kv = capture(llm, token_ids)
    return memory.set_prefix(text, token_ids, kv["k"], kv["v"])
