#!/usr/bin/env python3
"""Draws the recompute quality/cost curve (issue 30) from recorded results.

  python3 bench/engine/plot_recompute.py ENGINE_JSON LOCOMO_MD OUT_PNG

ENGINE_JSON: `bench_engine --benchmark_filter=engine/recompute --benchmark_out=F
--benchmark_out_format=json` (the demo memory, k = 5 and 20). LOCOMO_MD: a file holding the
"Recompute curve" tables printed by `locomo_eval --recompute ...` (every row of every such table is
read). Left panel: KL to the re-prefilled text against the share of memory tokens recomputed;
right panel: the time to first token against the same share, as a multiple of plain injection's
(the share-0 row of the same series; for the demo, the lower share-0 row of the same k). Needs matplotlib (`pip install matplotlib`)."""

import json
import re
import sys
from collections import defaultdict


def engine_series(path):
    """{label: [(recomputed, kl, ttft_ms)]} from bench_engine's JSON (selective rows, one batch),
    and {label: plain TTFT}: the lowest share-0 TTFT of the same k over both encodings (they do the
    same work per request; one of them alone can be a neighbour's noise)."""
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    series, plain = defaultdict(list), {}
    rows = [b for b in runs if b["name"].startswith("engine/recompute/")
            and not b.get("error_occurred") and b["r"] == 0 and b["one_batch"] == 1]
    for b in rows:  # the boundary and sequential rows are in the table, not on the curve
        label = "demo k=%d, %s" % (b["k"], "behind prefix" if b["prefixed"] else "alone")
        series[label].append((b["recomputed"], b["kl_mean"], b["ttft_ms"]))
        plain[label] = min(c["ttft_ms"] for c in rows if c["k"] == b["k"] and c["rho"] == 0)
    return series, plain


def locomo_series(path):
    """{label: [(recomputed, kl, ttft_ms)]} from the markdown rows of locomo_eval's curve table."""
    series = defaultdict(list)
    row = re.compile(r"^\| (?P<enc>[^|]+) \| (?P<pct>\d+) \| (?P<rec>[0-9.]+) \| (?P<kl>[0-9.]+) \|"
                     r" [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| (?P<ttft>[0-9.]+) \|$")
    with open(path) as f:
        for line in f:
            m = row.match(line.strip())
            if m:
                series["LoCoMo, " + m["enc"].strip()].append(
                    (float(m["rec"]), float(m["kl"]), float(m["ttft"])))
    return series


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series, plain = engine_series(sys.argv[1])
    series.update(locomo_series(sys.argv[2]))
    if not series:
        sys.exit("plot_recompute: no curve rows in the inputs")
    fig, (kl_ax, t_ax) = plt.subplots(1, 2, figsize=(11, 5))
    for label, points in sorted(series.items()):
        points.sort()
        x = [100 * p[0] for p in points]
        base = plain.get(label, next((p[2] for p in points if p[0] == 0), None))
        kl_ax.plot(x, [p[1] for p in points], marker="o", label=label)
        if base:
            t_ax.plot(x, [p[2] / base for p in points], marker="o", label=label)
    kl_ax.axhline(0.08, color="grey", linestyle="--", linewidth=0.8)
    kl_ax.text(0.5, 0.085, "target KL 0.08 (w = 0)", color="grey", fontsize=8)
    kl_ax.set_xlabel("memory fact tokens recomputed (%)")
    kl_ax.set_ylabel("KL(re-prefilled text || injected), nats/token")
    kl_ax.set_title("Answer fidelity")
    t_ax.axhline(1.5, color="grey", linestyle="--", linewidth=0.8)
    t_ax.text(0.5, 1.53, "target 1.5x plain injection", color="grey", fontsize=8)
    t_ax.set_xlabel("memory fact tokens recomputed (%)")
    t_ax.set_ylabel("TTFT / TTFT of plain injection")
    t_ax.set_title("Cost (llama.cpp, SmolLM2-135M, CPU, 1 thread)")
    handles, labels = kl_ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(sys.argv[3], dpi=110)
    print("plot_recompute: wrote", sys.argv[3])


if __name__ == "__main__":
    main()
