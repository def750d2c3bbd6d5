"""The memory directory: the library's memory facade bound once (``_inferscale.Memory``), what the
connector serves from, and the client helpers.

One on-disk format for C++ and Python: the directory is a snapshot of the C++ facade written by its
crash-safe ``save_memory`` — ``memory.ismem`` (the manifest, CRC-64 checksummed, naming every file
by its checksum), ``store-*.iskv`` (every fact's pre-RoPE K/V), ``index-*.isx`` (the facts' text
embeddings, one namespace per user), ``lifecycle-*.islc`` and ``application-*.isap``: this package's
record (JSON) of what the facade does not know — the model's identity, the store's configuration,
the embedder, each user's name and namespace, each fact's owner and text, the generation. All of it
is replaced by one atomic manifest rename; a reader never sees half of a generation, and a file of
another save is refused by its checksum. Beside it, ``salt.key`` (0600, made once) keys the
memory's prefix-cache salts, and ``.writer.lock`` is the writers' lock.

Contracts:
  - One writer at a time: a writer (``Memory.create`` / ``Memory.open(..., writer=True)``) holds an
    exclusive ``flock`` on ``.writer.lock`` until ``close()``; a second writer, in this process or
    another, is refused with ValueError at once (never two writers taking the same fact id).
  - Readers (``Memory.open(directory)``, ``MemoryReader``) take no lock and never fail because a
    writer commits: a load that meets files a commit removed reads the new manifest and tries
    again. A reader's refresh reads only what changed: the facts its loaded generation holds with
    the new store's bytes (per-fact CRC-64) are copied from it, the others read from disk.
  - Fact ids are never reused and a fact's K/V never change under its id, so a request planned
    against generation G injects the same bytes from any later generation that still holds its
    facts; a fact erased since is refused (the request falls back to prefill).
  - Every refusal is a ValueError with the reason and the path, raised before anything changes.

A memory without an embedder still goes through the facade, whose index then holds one 1-d unit
vector per fact (the facade's lifecycle needs an index entry); retrieval is refused for it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading

import numpy as np

from ._inferscale import Memory as _Facade

FORMAT = 2
MANIFEST = "memory.ismem"
LOCK = ".writer.lock"
SALT_KEY = "salt.key"
PREFIX_NAMESPACE = 0
MODEL_KEYS = ("name", "num_layers", "num_kv_heads", "head_dim", "rope_theta")
_USER = re.compile(r"[^\x00-\x1f]{1,256}")
# load attempts while a writer keeps committing under a reader (each attempt sees a newer manifest)
_LOAD_ATTEMPTS = 20


def _error(directory: str, what: str) -> ValueError:
    return ValueError(f"inferscale: memory {directory}: {what}")


def _check_user(user) -> str:
    if not isinstance(user, str) or not _USER.fullmatch(user):
        raise ValueError(f"inferscale: a user is a str of 1-256 printable characters, got {user!r}")
    return user


def _check_tokens(tokens, what: str) -> list[int]:
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"inferscale: {what} must be a list of token ids, got "
                         f"{type(tokens).__name__}")
    out = []
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < 2**31:
            raise ValueError(f"inferscale: {what} must hold token ids in [0, 2^31), got {t!r}")
        out.append(int(t))
    return out


def _kv(a, what: str) -> np.ndarray:
    """A [layers, tokens, heads, head_dim] float32 C-contiguous array from numpy or torch."""
    if hasattr(a, "detach"):  # torch
        a = a.detach().float().cpu().numpy()
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"inferscale: {what} are {a.dtype}, not floating point")
    return np.ascontiguousarray(a, dtype=np.float32)


def weights_digest(model_dir: str) -> str:
    """sha256 over the model folder's weight files (name, size and bytes, in name order): the
    model's identity beyond its geometry (two models of one geometry differ here)."""
    names = sorted(f for f in os.listdir(model_dir)
                   if f.endswith((".safetensors", ".bin", ".pt", ".gguf")))
    if not names:
        raise ValueError(f"inferscale: {model_dir} holds no weight files (*.safetensors, *.bin)")
    h = hashlib.sha256()
    for name in names:
        path = os.path.join(model_dir, name)
        h.update(f"{name}\0{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


_digests: dict = {}


def describe_model(model_config) -> dict:
    """What a memory records of the model it was encoded with, from vLLM's ModelConfig: the
    geometry, the rotation (theta, scaling, rotary fraction), the dtype and the weights' digest
    (weights_digest of a local folder; computed once per process and folder state). The
    connector refuses a serving model that differs in any of them."""
    hf = model_config.hf_config
    params = dict(getattr(hf, "rope_parameters", None) or {})
    theta = getattr(hf, "rope_theta", None)
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} or \
        getattr(hf, "rope_scaling", None)
    d = {"name": str(model_config.model),
         "num_layers": model_config.get_total_num_hidden_layers(),
         "num_kv_heads": model_config.get_total_num_kv_heads(),
         "head_dim": model_config.get_head_size(), "rope_theta": float(theta),
         "rope_scaling": json.loads(json.dumps(scaling, default=str)) if scaling else None,
         "partial_rotary_factor": float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0),
         "dtype": str(model_config.dtype).replace("torch.", "")}
    folder = str(model_config.model)
    if os.path.isdir(folder):
        state = tuple(sorted((f, os.stat(os.path.join(folder, f)).st_size,
                              os.stat(os.path.join(folder, f)).st_mtime_ns)
                             for f in os.listdir(folder)))
        key = (os.path.realpath(folder), state)
        if key not in _digests:
            _digests[key] = weights_digest(folder)
        d["weights"] = _digests[key]
    return d


