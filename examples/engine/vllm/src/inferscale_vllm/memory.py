"""The memory directory: what the connector serves from, and the client helper.

Layout of ``memory_dir`` (one deployment; one namespace per user):
  manifest.json        {"format": 1, "generation": G, "model": {...}, "store": "store-G.iskv",
                        "prefix": id | null, "next_id": n, "users": {user: [fact ids]},
                        "facts": {id: {"user": u, "text": t, "tokens": c}}}
  store-G.iskv         InferScale's store snapshot (pre-RoPE K/V of every fact, whole model)

Writers (``MemoryStore``) change the store in memory and ``commit()`` a new generation: the snapshot
is written under a new name, then the manifest is replaced atomically (rename), then the previous
snapshot is removed. Readers (the connector's scheduler and workers) check the manifest's stat
before each step and reload a new generation; a reader never sees a half-written state.

Fact ids are never reused and a fact's K/V never change under its id (an update is a new id), so a
plan made against generation G injects the same bytes from any later generation that still holds
its facts, and a fact erased since is refused (the request falls back to prefill).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np

from ._inferscale import Store, Tensor

FORMAT = 1
MANIFEST = "manifest.json"


def _tensor(a: np.ndarray) -> Tensor:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return Tensor(a.ctypes.data, list(a.shape), [s // 4 for s in a.strides], "float32"), a


def cache_salt(user: str, facts: list[int], generation: int) -> str:
    """The prefix-cache salt of a memory request: vLLM hashes it into the first block, so blocks
    filled from memory are shared only by requests with the same user, facts and generation, and
    never with a request whose text merely starts with the same tokens."""
    key = f"inferscale/1/{user}/{generation}/{','.join(str(f) for f in facts)}"
    return "inferscale-" + hashlib.sha256(key.encode()).hexdigest()[:32]


class MemoryStore:
    """Read-write access to a memory directory (the offline side: adding and erasing facts)."""

    def __init__(self, directory: str, manifest: dict, store: Store):
        self.directory = directory
        self.manifest = manifest
        self.store = store

    # -- creation and loading -------------------------------------------------------------------
    @classmethod
    def create(cls, directory: str, *, model: dict, dtype: str = "bfloat16",
               num_pages: int = 4096, page_size: int = 16) -> "MemoryStore":
        """A new, empty memory for a model. ``model`` names at least num_layers, num_kv_heads,
        head_dim, rope_theta and name (the connector refuses a vLLM model that differs)."""
        for key in ("name", "num_layers", "num_kv_heads", "head_dim", "rope_theta"):
            if key not in model:
                raise ValueError(f"MemoryStore.create: model description lacks '{key}'")
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(os.path.join(directory, MANIFEST)):
            raise ValueError(f"MemoryStore.create: {directory} already holds a memory")
        store = Store(model["num_layers"], model["num_kv_heads"], model["head_dim"], dtype,
                      num_pages, page_size)
        manifest = {"format": FORMAT, "generation": 0, "model": dict(model), "store": None,
                    "prefix": None, "next_id": 1, "users": {}, "facts": {}}
        m = cls(directory, manifest, store)
        m.commit()
        return m

    @classmethod
    def open(cls, directory: str) -> "MemoryStore":
        manifest = read_manifest(directory)
        return cls(directory, manifest, load_store(directory, manifest))

    # -- facts ----------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.manifest["generation"]

    def facts(self, user: str) -> list[int]:
        return list(self.manifest["users"].get(user, []))

    def text(self, fact_id: int) -> str:
        return self.manifest["facts"][str(fact_id)]["text"]

    def add_fact(self, user: str, text: str, token_ids, keys, values) -> int:
        """Stores a fact's pre-RoPE K/V (``[layers, tokens, kv_heads, head_dim]``, any float
        type) under a new id in the user's namespace. Nothing is written on a refusal."""
        fid = self.manifest["next_id"]
        self._insert(fid, token_ids, keys, values)
        self.manifest["next_id"] = fid + 1
        self.manifest["users"].setdefault(user, []).append(fid)
        self.manifest["facts"][str(fid)] = {"user": user, "text": text, "tokens": len(token_ids)}
        return fid

    def set_prefix(self, text: str, token_ids, keys, values) -> int:
        """The shared head of every memory segment (e.g. the chat template's system turn): its
        K/V stored once, injected first in every request."""
        fid = self.manifest["next_id"]
        self._insert(fid, token_ids, keys, values)
        old = self.manifest["prefix"]
        if old is not None:
            self.store.erase(old)
            del self.manifest["facts"][str(old)]
        self.manifest["next_id"] = fid + 1
        self.manifest["prefix"] = fid
        self.manifest["facts"][str(fid)] = {"user": None, "text": text, "tokens": len(token_ids)}
        return fid

    def erase_fact(self, fact_id: int) -> None:
        key = str(fact_id)
        if key not in self.manifest["facts"] or fact_id == self.manifest["prefix"]:
            raise ValueError(f"MemoryStore.erase_fact: no user fact {fact_id}")
        self.store.erase(fact_id)
        user = self.manifest["facts"].pop(key)["user"]
        self.manifest["users"][user].remove(fact_id)
        if not self.manifest["users"][user]:
            del self.manifest["users"][user]

    def _insert(self, fid, token_ids, keys, values):
        k = keys.float().numpy() if hasattr(keys, "numpy") else np.asarray(keys)
        v = values.float().numpy() if hasattr(values, "numpy") else np.asarray(values)
        kt, kbuf = _tensor(k)
        vt, vbuf = _tensor(v)
        self.store.insert(fid, 0, [int(t) for t in token_ids], kt, vt)
        del kbuf, vbuf

    # -- commit ---------------------------------------------------------------------------------
    def commit(self) -> int:
        """Writes a new generation (snapshot, then the manifest by rename); returns it."""
        gen = self.manifest["generation"] + 1
        name = f"store-{gen}.iskv"
        self.store.save(os.path.join(self.directory, name))
        old = self.manifest.get("store")
        manifest = dict(self.manifest, generation=gen, store=name)
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=self.directory)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, MANIFEST))
        self.manifest = manifest
        if old and old != name:
            try:
                os.remove(os.path.join(self.directory, old))
            except FileNotFoundError:
                pass
        return gen

    # -- the client helper ----------------------------------------------------------------------
    def request(self, user: str, facts: list[int], query_token_ids: list[int]) -> dict:
        """What to pass vLLM for a question answered with memory: the prompt (memory segment +
        query tokens, with the memory's prefix-cache salt) and the kv_transfer_params naming the
        user and the facts. Use as ``llm.generate(r["prompt"], SamplingParams(..., extra_args=
        r["extra_args"]))``. The same prompt without the extra_args is the re-prefill baseline."""
        owned = set(self.manifest["users"].get(user, []))
        for f in facts:
            if f not in owned:
                raise ValueError(f"MemoryStore.request: fact {f} is not one of {user}'s facts")
        order = ([self.manifest["prefix"]] if self.manifest["prefix"] is not None else []) + list(facts)
        memory = self.store.composed_tokens(order)
        params = {"user": user, "facts": list(facts), "generation": self.generation,
                  "memory_tokens": len(memory)}
        return {"prompt": {"prompt_token_ids": list(memory) + list(query_token_ids),
                           "cache_salt": cache_salt(user, facts, self.generation)},
                "extra_args": {"kv_transfer_params": {"inferscale": params}},
                "memory_tokens": len(memory)}


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"inferscale: no memory at {directory} (no {MANIFEST})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"inferscale: {path} has format {manifest.get('format')}, expected {FORMAT}")
    return manifest


