#!/usr/bin/env python3
"""The vLLM demo of the main job: a user's facts stored once (K/V and a MiniLM embedding each), the
facts for a question picked by retrieval, the question answered by a real vLLM (CPU build) with
those facts injected through InferScaleConnector, and again with the same facts re-prefilled as
text. Prints the retrieved facts, both answers and both times to first token.

Usage: PYTHONPATH=<build>/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" demo.py [model]
(INFERSCALE_MINILM_HF: all-MiniLM-L6-v2's folder, from bash .ci/vllm --print)
"""

import os
import sys
import tempfile
import time

FACTS = [
    "Caroline moved to Lisbon in March 2021 to work as a marine biologist.",
    "Caroline adopted a grey cat named Pixel from a shelter last winter.",
    "Caroline is training for the Lisbon half marathon in October.",
    "Caroline plays the cello in a community orchestra on Thursdays.",
    "Caroline's best friend Melanie paints watercolour landscapes.",
    "Caroline bought a second-hand sailing boat called Maré in 2023.",
    "Caroline's sister Ana is a pediatric nurse who lives in Porto.",
    "Caroline's favourite book is 'The Sea Around Us' by Rachel Carson.",
    "Caroline is allergic to peanuts and avoids Thai restaurants.",
    "Caroline studied oceanography at the University of Southampton.",
    "Caroline volunteers at a beach clean-up every first Saturday of the month.",
    "Caroline's father Jorge runs a small bakery in Coimbra.",
    "Caroline keeps a logbook of every dolphin sighting from her boat.",
    "Caroline's neighbour lends her his van when she moves the cello.",
]
SYSTEM = "<|im_start|>system\nYou are a helpful assistant. You know these facts about the user:\n"
QUESTION = "What is the name of Caroline's boat, and what pet does she have?"
K = 8  # facts retrieved: with the prefix, more than one of vLLM's 128-token blocks


def main(argv):
    model = argv[1] if len(argv) > 1 else os.environ.get("INFERSCALE_SMOLLM2_HF", "")
    if not os.path.isfile(os.path.join(model, "config.json")):
        print("demo: no model folder; run bash .ci/vllm", file=sys.stderr)
        return 2
    from vllm import SamplingParams

    from inferscale_vllm.embed import MiniLMEmbedder
    from inferscale_vllm.encode import add_fact, model_description, set_prefix
    from inferscale_vllm.engine import make_llm
    from inferscale_vllm.memory import Memory

    embedder = MiniLMEmbedder()  # fails with a message without INFERSCALE_MINILM_HF
    directory = tempfile.mkdtemp(prefix="inferscale-demo-")
    llm = make_llm(model, directory)
    tok = llm.get_tokenizer()
    mem = Memory.create(directory, model=model_description(llm), embedder=embedder)
    prefix = tok.encode(SYSTEM, add_special_tokens=False)
    set_prefix(mem, llm, SYSTEM, prefix)
    for f in FACTS:  # the prompt's line is stored; the bare sentence is embedded
        add_fact(mem, llm, "caroline", f"- {f}\n", tok.encode(f"- {f}\n", add_special_tokens=False),
                 prefix, embed_text=f)
    mem.commit()
    q = tok.encode(f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)
    r = mem.request_for_query("caroline", QUESTION, q, K)  # the best fact last, next to the query
    ids = r["retrieved"]

    def ask(prompt, extra):
        llm.reset_prefix_cache()
        t = time.perf_counter()
        first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                      extra_args=extra), use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        llm.reset_prefix_cache()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48,
                                                    extra_args=extra), use_tqdm=False)[0]
        return ttft, first.num_cached_tokens or 0, out.outputs[0].text.strip()

    plain = {"prompt_token_ids": r["prompt"]["prompt_token_ids"], "cache_salt": "plain"}
    ask(r["prompt"], r["extra_args"])  # warm-up: the engine's first requests pay one-time costs
    ask(plain, None)
    t_inj, loaded, a_inj = ask(r["prompt"], r["extra_args"])
    t_pre, _, a_pre = ask(plain, None)
    print(f"question: {QUESTION}")
    print(f"retrieved (top {K} of {len(FACTS)}, best first):")
    for f in ids:
        print(f"  {mem.text(f).strip()}")
    print(f"prompt: {len(r['prompt']['prompt_token_ids'])} tokens, memory segment "
          f"{r['memory_tokens']} (prefix + {len(ids)} facts, each encoded alone behind the prefix)")
    print(f"injected  ({loaded} tokens from memory, TTFT {1e3 * t_inj:.0f} ms): {a_inj}")
    print(f"re-prefill (TTFT {1e3 * t_pre:.0f} ms): {a_pre}")
    print("vLLM loads the whole memory segment from the connector and prefills only the query. "
          "The facts were encoded apart, so the answers may differ (issue 30).")
    return 0 if loaded == r["memory_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
