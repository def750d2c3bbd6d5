#!/usr/bin/env python3
"""TTFT (p50, p99) and requests/s against concurrent users, injected against the facts as text,
from bench_serve.py's JSON:
  python3 bench/serve/plot_serve.py SERVE_JSON OUT_PNG   (needs matplotlib)"""

import json
import sys


def plot(rows, path, cpu):
    """The two panels, titled with the CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("injected", "o-"), ("text", "s--")):
        r = [x for x in rows if x["mode"] == mode]
        a.plot([x["users"] for x in r], [x["ttft_p50_ms"] for x in r], style, label=f"{mode} p50")
        a.plot([x["users"] for x in r], [x["ttft_p99_ms"] for x in r], style, alpha=0.4,
               label=f"{mode} p99")
        b.plot([x["users"] for x in r], [x["rps"] for x in r], style, label=mode)
    a.set(xscale="log", yscale="log", xlabel="concurrent users", ylabel="TTFT (ms)")
    b.set(xscale="log", xlabel="concurrent users", ylabel="requests/s")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.suptitle(f"memory server over HTTP, SmolLM2-135M, {cpu}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    plot(doc["rows"], sys.argv[2], doc["cpu"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
