"""Which layers a worker injects: the global layer index read from the names of the KV caches vLLM
registers (a pipeline stage gets only its own layers, named by their index in the whole model),
and the store shard of those layers and heads. No engine: the oracle is the full store itself
(a direct slice of what it holds, and the full store injected into a whole-model cache)."""

import numpy as np
import pytest
import torch

from inferscale_vllm import Rotation, Store, inject
from inferscale_vllm.connector import _layer_index, rank_layers
from inferscale_vllm.memory import shard_store
from inferscale_vllm.tensors import vllm_cpu_cache

LAYERS, HEADS, DIM, BLOCK = 6, 3, 64, 128


def names(layers, prefix="model"):
    return {f"{prefix}.layers.{l}.self_attn.attn": None for l in layers}


def test_layer_index_is_the_models_index_in_the_name():
    assert _layer_index("model.layers.17.self_attn.attn") == 17
    assert _layer_index("language_model.model.layers.3.self_attn.attn") == 3
    for bad in ["model.embed_tokens", "layers.x.attn", "model.layers.1.sub.layers.2.attn"]:
        with pytest.raises(ValueError, match="cannot tell the layer"):
            _layer_index(bad)


def test_a_stage_gets_its_contiguous_run_of_layers_in_any_order():
    assert rank_layers(names([3, 5, 4]), 6) == (3, 3)
    assert rank_layers(names(range(30)), 30) == (0, 30)
    assert rank_layers(names(range(15, 30)), 30) == (15, 15)


@pytest.mark.parametrize("layers,total,message", [
    ([0, 1, 3], 6, r"skip layers \[2\]"),
    ([4, 5, 6], 6, "is layer 6, the model has 6 layers"),
    ([], 6, "got no KV caches"),
])
def test_layer_sets_that_cannot_be_one_shard_are_refused(layers, total, message):
    with pytest.raises(ValueError, match=message):
        rank_layers(names(layers), total)


def test_two_caches_for_one_layer_are_refused():
    caches = {"model.layers.2.self_attn.attn": None, "other.layers.2.attn": None}
    with pytest.raises(ValueError, match="are both layer 2"):
        rank_layers(caches, 6)


def full_store(n=40):
    rng = np.random.default_rng(5)
    k = rng.standard_normal((LAYERS, n, HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, n, HEADS, DIM)).astype(np.float32)
    store = Store(LAYERS, HEADS, DIM, "float32", num_pages=16)
    kt, vt = torch.from_numpy(k), torch.from_numpy(v)
    store.insert(7, 0, list(range(100, 100 + n)), kt, vt)
    manifest = [7]  # the fact ids to shard
    return store, manifest, k, v


def test_a_layer_and_head_shard_holds_exactly_that_slice():
    store, manifest, k, v = full_store()
    shard = shard_store(store, manifest, first_head=1, num_heads=2, first_layer=2, num_layers=3)
    n = k.shape[1]
    kb = np.empty((3, n, 2, DIM), np.float32)
    vb = np.empty_like(kb)
    shard.read(7, kb, vb)
    assert np.array_equal(kb, k[2:5, :, 1:3]) and np.array_equal(vb, v[2:5, :, 1:3])
    assert shard.token_ids(7) == list(range(100, 100 + n))


