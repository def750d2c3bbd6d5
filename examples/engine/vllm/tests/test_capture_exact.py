"""Captured keys that re-inject vLLM's own bytes (serve_capture.ExactKeys), no engine: vLLM's rotary module and cache op write random bf16 keys (test_rotary_capture's caches),
the capture reads them back de-rotated, and the library's injection (with the rounding that
reproduces vLLM's rotary kernel here) writes the captured float32 keys at the same positions into
a cache whose slots were overwritten first: every byte must be vLLM's again. The plain
de-rotation, injected the same way, is checked too: with vLLM's truncating kernel it does not give
every byte back (what the pre-image is for), and the pre-image stays within one bf16 rounding of
the true pre-RoPE keys."""

import numpy as np
import pytest
import torch
from test_rotary_capture import DIM, HEADS, LAYERS, PAIR_BOUND, filled_caches, pair_errors, rope_of

from inferscale_vllm import _inferscale
from inferscale_vllm.connector import rotation_matching_vllm
from inferscale_vllm.serve_capture import CaptureJob, CaptureWriter, ExactKeys
from inferscale_vllm.tensors import vllm_cpu_cache


def inject_keys(caches, names, isa, rotation, k, v, slots):
    """The library's host injection of (k, v) (float32 [layers, n, heads, dim]) at positions
    0 .. n-1 into `slots` of the caches (vLLM's CPU layout)."""
    n = k.shape[1]
    # a bf16 store, as the memory holds this model's keys (its rotation rounds as vLLM's does)
    store = _inferscale.Store(LAYERS, HEADS, DIM, "bfloat16", (n + 15) // 16, 16)
    kc, vc = np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32)
    store.insert(7, 0, list(range(n)),
                 kc,
                 vc)
    _inferscale.inject(store, vllm_cpu_cache(caches, names, isa), rotation, [([7], 0, slots)])


@pytest.mark.parametrize("kind", ["neox", "gptj", "partial"])
def test_captured_keys_give_vllms_bytes_back(kind, tmp_path):
    params = {"neox": dict(neox=True), "gptj": dict(neox=False),
              "partial": dict(neox=True, partial_rotary_factor=0.5)}[kind]
    rope = rope_of(**params)
    n = 200
    caches, names, slots, k, v, isa = filled_caches(rope, n)
    rotation, table, mode = rotation_matching_vllm(rope, torch.bfloat16, DIM)
    job = CaptureJob("req", f"exact-{kind}", list(range(n)), slots)
    cache = vllm_cpu_cache(caches, names, isa)
    fixer = ExactKeys(rotation, mode, cache, isa, rope.cos_sin_cache, rope.is_neox_style)
    exact = CaptureWriter(str(tmp_path), cache, rope.cos_sin_cache, rope.is_neox_style, rank=0,
                          tp=1, first_head=0, kv_heads=HEADS, exact=fixer)
    plain = CaptureWriter(str(tmp_path), cache, rope.cos_sin_cache, rope.is_neox_style, rank=0,
                          tp=1, first_head=0, kv_heads=HEADS)
    k_exact, v_got = exact.read(job)
    k_plain, _ = plain.read(job)
    want = {name: c.clone() for name, c in caches.items()}

    def reinjected(keys):
        out = {name: c.clone() for name, c in want.items()}
        g = np.random.default_rng(5)
        noise = g.standard_normal(keys.shape).astype(np.float32)
        inject_keys(out, names, isa, rotation, noise, noise, slots)  # the slots overwritten
        assert any(not torch.equal(out[x], want[x]) for x in names)
        inject_keys(out, names, isa, rotation, keys, v_got, slots)
        return sum(int((out[x].view(torch.int16) != want[x].view(torch.int16)).sum())
                   for x in names)

    differ_exact = reinjected(k_exact)
    differ_plain = reinjected(k_plain)
    total = LAYERS * n * HEADS * DIM
    print(f"{kind}: vLLM's rotary rounding here '{mode}'; keys re-injected differing from vLLM's "
          f"bytes: pre-image {differ_exact}, plain de-rotation {differ_plain} of {total}")
    assert fixer.unmatched == 0 and differ_exact == 0
    assert differ_plain > 0  # what the search is for (on every rounding seen: this can fail)
    # bf16 keys within one bf16 rounding of the true pre-RoPE keys, as the plain de-rotation
    assert np.array_equal(k_exact, torch.from_numpy(k_exact).bfloat16().float().numpy())
    err, norm = pair_errors(k_exact, k.float().numpy(), rope.rotary_dim, rope.is_neox_style)
    assert np.all(err <= 2 * PAIR_BOUND * norm + 1e-6)