def check_model(recorded: dict, running: dict) -> str | None:
    """Why a memory recorded for `recorded` must not serve `running` (both model descriptions),
    or None. Every key the memory recorded must match, the weights' digest among them."""
    for key, value in recorded.items():
        if key == "name":
            continue  # a folder may move; its weights' digest says whether it is the same model
        if running.get(key) != value:
            return (f"the memory was built for {key} = {value!r}, this model has "
                    f"{running.get(key)!r} (memory model {recorded.get('name')!r})")
    return None


class Memory:
    """A memory directory through the C++ facade: the writer's side (facts added, erased,
    committed) and a reader's (retrieval, requests)."""

    def __init__(self, directory: str, facade, app: dict, embedder=None, lock_fd=None):
        self.directory = directory
        self._facade = facade
        self.app = app
        self.embedder = embedder
        self._lock_fd = lock_fd
        self._dirty = False
        self._mutex = threading.RLock()  # one Python thread at a time changes app + facade
        if app.get("embedder") is not None and embedder is not None:
            got = embedder.description()
            for key in ("name", "dim"):
                if got.get(key) != app["embedder"].get(key):
                    raise _error(directory, f"it embeds with {app['embedder']}, this embedder is "
                                            f"{got}")

    # -- creation, opening, closing ---------------------------------------------------------
    @classmethod
    def create(cls, directory: str, *, model: dict, dtype: str = "bfloat16",
               num_pages: int = 4096, page_size: int = 16, embedder=None,
               compression: str = "none") -> "Memory":
        """A new, empty memory for a model (the caller becomes its writer). ``model`` names at
        least name, num_layers, num_kv_heads, head_dim and rope_theta; every key it holds (the
        weights' digest, the dtype, the rotation) is checked against the serving model.
        ``compression``: the store's, "none" or the library's "fp8_e4m3" / "int4" (codes with
        scales, dequantized to ``dtype`` by injection; the snapshot keeps it)."""
        for key in MODEL_KEYS:
            if key not in model:
                raise ValueError(f"inferscale: Memory.create: the model description lacks {key!r}")
        dim = 1
        description = None
        if embedder is not None:
            description = embedder.description()
            if not isinstance(description.get("dim"), int) or description["dim"] < 1:
                raise ValueError(f"inferscale: Memory.create: the embedder's description "
                                 f"{description} has no positive 'dim'")
            dim = description["dim"]
        os.makedirs(directory, exist_ok=True)
        lock_fd = _lock_writer(directory)
        try:
            if os.path.exists(os.path.join(directory, MANIFEST)):
                raise _error(directory, "it already holds a memory (Memory.open it)")
            store = {"dtype": dtype, "num_pages": int(num_pages), "page_size": int(page_size),
                     "embedding_dim": dim}
            if compression != "none":  # an uncompressed memory's record is as before
                store["compression"] = compression
            facade = _Facade(model["num_layers"], model["num_kv_heads"], model["head_dim"],
                             dtype, int(num_pages), int(page_size), dim, compression=compression)
            _make_salt_key(directory)
            app = {"format": FORMAT, "generation": 0, "model": dict(model), "store": store,
                   "embedder": description, "users": {}, "next_namespace": 1, "next_id": 1,
                   "facts": {}, "prefix": None}
            m = cls(directory, facade, app, embedder, lock_fd)
            m.commit()
            return m
        except BaseException:
            _unlock(lock_fd)
            raise

    @classmethod
    def open(cls, directory: str, embedder=None, *, writer: bool = False,
             dtype: str | None = None) -> "Memory":
        """The memory's newest generation; ``writer=True`` takes the writers' lock (refused while
        another writer holds it). A memory with retrieval needs ``embedder`` to add facts or to
        retrieve by text. ``dtype`` converts the store as it loads (the library's load_store:
        float32 widens exactly); a writer's next commit keeps that dtype."""
        lock_fd = _lock_writer(directory) if writer else None
        try:
            facade, app = load_generation(directory, dtype)
            return cls(directory, facade, app, embedder, lock_fd)
        except BaseException:
            _unlock(lock_fd)
            raise

    def close(self) -> None:
        """Gives the writers' lock back (uncommitted changes are dropped)."""
        _unlock(self._lock_fd)
        self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def refresh(self) -> bool:
        """A reader: loads a newer generation if one was committed; False when none was."""
        if self._lock_fd is not None:
            raise _error(self.directory, "refresh() is a reader's: this writer's generation is the "
                                         "newest")
        facade, app = load_generation(self.directory, previous=self._facade)
        if app["generation"] == self.generation:
            return False
        with self._mutex:
            self._facade, self.app = facade, app
        return True

    # -- what it holds ----------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.app["generation"]

    @property
    def model(self) -> dict:
        return self.app["model"]

    @property
    def manifest(self) -> dict:
        """The package's record of this generation (read-only use)."""
        return self.app

    @property
    def store(self):
        """The facade's store (a view: token ids, composed tokens, injection)."""
        return self._facade.store

    @property
    def facade(self):
        return self._facade

    @property
    def retrieval(self) -> bool:
        return self.app.get("embedder") is not None

    @property
    def prefix(self) -> int | None:
        return self.app["prefix"]

    def users(self) -> list[str]:
        return sorted(self.app["users"])

    def facts(self, user: str) -> list[int]:
        ns = self.app["users"].get(user) if isinstance(user, str) else None
        return [] if ns is None else sorted(int(i) for i in self._facade.facts(ns))

    def owner(self, fact_id: int) -> str | None:
        f = self.app["facts"].get(str(fact_id))
        return None if f is None else f["user"]

    def text(self, fact_id: int) -> str:
        f = self.app["facts"].get(str(fact_id))
        if f is None:
            raise _error(self.directory, f"no fact {fact_id!r}")
        return f["text"]

    # -- writing ----------------------------------------------------------------------------
    def _writer(self, what: str) -> None:
        if self._lock_fd is None:
            raise _error(self.directory, f"{what} needs the writer (Memory.open(..., writer=True))")

    def add_fact(self, user: str, text: str, token_ids, keys, values, *, context=(),
                 first_position: int = 0, embed_text: str | None = None, embedding=None) -> int:
        """Stores a fact of `user`: its tokens seen behind ``context`` (whose K/V are dropped) at
        positions ``first_position ..``; ``keys`` / ``values`` are the engine's pre-RoPE K/V of
        ``context + token_ids`` (``[layers, len(context) + len(token_ids), kv_heads, head_dim]``,
        any float type). With retrieval, ``embed_text`` (default ``text``) is embedded by the
        memory's embedder, or ``embedding`` is given. Nothing is written on a refusal."""
        return self.add_facts(user, [dict(text=text, token_ids=token_ids, keys=keys, values=values,
                                          context=context, first_position=first_position,
                                          embed_text=embed_text, embedding=embedding)])[0]

    def add_facts(self, user: str, facts: list[dict]) -> list[int]:
        """add_fact for several facts of one user, all or nothing (one facade call)."""
        self._writer("add_facts")
        _check_user(user)
        if not isinstance(facts, list) or not facts:
            raise ValueError("inferscale: add_facts takes a non-empty list of facts")
        with self._mutex:
            ids, contexts, tokens, positions, keys, values, texts, vectors = ([] for _ in range(8))
            next_id = self.app["next_id"]
            for i, f in enumerate(facts):
                text = f.get("text")
                if not isinstance(text, str) or not text.strip():
                    raise ValueError(f"inferscale: fact {i}: the text is a non-empty str, got "
                                     f"{text!r}")
                toks = _check_tokens(f.get("token_ids"), f"fact {i}'s token_ids")
                ctx = _check_tokens(f.get("context", ()), f"fact {i}'s context")
                if not toks:
                    raise ValueError(f"inferscale: fact {i} has no tokens")
                p0 = f.get("first_position", 0)
                if isinstance(p0, bool) or not isinstance(p0, int) or p0 < 0:
                    raise ValueError(f"inferscale: fact {i}: first_position is an int >= 0")
                ids.append(next_id + i)
                contexts.append(ctx)
                tokens.append(toks)
                positions.append(p0)
                keys.append(_kv(f.get("keys"), f"fact {i}'s keys"))
                values.append(_kv(f.get("values"), f"fact {i}'s values"))
                texts.append(text)
                vectors.append(self._embedding(f, text))
            ns = self.app["users"].get(user)
            new_user = ns is None
            if new_user:
                ns = self.app["next_namespace"]
            # unique texts for the embedder adapter: the facade embeds by text
            keyed = [f"{fid}\0{t}" for fid, t in zip(ids, texts)]
            self._facade.add_facts(ns, ids, contexts, tokens, positions, keys, values, keyed,
                                   np.ascontiguousarray(np.stack(vectors), dtype=np.float32))
            if new_user:
                self.app["users"][user] = ns
                self.app["next_namespace"] = ns + 1
            for fid, text in zip(ids, texts):
                self.app["facts"][str(fid)] = {"user": user, "text": text}
            self.app["next_id"] = next_id + len(ids)
            self._dirty = True
            return ids

    def _embedding(self, f: dict, text: str) -> np.ndarray:
        dim = self.app["store"]["embedding_dim"]
        if not self.retrieval:
            if f.get("embedding") is not None or f.get("embed_text") is not None:
                raise _error(self.directory, "an embedding was given, but this memory has no "
                                             "embedder (Memory.create(..., embedder=...))")
            return np.ones(1, np.float32)
        if f.get("embedding") is not None:
            v = np.asarray(f["embedding"], dtype=np.float32).reshape(-1)
        else:
            self._need_embedder("add_fact")
            v = np.asarray(self.embedder.embed(f.get("embed_text") or text)[0], np.float32)
        if v.shape != (dim,) or not np.isfinite(v).all() or not np.any(v):
            raise ValueError(f"inferscale: a fact's embedding must be {dim} finite values, not all "
                             f"zero (got shape {v.shape})")
        return v

    def set_prefix(self, text: str, token_ids, keys, values) -> int:
        """The shared head of every memory segment (e.g. the chat template's system turn), set
        once: its K/V at position 0, injected first in every request."""
        self._writer("set_prefix")
        toks = _check_tokens(token_ids, "the prefix's token_ids")
        with self._mutex:
            if self.app["prefix"] is not None:
                raise _error(self.directory, f"the prefix is already set (fact "
                                             f"{self.app['prefix']})")
            fid = self.app["next_id"]
            self._facade.set_instruction_prefix(toks, fid, PREFIX_NAMESPACE,
                                                _kv(keys, "the prefix's keys"),
                                                _kv(values, "the prefix's values"))
            self.app["prefix"] = fid
            self.app["facts"][str(fid)] = {"user": None, "text": text}
            self.app["next_id"] = fid + 1
            self._dirty = True
            return fid

    def erase_fact(self, fact_id: int, user: str | None = None) -> None:
        """Erases a fact (its K/V pages zeroed); with `user`, only one of that user's."""
        self._writer("erase_fact")
        with self._mutex:
            f = self.app["facts"].get(str(fact_id)) if isinstance(fact_id, int) else None
            if f is None or f["user"] is None:
                raise _error(self.directory, f"no user fact {fact_id!r}")
            if user is not None and f["user"] != user:
                raise _error(self.directory, f"fact {fact_id} is not one of {user!r}'s facts")
            self._facade.erase_fact(int(fact_id))
            del self.app["facts"][str(fact_id)]
            self._dirty = True

    def erase_user(self, user: str) -> int:
        """Forgets a user: every fact erased; returns how many."""
        self._writer("erase_user")
        with self._mutex:
            ns = self.app["users"].get(user) if isinstance(user, str) else None
            if ns is None:
                raise _error(self.directory, f"unknown user {user!r}")
            n = self._facade.erase_namespace(ns)
            for key in [k for k, f in self.app["facts"].items() if f["user"] == user]:
                del self.app["facts"][key]
            del self.app["users"][user]
            self._dirty = True
            return int(n)

    def commit(self) -> int:
        """Writes a new generation with the facade's crash-safe save (every file and this
        package's record in one directory transaction); returns it."""
        self._writer("commit")
        with self._mutex:
            app = dict(self.app, generation=self.app["generation"] + 1)
            self._facade.save(self.directory, json.dumps(app, sort_keys=True).encode())
            self.app = app
            self._dirty = False
            return app["generation"]

    # -- retrieval and requests -------------------------------------------------------------
    def retrieve(self, user: str, query, k: int) -> list[int]:
        """The ids of `user`'s k facts nearest to the query (a text, embedded by the memory's
        embedder, or an embedding), most relevant first. k outside 1 .. the user's facts, an
        unknown user and a memory without retrieval are refused, never cut down."""
        if not self.retrieval:
            raise _error(self.directory, "it has no embedder: retrieval is not available")
        ns = self.app["users"].get(user) if isinstance(user, str) else None
        facts = self.facts(user) if ns is not None else []
        if not facts:
            raise _error(self.directory, f"unknown user {user!r} (no facts)")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= len(facts):
            raise ValueError(f"inferscale: k must be an int in 1 .. {len(facts)} ({user!r}'s "
                             f"facts), got {k!r}")
        if isinstance(query, str):
            self._need_embedder("retrieve")
            vector = np.asarray(self.embedder.embed(query)[0], np.float32)
        else:
            vector = np.asarray(query, np.float32).reshape(-1)
        dim = self.app["store"]["embedding_dim"]
        if vector.shape != (dim,):
            raise ValueError(f"inferscale: a query embedding has {dim} values, got shape "
                             f"{vector.shape}")
        if not np.isfinite(vector).all():
            raise ValueError("inferscale: the query embedding holds NaN or infinite values")
        if not np.any(vector):
            raise ValueError("inferscale: the query embedding is all zero (no direction to "
                             "compare under cosine)")
        return [int(i) for i in self._facade.retrieve(ns, np.ascontiguousarray(vector), int(k))]

    def search(self, user: str, queries, k: int):
        """Ids (best first) of `user`'s k nearest facts for each query embedding ([n, dim])."""
        q = np.atleast_2d(np.asarray(queries, np.float32))
        return np.array([self.retrieve(user, row, k) for row in q], np.int64)

    def _need_embedder(self, what: str) -> None:
        if self.embedder is None:
            raise _error(self.directory, f"{what}: it embeds with {self.app['embedder']['name']}; "
                                         "open it with that embedder")

    def salt(self, user: str, facts: list[int], recompute_tokens: int = 0) -> str:
        return cache_salt(self.directory, user, facts, self.generation, recompute_tokens)

    def request(self, user: str, facts: list[int], query_token_ids, *,
                recompute_tokens: int = 0) -> dict:
        """What to pass vLLM for a question answered with memory: the prompt (the prefix and
        `facts` in this order, then the query) with the memory's keyed cache salt, and the
        kv_transfer_params naming the user and the facts."""
        owned = set(self.facts(user))
        if not isinstance(facts, list) or not facts:
            raise ValueError("inferscale: facts must be a non-empty list of fact ids")
        for f in facts:
            if isinstance(f, bool) or not isinstance(f, int) or f not in owned:
                raise _error(self.directory, f"fact {f!r} is not one of {user!r}'s facts")
        if len(set(facts)) != len(facts):
            raise ValueError(f"inferscale: facts {facts} name a fact twice")
        query = _check_tokens(query_token_ids, "query_token_ids")
        order = ([self.prefix] if self.prefix is not None else []) + list(facts)
        memory = list(self.store.composed_tokens(order))
        if (isinstance(recompute_tokens, bool) or not isinstance(recompute_tokens, int)
                or not 0 <= recompute_tokens <= len(memory)):
            raise ValueError(f"inferscale: recompute_tokens must be an int in [0, {len(memory)}] "
                             f"(the segment's tokens), got {recompute_tokens!r}")
        params = {"user": user, "facts": list(facts), "generation": self.generation,
                  "memory_tokens": len(memory)}
        if recompute_tokens:
            params["recompute_tokens"] = recompute_tokens
        return {"prompt": {"prompt_token_ids": memory + query,
                           "cache_salt": self.salt(user, facts, recompute_tokens)},
                "extra_args": {"kv_transfer_params": {"inferscale": params}},
                "memory_tokens": len(memory)}

    def request_for_query(self, user: str, query: str, query_token_ids, k: int, *,
                          order: str = "best_last", recompute_tokens: int = 0) -> dict:
        """``request`` for the user's k facts retrieved for the query text, laid out with the
        most relevant fact last (next to the query: "best_last", the facade's layout) or first;
        the dict also names them ("retrieved", best first)."""
        if order not in ("best_last", "best_first"):
            raise ValueError(f"inferscale: order is 'best_last' or 'best_first', got {order!r}")
        retrieved = self.retrieve(user, query, k)
        r = self.request(user, retrieved[::-1] if order == "best_last" else retrieved,
                         query_token_ids, recompute_tokens=recompute_tokens)
        r["retrieved"] = retrieved
        return r


