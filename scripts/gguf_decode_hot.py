"""1-token GGUF decode with the weights cache-resident: the kernels' compute limit.

S1 sizes (H 2048, I 768) with only the 8 experts a token uses: a 21 MB (4-bit types) to
40 MB (Q8_0) layer, which stays in a 32 MiB L3 between calls for the types below ~6 bits
per weight (Q8_0's and Q6_K's layers partly stream from DRAM there, so their figure is a
lower bound of the compute limit); prints the median time and the weight bytes it would
stream per second. Compare with ``python -m kt_ops.bench`` (caches evicted).
TOKENS=n routes n tokens to the same 8 experts (n tokens per expert: the in-place
kernels' token blocks); N sets the timed calls (300).

    .venv/bin/python scripts/gguf_decode_hot.py [Q4_K Q8_0 ...]
"""

from __future__ import annotations

import os
import sys
import time

import torch

import kt_ops


def main(types: list[str]) -> None:
    torch.manual_seed(0)
    experts, top_k, hidden, inter = 8, 8, 2048, 768
    gate = torch.randn(experts, inter, hidden, dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, dtype=torch.bfloat16) * 0.02
    tokens = int(os.environ.get("TOKENS", "1"))
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    ids, weights = torch.arange(top_k)[None].repeat(tokens, 1), torch.rand(tokens, top_k)
    print(f"variant {kt_ops.cpu_variant()}, {kt_ops.get_num_threads()} threads, {tokens} tokens")
    for name in types:
        packed = kt_ops.pack_experts(gate, gate, down, method="LLAMAFILE", gguf_type=name)
        for _ in range(20):
            kt_ops.moe_forward(x, ids, weights, packed)
        times = []
        for _ in range(int(os.environ.get("N", "300"))):
            start = time.perf_counter()
            kt_ops.moe_forward(x, ids, weights, packed)
            times.append(time.perf_counter() - start)
        median = sorted(times)[len(times) // 2]
        print(f"{name}: {median * 1e6:.0f} us, {(packed.nbytes - 256) / median / 1e9:.1f} GB/s of weights")


if __name__ == "__main__":
    main(sys.argv[1:] or ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
