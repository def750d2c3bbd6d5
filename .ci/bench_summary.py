#!/usr/bin/env python3
"""Summarise Google Benchmark JSON files (one per bench_* executable) as a short table.

usage: bench_summary.py [--combine OUT.json] FILE.json...
       bench_summary.py --headline RESULTS_DIR | FILE.json|locomo-fast.md...
                                                   (the main job's first screen)

Columns: benchmark name, real time per iteration, decimal GB/s (the fixture's "GB/s" counter, else
bytes_per_second / 1e9) and the other user counters (ratios such as vs_copy, copy_GB/s), then the
label in brackets. Runs that called SkipWithError are listed as skipped with their message. A file
cut short (a benchmark killed by a timeout) is read up to its last complete entry. --combine writes
{executable: json} to one file.

When device runs are present, a last section reads the device targets of issue 13 (injection >= 0.8
of a device copy at m = 1,024; search 100k x 768 batch 1 <= 30 us p50 at recall >= 0.95; batched QPS
beside RAFT's exact search) as PASS / SHORT / NOT RUN, one line each.

--headline: the mission in a few tables, each figure beside its baseline or ceiling from the same
run: vLLM TTFT against k (injected, re-prefilled, the query alone) and requests/s of concurrent
users (bench_vllm.py's JSON), llama.cpp TTFT (bench_engine, when it ran), injection GB/s beside a
copy of the same bytes (bench_inject's bf16 cases), search against hnswlib at equal recall
(bench_index_host's fp32 equal_recall cases), LoCoMo F1 and agreement (locomo-fast.md). Given
the main job's results folder it also prints the configuration (config.txt: the mode, CPUs, GPU and
each step's arguments) and each step's wall seconds (steps.txt).

The fact index (bench_index) gets a second table: each search figure beside its ceiling from the
same run (recall@10, QPS, exact QPS and speedup, hnswlib QPS/recall and vs_hnswlib), the build
rates, and the crossover N (smallest N from which graph search beats exact search at batch 1).
"""
import json
import os
import sys

STANDARD = {
    "name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
    "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit",
    "bytes_per_second", "items_per_second", "label", "error_occurred", "error_message",
    "aggregate_name", "aggregate_unit", "skipped", "skip_message",
}