# -- the directory's files ----------------------------------------------------------------------
def _lock_writer(directory: str) -> int:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise _error(directory, f"another writer holds {path} (one writer at a time; readers "
                                    "need no lock)") from None
        raise _error(directory, f"cannot lock {path}: {e}") from None
    return fd


def _unlock(fd) -> None:
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _make_salt_key(directory: str) -> None:
    path = os.path.join(directory, SALT_KEY)
    if os.path.exists(path):
        return
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


_salt_keys: dict = {}


def salt_key(directory: str) -> bytes:
    """The memory's secret salt key (read once per process)."""
    path = os.path.realpath(os.path.join(directory, SALT_KEY))
    key = _salt_keys.get(path)
    if key is None:
        try:
            with open(path, "rb") as f:
                key = f.read()
        except OSError as e:
            raise _error(directory, f"cannot read its salt key {path}: {e.strerror}") from None
        if len(key) != 32:
            raise _error(directory, f"its salt key {path} holds {len(key)} bytes, expected 32")
        _salt_keys[path] = key
    return key


def cache_salt(directory: str, user: str, facts: list[int], generation: int,
               recompute_tokens: int = 0) -> str:
    """The prefix-cache salt of a memory request: vLLM hashes it into the first block, so blocks
    filled from memory are shared only by requests with the same user, facts, generation and
    recompute setting, never with a plain-text request. Keyed (HMAC-SHA256) with the memory's
    secret: no tenant can compute another's."""
    msg = f"inferscale/2/{user}/{generation}/{','.join(str(f) for f in facts)}/{recompute_tokens}"
    digest = hmac.new(salt_key(directory), msg.encode(), hashlib.sha256).hexdigest()
    return "inferscale-" + digest[:40]


