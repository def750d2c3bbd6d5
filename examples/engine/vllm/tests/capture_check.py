"""What the engine tests of capture while serving share (test_capture_serving.py, test_machinery.py,
test_tp.py): a served capture, the hook capture of the same forward, and the checks that compare
them."""

import os
import shutil
import tempfile
import uuid

import numpy as np

from inferscale_vllm.serve_capture import capture_path, read_capture

# A de-rotated key pair against the pre-RoPE pair the hook saw, relative to its norm: vLLM's cache
# holds its rotation rounded to bf16 (within 2^-7 of each pair's norm, whether its kernel truncates
# or rounds each operation), and extract's inverse is exact up to fp32 rounding
# (test_rotary_capture.py, PAIR_BOUND, says why).
PAIR_BOUND = 2.0 ** -7 * 1.01


def capture_params(capture_id):
    return {"kv_transfer_params": {"inferscale_capture": {"id": capture_id}}}


def generate(llm, ids, extra_args=None, salt=None, max_tokens=1):
    from vllm import SamplingParams

    prompt = {"prompt_token_ids": list(ids), "cache_salt": salt or uuid.uuid4().hex}
    out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                extra_args=extra_args), use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


def hook_and_served(llm, ids, directory, capture_id, tp=1, salt=None):
    """One forward of `ids` (a fresh salt unless given) that is both captured by the hooks
    (capture.py: pre-RoPE k, v and the rotated keys vLLM wrote, every rank's heads side by side)
    and served with kv_transfer_params.inferscale_capture; returns (hook, served, cached tokens)."""
    llm.collective_rpc("inferscale_capture_begin")
    folder = tempfile.mkdtemp(prefix="inferscale-hook-")
    try:
        path = os.path.join(folder, "kv.npz")
        try:
            _, cached = generate(llm, ids, capture_params(capture_id), salt)
        finally:
            written = llm.collective_rpc("inferscale_capture_end", args=(path,))
        parts = []
        for file, _, _ in sorted(written, key=lambda w: w[1]):
            with np.load(file) as z:
                parts.append({k: z[k] for k in ("k", "v", "k_rotated")})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    hook = {k: np.concatenate([p[k] for p in parts], axis=2) for k in ("k", "v", "k_rotated")}
    # what the worker wrote in the step, before the reader's de-rotation and ExactKeys: the cached
    # bytes of every rank's heads (bf16 bit patterns, widened here by a shift)
    files = [capture_path(directory, capture_id, r) for r in range(tp)]
    cached_kv = {}
    for name in ("k_cached", "v_cached"):
        arrays = []
        for f in files:
            with np.load(f, allow_pickle=False) as z:
                assert str(z["cache_dtype"]) == "bfloat16", f
                arrays.append((z[name].astype(np.uint32) << 16).view(np.float32))
        cached_kv[name] = np.concatenate(arrays, axis=2)
    served = read_capture(directory, capture_id, tp)
    served.update(cached_kv)
    return hook, served, cached


def pair_error(got, want):
    """Per NeoX pair (i, i + D/2): the 2-norm of got - want, and of want."""
    half = want.shape[-1] // 2
    d = got - want
    err = np.sqrt(d[..., :half] ** 2 + d[..., half:] ** 2)
    norm = np.sqrt(want[..., :half] ** 2 + want[..., half:] ** 2)
    return err, norm


