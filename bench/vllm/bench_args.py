"""The arguments every vLLM benchmark here shares: SmolLM2's HF folder (--model, default
$INFERSCALE_SMOLLM2_HF, which `bash .ci/vllm` prints) and LoCoMo (--locomo, default
$INFERSCALE_LOCOMO or ../shared/data/locomo/locomo10.json beside the project), checked alike,
and the CPU every figure is named with (cpu_description)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def add_model_and_locomo(ap):
    ap.add_argument("--model", default=os.environ.get("INFERSCALE_SMOLLM2_HF"))
    ap.add_argument("--locomo", default=os.environ.get(
        "INFERSCALE_LOCOMO", os.path.join(HERE, "..", "..", "..", "shared", "data", "locomo",
                                          "locomo10.json")))


def check_model_and_locomo(a, name):
    if not a.model or not os.path.isfile(os.path.join(a.model, "config.json")):
        sys.exit(f"{name}: --model must be SmolLM2's HF folder (bash .ci/vllm prints it)")
    if not os.path.isfile(a.locomo):
        sys.exit(f"{name}: LoCoMo not found at {a.locomo} (INFERSCALE_LOCOMO)")


def cpu_description() -> str:
    """The CPU's model name and the vector / matrix ISA vLLM's kernels pick from."""
    model, flags = "unknown CPU", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    isa = [n for n, f in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512_BF16", "avx512_bf16"),
                          ("AMX-BF16", "amx_bf16")) if f in flags]
    return f"{model} ({len(os.sched_getaffinity(0))} CPUs; {', '.join(isa) or 'no AVX2'})"


def agreement(a, b):
    """How many leading tokens two generations share (the greedy agreement of the fidelity
    benchmarks)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
