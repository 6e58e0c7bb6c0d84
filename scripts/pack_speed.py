"""Times kt_ops.pack_experts on one Qwen3-30B-A3B MoE layer (128 experts, hidden 2048,
intermediate 768, bf16 weights) for every quantized method, with and without the
scale search. Usage: .venv/bin/python scripts/pack_speed.py [--experts N]"""

from __future__ import annotations

import argparse
import time

import torch

import kt_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    args = parser.parse_args()
    E, H, I = args.experts, 2048, 768
    gate = torch.randn(E, I, H, dtype=torch.bfloat16) * 0.02
    up = torch.randn(E, I, H, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, I, dtype=torch.bfloat16) * 0.02
    print(f"{E} experts, H {H}, I {I}, bf16, {kt_ops.get_num_threads()} threads")
    for method, zero_point in (("BF16", False), ("AMXINT8", False), ("AMXINT4", False), ("AMXINT4", True)):
        for search in (False, True) if method != "BF16" else (False,):
            start = time.perf_counter()
            packed = kt_ops.pack_experts(gate, up, down, method=method, zero_point=zero_point, scale_search=search)
            seconds = time.perf_counter() - start
            print(f"{method:8} zero_point={zero_point!s:5} scale_search={search!s:5} {seconds:6.2f} s"
                  f"  {packed.nbytes / 1e6:7.1f} MB")
            del packed


if __name__ == "__main__":
    main()
