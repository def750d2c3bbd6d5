"""The extension's device path (a GPU vLLM): injection into vLLM's GPU paged cache on a CUDA stream.

Runs where torch sees a CUDA GPU and the extension was built with INFERSCALE_VLLM_CUDA=ON
(`examples/engine/vllm/gpu_check.sh` builds it and runs this file); without a GPU it reports
skipped, with the reason. No vLLM is needed: the expectation is written out here in torch.

Oracle: random pre-RoPE K/V are stored (bfloat16); the expected cache is the initial cache with,
for every request token whose slot is not negative, the value copied and the key rotated to its
position with vLLM's table and vLLM's CUDA `rotary_embedding` arithmetic, which runs in the key
dtype (`scalar_t` = c10::BFloat16): `x' = x*cos - y*sin`, `y' = y*cos + x*sin`, each product and the
sum rounded to bfloat16, over the neox pairing (x = dim i, y = dim i + rotary_dim/2). torch's
bfloat16 CUDA ops round each operation the same way, so the comparison is bit for bit (the
library's contract with `round_each_operation`), on the whole cache: nothing outside the slots
may change.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible to torch (torch.cuda.is_available() is False): the device "
                "path can only be tested on a GPU", allow_module_level=True)

from inferscale_vllm import _inferscale  # noqa: E402
from inferscale_vllm._inferscale import Rotation, Store, inject  # noqa: E402
from inferscale_vllm.tensors import kv_cache_descriptor  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 4, 128, 16, 24
THETA, MAX_POS = 10000.0, 4096
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


def setup_module(module):
    assert _inferscale.HAS_CUDA, (
        "a CUDA GPU is visible but inferscale_vllm._inferscale was built without CUDA: build it "
        "with -DINFERSCALE_VLLM_CUDA=ON (gpu_check.sh does)")


def cos_sin_table():
    """vLLM's `RotaryEmbedding._compute_cos_sin_cache` (default rope): fp32 inv_freq and angles,
    [cos | sin] per row, cast to the model dtype."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, DIM, 2, dtype=torch.float) / DIM))
    t = torch.arange(MAX_POS, dtype=torch.float)
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DTYPE).to(DEV).contiguous()


def rotate_like_vllm_cuda(keys, positions, table):
    """keys [n, heads, dim] bf16 (CUDA), positions [n]: neox pairing, each op rounded to bf16."""
    half = DIM // 2
    cos = table[positions, :half].unsqueeze(1)  # [n, 1, half], bf16
    sin = table[positions, half:].unsqueeze(1)
    x, y = keys[..., :half], keys[..., half:]
    return torch.cat((x * cos - y * sin, y * cos + x * sin), dim=-1)


# vLLM layouts of one layer's cache, as (name, make(initial values) -> tensor, K view, V view).
# The K/V views are [blocks, block_size, heads, dim] views of the same memory.
def _layout_v032_nhd():
    # vLLM 0.32, layout LBNHC (NHD, the default): logical (B, H, N, 2D), memory [B, N, H, 2D]
    def make():
        return torch.randn(BLOCKS, BLOCK, HEADS, 2 * DIM, device=DEV).to(DTYPE).transpose(1, 2)

    return make, lambda t: t.transpose(1, 2)[..., :DIM], lambda t: t.transpose(1, 2)[..., DIM:]


def _layout_v032_hnd():
    # vLLM 0.32, layout LBHNC (HND): logical (B, H, N, 2D), contiguous
    def make():
        return torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM, device=DEV).to(DTYPE)

    return make, lambda t: t.transpose(1, 2)[..., :DIM], lambda t: t.transpose(1, 2)[..., DIM:]


def _layout_flash_attn_5d():
    # earlier vLLM FlashAttention: (2, B, N, H, D), kv_cache.unbind(0) = K, V
    def make():
        return torch.randn(2, BLOCKS, BLOCK, HEADS, DIM, device=DEV).to(DTYPE)

    return make, lambda t: t[0], lambda t: t[1]


LAYOUTS = {"v0.32-NHD": _layout_v032_nhd, "v0.32-HND": _layout_v032_hnd,
           "flash-attn-5d": _layout_flash_attn_5d}

# three facts: 5, 20 and 33 tokens (the last two span blocks)
FACT_LENGTHS = {11: 5, 12: 20, 13: 33}


def make_facts():
    g = torch.Generator().manual_seed(2024)
    facts = {}
    for fid, n in FACT_LENGTHS.items():
        k = (torch.randn(LAYERS, n, HEADS, DIM, generator=g) * 2).to(DTYPE)
        v = torch.randn(LAYERS, n, HEADS, DIM, generator=g).to(DTYPE)
        facts[fid] = (k, v)
    return facts


def host_store(facts):
    store = Store(LAYERS, HEADS, DIM, "bfloat16", 64, 16)
    for fid, (k, v) in facts.items():
        store.insert(fid, 7, list(range(100 * fid, 100 * fid + k.shape[1])), k,
                     v)
    return store


def slots_of(block_table, first, count):
    """Slots of tokens first .. first + count of a sequence with this block table."""
    return [block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + count)]


def requests():
    """(facts in order, first position, slots): two requests; the first skips three tokens
    (slot -1, as the connector marks tokens vLLM computes itself)."""
    n1 = FACT_LENGTHS[12] + FACT_LENGTHS[11]
    s1 = slots_of([5, 2, 9], 3, n1)
    s1[0] = s1[4] = s1[17] = -1
    s2 = slots_of([17, 0, 11, 20], 9, FACT_LENGTHS[13] + FACT_LENGTHS[12])
    return [([12, 11], 1000, s1), ([13, 12], 37, s2)]


