#!/usr/bin/env python3
"""The paper's claims on a real vLLM (CPU build) with InferScale as its KV connector.

One engine (SmolLM2-135M-Instruct, bf16, block size 128 or --block-size), facts = LoCoMo conversation turns (read
from ../shared/data/locomo, never copied), each encoded once through vLLM behind the shared
system prefix (shared-prefix encoding) and stored in a memory directory. Then, in the same engine,
alternating and with the prefix cache reset before every request (so nothing is a cache hit):
  ttft       k = 5, 10, 20, 50 facts: time to first token with the facts injected (connector) vs
             the same prompt re-prefilled as text; and the floor, the query alone prefilled
             (what vLLM computes after the memory is loaded, without its attention to it);
             and the injected TTFT broken down (PARTS below: vLLM's front end and queue, the
             connector's planning and load, the query's forward, the attention over the memory),
             from vLLM's request timestamps and the connector's trace (INFERSCALE_VLLM_TRACE).
  load       N users at once (one request each, k = 20 facts, 8 tokens): requests/s and p50/p99
             TTFT, inject vs re-prefill.
  overhead   the connector's scheduler-side cost for a request that asks for no memory, timed
             directly (its hooks), beside that request's TTFT.
Prints a table and writes JSON (--json). Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=build/ci/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/bench_vllm.py \
      --model "$INFERSCALE_SMOLLM2_HF" [--locomo ../shared/data/locomo/locomo10.json] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench_args import add_model_and_locomo, check_model_and_locomo, cpu_description

SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer from what you know about the "
          "user's conversations:\n")
QUESTION = "What did they talk about most recently?"


def locomo_turns(path, count):
    with open(path) as f:
        data = json.load(f)
    conv = data[0]["conversation"]
    turns = []
    s = 1
    while f"session_{s}" in conv and len(turns) < count:
        for t in conv[f"session_{s}"]:
            turns.append(f"{t['speaker']}: {t['text']}\n")
            if len(turns) == count:
                break
        s += 1
    if len(turns) < count:
        raise SystemExit(f"bench_vllm: {path} has only {len(turns)} turns, {count} wanted")
    return turns


def timed(llm, prompt, extra=None, max_tokens=1):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra_args=extra)
    t = time.perf_counter()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out


# The injected request's TTFT, in the order a request meets them (the TTFT breakdown):
#   front end   arrival in the LLM to the engine core's queue, and the first token back out
#               (first_token_latency less the engine core's queued -> first-token span)
#   queue       queued -> scheduled (the engine core's timestamps)
#   connector   the connector's scheduler hooks (planning the load: the memory check, slots)
#   load        the workers' injection into vLLM's cache (the slowest rank)
#   query       what vLLM computes after the loaded tokens (the query, and any memory tokens the
#               connector left to vLLM: token_classes.py), prefilled alone: scheduled -> first
#               token of those tokens with no memory before them (another request, next to it)
#   memory attention  the rest of the injected request's scheduled -> first token span: what
#               attending to the loaded memory tokens adds to the query's forward (and what else
#               differs between the two steps)
PARTS = ("front end", "queue", "connector", "load", "query", "memory attention")


def read_trace(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def breakdown(ttft_s, metrics, events, alone):
    """{part: seconds} of one injected request (PARTS), from vLLM's request metrics and the
    connector's trace; `alone`: the metrics of the query prefilled without memory."""
    if metrics is None or alone is None:
        raise SystemExit("bench_vllm: vLLM handed back no request metrics (disable_log_stats)")
    core = metrics.first_token_ts - metrics.queued_ts
    step = metrics.first_token_ts - metrics.scheduled_ts
    connector = sum(e["seconds"] for e in events if e["side"] == "scheduler")
    loads = {}
    for e in events:
        if e["side"] == "worker":
            loads[tuple(e["rank"])] = loads.get(tuple(e["rank"]), 0.0) + e["seconds"]
    if not loads:
        raise SystemExit("bench_vllm: the connector traced no load for an injected request")
    load = max(loads.values())
    query = alone.first_token_ts - alone.scheduled_ts
    return {"front end": metrics.first_token_latency - core,
            "queue": metrics.scheduled_ts - metrics.queued_ts, "connector": connector,
            "load": load, "query": query,
            "memory attention": step - connector - load - query}


