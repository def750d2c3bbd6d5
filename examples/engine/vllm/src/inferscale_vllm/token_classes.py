"""Which token counts vLLM's linear layers compute alike, and how much of a memory segment may be
loaded so that vLLM computes the rest exactly as in its cold prefill (Theorem 3).

Why (bench/results/2026-12-07-vllm-amx-tail.md): a row of a GEMM is not always the same floats
whatever the batch around it. On an Intel Xeon with AMX, vLLM 0.32 CPU computes the model's linear
layers with oneDNN (``onednn_mm``) or the SGL kernels, which pick their kernel by the number of rows
M (the tokens of the step): for SmolLM2's projections M <= 32, 33 <= M <= ~572-956 and larger M
give rows that differ in the last bit of about 1 element in 10^4, so the query of a request whose
memory was loaded (M = the query's tokens) is computed with other roundings than in vLLM's cold
prefill of the whole prompt (M = the prompt's tokens) whenever the two counts fall in different
classes: greedy answers then differ (2 of 8 questions), although every injected byte is vLLM's own.
The attention kernels are not the cause: with the counts in one class, a context that ends
anywhere inside a block gives vLLM's logprobs bit for bit.

``measure_layers`` finds the classes on the worker, at start-up, from the model's own layers and
weights (their ``quant_method.apply``: the GEMM alone, no communication between ranks);
``exact_load`` picks the most tokens to load for a request so that every row vLLM then computes
(with the chunks it schedules) is computed at a token count of the same class as in its cold
prefill."""

from __future__ import annotations

import bisect
import hashlib

# Rows of each signature. Kernels that differ give other bits in 3-8 of 10^5 elements (SmolLM2's
# shapes on an Intel Xeon with AMX): 512 rows of 960 columns hold ~14 such elements, so a change
# of kernel is missed with a probability of ~1e-6 (128 rows: ~3 %).
PROBE_ROWS = 512
DENSE_UP_TO = 64  # every count up to here is measured
GRID = 32  # then every GRID-th count, with bisection wherever the class changes


class TokenClasses:
    """Intervals [lo, hi] of token counts (1 .. max_tokens) with a class key each: two counts
    with equal keys give every row of every measured layer the same bits."""

    def __init__(self, intervals):
        self.intervals = [(int(lo), int(hi), tuple(key)) for lo, hi, key in intervals]
        if not self.intervals or self.intervals[0][0] != 1:
            raise ValueError("token classes must start at 1")
        for (_, hi, _), (lo, _, _) in zip(self.intervals, self.intervals[1:]):
            if lo != hi + 1:
                raise ValueError("token classes must be contiguous")
        self._starts = [lo for lo, _, _ in self.intervals]
        self.max_tokens = self.intervals[-1][1]

    def of(self, m: int):
        """The class key of m tokens, None outside 1 .. max_tokens."""
        if m < 1 or m > self.max_tokens:
            return None
        return self.intervals[bisect.bisect_right(self._starts, m) - 1][2]

    def uniform(self) -> bool:
        return len({key for _, _, key in self.intervals}) == 1

    def to_list(self) -> list:
        return [[lo, hi, list(key)] for lo, hi, key in self.intervals]

    def __repr__(self):
        return " ".join(f"{lo}-{hi}:{'.'.join(map(str, key))}" for lo, hi, key in self.intervals)


def join(maps) -> TokenClasses:
    """The classes of several layers (or ranks) together: equal keys where every map's key is."""
    maps = list(maps)
    top = min(m.max_tokens for m in maps)
    cuts = sorted({lo for m in maps for lo, _, _ in m.intervals if lo <= top})
    out = []
    for i, lo in enumerate(cuts):
        hi = cuts[i + 1] - 1 if i + 1 < len(cuts) else top
        key = tuple(m.of(lo) for m in maps)
        if out and out[-1][2] == key:
            out[-1][1] = hi
        else:
            out.append([lo, hi, key])
    # renumber the joined keys 0, 1, ... in order of appearance
    ids = {}
    return TokenClasses([(lo, hi, (ids.setdefault(key, len(ids)),)) for lo, hi, key in out])


