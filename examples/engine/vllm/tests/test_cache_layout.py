"""The extension's injection into vLLM's CPU paged cache, element for element against vLLM itself.

Oracle: vLLM's own rotary embedding module (``get_rope``, the class its Llama uses) rotates the keys,
and vLLM's own ``cpu_attn_reshape_and_cache`` op with the backend's ISA writes them into a cache.
InferScale stores the same keys un-rotated, then injects them at the same positions and slots into
another cache, rotating with that module's ``cos_sin_cache``. The two caches must be equal bit for
bit (keys and values), and nothing outside the slots may change.
"""

import pytest
import torch

from inferscale_vllm import Rotation, Store, extract, inject
from inferscale_vllm.tensors import vllm_cpu_cache

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 3, 3, 64, 128, 4
THETA, MAX_POS = 100000.0, 2048


def _vllm():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    current_platform.import_kernels()
    return ops, get_rope, _get_attn_isa


def _rope(get_rope, dtype):
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        return _make_rope(get_rope, dtype)


def _make_rope(get_rope, dtype):
    try:
        return get_rope(DIM, max_position=MAX_POS, is_neox_style=True,
                        rope_parameters={"rope_type": "default", "rope_theta": THETA}, dtype=dtype)
    except TypeError:  # older signature
        return get_rope(DIM, DIM, MAX_POS, THETA, True, dtype=dtype)


def _caches(dtype):
    return {f"model.layers.{l}.self_attn.attn":
            torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM).to(dtype) for l in range(LAYERS)}


@pytest.mark.parametrize("store_dtype", ["float32", "bfloat16"])
def test_inject_equals_vllm_rotary_and_reshape_and_cache(store_dtype):
    ops, get_rope, get_isa = _vllm()
    dtype = torch.bfloat16
    isa = get_isa(dtype, BLOCK, DIM, "auto")
    # 'vec' on CPUs without AMX, 'amx' on AMX CPUs (bfloat16): the library describes both
    assert isa in ("vec", "amx"), f"vLLM picked the {isa!r} kernels here, not described"
    rope = _rope(get_rope, dtype)
    n = 300  # spans three blocks, not block-aligned
    torch.manual_seed(7)
    k = torch.randn(LAYERS, n, HEADS, DIM).to(dtype)
    v = torch.randn(LAYERS, n, HEADS, DIM).to(dtype)
    first = 37
    positions = torch.arange(first, first + n)
    # slots: a block table [2, 0, 3] read from token 0: block b holds tokens 128*i..
    table = [2, 0, 3]
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)], dtype=torch.int64)

    ref = _caches(dtype)
    ours = {name: t.clone() for name, t in ref.items()}
    names = list(ref)
    for l, name in enumerate(names):
        q = torch.zeros(n, HEADS * DIM, dtype=dtype)
        key = k[l].reshape(n, HEADS * DIM).clone()
        from vllm.config import VllmConfig, set_current_vllm_config

        with set_current_vllm_config(VllmConfig()):
            _, key_rot = rope(positions, q, key)
        kc, vc = ref[name].view(BLOCKS, HEADS, 2 * BLOCK, DIM).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key_rot.reshape(n, HEADS, DIM).contiguous(),
                                       v[l].contiguous(), kc, vc, slots, isa)

    store = Store(LAYERS, HEADS, DIM, store_dtype, num_pages=64)
    kf, vf = (k.float(), v.float()) if store_dtype == "float32" else (k, v)
    store.insert(11, 5, list(range(n)), kf, vf)
    table_t = rope.cos_sin_cache
    # vLLM's CPU rotary kernel rounds each product and the sum to bf16 (checked: an fp32
    # computation rounded once differs in about 15% of the elements).
    rotation = Rotation(table_t, DIM, True, True)
    cache = vllm_cpu_cache(ours, names, isa)
    written = inject(store, cache, rotation, [([11], first, slots.tolist())])
    assert written == n
    for name in names:
        a, b = ours[name].view(torch.int16).int(), ref[name].view(torch.int16).int()
        if store_dtype == "bfloat16":
            # bf16 keys rotated with vLLM's rounding: the engine's own bits.
            assert int((a != b).sum()) == 0, f"{name}: {int((a != b).sum())} elements differ"
        else:
            # An fp32 store rotates in fp32 and rounds once (the library rounds each operation
            # only for 16-bit keys): values equal, keys within bf16 rounding of vLLM's (per-op
            # rounding differs most where x*cos and y*sin nearly cancel, so compare norms).
            kr, vr = ref[name].view(BLOCKS, HEADS, 2, BLOCK * DIM).unbind(2)
            ko, vo = ours[name].view(BLOCKS, HEADS, 2, BLOCK * DIM).unbind(2)
            assert torch.equal(vo.view(torch.int16), vr.view(torch.int16))
            ko, kr = ko.float(), kr.float()
            rel = float((ko - kr).norm() / kr.norm())
            assert rel < 4e-3, f"{name}: keys differ from vLLM's by {rel:.2e} (relative norm)"

    # Extraction de-rotates them back to the stored keys (bf16: exact inverse within rounding).
    back = Store(LAYERS, HEADS, DIM, "float32", num_pages=64)
    extract(back, cache, rotation, slots.tolist(), first, 12, 5, list(range(n)))
    kb = torch.empty(LAYERS, n, HEADS, DIM)
    vb = torch.empty(LAYERS, n, HEADS, DIM)
    back.read(12, kb, vb)
    assert torch.equal(vb, v.float())
    err = (kb - k.float()).norm() / k.float().norm()
    assert err < 1e-2, f"de-rotated keys differ by {err:.2e} (relative)"