def _manifest_stamp(directory: str):
    st = os.stat(os.path.join(directory, MANIFEST))
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _parse_app(directory: str, data) -> dict:
    if data is None:
        raise _error(directory, "its snapshot carries no inferscale_vllm record (written by "
                                "the C++ library alone?)")
    try:
        app = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _error(directory, f"its record is not JSON: {e}") from None
    problem = _check_app(app)
    if problem:
        raise _error(directory, f"its record is malformed: {problem}")
    return app


def _check_app(app) -> str | None:
    if not isinstance(app, dict):
        return "not an object"
    if app.get("format") != FORMAT:
        return f"format {app.get('format')!r}, this package reads {FORMAT}"
    ints = ("generation", "next_namespace", "next_id")
    if any(isinstance(app.get(k), bool) or not isinstance(app.get(k), int) for k in ints):
        return f"{ints} must be ints"
    model, store = app.get("model"), app.get("store")
    if not isinstance(model, dict) or any(k not in model for k in MODEL_KEYS):
        return f"model must name {MODEL_KEYS}"
    if not isinstance(store, dict) or any(not isinstance(store.get(k), int) for k in
                                          ("num_pages", "page_size", "embedding_dim")) \
            or not isinstance(store.get("dtype"), str):
        return "store must give dtype, num_pages, page_size, embedding_dim"
    if not isinstance(store.get("compression", "none"), str):
        return "store's compression must be a str"
    users, facts = app.get("users"), app.get("facts")
    if not isinstance(users, dict) or not all(isinstance(u, str) and isinstance(n, int)
                                              for u, n in users.items()):
        return "users must map names to namespaces"
    if not isinstance(facts, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("text"), str)
            and (f.get("user") is None or f.get("user") in users) for f in facts.values()):
        return "facts must map ids to {user, text} of known users"
    if app.get("prefix") is not None and not isinstance(app["prefix"], int):
        return "prefix must be a fact id or null"
    return None


