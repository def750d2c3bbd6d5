#!/usr/bin/env python3
"""What compressed fact KV (issue 52, item 1) costs in answers through the vLLM connector: greedy
agreement of the answers with fp8_e4m3 / int4 facts against the same facts in a bf16 store.

The memory of the connector's tests (examples/engine/vllm/tests/caroline.py: a system prefix and
12 facts about one user), in two layouts: "joint" (the 12 facts encoded in one forward behind the
prefix and stored as one fact, Theorem 3's case) and "apart" (each fact encoded alone behind the
prefix, 12 facts). The K/V are captured once through vLLM (the first run, bfloat16) and saved, so
every store holds the same captured values; each compression then runs in a process of its own
(one engine at a time: a fresh vLLM engine whose connector reads a fresh memory directory with
that store): Memory.create(..., dtype="bfloat16", compression=...) (float32: an uncompressed
float32 store, the bf16 rounding's own effect), the facts added, and every
question answered greedy (32 tokens) through the connector with the memory injected. Reported per
store and layout against the bfloat16 store: answers identical, leading tokens agreeing, and the
memory tokens the connector loaded (every answer must have loaded the memory, else the run fails).

Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=<build>/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/compression_vllm.py \
      --model "$INFERSCALE_SMOLLM2_HF" [--compression bfloat16,float32,fp8_e4m3,int4] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "engine", "vllm", "tests"))

from bench_args import agreement, cpu_description  # noqa: E402
from caroline import FACTS, GEN, QUESTIONS, SYSTEM, query_tokens  # noqa: E402

# store name -> (dtype, compression); float32: how far the bf16 rounding of the facts alone moves
# the answers (the scale against which fp8 / int4 are read)
STORES = {"bfloat16": ("bfloat16", "none"), "float32": ("float32", "none"),
          "fp8_e4m3": ("bfloat16", "fp8_e4m3"), "int4": ("bfloat16", "int4")}


def one(model, compression, kv_path, out_path):
    """One store: (capture the K/V into kv_path if absent), build the memory, answer."""
    import numpy as np
    from vllm import SamplingParams

    from inferscale_vllm.encode import capture, model_description
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.memory import Memory

    directory = tempfile.mkdtemp(prefix=f"inferscale-comp-{compression}-")
    llm = make_llm(model, directory)
    tok = llm.get_tokenizer()
    prefix = tok.encode(SYSTEM, add_special_tokens=False)
    joint_text = "".join(f"- {f}\n" for f in FACTS)
    joint_ids = tok.encode(joint_text, add_special_tokens=False)
    fact_texts = [f"- {f}\n" for f in FACTS]
    fact_ids = [tok.encode(t, add_special_tokens=False) for t in fact_texts]
    if not os.path.exists(kv_path):
        arrays = {}
        kv = capture(llm, prefix + joint_ids)
        arrays["joint_k"], arrays["joint_v"] = kv["k"], kv["v"]
        for i, ids in enumerate(fact_ids):
            kv = capture(llm, prefix + ids)
            arrays[f"fact{i}_k"], arrays[f"fact{i}_v"] = kv["k"], kv["v"]
        np.savez(kv_path, **arrays)
    kv = np.load(kv_path)
    dtype, comp = STORES[compression]
    mem = Memory.create(directory, model=model_description(llm), dtype=dtype, num_pages=256,
                        compression=comp)
    n = len(prefix)
    # the prefix's K/V from the joint forward (caroline.joint_memory: one forward of prefix + facts)
    mem.set_prefix(SYSTEM, prefix, kv["joint_k"][:, :n], kv["joint_v"][:, :n])
    joint = mem.add_fact("caroline", joint_text, joint_ids, kv["joint_k"], kv["joint_v"],
                         context=prefix)
    apart = [mem.add_fact("caroline", t, ids, kv[f"fact{i}_k"], kv[f"fact{i}_v"], context=prefix)
             for i, (t, ids) in enumerate(zip(fact_texts, fact_ids))]
    mem.commit()
    assert (mem.store.dtype, mem.store.compression) == (dtype, comp), mem.store.compression

    out = {"compression": compression, "answers": {}}
    for layout, facts in (("joint", [joint]), ("apart", apart)):
        rows = []
        for q in QUESTIONS:
            r = mem.request("caroline", facts, query_tokens(tok, q))
            llm.reset_prefix_cache()
            sp = SamplingParams(temperature=0.0, max_tokens=GEN, extra_args=r["extra_args"])
            o = llm.generate([r["prompt"]], sp, use_tqdm=False)[0]
            rows.append({"tokens": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                         "loaded": o.num_cached_tokens or 0, "memory_tokens": r["memory_tokens"]})
        out["answers"][layout] = rows
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("INFERSCALE_SMOLLM2_HF"))
    ap.add_argument("--compression", default="bfloat16,float32,fp8_e4m3,int4")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one store
    ap.add_argument("--kv", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.model or not os.path.isfile(os.path.join(a.model, "config.json")):
        sys.exit("compression_vllm: --model must be SmolLM2's HF folder (bash .ci/vllm prints it)")
    if a.one:
        return one(a.model, a.one, a.kv, a.out)

    names = [x for x in a.compression.split(",") if x]
    for x in names:
        if x not in STORES:
            sys.exit(f"compression_vllm: unknown store '{x}' ({', '.join(STORES)})")
    names = ["bfloat16"] + [x for x in names if x != "bfloat16"]  # the reference first
    work = tempfile.mkdtemp(prefix="inferscale-comp-vllm-")
    kv_path = os.path.join(work, "kv.npz")
    results = {}
    for x in names:
        out = os.path.join(work, f"{x}.json")
        rc = subprocess.call([sys.executable, os.path.abspath(__file__), "--model", a.model,
                              "--one", x, "--kv", kv_path, "--out", out],
                             stdout=sys.stderr)  # vLLM's logs apart from the table
        if rc != 0 or not os.path.exists(out):
            sys.exit(f"compression_vllm: the {x} run failed (exit {rc})")
        with open(out) as f:
            results[x] = json.load(f)

    ref = results["bfloat16"]["answers"]
    print(f"## Compressed facts through the vLLM connector: SmolLM2-135M-Instruct, "
          f"{cpu_description()}\n")
    print(f"{len(QUESTIONS)} questions per layout, greedy, {GEN} tokens; against the bfloat16 "
          f"store's answers.\n")
    print("| store | layout | identical answers | leading tokens agreeing (per question) | "
          "memory tokens loaded |")
    print("|---|---|---|---|---|")
    ok = True
    summary = {}
    for x in names:
        for layout in ("joint", "apart"):
            got = results[x]["answers"][layout]
            base = ref[layout]
            if len(got) != len(QUESTIONS) or any(r["loaded"] <= 0 for r in got):
                print(f"compression_vllm: {x} {layout}: an answer is missing or loaded no memory",
                      file=sys.stderr)
                ok = False
                continue
            same = sum(g["tokens"] == b["tokens"] for g, b in zip(got, base))
            agree = [agreement(g["tokens"], b["tokens"]) for g, b in zip(got, base)]
            lengths = [len(b["tokens"]) for b in base]
            loaded = sorted({r["loaded"] for r in got})
            summary[f"{x}/{layout}"] = {"identical": same, "agree": agree, "lengths": lengths,
                                        "loaded": loaded,
                                        "texts": [g["text"] for g in got]}
            print(f"| {x}{' (reference)' if x == 'bfloat16' else ''} | {layout} | {same} of "
                  f"{len(got)} | {' '.join(f'{g}/{n}' for g, n in zip(agree, lengths))} | "
                  f"{loaded[0]}-{loaded[-1]} of {got[0]['memory_tokens']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