def vllm_table(theta, head_dim, rows):
    """The cos/sin table vLLM's RotaryEmbedding holds for a bf16 model (fp32 angles t * inv_freq,
    cos and sin in fp32, then bf16), as float64."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(rows, dtype=torch.float), inv)
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16)
    return table.double().numpy()


def inverse_rotation(k_rotated, table):
    """float64 de-rotation of NeoX-paired keys [layers, tokens, heads, D] at positions 0.. with
    `table` rows: x = (x' c + y' s) / (c^2 + s^2), y = (y' c - x' s) / (c^2 + s^2)."""
    n, half = k_rotated.shape[1], k_rotated.shape[-1] // 2
    c = table[:n, :half][None, :, None, :]
    s = table[:n, half:][None, :, None, :]
    x, y = k_rotated[..., :half].astype(np.float64), k_rotated[..., half:].astype(np.float64)
    norm2 = c * c + s * s
    return np.concatenate([(x * c + y * s) / norm2, (y * c - x * s) / norm2], axis=-1)


def vllm_rotation(llm):
    """The engine's rotation as the connector matches it (rotation_matching_vllm on the model's
    rotary module): a function from pre-RoPE keys [layers, tokens, heads, head_dim] at positions
    0 .. to the bf16 keys (as float32) it writes — through the library's injection, which that
    match proved equal to vLLM's rotary kernel bit for bit."""
    import torch
    from types import SimpleNamespace
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from inferscale_vllm.connector import rotation_matching_vllm
    from inferscale_vllm.serve_capture import ExactKeys

    mc = llm.llm_engine.model_config
    hf = mc.hf_config
    params = getattr(hf, "rope_parameters", None) or {"rope_type": "default",
                                                      "rope_theta": hf.rope_theta}
    head = mc.get_head_size()
    with set_current_vllm_config(llm.llm_engine.vllm_config):
        rope = get_rope(head, max_position=hf.max_position_embeddings, is_neox_style=True,
                        rope_parameters=params, dtype=torch.bfloat16)
        rotation, table, mode = rotation_matching_vllm(rope, torch.bfloat16, head)

    def rotate(k):
        geometry = SimpleNamespace(num_layers=k.shape[0], num_heads=k.shape[2], head_dim=head,
                                   block_size=128)
        fixer = ExactKeys(rotation, mode, geometry, "vec", table, True)
        return fixer.forward(k)

    rotate.keep = (rope, table, rotation)  # the rotation reads the table's memory
    return rotate


def check_served_against_hook(hook, served, ids, rotate, label=""):
    """The served capture of one forward against its hook capture: token ids; the step's file
    holds the keys and values vLLM cached, bit for bit (where `served` carries them); values bit
    for bit;
    keys bf16 values that the engine's rotation (`rotate`, vllm_rotation) maps to exactly the
    keys vLLM wrote (ExactKeys), and within 2 x PAIR_BOUND of the pre-RoPE keys the hook saw.
    Returns a line to print."""
    assert served["token_ids"].tolist() == list(ids), f"{label}: token ids"
    if "k_cached" in served:  # the step's file: the bytes vLLM wrote, as the hook saw them
        assert np.array_equal(served["k_cached"], hook["k_rotated"]), f"{label}: cached keys"
        assert np.array_equal(served["v_cached"], hook["v"]), f"{label}: cached values"
    assert served["unmatched"] == 0, f"{label}: ExactKeys left {served['unmatched']} pairs"
    assert served["k"].shape == hook["k"].shape, (label, served["k"].shape, hook["k"].shape)
    assert served["k"].dtype == np.float32 and served["v"].dtype == np.float32
    assert np.array_equal(served["v"], hook["v"]), f"{label}: values differ from the hook's"
    import torch

    as_bf16 = torch.from_numpy(served["k"]).bfloat16().float().numpy()
    assert np.array_equal(as_bf16, served["k"]), f"{label}: served keys are not bf16 values"
    rotated = rotate(served["k"])
    differ = int((rotated != hook["k_rotated"]).sum())
    assert differ == 0, f"{label}: {differ} rotated served keys differ from the bytes vLLM wrote"
    err, norm = pair_error(served["k"], hook["k"])
    worst = float((err / np.maximum(norm, 1e-30)).max())
    assert np.all(err <= 2 * PAIR_BOUND * norm + 1e-6), f"{label}: a key pair is off by {worst:.2e}"
    same = float(np.mean(served["k"] == hook["k"]))
    return (f"{label}: {len(ids)} tokens, values equal; keys rotate back to vLLM's bytes exactly; "
            f"{same:.1%} of them equal the hook's pre-RoPE keys, worst pair {worst:.2e} of its "
            f"norm (bound {2 * PAIR_BOUND:.2e})")