def load(path):
    """Returns (document, note); a truncated file yields the complete entries and a note."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        return json.loads(text), ""
    except json.JSONDecodeError:
        pass
    doc = {"context": {}, "benchmarks": []}
    decoder = json.JSONDecoder()
    at = text.find('"benchmarks"')
    if at < 0:
        return doc, "no benchmark entries (empty or cut-short file)"
    at = text.find("[", at) + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] != "{":
            break
        try:
            entry, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        doc["benchmarks"].append(entry)
    return doc, "file cut short: %d complete entries" % len(doc["benchmarks"])


def fmt_time(b):
    t = b.get("real_time")
    if t is None:
        return "-"
    return "%.3g %s" % (t, b.get("time_unit", "ns"))


def fmt_num(x):
    if isinstance(x, (int, float)):
        return "%.4g" % x
    return str(x)


# bench_index counters, in the order they are read: the figure first, then its ceilings.
INDEX_ORDER = [
    "recall", "recall_tol", "QPS", "us_per_query", "exact_QPS", "exact_us_per_query", "speedup",
    "hnswlib_QPS", "hnswlib_us_per_query", "hnswlib_recall", "vs_hnswlib", "graph_us", "exact_us",
    "wall_us_per_query", "crossover_N", "parity_cost_factor", "cost_factor", "auto_threshold",
    "auto_picks_exact", "vectors_per_s", "build_s", "hnswlib_build_s",
    "hnswlib_vectors_per_s", "itopk", "samplings", "hnswlib_ef", "threads",
]


def ordered_counters(b):
    keys = [k for k in b if k not in STANDARD and k != "GB/s" and isinstance(b[k], (int, float))]
    if not b.get("name", "").startswith("index/"):
        return keys
    rank = {k: i for i, k in enumerate(INDEX_ORDER)}
    return sorted(keys, key=lambda k: (rank.get(k, len(INDEX_ORDER)), k))


def index_table(entries):
    """The bench_index figures beside their ceilings, one line per case (means of repetitions)."""
    lines = []
    for b in entries:
        name = b.get("name", "?")
        if not name.startswith("index/") or b.get("error_occurred") or b.get("skipped"):
            continue
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "mean":
            continue
        if "QPS" in b:
            cells = ["recall %.3f" % b.get("recall", float("nan")),
                     "QPS %s" % fmt_num(b["QPS"]),
                     "exact QPS %s (graph %.2fx)" % (fmt_num(b.get("exact_QPS", 0)),
                                                     b.get("speedup", float("nan")))]
            if "hnswlib_QPS" in b:
                cells.append("hnswlib QPS %s at recall %.3f (graph %.2fx)" % (
                    fmt_num(b["hnswlib_QPS"]), b.get("hnswlib_recall", float("nan")),
                    b.get("vs_hnswlib", float("nan"))))
        elif "graph_us" in b:
            cells = ["graph %.1f us" % b["graph_us"], "exact %.1f us" % b.get("exact_us", 0),
                     "graph %.2fx" % b.get("speedup", float("nan")),
                     "recall %.3f" % b.get("recall", float("nan")),
                     "cost factor %.3g" % b.get("cost_factor", float("nan")),
                     "automatic: %s" % ("exact" if b.get("auto_picks_exact") else "graph")]
        elif "crossover_N" in b:
            cells = ["crossover N %d" % b["crossover_N"],
                     "cost factor at parity %.3g" % b.get("parity_cost_factor", float("nan")),
                     b.get("label", "")]
        elif "vectors_per_s" in b:
            cells = ["%s vectors/s (%.3g s)" % (fmt_num(b["vectors_per_s"]), b.get("build_s", 0))]
            if "hnswlib_build_s" in b:
                cells.append("hnswlib %.3g s (graph %.2fx)" % (b["hnswlib_build_s"],
                                                               b.get("vs_hnswlib", float("nan"))))
        else:
            continue
        lines.append((name, "; ".join(cells)))
    if lines:
        width = max(len(n) for n, _ in lines)
        print("\nfact index (each figure beside its ceiling from the same run):")
        for n, c in lines:
            print("  " + n.ljust(width) + "  " + c)


def usable(b):
    if b.get("error_occurred") or b.get("skipped"):
        return False
    return not (b.get("run_type") == "aggregate" and b.get("aggregate_name") != "mean")


def fmt_int(x):
    return "{:,}".format(int(round(x)))


def table(header, rows, indent="  "):
    """Right-aligned columns but the first; returns the lines."""
    cells = [header] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = []
    for r in cells:
        out.append(indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths))))
    return out


def case_part(name, key):
    """The value of a '/key:value' part of a benchmark name, else ''."""
    for part in name.split("/"):
        if part.startswith(key + ":"):
            return part[len(key) + 1:]
    return ""


def engine_lines(entries):
    """bench_engine (--full): llama.cpp TTFT against k, the divergence of independent facts, and
    the recompute curve."""
    lines = []
    ttft = sorted((b for b in entries if b.get("name", "").startswith("engine/ttft") and usable(b)),
                  key=lambda b: b.get("k", 0))
    if ttft:
        lines.append("time to first token, llama.cpp + SmolLM2-135M Q4_1 (CPU, 1 thread), question of "
                     "%d tokens (bench_engine, mean of %d runs):" % (
                         ttft[0].get("question_tokens", 0), ttft[0].get("iterations", 0)))
        rows = [[str(b.get("k", 0)), fmt_int(b.get("memory_tokens", 0)),
                 "%.1f" % b.get("inferscale_ms", 0), "%.1f" % b.get("prefill_ms", 0),
                 "%.1fx" % b.get("speedup", 0), "%.1f" % b.get("query_ms", 0),
                 "%.2fx" % b.get("over_floor", 0)] for b in ttft]
        lines += table(["k", "memory tokens", "injected ms", "re-prefilled ms", "speed-up",
                        "query alone ms", "injected / query alone"], rows)
    div = [b for b in entries if b.get("name", "").startswith("engine/divergence") and usable(b)]
    for b in sorted(div, key=lambda b: b.get("k", 0)):
        lines.append("  divergence from a joint prefill, k=%d: facts encoded apart KL %.3g nats/token, "
                     "top-1 %.2f; encoded jointly KL %.3g, top-1 %.2f" % (
                         b.get("k", 0), b.get("kl_mean_independent", 0),
                         b.get("top1_independent", 0), b.get("kl_mean_joint", 0),
                         b.get("top1_joint", 0)))
    rec = [b for b in entries if b.get("name", "").startswith("engine/recompute") and usable(b)]
    if rec:
        lines.append("recompute after injection (recompute.hpp; KL to the re-prefilled text, 4 "
                     "questions x 32 tokens; TTFT includes the layer-1 probe and the recompute):")
        rows = [[str(int(b.get("k", 0))), "behind prefix" if b.get("prefixed") else "alone",
                 str(int(b.get("r", 0))), "%d%%" % round(100 * b.get("rho", 0)),
                 "one batch" if b.get("one_batch") else "in order",
                 "%.1f%%" % (100 * b.get("recomputed", 0)), "%.3f" % b.get("kl_mean", 0),
                 "%.2f" % b.get("top1", 0), "%.0f" % b.get("ttft_ms", 0),
                 "%.0f" % b.get("prefill_ms", 0)]
                for b in sorted(rec, key=lambda b: (b.get("k", 0), b.get("prefixed", 0),
                                                    b.get("r", 0), b.get("rho", 0)))]
        lines += table(["k", "facts encoded", "first r", "rho", "runs", "recomputed", "KL",
                        "top-1", "TTFT ms", "re-prefill ms"], rows)
    return lines


def vllm_lines(doc, reps):
    """bench/vllm/bench_vllm.py's JSON: TTFT against k and requests/s under concurrent users."""
    lines = []
    ttft = doc.get("ttft", [])
    if ttft:
        lines.append("time to first token, vLLM (CPU build) + SmolLM2-135M bf16 on %s, InferScale "
                     "as its KV connector (bench_vllm.py, %s; prefix cache reset before each "
                     "request):" % (doc.get("cpu") or "%s CPUs" % doc.get("cpus", "?"), reps))
        rows = [[str(r["k"]), fmt_int(r["memory_tokens"]), fmt_int(r["inject_ms"]),
                 fmt_int(r["prefill_ms"]), "%.1fx" % r["speedup"], fmt_int(r.get("floor_ms", 0)),
                 "%.2fx" % (r["inject_ms"] / r["floor_ms"]) if r.get("floor_ms") else "-"]
                for r in ttft]
        lines += table(["k facts", "memory tokens", "injected ms", "re-prefilled ms", "speed-up",
                        "query alone ms", "injected / query alone"], rows)
        parts = [r for r in ttft if "breakdown_ms" in r]
        if parts:
            lines.append("  the injected TTFT broken down (ms; ours = the connector's planning + "
                         "its load into vLLM's cache; the rest is vLLM's):")
            names = list(parts[0]["breakdown_ms"])
            lines += table(["k"] + names + ["ours / injected TTFT"],
                           [[str(r["k"])] + ["%.1f" % r["breakdown_ms"][p] for p in names]
                            + ["%.1f %%" % (100 * r["ours_fraction"])] for r in parts],
                           indent="    ")
        if "first_request_ms" in doc:
            lines.append("  (not in the table: the first memory request after the commit, %s ms, "
                         "pays the workers' one-time load of the memory generation)"
                         % fmt_int(doc["first_request_ms"]))
    load = doc.get("load", [])
    if load:
        lines.append("concurrent users on the same engine (k = %d facts each, 8 new tokens, one "
                     "batch of requests):" % load[0]["k"])
        rows = [[str(r["users"]), "%.2f" % r["inject_rps"], "%.2f" % r["prefill_rps"],
                 "%.1fx" % r["rps_ratio"],
                 "%s / %s" % (fmt_int(r.get("inject_p50_ms", 0)), fmt_int(r.get("prefill_p50_ms", 0)))]
                for r in load]
        lines += table(["users", "injected req/s", "re-prefilled req/s", "ratio",
                        "p50 TTFT ms injected / re-prefilled"], rows)
    return lines


