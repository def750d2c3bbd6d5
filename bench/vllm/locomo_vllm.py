#!/usr/bin/env python3
"""LoCoMo through the vLLM connector: answers with memory injected (each conversation turn a fact,
encoded apart behind the system prefix), with and without suffix recompute, against vLLM's own
prefill of the same prompt and against the gold answers.

One engine (SmolLM2-135M-Instruct, bf16); one LoCoMo conversation. Every turn is one fact
("[session date] speaker: text"), encoded once through vLLM behind the shared system prefix and
embedded with MiniLM (the package's retrieval). Per question (categories 1-4, the first N in the
file's order): the k facts retrieved for the question, most relevant last ("best_last"), then
greedy answers of GEN tokens:

  prefill    vLLM prefills the whole prompt (prefix + facts + question) as text;
  R%         the connector injects the memory, vLLM prefilling the segment's last R% of tokens in
             context (recompute_tokens; R = 0 is plain injection).

Reported per setting: LoCoMo's token F1 against the gold answer (lower case, punctuation and
a/an/the/and removed, as bench/locomo), the share of answers identical to the prefill's, the token
F1 between the injected and the prefilled answer, and the memory tokens vLLM loaded.

Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=build/ci/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/locomo_vllm.py \
      --model "$INFERSCALE_SMOLLM2_HF" [--questions 60] [--k 10] [--recompute 0,10,25] [--json out.json]
"""

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter

from bench_args import add_model_and_locomo, check_model_and_locomo

SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer the user's question in a few "
          "words from these conversation turns:\n")
GEN = 24


def normalized_words(s):
    s = re.sub(r"[^\w\s]|_", "", s.lower())
    return [w for w in s.split() if w not in ("a", "an", "the", "and")]


def token_f1(prediction, gold):
    p, g = normalized_words(prediction), normalized_words(str(gold))
    if not p or not g:
        return 1.0 if not p and not g else 0.0
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def turns_and_questions(path, conversation, count):
    with open(path) as f:
        sample = json.load(f)[conversation]
    conv = sample["conversation"]
    turns, s = [], 1
    while f"session_{s}" in conv:
        date = conv.get(f"session_{s}_date_time", "")
        for t in conv[f"session_{s}"]:
            turns.append(f"[{date}] {t['speaker']}: {t['text']}\n")
        s += 1
    qa = [q for q in sample["qa"] if q.get("category") in (1, 2, 3, 4) and "answer" in q]
    return sample["sample_id"], turns, qa[:count]


def main():
    ap = argparse.ArgumentParser()
    add_model_and_locomo(ap)
    ap.add_argument("--conversation", type=int, default=0, help="index in locomo10.json")
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--k", type=int, default=10, help="facts retrieved per question")
    ap.add_argument("--recompute", default="0,10,25", help="suffix recompute, percent of the segment")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--json")
    a = ap.parse_args()
    check_model_and_locomo(a, "locomo_vllm")
    percents = [float(x) for x in a.recompute.split(",")]

    from vllm import SamplingParams

    from inferscale_vllm.embed import MiniLMEmbedder
    from inferscale_vllm.encode import add_fact, model_description, set_prefix
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.memory import Memory

    sample_id, turns, qa = turns_and_questions(a.locomo, a.conversation, a.questions)
    directory = tempfile.mkdtemp(prefix="inferscale-locomo-vllm-")
    llm = make_llm(a.model, directory, block_size=a.block_size)
    tok = llm.get_tokenizer()
    prefix = tok.encode(SYSTEM, add_special_tokens=False)
    # as many pages as the facts fill (every reader of the memory loads the whole pool)
    pages = -(-len(prefix) // 16) + sum(-(-len(tok.encode(t, add_special_tokens=False)) // 16)
                                        for t in turns)
    mem = Memory.create(directory, model=model_description(llm), num_pages=pages + 8,
                             embedder=MiniLMEmbedder())
    set_prefix(mem, llm, SYSTEM, prefix)
    t0 = time.perf_counter()
    for t in turns:
        add_fact(mem, llm, "user", t, tok.encode(t, add_special_tokens=False), context=prefix)
    mem.commit()
    encode_s = time.perf_counter() - t0
    print(f"{sample_id}: {len(turns)} turns encoded through vLLM in {encode_s:.1f} s; "
          f"{len(qa)} questions, k = {a.k}, block size {a.block_size}", flush=True)

    def answer(prompt, extra=None):
        llm.reset_prefix_cache()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=GEN,
                                                    extra_args=extra), use_tqdm=False)[0]
        return tok.decode(out.outputs[0].token_ids, skip_special_tokens=True).strip(), \
            out.num_cached_tokens or 0

    rows = []
    for i, q in enumerate(qa):
        qtok = tok.encode(f"<|im_end|>\n<|im_start|>user\n{q['question']}<|im_end|>\n"
                          f"<|im_start|>assistant\n", add_special_tokens=False)
        retrieved = mem.retrieve("user", q["question"], a.k)
        facts = retrieved[::-1]  # best last
        base = mem.request("user", facts, qtok)
        plain, _ = answer({"prompt_token_ids": base["prompt"]["prompt_token_ids"],
                           "cache_salt": f"plain-{i}"})
        row = {"question": q["question"], "gold": str(q["answer"]), "category": q["category"],
               "memory_tokens": base["memory_tokens"], "prefill": plain,
               "f1_prefill": token_f1(plain, q["answer"]), "injected": {}}
        for p in percents:
            r = mem.request("user", facts, qtok,
                            recompute_tokens=round(base["memory_tokens"] * p / 100))
            text, loaded = answer(r["prompt"], r["extra_args"])
            row["injected"][str(p)] = {"answer": text, "loaded": loaded,
                                       "f1": token_f1(text, q["answer"]),
                                       "identical": text == plain,
                                       "f1_to_prefill": token_f1(text, plain)}
        rows.append(row)
        if (i + 1) % 10 == 0:
            print(f"  {i + 1} questions", flush=True)

    n = len(rows)
    print(f"\n{sample_id}, {n} questions (categories 1-4), k = {a.k}, memory "
          f"{min(r['memory_tokens'] for r in rows)}-{max(r['memory_tokens'] for r in rows)} tokens")
    print("| setting | F1 vs gold | identical to prefill | F1 vs prefill's answer | loaded tokens "
          "(median) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| prefill | {statistics.mean(r['f1_prefill'] for r in rows):.3f} | - | - | 0 |")
    summary = {"prefill": {"f1": statistics.mean(r["f1_prefill"] for r in rows)}}
    for p in percents:
        cells = [r["injected"][str(p)] for r in rows]
        s = {"f1": statistics.mean(c["f1"] for c in cells),
             "identical": sum(c["identical"] for c in cells) / n,
             "f1_to_prefill": statistics.mean(c["f1_to_prefill"] for c in cells),
             "loaded_median": statistics.median(c["loaded"] for c in cells)}
        summary[str(p)] = s
        print(f"| inject, recompute {p:g}% | {s['f1']:.3f} | {s['identical']:.2f} | "
              f"{s['f1_to_prefill']:.3f} | {s['loaded_median']:.0f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sample": sample_id, "k": a.k, "block_size": a.block_size,
                       "encode_seconds": encode_s, "summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
