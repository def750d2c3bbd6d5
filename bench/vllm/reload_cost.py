#!/usr/bin/env python3
"""What a reader's refresh costs after a writer commits one fact: the full load of the new
generation (`load_generation(directory)`: every file read and checked, the whole store) against the
incremental one (`load_generation(directory, previous=facade)`: the small files, the store's header
and catalogue, the new fact's pages; the unchanged facts copied from the generation the reader
serves and checked against the store's per-fact CRC-64), in the same run, on the same files.

The memory: N facts of T tokens in SmolLM2-135M's geometry (30 layers x 3 KV heads x 64, bf16,
pages of 16 tokens: 368,640 bytes a page), in 8 users, committed once (generation 1, loaded by the
reader), then one fact of T tokens more (generation 2). Each load is timed warm (the files in the
page cache, as right after the commit on the same machine) and cold (the store file's pages dropped
with posix_fadvise(DONTNEED) first, so its reads go to the disk). Bytes read are this process's
(/proc/self/io): `rchar` (through read/pread, page cache or not) and `read_bytes` (from the storage
device). Medians of R repetitions, alternating full and incremental.

Usage: PYTHONPATH=<build>/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/reload_cost.py [N] [T] [R]
       (defaults 600 32 5; the files go under $INFERSCALE_BENCH_DIR or the system's temporary
       directory and are removed)
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

LAYERS, HEADS, DIM, PAGE = 30, 3, 64, 16
MODEL = {"name": "SmolLM2-135M geometry", "num_layers": LAYERS, "num_kv_heads": HEADS,
         "head_dim": DIM, "rope_theta": 100000.0, "weights": "0" * 64}


def io():
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value)
    return out


def drop_cache(directory):
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(load, directory, cold):
    if cold:
        drop_cache(directory)
    before = io()
    t0 = time.perf_counter()
    facade, app = load()
    seconds = time.perf_counter() - t0
    after = io()
    return seconds, after["rchar"] - before["rchar"], after["read_bytes"] - before["read_bytes"], \
        facade, app


def main():
    from inferscale_vllm.memory import Memory, load_generation

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 600
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    root = tempfile.mkdtemp(prefix="inferscale-reload-", dir=os.environ.get("INFERSCALE_BENCH_DIR"))
    directory = os.path.join(root, "memory")
    try:
        rng = np.random.default_rng(0)
        pages = n * ((tokens + PAGE - 1) // PAGE) + 64
        mem = Memory.create(directory, model=MODEL, num_pages=pages, page_size=PAGE)
        shape = (LAYERS, tokens, HEADS, DIM)
        t0 = time.perf_counter()
        for i in range(n):
            k = rng.standard_normal(shape, dtype=np.float32)
            mem.add_fact(f"user{i % 8}", f"fact {i}", [int(x) for x in rng.integers(0, 49152, tokens)],
                         k, -k)
        mem.commit()
        print(f"generation 1: {n} facts of {tokens} tokens committed in "
              f"{time.perf_counter() - t0:.1f} s")
        previous, _ = load_generation(directory)
        k = rng.standard_normal(shape, dtype=np.float32)
        mem.add_fact("user3", "one more", [int(x) for x in rng.integers(0, 49152, tokens)], k, -k)
        mem.commit()
        store = [f for f in os.listdir(directory) if f.startswith("store-")][0]
        size = os.path.getsize(os.path.join(directory, store))
        total = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(f"generation 2: one fact more; store file {size:,} bytes, all files {total:,} bytes")

        loads = {"full": lambda: load_generation(directory),
                 "incremental": lambda: load_generation(directory, previous=previous)}
        results = {}
        check = {}
        for cold in (False, True):
            for _ in range(reps):
                for name, load in loads.items():
                    s, rchar, disk, facade, app = measure(load, directory, cold)
                    results.setdefault((cold, name), []).append((s, rchar, disk))
                    check[name] = (facade, app)
                    del facade
        # the two loads give the same memory: every fact's token ids and K/V
        (fa, fapp), (ia, iapp) = check["full"], check["incremental"]
        assert fapp == iapp
        for f in fapp["facts"]:
            f = int(f)
            assert fa.store.token_ids(f) == ia.store.token_ids(f)
            a, b = (np.empty((LAYERS, fa.store.length(f), HEADS, DIM), np.float32) for _ in "ab")
            c, d = np.empty_like(a), np.empty_like(a)
            fa.store.read(f, a, c)
            ia.store.read(f, b, d)
            assert np.array_equal(a, b) and np.array_equal(c, d)
        print(f"{'load':<12} {'cache':<5} {'median ms':>10} {'min ms':>8} {'rchar bytes':>14} "
              f"{'disk bytes':>14}")
        for (cold, name), rows in results.items():
            ms = [r[0] * 1e3 for r in rows]
            print(f"{name:<12} {'cold' if cold else 'warm':<5} {statistics.median(ms):>10.1f} "
                  f"{min(ms):>8.1f} {int(statistics.median(r[1] for r in rows)):>14,} "
                  f"{int(statistics.median(r[2] for r in rows)):>14,}")
        mem.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
