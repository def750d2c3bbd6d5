"""The package's memory layer over the C++ facade (memory.py, _inferscale.Memory), no engine:
round trips against the K/V handed in (rounded to bf16 by numpy, independently), the writers' lock,
readers while a writer commits, refusals that change nothing, files of another save, a malformed
record, retrieval against brute force, and the keyed cache salt recomputed with hmac."""

import hashlib
import hmac
import json
import os
import shutil
import tempfile
import threading

import numpy as np
import pytest

from inferscale_vllm import _inferscale
from inferscale_vllm.memory import (SALT_KEY, Memory, MemoryReader, cache_salt, check_model,
                                    load_generation, shard_store, weights_digest)

MODEL = {"name": "toy", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "rope_theta": 10000.0,
         "weights": "0" * 64}
DIM = 6


class ToyEmbedder:
    """Deterministic text embeddings (a hash of the words), unit length."""

    def description(self):
        return {"name": "toy-embedder", "dim": DIM}

    def embed(self, text):
        v = np.zeros(DIM, np.float32)
        for w in text.lower().split():
            v[int(hashlib.sha256(w.encode()).hexdigest(), 16) % DIM] += 1.0
        return (v / np.linalg.norm(v))[None, :]


def bf16(a):
    """float32 -> bfloat16 (round to nearest even) -> float32, written out with integer ops."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def kv(n, seed):
    g = np.random.default_rng(seed)
    shape = (MODEL["num_layers"], n, MODEL["num_kv_heads"], MODEL["head_dim"])
    return g.standard_normal(shape).astype(np.float32), g.standard_normal(shape).astype(np.float32)


@pytest.fixture
def directory():
    d = tempfile.mkdtemp(prefix="inferscale-mem-")
    yield os.path.join(d, "memory")
    shutil.rmtree(d, ignore_errors=True)


def read_fact(store, fid):
    n = store.length(fid)
    shape = (MODEL["num_layers"], n, MODEL["num_kv_heads"], MODEL["head_dim"])
    k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
    store.read(fid, k, v)
    return k, v


def test_round_trip_and_reader(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=64, embedder=ToyEmbedder())
    pk, pv = kv(3, 1)
    prefix = mem.set_prefix("system", [1, 2, 3], pk, pv)
    k, v = kv(2 + 4, 2)  # a context of 2 tokens, then the fact's 4
    fid = mem.add_fact("alice", "alice plays the cello", [10, 11, 12, 13], k, v, context=[7, 8])
    k2, v2 = kv(3, 3)
    bob = mem.add_fact("bob", "bob likes trains", [20, 21, 22], k2, v2)
    assert mem.commit() == 2
    reader = Memory.open(directory, ToyEmbedder())
    assert reader.generation == 2 and reader.prefix == prefix
    assert reader.facts("alice") == [fid] and reader.facts("bob") == [bob]
    assert reader.store.token_ids(fid) == [10, 11, 12, 13]
    got_k, got_v = read_fact(reader.store, fid)
    np.testing.assert_array_equal(got_k, bf16(k[:, 2:]))  # the context's rows dropped
    np.testing.assert_array_equal(got_v, bf16(v[:, 2:]))
    np.testing.assert_array_equal(read_fact(reader.store, prefix)[0], bf16(pk))
    r = reader.request("alice", [fid], [99, 98])
    assert r["prompt"]["prompt_token_ids"] == [1, 2, 3, 10, 11, 12, 13, 99, 98]
    assert r["memory_tokens"] == 7
    assert reader.text(fid) == "alice plays the cello" and reader.owner(bob) == "bob"
    # the C++ snapshot, version 2: manifest + store + index + lifecycle + application record
    names = sorted(os.listdir(directory))
    assert "memory.ismem" in names and os.path.getsize(os.path.join(directory,
                                                                    "memory.ismem")) == 80
    assert sum(n.startswith("application-") for n in names) == 1
    mem.close()


def test_one_writer(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=8)
    with pytest.raises(ValueError, match="another writer holds"):
        Memory.open(directory, writer=True)
    reader = Memory.open(directory)  # readers need no lock
    with pytest.raises(ValueError, match="needs the writer"):
        reader.add_fact("alice", "x", [1], *kv(1, 0))
    mem.close()
    second = Memory.open(directory, writer=True)
    second.add_fact("alice", "x", [1], *kv(1, 0))
    second.commit()
    second.close()
    # two writers in two threads: the second is refused, never a lost fact
    errors = []

    def write(i):
        try:
            with Memory.open(directory, writer=True) as w:
                w.add_fact("carol", f"fact {i}", [i + 1], *kv(1, i))
                w.commit()
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    committed = Memory.open(directory).facts("carol")
    assert len(committed) + len(errors) == 4
    assert all("another writer holds" in e for e in errors)
    assert len(set(committed)) == len(committed)


def test_refusals_change_nothing(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=8, embedder=ToyEmbedder())
    mem.add_fact("alice", "alice plays the cello", [10, 11], *kv(2, 1))
    mem.commit()
    before = (json.dumps(mem.app, sort_keys=True), mem.store.num_facts, mem.store.free_pages)
    k, v = kv(2, 2)
    bad = [
        dict(user="alice", text="t", token_ids=[-1, 2]),
        dict(user="alice", text="t", token_ids=["a", 2]),
        dict(user="alice", text="t", token_ids=[1.5, 2]),
        dict(user="alice", text="t", token_ids="12"),
        dict(user="alice", text=None, token_ids=[1, 2]),
        dict(user="alice", text="", token_ids=[1, 2]),
        dict(user="", text="t", token_ids=[1, 2]),
        dict(user=None, text="t", token_ids=[1, 2]),
        dict(user="alice", text="t", token_ids=[1, 2, 3]),  # 3 tokens, K/V of 2
        dict(user="alice", text="t", token_ids=[]),
    ]
    for b in bad:
        user = b.pop("user")
        with pytest.raises(ValueError):
            mem.add_fact(user, b["text"], b["token_ids"], k, v)
    with pytest.raises(ValueError, match="expected"):  # a wrong geometry
        mem.add_fact("alice", "t", [1, 2], k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="pages"):  # more than the store holds
        mem.add_fact("alice", "long", list(range(1, 200)), *kv(199, 3))
    for fid in (999, "1", None, True):
        with pytest.raises(ValueError):
            mem.erase_fact(fid)
    with pytest.raises(ValueError, match="not one of"):
        mem.erase_fact(mem.facts("alice")[0], user="bob")
    assert (json.dumps(mem.app, sort_keys=True), mem.store.num_facts, mem.store.free_pages) == before
    for user, k_ in (("bob", 1), ("alice", 0), ("alice", 2), ("alice", True), (None, 1)):
        with pytest.raises(ValueError):
            mem.retrieve(user, "cello", k_)
    with pytest.raises(ValueError):
        mem.request("alice", [mem.facts("alice")[0]], [-3])
    with pytest.raises(ValueError, match="not one of"):
        mem.request("bob", mem.facts("alice"), [1])
    mem.close()


def test_retrieval_against_brute_force(directory):
    emb = ToyEmbedder()
    mem = Memory.create(directory, model=MODEL, num_pages=128, embedder=emb)
    texts = [f"w{i % 5} w{(i * 3) % 7} topic{i % 3}" for i in range(12)]
    ids = [mem.add_fact("u", t, [i + 1], *kv(1, i)) for i, t in enumerate(texts)]
    mem.commit()
    vectors = np.concatenate([emb.embed(t) for t in texts])
    for q in ("w1 topic2", "w3 w6", "topic0"):
        qv = emb.embed(q)[0]
        cos = vectors @ qv / np.linalg.norm(vectors, axis=1)
        got = mem.retrieve("u", q, 4)
        # the same set as brute force up to ties at the 4th distance
        kth = np.sort(cos)[::-1][3]
        assert all(cos[ids.index(g)] >= kth - 1e-6 for g in got)
        assert [cos[ids.index(g)] for g in got] == sorted([cos[ids.index(g)] for g in got],
                                                          reverse=True)
    mem.close()


def test_readers_never_fail_while_a_writer_commits(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=512)
    stop = threading.Event()
    failures, loads = [], [0]

    def read():
        while not stop.is_set():
            try:
                _, app = load_generation(directory)
                loads[0] += 1
                assert app["generation"] >= 1
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e))

    t = threading.Thread(target=read)
    t.start()
    for i in range(60):
        mem.add_fact("alice", f"fact {i}", [i + 1, i + 2], *kv(2, i))
        mem.commit()
    stop.set()
    t.join()
    assert failures == []
    assert loads[0] > 0
    # no temporaries or old generations left behind
    left = [n for n in os.listdir(directory) if "pending" in n or n.endswith(".tmp")]
    assert left == []
    assert sum(n.startswith("store-") for n in os.listdir(directory)) == 1
    mem.close()


def test_files_of_another_save_and_a_malformed_record(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=16)
    mem.add_fact("alice", "a", [1, 2], *kv(2, 1))
    mem.commit()
    other_dir = directory + "-other"
    other = Memory.create(other_dir, model=MODEL, num_pages=16)
    other.add_fact("mallory", "m", [1, 2], *kv(2, 9))
    other.commit()
    store = [n for n in os.listdir(directory) if n.startswith("store-")][0]
    other_store = [n for n in os.listdir(other_dir) if n.startswith("store-")][0]
    shutil.copy(os.path.join(other_dir, other_store), os.path.join(directory, store))
    with pytest.raises(ValueError, match="checksum") as e:
        Memory.open(directory)
    assert directory in str(e.value)
    # a valid snapshot whose record is JSON of the wrong shape, written by the facade itself
    bad_dir = directory + "-bad"
    os.makedirs(bad_dir)
    for record in (b"[]", b"{\"format\": 2}", b"not json", json.dumps(dict(
            mem.app, users={"alice": "one"})).encode(), json.dumps(dict(
            mem.app, facts={"1": {"user": "nobody", "text": "x"}})).encode()):
        _inferscale.Memory(2, 2, 8, "bfloat16", 16, 16, 1).save(bad_dir, record)
        with pytest.raises(ValueError, match=bad_dir.replace("+", r"\+")):
            Memory.open(bad_dir)
    reader = MemoryReader(bad_dir)
    with pytest.raises(ValueError, match="malformed|not JSON"):
        reader.poll()
    mem.close()
    other.close()


def test_keyed_salt(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=16)
    fid = mem.add_fact("alice", "a", [1, 2], *kv(2, 1))
    mem.commit()
    with open(os.path.join(directory, SALT_KEY), "rb") as f:
        key = f.read()
    assert len(key) == 32 and oct(os.stat(os.path.join(directory, SALT_KEY)).st_mode & 0o777) \
        == "0o600"
    msg = f"inferscale/2/alice/{mem.generation}/{fid}/0".encode()
    want = "inferscale-" + hmac.new(key, msg, hashlib.sha256).hexdigest()[:40]
    assert mem.request("alice", [fid], [5])["prompt"]["cache_salt"] == want
    # the unkeyed hash of the same fields (what a tenant could compute) is not it
    assert hashlib.sha256(msg).hexdigest()[:40] not in want
    other = directory + "-2"
    m2 = Memory.create(other, model=MODEL, num_pages=16)
    assert cache_salt(other, "alice", [fid], mem.generation) != want  # another memory's key
    mem.close()
    m2.close()


def _bytes_read():
    """Bytes this process has read through read()/pread() so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _saved_files(facade, app, where):
    os.makedirs(where)
    facade.save(where, json.dumps(app).encode())
    return {n: open(os.path.join(where, n), "rb").read() for n in sorted(os.listdir(where))}


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")
def test_a_reader_loads_only_what_changed(directory):
    """After a commit of one fact (and an erasure), a reader's refresh reads the small files, the
    store's catalogue and the new fact's pages, not the store; what it builds is the full load's
    (every fact's K/V and tokens, and the bytes of a re-save)."""
    mem = Memory.create(directory, model=MODEL, num_pages=1024)
    for i in range(150):
        mem.add_fact(f"user{i % 3}", f"fact {i}", list(range(i, i + 64)), *kv(64, 100 + i))
    mem.commit()
    reader = MemoryReader(directory)
    first, _ = reader.poll(block=True)
    opened = Memory.open(directory)
    fid = mem.add_fact("user1", "one more", list(range(7, 7 + 64)), *kv(64, 999))
    mem.erase_fact(5)
    mem.commit()
    store = [n for n in os.listdir(directory) if n.startswith("store-")]
    store_bytes = os.path.getsize(os.path.join(directory, store[0]))

    before = _bytes_read()
    app, facade = reader.poll(block=True)
    incremental_read = _bytes_read() - before
    before = _bytes_read()
    full, full_app = load_generation(directory)
    full_read = _bytes_read() - before
    assert app["generation"] == first["generation"] + 1 and app == full_app
    assert full_read >= store_bytes
    assert incremental_read < store_bytes / 8, (incremental_read, store_bytes)
    assert opened.refresh() and opened.generation == app["generation"]

    ids = sorted(int(f) for f in app["facts"])
    assert fid in ids and 5 not in ids
    for f in ids:
        assert facade.store.token_ids(f) == full.store.token_ids(f)
        for a, b in zip(read_fact(facade.store, f), read_fact(full.store, f)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(read_fact(opened.store, f)[0], read_fact(full.store, f)[0])
    scratch = tempfile.mkdtemp(prefix="inferscale-resave-")
    try:
        assert _saved_files(facade, app, os.path.join(scratch, "a")) == \
            _saved_files(full, full_app, os.path.join(scratch, "b"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    mem.close()


def test_shard_store(directory):
    mem = Memory.create(directory, model=MODEL, num_pages=16)
    k, v = kv(3, 4)
    fid = mem.add_fact("alice", "a", [1, 2, 3], k, v)
    shard = shard_store(mem.store, [fid], 1, 1, 1, 1)
    got_k, got_v = np.empty((1, 3, 1, 8), np.float32), np.empty((1, 3, 1, 8), np.float32)
    shard.read(fid, got_k, got_v)
    np.testing.assert_array_equal(got_k, bf16(k[1:2, :, 1:2]))
    np.testing.assert_array_equal(got_v, bf16(v[1:2, :, 1:2]))
    mem.close()


def test_model_identity(tmp_path):
    """A memory serves only the model it was encoded with: every recorded key must match, the
    weights' digest among them (two folders of one geometry and other weights differ there)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "model.safetensors").write_bytes(b"\x01" * 1000)
    (b / "model.safetensors").write_bytes(b"\x01" * 999 + b"\x02")
    assert weights_digest(str(a)) == hashlib.sha256(
        b"model.safetensors\x001000\x00" + b"\x01" * 1000).hexdigest()
    assert weights_digest(str(a)) != weights_digest(str(b))
    recorded = dict(MODEL, weights=weights_digest(str(a)), dtype="bfloat16")
    assert check_model(recorded, dict(recorded, name="moved/elsewhere")) is None
    assert "weights" in check_model(recorded, dict(recorded, weights=weights_digest(str(b))))
    assert "dtype" in check_model(recorded, dict(recorded, dtype="float16"))
    assert "rope_theta" in check_model(recorded, dict(recorded, rope_theta=1e6))
    missing = dict(recorded)
    del missing["weights"]
    assert "weights" in check_model(recorded, missing)
    with pytest.raises(ValueError, match="no weight files"):
        weights_digest(str(tmp_path))
