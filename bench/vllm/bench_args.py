"""The arguments every vLLM benchmark here shares: SmolLM2's HF folder (--model, default
$INFERSCALE_SMOLLM2_HF, which `bash .ci/vllm` prints) and LoCoMo (--locomo, default
$INFERSCALE_LOCOMO or ../shared/data/locomo/locomo10.json beside the project), checked alike."""

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
