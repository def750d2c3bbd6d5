#!/usr/bin/env python3
"""The injected time to first token broken down, as stacked bars per k, on both reference engines:
  - vLLM (CPU build), from bench_vllm.py's JSON (its "ttft" rows' breakdown_ms: vLLM's front end
    and queue, the connector's planning and load, the query's forward, the attention over the
    memory), with the re-prefilled TTFT written above each bar (off the scale);
  - llama.cpp, from bench_engine's Google Benchmark JSON (engine/ttft: InferScale's compose +
    injection + state write, the question's forward over the memory split into the question
    alone and the rest), the same way.
Usage (a Python with matplotlib):
  python3 bench/vllm/plot_breakdown.py VLLM_JSON ENGINE_JSON OUT_PNG
"""

import json
import sys

VLLM_PARTS = ("front end", "queue", "connector", "load", "query", "memory attention")
OURS = {"connector", "load", "inject (ours)"}
LABELS = {"query": "query (+ memory tokens not loaded), alone"}
COLORS = {"front end": "#1f77b4", "queue": "#ff7f0e", "connector": "#2ca02c", "load": "#d62728",
          "inject (ours)": "#d62728", "query": "#9467bd", "memory attention": "#8c564b"}


def llama_rows(doc):
    """[(k, {part: ms}, re-prefill ms)] of bench_engine's engine/ttft cases."""
    rows = []
    for b in doc["benchmarks"]:
        if not b["name"].startswith("engine/ttft/") or b.get("run_type") == "aggregate":
            continue
        parts = {"inject (ours)": b["inject_ms"], "query": b["query_ms"],
                 "memory attention": b["question_ms"] - b["query_ms"]}
        rows.append((int(b["k"]), parts, b["prefill_ms"]))
    return sorted(rows)


def panel(ax, rows, parts, title):
    import numpy as np

    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for p in parts:
        vals = np.array([max(r[1].get(p, 0.0), 0.0) for r in rows])
        ax.bar(x, vals, 0.6, bottom=bottom, label=LABELS.get(p, p), color=COLORS[p],
               hatch="//" if p in OURS else None)
        bottom += vals
    for i, r in enumerate(rows):  # linear bars: InferScale's own share written above each
        ours = sum(max(r[1].get(p, 0.0), 0.0) for p in parts if p in OURS)
        ax.annotate(f"ours {ours:.1f} ms\n({100 * ours / bottom[i]:.0f} %)\nre-prefill "
                    f"{r[2]:.0f} ms", (x[i], bottom[i]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [f"k = {r[0]}" for r in rows])
    ax.set(ylabel="ms", title=title)
    ax.set_ylim(0, 1.35 * bottom.max())
    ax.legend(fontsize=6)


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(argv[1]) as f:
        vdoc = json.load(f)
    with open(argv[2]) as f:
        edoc = json.load(f)
    vrows = [(r["k"], r["breakdown_ms"], r["prefill_ms"]) for r in vdoc["ttft"]
             if "breakdown_ms" in r]
    lrows = llama_rows(edoc)
    if not vrows or not lrows:
        sys.exit("plot_breakdown: no breakdown rows (bench_vllm.py's ttft, bench_engine's "
                 "engine/ttft)")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    panel(a, vrows, VLLM_PARTS, "vLLM CPU + connector, SmolLM2-135M bf16")
    panel(b, lrows, ("inject (ours)", "query", "memory attention"),
          "llama.cpp, SmolLM2-135M Q4_1, 1 thread")
    fig.suptitle(f"injected TTFT broken down (hatched: InferScale's own part), "
                 f"{vdoc.get('cpu', '?')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(argv[3], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