def measure(apply, k: int, max_tokens: int, *, dtype, device="cpu", seed: int = 0) -> TokenClasses:
    """The token classes of one GEMM ``apply(x [M, k]) -> [M, n]`` for M = 1 .. max_tokens.

    The signature of M is the output of PROBE_ROWS fixed random rows computed in batches of M rows
    (M < PROBE_ROWS: the probe rows in runs of M, so each sits at several positions of a batch;
    else half of them first and half last in one batch of M rows, the rest random). Every M up
    to DENSE_UP_TO is measured, then every GRID-th, and the interval between two measured counts
    of different signatures is bisected until the change is found; counts between two measured
    ones of the same signature are taken to share it (the assumption; test_token_classes.py checks
    it against every count on the machine that runs it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    probe = torch.randn(PROBE_ROWS, k, generator=g).to(dtype).to(device)
    filler = torch.randn(max(max_tokens, PROBE_ROWS), k, generator=g).to(dtype).to(device)
    half = PROBE_ROWS // 2
    sigs = {}

    def sig(m):
        if m in sigs:
            return sigs[m]
        with torch.no_grad():
            if m < PROBE_ROWS:
                outs = []
                for i in range(0, PROBE_ROWS, m):
                    rows = probe[i:i + m]
                    x = rows if len(rows) == m else torch.cat([rows, filler[:m - len(rows)]])
                    outs.append(apply(x.contiguous())[:len(rows)])
                y = torch.cat(outs)
            else:
                x = torch.cat([probe[:half], filler[:m - PROBE_ROWS], probe[half:]]).contiguous()
                out = apply(x)
                y = torch.cat([out[:half], out[m - (PROBE_ROWS - half):]])
        h = hashlib.sha1(y.contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()
        sigs[m] = h
        return h

    points = sorted(set(list(range(1, min(DENSE_UP_TO, max_tokens) + 1))
                        + list(range(DENSE_UP_TO, max_tokens + 1, GRID)) + [max_tokens]))
    for m in points:
        sig(m)

    def refine(a, b):  # sig(a) != sig(b): measure in between until the change(s) are found
        if b - a <= 1:
            return
        mid = (a + b) // 2
        if sig(mid) != sig(a):
            refine(a, mid)
        if sig(mid) != sig(b):
            refine(mid, b)

    for a, b in zip(points, points[1:]):
        if sig(a) != sig(b):
            refine(a, b)
    measured = sorted(sigs)
    ids, intervals = {}, []
    for i, m in enumerate(measured):
        key = ids.setdefault(sigs[m], len(ids))
        hi = measured[i + 1] - 1 if i + 1 < len(measured) else max_tokens
        if intervals and intervals[-1][2] == (key,):
            intervals[-1][1] = hi
        else:
            intervals.append([m, hi, (key,)])
    return TokenClasses(intervals)


def linear_layers(model):
    """{(kind, k, n, dtype, bias): [(name, module), ...]}: the model's linear layers (vLLM's
    LinearBase) grouped by what picks their kernel (quantisation method, local shape, dtype)."""
    from vllm.model_executor.layers.linear import LinearBase

    groups = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, LinearBase) or getattr(mod, "quant_method", None) is None:
            continue
        w = getattr(mod, "weight", None)
        k = getattr(mod, "input_size_per_partition", None) or getattr(mod, "input_size", None)
        n = getattr(mod, "output_size_per_partition", None) or getattr(mod, "output_size", None)
        if not k or not n:
            continue
        bias = getattr(mod, "bias", None)
        key = (type(mod.quant_method).__name__, int(k), int(n),
               str(getattr(w, "dtype", None)), bias is not None)
        groups.setdefault(key, []).append((name, mod))
    return groups


def measure_layers(model, max_tokens: int, dtype, device="cpu", cache=None):
    """The joined token classes of the model's linear layers (one layer of each group measured:
    the kernel is picked by the group's key), {group: classes} for the log, and how many groups
    were read from ``cache`` (a ClassCache, or None: every group measured)."""
    per, hits = {}, 0
    for key, mods in linear_layers(model).items():
        name, mod = mods[0]
        bias = getattr(mod, "bias", None)

        def apply(x, mod=mod, bias=bias):
            return mod.quant_method.apply(mod, x, bias)

        def run(apply=apply, k=key[1]):
            return measure(apply, k, max_tokens, dtype=dtype, device=device)

        if cache is None:
            classes = run()
        else:
            classes, hit = cache.get_or_measure(
                {"group": list(key), "weight": tensor_digest(getattr(mod, "weight", None)),
                 "bias": tensor_digest(bias), "max_tokens": int(max_tokens), "dtype": str(dtype),
                 "device": str(device)}, run)
            hits += hit
        per[f"{name} {key[0]} {key[1]}x{key[2]}"] = classes
    if not per:
        return None, per, hits
    return join(per.values()), per, hits


def tensor_digest(t) -> str | None:
    """SHA-1 of a tensor's bytes, its dtype and shape (None for None)."""
    if t is None:
        return None
    import torch

    data = t.detach().contiguous().cpu()
    h = hashlib.sha1(f"{data.dtype} {tuple(data.shape)}".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def machine_identity() -> dict:
    """What picks a GEMM's kernel besides the layer: the CPU (model name and ISA flags), the
    threads torch computes with, torch's and vLLM's versions, and the environment variables that
    steer vLLM's CPU kernels and oneDNN."""
    import os
    import platform

    import torch

    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU part") and name not in cpu:
                    cpu[name] = value.strip()
    except OSError:
        cpu["processor"] = platform.processor()
    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception:  # noqa: BLE001 - outside an engine's environment
        vllm_version = None
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("VLLM_CPU_", "ONEDNN_", "DNNL_", "OMP_", "KMP_"))}
    return {"cpu": cpu, "machine": platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "vllm": vllm_version, "env": dict(sorted(env.items()))}


