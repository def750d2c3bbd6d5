"""Capture while serving: the connector's save path (issue 48, item 2).

A request that asks to be remembered carries
``kv_transfer_params = {"inferscale_capture": {"id": "<capture id>"}}`` (the id: 1 to 64 of
``A-Z a-z 0-9 _ -``). Nothing else about it changes: vLLM schedules and prefills it as any other
request (chunked, prefix-cached, preempted, batched). The connector then

- on the scheduler side (``CaptureScheduler``): checks the parameter when vLLM adds the request
  (a malformed one is logged with the request id and ignored: the request is served, nothing is
  captured), and in the step whose batch holds the request's last prompt token hands the workers
  (``InferScaleMetadata.captures``) the prompt's token ids and the cache slot of every prompt
  token: the request's blocks as vLLM's KV cache manager holds them in that step;
- on each worker (``CaptureWriter``), after that step's forward (``wait_for_save``: by then vLLM
  has written every prompt token's K and V into its paged cache): reads those tokens back from the
  cache tensors vLLM registered, de-rotates the keys with the library's ``extract`` and the
  model's own rotary table, and writes this rank's KV heads, float32, atomically (a temporary file,
  fsync, rename, fsync of the folder) to ``<memory_dir>/.captures/<id>.rank<r>.npz``.

``read_capture(memory_dir, id, tp)`` joins the ranks' files into the whole model's heads and
removes them. No hook on the model: whatever the model does to K before its rotation (a norm, a
bias), the cache holds what attention reads, and the de-rotation is the exact inverse of the
rotation vLLM applied (the model's table; the pairing, rotary dims and scaling read from the
model's rotary module, ``model_rotary``), up to the rounding of the rotated keys to the cache
dtype.

File format (``np.load(path, allow_pickle=False)``):
  k, v          float32 [layers, tokens, heads_of_rank, head_dim] (v: the cache's values widened
                exactly; k: de-rotated in fp32 from the cache's keys)
  token_ids     int64 [tokens] (the prompt's, from position 0)
  first_head    int64 scalar: this rank's first KV head in the whole model
  num_heads     int64 scalar: this rank's KV heads (= k.shape[2])
  kv_heads      int64 scalar: the whole model's KV heads
  rank, tp_size int64 scalars: the tensor-parallel rank and size
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger("vllm.inferscale")

CAPTURE_PARAM = "inferscale_capture"  # the key in kv_transfer_params
CAPTURE_DIR = ".captures"  # under the memory directory
CAPTURE_KEYS = ("id",)  # the keys a capture parameter may have
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
NULL_BLOCK = 0  # vLLM's null block id (v1/core/block_pool.py: the first block of the pool)
KEEP_STORE_BYTES = 256 << 20  # the largest extraction store a worker keeps between captures
_FIELDS = ("k", "v", "token_ids", "first_head", "num_heads", "kv_heads", "rank", "tp_size")


def parse_capture_param(kv_transfer_params):
    """(capture id, None) for a request that asks to be captured, (None, reason) for a malformed
    ``inferscale_capture`` parameter, (None, None) when there is none. Never raises."""
    if not isinstance(kv_transfer_params, dict) or CAPTURE_PARAM not in kv_transfer_params:
        return None, None
    param = kv_transfer_params[CAPTURE_PARAM]
    if not isinstance(param, dict):
        return None, f"{CAPTURE_PARAM} must be a dict, got {type(param).__name__}"
    unknown = sorted(str(k) for k in param if k not in CAPTURE_KEYS)
    if unknown:
        return None, f"{CAPTURE_PARAM} has unknown keys {unknown} (allowed: {list(CAPTURE_KEYS)})"
    capture_id = param.get("id")
    if not isinstance(capture_id, str) or not _ID.fullmatch(capture_id):
        return None, (f"{CAPTURE_PARAM}.id must be 1 to 64 characters of A-Z a-z 0-9 _ -, got "
                      f"{capture_id!r:.80}")
    return capture_id, None


def capture_path(memory_dir: str, capture_id: str, rank: int) -> str:
    return os.path.join(memory_dir, CAPTURE_DIR, f"{capture_id}.rank{rank}.npz")


@dataclass
class CaptureJob:
    """One capture handed to the workers (in InferScaleMetadata.captures): the prompt's tokens,
    from position 0, and the cache slot each of them is in this step."""

    request_id: str
    capture_id: str
    token_ids: list
    slots: list


class CaptureScheduler:
    """The scheduler side's bookkeeping of capture requests (in the engine core)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.requests = {}  # request id -> (capture id, prompt token ids), until handed over
        self.counters = {"captures": 0, "malformed": 0}

    def on_new_request(self, request) -> None:
        try:
            capture_id, reason = parse_capture_param(getattr(request, "kv_transfer_params", None))
            if reason is not None:
                self.counters["malformed"] += 1
                logger.warning("inferscale: request %s: kv_transfer_params.%s ignored (nothing "
                               "is captured): %s", request.request_id, CAPTURE_PARAM, reason)
                return
            if capture_id is None:
                return
            prompt = list(request.prompt_token_ids or [])
            if not prompt:
                logger.warning("inferscale: request %s: capture %s ignored: the request has no "
                               "prompt token ids", request.request_id, capture_id)
                return
            self.requests[request.request_id] = (capture_id, prompt)
        except Exception as e:  # noqa: BLE001 - a request never takes the engine down
            logger.warning("inferscale: request %s: capture parameter ignored: %r",
                           getattr(request, "request_id", "?"), e)

    def jobs(self, scheduler_output, block_ids_of) -> list:
        """The captures whose request's last prompt token is computed in this step.
        block_ids_of(request id): the request's block ids (KV cache group 0), position order."""
        if not self.requests:
            return []
        jobs = []
        scheduled = scheduler_output.num_scheduled_tokens
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for request_id in list(self.requests):
            if request_id not in scheduled or request_id not in computed:
                continue
            capture_id, prompt = self.requests[request_id]
            n = len(prompt)
            start, count = computed[request_id], scheduled[request_id]
            if not start < n <= start + count:
                continue  # the prompt is not finished in this step (or was, earlier)
            del self.requests[request_id]
            try:
                blocks = list(block_ids_of(request_id))
                bs = self.block_size
                if len(blocks) * bs < n:
                    raise ValueError(f"{len(blocks)} blocks of {bs} for {n} prompt tokens")
                if NULL_BLOCK in blocks[: (n + bs - 1) // bs]:
                    # vLLM's placeholder for blocks a sliding window has dropped (block_pool.py
                    # L187: the pool's first block): those tokens are no longer in the cache
                    raise ValueError("some prompt blocks were dropped (sliding window)")
                slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
            except Exception as e:  # noqa: BLE001
                logger.warning("inferscale: request %s: capture %s not made: %s", request_id,
                               capture_id, e)
                continue
            jobs.append(CaptureJob(request_id, capture_id, prompt, slots))
            self.counters["captures"] += 1
        return jobs

    def finished(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_npz_atomically(path: str, arrays: dict) -> None:
    """`arrays` as an npz at `path`: a temporary file beside it, fsynced, renamed over `path`, and
    the folder fsynced; a reader sees the old file or the whole new one, never a part."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


class CaptureWriter:
    """The worker side: reads captured tokens back from this rank's paged cache and writes them.

    cache: the rank's VllmCpuCache (every layer of the model, this rank's KV heads); table: the
    model's cos/sin table as vLLM holds it (rows = positions, [cos | sin] of rotary_dim); neox:
    the model's pairing."""

    def __init__(self, memory_dir: str, cache, table, neox: bool, *, rank: int, tp: int,
                 first_head: int, kv_heads: int, exact: "ExactKeys | None" = None):
        import torch

        from . import _inferscale

        self.directory = os.path.join(memory_dir, CAPTURE_DIR)
        self.memory_dir = memory_dir
        self.cache = cache
        # De-rotation in fp32 with the table's values (a bf16 table widened exactly): the inverse
        # of the rotation vLLM applied with those values (extract divides by cos^2 + sin^2).
        self.table = table.detach().to("cpu", torch.float32).contiguous()
        self.rotation = _inferscale.Rotation(self.table, cache.head_dim, bool(neox), False, False)
        self.rank, self.tp, self.first_head, self.kv_heads = rank, tp, first_head, kv_heads
        # The float32 store extract writes into, kept between captures (a new one's pool costs
        # its page faults: 0.13 s for 1,024 tokens of SmolLM2 here) while it stays within
        # KEEP_STORE_BYTES; its one fact is erased after each read.
        self._store, self._store_tokens, self._buffer = None, 0, None
        # ExactKeys: the keys moved to bf16 keys that rotate back to vLLM's exact bytes
        self.exact = exact
        self.seconds = 0.0  # time spent capturing (extraction + writing), for the benchmark
        self.write_seconds = 0.0  # of which writing the file (npz, fsync, rename, fsync)
        self.written = 0
        self.lock = threading.Lock()

    def read(self, job: CaptureJob):
        """(k, v) float32 [layers, tokens, heads of this rank, head_dim] of the job's tokens (views
        of the writer's buffer, valid until its next read)."""
        from . import _inferscale

        n = len(job.slots)
        c = self.cache
        if n > self.table.shape[0]:
            raise ValueError(f"{n} tokens, the model's rotary table has {self.table.shape[0]} "
                             f"positions")
        pages = (n + 15) // 16
        per_token = c.num_layers * c.num_heads * c.head_dim  # elements of k (or v) per token
        if self._store is None or self._store_tokens < pages * 16:
            self._store, self._buffer = None, None
            store = _inferscale.Store(c.num_layers, c.num_heads, c.head_dim, "float32", pages, 16)
            if pages * 16 * per_token * 2 * 4 <= KEEP_STORE_BYTES:
                self._store, self._store_tokens = store, pages * 16
                # k and v's memory too (written to the file before the next capture reuses it)
                self._buffer = np.empty((2, pages * 16 * per_token), dtype=np.float32)
        else:
            store = self._store
        shape = (c.num_layers, n, c.num_heads, c.head_dim)
        try:
            _inferscale.extract(store, c, self.rotation, [int(s) for s in job.slots], 0, 1, 0,
                                [int(t) for t in job.token_ids])
            if self._buffer is not None and store is self._store:
                k = self._buffer[0, : n * per_token].reshape(shape)
                v = self._buffer[1, : n * per_token].reshape(shape)
            else:
                k, v = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
            store.read(1, k, v)
            if self.exact is not None:
                k = self.exact.fix(k, self.exact.raw_keys(c, job.slots, n))
        finally:
            if store.contains(1):
                store.erase(1)
        return k, v

    def capture(self, job: CaptureJob) -> str:
        t0 = time.perf_counter()
        k, v = self.read(job)
        t1 = time.perf_counter()
        os.makedirs(self.directory, exist_ok=True)
        path = capture_path(self.memory_dir, job.capture_id, self.rank)
        write_npz_atomically(path, {
            "k": k, "v": v, "token_ids": np.asarray(job.token_ids, dtype=np.int64),
            "first_head": np.int64(self.first_head), "num_heads": np.int64(k.shape[2]),
            "kv_heads": np.int64(self.kv_heads), "rank": np.int64(self.rank),
            "tp_size": np.int64(self.tp)})
        t2 = time.perf_counter()
        with self.lock:
            self.seconds += t2 - t0
            self.write_seconds += t2 - t1
            self.written += 1
        return path

    def run(self, jobs) -> None:
        """Every job of this step; a failure is logged with its request and never raised (the
        request itself is served as usual)."""
        for job in jobs:
            try:
                path = self.capture(job)
                logger.info("inferscale: request %s: captured %d tokens to %s", job.request_id,
                            len(job.slots), path)
            except Exception as e:  # noqa: BLE001 - a capture never takes the engine down
                logger.warning("inferscale: request %s: capture %s failed on rank %d: %s",
                               job.request_id, job.capture_id, self.rank, e)


class ExactKeys:
    """Moves de-rotated keys to bf16 keys that the engine's own rotation maps back to the bytes
    vLLM wrote, bit for bit.

    vLLM wrote round(R k) for bf16 pre-RoPE keys k; the capture reads those bytes back and
    de-rotates them exactly (in fp32), which gives k only up to that rounding. Some bf16 key near
    the de-rotation rotates back to the same bytes (k itself does), so: round the de-rotation to
    bf16, rotate it with `rotation` — the library's rotation that reproduces vLLM's rotary kernel
    bit for bit on this machine (connector.rotation_matching_vllm) — into a scratch cache, and
    where a rotary pair's bytes differ, try its bf16 neighbours (1, then 2 units in the last place
    each way) until they match. Stored, such keys re-inject at the captured positions exactly what
    vLLM's prefill wrote (Theorem 3 through the server); a pair no neighbour fixes is left as the
    rounding gave it (counted in `unmatched`)."""

    def __init__(self, rotation, mode: str, cache, isa: str, table, neox: bool):
        import torch

        self.rotation, self.isa, self.neox = rotation, isa, bool(neox)
        self.mode = mode  # connector.ROUNDING_MODES: how vLLM's kernel rounds (the grid's model)
        self.layers, self.heads, self.dim = cache.num_layers, cache.num_heads, cache.head_dim
        self.block = cache.block_size
        self.rotary = table.shape[1]
        self.table = table.detach().to("cpu", torch.float32).numpy()
        # the identity rotation (cos 1, sin 0): extract then reads a cache's keys as stored
        self.identity_table = torch.zeros(table.shape[0], self.rotary, dtype=torch.float32)
        self.identity_table[:, : self.rotary // 2] = 1.0
        from . import _inferscale

        self.identity = _inferscale.Rotation(self.identity_table, self.dim, self.neox, False,
                                             False)
        self.unmatched = 0

    def raw_keys(self, cache, slots, n):
        from . import _inferscale

        store = _inferscale.Store(self.layers, self.heads, self.dim, "float32", (n + 15) // 16, 16)
        _inferscale.extract(store, cache, self.identity, [int(x) for x in slots], 0, 1, 0,
                            [0] * n)
        k = np.empty((self.layers, n, self.heads, self.dim), np.float32)
        v = np.empty_like(k)
        store.read(1, k, v)
        return k

    def forward(self, keys):
        """The bytes (as float32) `rotation` writes for `keys` at positions 0 .. n-1."""
        import torch

        from . import _inferscale
        from .tensors import vllm_cpu_cache

        n = keys.shape[1]
        blocks = (n + self.block - 1) // self.block
        caches = {f"model.layers.{i}.self_attn.attn":
                  torch.zeros(blocks, self.heads, self.block, 2 * self.dim, dtype=torch.bfloat16)
                  for i in range(self.layers)}
        names = list(caches)
        cache = vllm_cpu_cache(caches, names, self.isa)
        # a bf16 store, as a memory of this model holds its keys: the rotation rounds in the
        # store's dtype where vLLM's kernel does (round_each), and the keys are bf16 values
        store = _inferscale.Store(self.layers, self.heads, self.dim, "bfloat16",
                                  (n + 15) // 16, 16)
        k = np.ascontiguousarray(keys, np.float32)
        store.insert(1, 0, [0] * n, k, k)
        _inferscale.inject(store, cache, self.rotation, [([1], 0, list(range(n)))])
        return self.raw_keys(cache, range(n), n)

    def fix(self, k: np.ndarray, wanted: np.ndarray) -> np.ndarray:
        """`k`: the de-rotated keys [layers, n, heads, dim]; `wanted`: the bytes vLLM wrote (as
        float32). Returns bf16-valued float32 keys."""
        bits = _bf16_bits(k)
        keys = bits.view(np.float32).copy()
        r = self.rotary
        idx = np.arange(r // 2)
        first, second = (idx, idx + r // 2) if self.neox else (2 * idx, 2 * idx + 1)

        def bad_pairs(got):
            d = (got != wanted)
            return d[..., first] | d[..., second]

        # one rotation by the library (the reference), then candidates chosen on a numpy model of
        # the kernel's rounding (vectorised, in chunks of pairs), each round checked by the
        # library again: bf16 neighbours first, then values spread over the pair's rounding
        # interval for an element small beside its pair's norm (whose error spans more of its
        # own units in the last place than a neighbour grid can hold)
        bad = bad_pairs(self.forward(keys))
        for radius in (1, self.RADIUS, None, "solve"):  # None: values over the interval
            if not bad.any():
                break
            if radius == "solve":
                keys = self._solve(keys, wanted, bad, first, second)
            else:
                keys = self._grid_chunked(keys, wanted, bad, first, second, radius)
            bad = bad_pairs(self.forward(keys))
        self.unmatched += int(bad.sum())
        return keys


    RADIUS = 6  # bf16 steps each way, per element of a pair

    def _model(self, ca, cb, c, s_):
        """vLLM's rotation of candidate pairs (ca, cb) by (c, s_), as `mode` rounds it."""
        import torch

        def bf(x):
            t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            return t.to(torch.bfloat16).to(torch.float64).numpy()

        if self.mode == "round_each":
            cr, sr = bf(c), bf(s_)
            return bf(bf(ca * cr) - bf(cb * sr)), bf(bf(cb * cr) + bf(ca * sr))
        fa = (ca * c - cb * s_).astype(np.float32)
        fb = (cb * c + ca * s_).astype(np.float32)
        if self.mode == "fp32_truncate":
            return ((fa.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64),
                    (fb.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64))
        return bf(fa), bf(fb)

    def _solve(self, keys, wanted, bad, first, second, span=512, near=8):
        """The pairs no grid fixed: their valid pre-images are a thin sliver (one output element
        small, its rounding cell narrow). Walk one input element over its bf16 lattice and solve
        the other from each output equation, then try the bf16 values around each solution."""
        r = self.rotary
        keys = keys.copy()
        for l, t, h, p in np.argwhere(bad):
            ia, ib = first[p], second[p]
            ya, yb = float(wanted[l, t, h, ia]), float(wanted[l, t, h, ib])
            c, s_ = float(self.table[t, p]), float(self.table[t, r // 2 + p])
            if self.mode == "round_each":  # the kernel's own (bf16) cos and sin
                import torch

                c, s_ = (float(torch.tensor(x).to(torch.bfloat16)) for x in (c, s_))
            norm = c * c + s_ * s_
            a_star, b_star = (ya * c + yb * s_) / norm, (yb * c - ya * s_) / norm
            steps = np.arange(-span, span + 1, dtype=np.int64) * 0x10000
            offs = np.arange(-near, near + 1, dtype=np.int64) * 0x10000
            cands = []
            for walk_a in (True, False):
                start = a_star if walk_a else b_star
                lattice = ((_bf16_bits(np.array([start])).astype(np.int64) + steps)
                           & 0xFFFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)
                x = lattice
                with np.errstate(divide="ignore", invalid="ignore"):
                    if walk_a:  # b from ya = a c - b s, and from yb = b c + a s
                        solved = [(x * c - ya) / s_, (yb - x * s_) / c]
                    else:  # a from ya = a c - b s, and from yb = b c + a s
                        solved = [(ya + x * s_) / c, (yb - x * c) / s_]
                for y in solved:
                    ok = np.isfinite(y)
                    yb_bits = _bf16_bits(np.where(ok, y, 0.0)).astype(np.int64)
                    other = ((yb_bits[:, None] + offs[None, :]) & 0xFFFFFFFF).astype(
                        np.uint32).view(np.float32).astype(np.float64)
                    xs = np.repeat(x[:, None], len(offs), axis=1)
                    pa, pb = (xs, other) if walk_a else (other, xs)
                    cands.append((pa[ok].ravel(), pb[ok].ravel()))
            pa = np.concatenate([a for a, _ in cands])
            pb = np.concatenate([b for _, b in cands])
            ga, gb = self._model(pa, pb, c, s_) if self.mode != "round_each" else self._model(
                pa, pb, np.float64(self.table[t, p]), np.float64(self.table[t, r // 2 + p]))
            hit = np.nonzero((ga == ya) & (gb == yb))[0]
            if len(hit):
                cur = np.array([keys[l, t, h, ia], keys[l, t, h, ib]], np.float64)
                d = np.abs(pa[hit] - cur[0]) + np.abs(pb[hit] - cur[1])
                j = hit[int(np.argmin(d))]
                keys[l, t, h, ia], keys[l, t, h, ib] = pa[j], pb[j]
        return keys

    def _grid_chunked(self, keys, wanted, bad, first, second, radius):
        """_grid over the bad pairs in chunks (bounded memory); radius None: the value grid."""
        where = np.argwhere(bad)
        chunk = 64 if radius is None else max(64, 200000 // (2 * radius + 1) ** 2)
        for start in range(0, len(where), chunk):
            part = np.zeros(bad.shape, bool)
            part[tuple(where[start:start + chunk].T)] = True
            keys = self._grid(keys, wanted, part, first, second,
                              radii=None if radius is None else (radius, radius),
                              values=radius is None)
        return keys

    def _grid(self, keys, wanted, bad, first, second, radii=None, values=False):
        """For each bad pair, the bf16 pair within RADIUS steps of each element whose rotation
        (vLLM's arithmetic as `mode` says, modelled in numpy) gives the wanted bytes, nearest the
        current guess (the library's rotation checks every choice afterwards)."""
        r = self.rotary
        where = np.argwhere(bad)  # (layer, token, head, pair)
        if len(where) == 0:
            return keys
        l, t, h, p = where.T
        a = keys[l, t, h, first[p]].astype(np.float32)
        b = keys[l, t, h, second[p]].astype(np.float32)
        ya = wanted[l, t, h, first[p]].astype(np.float64)
        yb = wanted[l, t, h, second[p]].astype(np.float64)
        cos = self.table[t, p].astype(np.float64)
        sin = self.table[t, r // 2 + p].astype(np.float64)
        ra, rb = radii if radii is not None else (self.RADIUS, self.RADIUS)
        da = np.arange(-ra, ra + 1, dtype=np.int64)
        db = np.arange(-rb, rb + 1, dtype=np.int64)
        if values:  # bf16 values spread over +-2^-6 of the pair's norm around each element
            span = np.hypot(a.astype(np.float64), b.astype(np.float64))[:, None] * 2.0 ** -6
            grid = np.linspace(-1.0, 1.0, 161)[None, :]
            ab = _bf16_bits(a.astype(np.float64)[:, None] + grid * span).astype(np.int64)
            bb = _bf16_bits(b.astype(np.float64)[:, None] + grid * span).astype(np.int64)
            da = db = np.abs(np.linspace(-80, 80, 161)).astype(np.int64)
        else:
            ab = (a.view(np.uint32).astype(np.int64)[:, None] + da * 0x10000) & 0xFFFFFFFF
            bb = (b.view(np.uint32).astype(np.int64)[:, None] + db * 0x10000) & 0xFFFFFFFF
        ca = ab.astype(np.uint32).view(np.float32).astype(np.float64)[:, :, None]
        cb = bb.astype(np.uint32).view(np.float32).astype(np.float64)[:, None, :]
        c, s_ = cos[:, None, None], sin[:, None, None]

        ga, gb = self._model(ca, cb, c, s_)  # vLLM's arithmetic as `mode` rounds it
        ok = (ga == ya[:, None, None]) & (gb == yb[:, None, None])
        cost = np.where(ok, np.abs(da)[None, :, None] + np.abs(db)[None, None, :], 10 ** 9)
        best = cost.reshape(len(where), -1).argmin(axis=1)
        found = cost.reshape(len(where), -1)[np.arange(len(where)), best] < 10 ** 9
        ia, ib = np.unravel_index(best, cost.shape[1:])
        keys = keys.copy()
        sel = np.nonzero(found)[0]
        keys[l[sel], t[sel], h[sel], first[p[sel]]] = ca[sel, ia[sel], 0]
        keys[l[sel], t[sel], h[sel], second[p[sel]]] = cb[sel, 0, ib[sel]]
        return keys


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float -> the nearest bfloat16 (ties to even), as float32 bit patterns (uint32; finite
    values: no carry out of 32 bits)."""
    u = np.array(a, dtype=np.float32).view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    u &= np.uint32(0xFFFF0000)
    return u


def _refuse(path, why):
    raise ValueError(f"inferscale: capture file {path}: {why}")


def _load_rank(path: str) -> dict:
    if not os.path.isfile(path):
        _refuse(path, "missing (not captured yet, failed, or another tensor-parallel size)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [f for f in _FIELDS if f not in z.files]
            if missing:
                _refuse(path, f"partial: no {missing}")
            out = {f: z[f] for f in _FIELDS}
    except ValueError as e:
        if str(e).startswith("inferscale:"):
            raise
        _refuse(path, f"unreadable ({e})")
    except (OSError, EOFError, KeyError, zipfile.BadZipFile) as e:
        _refuse(path, f"unreadable ({type(e).__name__}: {e})")
    return out


def read_capture(memory_dir: str, capture_id: str, tp: int = 1, *,
                 timeout: float = 5.0) -> dict:
    """The capture `capture_id` of a memory directory: ``{"k", "v": float32 [layers, tokens,
    kv_heads, head_dim], "token_ids": int64 [tokens]}``, the `tp` ranks' files joined by heads; the
    files are then removed. Raises ValueError naming the file when one is missing, unreadable,
    partial or inconsistent with the others (nothing is removed then).

    timeout: seconds to wait for rank files that are not there yet. At TP = 1 the file is written
    before vLLM returns the request's first token; at TP > 1 vLLM returns it from one rank while
    the others may still be writing theirs."""
    if not isinstance(capture_id, str) or not _ID.fullmatch(capture_id):
        raise ValueError(f"inferscale: capture id {capture_id!r:.80} is not 1 to 64 characters "
                         f"of A-Z a-z 0-9 _ -")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"inferscale: tp must be a positive int, got {tp!r}")
    paths = [capture_path(memory_dir, capture_id, r) for r in range(tp)]
    deadline = time.monotonic() + max(0.0, float(timeout))
    while not all(os.path.isfile(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.01)
    parts = [_load_rank(p) for p in paths]
    next_head = 0
    for r, (path, p) in enumerate(zip(paths, parts)):
        k, v = p["k"], p["v"]
        scalars = {f: p[f] for f in ("first_head", "num_heads", "kv_heads", "rank", "tp_size")}
        for f, a in scalars.items():
            if a.shape != () or a.dtype.kind not in "iu":
                _refuse(path, f"{f} is not an integer scalar ({a.dtype} {a.shape})")
        if int(scalars["rank"]) != r or int(scalars["tp_size"]) != tp:
            _refuse(path, f"written by rank {int(scalars['rank'])} of "
                          f"{int(scalars['tp_size'])}, expected rank {r} of {tp}")
        if k.dtype != np.float32 or v.dtype != np.float32 or k.ndim != 4 or k.shape != v.shape:
            _refuse(path, f"k {k.dtype} {k.shape} and v {v.dtype} {v.shape} are not float32 "
                          f"[layers, tokens, heads, head_dim] of one shape")
        ids = p["token_ids"]
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.shape[0] != k.shape[1]:
            _refuse(path, f"{ids.shape} token ids ({ids.dtype}) for {k.shape[1]} tokens")
        if int(scalars["num_heads"]) != k.shape[2] or int(scalars["first_head"]) != next_head:
            _refuse(path, f"heads [{int(scalars['first_head'])}, +{int(scalars['num_heads'])}) "
                          f"(k has {k.shape[2]}), expected the run to start at head {next_head}")
        next_head += k.shape[2]
        first = parts[0]
        if r and (k.shape[0] != first["k"].shape[0] or k.shape[1] != first["k"].shape[1]
                  or k.shape[3] != first["k"].shape[3]
                  or not np.array_equal(ids, first["token_ids"])
                  or int(scalars["kv_heads"]) != int(first["kv_heads"])):
            _refuse(path, f"another capture than {paths[0]}'s (layers, tokens, head size, token "
                          f"ids or the model's KV heads differ): one id reused?")
    if next_head != int(parts[0]["kv_heads"]):
        _refuse(paths[-1], f"the ranks hold {next_head} KV heads, the model "
                           f"{int(parts[0]['kv_heads'])}")
    out = {"k": np.concatenate([p["k"] for p in parts], axis=2),
           "v": np.concatenate([p["v"] for p in parts], axis=2),
           "token_ids": parts[0]["token_ids"].astype(np.int64)}
    for path in paths:
        os.remove(path)
    return out