def main():
    ap = argparse.ArgumentParser()
    add_model_and_locomo(ap)
    ap.add_argument("--ks", default="5,10,20,50")
    ap.add_argument("--users", default="1,8,32,64,100")
    ap.add_argument("--block-size", type=int, default=128,
                    help="vLLM's KV block size (the CPU backend takes multiples of 32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    check_model_and_locomo(a, "bench_vllm")
    ks = [int(x) for x in a.ks.split(",")]
    users = [int(x) for x in a.users.split(",")]

    from inferscale_vllm.connector import TRACE_ENV
    from inferscale_vllm.encode import add_fact, model_description, set_prefix
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.memory import Memory

    directory = tempfile.mkdtemp(prefix="inferscale-bench-")
    # the connector's own work per memory request (its scheduler hooks, each worker's load), for
    # the TTFT breakdown; the engine's processes inherit the variable
    trace = os.path.join(directory, "connector-trace.jsonl")
    os.environ[TRACE_ENV] = trace
    t0 = time.perf_counter()
    llm = make_llm(a.model, directory, disable_log_stats=False, block_size=a.block_size)
    print(f"bench_vllm: {cpu_description()}", flush=True)
    print(f"engine start {time.perf_counter() - t0:.1f} s", flush=True)
    tok = llm.get_tokenizer()
    mem = Memory.create(directory, model=model_description(llm), num_pages=8192)
    prefix_ids = tok.encode(SYSTEM, add_special_tokens=False)
    set_prefix(mem, llm, SYSTEM, prefix_ids)
    turns = locomo_turns(a.locomo, max(ks))
    t0 = time.perf_counter()
    facts = [add_fact(mem, llm, "u0", t, tok.encode(t, add_special_tokens=False), prefix_ids)
             for t in turns]
    mem.commit()
    encode_s = time.perf_counter() - t0
    print(f"encoded {len(facts)} facts through vLLM in {encode_s:.1f} s", flush=True)
    q = tok.encode(f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)
    results = {"machine": os.uname().nodename, "cpus": len(os.sched_getaffinity(0)),
               "cpu": cpu_description(),
               "block_size": a.block_size,
               "encode_seconds": encode_s, "ttft": [], "load": []}

    # --- the first memory request after the commit ----------------------------------------------
    # It pays the workers' one-time load of the new memory generation (seconds): timed and
    # reported apart, so that it does not land in the first k's TTFT (with --reps 1 it would).
    r = mem.request("u0", facts[:min(ks)], q)
    llm.reset_prefix_cache()
    t, _ = timed(llm, r["prompt"], r["extra_args"])
    results["first_request_ms"] = 1e3 * t
    print(f"first memory request after the commit (the workers load the memory generation): "
          f"{1e3 * t:.1f} ms", flush=True)

    # --- TTFT against k -------------------------------------------------------------------------
    for k in ks:
        r = mem.request("u0", facts[:k], q)
        ids = r["prompt"]["prompt_token_ids"]
        inj, pre, floor, cached, parts = [], [], [], [], []
        for rep in range(a.reps):
            llm.reset_prefix_cache()
            open(trace, "w").close()  # this request's events only
            t, out = timed(llm, r["prompt"], r["extra_args"])
            inj.append(t)
            cached.append(out.num_cached_tokens or 0)
            events = read_trace(trace)
            llm.reset_prefix_cache()
            t, _ = timed(llm, {"prompt_token_ids": ids, "cache_salt": f"plain-{k}-{rep}"})
            pre.append(t)
            llm.reset_prefix_cache()
            # what vLLM prefilled after injection: everything after the tokens it loaded
            rest = ids[cached[-1]:]
            t, alone = timed(llm, {"prompt_token_ids": rest, "cache_salt": f"floor-{k}-{rep}"})
            floor.append(t)
            parts.append(breakdown(inj[-1], out.metrics, events, alone.metrics))
        row = {"k": k, "prompt_tokens": len(ids), "memory_tokens": r["memory_tokens"],
               "loaded_tokens": min(cached), "inject_ms": 1e3 * statistics.median(inj),
               "prefill_ms": 1e3 * statistics.median(pre),
               "floor_ms": 1e3 * statistics.median(floor)}
        row["speedup"] = row["prefill_ms"] / row["inject_ms"]
        row["breakdown_ms"] = {p: 1e3 * statistics.median(x[p] for x in parts) for p in PARTS}
        b = row["breakdown_ms"]
        row["ours_fraction"] = (b["connector"] + b["load"]) / row["inject_ms"]
        results["ttft"].append(row)
        print(f"ttft k={k:3d} prompt {len(ids):5d} tok (memory {r['memory_tokens']}, loaded "
              f"{row['loaded_tokens']}): inject {row['inject_ms']:8.1f} ms, re-prefill "
              f"{row['prefill_ms']:8.1f} ms ({row['speedup']:.1f}x), floor {row['floor_ms']:.1f} ms",
              flush=True)
        print("  breakdown " + ", ".join(f"{p} {b[p]:.1f}" for p in PARTS) + " ms: ours "
              f"(connector + load) {100 * row['ours_fraction']:.1f} % of the injected TTFT",
              flush=True)

    # --- concurrent users -----------------------------------------------------------------------
    from vllm import SamplingParams

    k = 20
    for n in users:
        row = {"users": n, "k": k}
        for mode in ("inject", "prefill"):
            llm.reset_prefix_cache()
            prompts, params = [], []
            for u in range(n):
                # each user: the same 20 facts in a rotated order (distinct prompts and salts)
                order = facts[u % len(facts):] + facts[:u % len(facts)]
                r = mem.request("u0", order[:k], q)
                if mode == "inject":
                    prompts.append(r["prompt"])
                    params.append(SamplingParams(temperature=0.0, max_tokens=8,
                                                 extra_args=r["extra_args"]))
                else:
                    prompts.append({"prompt_token_ids": r["prompt"]["prompt_token_ids"],
                                    "cache_salt": f"plain-{n}-{u}"})
                    params.append(SamplingParams(temperature=0.0, max_tokens=8))
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            ttfts = sorted(o.metrics.first_token_latency for o in outs
                           if getattr(o, "metrics", None) is not None)
            row[f"{mode}_rps"] = n / wall
            if ttfts:
                row[f"{mode}_p50_ms"] = 1e3 * ttfts[len(ttfts) // 2]
                row[f"{mode}_p99_ms"] = 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        row["rps_ratio"] = row["inject_rps"] / row["prefill_rps"]
        results["load"].append(row)
        print(f"load users={n:3d}: inject {row['inject_rps']:.2f} req/s "
              f"(p50 {row.get('inject_p50_ms', float('nan')):.0f} ms, p99 "
              f"{row.get('inject_p99_ms', float('nan')):.0f} ms), re-prefill "
              f"{row['prefill_rps']:.2f} req/s (p50 {row.get('prefill_p50_ms', float('nan')):.0f} "
              f"ms, p99 {row.get('prefill_p99_ms', float('nan')):.0f} ms): {row['rps_ratio']:.2f}x",
              flush=True)

    # --- connector overhead for a request without memory -----------------------------------------
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from inferscale_vllm.connector import InferScaleConnector as Connector

    sched = Connector(llm.llm_engine.vllm_config, KVConnectorRole.SCHEDULER, None)
    plain_ids = prefix_ids + q
    req = SimpleNamespace(request_id="x", kv_transfer_params=None, prompt_token_ids=plain_ids,
                          num_prompt_tokens=len(plain_ids), cache_salt=None)
    n_iter = 20000
    t = time.perf_counter()
    for _ in range(n_iter):
        sched.get_num_new_matched_tokens(req, 0)
        sched.build_connector_meta(None)
        sched.request_finished(req, [])
    hook_us = 1e6 * (time.perf_counter() - t) / n_iter
    llm.reset_prefix_cache()
    ttft, _ = timed(llm, {"prompt_token_ids": plain_ids, "cache_salt": "overhead"})
    results["overhead"] = {"scheduler_hooks_us": hook_us, "ttft_ms": 1e3 * ttft,
                           "fraction": hook_us * 1e-6 / ttft}
    print(f"overhead: the scheduler-side hooks take {hook_us:.1f} us per request without memory, "
          f"{100 * hook_us * 1e-6 / ttft:.4f}% of its TTFT ({1e3 * ttft:.1f} ms, {len(plain_ids)} "
          "tokens); the worker does nothing for it (no load in the step's metadata)", flush=True)

    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