def inject_lines(entries):
    """bench_inject: the bf16 injection cases beside the plain copy of the same bytes."""
    rows = []
    for b in entries:
        name = b.get("name", "")
        parts = name.split("/")
        if len(parts) < 5 or parts[0] != "inject" or parts[3] != "bf16" or not usable(b):
            continue
        if not parts[4].startswith("m:") or "vs_copy" not in b:
            continue
        rows.append([parts[1], parts[2], parts[4][2:], "%.2f" % b.get("GB/s", 0),
                     "%.2f" % b.get("copy_GB/s", 0), "%.2f" % b["vs_copy"]])
    if not rows:
        return []
    return (["injection throughput (bench_inject, Google Benchmark min_time 0.1 s) beside a plain "
             "copy of the same bytes timed in the same run (the ceiling):"] +
            table(["where", "model geometry", "tokens", "GB/s", "copy GB/s", "of the copy"], rows))


def search_lines(entries):
    """bench_index_host: the fact index against hnswlib at equal recall (fp32 rows)."""
    rows = []
    for b in entries:
        name = b.get("name", "")
        if not name.startswith("index_host/equal_recall/") or not usable(b):
            continue
        if "/rows:" in name or "/traversal:" in name or "vs_hnswlib" not in b:
            continue
        data = case_part(name, "data")
        rows.append(["%s %s-d" % (data, case_part(name, "dim")), fmt_int(b.get("N", 0)),
                     ">= 0.%s" % case_part(name, "target"),
                     "%.3f / %.1f" % (b.get("recall", 0), b.get("us_per_query", 0)),
                     "%.3f / %.1f" % (b.get("hnswlib_recall", 0), b.get("hnswlib_us_per_query", 0)),
                     "%.2fx" % b["vs_hnswlib"],
                     "%.2f / %.2f" % (b.get("graph_build_s", 0), b.get("hnswlib_build_s", 0))])
    if not rows:
        return []
    return (["fact index search vs hnswlib 0.6.2 (M 16, efC 200, -march=native) at equal recall, "
             "batch 1, one thread, 1,024 queries (bench_index_host):"] +
            table(["data", "N", "recall@10", "graph recall / us", "hnswlib recall / us",
                   "graph speed-up", "build s graph / hnswlib"], rows))