def load_store(directory: str, manifest: dict, dtype: str | None = None) -> Store:
    return Store.load(os.path.join(directory, manifest["store"]), dtype)


def shard_store(full: Store, manifest: dict, first_head: int, num_heads: int,
                first_layer: int = 0, num_layers: int | None = None) -> Store:
    """The heads [first_head, first_head + num_heads) of the layers [first_layer, first_layer +
    num_layers) of every fact (a tensor-parallel rank's heads in a pipeline stage's layers; the
    shard's layer 0 is the model's layer first_layer)."""
    layers, heads, dim = full.geometry
    if num_layers is None:
        num_layers = layers - first_layer
    if not (0 <= first_layer and num_layers >= 1 and first_layer + num_layers <= layers):
        raise ValueError(f"shard_store: layers [{first_layer}, {first_layer + num_layers}) are "
                         f"not inside the store's {layers}")
    if not (0 <= first_head and num_heads >= 1 and first_head + num_heads <= heads):
        raise ValueError(f"shard_store: KV heads [{first_head}, {first_head + num_heads}) are not "
                         f"inside the store's {heads}")
    if first_head == 0 and num_heads == heads and first_layer == 0 and num_layers == layers:
        return full
    pages = max(1, sum((f["tokens"] + 15) // 16 for f in manifest["facts"].values()))
    shard = Store(num_layers, heads, dim, full.dtype, pages, 16, first_head, num_heads)
    for key in manifest["facts"]:
        fid = int(key)
        n = full.length(fid)
        k = np.empty((layers, n, heads, dim), np.float32)
        v = np.empty_like(k)
        full.read(fid, k.ctypes.data, v.ctypes.data)
        kt, _kb = _tensor(k[first_layer:first_layer + num_layers])
        vt, _vb = _tensor(v[first_layer:first_layer + num_layers])
        shard.insert(fid, 0, full.token_ids(fid), kt, vt)
    return shard
