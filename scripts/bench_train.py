"""Training-step cost of one MoE layer through kt_ops: forward alone (the inference kernel),
forward + backward w.r.t. the inputs as ``kt_ops.moe_forward`` runs it under autograd
(kt::moe_forward_train saving gate and up, kt::moe_train_backward), the same with gate and
up recomputed in the backward (``torch.ops.kt.moe_forward`` + kt::moe_backward), and LoRA
forward + backward (kt::moe_lora_forward / kt::moe_lora_backward), per format, on the
bench shapes.

    python scripts/bench_train.py [--shape S1] [--tokens 512] [--method BF16 AMXINT8 AMXINT4 Q4_K] [--repeats 5]
        [--rank 16]

``--method`` takes the bench's methods (``python -m kt_ops.bench --method``), packed as the
bench packs them (GGUF mixes such as Q4_K_M; on S2 llama.cpp's down type for K-quants).

Prints medians of ``--repeats`` timed calls of each (after one warm-up), the four calls of
a method interleaved, and the ratio (forward + backward) / forward. Run on an idle machine.
``KT_OPS_TRAIN_GEMM=aten`` (or ``panel``) times the backward's weight products on ATen's
sgemm (or the AVX2 panel kernel) instead of this CPU's default.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kt_ops
from kt_ops.bench.runner import ALL_METHODS, GGUF_METHODS, SHAPES, Shape, gguf_types_for, pack_layer
from kt_ops.packed import PackedExperts


def timed(fns: list, repeats: int) -> list[float]:
    """Median seconds of each function, the functions called in turn (one warm-up each),
    so that a slow spell of the machine hits them all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; bad values are usage errors (exit status 2) before any weights are drawn."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--method", nargs="+", choices=ALL_METHODS, default=["BF16", "AMXINT8", "AMXINT4", "Q4_K"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    for name in ("tokens", "repeats", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    for method in args.method:
        if method in GGUF_METHODS:
            try:
                gguf_types_for(method, SHAPES[args.shape])
            except ValueError as error:  # Q2_K / Q3_K on S2: llama.cpp's down type is one kt_ops does not compute
                parser.error(str(error))
    return args


def pack(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, method: str, shape: Shape) -> PackedExperts:
    """The layer packed as the bench packs ``method`` (GGUF types and mixes such as Q4_K_M with
    llama.cpp's down type where I is no multiple of 256: S2's Q4_K down is Q5_0)."""
    return pack_layer(gate, up, down, method, shape)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    x = torch.randn(args.tokens, H, generator=g).bfloat16()
    weights, ids = torch.rand(args.tokens, E, generator=g).softmax(-1).topk(K)
    probe = torch.randn(args.tokens, H, generator=g).bfloat16()
    print(f"{shape.name} (E={E}, K={K}, H={H}, I={I}), {args.tokens} tokens, {kt_ops.get_num_threads()} threads, "
          f"CPU variant {kt_ops.cpu_variant()}, torch threads {torch.get_num_threads()}")
    print(f"{'method':10} {'forward':>10} {'fwd+bwd':>10} {'ratio':>6} {'recompute':>10} {'ratio':>6} "
          f"{'LoRA f+b':>10} {'ratio':>6}")
    for method in args.method:
        packed = pack(gate, up, down, method, shape)
        lora = kt_ops.LoraExperts(E, H, I, rank=args.rank, dtype=torch.bfloat16)

        def forward() -> None:
            with torch.no_grad():
                kt_ops.moe_forward(x, ids, weights, packed)

        def train() -> None:
            inp = x.detach().requires_grad_()
            (kt_ops.moe_forward(inp, ids, weights, packed) * probe).sum().backward()

        def train_recompute() -> None:
            inp = x.detach().requires_grad_()
            (torch.ops.kt.moe_forward(inp, ids, weights, packed.data) * probe).sum().backward()

        def train_lora() -> None:
            inp = x.detach().requires_grad_()
            (lora(inp, ids, weights, packed) * probe).sum().backward()

        f, t, r, lt = timed([forward, train, train_recompute, train_lora], args.repeats)
        print(f"{method:10} {f * 1e3:8.1f}ms {t * 1e3:8.1f}ms {t / f:6.1f} {r * 1e3:8.1f}ms {r / f:6.1f} "
              f"{lt * 1e3:8.1f}ms {lt / f:6.1f}", flush=True)


if __name__ == "__main__":
    main()
