"""NUMA parts vs one part: decode (one token; --tokens for more) of one MoE layer.

    KT_OPS_NUMA_SIMULATE=2 .venv/bin/python scripts/bench_numa_parts.py [--experts 64] [--top-k 8]
        [--hidden 2048] [--intermediate 768] [--method BF16] [--tokens 1] [--repeats 15] [--calls 100]

Sides, on the same weights (seed 0) and the same routing sequence (another top-k set
every call, as decode has):

- ``1 part``: ``kt::moe_forward`` of the layer packed whole, on all threads;
- ``2 parts at once``: ``kt::moe_forward_parts`` of the layer packed as two parts, nodes
  0 and 1: each part on its node's pool, both at once, the partials summed;
- ``2 parts one after another``: ``kt::moe_forward`` per part, summed in Python (what
  threadpool_count=2 ran before the parts operator);
- ``wrapper, threadpool_count=1`` and ``=2``: ``KTMoEWrapper.forward`` (its background
  thread, routing table and fp32 rows included).

Each repeat times ``--calls`` calls per side, the sides in rotating order so the
machine's drift hits them alike. Reports per side the median microseconds per call, its
ratio to its reference's median (the operator sides to ``1 part``, the wrapper sides to
``threadpool_count=1``), and the median of its per-repeat ratios to that reference (the
sides of one repeat run closer together in time than the repeats do). Run it on an
otherwise idle machine (``uptime``, ``top``): no builds or tests beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import kt_ops
from kt_ops import numa
from kt_ops.ops import moe_forward_parts
from kt_ops.parts import pack_parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--method", default="BF16")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    E, K, H, I, T = args.experts, args.top_k, args.hidden, args.intermediate, args.tokens
    topology = numa.topology()
    nodes = numa.resolve_nodes(None, 2)
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    whole = pack_parts(gate, up, down, args.method, 1)[0]
    parts = pack_parts(gate, up, down, args.method, 2)
    wrappers = {}
    for count in (1, 2):
        wrappers[count] = kt_ops.KTMoEWrapper(0, E, K, H, I, threadpool_count=count, method=args.method)
        wrappers[count].load_weights_from_tensors(gate, up, down)
    x = torch.randn(T, H, generator=g)
    routes = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int() for _ in range(64)]
    weights = torch.rand(T, K, generator=g)

    sides: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
        "1 part": (lambda ids: kt_ops.moe_forward(x, ids, weights, whole), "1 part"),
        "2 parts at once": (lambda ids: moe_forward_parts(x, ids, weights, parts, nodes), "1 part"),
        "2 parts one after another": (
            lambda ids: kt_ops.moe_forward(x, ids, weights, parts[0]) + kt_ops.moe_forward(x, ids, weights, parts[1]),
            "1 part"),
        "wrapper, threadpool_count=1": (lambda ids: wrappers[1].forward(x, ids, weights),
                                        "wrapper, threadpool_count=1"),
        "wrapper, threadpool_count=2": (lambda ids: wrappers[2].forward(x, ids, weights),
                                        "wrapper, threadpool_count=1"),
    }
    first = sides["1 part"][0](routes[0])
    width = max(map(len, sides))
    for name, (side, _) in sides.items():
        error = ((side(routes[0]) - first).norm() / first.norm()).item()
        print(f"{name:{width}s} rel. difference to 1 part: {error:.1e}")
        for i in range(20):  # warm-up: pools started, scratch grown
            side(routes[i % len(routes)])
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            side = sides[name][0]
            start = time.perf_counter()
            for i in range(args.calls):
                side(routes[i % len(routes)])
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"E={E} K={K} H={H} I={I} {args.method}, {T} token(s), {kt_ops.get_num_threads()} threads on "
          f"{kt_ops.thread_source()}, nodes {topology.ids}{' (simulated)' if topology.simulated else ''}, parts on "
          f"{nodes}; {args.repeats} repeats x {args.calls} calls")
    for name, values in times.items():
        reference = times[sides[name][1]]
        median = statistics.median(values)
        paired = statistics.median(v / r for v, r in zip(values, reference))
        print(f"{name:{width}s} median {median:8.1f} us/call  x{median / statistics.median(reference):.3f}  "
              f"(per-repeat ratios: median x{paired:.3f})  repeats: {', '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
