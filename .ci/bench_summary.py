#!/usr/bin/env python3
"""Summarise Google Benchmark JSON files (one per bench_* executable) as a short table.

usage: bench_summary.py [--combine OUT.json] FILE.json...
       bench_summary.py --headline FILE.json|locomo-*.md...   (the main job's first screen)

Columns: benchmark name, real time per iteration, decimal GB/s (the fixture's "GB/s" counter, else
bytes_per_second / 1e9) and the other user counters (ratios such as vs_copy, copy_GB/s), then the
label in brackets. Runs that called SkipWithError are listed as skipped with their message. A file
cut short (a benchmark killed by a timeout) is read up to its last complete entry. --combine writes
{executable: json} to one file.

When device runs are present, a last section reads the device targets of issue 13 (injection >= 0.8
of a device copy at m = 1,024; search 100k x 768 batch 1 <= 30 us p50 at recall >= 0.95; batched QPS
beside RAFT's exact search) as PASS / SHORT / NOT RUN, one line each.

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


def headline(entries):
    """The few figures a newcomer reads first, each beside the baseline of the same run."""
    lines = []
    ttft = sorted((b for b in entries if b.get("name", "").startswith("engine/ttft") and usable(b)),
                  key=lambda b: b.get("k", 0))
    if ttft:
        base = ttft[0].get("inferscale_ms")
        lines.append("time to first token, llama.cpp + SmolLM2-135M (CPU, 1 thread), "
                     "question of %d tokens:" % ttft[0].get("question_tokens", 0))
        lines.append("  %4s %7s  %14s %10s %12s %14s %9s  %8s %10s %8s" % (
            "k", "memory", "InferScale ms", "(inject", "+ question)", "re-prefill ms", "query ms",
            "speedup", "over floor", "vs k=%d" % ttft[0].get("k", 0)))
        for b in ttft:
            lines.append("  %4d %7d  %14.1f %10.1f %12.1f %14.1f %9.1f  %7.1fx %9.2fx %7.2fx" % (
                b.get("k", 0), b.get("memory_tokens", 0), b.get("inferscale_ms", 0),
                b.get("inject_ms", 0), b.get("question_ms", 0),
                b.get("prefill_ms", 0), b.get("query_ms", 0), b.get("speedup", 0),
                b.get("over_floor", 0), b.get("inferscale_ms", 0) / base if base else 0))
    div = [b for b in entries if b.get("name", "").startswith("engine/divergence") and usable(b)]
    for b in sorted(div, key=lambda b: b.get("k", 0)):
        lines.append("divergence from joint prefill, k=%d: independently encoded facts KL %.3g "
                     "nats/token, top-1 %.2f, greedy common %.2f; jointly encoded KL %.3g, "
                     "top-1 %.2f" % (b.get("k", 0), b.get("kl_mean_independent", 0),
                                     b.get("top1_independent", 0),
                                     b.get("greedy_common_independent", 0),
                                     b.get("kl_mean_joint", 0), b.get("top1_joint", 0)))
    inject = [b for b in entries if b.get("name", "").startswith("inject/") and usable(b)
              and "vs_copy" in b]
    if inject:
        ratios = sorted(b["vs_copy"] for b in inject)
        lines.append("injection vs a plain copy of the same bytes (host): %.2f-%.2f of memcpy "
                     "over %d cases" % (ratios[0], ratios[-1], len(ratios)))
    search = [b for b in entries if b.get("name", "").startswith("index/") and usable(b)
              and "QPS" in b]
    if search:
        best = max(search, key=lambda b: b.get("speedup", 0))
        lines.append("fact index: graph search up to %.1fx exact search (%s, recall %.3f)" % (
            best.get("speedup", 0), best.get("name", "?"), best.get("recall", 0)))
        hn = [b for b in search if "vs_hnswlib" in b]
        if hn:
            r = sorted(b["vs_hnswlib"] for b in hn)
            lines.append("fact index vs hnswlib at equal recall (host): %.2f-%.2fx over %d cases"
                         % (r[0], r[-1], len(r)))
    return lines


def vllm_lines(doc):
    """bench/vllm/bench_vllm.py's JSON: TTFT against k and requests/s under concurrent users."""
    lines = []
    ttft = doc.get("ttft", [])
    if ttft:
        lines.append("time to first token, vLLM (CPU build) + SmolLM2-135M, InferScale as its KV "
                     "connector: " + "; ".join(
                         "k=%d (%d memory tokens) %.0f ms vs %.0f ms re-prefilled (%.1fx)" % (
                             r["k"], r["memory_tokens"], r["inject_ms"], r["prefill_ms"],
                             r["speedup"]) for r in ttft) +
                     ("; the first memory request after a commit %.0f ms (the workers load the "
                      "memory generation once)" % doc["first_request_ms"]
                      if "first_request_ms" in doc else ""))
    load = doc.get("load", [])
    if load:
        lines.append("vLLM throughput under concurrent users (k=%d facts each): " % load[0]["k"] +
                     "; ".join("%d users %.2f req/s vs %.2f re-prefilled (%.2fx)" % (
                         r["users"], r["inject_rps"], r["prefill_rps"], r["rps_ratio"])
                         for r in load))
    return lines


def locomo_lines(path):
    """locomo_eval's table: its row over all categories."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            rows = [l for l in f if l.startswith("| **all** |")]
    except OSError:
        return []
    if not rows:
        return []
    c = [x.strip() for x in rows[0].strip().strip("|").split("|")]
    # category | questions | recall@5 | @10 | @20 | F1 a | F1 b | F1 c | F1 d | exact | F1(a,b)
    # | TTFT a | inject | TTFT b
    if len(c) < 14:
        return []
    return ["LoCoMo (%s, %s questions): recall@10 %s; answer F1 injected %s vs re-prefilled %s "
            "(no memory %s); injected = re-prefilled answers %s; TTFT %s ms vs %s ms" % (
                os.path.basename(path), c[1], c[3], c[5], c[6], c[7], c[9], c[11], c[13])]


def print_headline(lines):
    if lines:
        print("\n==== headline ====")
        for line in lines:
            print(line)


def headline_only(paths):
    """--headline: the mission in a few lines, from whatever results exist."""
    entries, lines = [], []
    for path in paths:
        if path.endswith(".md"):
            lines += locomo_lines(path)
            continue
        try:
            doc, _ = load(path)
        except OSError:
            continue
        if isinstance(doc, dict) and "ttft" in doc and "benchmarks" not in doc:
            lines += vllm_lines(doc)
        elif isinstance(doc, dict):
            entries += doc.get("benchmarks", [])
    lines = headline(entries) + lines
    print("==== InferScale: the headline (details below) ====")
    for line in lines or ["no results: every step failed (see the details)"]:
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
    print_headline(headline(every))
    if any(b.get("name", "").startswith(("inject/device", "index/device")) for b in every):
        device_targets(every)
        split_report(every)
    for n in notes:
        print("note: " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
