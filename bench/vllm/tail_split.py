#!/usr/bin/env python3
"""Where may the memory segment end? vLLM's answers with the connector's offer capped at L tokens,
against vLLM's cold prefill of the same prompt, bit for bit (greedy tokens and the top-3 logprobs
of each of 32 tokens), for several L per question (bench/results/2026-12-07-vllm-amx-tail.md).

One in-process engine (SmolLM2-135M-Instruct, bf16, block 128, the connector's tests' memory:
examples/engine/vllm/tests/caroline.py, 205 tokens), one core (INFERSCALE_TEST_CPUS=1 unless
set). Each offer is an absolute L or, when negative, N + offer (the prompt's length N minus that
many tokens: the count vLLM computes); "auto" is the connector's own choice (no cap). vLLM's
prefix cache is reset before every run.

Usage:
  eval "$(bash .ci/vllm --print)"
  PYTHONPATH=<build>/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/tail_split.py \\
      --offers 128,192,-40,-37,-33,0,auto [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "engine", "vllm", "tests"))
os.environ.setdefault("INFERSCALE_TEST_CPUS", "1")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--offers", default="128,192,-40,-37,-33,0,auto")
    ap.add_argument("--json")
    args = ap.parse_args()

    import conftest  # noqa: F401 - INFERSCALE_TEST_CPUS: this process's CPUs, before torch
    from caroline import GEN, QUESTIONS, joint_memory, query_tokens
    from conftest import InProcessEngine

    from inferscale_vllm import connector as C
    from inferscale_vllm.engine import make_llm

    cap = {"L": None}
    original = C.InferScaleConnector.get_num_new_matched_tokens

    def capped(self, request, num_computed_tokens):
        mode = self._partial_block
        if cap["L"] is not None:
            self._partial_block = True  # every usable token, then capped at L
        try:
            n, asynchronous = original(self, request, num_computed_tokens)
        finally:
            self._partial_block = mode
        if n and cap["L"] is not None:
            n = max(0, min(n + num_computed_tokens, cap["L"]) - num_computed_tokens)
        return n, asynchronous

    C.InferScaleConnector.get_num_new_matched_tokens = capped
    from vllm import SamplingParams

    directory = tempfile.mkdtemp(prefix="tail-split-")
    engine = InProcessEngine(lambda: make_llm(os.environ["INFERSCALE_SMOLLM2_HF"], directory))
    llm = engine.llm
    try:
        mem, tok, facts, _ = joint_memory(llm, directory, ["caroline"], dtype="bfloat16")

        def run(prompt, extra=None):
            sp = SamplingParams(temperature=0.0, max_tokens=GEN, logprobs=3, extra_args=extra)
            o = llm.generate([prompt], sp, use_tqdm=False)[0]
            lps = [sorted((k, v.logprob) for k, v in s.items()) for s in o.outputs[0].logprobs]
            return list(o.outputs[0].token_ids), lps, o.num_cached_tokens or 0

        rows = []
        for qi, q in enumerate(QUESTIONS):
            r = mem.request("caroline", [facts["caroline"]], query_tokens(tok, q))
            ids = r["prompt"]["prompt_token_ids"]
            n, m = len(ids), r["memory_tokens"]
            llm.reset_prefix_cache()
            cold_t, cold_lp, _ = run({"prompt_token_ids": ids, "cache_salt": f"plain-{qi}"})
            line = [f"q{qi} N={n} m={m} query={n - m}:"]
            for offer in args.offers.split(","):
                cap["L"] = None if offer == "auto" else min(m, n + int(offer) if int(offer) < 0
                                                           else int(offer))
                llm.reset_prefix_cache()
                t, lp, cached = run(r["prompt"], r["extra_args"])
                first = next((i for i, (a, b) in enumerate(zip(lp, cold_lp)) if a != b), None)
                line.append(f"{offer}: L={cached} computed {n - cached} tokens "
                            f"tok={'=' if t == cold_t else 'X'} "
                            f"lp={'=' if first is None else f'X@{first}'}")
                rows.append(dict(question=q, prompt=n, memory=m, offer=offer, loaded=cached,
                                 tokens_equal=t == cold_t, logprobs_equal=first is None,
                                 first_logprob_difference=first))
            print(" | ".join(line), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
