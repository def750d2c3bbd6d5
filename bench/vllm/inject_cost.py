#!/usr/bin/env python3
"""What the connector's load costs inside vLLM's step on the CPU: InferScale's host injection
(`_inferscale.inject`: compose, rotate with the fp32-and-truncate rounding vLLM's AVX2 kernel uses,
scatter into vLLM's CPU cache layout) of an m-token memory segment of SmolLM2-135M's geometry
(30 layers x 3 KV heads x 64, bf16), beside its ceiling measured in the same run: torch copying the
same bytes (keys and values of every layer) from one buffer to another.

The load runs synchronously in `start_load_kv`, before the forward. An asynchronous load
(`get_finished`) could only hide this time behind the forward, on the same cores; the figure says
how much there is to hide, against the TTFTs of bench_vllm.py.

Usage: PYTHONPATH=build/ci/examples/engine/vllm/python "$INFERSCALE_VLLM_PYTHON" bench/vllm/inject_cost.py
"""

import statistics
import sys
import time

LAYERS, HEADS, DIM, BLOCK = 30, 3, 64, 128


def main():
    import torch

    from inferscale_vllm import Rotation, Store, inject
    from inferscale_vllm.tensors import vllm_cpu_cache

    torch.manual_seed(0)
    positions = 4096
    inv = 1.0 / (100000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    table = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.bfloat16).contiguous()
    rotation = Rotation(table[:positions], DIM, True,
                        False, True)
    print(f"{'m tokens':>9} {'inject ms':>10} {'copy ms':>8} {'inject / copy time':>19} "
          f"{'MB moved':>9}")
    for m in (128, 512, 1920):
        k = torch.randn(LAYERS, m, HEADS, DIM).to(torch.bfloat16).contiguous()
        v = torch.randn(LAYERS, m, HEADS, DIM).to(torch.bfloat16).contiguous()
        store = Store(LAYERS, HEADS, DIM, "bfloat16", (m + 15) // 16 + 1)
        store.insert(1, 0, list(range(m)),
                     k,
                     v)
        blocks = (m + BLOCK - 1) // BLOCK + 1
        caches = {f"model.layers.{l}.self_attn.attn":
                  torch.zeros(blocks, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
                  for l in range(LAYERS)}
        names = list(caches)
        cache = vllm_cpu_cache(caches, names)
        slots = [BLOCK + t for t in range(m)]  # from block 1 on
        src = torch.empty(2 * LAYERS * m * HEADS * DIM, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        inj, cp = [], []
        for _ in range(20):
            t = time.perf_counter()
            written = inject(store, cache, rotation, [([1], 0, slots)])
            inj.append(time.perf_counter() - t)
            t = time.perf_counter()
            dst.copy_(src)
            cp.append(time.perf_counter() - t)
        if written != m:
            sys.exit(f"inject_cost: {written} tokens written, {m} expected")
        a, b = statistics.median(inj), statistics.median(cp)
        print(f"{m:9d} {1e3 * a:10.2f} {1e3 * b:8.2f} {a / b:19.2f} "
              f"{src.numel() * 2 / 1e6:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