def load_generation(directory: str, dtype: str | None = None, previous=None):
    """(facade, record) of the directory's newest generation, every file checked (``dtype``:
    the store converted to it as it loads). A commit that replaces the snapshot while it loads
    (its old files removed) makes it load the new one.

    ``previous`` (a facade, e.g. the generation a reader serves): the library's incremental
    load_memory: the facts it holds with the new store file's bytes (each fact's pages checked
    against the file's per-fact CRC-64) are copied from it, and only the other facts' pages are
    read from disk; the result is the full load's, byte for byte."""
    last = None
    for _ in range(_LOAD_ATTEMPTS):
        try:
            stamp = _manifest_stamp(directory)
        except FileNotFoundError:
            raise _error(directory, f"no memory here (no {MANIFEST})") from None
        try:
            app = _parse_app(directory, _Facade.application(directory))
            s = app["store"]
            m = app["model"]
            facade, data = _Facade.load(directory, m["num_layers"], m["num_kv_heads"],
                                        m["head_dim"], dtype or s["dtype"], s["num_pages"],
                                        s["page_size"], s["embedding_dim"], previous,
                                        compression=s.get("compression", "none"))
            if _parse_app(directory, data) != app:
                raise ValueError("the snapshot changed while it loaded")
            if dtype:
                app = dict(app, store=dict(s, dtype=dtype))
            return facade, app
        except (ValueError, OSError) as e:
            last = e
            try:
                if _manifest_stamp(directory) == stamp:
                    raise  # the same snapshot: a real refusal
            except FileNotFoundError:
                raise _error(directory, f"no memory here (no {MANIFEST})") from None
    raise _error(directory, f"it kept changing while it loaded ({_LOAD_ATTEMPTS} attempts; last: "
                            f"{last})")


