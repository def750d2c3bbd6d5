#!/usr/bin/env python3
"""Checks how vLLM's CPU attention backend (CPU_ATTN) lays K and V out in its paged cache, on this machine.

No model, no engine: loads vLLM's CPU kernels, asks the backend which ISA it would pick for SmolLM2's
shape (bf16, block size 128 (the CPU default), head size 64), writes three tokens through vLLM's own
``cpu_attn_reshape_and_cache`` op into a zeroed cache of the shape a layer gets
(``[num_blocks, num_kv_heads, block_size, 2 * head_size]``), and checks where they landed:
per block and KV head, the first ``block_size * head_size`` elements hold K transposed
(``[head_size, block_size]``: token t of the block is column t), the rest hold V row-major
(``[block_size, head_size]``). Prints the ISA and OK, or fails. ~13 s (mostly ``import vllm``).

Usage: "$INFERSCALE_VLLM_PYTHON" examples/engine/vllm/cache_layout.py
"""
import sys

import torch


def main() -> int:
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    current_platform.import_kernels()
    num_blocks, heads, block, dim = 2, 3, 128, 64
    isa = _get_attn_isa(torch.bfloat16, block, dim, "auto")
    print(f"cache_layout: platform {type(current_platform).__name__}, "
          f"avx512={torch.cpu._is_avx512_supported()}, amx={torch.cpu._is_amx_tile_supported()}, "
          f"isa={isa!r}")

    kv = torch.zeros(num_blocks, heads, block, 2 * dim, dtype=torch.bfloat16)
    # The backend's own view (cpu_attn.py do_kv_cache_update): [B, H, 2 * N, D] split into K and V.
    key_cache, value_cache = kv.view(num_blocks, heads, 2 * block, dim).chunk(2, dim=2)
    slots = torch.tensor([5, block + 2, 7], dtype=torch.int64)
    key = (torch.arange(len(slots) * heads * dim, dtype=torch.float32) + 1).reshape(len(slots), heads, dim)
    key = key.to(torch.bfloat16)
    value = -key
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    bad = 0
    for t, slot in enumerate(slots.tolist()):
        b, offset = divmod(slot, block)
        for h in range(heads):
            flat = kv[b, h].reshape(-1)
            k_region = flat[: block * dim].view(dim, block)
            v_region = flat[block * dim:].view(block, dim)
            if not torch.equal(k_region[:, offset], key[t, h]):
                print(f"cache_layout: token {t} head {h}: K is not at column {offset} of [head, block]")
                bad += 1
            if not torch.equal(v_region[offset], value[t, h]):
                print(f"cache_layout: token {t} head {h}: V is not at row {offset} of [block, head]")
                bad += 1
    if bad:
        print(f"cache_layout: FAILED ({bad} mismatches) for isa {isa!r}")
        return 1
    print(f"cache_layout: OK for isa {isa!r}: per block and KV head, K = [head_size, block_size] "
          "(transposed), then V = [block_size, head_size]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
