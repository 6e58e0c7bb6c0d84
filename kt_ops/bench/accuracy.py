"""python -m kt_ops.bench.accuracy: the accuracy table of every packed format.

For one MoE layer with Gaussian weights and inputs, per format:
- quantization error: ||ref(dequantized W) - ref(W)|| / ||ref(W)||, the fp32 reference
  on the weights the format stores vs on the original (bf16) weights;
- kernel error: ||ours - ref(dequantized W)|| / ||ref(dequantized W)||, what our kernel
  adds (for INT8/INT4 mostly the per-token int8 activation rounding);
- total error: ||ours - ref(W)|| / ||ref(W)||.
docs/formats.md quotes its output; tests/test_accuracy.py runs it on a small layer.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from kt_ops import reference
from kt_ops.ops import moe_forward, pack_experts

# (label, method, group_size, zero_point, scale_search)
FORMATS: list[tuple[str, str, int, bool, bool]] = [
    ("BF16", "BF16", 128, False, False),
    ("INT8", "AMXINT8", 128, False, False),
    ("INT8 + scale search", "AMXINT8", 128, False, True),
    ("INT4 g32", "AMXINT4", 32, False, False),
    ("INT4 g64", "AMXINT4", 64, False, False),
    ("INT4 g128", "AMXINT4", 128, False, False),
    ("INT4 g128 + scale search", "AMXINT4", 128, False, True),
    ("INT4 g128 zero point", "AMXINT4", 128, True, False),
    ("INT4 g128 zero point + scale search", "AMXINT4", 128, True, True),
    ("FP8 (128 x 128 blocks)", "FP8", 128, False, False),
    ("FP8 per channel", "FP8_PERCHANNEL", 128, False, False),
    ("MXFP8", "MXFP8", 128, False, False),
    ("MXFP4", "MXFP4", 128, False, False),
]


@dataclass
class AccuracyRow:
    label: str
    quant_error: float
    kernel_error: float
    total_error: float


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def accuracy_table(experts: int = 8, hidden: int = 2048, intermediate: int = 768, tokens: int = 64,
                   top_k: int = 2, seed: int = 0) -> list[AccuracyRow]:
    """The table's rows for a random layer of the given shape (fp32 inputs and output)."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(experts, intermediate, hidden, generator=g) / hidden**0.5).bfloat16()
    up = (torch.randn(experts, intermediate, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, intermediate, generator=g) / intermediate**0.5).bfloat16()
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=-1)[:, :top_k].to(torch.int32)
    weights = torch.softmax(torch.rand(tokens, top_k, generator=g), dim=-1)
    exact = reference.moe_forward(x, ids, weights, gate, up, down)
    rows = []
    for label, method, group, zero_point, search in FORMATS:
        packed = pack_experts(gate, up, down, method=method, group_size=group, zero_point=zero_point,
                              scale_search=search)
        stored = reference.moe_forward(x, ids, weights, *reference.dequantize(packed.data))
        ours = moe_forward(x, ids, weights, packed)
        rows.append(AccuracyRow(label, _rel(stored, exact), _rel(ours, stored), _rel(ours, exact)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kt_ops.bench.accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    rows = accuracy_table(args.experts, args.hidden, args.intermediate, args.tokens)
    print(f"layer: E={args.experts} H={args.hidden} I={args.intermediate}, {args.tokens} tokens, top-2, "
          "Gaussian weights and inputs; relative Frobenius errors of the layer output\n")
    print("| format | quantization error | kernel error | total |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.label} | {r.quant_error:.2e} | {r.kernel_error:.2e} | {r.total_error:.2e} |")


if __name__ == "__main__":
    main()
