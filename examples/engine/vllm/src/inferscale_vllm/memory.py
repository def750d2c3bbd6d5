"""The memory directory: what the connector serves from, and the client helper.

Layout of ``memory_dir`` (one deployment; one namespace per user):
  manifest.json        {"format": 1, "generation": G, "model": {...}, "store": "store-G.iskv",
                        "prefix": id | null, "next_id": n, "users": {user: [fact ids]},
                        "facts": {id: {"user": u, "text": t, "tokens": c}},
                        "embedder": {...} | null, "embeddings": "embeddings-G.npz" | null}
  store-G.iskv         InferScale's store snapshot (pre-RoPE K/V of every fact, whole model)
  embeddings-G.npz     retrieval (when the memory has an embedder): "ids" [n] uint64 and
                       "vectors" [n, dim] float32, one unit-length text embedding per user fact

Writers (``MemoryStore``) change the store in memory and ``commit()`` a new generation: the snapshot
and the embeddings are written under new names, then the manifest is replaced atomically (rename),
then the previous generation's files are removed. Readers (the connector's scheduler and workers)
check the manifest's stat before each step and reload a new generation; a reader never sees a
half-written state.

Retrieval: a memory made with an embedder (``MemoryStore.create(..., embedder=MiniLMEmbedder())``)
embeds each fact's text as it is added and keeps InferScale's host graph index (the library's
``graph_index``, one namespace per user) over the embeddings; it is rebuilt from the embeddings
file on ``open`` and ``refresh``. ``retrieve(user, query, k)`` gives the user's k facts nearest to
the query (cosine), best first; ``request_for_query`` composes that with ``request``.

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

from ._inferscale import Index, Store, Tensor

FORMAT = 1
MANIFEST = "manifest.json"
INVALID_ID = (1 << 64) - 1  # the index's "no fact" id


def _tensor(a: np.ndarray) -> Tensor:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return Tensor(a.ctypes.data, list(a.shape), [s // 4 for s in a.strides], "float32"), a


def cache_salt(user: str, facts: list[int], generation: int, recompute_tokens: int = 0) -> str:
    """The prefix-cache salt of a memory request: vLLM hashes it into the first block, so blocks
    filled from memory are shared only by requests with the same user, facts, generation and
    recompute setting (a block vLLM computed in context is not one injected), and never with a
    request whose text merely starts with the same tokens."""
    key = f"inferscale/1/{user}/{generation}/{','.join(str(f) for f in facts)}"
    if recompute_tokens:
        key += f"/recompute={recompute_tokens}"
    return "inferscale-" + hashlib.sha256(key.encode()).hexdigest()[:32]


class MemoryStore:
    """Read-write access to a memory directory (the offline side: adding and erasing facts) and
    the client helper (retrieval, requests)."""

    def __init__(self, directory: str, manifest: dict, store: Store, embedder=None,
                 vectors: dict | None = None):
        self.directory = directory
        self.manifest = manifest
        self.store = store
        self.embedder = embedder
        self._dirty = False
        self._vectors = {}  # fact id -> float32 [dim]: the embeddings of the user facts
        self._index = None
        self._ns = {}       # user -> the index namespace holding their facts
        if manifest.get("embedder") is not None:
            _check_embedder(manifest["embedder"], embedder, directory)
            self._vectors = dict(vectors or {})
            self._build_index()

    # -- creation and loading -------------------------------------------------------------------
    @classmethod
    def create(cls, directory: str, *, model: dict, dtype: str = "bfloat16",
               num_pages: int = 4096, page_size: int = 16, embedder=None) -> "MemoryStore":
        """A new, empty memory for a model. ``model`` names at least num_layers, num_kv_heads,
        head_dim, rope_theta and name (the connector refuses a vLLM model that differs).
        ``embedder`` (e.g. ``embed.MiniLMEmbedder()``): facts are embedded as they are added and
        can be retrieved by a query text; the memory records it and refuses another one later."""
        for key in ("name", "num_layers", "num_kv_heads", "head_dim", "rope_theta"):
            if key not in model:
                raise ValueError(f"MemoryStore.create: model description lacks '{key}'")
        description = None
        if embedder is not None:
            description = embedder.description()
            if not isinstance(description.get("dim"), int) or description["dim"] < 1:
                raise ValueError(f"MemoryStore.create: the embedder's description {description} "
                                 "has no positive 'dim'")
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(os.path.join(directory, MANIFEST)):
            raise ValueError(f"MemoryStore.create: {directory} already holds a memory")
        store = Store(model["num_layers"], model["num_kv_heads"], model["head_dim"], dtype,
                      num_pages, page_size)
        manifest = {"format": FORMAT, "generation": 0, "model": dict(model), "store": None,
                    "prefix": None, "next_id": 1, "users": {}, "facts": {},
                    "embedder": description, "embeddings": None}
        m = cls(directory, manifest, store, embedder)
        m.commit()
        return m

    @classmethod
    def open(cls, directory: str, embedder=None) -> "MemoryStore":
        """The memory's newest generation. A memory with retrieval needs ``embedder`` (the same
        model it was made with) to add facts or to retrieve by text; its index is rebuilt here
        from the generation's embeddings."""
        manifest = read_manifest(directory)
        store = load_store(directory, manifest)
        return cls(directory, manifest, store, embedder, load_embeddings(directory, manifest))

    def refresh(self) -> bool:
        """Loads a newer generation committed by another writer (store, embeddings, index);
        False when the directory holds this one. Refused while this writer has uncommitted
        changes (they would be lost)."""
        manifest = read_manifest(self.directory)
        if manifest["generation"] == self.generation:
            return False
        if self._dirty:
            raise ValueError("MemoryStore.refresh: this writer has uncommitted changes; commit "
                             "them (or reopen) first")
        store = load_store(self.directory, manifest)
        vectors = load_embeddings(self.directory, manifest)
        MemoryStore.__init__(self, self.directory, manifest, store, self.embedder, vectors)
        return True

    # -- facts ----------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.manifest["generation"]

    def facts(self, user: str) -> list[int]:
        return list(self.manifest["users"].get(user, []))

    def text(self, fact_id: int) -> str:
        return self.manifest["facts"][str(fact_id)]["text"]

    def add_fact(self, user: str, text: str, token_ids, keys, values, *,
                 embed_text: str | None = None) -> int:
        """Stores a fact's pre-RoPE K/V (``[layers, tokens, kv_heads, head_dim]``, any float
        type) under a new id in the user's namespace; with retrieval, also embeds ``embed_text``
        (default: ``text``) into the user's index. Nothing is written on a refusal."""
        if not isinstance(user, str) or not user:
            raise ValueError("MemoryStore.add_fact: the user is a non-empty str")
        vector = None
        if self.retrieval:
            self._need_embedder("add_fact")
            vector = self.embedder.embed(text if embed_text is None else embed_text)[0]
        elif embed_text is not None:
            raise ValueError("MemoryStore.add_fact: embed_text given, but this memory has no "
                             "embedder (MemoryStore.create(..., embedder=...))")
        fid = self.manifest["next_id"]
        self._insert(fid, token_ids, keys, values)
        if vector is not None:
            try:
                self._index.add(self._namespace(user), vector.ctypes.data, 1, vector.shape[0], [fid])
            except Exception:
                self.store.erase(fid)
                raise
            self._vectors[fid] = vector
        self.manifest["next_id"] = fid + 1
        self.manifest["users"].setdefault(user, []).append(fid)
        self.manifest["facts"][str(fid)] = {"user": user, "text": text, "tokens": len(token_ids)}
        self._dirty = True
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
        self._dirty = True
        return fid

    def erase_fact(self, fact_id: int) -> None:
        key = str(fact_id)
        if key not in self.manifest["facts"] or fact_id == self.manifest["prefix"]:
            raise ValueError(f"MemoryStore.erase_fact: no user fact {fact_id}")
        if self._index is not None and self._index.contains(fact_id):
            self._index.erase([fact_id])
        self._vectors.pop(fact_id, None)
        self.store.erase(fact_id)
        user = self.manifest["facts"].pop(key)["user"]
        self.manifest["users"][user].remove(fact_id)
        if not self.manifest["users"][user]:
            del self.manifest["users"][user]
        self._dirty = True

    def _insert(self, fid, token_ids, keys, values):
        k = keys.float().numpy() if hasattr(keys, "numpy") else np.asarray(keys)
        v = values.float().numpy() if hasattr(values, "numpy") else np.asarray(values)
        kt, kbuf = _tensor(k)
        vt, vbuf = _tensor(v)
        self.store.insert(fid, 0, [int(t) for t in token_ids], kt, vt)
        del kbuf, vbuf

    # -- commit ---------------------------------------------------------------------------------
    def commit(self) -> int:
        """Writes a new generation (snapshot and embeddings, then the manifest by rename);
        returns it."""
        gen = self.manifest["generation"] + 1
        name = f"store-{gen}.iskv"
        self.store.save(os.path.join(self.directory, name))
        old = self.manifest.get("store")
        old_embeddings = self.manifest.get("embeddings")
        embeddings = None
        if self.retrieval:
            embeddings = f"embeddings-{gen}.npz"
            ids = np.array(sorted(self._vectors), dtype=np.uint64)
            dim = self.manifest["embedder"]["dim"]
            vectors = (np.stack([self._vectors[int(i)] for i in ids]) if len(ids)
                       else np.zeros((0, dim), np.float32))
            fd, tmp = tempfile.mkstemp(prefix=".embeddings-", suffix=".npz", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, ids=ids, vectors=vectors.astype(np.float32, copy=False))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, embeddings))
        manifest = dict(self.manifest, generation=gen, store=name, embeddings=embeddings)
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=self.directory)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, MANIFEST))
        self.manifest = manifest
        self._dirty = False
        for previous, current in ((old, name), (old_embeddings, embeddings)):
            if previous and previous != current:
                try:
                    os.remove(os.path.join(self.directory, previous))
                except FileNotFoundError:
                    pass
        return gen

    # -- retrieval ------------------------------------------------------------------------------
    @property
    def retrieval(self) -> bool:
        """Whether this memory embeds its facts (it was created with an embedder)."""
        return self.manifest.get("embedder") is not None

    def search(self, user: str, queries, k: int, *, algo: str = "automatic"):
        """The k facts of ``user`` nearest to each query embedding (``[n, dim]`` or ``[dim]``,
        any float type; cosine): ``(ids [n, k] int64, distances [n, k] float32)``, best first,
        distance = 1 - cosine. ``algo``: "automatic" (the library's choice: exact for small
        namespaces), "graph" or "exact". Refused (ValueError): a memory without retrieval, an
        unknown user, k outside 1 .. the user's facts, a wrong dimension, NaN or zero queries."""
        if not self.retrieval:
            raise ValueError("MemoryStore.search: this memory has no embedder "
                             "(MemoryStore.create(..., embedder=...))")
        facts = self.manifest["users"].get(user) if isinstance(user, str) else None
        if not facts:
            raise ValueError(f"MemoryStore.search: unknown user {user!r} (no facts)")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= len(facts):
            raise ValueError(f"MemoryStore.search: k must be in 1 .. {len(facts)} ({user!r}'s "
                             f"facts), got {k!r}")
        q = np.asarray(queries)
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self._index.dim:
            raise ValueError(f"MemoryStore.search: queries have shape {np.shape(queries)}, the "
                             f"index takes [n, {self._index.dim}]")
        if not np.issubdtype(q.dtype, np.floating):
            raise ValueError(f"MemoryStore.search: queries are {q.dtype}, not floating point")
        q = np.ascontiguousarray(q, dtype=np.float32)
        ids = np.empty((q.shape[0], int(k)), np.uint64)
        distances = np.empty((q.shape[0], int(k)), np.float32)
        self._index.search(self._ns[user], q.ctypes.data, q.shape[0], q.shape[1], int(k),
                           ids.ctypes.data, distances.ctypes.data, algo)
        if (ids == INVALID_ID).any():  # k <= the user's facts: every slot is a fact
            raise RuntimeError("MemoryStore.search: the index returned fewer facts than the user has")
        return ids.astype(np.int64), distances

    def retrieve(self, user: str, query: str, k: int, *, algo: str = "automatic") -> list[int]:
        """The ids of ``user``'s k facts nearest to the query text (cosine of the embeddings),
        best first. k larger than the user's facts is refused, never cut down."""
        if not self.retrieval:
            raise ValueError("MemoryStore.retrieve: this memory has no embedder "
                             "(MemoryStore.create(..., embedder=...))")
        self._need_embedder("retrieve")
        if not isinstance(user, str) or not self.manifest["users"].get(user):
            raise ValueError(f"MemoryStore.retrieve: unknown user {user!r} (no facts)")
        ids, _ = self.search(user, self.embedder.embed(query), k, algo=algo)
        return [int(i) for i in ids[0]]

    def _need_embedder(self, what: str) -> None:
        if self.embedder is None:
            raise ValueError(f"MemoryStore.{what}: this memory embeds with "
                             f"{self.manifest['embedder']['name']}; open it with that embedder "
                             "(MemoryStore.open(directory, embedder=...))")

    def _namespace(self, user: str) -> int:
        if user not in self._ns:
            self._ns[user] = len(self._ns) + 1
        return self._ns[user]

    def _build_index(self) -> None:
        """The index of the current facts, from their embeddings (one namespace per user)."""
        dim = self.manifest["embedder"]["dim"]
        index = Index(dim, "cosine")
        self._ns = {}
        for user in sorted(self.manifest["users"]):
            ids = self.manifest["users"][user]
            missing = [f for f in ids if f not in self._vectors]
            if missing:
                raise ValueError(f"inferscale: the memory at {self.directory} has no embeddings "
                                 f"for {user!r}'s facts {missing[:5]}")
            m = np.ascontiguousarray(np.stack([self._vectors[f] for f in ids]), dtype=np.float32)
            index.add(self._namespace(user), m.ctypes.data, m.shape[0], m.shape[1], list(ids))
        self._index = index

    # -- the client helper ----------------------------------------------------------------------
    def request_for_query(self, user: str, query: str, query_token_ids: list[int], k: int, *,
                          order: str = "best_last", recompute_tokens: int = 0) -> dict:
        """``request`` for the user's k facts retrieved for the query text: the same dict, plus
        "retrieved" (the ids, best first). ``order`` lays them out: "best_last" (the most
        relevant fact next to the query, as the library's memory facade does; with
        ``recompute_tokens`` the facts vLLM recomputes in context are the most relevant) or
        "best_first"."""
        if order not in ("best_last", "best_first"):
            raise ValueError(f"MemoryStore.request_for_query: order is 'best_last' or "
                             f"'best_first', got {order!r}")
        retrieved = self.retrieve(user, query, k)
        r = self.request(user, retrieved[::-1] if order == "best_last" else retrieved,
                         query_token_ids, recompute_tokens=recompute_tokens)
        r["retrieved"] = retrieved
        return r

    def request(self, user: str, facts: list[int], query_token_ids: list[int], *,
                recompute_tokens: int = 0) -> dict:
        """What to pass vLLM for a question answered with memory: the prompt (memory segment +
        query tokens, with the memory's prefix-cache salt) and the kv_transfer_params naming the
        user and the facts. Use as ``llm.generate(r["prompt"], SamplingParams(..., extra_args=
        r["extra_args"]))``. The same prompt without the extra_args is the re-prefill baseline.

        ``recompute_tokens``: the segment's last tokens that vLLM prefills in context instead of
        loading them (suffix recompute, the form of issue 30's recompute a KV connector allows:
        it can only hand vLLM a prefix of the prompt). Those tokens see every fact before them,
        so the facts at the end (the most relevant, with ``request_for_query``'s "best_last")
        regain the cross-fact attention independent encoding lacks; the connector loads the
        segment's whole blocks before them."""
        owned = set(self.manifest["users"].get(user, []))
        for f in facts:
            if f not in owned:
                raise ValueError(f"MemoryStore.request: fact {f} is not one of {user}'s facts")
        order = ([self.manifest["prefix"]] if self.manifest["prefix"] is not None else []) + list(facts)
        memory = self.store.composed_tokens(order)
        if (isinstance(recompute_tokens, bool) or not isinstance(recompute_tokens, int)
                or not 0 <= recompute_tokens <= len(memory)):
            raise ValueError(f"MemoryStore.request: recompute_tokens must be an int in [0, "
                             f"{len(memory)}] (the segment's tokens), got {recompute_tokens!r}")
        params = {"user": user, "facts": list(facts), "generation": self.generation,
                  "memory_tokens": len(memory)}
        if recompute_tokens:
            params["recompute_tokens"] = recompute_tokens
        return {"prompt": {"prompt_token_ids": list(memory) + list(query_token_ids),
                           "cache_salt": cache_salt(user, facts, self.generation,
                                                    recompute_tokens)},
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


def _check_embedder(recorded: dict, embedder, directory: str) -> None:
    if embedder is None:
        return  # the index still loads; adding and retrieving by text ask for the embedder
    got = embedder.description()
    for key in ("name", "dim"):
        if got.get(key) != recorded.get(key):
            raise ValueError(f"inferscale: the memory at {directory} embeds with {recorded}, "
                             f"this embedder is {got}")


def load_embeddings(directory: str, manifest: dict) -> dict:
    """fact id -> embedding (float32 [dim]) of a generation ({} without retrieval)."""
    name = manifest.get("embeddings")
    if manifest.get("embedder") is None:
        return {}
    if name is None:
        raise ValueError(f"inferscale: the memory at {directory} has an embedder but its "
                         "manifest names no embeddings file")
    path = os.path.join(directory, name)
    with np.load(path) as z:
        ids, vectors = z["ids"], z["vectors"]
    dim = manifest["embedder"]["dim"]
    if ids.ndim != 1 or vectors.shape != (ids.shape[0], dim) or vectors.dtype != np.float32:
        raise ValueError(f"inferscale: {path} holds ids {ids.shape} and vectors {vectors.shape} "
                         f"{vectors.dtype}; expected [n] and [n, {dim}] float32")
    return {int(i): vectors[j].copy() for j, i in enumerate(ids)}


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