class ClassCache:
    """Measured token classes kept on disk, one JSON file per (layer group, machine): a worker
    that starts again on the same machine with the same model reads them instead of measuring
    (seconds per start: 6.7 s for SmolLM2 on an AMD EPYC, 10 s per rank at TP = 3).

    The file's name is the SHA-256 of everything the classes depend on: the layer group (its
    quantisation method, local shape, dtype, bias), the measured layer's weight and bias bytes,
    the most tokens measured, the dtype and device, the measurement's own parameters
    (PROBE_ROWS, DENSE_UP_TO, GRID, FORMAT) and the machine (``machine_identity``: CPU model and
    flags, torch threads, torch and vLLM versions, the VLLM_CPU_/ONEDNN_/DNNL_/OMP_/KMP_
    environment). The file repeats that description and is used only where it is equal; a file
    that cannot be read, or does not match, is measured again and replaced (written to a
    temporary file and renamed: concurrent workers never read a half-written one).

    ``INFERSCALE_TOKEN_CLASSES_CACHE``: the folder (default ``$XDG_CACHE_HOME/inferscale/
    token-classes``, else ``~/.cache/inferscale/token-classes``), or ``off`` to measure at every
    start."""

    FORMAT = 1

    def __init__(self, directory: str, machine: dict | None = None):
        self.directory = directory
        self.machine = machine_identity() if machine is None else machine

    @classmethod
    def default(cls):
        """The cache the environment names, or None where it says ``off``."""
        import os

        where = os.environ.get("INFERSCALE_TOKEN_CLASSES_CACHE", "")
        if where.lower() in ("off", "0", "none", "false"):
            return None
        if not where:
            base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                    ".cache")
            where = os.path.join(base, "inferscale", "token-classes")
        return cls(where)

    def describe(self, what: dict) -> dict:
        return {"format": self.FORMAT, "probe_rows": PROBE_ROWS, "dense_up_to": DENSE_UP_TO,
                "grid": GRID, "layer": what, "machine": self.machine}

    def path(self, description: dict) -> str:
        import json
        import os

        text = json.dumps(description, sort_keys=True)
        return os.path.join(self.directory, hashlib.sha256(text.encode()).hexdigest() + ".json")

    def get(self, what: dict):
        """The classes kept for `what`, or None (no file, or one that is unreadable or for
        something else)."""
        import json

        description = self.describe(what)
        try:
            with open(self.path(description)) as f:
                data = json.load(f)
            if data.get("description") != json.loads(json.dumps(description)):
                return None
            classes = TokenClasses(data["classes"])
            if classes.max_tokens != what["max_tokens"]:
                return None
            return classes
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def put(self, what: dict, classes: TokenClasses) -> None:
        """Keeps `classes` for `what` (an OSError where the folder cannot be written)."""
        import json
        import os
        import tempfile

        description = self.describe(what)
        path = self.path(description)
        os.makedirs(self.directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".classes-", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"description": description, "classes": classes.to_list()}, f)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def get_or_measure(self, what: dict, measure_fn):
        """(classes, 1) read from the cache, or (measure_fn(), 0), kept for the next start
        (a cache that cannot be written is logged and the measurement used)."""
        classes = self.get(what)
        if classes is not None:
            return classes, 1
        classes = measure_fn()
        try:
            self.put(what, classes)
        except OSError as e:
            import logging

            logging.getLogger("vllm.inferscale").warning(
                "inferscale: the token classes cannot be kept in %s (%s); they are measured "
                "again at the next start", self.directory, e)
        return classes, 0


def exact_load(n: int, lo: int, hi: int, classes: TokenClasses, chunk: int):
    """The most tokens L in [lo, hi] to load for an n-token prompt such that every row p in
    [L, n) that vLLM then computes (in steps of at most `chunk` tokens from L, the request alone)
    is computed at a token count of the class its row has in vLLM's cold prefill (steps of
    `chunk` from 0); None where no L qualifies."""
    if classes is None or hi < lo:
        return None

    def steps(start):  # [(first row, end row, tokens in that step)]
        out, p = [], start
        while p < n:
            q = min(p + chunk, n)
            out.append((p, q, q - p))
            p = q
        return out

    cold = steps(0)
    cold_at = [s for s, _, _ in cold]

    def cold_class(p):
        return classes.of(cold[bisect.bisect_right(cold_at, p) - 1][2])

    for L in range(hi, lo - 1, -1):
        ok = True
        for s, e, size in steps(L):
            want = classes.of(size)
            if want is None:
                ok = False
                break
            # the cold steps that hold rows [s, e)
            i = bisect.bisect_right(cold_at, s) - 1
            while i < len(cold) and cold[i][0] < e:
                if classes.of(cold[i][2]) != want:
                    ok = False
                    break
                i += 1
            if not ok:
                break
        if ok:
            return L
    return None