def test_refusals_leave_the_cache_unchanged():
    _, get_rope, _ = _vllm()
    rope = _rope(get_rope, torch.bfloat16)
    caches = _caches(torch.bfloat16)
    before = {n: t.clone() for n, t in caches.items()}
    names = list(caches)
    store = Store(LAYERS, HEADS, DIM, "bfloat16", num_pages=8)
    k = torch.randn(LAYERS, 10, HEADS, DIM).to(torch.bfloat16)
    store.insert(1, 1, list(range(10)), k, k)
    t = rope.cos_sin_cache
    rot = Rotation(t, DIM, True, True)
    cache = vllm_cpu_cache(caches, names)
    with pytest.raises(ValueError, match="unknown fact"):
        inject(store, cache, rot, [([1], 0, list(range(10))), ([99], 0, list(range(10, 20)))])
    with pytest.raises(ValueError, match="slots were given"):
        inject(store, cache, rot, [([1], 0, list(range(9)))])
    with pytest.raises(ValueError):
        inject(store, cache, rot, [([1], 0, [BLOCKS * BLOCK + i for i in range(10)])])  # beyond
    with pytest.raises(ValueError):
        inject(store, cache, rot, [([1], MAX_POS - 5, list(range(10)))])  # beyond the table
    other = Store(LAYERS, 1, DIM, "bfloat16", num_pages=8)
    with pytest.raises(ValueError, match="geometry"):
        inject(other, cache, rot, [])
    # one entry, one overload per backend: a stream goes with a device cache only (a host cache
    # and a stream match neither overload; both are named in the error)
    with pytest.raises(TypeError, match="VllmFlashAttnCache") as e:
        inject(store, cache, rot, [([1], 0, list(range(10)))], 0)
    assert "cache: inferscale_vllm._inferscale.VllmCpuCache" in str(e.value)
    for n in names:
        assert torch.equal(caches[n].view(torch.int16), before[n].view(torch.int16))


def test_arrays_cross_as_arrays_and_are_checked_before_use():
    """Every array argument crosses as the array itself (DLPack), never an address: its dtype,
    rank, shape, layout and device are checked, and a refusal writes nothing."""
    _, get_rope, _ = _vllm()
    rope = _rope(get_rope, torch.bfloat16)
    caches = _caches(torch.bfloat16)
    names = list(caches)
    store = Store(LAYERS, HEADS, DIM, "bfloat16", num_pages=8)
    k = torch.randn(LAYERS, 10, HEADS, DIM).to(torch.bfloat16)
    with pytest.raises(ValueError, match="unsupported element type"):
        store.insert(1, 1, list(range(10)), k.double(), k.double())
    with pytest.raises(ValueError, match="different dtypes"):
        store.insert(1, 1, list(range(10)), k, k.float())
    with pytest.raises(ValueError, match="must have 4 dimensions, got 3"):
        store.insert(1, 1, list(range(10)), k[0], k[0])
    assert store.num_facts == 0 and not store.contains(1)
    # any strides: a transposed view is read as such (the same fact as its contiguous copy)
    kt = k.transpose(2, 3).contiguous().transpose(2, 3)
    store.insert(1, 1, list(range(10)), kt, kt)
    out_k, out_v = torch.empty(LAYERS, 10, HEADS, DIM), torch.empty(LAYERS, 10, HEADS, DIM)
    store.read(1, out_k, out_v)
    assert torch.equal(out_k, k.float()) and torch.equal(out_v, k.float())
    wrong = torch.zeros(LAYERS, 9, HEADS, DIM)
    with pytest.raises(ValueError, match=r"keys are \[3, 9, 3, 64\], fact 1 needs \[3, 10, 3, 64\]"):
        store.read(1, wrong, out_v)
    with pytest.raises(TypeError):  # float64 output: nanobind refuses the argument's type
        store.read(1, out_k.double(), out_v.double())
    t = rope.cos_sin_cache
    with pytest.raises(ValueError, match="must have 2 dimensions"):
        Rotation(t[0], DIM)
    with pytest.raises(ValueError, match="rotary_dim <= head_dim"):
        Rotation(t, DIM // 2)
    # the rotation holds its table: dropping the caller's reference keeps it valid
    rot = Rotation(t.clone(), DIM, True, True)
    import gc

    gc.collect()
    assert rot.rows == t.shape[0]
    odd = dict(caches)
    odd[names[1]] = caches[names[1]][:-1]  # one block fewer
    with pytest.raises(ValueError, match=r"layer model.layers.1.self_attn.attn has shape \(3, "):
        vllm_cpu_cache(odd, names)
    from inferscale_vllm import VllmCpuCache

    with pytest.raises(ValueError, match="layer 1 differs from layer 0"):
        VllmCpuCache([caches[names[0]], caches[names[1]][:-1]])
    with pytest.raises(ValueError, match="no layers"):
        VllmCpuCache([])
