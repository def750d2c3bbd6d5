"""Capture while serving without an engine (serve_capture.py, rotary.py): the capture parameter's
checks, the worker's read-back against vLLM's own rotary module and cache-write op for every kind
of rotation the connector accepts (NeoX and GPT-J pairing, partial rotary, scaled tables), the
capture files (tensor-parallel ranks joined, refusals naming the file), and the model rotations
refused at start-up with their reason.

Oracle: vLLM's rotary module (``get_rope``, as a model builds it) rotates random bf16 keys and
vLLM's ``cpu_attn_reshape_and_cache`` op writes them, with random values, into caches of vLLM's
CPU layout; the capture must give the values back exactly and the keys within the rounding of the
rotated keys to bf16 (below)."""

import os
import re

import numpy as np
import pytest
import torch

from inferscale_vllm.serve_capture import (CaptureJob, CaptureWriter, capture_path,
                                           parse_capture_param, read_capture)
from inferscale_vllm.tensors import vllm_cpu_cache

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 3, 64, 128, 4
MAX_POS = 2048


def _vllm():
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    current_platform.import_kernels()
    return ops, _get_attn_isa


def rope_of(neox=True, **params):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_type": "default", "rope_theta": 100000.0, **params}
    with set_current_vllm_config(VllmConfig()):
        return get_rope(DIM, max_position=MAX_POS, is_neox_style=neox, rope_parameters=params,
                        dtype=torch.bfloat16)


ROPES = {
    "neox": dict(neox=True),
    "gptj": dict(neox=False),
    "partial": dict(neox=True, partial_rotary_factor=0.5),
    "gptj-partial": dict(neox=False, partial_rotary_factor=0.5),
    "llama3": dict(neox=True, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=512),
    "yarn": dict(neox=True, rope_type="yarn", factor=4.0, original_max_position_embeddings=512),
}


def filled_caches(rope, n, first_block=1, seed=3):
    """Random pre-RoPE keys and values of n tokens at positions 0..n-1, rotated by `rope` and
    written by vLLM's op into caches (slots from `first_block` on, one block skipped between):
    (caches, names, slots, k, v, isa)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    ops, get_isa = _vllm()
    isa = get_isa(torch.bfloat16, BLOCK, DIM, "auto")
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(LAYERS, n, HEADS, DIM, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(torch.bfloat16)
    blocks = [first_block + 2 * i for i in range((n + BLOCK - 1) // BLOCK)]
    slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    caches = {f"model.layers.{l}.self_attn.attn":
              torch.randn(2 * BLOCKS + 2, HEADS, BLOCK, 2 * DIM).to(torch.bfloat16)
              for l in range(LAYERS)}
    names = list(caches)
    for l, name in enumerate(names):
        q = torch.zeros(n, HEADS * DIM, dtype=torch.bfloat16)
        with set_current_vllm_config(VllmConfig()):
            _, kr = rope(torch.arange(n), q, k[l].reshape(n, -1).clone())
        kc, vc = caches[name].view(caches[name].shape[0], HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(kr.reshape(n, HEADS, DIM).contiguous(),
                                       v[l].contiguous(), kc, vc,
                                       torch.tensor(slots, dtype=torch.int64), isa)
    return caches, names, slots, k, v, isa


def pair_errors(got, want, rotary_dim, neox):
    """Per rotary pair: |got - want| (2-norm) and |want| (2-norm)."""
    idx = np.arange(rotary_dim // 2)
    a, b = (idx, idx + rotary_dim // 2) if neox else (2 * idx, 2 * idx + 1)
    d = got - want
    err = np.sqrt(d[..., a] ** 2 + d[..., b] ** 2)
    norm = np.sqrt(want[..., a] ** 2 + want[..., b] ** 2)
    return err, norm


FILE_FIELDS = ["k_cached", "v_cached", "cache_dtype", "table", "table_dtype", "neox", "rounding",
               "token_ids", "first_head", "num_heads", "kv_heads", "rank", "tp_size"]


def vllm_rotated(rope, k):
    """vLLM's rotary module's own rotation of pre-RoPE keys k (bf16 [layers, n, heads, dim]) at
    positions 0 .. n-1: what its cache op writes (the oracle for the cached bytes)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    layers, n, heads, dim = k.shape
    out = []
    for l in range(layers):
        q = torch.zeros(n, heads * dim, dtype=torch.bfloat16)
        with set_current_vllm_config(VllmConfig()):
            _, kr = rope(torch.arange(n), q, k[l].reshape(n, -1).clone())
        out.append(kr.reshape(n, heads, dim))
    return torch.stack(out)


