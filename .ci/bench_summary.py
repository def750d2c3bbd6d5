#!/usr/bin/env python3
"""Summarise Google Benchmark JSON files (one per bench_* executable) as a short table.

usage: bench_summary.py [--combine OUT.json] FILE.json...

Columns: benchmark name, real time per iteration, decimal GB/s (the fixture's "GB/s" counter, else
bytes_per_second / 1e9) and the other user counters (ratios such as vs_copy, copy_GB/s). Runs that
called SkipWithError are listed as skipped with their message. A file cut short (a benchmark killed
by a timeout) is read up to its last complete entry. --combine writes {executable: json} to one file.
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


def main(argv):
    combine = None
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
            others = ["%s=%s" % (k, fmt_num(v)) for k, v in b.items()
                      if k not in STANDARD and k != "GB/s" and isinstance(v, (int, float))]
            rows.append((name, fmt_time(b), fmt_num(gbps) if gbps is not None else "-",
                         " ".join(others)))
    if combine:
        with open(combine, "w", encoding="utf-8") as f:
            json.dump(combined, f, indent=1)
    if rows:
        widths = [max(len(r[i]) for r in rows + [("benchmark", "time", "GB/s", "")])
                  for i in range(3)]
        header = ("benchmark", "time", "GB/s", "counters")
        print("  ".join(h.ljust(w) for h, w in zip(header[:3], widths)) + "  " + header[3])
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
        skipped = sum(1 for r in rows if r[3].startswith("skipped"))
        print("%d runs, %d skipped, from %d file(s)" % (len(rows), skipped, len(argv)))
    else:
        print("bench_summary: no benchmark runs in %d file(s)" % len(argv))
    for n in notes:
        print("note: " + n)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
