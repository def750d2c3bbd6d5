"""Captured keys that re-inject vLLM's own bytes, no engine: vLLM's rotary module and cache op
write random bf16 keys (test_rotary_capture's caches); the worker's CaptureWriter writes the
capture file in the step (the keys exactly as cached: vLLM's rotation of the keys, bit for bit);
the reader's read_capture de-rotates them and runs ExactKeys (off the engine step), and the
library's injection (with the rounding that reproduces vLLM's rotary kernel here) writes the
captured float32 keys at the same positions into a cache whose slots were overwritten first: every
byte must be vLLM's again. The plain de-rotation (read_capture's exact=False), injected the same
way, is checked too: with vLLM's kernel it does not give every byte back (what ExactKeys is for),
and ExactKeys' keys stay within one bf16 rounding of the true pre-RoPE keys."""

import numpy as np
import pytest
import torch
from test_rotary_capture import (DIM, HEADS, LAYERS, PAIR_BOUND, bits, filled_caches, pair_errors,
                                 rope_of, vllm_rotated)

from inferscale_vllm import _inferscale
from inferscale_vllm.connector import rotation_matching_vllm
from inferscale_vllm.serve_capture import CaptureJob, CaptureWriter, read_capture
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
    cache = vllm_cpu_cache(caches, names, isa)
    writer = CaptureWriter(str(tmp_path), cache, [caches[x] for x in names], table,
                           rope.is_neox_style, rank=0, tp=1, first_head=0, kv_heads=HEADS,
                           rounding=mode)
    job = CaptureJob("req", f"exact-{kind}", list(range(n)), slots)
    path = writer.capture(job)
    # The step's file carries the keys as vLLM cached them: its rotary module's rotation of k
    with np.load(path, allow_pickle=False) as z:
        assert np.array_equal(z["k_cached"], bits(vllm_rotated(rope, k)))
        assert str(z["rounding"]) == mode
    with open(path, "rb") as f:
        saved = f.read()
    exact = read_capture(str(tmp_path), f"exact-{kind}", 1)
    with open(path, "wb") as f:
        f.write(saved)
    plain = read_capture(str(tmp_path), f"exact-{kind}", 1, exact=False)
    k_exact, k_plain, v_got = exact["k"], plain["k"], exact["v"]
    assert np.array_equal(v_got, v.float().numpy())
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
          f"bytes: ExactKeys (in the reader) {differ_exact}, plain de-rotation {differ_plain} of "
          f"{total}")
    assert exact["unmatched"] == 0 and differ_exact == 0
    assert differ_plain > 0  # what the search is for (on every rounding seen: this can fail)
    # bf16 keys within one bf16 rounding of the true pre-RoPE keys, as the plain de-rotation
    assert np.array_equal(k_exact, torch.from_numpy(k_exact).bfloat16().float().numpy())
    err, norm = pair_errors(k_exact, k.float().numpy(), rope.rotary_dim, rope.is_neox_style)
    assert np.all(err <= 2 * PAIR_BOUND * norm + 1e-6)