def tenants_lines(entries):
    """bench_index_tenants: many users' small namespaces in one index vs one hnswlib per user."""
    cells = {}
    for b in entries:
        name = b.get("name", "")
        if not name.startswith("index_tenants/") or not usable(b) or "vs_hnswlib" not in b:
            continue
        key = (case_part(name, "users"), case_part(name, "dim"), case_part(name, "batch"))
        cells.setdefault(key, []).append((case_part(name, "store"), case_part(name, "target"), b))
    lines = []
    for (users, dim, batch), found in sorted(cells.items()):
        parts = ["%s rows at recall >= 0.%s: %.2fx (%.0f vs %.0f QPS)" % (
            store, target, b["vs_hnswlib"], b.get("QPS", 0), b.get("hnswlib_QPS", 0))
            for store, target, b in sorted(found, key=lambda x: (x[0], x[1]))]
        overhead = {}
        peer = None
        for store, _, b in found:
            if "overhead_B_per_fact" in b:
                overhead[store] = b["overhead_B_per_fact"]
            if "hnswlib_overhead_B_per_fact" in b and "hnswlib_fixed_B_per_fact" in b:
                peer = b
        if overhead and peer is not None:
            parts.append("index overhead beside the vectors %s B per fact, hnswlib's %s B per "
                         "element + %s B of its per-index locks" % (
                             " / ".join("%.0f (%s)" % (v, k) for k, v in sorted(overhead.items())),
                             fmt_int(peer["hnswlib_overhead_B_per_fact"] -
                                     peer["hnswlib_fixed_B_per_fact"]),
                             fmt_int(peer["hnswlib_fixed_B_per_fact"])))
        lines.append("many users (bench_index_tenants): %s users, %s-d, a step of %s users' "
                     "queries, one index vs one hnswlib per user, one thread: %s" % (
                         fmt_int(float(users)), dim, batch, "; ".join(parts)))
    return lines