class MemoryReader:
    """What the connector serves from: the newest generation, loaded off the caller's path.

    ``current()`` returns the loaded generation at once and, when the manifest changed, starts
    loading the new one in a background thread; ``wait_for(generation, timeout)`` blocks until a
    generation at least that new is loaded (a worker asked to inject facts of it). A new
    generation is loaded incrementally from the one loaded (``load_generation(..., previous=)``):
    a commit of one fact costs the small files, the store's catalogue and that fact's pages."""

    def __init__(self, directory: str, transform=None):
        self.directory = directory
        self._transform = transform  # (facade, app) -> what the reader keeps (a worker's shard)
        self._lock = threading.Condition()
        self._loaded = None  # (stamp, app, value, facade)
        self._loading = False
        self._error = None

    def _load(self, stamp):
        try:
            with self._lock:
                previous = None if self._loaded is None else self._loaded[3]
            # only what changed since the generation served is read (the incremental load)
            facade, app = load_generation(self.directory, previous=previous)
            del previous
            value = self._transform(facade, app) if self._transform else facade
            with self._lock:
                self._loaded = (stamp, app, value, facade)
                self._error = None
        except Exception as e:  # noqa: BLE001 - reported through poll()
            with self._lock:
                first = repr(e) != repr(self._error)
                self._error = e
            if first:  # the last good generation keeps serving the requests that name it
                logging.getLogger("vllm.inferscale").warning(
                    "inferscale: a new generation of %s cannot be loaded (%s); requests naming "
                    "it are prefilled", self.directory, e)
        finally:
            with self._lock:
                self._loading = False
                self._lock.notify_all()

    @property
    def loading(self) -> bool:
        """True while a newer generation is being loaded in the background."""
        with self._lock:
            return self._loading

    def poll(self, block: bool = False):
        """Starts a load when the manifest changed (in the background unless `block` or nothing
        is loaded yet); returns (app, value) of the loaded generation or raises its error."""
        try:
            stamp = _manifest_stamp(self.directory)
        except OSError as e:
            raise _error(self.directory, f"cannot read {MANIFEST}: {e.strerror}") from None
        with self._lock:
            stale = self._loaded is None or self._loaded[0] != stamp
            start = stale and not self._loading
            if start:
                self._loading = True
        if start:
            if block or self._loaded is None:
                self._load(stamp)
            else:
                threading.Thread(target=self._load, args=(stamp,), daemon=True,
                                 name="inferscale-memory-load").start()
        with self._lock:
            if self._loaded is None:
                raise self._error or _error(self.directory, "not loaded")
            return self._loaded[1], self._loaded[2]

    def wait_for(self, generation: int, timeout: float = 30.0):
        """(app, value) of a generation >= `generation`, loading it if needed."""
        app, value = self.poll()
        if app["generation"] >= generation:
            return app, value
        with self._lock:
            self._lock.wait_for(lambda: not self._loading, timeout)
        app, value = self.poll(block=True)
        if app["generation"] < generation:
            raise _error(self.directory, f"generation {generation} is not (yet) committed; the "
                                         f"newest is {app['generation']}")
        return app, value


