#!/usr/bin/env python3
"""Fidelity of InferScale's connector on a real vLLM (CPU build), against vLLM's own prefill.

One engine (SmolLM2-135M-Instruct, bf16, block size 128); the memory of the connector's tests
(examples/engine/vllm/tests/caroline.py: a system prefix and 12 facts about one user, encoded
jointly in one forward through vLLM and stored as one fact). Each question is answered twice,
greedy, 32 tokens: with the memory injected by the connector, and with the same prompt prefilled
as text by vLLM (a distinct cache salt: nothing is shared). Reported per question: identical or
not, and how many leading tokens agree.

  theorem3   the joint memory at its encoding positions, bf16 store and float32 store
  relocate   the same joint memory behind a filler fact (encoded on its own behind the prefix)
             of D tokens, so it is injected D positions later than it was encoded; the baseline
             is vLLM's prefill of the same text. In vLLM a shift needs preceding tokens, so this
             mixes relocation (exact in real arithmetic) with the filler the memory never saw
             (the cross-fact attention independent encoding lacks, issue 30).
  recompute  the 12 facts encoded apart, each behind the prefix (shared-prefix encoding, issue
             30), injected with the segment's last R% of tokens left to vLLM's prefill (suffix
             recompute, recompute_tokens: what a connector allows); in the facts' own order and
             with the fact that answers the question last (where retrieval's "best_last" puts
             it); per R the answers identical to vLLM's prefill, the tokens loaded and the TTFT
             (median of 3 single-token generations)
Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=build/ci/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/fidelity_vllm.py \
      --model "$INFERSCALE_SMOLLM2_HF" [--locomo ../shared/data/locomo/locomo10.json] [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "engine", "vllm", "tests"))

from bench_args import (add_model_and_locomo, agreement,  # noqa: E402
                        check_model_and_locomo)
from caroline import FACTS, GEN, QUESTIONS, SYSTEM, query_tokens  # noqa: E402


def locomo_text(path, tokens, tok):
    """LoCoMo turns (conversation 2), whole turns until at least `tokens` tokens: a filler
    unrelated to the memory (its exact length is what the shift is)."""
    with open(path) as f:
        conv = json.load(f)[1]["conversation"]
    text, s = "", 1
    while f"session_{s}" in conv:
        for t in conv[f"session_{s}"]:
            text += f"{t['speaker']}: {t['text']}\n"
            if len(tok.encode(text, add_special_tokens=False)) >= tokens:
                return text
        s += 1
    raise SystemExit(f"fidelity_vllm: {path} holds fewer than {tokens} tokens of turns")


# the fact (index into FACTS) that answers each of QUESTIONS, and the words one of which a right
# answer names (lower case)
ANSWERED_BY = [0, 2, 3, 5, 6, 7, 8, 11]
KEYWORDS = [("lisbon",), ("pixel",), ("marathon",), ("cello",), ("peanut",), ("friend", "paint"),
            ("southampton",), ("bakery", "baker")]


def right(i, text):
    return any(w in text.lower() for w in KEYWORDS[i])


def recompute_curve(llm, mem, tok, apart, percents, answer):
    import statistics
    import time

    from vllm import SamplingParams

    def ttft(prompt, extra):
        times = []
        for _ in range(3):
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1,
                                                  extra_args=extra), use_tqdm=False)
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    assert len(ANSWERED_BY) == len(QUESTIONS)
    out = {}
    for order in ("facts' order", "answer last"):
        rows = {p: [] for p in percents}
        for i, q in enumerate(QUESTIONS):
            facts = list(apart)
            if order == "answer last":
                facts.append(facts.pop(ANSWERED_BY[i]))
            base = mem.request("caroline", facts, query_tokens(tok, q))
            ids = base["prompt"]["prompt_token_ids"]
            llm.reset_prefix_cache()
            plain, _ = answer({"prompt_token_ids": ids, "cache_salt": f"plain-rc-{i}"})
            plain_right = right(i, tok.decode(plain))
            for p in percents:
                r = mem.request("caroline", facts, query_tokens(tok, q),
                                recompute_tokens=round(base["memory_tokens"] * p / 100))
                llm.reset_prefix_cache()
                injected, cached = answer(r["prompt"], r["extra_args"])
                rows[p].append({"identical": injected == plain,
                                "agree": agreement(injected, plain), "loaded": cached,
                                "answer": tok.decode(injected),
                                "right": right(i, tok.decode(injected)),
                                "prefill_right": plain_right,
                                "memory_tokens": r["memory_tokens"],
                                "ttft_ms": ttft(r["prompt"], r["extra_args"]) if i < 2 else None})
        for p in percents:
            rr = rows[p]
            t = [x["ttft_ms"] for x in rr if x["ttft_ms"] is not None]
            print(f"recompute {p:5.1f}% ({order}): identical on "
                  f"{sum(x['identical'] for x in rr)} of {len(rr)}; leading tokens agreeing "
                  f"{[x['agree'] for x in rr]}; right answers {sum(x['right'] for x in rr)} "
                  f"(prefill {sum(x['prefill_right'] for x in rr)}) of {len(rr)}; loaded {min(x['loaded'] for x in rr)}-"
                  f"{max(x['loaded'] for x in rr)} of {rr[0]['memory_tokens']} memory tokens; "
                  f"TTFT {statistics.median(t):.0f} ms (median, 2 questions x 3)", flush=True)
        out[order] = {str(p): rows[p] for p in percents}
    return out


def main():
    ap = argparse.ArgumentParser()
    add_model_and_locomo(ap)
    ap.add_argument("--shifts", default="16,200", help="filler lengths in tokens (at least: whole turns)")
    ap.add_argument("--recompute", default="0,10,25,50,100",
                    help="suffix recompute points, percent of the memory segment")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's KV block size")
    ap.add_argument("--json")
    a = ap.parse_args()
    check_model_and_locomo(a, "fidelity_vllm")

    from vllm import SamplingParams

    from inferscale_vllm.encode import add_fact, capture, model_description
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.memory import Memory

    directory = tempfile.mkdtemp(prefix="inferscale-fidelity-")
    llm = make_llm(a.model, directory, block_size=a.block_size)
    tok = llm.get_tokenizer()
    mem = Memory.create(directory, model=model_description(llm), num_pages=2048)
    prefix = tok.encode(SYSTEM, add_special_tokens=False)
    joint_text = "".join(f"- {f}\n" for f in FACTS)
    joint_ids = tok.encode(joint_text, add_special_tokens=False)
    kv = capture(llm, prefix + joint_ids)
    # Theorem 3's case is one forward of prefix + facts, so the prefix's K/V come from it too (a
    # forward of the prefix alone differs in the last bits on some CPUs: caroline.joint_memory).
    mem.set_prefix(SYSTEM, prefix, kv["k"][:, :len(prefix)], kv["v"][:, :len(prefix)])
    joint = mem.add_fact("caroline", joint_text, joint_ids, kv["k"], kv["v"], context=prefix)
    fillers = {}
    for d in (int(x) for x in a.shifts.split(",")):
        text = locomo_text(a.locomo, d, tok)
        ids = tok.encode(text, add_special_tokens=False)
        fillers[len(ids)] = add_fact(mem, llm, "caroline", text, ids, context=prefix)
    apart = [add_fact(mem, llm, "caroline", f"- {f}\n",
                      tok.encode(f"- {f}\n", add_special_tokens=False), context=prefix)
             for f in FACTS]
    mem.commit()

    def answer(prompt, extra=None):
        sp = SamplingParams(temperature=0.0, max_tokens=GEN, extra_args=extra)
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens or 0

    def compare(memory, facts, label):
        rows = []
        for i, q in enumerate(QUESTIONS):
            r = memory.request("caroline", facts, query_tokens(tok, q))
            plain, _ = answer({"prompt_token_ids": r["prompt"]["prompt_token_ids"],
                               "cache_salt": f"plain-{label}-{i}"})
            injected, cached = answer(r["prompt"], r["extra_args"])
            rows.append({"question": q, "identical": injected == plain,
                         "agree": agreement(injected, plain), "tokens": len(plain),
                         "loaded": cached,
                         "memory_tokens": r["memory_tokens"]})
        same = sum(r["identical"] for r in rows)
        print(f"{label}: identical on {same} of {len(rows)} questions; leading tokens agreeing / "
              f"prefill's answer length (at most {GEN}, shorter where it ended) per question "
              f"{[(r['agree'], r['tokens']) for r in rows]}; loaded "
              f"{min(r['loaded'] for r in rows)} of {rows[0]['memory_tokens']} memory tokens",
              flush=True)
        return rows

    results = {"theorem3": {}, "relocate": {}}
    results["theorem3"]["bfloat16"] = compare(mem, [joint], "theorem3 bf16 store")
    mem.close()  # one writer: the float32 copy takes over, then the bf16 one again
    wide = Memory.open(directory, writer=True, dtype="float32")
    wide.commit()
    results["theorem3"]["float32"] = compare(wide, [joint], "theorem3 fp32 store")
    wide.close()
    mem = Memory.open(directory, writer=True, dtype="bfloat16")
    mem.commit()
    for d, fid in fillers.items():
        results["relocate"][d] = compare(mem, [fid, joint],
                                         f"relocated by {d} tokens (behind a filler)")
    results["recompute"] = recompute_curve(
        llm, mem, tok, apart, [float(x) for x in a.recompute.split(",")], answer)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
