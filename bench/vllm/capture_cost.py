#!/usr/bin/env python3
"""What capture while serving costs (issue 48, target: at most 10 % over the plain forward of the
same prompt): one vLLM engine (CPU build, SmolLM2-135M-Instruct, bf16) with InferScaleConnector;
for each prompt length, requests of max_tokens = 1 (the prompt's forward and its first token)
alternate between the plain request and the same prompt with
``kv_transfer_params.inferscale_capture`` (the connector's worker then reads the prompt's K/V
back from vLLM's cache after the forward and writes them, fsynced, to <memory>/.captures; what
else it does in the step depends on the package's version). Every request has a fresh
cache_salt: nothing is a prefix-cache hit. Printed in the same run: the CPU model (lscpu) and its
vector/matrix ISA flags, the wall time of each kind (median), the overhead, the worker's own
capture time in the engine step (timed in the connector) and file size. Wall times of whole
requests drift with anything else running on the machine (the load average is printed before and
after): the worker's own capture time against the plain request's median ("in-step / plain") is
the figure that does not.

Then the reader's side (what the server's write path pays, off the engine step): each capture is
read with ``read_capture`` twice from the same file, with ``exact=False`` (the de-rotation only)
and with ExactKeys (the default), where the package has that switch; "ExactKeys ms" is the
difference, per capture (one fact's prompt) and per token.

Run it once per package to compare versions (e.g. main's and a branch's), back to back: the
script reports what the package it imports does.

The engine core and worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the tests) so
that the worker's timer can be read; the forward is the same as in vLLM's multi-process layout.

Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=<build>/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/capture_cost.py \\
      --model "$INFERSCALE_SMOLLM2_HF" [--lengths 256 1024] [--reps 5] [--memory DIR]
(<build>/python: the package assembled by CMake, e.g. build/ci/examples/engine/vllm/python.)
"""

import argparse
import inspect
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid


def cpu_description():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                  if line.startswith("Model name")), "unknown")
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    return model, isa, len(os.sched_getaffinity(0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("INFERSCALE_SMOLLM2_HF"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory", default=None, help="the memory directory (default: a new one "
                    "under /tmp; its file system decides the fsync's cost)")
    a = ap.parse_args()
    if not a.model or not os.path.isfile(os.path.join(a.model, "config.json")):
        sys.exit("capture_cost: --model must be SmolLM2's HF folder (bash .ci/vllm prints it)")
    model, isa, cpus = cpu_description()
    print(f"CPU: {model}; ISA flags: {' '.join(isa) or 'none of avx2/avx512/amx'}; {cpus} CPUs "
          f"for this run", flush=True)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    import inferscale_vllm.serve_capture as serve_capture
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.serve_capture import read_capture

    has_exact_switch = "exact" in inspect.signature(read_capture).parameters

    directory = a.memory or tempfile.mkdtemp(prefix="inferscale-capture-bench-")
    os.makedirs(directory, exist_ok=True)
    fs = subprocess.run(["df", "--output=fstype", directory], capture_output=True,
                        text=True).stdout.split()[-1]
    llm = make_llm(a.model, directory, capture=False,
                   max_model_len=max(2048, max(a.lengths) + 16))
    worker = get_kv_transfer_group()  # the worker-role connector (in this process)
    writer = worker._capture_writer
    if writer is None:
        sys.exit("capture_cost: the worker has no capture writer (device caches?)")
    in_step = ("ExactKeys in the step" if getattr(writer, "exact", None) is not None
               else "the cached bytes only in the step, ExactKeys in the reader"
               if has_exact_switch else "no ExactKeys")
    print(f"package: {os.path.dirname(serve_capture.__file__)} ({in_step})", flush=True)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)

    def run(ids, capture_id=None):
        extra = ({"kv_transfer_params": {"inferscale_capture": {"id": capture_id}}}
                 if capture_id else None)
        sp = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids, "cache_salt": uuid.uuid4().hex}], sp,
                           use_tqdm=False)[0]
        dt = time.perf_counter() - t
        assert (out.num_cached_tokens or 0) == 0
        return dt

    print(f"memory directory {directory} ({fs}); {a.reps} alternating pairs per length, "
          f"max_tokens = 1, fresh salts", flush=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'tokens':>7} {'plain s':>9} {'capture s':>10} {'wall diff':>10} {'in-step ms':>11} "
          f"{'of which write ms':>18} {'in-step / plain':>16} {'file MB':>8} "
          f"{'read ms':>8} {'ExactKeys ms':>13} {'per token':>10}")
    rows = []

    def read_twice(capture_id):
        """(seconds of read_capture without ExactKeys, seconds with it; None where the package
        has no switch) on the same file."""
        path = os.path.join(directory, ".captures", f"{capture_id}.rank0.npz")
        with open(path, "rb") as f:
            saved = f.read()
        if not has_exact_switch:
            t = time.perf_counter()
            read_capture(directory, capture_id, 1)
            return time.perf_counter() - t, None
        t = time.perf_counter()
        read_capture(directory, capture_id, 1, exact=False)
        plain = time.perf_counter() - t
        with open(path, "wb") as f:
            f.write(saved)
        t = time.perf_counter()
        got = read_capture(directory, capture_id, 1)
        exact = time.perf_counter() - t
        if got.get("unmatched", 0):
            print(f"  (ExactKeys left {got['unmatched']} key pairs unmatched)")
        return plain, exact
    for n in a.lengths:
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        run(ids)  # warm-up (this length's shapes)
        run(ids, "warmup")
        read_capture(directory, "warmup", 1)
        plain, cap, work, write, size, reads, exacts = [], [], [], [], 0, [], []
        for i in range(a.reps):
            order = (False, True) if i % 2 == 0 else (True, False)
            for with_capture in order:
                if with_capture:
                    s0, w0 = writer.seconds, writer.write_seconds
                    cap.append(run(ids, f"bench-{n}-{i}"))
                    work.append(writer.seconds - s0)
                    write.append(writer.write_seconds - w0)
                    path = os.path.join(directory, ".captures", f"bench-{n}-{i}.rank0.npz")
                    size = os.path.getsize(path)
                    read_s, exact_s = read_twice(f"bench-{n}-{i}")
                    reads.append(read_s)
                    if exact_s is not None:
                        exacts.append(exact_s - read_s)
                else:
                    plain.append(run(ids))
        p, c, w = statistics.median(plain), statistics.median(cap), statistics.median(work)
        e = statistics.median(exacts) if exacts else None
        rows.append((n, p, c, w, e))
        exact_cols = (f"{1000 * e:>13.1f} {1000 * e / n:>10.2f}" if e is not None
                      else f"{'-':>13} {'-':>10}")
        print(f"{n:>7} {p:>9.3f} {c:>10.3f} {100 * (c / p - 1):>9.1f}% {1000 * w:>11.1f} "
              f"{1000 * statistics.median(write):>18.1f} {100 * w / p:>15.2f}% "
              f"{size / 1e6:>8.1f} {1000 * statistics.median(reads):>8.1f} {exact_cols}",
              flush=True)
    llm.llm_engine.engine_core.shutdown()
    if a.memory is None:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    worst = max(100 * w / p for _, p, _, w, _ in rows)
    wall = max(100 * (c / p - 1) for _, p, c, _, _ in rows)
    print(f"capture overhead: worker's capture time in the step at most {worst:.2f}% of the plain "
          f"request (wall-time difference at most {wall:.1f}%); target <= 10%; CPU {model}; "
          f"{in_step}")


if __name__ == "__main__":
    main()
