"""Tensor parallelism: SmolLM2's 3 KV heads over TP = 3 ranks, each rank's connector injecting only
its head (its shard of the store). The memory is built with a TP = 1 engine (conftest's shared
one, which test_connector.py uses first: 'caroline' holds the facts encoded jointly), then served
by a TP = 3 engine from the same directory, in the arrangement vLLM serves in: front end, engine
core and the 3 workers in processes of their own (the connector's metadata and the requests'
kv_transfer_params cross processes): injected answers equal that engine's own prefill of the
same prompts (Theorem 3 per shard), with the memory's blocks really loaded; agreement with TP = 1
is reported (TP changes the reduction order, so TP = 1 and TP = 3 prefill may differ themselves).
Correctness only: nothing is timed (3 ranks on 2 cores)."""

import gc
import os

from caroline import query_tokens

from inferscale_vllm.engine import make_llm

QUESTIONS = ["What is the name of Caroline's cat?", "What instrument does Caroline play?",
             "Who is Melanie?"]


def answers(llm, mem, joint, tok, gen=16):
    from vllm import SamplingParams

    out = []
    for q in QUESTIONS:
        r = mem.request("caroline", [joint], query_tokens(tok, q))
        llm.reset_prefix_cache()
        inj = llm.generate([r["prompt"]], SamplingParams(temperature=0, max_tokens=gen,
                                                         extra_args=r["extra_args"]),
                           use_tqdm=False)[0]
        llm.reset_prefix_cache()
        pre = llm.generate([{"prompt_token_ids": r["prompt"]["prompt_token_ids"],
                             "cache_salt": "plain"}],
                           SamplingParams(temperature=0, max_tokens=gen), use_tqdm=False)[0]
        out.append((list(inj.outputs[0].token_ids), inj.num_cached_tokens or 0,
                    list(pre.outputs[0].token_ids), r["memory_tokens"]))
    return out


def test_tp3_each_rank_injects_its_heads(model_dir, shared_engine):
    shared = shared_engine.get()
    mem, tok, joint = shared["mem"], shared["tok"], shared["joint"]
    tp1 = answers(shared["llm"], mem, joint, tok)
    shared_engine.close()  # one engine at a time

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # make_llm sets one group per rank
    llm3 = make_llm(model_dir, shared["directory"], capture=False, tensor_parallel=3)
    try:
        tp3 = answers(llm3, mem, joint, tok)
    finally:
        llm3.llm_engine.engine_core.shutdown()
        del llm3
        gc.collect()
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    same_as_tp1 = 0
    for q, (a1, _, p1, _), (a3, cached, p3, m) in zip(QUESTIONS, tp1, tp3):
        assert cached >= m // 128 * 128 > 0, f"{q!r}: {cached} tokens loaded under TP = 3"
        assert a3 == p3, f"{q!r}: TP = 3 injected {tok.decode(a3)!r} vs prefill {tok.decode(p3)!r}"
        same_as_tp1 += a3 == a1
    print(f"TP = 3 injected answers equal TP = 1's on {same_as_tp1} of {len(QUESTIONS)} questions")
