"""token_classes.py without an engine: the token classes measured with vLLM's own CPU GEMM
dispatch (dispatch_cpu_unquantized_gemm: oneDNN or the SGL kernels, whichever vLLM picks here) for
SmolLM2's four projection shapes, against every token count measured directly (the measurement
samples counts and bisects; here every count up to TOP is computed and compared), and
``exact_load`` and ``join`` on hand-made classes."""

import hashlib

import pytest
import torch

from inferscale_vllm.token_classes import PROBE_ROWS, TokenClasses, exact_load, join, measure

TOP = 1100  # every count up to here is checked (SmolLM2's classes change at 33, 37, 576, 705, 960
# on an Intel Xeon with AMX)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (n, k)


def vllm_linear(n, k):
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(n * 7 + k)
    layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).bfloat16(),
                                      requires_grad=False)
    layer.bias = None
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return lambda x: layer.cpu_linear(x, layer.weight, None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_measured_classes_equal_every_count_computed(n, k):
    """Two token counts share a class exactly when PROBE_ROWS rows computed at those counts are
    the same bits: here each count from 1 to TOP is computed (other rows than the measurement's,
    in batches of that count; from PROBE_ROWS tokens on, half of them first and half last in one
    batch, random rows between), grouped by the bits, and the groups compared with the measured
    classes."""
    apply = vllm_linear(n, k)
    classes = measure(apply, k, TOP, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(PROBE_ROWS, k, generator=g).bfloat16()
    half = PROBE_ROWS // 2
    fill = torch.randn(TOP, k, generator=g).bfloat16()
    groups = {}
    for t in range(1, TOP + 1):
        if t < PROBE_ROWS:  # the rows in batches of t
            out = torch.cat([apply(torch.cat([rows[i:i + t], fill[:max(0, t - len(rows[i:i + t]))]])
                                   .contiguous())[:len(rows[i:i + t])]
                             for i in range(0, len(rows), t)])
        else:
            y = apply(torch.cat([rows[:half], fill[:t - PROBE_ROWS], rows[half:]]).contiguous())
            out = torch.cat([y[:half], y[t - (PROBE_ROWS - half):]])
        digest = hashlib.sha1(out.view(torch.uint8).numpy().tobytes()).hexdigest()
        groups.setdefault(digest, []).append(t)
    direct = sorted(groups.values())
    measured = {}
    for t in range(1, TOP + 1):
        measured.setdefault(classes.of(t), []).append(t)
    print(f"{n}x{k}: measured {classes}; computed {len(direct)} groups")
    assert sorted(measured.values()) == direct, (
        f"{n}x{k}: measured {classes}, computed groups "
        f"{[(g[0], g[-1], len(g)) for g in direct]}")


def classes(spec):
    """'1-4:0 5-32:1 ...' -> TokenClasses."""
    out = []
    for part in spec.split():
        span, key = part.split(":")
        lo, hi = (int(x) for x in span.split("-"))
        out.append((lo, hi, (int(key),)))
    return TokenClasses(out)


AMX = classes("1-4:0 5-32:1 33-36:2 37-575:3 576-704:4 705-959:5 960-2048:1")  # SmolLM2, TP = 1


def test_exact_load_in_one_step():
    # the prompt (226 tokens) in class 3: the query must be 37-575 tokens
    assert exact_load(226, 0, 205, AMX, 2048) == 189
    assert exact_load(226, 0, 180, AMX, 2048) == 180  # a 46-token query already
    assert exact_load(226, 195, 205, AMX, 2048) is None  # vLLM's own hit leaves no such count
    assert exact_load(1000, 0, 990, AMX, 2048) == 990  # 10 tokens: class 1, as 1000 tokens
    assert exact_load(1000, 0, 999, AMX, 2048) == 995  # not 1-4 tokens (class 0)
    uniform = classes("1-2048:0")
    assert exact_load(226, 0, 205, uniform, 2048) == 205  # every memory token
    assert exact_load(226, 0, 205, None, 2048) is None
    assert exact_load(3000, 0, 2900, uniform, 2048) == 2900  # chunks: all one class


def test_exact_load_under_chunked_prefill():
    # chunks of 64: the cold prefill of 282 tokens computes [256, 282) in a 26-token step
    # (class 1); the rows the injected run computes must fall in steps of the same classes
    top64 = classes("1-4:0 5-32:1 33-36:2 37-64:3")
    assert exact_load(282, 0, 205, top64, 64) == 192  # steps [192, 256), [256, 282): the cold ones
    assert exact_load(282, 0, 190, top64, 64) == 128
    assert exact_load(282, 0, 205, classes("1-64:0"), 64) == 205


def test_join_keeps_every_change():
    a = classes("1-32:0 33-959:1 960-2048:0")
    b = classes("1-4:0 5-2048:1")
    j = join([a, b])
    assert repr(j) == "1-4:0 5-32:1 33-959:2 960-2048:1", repr(j)
    assert join([a]).of(40) == join([a]).of(959) != join([a]).of(960)
    with pytest.raises(ValueError):
        TokenClasses([(2, 5, (0,))])


def test_class_cache_reads_only_what_was_measured_for_the_same_layer_and_machine(tmp_path,
                                                                              monkeypatch):
    """ClassCache: a measurement kept on disk is read back for the same layer, weights and
    machine only, without measuring; any other key, a damaged or foreign file, is measured again
    (and replaced); a folder that cannot be written still gives the measured classes."""
    import json
    import os

    from inferscale_vllm.token_classes import ClassCache, tensor_digest

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(48, 40, generator=g) * 0.05).bfloat16()
    calls = []

    def measure_w(weight):
        def run():
            calls.append(1)
            return measure(lambda x: x @ weight.t(), 40, 96, dtype=torch.bfloat16)
        return run

    what = {"group": ["UnquantizedLinearMethod", 40, 48, "torch.bfloat16", False],
            "weight": tensor_digest(w), "bias": None, "max_tokens": 96,
            "dtype": "torch.bfloat16", "device": "cpu"}
    cache = ClassCache(str(tmp_path / "tc"), machine={"cpu": {"model name": "test"}, "threads": 1})
    first, hit = cache.get_or_measure(what, measure_w(w))
    assert hit == 0 and len(calls) == 1
    files = os.listdir(tmp_path / "tc")
    assert len(files) == 1 and files[0].endswith(".json"), files
    again, hit = cache.get_or_measure(what, measure_w(w))
    assert hit == 1 and len(calls) == 1, "read back without measuring"
    assert again.to_list() == first.to_list()
    assert again.to_list() == measure(lambda x: x @ w.t(), 40, 96, dtype=torch.bfloat16).to_list()

    # other weights (one element changed), another machine, other thread counts: measured
    w2 = w.clone()
    w2[3, 7] = -w2[3, 7] if w2[3, 7] != 0 else 1.0
    assert tensor_digest(w2) != tensor_digest(w) and tensor_digest(w.clone()) == tensor_digest(w)
    assert tensor_digest(w.reshape(40, 48)) != tensor_digest(w)  # the shape is in the digest
    _, hit = cache.get_or_measure(dict(what, weight=tensor_digest(w2)), measure_w(w2))
    assert hit == 0 and len(calls) == 2
    for machine in ({"cpu": {"model name": "other"}, "threads": 1},
                    {"cpu": {"model name": "test"}, "threads": 2}):
        _, hit = ClassCache(str(tmp_path / "tc"), machine=machine).get_or_measure(
            what, measure_w(w))
        assert hit == 0
    assert len(calls) == 4 and len(os.listdir(tmp_path / "tc")) == 4

    # a damaged file, and a file whose description is another layer's: measured and replaced
    path = cache.path(cache.describe(what))
    for damage in ("{not json", json.dumps({"description": cache.describe(dict(what,
                                                                                max_tokens=95)),
                                             "classes": first.to_list()}),
                   json.dumps({"description": cache.describe(what), "classes": [[2, 96, [0]]]})):
        with open(path, "w") as f:
            f.write(damage)
        n = len(calls)
        again, hit = cache.get_or_measure(what, measure_w(w))
        assert hit == 0 and len(calls) == n + 1 and again.to_list() == first.to_list()
        assert cache.get(what).to_list() == first.to_list(), "replaced by the measurement"

    # a folder that cannot be made: the measured classes, nothing kept
    (tmp_path / "blocked").write_text("a file where the folder would be")
    blocked = ClassCache(str(tmp_path / "blocked" / "tc"), machine=cache.machine)
    got, hit = blocked.get_or_measure(what, measure_w(w))
    assert hit == 0 and got.to_list() == first.to_list() and blocked.get(what) is None

    # the environment: off, a folder, or XDG_CACHE_HOME's
    monkeypatch.setenv("INFERSCALE_TOKEN_CLASSES_CACHE", "off")
    assert ClassCache.default() is None
    monkeypatch.setenv("INFERSCALE_TOKEN_CLASSES_CACHE", str(tmp_path / "elsewhere"))
    assert ClassCache.default().directory == str(tmp_path / "elsewhere")
    monkeypatch.delenv("INFERSCALE_TOKEN_CLASSES_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ClassCache.default().directory == str(tmp_path / "xdg" / "inferscale" /
                                                 "token-classes")
    # what the machine is described by, on this machine
    m = ClassCache.default().machine
    assert m["threads"] == torch.get_num_threads() and m["torch"] == torch.__version__
