"""Fixed cost of one ``moe_forward`` call: a tiny layer (1 token, L1-resident weights),
timed under grad mode, ``torch.no_grad()`` and ``torch.inference_mode()`` (which skips the
Autograd dispatch key), through ``kt_ops.moe_forward``, ``torch.ops.kt.moe_forward`` and
kt-kernel's API (``KTMoEWrapper.forward`` on CPU inputs, its layer re-packed from the
dequantized weights: the same weights for BF16, quantized again for the other methods).

    .venv/bin/python scripts/call_overhead.py [--method BF16] [--layer 2,64,32,1]
        [--calls 20000] [--rounds 3]

``--layer E,H,I,k``: experts, hidden size, intermediate size, experts per token. The modes
alternate round by round (the machine's drift hits them alike); each row is the median of
the rounds' median microseconds per call. Run it on an otherwise idle machine, and with
``OMP_NUM_THREADS=1`` and ``=2`` to see the thread pool's share.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable

import torch

import kt_ops


def median_us(call: Callable[[], object], calls: int) -> float:
    """Median wall time of ``call`` in microseconds over ``calls`` calls (after a warm-up)."""
    for _ in range(min(calls, 500)):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="BF16")
    parser.add_argument("--layer", default="2,64,32,1", help="E,H,I,k")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    experts, hidden, inter, top_k = (int(v) for v in args.layer.split(","))
    torch.manual_seed(0)
    packed = kt_ops.pack_experts(torch.randn(experts, inter, hidden) * 0.05, torch.randn(experts, inter, hidden) * 0.05,
                                 torch.randn(experts, hidden, inter) * 0.05, method=args.method)
    x = torch.randn(1, hidden).to(torch.bfloat16)
    ids = torch.arange(top_k, dtype=torch.int32).view(1, top_k)
    weights = torch.rand(1, top_k)
    op = torch.ops.kt.moe_forward.default
    wrapper = kt_ops.KTMoEWrapper(0, experts, top_k, hidden, inter, method=args.method)
    wrapper.load_weights_from_tensors(*(kt_ops.dequantize_experts(packed)))
    entries = {
        "kt_ops.moe_forward": lambda: kt_ops.moe_forward(x, ids, weights, packed),
        "torch.ops.kt.moe_forward.default": lambda: op(x, ids, weights, packed.data, None),
        "KTMoEWrapper.forward": lambda: wrapper.forward(x, ids, weights),
    }
    modes = {"grad mode": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for entry, call in entries.items():
            for mode, context in modes.items():
                with context():
                    results.setdefault((entry, mode), []).append(median_us(call, args.calls))
    print(f"{args.method} E,H,I,k = {args.layer}, 1 token, {torch.get_num_threads()} threads, "
          f"variant {kt_ops.cpu_variant()}, {args.rounds} rounds of {args.calls} calls")
    for (entry, mode), values in results.items():
        print(f"  {entry:34s} {mode:15s} {statistics.median(values):7.2f} us  "
              f"(rounds {min(values):.2f}-{max(values):.2f})")


if __name__ == "__main__":
    main()
