#!/usr/bin/env python3
"""Do vLLM's CPU GEMMs give a row the same bits whatever the number of rows (tokens) in the step?
(bench/results/2026-12-07-vllm-amx-tail.md). SmolLM2-135M's four projection shapes (qkv, o,
gate_up, down; random bf16 weights: the kernel is picked by shape, not values) through vLLM's own
dispatch (``dispatch_cpu_unquantized_gemm``: oneDNN ``onednn_mm`` or the SGL kernels), on this
process's threads. Prints, per shape: the kernel path, the token classes the connector measures
(token_classes.measure) and, for a few counts, which rows of x[:M] differ from the same rows
computed in one batch of --top rows, and how many elements differ between a 16-row and a
288-row batch of the same rows.

Usage: OMP_NUM_THREADS=1 taskset -c 1 PYTHONPATH=<build>/examples/engine/vllm/python \\
           "$INFERSCALE_VLLM_PYTHON" bench/vllm/gemm_token_classes.py [--top 2048]
"""

import argparse

import torch

SHAPES = [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576),
          ("down_proj", 576, 1536)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=2048)
    args = ap.parse_args()
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel, \
        dispatch_cpu_unquantized_gemm

    from inferscale_vllm.token_classes import measure

    print(f"torch threads {torch.get_num_threads()}, AMX tiles "
          f"{torch.cpu._is_amx_tile_supported()}")
    for name, n, k in SHAPES:
        layer = torch.nn.Module()
        g = torch.Generator().manual_seed(n + k)
        layer.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).bfloat16(),
                                          requires_grad=False)
        layer.bias = None
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        path = "SGL weight_packed_linear" if check_cpu_sgl_kernel(n, k, torch.bfloat16) \
            else "oneDNN onednn_mm"

        def apply(x):
            return layer.cpu_linear(x, layer.weight, None)

        classes = measure(apply, k, args.top, dtype=torch.bfloat16)
        x = torch.randn(args.top, k, generator=g).bfloat16()
        big = apply(x).view(torch.int16)
        diffs = []
        for m in (1, 16, 32, 33, 36, 37, 64, 300, 575, 576, 704, 705, 959, 960):
            if m > args.top:
                continue
            y = apply(x[:m].contiguous()).view(torch.int16)
            rows = int((y != big[:m]).any(1).sum())
            diffs.append(f"{m}:{rows}")
        small = torch.cat([apply(x[i:i + 16].contiguous()) for i in range(0, 288, 16)])
        one = apply(x[:288].contiguous())
        el = int((small.view(torch.int16) != one.view(torch.int16)).sum())
        print(f"{name} {n}x{k} ({path}): classes {classes}; rows of x[:M] differing from a "
              f"{args.top}-row batch, M:rows {' '.join(diffs)}; 16- vs 288-row batches: {el} of "
              f"{small.numel()} elements differ")


if __name__ == "__main__":
    main()
