"""What the engine tests of capture while serving share (test_capture_serving.py, test_machinery.py,
test_tp.py): a served capture, the hook capture of the same forward, and the checks that compare
them."""

import os
import shutil
import tempfile
import uuid

import numpy as np

from inferscale_vllm.serve_capture import read_capture

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
    return hook, read_capture(directory, capture_id, tp), cached


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


def check_served_against_hook(hook, served, ids, theta, label=""):
    """The served capture of one forward against its hook capture: token ids; values bit for bit;
    keys equal to a float64 de-rotation of the very keys vLLM wrote (so extract is the exact
    inverse, up to fp32 rounding), and within PAIR_BOUND of the pre-RoPE keys the hook saw.
    Returns a line to print."""
    assert served["token_ids"].tolist() == list(ids), f"{label}: token ids"
    assert served["k"].shape == hook["k"].shape, (label, served["k"].shape, hook["k"].shape)
    assert served["k"].dtype == np.float32 and served["v"].dtype == np.float32
    assert np.array_equal(served["v"], hook["v"]), f"{label}: values differ from the hook's"
    exact = inverse_rotation(hook["k_rotated"], vllm_table(theta, hook["k"].shape[-1], len(ids)))
    err64, norm64 = pair_error(served["k"].astype(np.float64), exact)
    worst_fp32 = float((err64 / np.maximum(norm64, 1e-30)).max())
    assert np.all(err64 <= 2.0 ** -20 * norm64 + 1e-12), (
        f"{label}: served keys are not the inverse of vLLM's rotated keys (worst pair "
        f"{worst_fp32:.2e} of its norm)")
    err, norm = pair_error(served["k"], hook["k"])
    worst = float((err / np.maximum(norm, 1e-30)).max())
    assert np.all(err <= PAIR_BOUND * norm + 1e-6), f"{label}: a key pair is off by {worst:.2e}"
    same = float(np.mean(served["k"].astype("float32") == hook["k"]))
    import torch

    as_bf16 = torch.from_numpy(served["k"]).bfloat16().float().numpy()
    bf16_same = float(np.mean(as_bf16 == hook["k"]))
    return (f"{label}: {len(ids)} tokens, values equal; keys: worst pair {worst:.2e} of its norm "
            f"(bound {PAIR_BOUND:.2e}), {bf16_same:.1%} of elements equal once rounded to bf16 "
            f"({same:.1%} as fp32); vs float64 inverse worst {worst_fp32:.1e}")