def shard_store(full, fact_ids, first_head: int, num_heads: int, first_layer: int = 0,
                num_layers: int | None = None, page_size: int = 16):
    """The heads [first_head, first_head + num_heads) of the layers [first_layer, first_layer +
    num_layers) of every fact in `fact_ids` (a tensor-parallel rank's heads in a pipeline stage's
    layers; the shard's layer 0 is the model's layer first_layer), as a Store of its own.

    An uncompressed store is sliced by the library (``Store.slice``, slice_store.hpp): the
    slice's rows copied page by page, byte for byte, in the full store's page size (1,000
    SmolLM2 facts, one KV head of three: 63-69 ms against 470-483 ms through float32 arrays on
    an AMD EPYC). A compressed store's facts are dequantized into an uncompressed shard of
    `page_size`-token pages (the values its injection writes)."""
    from ._inferscale import Store

    layers, heads, dim = full.geometry
    if num_layers is None:
        num_layers = layers - first_layer
    if not (0 <= first_layer and num_layers >= 1 and first_layer + num_layers <= layers):
        raise ValueError(f"shard_store: layers [{first_layer}, {first_layer + num_layers}) are "
                         f"not inside the store's {layers}")
    if not (0 <= first_head and num_heads >= 1 and first_head + num_heads <= heads):
        raise ValueError(f"shard_store: KV heads [{first_head}, {first_head + num_heads}) are not "
                         f"inside the store's {heads}")
    fact_ids = [int(f) for f in fact_ids]
    if full.compression == "none":
        # the library's slice_store: the rows of the slice copied page by page, byte for byte
        return full.slice(fact_ids, first_head, num_heads, first_layer, num_layers)
    # A compressed store's blocks are scaled per page and head: its facts dequantized and stored
    # uncompressed (the injection of a compressed store writes those very values).
    pages = max(1, sum((full.length(f) + page_size - 1) // page_size for f in fact_ids))
    shard = Store(num_layers, heads, dim, full.dtype, pages, page_size, first_head, num_heads)
    for fid in fact_ids:
        n = full.length(fid)
        k = np.empty((layers, n, heads, dim), np.float32)
        v = np.empty_like(k)
        full.read(fid, k, v)
        shard.insert(fid, full.namespace_of(fid), full.token_ids(fid),
                     k[first_layer:first_layer + num_layers],
                     v[first_layer:first_layer + num_layers])
    return shard
