#!/usr/bin/env python3
"""What capture while serving costs (issue 48, target: at most 10 % over the plain forward of the
same prompt): one vLLM engine (CPU build, SmolLM2-135M-Instruct, bf16) with InferScaleConnector;
for each prompt length, requests of max_tokens = 1 (the prompt's forward and its first token)
alternate between the plain request and the same prompt with
``kv_transfer_params.inferscale_capture`` (the connector's worker then reads the prompt's K/V
back from vLLM's cache after the forward, de-rotates them and writes them, fsynced, to
<memory>/.captures). Every request has a fresh cache_salt: nothing is a prefix-cache hit.
Printed in the same run: the CPU model (lscpu) and its vector/matrix ISA flags, the wall time of
each kind (median), the overhead, and the worker's own capture time (extraction + write, timed in
the connector) and file size. Wall times of whole requests drift with anything else running on the
machine (the load average is printed before and after): the worker's own capture time against the
plain request's median ("capture / plain") is the figure that does not.

The engine core and worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as the tests) so
that the worker's timer can be read; the forward is the same as in vLLM's multi-process layout.

Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=<build>/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/capture_cost.py \\
      --model "$INFERSCALE_SMOLLM2_HF" [--lengths 256 1024] [--reps 5] [--memory DIR]
(<build>/python: the package assembled by CMake, e.g. build/ci/examples/engine/vllm/python.)
"""

import argparse
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

    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.serve_capture import read_capture

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
    print(f"{'tokens':>7} {'plain s':>9} {'capture s':>10} {'wall diff':>10} {'worker ms':>10} "
          f"{'of which write ms':>18} {'capture / plain':>16} {'file MB':>8}")
    rows = []
    for n in a.lengths:
        ids = [rng.randrange(100, vocab) for _ in range(n)]
        run(ids)  # warm-up (this length's shapes)
        run(ids, "warmup")
        read_capture(directory, "warmup", 1)
        plain, cap, work, write, size = [], [], [], [], 0
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
                    os.remove(path)
                else:
                    plain.append(run(ids))
        p, c, w = statistics.median(plain), statistics.median(cap), statistics.median(work)
        rows.append((n, p, c, w))
        print(f"{n:>7} {p:>9.3f} {c:>10.3f} {100 * (c / p - 1):>9.1f}% {1000 * w:>10.1f} "
              f"{1000 * statistics.median(write):>18.1f} {100 * w / p:>15.2f}% "
              f"{size / 1e6:>8.1f}", flush=True)
    llm.llm_engine.engine_core.shutdown()
    if a.memory is None:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    worst = max(100 * w / p for _, p, _, w in rows)
    wall = max(100 * (c / p - 1) for _, p, c, _ in rows)
    print(f"capture overhead: worker's capture time at most {worst:.2f}% of the plain request "
          f"(wall-time difference at most {wall:.1f}%); target <= 10%; CPU {model}")


if __name__ == "__main__":
    main()
