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
  cache tensors vLLM registered exactly as cached (the library's ``extract`` with an identity
  rotation: any layout the library describes) and writes them with what the reader needs to
  de-rotate them, this rank's KV heads, atomically (a temporary file, fsync, rename, fsync of the
  folder) to ``<memory_dir>/.captures/<id>.rank<r>.npz``. That is all the engine step pays for.

``read_capture(memory_dir, id, tp)``, in the process that asks for the capture (the server's
write path), off the engine step: checks each rank's file, de-rotates its keys with the library's
``extract`` and the model's own rotary table (``derotate``), moves them with ``ExactKeys`` to bf16
keys that the engine's rotation maps back to the cached bytes (the rounding the worker found
vLLM's rotary kernel to use), joins the ranks' heads into the whole model's and removes the
files. No hook on the model: whatever the model does to K before its rotation (a norm, a bias),
the cache holds what attention reads, and the de-rotation is the exact inverse of the rotation
vLLM applied (the model's table; the pairing, rotary dims and scaling read from the model's rotary
module, ``model_rotary``), up to the rounding of the rotated keys to the cache dtype, which
ExactKeys then resolves.

File format (``np.load(path, allow_pickle=False)``), one file per tensor-parallel rank; every
field is checked on read and a file missing one, or with one malformed, is refused naming it:
  k_cached, v_cached  [layers, tokens, heads_of_rank, head_dim]: the rotated keys and the values
                exactly as the cache holds them, in cache_dtype (bfloat16: its bit patterns as
                uint16; float16; float32)
  cache_dtype   str: "bfloat16", "float16" or "float32"
  table         float32 [tokens, rotary_dim]: the model's cos|sin table rows of positions
                0 .. tokens-1 as the engine's rotation reads them, widened exactly
  table_dtype   str: the dtype the engine's rotation reads the table in ("bfloat16", ...)
  neox          bool scalar: the model's pairing (halves; False: GPT-J's interleaved pairs)
  rounding      str: how vLLM's rotary kernel rounds on the worker's machine (``ROUNDING_MODES``),
                "" if unknown (the reader then gives the plain de-rotation)
  token_ids     int64 [tokens] (the prompt's, from position 0)
  first_head    int64 scalar: this rank's first KV head in the whole model
  num_heads     int64 scalar: this rank's KV heads (= k_cached.shape[2])
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
_FIELDS = ("k_cached", "v_cached", "cache_dtype", "table", "table_dtype", "neox", "rounding",
           "token_ids", "first_head", "num_heads", "kv_heads", "rank", "tp_size")
# How a cache's elements are stored in the file, exactly: bfloat16 as its bit patterns
_STORED_AS = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}
# How vLLM's rotary kernel rounds, as the library's Rotation reproduces it: (round each
# operation, truncate fp32 to bf16), in the order connector.rotation_matching_vllm tries them.
ROUNDING_MODES = {"round_each": (True, False), "fp32_truncate": (False, True),
                  "fp32_nearest": (False, False)}


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
    """The worker side: reads captured tokens back from this rank's paged cache, as cached, and
    writes them (the module docstring's file format). Nothing else runs in the engine step: the
    de-rotation and ExactKeys run in the process that reads the capture (``read_capture``).

    cache: the rank's VllmCpuCache (every layer of the model, this rank's KV heads); tensors: the
    cache tensors it describes, in its layer order (their dtype is the file's cache_dtype);
    table: the model's cos/sin table as the engine's rotation reads it (rows = positions, [cos |
    sin] of rotary_dim, its dtype kept); neox: the model's pairing; rounding: how vLLM's rotary
    kernel rounds on this machine (``ROUNDING_MODES``, found by
    connector.rotation_matching_vllm), None if unknown (the reader then gives the plain
    de-rotation only).

    The read-back is one gather per layer and K/V: the element offsets of every (token, head,
    dim) come from the library's description of the cache (``key_offset``, ``value_offset``;
    offset = block part + token part + (head, dim) part, cache.hpp), taken once here, so any
    layout the library describes (vLLM's vec and amx) is read as it describes it, in the
    cache's own dtype, with no conversion."""

    def __init__(self, memory_dir: str, cache, tensors, table, neox: bool, *, rank: int, tp: int,
                 first_head: int, kv_heads: int, rounding: "str | None" = None):
        import torch

        tensors = list(tensors)
        cache_dtype = str(tensors[0].dtype).replace("torch.", "") if tensors else None
        if len(tensors) != cache.num_layers or any(
                t.dtype != tensors[0].dtype or t.shape != tensors[0].shape
                or t.stride() != tensors[0].stride() or t.device.type != "cpu" for t in tensors):
            raise ValueError(f"inferscale: capture needs the cache's {cache.num_layers} layer "
                             f"tensors, on the CPU, of one dtype, shape and strides")
        if cache_dtype not in _STORED_AS:
            raise ValueError(f"inferscale: capture of a {cache_dtype!r} cache (supported: "
                             f"{sorted(_STORED_AS)})")
        if rounding is not None and rounding not in ROUNDING_MODES:
            raise ValueError(f"inferscale: rounding {rounding!r} is none of "
                             f"{list(ROUNDING_MODES)}")
        table_dtype = str(table.dtype).replace("torch.", "")
        if table_dtype not in _STORED_AS:
            raise ValueError(f"inferscale: a {table_dtype} rotary table (supported: "
                             f"{sorted(_STORED_AS)})")
        self.directory = os.path.join(memory_dir, CAPTURE_DIR)
        self.memory_dir = memory_dir
        self.cache, self.tensors, self.cache_dtype = cache, tensors, cache_dtype
        self.neox, self.rounding, self.table_dtype = bool(neox), rounding or "", table_dtype
        # the table's rows as the file carries them: its values widened exactly to float32
        self.table = table.detach().to("cpu", torch.float32).contiguous().numpy()
        self.rank, self.tp, self.first_head, self.kv_heads = rank, tp, first_head, kv_heads
        self._offsets()
        self.seconds = 0.0  # time spent capturing in the step (read-back + writing), for benches
        self.write_seconds = 0.0  # of which writing the file (npz, fsync, rename, fsync)
        self.written = 0
        self.lock = threading.Lock()

    def _offsets(self):
        """The parts of each element's offset from its layer's base, from the library's cache
        description: per (head, dim), per token of a block, per block; checked against the
        library at a few slots (a layout whose offset is not such a sum is refused)."""
        c = self.cache
        heads, dim, bs = c.num_heads, c.head_dim, c.block_size
        self._parts = {}
        for name, at in (("k", c.key_offset), ("v", c.value_offset)):
            origin = at(0, 0, 0)
            head_dim = np.array([[at(0, h, d) - origin for d in range(dim)] for h in range(heads)],
                                np.int64)
            token = np.array([at(t, 0, 0) - origin for t in range(bs)], np.int64)
            block = at(bs, 0, 0) - origin if c.num_slots > bs else 0
            self._parts[name] = (origin, block, token, head_dim)
        probes = {0, bs - 1, min(bs + 1, c.num_slots - 1), c.num_slots - 1}
        span = self.tensors[0].numel()
        for name, at in (("k", c.key_offset), ("v", c.value_offset)):
            for slot in probes:
                got = self._slot_offsets(name, np.array([slot], np.int64))[0]
                want = np.array([[at(slot, h, d) for d in range(dim)] for h in range(heads)])
                if not np.array_equal(got, want):
                    raise ValueError(f"inferscale: the cache's {name} layout is not a sum of "
                                     f"block, token and (head, dim) parts (slot {slot}): "
                                     f"capture cannot gather it")
            origin, block, token, head_dim = self._parts[name]
            parts = (origin, block, token.min(), head_dim.min())
            last = origin + (c.num_slots // bs - 1) * block + token.max() + head_dim.max()
            if min(parts) < 0 or last >= span:
                raise ValueError(f"inferscale: the cache's {name} elements reach offset {last}, "
                                 f"beyond its layer tensors' {span} elements")
        # each layer's elements from its base, as the descriptor addresses them (torch refuses a
        # tensor whose storage does not hold them)
        try:
            self._flat = [t.as_strided((span,), (1,)) for t in self.tensors]
        except RuntimeError as e:
            raise ValueError(f"inferscale: the cache's layer tensors cannot be read as "
                             f"{span} elements from their bases: {e}") from e

    def _slot_offsets(self, name, slots):
        origin, block, token, head_dim = self._parts[name]
        bs = self.cache.block_size
        base = origin + (slots // bs) * block + token[slots % bs]
        return base[:, None, None] + head_dim[None]

    def read_cached(self, job: CaptureJob):
        """(k, v) [layers, tokens, heads of this rank, head_dim] of the job's tokens exactly as
        the cache holds them (rotated keys), as numpy arrays in the file's storage dtype (bfloat16:
        its bit patterns as uint16)."""
        import torch

        n = len(job.slots)
        c = self.cache
        if n > self.table.shape[0]:
            raise ValueError(f"{n} tokens, the model's rotary table has {self.table.shape[0]} "
                             f"positions")
        slots = np.asarray(job.slots, np.int64)
        if n == 0 or slots.min() < 0 or slots.max() >= c.num_slots:
            raise ValueError(f"slots out of the cache's [0, {c.num_slots})")
        shape = (c.num_layers, n, c.num_heads, c.head_dim)
        out = []
        for name in ("k", "v"):
            index = torch.from_numpy(self._slot_offsets(name, slots).reshape(-1))
            got = torch.empty((c.num_layers, index.numel()), dtype=self.tensors[0].dtype)
            for layer, flat in enumerate(self._flat):
                torch.index_select(flat, 0, index, out=got[layer])
            if self.cache_dtype == "bfloat16":
                got = got.view(torch.int16).numpy().view(np.uint16)
            else:
                got = got.numpy()
            out.append(got.reshape(shape))
        return out[0], out[1]

    def capture(self, job: CaptureJob) -> str:
        t0 = time.perf_counter()
        k, v = self.read_cached(job)
        n = k.shape[1]
        arrays = {
            "k_cached": k, "v_cached": v, "cache_dtype": np.array(self.cache_dtype),
            "table": self.table[:n], "table_dtype": np.array(self.table_dtype),
            "neox": np.array(self.neox), "rounding": np.array(self.rounding),
            "token_ids": np.asarray(job.token_ids, dtype=np.int64),
            "first_head": np.int64(self.first_head), "num_heads": np.int64(k.shape[2]),
            "kv_heads": np.int64(self.kv_heads), "rank": np.int64(self.rank),
            "tp_size": np.int64(self.tp)}
        t1 = time.perf_counter()
        os.makedirs(self.directory, exist_ok=True)
        path = capture_path(self.memory_dir, job.capture_id, self.rank)
        write_npz_atomically(path, arrays)
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
    where a rotary pair's bytes differ, try bf16 pairs around it (neighbours 1, then 6 units in
    the last place each way, then values spread over the pair's rounding interval, then a walk
    along one element's bf16 lattice solving for the other) until they match. Stored, such keys
    re-inject at the captured positions exactly what vLLM's prefill wrote (Theorem 3 through the
    server); a pair none of them fixes is left as the rounding gave it (counted in `unmatched`).
    Costly (tens of ms per token for a 30-layer model): it runs in the process that reads the
    capture (``read_capture``), never in the engine step."""

    def __init__(self, rotation, mode: str, cache, isa: str, table, neox: bool):
        import torch

        self.rotation, self.isa, self.neox = rotation, isa, bool(neox)
        self.mode = mode  # connector.ROUNDING_MODES: how vLLM's kernel rounds (the grid's model)
        self.layers, self.heads, self.dim = cache.num_layers, cache.num_heads, cache.head_dim
        self.block = cache.block_size
        self.rotary = table.shape[1]
        self.table = table.detach().to("cpu", torch.float32).numpy()
        # the identity rotation (cos 1, sin 0): extract then reads a cache's keys as stored
        self.identity_table = _identity_table(table.shape[0], self.rotary)
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
        from . import _inferscale

        n = keys.shape[1]
        cache, _ = _scratch_cache(self.layers, self.heads, self.dim, n, "bfloat16", self.block,
                                  self.isa)
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



def _identity_table(rows: int, rotary_dim: int) -> np.ndarray:
    """A float32 [rows, rotary_dim] cos|sin table of cos 1 and sin 0: a rotation that moves
    nothing (extract reads a cache's keys as stored, inject writes keys as given)."""
    table = np.zeros((rows, rotary_dim), np.float32)
    table[:, : rotary_dim // 2] = 1.0
    return table


def _widen(a: np.ndarray, cache_dtype: str) -> np.ndarray:
    """A cache's elements as the file stores them (``_STORED_AS``) in float32, exactly."""
    if cache_dtype == "bfloat16":
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(np.float32)


def _scratch_cache(layers, heads, dim, n, dtype, block=128, isa="vec"):
    """(descriptor, tensors) of a zeroed cache of vLLM's CPU layout holding n tokens in slots
    0 .. n-1 (the caller keeps the tensors alive)."""
    import torch

    from .tensors import vllm_cpu_cache

    blocks = (n + block - 1) // block
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.zeros(blocks, heads, block, 2 * dim, dtype=getattr(torch, dtype))
              for i in range(layers)}
    return vllm_cpu_cache(caches, list(caches), isa), caches


def derotate(k_cached: np.ndarray, cache_dtype: str, table: np.ndarray, neox: bool) -> np.ndarray:
    """The library's de-rotation (``extract``, in fp32, with the float32 `table`'s rows as the
    positions 0 .. n-1) of keys as a cache of `cache_dtype` holds them (float32 [layers, n, heads,
    head_dim], each a `cache_dtype` value): the keys are put back, bit for bit, into a scratch cache
    of that dtype (injected with the identity rotation) and extracted from it, the same arithmetic
    on the same bytes as an extraction from vLLM's own cache."""
    from . import _inferscale

    layers, n, heads, dim = k_cached.shape
    rotary = table.shape[1]
    k_cached = np.ascontiguousarray(k_cached, np.float32)
    cache, tensors = _scratch_cache(layers, heads, dim, n, cache_dtype)
    identity_table = _identity_table(n, rotary)
    identity = _inferscale.Rotation(identity_table, dim, bool(neox), False, False)
    store = _inferscale.Store(layers, heads, dim, cache_dtype, (n + 15) // 16, 16)
    store.insert(1, 0, [0] * n, k_cached, k_cached)
    _inferscale.inject(store, cache, identity, [([1], 0, list(range(n)))])
    table = np.ascontiguousarray(table, np.float32)
    rotation = _inferscale.Rotation(table[:n], dim, bool(neox), False, False)
    out = _inferscale.Store(layers, heads, dim, "float32", (n + 15) // 16, 16)
    _inferscale.extract(out, cache, rotation, list(range(n)), 0, 1, 0, [0] * n)
    k = np.empty_like(k_cached)
    v = np.empty_like(k_cached)
    out.read(1, k, v)
    del tensors
    return k


def exact_keys(k: np.ndarray, k_cached: np.ndarray, table: np.ndarray, table_dtype: str,
               rounding: str, neox: bool) -> tuple[np.ndarray, int]:
    """(keys, unmatched): ExactKeys on de-rotated keys `k` against the bytes the cache held
    (`k_cached`, float32), with the engine's rotation rebuilt from the capture: the table's rows
    in the dtype the engine's rotation reads them, and the rounding vLLM's kernel does here."""
    import torch
    from types import SimpleNamespace

    from . import _inferscale

    layers, n, heads, dim = k.shape
    engine_table = torch.from_numpy(np.ascontiguousarray(table)).to(getattr(torch, table_dtype))
    round_each, truncate = ROUNDING_MODES[rounding]
    rotation = _inferscale.Rotation(engine_table[:n], dim, bool(neox), round_each, truncate)
    geometry = SimpleNamespace(num_layers=layers, num_heads=heads, head_dim=dim, block_size=128)
    fixer = ExactKeys(rotation, rounding, geometry, "vec", engine_table, neox)
    return fixer.fix(k, k_cached), fixer.unmatched  # (engine_table alive until fix returns)


def _refuse(path, why):
    raise ValueError(f"inferscale: capture file {path}: {why}")


def _load_rank(path: str) -> dict:
    if not os.path.isfile(path):
        _refuse(path, "missing (not captured yet, failed, or another tensor-parallel size)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [f for f in _FIELDS if f not in z.files]
            if missing:
                _refuse(path, f"partial or of another format: no {missing}")
            out = {f: z[f] for f in _FIELDS}
    except ValueError as e:
        if str(e).startswith("inferscale:"):
            raise
        _refuse(path, f"unreadable ({e})")
    except (OSError, EOFError, KeyError, zipfile.BadZipFile) as e:
        _refuse(path, f"unreadable ({type(e).__name__}: {e})")
    return out


def _text(path, p, field, allowed):
    a = p[field]
    if a.shape != () or a.dtype.kind != "U" or str(a) not in allowed:
        shown = repr(a.item()) if a.shape == () else f"of shape {a.shape}"
        _refuse(path, f"{field} {shown:.80} ({a.dtype}) is not one of {sorted(allowed)}")
    return str(a)


def _check_rank(path: str, p: dict, r: int, tp: int) -> dict:
    """The rank file's fields checked one by one (the module docstring's format); returns its
    scalars and strings as Python values."""
    meta = {}
    for f in ("first_head", "num_heads", "kv_heads", "rank", "tp_size"):
        a = p[f]
        if a.shape != () or a.dtype.kind not in "iu":
            _refuse(path, f"{f} is not an integer scalar ({a.dtype} {a.shape})")
        meta[f] = int(a)
    if meta["rank"] != r or meta["tp_size"] != tp:
        _refuse(path, f"written by rank {meta['rank']} of {meta['tp_size']}, expected rank {r} "
                      f"of {tp}")
    meta["cache_dtype"] = _text(path, p, "cache_dtype", _STORED_AS)
    meta["table_dtype"] = _text(path, p, "table_dtype", _STORED_AS)
    meta["rounding"] = _text(path, p, "rounding", set(ROUNDING_MODES) | {""})
    if p["neox"].shape != () or p["neox"].dtype != np.bool_:
        _refuse(path, f"neox is not a bool scalar ({p['neox'].dtype} {p['neox'].shape})")
    meta["neox"] = bool(p["neox"])
    k, v = p["k_cached"], p["v_cached"]
    stored = np.dtype(_STORED_AS[meta["cache_dtype"]])
    if k.dtype != stored or v.dtype != stored or k.ndim != 4 or k.shape != v.shape \
            or 0 in k.shape:
        _refuse(path, f"k_cached {k.dtype} {k.shape} and v_cached {v.dtype} {v.shape} are not "
                      f"{stored} [layers, tokens, heads, head_dim] of one shape (a "
                      f"{meta['cache_dtype']} cache)")
    ids = p["token_ids"]
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.shape[0] != k.shape[1]:
        _refuse(path, f"{ids.shape} token ids ({ids.dtype}) for {k.shape[1]} tokens")
    table = p["table"]
    if (table.dtype != np.float32 or table.ndim != 2 or table.shape[0] != k.shape[1]
            or not 0 < table.shape[1] <= k.shape[3] or table.shape[1] % 2
            or not np.all(np.isfinite(table))):
        _refuse(path, f"table {table.dtype} {table.shape} is not the finite float32 cos|sin rows "
                      f"of {k.shape[1]} positions, an even number of rotary dims up to the head "
                      f"size {k.shape[3]}")
    if meta["num_heads"] != k.shape[2]:
        _refuse(path, f"num_heads {meta['num_heads']}, k_cached holds {k.shape[2]} heads")
    return meta


def read_capture(memory_dir: str, capture_id: str, tp: int = 1, *, timeout: float = 5.0,
                 exact: bool = True) -> dict:
    """The capture `capture_id` of a memory directory: ``{"k", "v": float32 [layers, tokens,
    kv_heads, head_dim], "token_ids": int64 [tokens], "unmatched": int}``, the `tp` ranks' files
    joined by heads; the files are then removed. Raises ValueError naming the file when one is
    missing, unreadable, partial, malformed or inconsistent with the others (nothing is removed
    then).

    k: the cached keys de-rotated (``derotate``) and, with `exact` and a rounding in the file,
    moved by ExactKeys to bf16 keys that the engine's rotation maps back to the cached bytes;
    "unmatched": the key pairs ExactKeys left as the de-rotation gave them (0 when it did not run;
    logged). This is where ExactKeys runs, off the engine step (the caller's thread).

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
    metas = []
    next_head = 0
    for r, (path, p) in enumerate(zip(paths, parts)):
        meta = _check_rank(path, p, r, tp)
        k = p["k_cached"]
        if meta["first_head"] != next_head:
            _refuse(path, f"heads [{meta['first_head']}, +{meta['num_heads']}), expected the run "
                          f"to start at head {next_head}")
        next_head += k.shape[2]
        first, first_meta = parts[0], metas[0] if metas else meta
        same = ("kv_heads", "cache_dtype", "table_dtype", "rounding", "neox")
        if r and (k.shape[0] != first["k_cached"].shape[0]
                  or k.shape[1] != first["k_cached"].shape[1]
                  or k.shape[3] != first["k_cached"].shape[3]
                  or not np.array_equal(p["token_ids"], first["token_ids"])
                  or not np.array_equal(p["table"], first["table"])
                  or any(meta[f] != first_meta[f] for f in same)):
            _refuse(path, f"another capture than {paths[0]}'s (layers, tokens, head size, token "
                          f"ids, the model's KV heads, dtypes, table or rotation differ): one id "
                          f"reused?")
        metas.append(meta)
    if next_head != metas[0]["kv_heads"]:
        _refuse(paths[-1], f"the ranks hold {next_head} KV heads, the model "
                           f"{metas[0]['kv_heads']}")
    ks, vs, unmatched = [], [], 0
    for path, p, meta in zip(paths, parts, metas):
        k_cached = _widen(p["k_cached"], meta["cache_dtype"])
        k = derotate(k_cached, meta["cache_dtype"], p["table"], meta["neox"])
        if exact and meta["rounding"]:
            k, left = exact_keys(k, k_cached, p["table"], meta["table_dtype"], meta["rounding"],
                                 meta["neox"])
            if left:
                logger.warning("inferscale: capture %s: %d key pairs of %s do not rotate back to "
                               "the cached bytes (left as de-rotated)", capture_id, left, path)
            unmatched += left
        ks.append(k)
        vs.append(_widen(p["v_cached"], meta["cache_dtype"]))
    out = {"k": np.concatenate(ks, axis=2), "v": np.concatenate(vs, axis=2),
           "token_ids": parts[0]["token_ids"].astype(np.int64), "unmatched": unmatched}
    for path in paths:
        os.remove(path)
    return out