def index_lines(entries):
    """bench_index (--full): the best graph-over-exact speed-up and the range against hnswlib."""
    lines = []
    search = [b for b in entries if b.get("name", "").startswith("index/") and usable(b)
              and "QPS" in b]
    if search:
        best = max(search, key=lambda b: b.get("speedup", 0))
        lines.append("fact index (bench_index): graph search up to %.1fx exact search of the same "
                     "queries (%s, recall %.3f)" % (best.get("speedup", 0), best.get("name", "?"),
                                                    best.get("recall", 0)))
        hn = [b for b in search if "vs_hnswlib" in b]
        if hn:
            r = sorted(b["vs_hnswlib"] for b in hn)
            lines.append("fact index (bench_index) vs hnswlib, each at recall >= 0.95: %.2f-%.2fx "
                         "over %d cases" % (r[0], r[-1], len(r)))
    return lines


def locomo_lines(path):
    """locomo_eval's table (its row over all categories) and the served row of the window curve."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.readlines()
    except OSError:
        return []
    rows = [l for l in text if l.startswith("| **all** |")]
    if not rows:
        return []
    c = [x.strip() for x in rows[0].strip().strip("|").split("|")]
    # category | questions | recall@5 | @10 | @20 | F1 a | F1 b | F1 c | F1 d | exact | F1(a,b)
    # | TTFT a | inject | TTFT b
    if len(c) < 14:
        return []
    served = [l for l in text if l.startswith("| single pass")]
    agree = ""
    if served:
        s = [x.strip() for x in served[0].strip().strip("|").split("|")]
        # encoding | w | turns seen | KL(b||a) | top-1 (a)=(b) | KL(d||a) | top-1 (a)=(d) | ...
        if len(s) >= 5:
            agree = "%s (KL %s nats)" % (s[4], s[3])
    sessions = "conv-26, first 3 sessions" if "locomo-fast" in os.path.basename(path) else path
    lines = ["LoCoMo end to end, llama.cpp + SmolLM2-135M (1 thread), MiniLM retrieval, top 10 facts "
             "(locomo_eval, %s, %s questions):" % (sessions, c[1])]
    rows = [["injected (a)", c[5], c[11]], ["re-prefilled (b)", c[6], c[13]],
            ["no memory (c)", c[7], "-"]]
    if c[8] != "n/a":  # locomo_eval --no-whole: not run
        rows.append(["whole conversation (d)", c[8], "-"])
    lines += table(["answers", "F1", "TTFT ms"], rows)
    try:
        ratio = "%.1fx" % (float(c[13]) / float(c[11]))
    except (ValueError, ZeroDivisionError):
        ratio = "n/a"
    lines.append("  (a) vs (b): TTFT %s faster; next-token top-1 agreement on the gold answers %s; "
                 "same greedy answer %s; F1(a, b) %s; evidence recall@10 %s" % (
                     ratio, agree or "n/a", c[9], c[10], c[3]))
    return lines


def steps_line(path):
    try:
        with open(path, encoding="utf-8") as f:
            steps = [l.rstrip("\n").split("\t") for l in f if "\t" in l]
    except OSError:
        return []
    short = []
    for name, secs in steps:
        label = name.split(" (")[0].replace("benchmark ", "").replace("vLLM: ", "")
        label = label.split(" --")[0]
        short.append("%s %s" % (label, secs))
    return ["steps, wall seconds: " + "; ".join(short)] if short else []


def serve_lines(doc, args):
    """bench/serve/bench_serve.py's JSON: the memory server over HTTP, injected against the same
    server answering with the facts as text."""
    rows = doc.get("rows", [])
    if not rows:
        return []
    lines = ["the memory server over HTTP (python -m inferscale_vllm.serve; bench_serve.py %s; "
             "k = %d facts per request, each request's own retrieval; prefix caching on), %s:"
             % (args, doc.get("k", 0), doc.get("cpu", "?"))]
    by = {(r["users"], r["mode"]): r for r in rows}
    table_rows = []
    for n in sorted({r["users"] for r in rows}):
        i, t = by.get((n, "injected")), by.get((n, "text"))
        if not i or not t:
            continue
        table_rows.append([str(n), "%s / %s" % (fmt_int(i["ttft_p50_ms"]), fmt_int(t["ttft_p50_ms"])),
                           "%.1fx" % (t["ttft_p50_ms"] / i["ttft_p50_ms"]),
                           "%.2f / %.2f" % (i["rps"], t["rps"]), "%.1fx" % (i["rps"] / t["rps"]),
                           "%.1f ms" % (i.get("compose_p50_ms") or 0.0),
                           "%.0f / %.0f" % (i["ttft_mean_ms"], i["engine_ttft_mean_ms"])
                           if "engine_ttft_mean_ms" in i else "-"])
    lines += table(["users", "TTFT p50 ms injected / text", "speed-up", "req/s injected / text",
                    "ratio", "retrieval+composition p50",
                    "injected TTFT mean ms: client / vLLM's own"], table_rows)
    lines.append("  leaks: %d in %d injected answers checked for their own user's facts"
                 % (doc.get("leaks", -1), doc.get("checked", 0)))
    if "served_over_offline" in doc:
        lines.append("  through HTTP the TTFT speed-up is %.0f %% of the offline connector's (same "
                     "users, questions and k, same run)" % (100 * doc["served_over_offline"]))
    return lines


def headline_only(paths):
    """--headline DIR (the main job's results) or FILES: the mission in a few lines."""
    if len(paths) == 1 and os.path.isdir(paths[0]):
        d = paths[0]
        paths = sorted(os.path.join(d, f) for f in os.listdir(d)
                       if f.endswith(".json") or f == "locomo-fast.md")
        config = {}
        try:
            with open(os.path.join(d, "config.txt"), encoding="utf-8") as f:
                for l in f:
                    if "\t" in l:
                        k, v = l.rstrip("\n").split("\t", 1)
                        config[k] = v
        except OSError:
            pass
        steps = os.path.join(d, "steps.txt")
    else:
        config, steps = {}, None
    entries, vllm_doc, locomo, serve_doc = [], None, None, None
    for path in paths:
        if path.endswith(".md"):
            locomo = path
            continue
        try:
            doc, _ = load(path)
        except OSError:
            continue
        if isinstance(doc, dict) and "ttft" in doc and "benchmarks" not in doc:
            vllm_doc = doc
        elif isinstance(doc, dict) and "rows" in doc and "leaks" in doc:
            serve_doc = doc
        elif isinstance(doc, dict):
            entries += doc.get("benchmarks", [])
    reps = config.get("bench_vllm.py", "")
    n = reps.split("--reps ")[1].split()[0] if "--reps " in reps else ""
    reps = "one run per figure" if n == "1" else ("median of %s runs" % n if n else "its defaults")
    print("==== InferScale: the headline (%s main job; details below) ====" %
          config.get("mode", "the"))
    print("The mission: serve a user's memory to an engine without re-prefilling it; each figure "
          "beside its baseline or ceiling, measured in the same run.")
    if config:
        print("configuration: %s CPUs, %s, GPU: %s; each step's arguments:" % (
            config.get("cpus", "?"), config.get("cpu", "CPU model not recorded"),
            config.get("gpu", "?")))
        for k, v in config.items():
            if k not in ("mode", "gpu", "cpus", "cpu"):
                print("  %s %s" % (k, v))
    blocks = []
    if vllm_doc is not None:
        blocks.append(vllm_lines(vllm_doc, reps))
    if serve_doc is not None:
        blocks.append(serve_lines(serve_doc, config.get("bench_serve.py", "")))
    blocks.append(engine_lines(entries))
    blocks.append(inject_lines(entries))
    blocks.append(search_lines(entries))
    blocks.append(tenants_lines(entries))
    blocks.append(index_lines(entries))
    if locomo:
        blocks.append(locomo_lines(locomo))
    blocks = [b for b in blocks if b]
    for b in blocks:
        print()
        for line in b:
            print(line)
    if not blocks:
        print("no results: every step failed (see the details)")
    if steps:
        print()
        for line in steps_line(steps):
            print(line)
    return 0


# The device targets of issue 13 (item 14): what a GPU session reads first.
DEVICE_TARGETS = [
    # (benchmark name prefix, what, counter, comparison, bound, extra check)
    ("inject/device/llama3.1-8b/bf16/m:1024/", "injection, Llama-3.1-8B, m 1,024, vs device copy",
     "vs_copy", ">=", 0.8),
    ("inject/device/qwen2.5-7b/bf16/m:1024/", "injection, Qwen2.5-7B, m 1,024, vs device copy",
     "vs_copy", ">=", 0.8),
    ("inject_checked/device/llama3.1-8b/bf16/m:1024/",
     "checked injection (staging included), Llama-3.1-8B, m 1,024", "vs_copy", ">=", 0.8),
    ("index/device/search/dim:768/N:100000/batch:1/", "search 100k x 768, batch 1, p50 us/query",
     "p50_us_per_query", "<=", 30.0),
    ("index/device/search/dim:768/N:100000/batch:1024/",
     "search 100k x 768, batch 1,024, QPS / RAFT exact_search QPS", "speedup", ">=", 1.0),
    ("index/device/search/dim:384/N:100000/batch:1024/",
     "search 100k x 384, batch 1,024, QPS / RAFT exact_search QPS", "speedup", ">=", 1.0),
]


def device_targets(entries):
    """One line per device target: PASS / SHORT with the figure, or NOT RUN (skipped, absent)."""
    print("\n==== device targets (issue 13) ====")
    for prefix, what, counter, op, bound in DEVICE_TARGETS:
        runs = [b for b in entries if b.get("name", "").startswith(prefix)]
        good = [b for b in runs if usable(b) and counter in b]
        if not good:
            why = "skipped" if runs else "absent"
            if runs and (runs[0].get("error_message") or runs[0].get("skip_message")):
                why += ": " + (runs[0].get("error_message") or runs[0].get("skip_message"))
            print("NOT RUN  %s (%s)" % (what, why))
            continue
        # several runs may match (e.g. the search split over 1, 4 or 8 CTAs per query): the best
        # one that meets the recall bound, else the first
        def meets(b):
            value = b[counter]
            ok = value >= bound if op == ">=" else value <= bound
            recall = b.get("recall")
            if recall is not None and prefix.startswith("index/"):
                ok = ok and recall >= 0.95
            return ok
        passing = [b for b in good if meets(b)]
        pool = passing if passing else good[:1]
        b = max(pool, key=lambda r: r[counter]) if op == ">=" else min(pool, key=lambda r: r[counter])
        value = b[counter]
        met = meets(b)
        recall = b.get("recall")
        extra = ""
        if recall is not None:
            extra += ", recall@10 %.3f (>= 0.95)" % recall
        if "QPS" in b and "exact_QPS" in b:
            extra += ", QPS %s vs exact %s" % (fmt_num(b["QPS"]), fmt_num(b["exact_QPS"]))
        if "copy_GB/s" in b:
            extra += ", copy %s GB/s" % fmt_num(b["copy_GB/s"])
        if len(good) > 1:
            extra += " [%s]" % b.get("name", "")
        print("%-8s %s: %s = %s (target %s %s)%s" % ("PASS" if met else "SHORT", what, counter,
                                                    fmt_num(value), op, fmt_num(bound), extra))


def split_report(entries):
    """The automatic split (search_params::ctas_per_query = 0) beside one CTA per query and the
    best fixed split, per search case that ran all of them: whether it should be the default."""
    cases = {}
    for b in entries:
        name = b.get("name", "")
        if not name.startswith("index/device/search/") or not usable(b):
            continue
        if "p50_us_per_query" not in b or "/ctas:" not in name:
            continue
        base, ctas = name.split("/ctas:", 1)
        cases.setdefault(base, {})[ctas.split("/")[0]] = b
    lines = []
    for base in sorted(cases):
        runs = cases[base]
        if "1" not in runs or "0" not in runs:
            continue
        one, auto = runs["1"], runs["0"]
        fixed = [(c, r) for c, r in runs.items() if c not in ("0", "1")]
        best = min(fixed, key=lambda cr: cr[1]["p50_us_per_query"]) if fixed else None
        line = "%s: p50 us/query 1 CTA %s (recall %.3f), automatic %s (recall %.3f)" % (
            base, fmt_num(one["p50_us_per_query"]), one.get("recall", 0),
            fmt_num(auto["p50_us_per_query"]), auto.get("recall", 0))
        if best is not None:
            line += ", best fixed %s CTAs %s (recall %.3f)" % (
                best[0], fmt_num(best[1]["p50_us_per_query"]), best[1].get("recall", 0))
        pays = (auto["p50_us_per_query"] < one["p50_us_per_query"] and
                auto.get("recall", 0) >= one.get("recall", 0) - 0.005)
        lines.append(("PAYS    " if pays else "NO GAIN ") + line)
    print("\n==== automatic split (ctas_per_query 0) against one CTA per query ====")
    if not lines:
        print("NOT RUN  no device search case ran with both ctas:1 and ctas:0")
    for line in lines:
        print(line)


def collapse_skipped(rows):
    """Runs skipped for the same reason (no GPU) become one line."""
    out, skipped = [], {}
    for r in rows:
        if r[3].startswith("skipped: "):
            skipped.setdefault(r[3], []).append(r[0])
        else:
            out.append(r)
    for reason, names in skipped.items():
        out.append(("%d runs" % len(names), "-", "-", reason + " (e.g. %s)" % names[0]))
    return out


def main(argv):
    combine = None
    if argv and argv[0] == "--headline":
        return headline_only(argv[1:])
    if len(argv) >= 2 and argv[0] == "--combine":
        combine, argv = argv[1], argv[2:]
    if not argv:
        print("bench_summary: no JSON files")
        return 0
    combined = {}
    rows = []
    notes = []
    for path in argv:
        exe = os.path.splitext(os.path.basename(path))[0]
        try:
            doc, note = load(path)
        except OSError as e:
            notes.append("%s: %s" % (exe, e))
            continue
        combined[exe] = doc
        if note:
            notes.append("%s: %s" % (exe, note))
        for b in doc.get("benchmarks", []):
            if b.get("run_type") == "aggregate" and b.get("aggregate_name") not in ("mean", "median"):
                continue
            name = b.get("name", "?")
            if b.get("error_occurred") or b.get("skipped"):
                msg = b.get("error_message") or b.get("skip_message") or "skipped"
                rows.append((name, "-", "-", "skipped: " + msg))
                continue
            gbps = b.get("GB/s")
            if gbps is None and b.get("bytes_per_second"):
                gbps = b["bytes_per_second"] / 1e9
            others = ["%s=%s" % (k, fmt_num(b[k])) for k in ordered_counters(b)]
            if b.get("label"):
                others.append("[%s]" % b["label"])
            rows.append((name, fmt_time(b), fmt_num(gbps) if gbps is not None else "-",
                         " ".join(others)))
    if combine:
        with open(combine, "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=1)
    total_skipped = sum(1 for r in rows if r[3].startswith("skipped"))
    total_runs = len(rows)
    rows = collapse_skipped(rows)
    if rows:
        widths = [max(len(r[i]) for r in rows + [("benchmark", "time", "GB/s", "")])
                  for i in range(3)]
        header = ("benchmark", "time", "GB/s", "counters")
        print("  ".join(h.ljust(w) for h, w in zip(header[:3], widths)) + "  " + header[3])
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        print("%d runs, %d skipped, from %d file(s)" % (total_runs, total_skipped, len(argv)))
    else:
        print("bench_summary: no benchmark runs in %d file(s)" % len(argv))
    every = [b for doc in combined.values() for b in doc.get("benchmarks", [])]
    index_table(every)
    if any(b.get("name", "").startswith(("inject/device", "index/device")) for b in every):
        device_targets(every)
        split_report(every)
    for n in notes:
        print("note: " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
