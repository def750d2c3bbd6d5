"""The store compression through the binding (issue 52, item 1): Memory's ``compression`` argument
(the library's names round-trip; another value is refused with the binding's message naming the
three), a compressed memory saved and opened again keeps its compression, and its facts read back
within the rounding compression.hpp states (bounds written here from that text, not from the
code): a key scale per (page, layer, head, channel), a value scale per (token, layer, head), each
at least amax / q_max, codes rounded to nearest, the product rounded to bfloat16. No engine."""

import os
import shutil
import tempfile

import numpy as np
import pytest

from inferscale_vllm import _inferscale
from inferscale_vllm.memory import Memory

MODEL = {"name": "toy", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "rope_theta": 10000.0,
         "weights": "0" * 64}
NAMES = ("none", "fp8_e4m3", "int4")


@pytest.fixture
def directory():
    d = tempfile.mkdtemp(prefix="inferscale-comp-")
    yield os.path.join(d, "memory")
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("name", NAMES)
def test_compression_round_trips(name):
    m = _inferscale.Memory(2, 2, 8, "bfloat16", 16, 16, 1, compression=name)
    assert m.compression == name
    assert m.store.compression == name


def test_compression_default_is_none():
    assert _inferscale.Memory(2, 2, 8, "bfloat16", 16, 16, 1).compression == "none"


@pytest.mark.parametrize("bad", ["fp8", "INT4", "", "e4m3", "nf4"])
def test_bad_compression_refused(bad, directory):
    want = f"inferscale: unsupported compression '{bad}' (none, fp8_e4m3 or int4)"
    with pytest.raises(ValueError) as e:
        _inferscale.Memory(2, 2, 8, "bfloat16", 16, 16, 1, compression=bad)
    assert str(e.value) == want
    with pytest.raises(ValueError) as e:
        Memory.create(directory, model=MODEL, num_pages=8, compression=bad)
    assert str(e.value) == want
    assert not os.path.exists(os.path.join(directory, "memory.ismem"))  # nothing was created


def bound(x, amax, name):
    """|dequantized - x| allowed for elements x of a group whose largest magnitude is amax."""
    bf16 = np.abs(x) * 2.0**-8 * 1.01  # the product rounded to bfloat16
    if name == "int4":  # scale <= amax / 7 rounded up to bf16; code error <= scale / 2
        return amax / 14.0 * (1 + 2.0**-7) + bf16 + 1e-7
    # e4m3 with a power-of-two scale <= 2 amax / 448: relative 2^-4 for normal codes, an absolute
    # half step 2^-10 * scale among subnormal ones
    return np.abs(x) * 2.0**-4 + 2 * amax / 448.0 * 2.0**-10 + bf16 + 1e-7


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4"])
def test_compressed_memory_saved_and_opened(name, directory):
    g = np.random.default_rng(52)
    shape = (2, 5, 2, 8)  # layers, tokens, heads, head_dim: one 16-token page
    k = g.standard_normal(shape).astype(np.float32)
    v = g.standard_normal(shape).astype(np.float32)
    k[:, :, 1, 3] *= 40.0  # an outlier key channel: its own scale, the others unharmed
    mem = Memory.create(directory, model=MODEL, num_pages=8, compression=name)
    fid = mem.add_fact("alice", "alice plays the cello", [1, 2, 3, 4, 5], k, v)
    mem.commit()
    mem.close()

    reader = Memory.open(directory)
    assert reader.app["store"]["compression"] == name
    store = reader.store
    assert store.compression == name and store.dtype == "bfloat16"
    got_k, got_v = np.empty(shape, np.float32), np.empty(shape, np.float32)
    store.read(fid, got_k, got_v)
    key_amax = np.abs(k).max(axis=1, keepdims=True)    # per (layer, head, channel) over the page
    value_amax = np.abs(v).max(axis=3, keepdims=True)  # per (layer, token, head)
    assert np.all(np.abs(got_k - k) <= bound(k, key_amax, name))
    assert np.all(np.abs(got_v - v) <= bound(v, value_amax, name))
    assert not np.array_equal(got_v, v)  # codes, not the values: the store did compress
    # the outlier channel does not widen the other channels' error (per-channel key scales)
    others = np.ones(shape[2:], bool)
    others[1, 3] = False
    assert np.abs(got_k - k)[:, :, others].max() < 0.25 * np.abs(k[:, :, 1, 3]).max() / 7

    # a compressed snapshot loads in its own dtype only (the library's refusal)
    with pytest.raises(ValueError, match="the snapshot is compressed"):
        Memory.open(directory, dtype="float32")