def expected(initial, kv_views, facts, table, reqs):
    """The whole expected cache of every layer, written out in torch."""
    want = [t.clone() for t in initial]
    for order, first, slots in reqs:
        k = torch.cat([facts[f][0] for f in order], dim=1).to(DEV)  # [L, n, H, D]
        v = torch.cat([facts[f][1] for f in order], dim=1).to(DEV)
        n = k.shape[1]
        positions = torch.arange(first, first + n, device=DEV)
        for l in range(LAYERS):
            kr = rotate_like_vllm_cuda(k[l], positions, table)
            kview, vview = kv_views[0](want[l]), kv_views[1](want[l])
            for j, s in enumerate(slots):
                if s < 0:
                    continue
                kview[s // BLOCK, s % BLOCK] = kr[j]
                vview[s // BLOCK, s % BLOCK] = v[l, j]
    return want


def bits(t):
    return t.contiguous().view(torch.int16)


def rotation_for(table):
    return Rotation(table, DIM, True, True, False)


def run_inject(store, caches, names, table, reqs):
    on_device, desc = kv_cache_descriptor(caches, names)
    assert on_device, "CUDA caches must take the device path"
    assert (desc.num_layers, desc.num_heads, desc.head_dim, desc.block_size, desc.num_slots) == (
        LAYERS, HEADS, DIM, BLOCK, BLOCKS * BLOCK)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the caches' initial values are written
    with torch.cuda.stream(stream):
        written = inject(store, desc, rotation_for(table), reqs, stream.cuda_stream)
    stream.synchronize()
    return written


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("source", ["to_device", "load_device"])
def test_device_inject_equals_vllm_cuda_rotation_and_scatter(layout, source, tmp_path):
    torch.manual_seed(3)
    make, kview, vview = LAYOUTS[layout]()
    facts = make_facts()
    host = host_store(facts)
    if source == "to_device":
        store = host.to_device()
    else:  # the same snapshot the connector reads, loaded into device memory
        path = str(tmp_path / "store.iskv")
        host.save(path)
        store = Store.load(path, device=True)
    assert store.device and not host.device
    assert store.num_facts == host.num_facts == len(facts)
    table = cos_sin_table()
    names = [f"model.layers.{l}.self_attn.attn" for l in range(LAYERS)]
    caches = {n: make() for n in names}
    initial = [caches[n].clone() for n in names]
    reqs = requests()
    want = expected(initial, (kview, vview), facts, table, reqs)

    written = run_inject(store, caches, names, table, reqs)

    assert written == sum(len(s) for _, _, s in reqs)
    for l, n in enumerate(names):
        got, exp = bits(caches[n]), bits(want[l])
        bad = int((got != exp).sum())
        assert bad == 0, f"layer {l}: {bad} of {got.numel()} elements differ from the reference"
    # the values went through unchanged (no rounding involved): spot-check one explicitly
    order, first, slots = reqs[1]
    s = slots[0]
    assert torch.equal(vview(caches[names[2]])[s // BLOCK, s % BLOCK].cpu(), facts[order[0]][1][2, 0])


def test_device_store_round_trips_the_host_bytes():
    facts = make_facts()
    host = host_store(facts)
    dev = host.to_device()
    for fid, (k, v) in facts.items():
        n = k.shape[1]
        out_k = torch.empty(LAYERS, n, HEADS, DIM)
        out_v = torch.empty_like(out_k)
        dev.read(fid, out_k, out_v)
        assert torch.equal(out_k, k.float()) and torch.equal(out_v, v.float())
        assert dev.token_ids(fid) == host.token_ids(fid)
        assert dev.namespace_of(fid) == 7


def _refused(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_refusals_leave_the_cache_unchanged():
    torch.manual_seed(5)
    make, _, _ = LAYOUTS["v0.32-NHD"]()
    facts = make_facts()
    host = host_store(facts)
    dev = host.to_device()
    table = cos_sin_table()
    names = [f"model.layers.{l}.self_attn.attn" for l in range(LAYERS)]
    caches = {n: make() for n in names}
    before = [caches[n].clone() for n in names]
    _, desc = kv_cache_descriptor(caches, names)
    stream = torch.cuda.current_stream().cuda_stream
    good = requests()

    # a host store given to the device path
    _refused(lambda: inject(host, desc, rotation_for(table), good, stream), "host memory")
    # a slot beyond the cache (BLOCKS * BLOCK slots): refused before anything is written, although
    # every other token of the batch is valid
    beyond = [(good[0][0], good[0][1], good[0][2][:-1] + [BLOCKS * BLOCK])] + good[1:]
    _refused(lambda: inject(dev, desc, rotation_for(table), beyond, stream), "beyond")
    # a position beyond the table
    late = [(good[1][0], MAX_POS - 10, good[1][2])]
    _refused(lambda: inject(dev, desc, rotation_for(table), late, stream), "beyond the cos")
    # fewer slots than the facts' tokens: nothing is truncated
    short = [(good[1][0], good[1][1], good[1][2][:-1])]
    _refused(lambda: inject(dev, desc, rotation_for(table), short, stream), "truncated")
    # the rotation's table in host memory
    host_table = table.cpu()
    _refused(lambda: inject(dev, desc, rotation_for(host_table), good, stream),
             "not in device memory|not CUDA memory")
    torch.cuda.synchronize()
    for l, n in enumerate(names):
        assert torch.equal(bits(caches[n]), bits(before[l])), f"layer {l} changed on a refusal"

    # a CPU tensor described as the GPU cache
    cpu = before[0].cpu()
    _refused(lambda: _inferscale.VllmFlashAttnCache([cpu] * LAYERS), "not a CUDA tensor")