def test_a_shard_of_several_facts_is_their_rows_byte_for_byte_in_their_namespaces():
    """shard_store of an uncompressed store is the library's slice_store (Store.slice): each
    fact's rows of the slice, the stored bits unchanged (a bfloat16 store read back as float32
    is exact), its namespace and token ids kept; the namespace's facts in the order asked."""
    rng = np.random.default_rng(11)
    store = Store(LAYERS, HEADS, DIM, "bfloat16", num_pages=16, page_size=16)
    kv = {}
    for fid, ns, n in ((3, 1, 17), (5, 2, 40), (9, 1, 16)):
        k = rng.standard_normal((LAYERS, n, HEADS, DIM)).astype(np.float32)
        v = rng.standard_normal((LAYERS, n, HEADS, DIM)).astype(np.float32)
        store.insert(fid, ns, list(range(n)), k, v)
        kb, vb = np.empty_like(k), np.empty_like(v)
        store.read(fid, kb, vb)  # the stored (bf16-rounded) values
        kv[fid] = (kb, vb)
    shard = shard_store(store, [9, 5, 3], first_head=2, num_heads=1, first_layer=1, num_layers=4)
    assert shard.geometry == (4, 1, DIM) and shard.dtype == "bfloat16"
    assert shard.facts(1) == [9, 3] and shard.facts(2) == [5]
    for fid, (kb, vb) in kv.items():
        n = kb.shape[1]
        got_k, got_v = np.empty((4, n, 1, DIM), np.float32), np.empty((4, n, 1, DIM), np.float32)
        shard.read(fid, got_k, got_v)
        assert np.array_equal(got_k, kb[1:5, :, 2:3]) and np.array_equal(got_v, vb[1:5, :, 2:3])
        assert shard.namespace_of(fid) == store.namespace_of(fid)
        assert shard.token_ids(fid) == list(range(n))
    with pytest.raises(ValueError, match="unknown fact id 4"):
        store.slice([4], 0, 1)
    with pytest.raises(ValueError, match="fact id 3 is named twice"):
        store.slice([3, 3], 0, 1)
    with pytest.raises(ValueError, match=r"KV heads \[2, 4\) are not inside the store's \[0, 3\)"):
        store.slice([3], 2, 2)


@pytest.mark.parametrize("kwargs,message", [
    ({"first_head": 0, "num_heads": 3, "first_layer": 4, "num_layers": 3}, "layers"),
    ({"first_head": 0, "num_heads": 3, "first_layer": -1, "num_layers": 2}, "layers"),
    ({"first_head": 2, "num_heads": 2}, "KV heads"),
])
def test_shards_outside_the_store_are_refused(kwargs, message):
    store, manifest, _, _ = full_store()
    with pytest.raises(ValueError, match=message):
        shard_store(store, manifest, **kwargs)


def test_a_stage_injects_the_same_bytes_as_the_whole_model_into_its_layers():
    """Layers [3, 6) from their shard into a 3-layer cache == the full store into a 6-layer cache,
    read at layers 3..5; and the stage's cache differs from layers 0..2 (the wrong layers)."""
    store, manifest, _, _ = full_store()
    n = 40
    torch.manual_seed(3)
    table = torch.randn(512, DIM)  # any cos/sin table: both injections use the same one
    rotation = Rotation(table, DIM, True)
    slots = [BLOCK + p for p in range(n)]  # block 1
    whole = {f"model.layers.{l}.self_attn.attn": torch.zeros(2, HEADS, BLOCK, 2 * DIM)
             for l in range(LAYERS)}
    stage = {f"model.layers.{l}.self_attn.attn": torch.zeros(2, HEADS, BLOCK, 2 * DIM)
             for l in range(3, LAYERS)}
    first, count = rank_layers(stage, LAYERS)
    shard = shard_store(store, manifest, 0, HEADS, first, count)
    inject(store, vllm_cpu_cache(whole, list(whole)), rotation, [([7], 0, slots)])
    ordered = sorted(stage, key=_layer_index)
    inject(shard, vllm_cpu_cache(stage, ordered), rotation, [([7], 0, slots)])
    for name in ordered:
        assert torch.equal(stage[name], whole[name]), name
    assert not torch.equal(stage["model.layers.3.self_attn.attn"],
                           whole["model.layers.0.self_attn.attn"])


def test_memory_load_choices_reach_the_connector():
    """`serve --memory-load` / bench_serve: exact, all and blocks set the connector's
    partial_last_block to "auto", true and false; anything else is refused by name."""
    from inferscale_vllm.connector import partial_last_block
    from inferscale_vllm.engine import kv_transfer_config

    got = {m: kv_transfer_config("/m", m).kv_connector_extra_config for m in ("exact", "all",
                                                                                "blocks")}
    assert {m: c["partial_last_block"] for m, c in got.items()} == {
        "exact": "auto", "all": True, "blocks": False}
    assert all(c["memory_dir"] == "/m" for c in got.values())
    assert partial_last_block(None, True) is True and partial_last_block(None, False) is False
    with pytest.raises(ValueError, match="memory_load"):
        kv_transfer_config("/m", "some")
