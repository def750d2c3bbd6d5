"""Tensor parallelism: SmolLM2's 3 KV heads over TP = 3 ranks, each rank's connector injecting only
its head (its shard of the store), in the arrangement vLLM serves in: front end, engine core and
the 3 workers in processes of their own (the connector's metadata and the requests'
kv_transfer_params cross processes). The TP = 3 engine encodes its own memory (capture on every
rank, each rank's head put side by side: one forward of prefix + facts, Theorem 3's case for that
engine), and its injected answers equal its own prefill of the same prompts (tokens and top
logprobs), with as many memory tokens loaded as the ranks' token classes allow (every one where
the query's and the prompt's token counts share a class; conftest.expected_loaded). Reported, not
asserted: how the TP = 3 capture's bits compare with the TP = 1 engine's (conftest's shared one; TP
changes the reduction order, so the two engines' forwards, and hence a memory encoded by one and
served by the other, may differ in the last bits; on an Intel Xeon with AMX a TP = 1 memory served
at TP = 3 changed one of 3 answers). Two questions: each is an injected answer against the same
engine's prefill (a rank injecting another rank's head, or none, changes the answer's tokens).
Correctness only: nothing is timed (3 ranks on 2 cores)."""

import gc
import os

from capture_check import check_served_against_hook, hook_and_served, vllm_rotation
from caroline import query_tokens

from inferscale_vllm.engine import make_llm

QUESTIONS = ["What is the name of Caroline's cat?", "What instrument does Caroline play?"]


def answers(llm, mem, joint, tok, gen=16):
    """Per question: (injected tokens and top logprobs, tokens cached, prefill's tokens and top
    logprobs, memory tokens, prompt tokens)."""
    from vllm import SamplingParams

    def lps(o):
        return [sorted((k, v.logprob) for k, v in step.items()) for step in o.outputs[0].logprobs]

    out = []
    for q in QUESTIONS:
        r = mem.request("caroline", [joint], query_tokens(tok, q))
        llm.reset_prefix_cache()
        inj = llm.generate([r["prompt"]], SamplingParams(temperature=0, max_tokens=gen, logprobs=3,
                                                         extra_args=r["extra_args"]),
                           use_tqdm=False)[0]
        llm.reset_prefix_cache()
        pre = llm.generate([{"prompt_token_ids": r["prompt"]["prompt_token_ids"],
                             "cache_salt": "plain"}],
                           SamplingParams(temperature=0, max_tokens=gen, logprobs=3),
                           use_tqdm=False)[0]
        out.append(((list(inj.outputs[0].token_ids), lps(inj)), inj.num_cached_tokens or 0,
                    (list(pre.outputs[0].token_ids), lps(pre)), r["memory_tokens"],
                    len(r["prompt"]["prompt_token_ids"])))
    return out


def test_tp3_each_rank_injects_its_heads(model_dir, shared_engine, tmp_path):
    import numpy as np
    from caroline import joint_memory

    shared = shared_engine.get()
    tok = shared["tok"]
    kv1 = shared["kv"]
    shared_engine.close()  # one engine at a time

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")  # make_llm sets one group per rank
    directory = str(tmp_path / "memory-tp3")
    llm3 = make_llm(model_dir, directory, capture=True, tensor_parallel=3)
    try:
        mem3, _, facts3, kv3 = joint_memory(llm3, directory, ["caroline"], dtype="bfloat16")
        tp3 = answers(llm3, mem3, facts3["caroline"], tok)
        # what the scheduler side decides from: every rank's token classes (measured by each
        # worker at start-up), joined; the mode and step as the connector reads them
        from conftest import expected_loaded
        from inferscale_vllm.connector import partial_last_block, prefill_step_tokens
        from inferscale_vllm.token_classes import TokenClasses, join

        config = llm3.llm_engine.vllm_config
        ranks = llm3.collective_rpc("inferscale_token_classes")
        assert len(ranks) == 3 and all(ranks), f"token classes of the 3 ranks: {ranks}"
        loading = {"mode": partial_last_block(config), "step_tokens": prefill_step_tokens(config),
                   "block_size": config.cache_config.block_size,
                   "classes": join(TokenClasses(c) for c in ranks)}
        print(f"TP = 3 token classes (joined): {loading['classes']}")
        # Capture while serving at TP = 3: each rank writes its KV head, read_capture joins them;
        # the hook capture of the same forward, read back (capture_check.py).
        ids = mem3.store.token_ids(mem3.manifest["prefix"]) + mem3.store.token_ids(
            facts3["caroline"])
        hook, served, _ = hook_and_served(llm3, ids, directory, "tp3", tp=3)
        print(check_served_against_hook(hook, served, ids, vllm_rotation(llm3), "TP = 3"))
    finally:
        llm3.llm_engine.engine_core.shutdown()
        del llm3
        gc.collect()
        if bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    # The capture joined the 3 ranks' heads: the whole model's shape, and the same model (a
    # relative difference from TP = 1's capture at bf16 rounding level, not another head order).
    assert kv3["k"].shape == kv1["k"].shape, (kv3["k"].shape, kv1["k"].shape)
    for name in ("k", "v"):
        rel = np.linalg.norm(kv3[name] - kv1[name]) / np.linalg.norm(kv1[name])
        assert rel < 0.05, f"TP = 3 capture's {name} differ from TP = 1's by {rel:.3f} (relative)"
    equal_layers = sum(np.array_equal(kv3["k"][l], kv1["k"][l]) and
                       np.array_equal(kv3["v"][l], kv1["v"][l]) for l in range(kv1["k"].shape[0]))
    for q, (a3, cached, p3, m, n) in zip(QUESTIONS, tp3):
        want = expected_loaded(loading, n, m)
        print(f"TP = 3 {q!r}: {cached} of {m} memory tokens loaded (prompt {n})")
        assert cached == want and cached >= m // 128 * 128 > 0, (
            f"{q!r}: {cached} tokens loaded under TP = 3 (m = {m}, expected {want})")
        assert a3[0] == p3[0], (f"{q!r}: TP = 3 injected {tok.decode(a3[0])!r} vs prefill "
                                f"{tok.decode(p3[0])!r}")
        assert a3[1] == p3[1], f"{q!r}: TP = 3 top logprobs differ from the prefill's"
    print(f"TP = 3 capture equals TP = 1's bit for bit in {equal_layers} of {kv1['k'].shape[0]} "
          f"layers")