def bits(t):
    """A bf16 tensor's bit patterns as a numpy uint16 array."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


# The bound on a de-rotated key pair, relative to its norm. vLLM writes its rotation v = R k (R:
# the table's cos and sin, times any attention factor) rounded to bf16, whose spacing at x is at
# most 2^-7 |x|: truncated (its AVX2 kernel) each element is off by less than 2^-7 |v_i|, so the
# pair by less than 2^-7 |v|; rounded after each operation (its other kernels) by at most
# 2^-9 (|x c| + |y s|) + 2^-8 |v_i| per element, under 2^-7 |v| for the pair too. The library's
# inverse divides by cos^2 + sin^2 of the table's own values (fp32), so it undoes R exactly but for
# fp32 rounding (about 2^-23), and R^-1 scales the error by 1 / |R| = |k| / |v|: the pair comes
# back within 2^-7 |k|. 1 % is allowed for the fp32 arithmetic.
PAIR_BOUND = 2.0 ** -7 * 1.01


@pytest.mark.parametrize("kind", list(ROPES))
def test_capture_reads_back_what_vllm_rotated_and_wrote(kind, tmp_path):
    rope = rope_of(**ROPES[kind])
    n = 200  # ends inside its second block
    caches, names, slots, k, v, isa = filled_caches(rope, n)
    cache = vllm_cpu_cache(caches, names, isa)
    writer = CaptureWriter(str(tmp_path), cache, [caches[x] for x in names], rope.cos_sin_cache,
                           rope.is_neox_style, rank=0, tp=1, first_head=0, kv_heads=HEADS)
    ids = list(range(1000, 1000 + n))
    path = writer.capture(CaptureJob("req-1", f"cap-{kind}", ids, slots))
    assert path == capture_path(str(tmp_path), f"cap-{kind}", 0) and os.path.isfile(path)
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]
    with np.load(path, allow_pickle=False) as z:
        assert sorted(z.files) == sorted(FILE_FIELDS)
        # the keys as cached: bf16 bit patterns, vLLM's rotation of k (its own module) exactly
        assert z["k_cached"].dtype == np.uint16 and z["k_cached"].shape == (LAYERS, n, HEADS, DIM)
        assert np.array_equal(z["k_cached"], bits(vllm_rotated(rope, k)))
        assert np.array_equal(z["v_cached"], bits(v))
        assert str(z["cache_dtype"]) == "bfloat16" and str(z["rounding"]) == ""
        assert bool(z["neox"]) == rope.is_neox_style
        assert np.array_equal(z["table"], rope.cos_sin_cache[:n].float().numpy())
    got = read_capture(str(tmp_path), f"cap-{kind}", 1)
    assert got["unmatched"] == 0
    assert not os.path.exists(path), "read_capture removes the files it joined"
    assert got["token_ids"].tolist() == ids
    assert np.array_equal(got["v"], v.float().numpy()), "values are the cache's, widened"
    r = rope.rotary_dim
    kk = k.float().numpy()
    assert np.array_equal(got["k"][..., r:], kk[..., r:]), "unrotated dims come back as written"
    err, norm = pair_errors(got["k"], kk, r, rope.is_neox_style)
    worst = float((err / norm).max())
    print(f"{kind}: {type(rope).__name__}, rotary_dim {r}, table {tuple(rope.cos_sin_cache.shape)}"
          f": worst pair error {worst:.2e} of its norm; bf16-exact elements "
          f"{float((torch.from_numpy(got['k']).bfloat16().float().numpy() == kk).mean()):.3f}")
    assert np.all(err <= PAIR_BOUND * norm + 1e-6), f"{kind}: a pair is off by {worst:.2e}"
    # The pairing matters: the other pairing's de-rotation is far off (this test can fail).
    wrong = CaptureWriter(str(tmp_path), cache, [caches[x] for x in names], rope.cos_sin_cache,
                          not rope.is_neox_style, rank=0, tp=1, first_head=0, kv_heads=HEADS)
    wrong.capture(CaptureJob("req-1", "x", ids, slots))
    bad_k = read_capture(str(tmp_path), "x", 1)["k"]
    err, norm = pair_errors(bad_k, kk, r, rope.is_neox_style)
    assert float((err / norm).max()) > 0.1


def test_tensor_parallel_ranks_are_joined_by_heads_and_checked(tmp_path):
    """Each rank writes its KV heads (here 3 ranks of 1 head, each from a cache holding only its
    head); read_capture joins them in rank order, and refuses, naming the file, a missing rank, a
    truncated file, another capture's file, a file of another TP size, a bad id."""
    rope = rope_of()
    n = 130
    caches, names, slots, k, v, isa = filled_caches(rope, n)
    ids = list(range(n))
    for r in range(3):
        mine = {name: t[:, r:r + 1].contiguous() for name, t in caches.items()}
        w = CaptureWriter(str(tmp_path), vllm_cpu_cache(mine, names, isa),
                          [mine[x] for x in names], rope.cos_sin_cache, True, rank=r, tp=3,
                          first_head=r, kv_heads=3)
        w.capture(CaptureJob("req", "joined", ids, slots))
    whole = CaptureWriter(str(tmp_path / "one"), vllm_cpu_cache(caches, names, isa),
                          [caches[x] for x in names], rope.cos_sin_cache, True, rank=0, tp=1,
                          first_head=0, kv_heads=3)
    whole.capture(CaptureJob("req", "whole", ids, slots))
    want = read_capture(str(tmp_path / "one"), "whole", 1)
    want_k, want_v = want["k"], want["v"]
    paths = [capture_path(str(tmp_path), "joined", r) for r in range(3)]
    saved = {p: open(p, "rb").read() for p in paths}

    def restore():
        for p, data in saved.items():
            with open(p, "wb") as f:
                f.write(data)

    with pytest.raises(ValueError, match="rank of|expected rank 0 of 2"):
        read_capture(str(tmp_path), "joined", 2)
    with pytest.raises(ValueError, match="ranks hold 3 KV heads|rank"):
        read_capture(str(tmp_path), "joined", 4, timeout=0)
    os.remove(paths[1])
    with pytest.raises(ValueError, match=f"{paths[1]}.*missing"):
        read_capture(str(tmp_path), "joined", 3, timeout=0.2)  # waits for it, then refuses
    restore()
    with open(paths[2], "wb") as f:
        f.write(saved[paths[2]][: len(saved[paths[2]]) // 2])
    with pytest.raises(ValueError, match=f"{paths[2]}.*unreadable"):
        read_capture(str(tmp_path), "joined", 3)
    restore()
    head1 = {name: t[:, 1:2].contiguous() for name, t in caches.items()}
    other = CaptureWriter(str(tmp_path), vllm_cpu_cache(head1, names, isa),
                          [head1[x] for x in names], rope.cos_sin_cache, True, rank=1, tp=3,
                          first_head=1, kv_heads=3)
    other.capture(CaptureJob("req", "joined", [7] * n, slots))  # another prompt, same id
    with pytest.raises(ValueError, match=f"{paths[1]}.*another capture"):
        read_capture(str(tmp_path), "joined", 3)
    for p in paths:
        assert os.path.exists(p), "a refused capture's files stay for inspection"
    restore()
    for bad in ("", "a/b", "x" * 65, "..", None):
        with pytest.raises(ValueError, match="capture id"):
            read_capture(str(tmp_path), bad, 3)
    got = read_capture(str(tmp_path), "joined", 3)
    assert np.array_equal(got["k"], want_k) and np.array_equal(got["v"], want_v)
    assert got["token_ids"].tolist() == ids
    assert not any(os.path.exists(p) for p in paths)


def _resave(path, fields):
    """The capture file at `path` written again with `fields` replaced (None: removed)."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {f: z[f] for f in z.files}
    arrays.update(fields)
    with open(path, "wb") as f:
        np.savez(f, **{f: a for f, a in arrays.items() if a is not None})


# A field of the file each: removed (None) or malformed, and the words the refusal must hold.
MALFORMED_FILES = [
    ({}, None),  # the control: well-formed
    ({"k_cached": None}, r"no \['k_cached'\]"),
    ({"table": None, "rounding": None}, r"no \['table', 'rounding'\]"),
    ({"k_cached": np.zeros((LAYERS, 20, HEADS, DIM), np.float32)}, "k_cached float32"),
    ({"v_cached": np.zeros((LAYERS, 20, HEADS, DIM - 2), np.uint16)},
     r"v_cached uint16 \(2, 20, 3, 62\)"),
    ({"cache_dtype": np.array("float8")}, "cache_dtype 'float8'"),
    ({"cache_dtype": np.array(3)}, "cache_dtype 3"),
    ({"table_dtype": np.array("int8")}, "table_dtype 'int8'"),
    ({"rounding": np.array("truncate_maybe")}, "rounding 'truncate_maybe'"),
    ({"neox": np.array(1)}, "neox is not a bool"),
    ({"table": np.zeros((19, 64), np.float32)}, r"table float32 \(19, 64\)"),
    ({"table": np.zeros((20, 66), np.float32)}, r"table float32 \(20, 66\)"),
    ({"table": np.full((20, 64), np.nan, np.float32)}, "finite"),
    ({"num_heads": np.int64(2)}, "num_heads 2"),
]


@pytest.fixture(scope="module")
def capture_file(tmp_path_factory):
    """The bytes of one well-formed capture file (20 tokens, a rounding named), written once."""
    rope = rope_of()
    n = 20
    caches, names, slots, _, _, isa = filled_caches(rope, n)
    folder = str(tmp_path_factory.mktemp("well-formed"))
    writer = CaptureWriter(folder, vllm_cpu_cache(caches, names, isa),
                           [caches[x] for x in names], rope.cos_sin_cache, True, rank=0, tp=1,
                           first_head=0, kv_heads=HEADS, rounding="round_each")
    with open(writer.capture(CaptureJob("req", "good", list(range(n)), slots)), "rb") as f:
        return f.read()


@pytest.mark.parametrize("fields, words", MALFORMED_FILES)
def test_a_malformed_capture_file_is_refused_naming_it(fields, words, capture_file, tmp_path):
    """A capture file missing a field or with one malformed: read_capture raises ValueError with
    the file's path and what is wrong, and leaves the file where it is."""
    path = capture_path(str(tmp_path), "bad", 0)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(capture_file)
    _resave(path, fields)
    if words is None:  # the control: the file as written is read
        assert read_capture(str(tmp_path), "bad", 1)["k"].shape == (LAYERS, 20, HEADS, DIM)
        return
    with pytest.raises(ValueError, match=f"capture file {re.escape(path)}: .*{words}"):
        read_capture(str(tmp_path), "bad", 1)
    assert os.path.isfile(path), "a refused capture file stays for inspection"


@pytest.mark.parametrize("params,want", [
    ({"inferscale_capture": {"id": "abc_DEF-123"}}, ("abc_DEF-123", None)),
    ({"inferscale_capture": {"id": "x" * 64}}, ("x" * 64, None)),
    ({"inferscale": {"user": "u"}}, (None, None)),
    (None, (None, None)),
    ({"inferscale_capture": "abc"}, (None, "must be a dict")),
    ({"inferscale_capture": {}}, (None, "id must be")),
    ({"inferscale_capture": {"id": ""}}, (None, "id must be")),
    ({"inferscale_capture": {"id": "x" * 65}}, (None, "id must be")),
    ({"inferscale_capture": {"id": "../etc"}}, (None, "id must be")),
    ({"inferscale_capture": {"id": "a b"}}, (None, "id must be")),
    ({"inferscale_capture": {"id": 12}}, (None, "id must be")),
    ({"inferscale_capture": {"id": "ok", "user": "x"}}, (None, "unknown keys")),
])
def test_capture_parameter(params, want):
    got = parse_capture_param(params)
    assert got[0] == want[0]
    if want[1] is None:
        assert got[1] is None
    else:
        assert want[1] in got[1], got[1]


# ------------------------------------------------------------------------------------------------
# The model's rotation, read from the model (rotary.py)

class _Attn(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.layer_name = name


class _SelfAttn(torch.nn.Module):
    def __init__(self, name, rope):
        super().__init__()
        self.attn = _Attn(name)
        if rope is not None:
            self.rotary_emb = rope


class _Model(torch.nn.Module):
    def __init__(self, ropes):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for i, rope in enumerate(ropes):
            layer = torch.nn.Module()
            layer.self_attn = _SelfAttn(f"model.layers.{i}.self_attn.attn", rope)
            self.layers.append(layer)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(len(ropes))]


def test_model_rotation_is_read_from_the_model():
    from inferscale_vllm.rotary import model_rotary

    for kind, args in ROPES.items():
        rope = rope_of(**args)
        m = _Model([rope, rope])
        got = model_rotary(m, m.names, DIM)
        assert got.module is rope and got.neox is args["neox"], kind
        assert got.rotary_dim == (DIM // 2 if "partial" in kind else DIM), kind


def _longrope():
    """Phi-3's LongRoPE as get_rope builds it (it reads the engine's max_model_len: its table
    switches to the long factors for a sequence beyond the original 512 positions)."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    config = VllmConfig()
    object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=MAX_POS))
    with set_current_vllm_config(config):
        return get_rope(DIM, max_position=MAX_POS, is_neox_style=True, dtype=torch.bfloat16,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.0] * (DIM // 2),
                                         "long_factor": [4.0] * (DIM // 2),
                                         "original_max_position_embeddings": 512})


def test_model_rotations_the_library_cannot_reproduce_are_refused():
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from inferscale_vllm.rotary import model_rotary

    class OwnForward(RotaryEmbedding):
        def forward_native(self, positions, query, key=None):
            return query, key

    class NotVllm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(8, DIM))

    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        own = OwnForward(DIM, DIM, MAX_POS, 10000.0, True, torch.bfloat16)
    cases = [
        ([rope_of(), rope_of(rope_theta=10000.0)], "rotate differently"),
        ([own, own], "rotates in its own forward_native"),
        ([NotVllm(), NotVllm()], "is not vLLM's RotaryEmbedding"),
        ([None, None], "no rotary module"),
    ]
    longrope = _longrope()
    cases.append(([longrope, longrope], "is not vLLM's RotaryEmbedding"))
    for ropes, reason in cases:
        m = _Model(ropes)
        with pytest.raises(ValueError, match=reason):
            model_rotary(m, m.names, DIM)
    with pytest.raises(ValueError, match="no attention module"):
        model_rotary(_Model([rope_of()]), ["model.layers.7.self_attn.attn"], DIM)


@pytest.mark.parametrize("kind", ["gptj", "gptj-partial", "partial", "yarn"])
def test_injection_rotation_follows_the_model_pairing(kind):
    """The load path: rotation_matching_vllm reads the pairing from the module and reproduces
    vLLM's rotary kernel bit for bit on a GPT-J-style, partial or scaled model; the pairing it used
    to assume (NeoX) does not reproduce a GPT-J one (the start-up would have refused it)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from inferscale_vllm.connector import rotation_matching_vllm

    rope = rope_of(**ROPES[kind])
    with set_current_vllm_config(VllmConfig()):
        _, table, mode = rotation_matching_vllm(rope, torch.bfloat16, DIM)
    assert table.shape[1] == rope.rotary_dim
    if not rope.is_neox_style:
        # What the connector assumed before (NeoX pairing) does not reproduce vLLM's kernel on
        # a GPT-J model: no rounding mode matches, the start-up refuses.
        with set_current_vllm_config(VllmConfig()):
            with pytest.raises(RuntimeError, match="no rotation rounding"):
                rotation_matching_vllm(_AssumedNeox(rope), torch.bfloat16, DIM)


class _AssumedNeox:
    """vLLM's module (rotating as it does) described as NeoX-paired."""

    def __init__(self, rope):
        self.rope = rope
        self.is_neox_style = True
        self.cos_sin_cache = rope.cos_sin_cache

    def __call__(self, positions, q, k):
        return self.rope(positions, q, k)


def test_the_scheduler_hands_a_capture_over_in_the_step_of_the_last_prompt_token():
    """CaptureScheduler on scheduler outputs shaped as vLLM 0.32's (scheduled_new_reqs,
    scheduled_cached_reqs, num_scheduled_tokens): a 300-token prompt chunked by 128 is handed
    over in its third step only, with the slots of its blocks in position order; a prompt whose
    blocks include vLLM's null block (dropped by a sliding window) is not; a finished request's
    state goes."""
    from types import SimpleNamespace as NS

    from inferscale_vllm.serve_capture import CaptureScheduler

    s = CaptureScheduler(block_size=128)
    ids = list(range(300))

    def request(rid, param, prompt=ids):
        return NS(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=param)

    s.on_new_request(request("a", {"inferscale_capture": {"id": "cap-a"}}))
    s.on_new_request(request("b", {"inferscale_capture": {"id": 5}}))  # malformed: ignored
    s.on_new_request(request("c", None))
    s.on_new_request(request("d", {"inferscale_capture": {"id": "cap-d"}}))
    assert set(s.requests) == {"a", "d"} and s.counters["malformed"] == 1
    blocks = {"a": [7, 3, 9], "d": [4, 0, 5]}

    def output(new, cached, scheduled):
        return NS(scheduled_new_reqs=[NS(req_id=r, num_computed_tokens=c) for r, c in new],
                  scheduled_cached_reqs=NS(req_ids=[r for r, _ in cached],
                                           num_computed_tokens=[c for _, c in cached]),
                  num_scheduled_tokens=scheduled)

    assert s.jobs(output([("a", 0)], [], {"a": 128}), blocks.get) == []
    assert s.jobs(output([], [("a", 128)], {"a": 128}), blocks.get) == []
    jobs = s.jobs(output([], [("a", 256)], {"a": 44}), blocks.get)
    assert [(j.request_id, j.capture_id) for j in jobs] == [("a", "cap-a")]
    assert jobs[0].token_ids == ids
    assert jobs[0].slots == ([7 * 128 + i for i in range(128)] + [3 * 128 + i for i in range(128)]
                             + [9 * 128 + i for i in range(44)])
    assert "a" not in s.requests  # handed over once
    assert s.jobs(output([], [("a", 300)], {"a": 1}), blocks.get) == []  # decoding: nothing
    assert s.jobs(output([("d", 0)], [], {"d": 300}), blocks.get) == []  # null block: refused
    assert "d" not in s.requests
    s.on_new_request(request("e", {"inferscale_capture": {"id": "cap-e"}}))
    s.finished("e")
    assert not s.requests
