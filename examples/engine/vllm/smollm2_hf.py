#!/usr/bin/env python3
"""Converts the SmolLM2-135M-Instruct GGUF (the one the llama.cpp adapter uses) to a Hugging Face folder.

vLLM 0.32 has no GGUF loader of its own (vllm-gguf-plugin's dequantize kernels are CUDA-only), so
vLLM on CPU serves the same model from a plain folder: ``config.json``, ``generation_config.json``,
``model.safetensors`` (bfloat16) and the tokenizer files (with the chat template).

How (transformers 5.19 with ``gguf`` and ``accelerate``, run from .ci/vllm's venv):

1. ``from_pretrained(folder, gguf_file=name)`` reads the GGUF for both the tokenizer and the model
   and dequantizes the weights (Q4_1 -> float32).
2. ``save_pretrained`` refuses that model ("quantized with GGUF, not serializable"): the config
   carries a ``quantization_config``. So a plain ``LlamaForCausalLM`` is built from the same config
   without it, the state dict copied in (strict: every tensor must match by name and shape), cast to
   bfloat16 and saved. The embeddings are tied (``lm_head`` shares ``embed_tokens``).

Usage: python smollm2_hf.py <model.gguf> <output folder>
Deterministic for a given GGUF and transformers version; .ci/vllm stamps this file's sha256 beside
the output so a changed converter redoes it.
"""
import os
import sys
import time


def convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(os.path.abspath(gguf_path))
    t = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    print(f"smollm2_hf: read {name} in {time.time() - t:.1f} s ({type(loaded).__name__})",
          file=sys.stderr)

    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "bfloat16"
    cfg.pop("torch_dtype", None)
    config = AutoConfig.for_model(**cfg)
    if config.model_type != "llama":
        raise SystemExit(f"expected a llama model, the GGUF holds {config.model_type!r}")
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied lm_head may be absent from the source dict; anything else missing or extra is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(torch.bfloat16).eval()
    if loaded.generation_config is not None:
        model.generation_config = loaded.generation_config

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit("the tokenizer has no chat template")
    n = sum(p.numel() for p in model.parameters())
    print(f"smollm2_hf: wrote {out_dir} ({n / 1e6:.1f} M parameters, {config.num_hidden_layers} layers, "
          f"{config.num_attention_heads} heads, {config.num_key_value_heads} KV heads, "
          f"tied={config.tie_word_embeddings}) in {time.time() - t:.1f} s", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        print("usage: smollm2_hf.py <model.gguf> <output folder>", file=sys.stderr)
        return 2
    convert(argv[1], argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
