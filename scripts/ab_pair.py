"""Paired A/B of two kt_ops builds or CPU variants, row by row, on a noisy machine.

    .venv/bin/python scripts/ab_pair.py S1:AMXINT4 S2:Q4_K [--tokens 1 8 64 512]
        [--a PATH] [--b PATH] [--a-variant V] [--b-variant V] [--b-method M] [--calls 40] [--rounds 1] [--json OUT]
        [--a-env NAME=VALUE ...] [--b-env NAME=VALUE ...]

Side A and side B are two worker processes, each importing kt_ops from its own path
(``--a``/``--b``: a checkout with the extension built in place; default: this checkout)
under its own ``KT_OPS_CPU_VARIANT`` (``--a-variant``/``--b-variant``; default: the
active one); ``--b-method`` makes side B pack another method on the same shape and
weights (e.g. ``S1:MXFP4 --b-method GGUF_MXFP4``: two packings, one build);
``--a-env``/``--b-env`` set environment variables in one side's worker only (a run-time
switch read with ``getenv`` during an experiment: both ways from one build). Both pack the same random layers (seed 0; 3 layers cycled), and time the
same calls with the bench's protocol: before every timed call the caches are flushed (a
stream of 4x the last-level cache, at least 256 MiB, as the bench's) and a small layer of
the same method runs. The driver alternates the sides call by call (ABBA order), so the
machine's drift — read bandwidth swinging by a third within minutes on shared hosts —
hits both alike, and reports per row the median microseconds of each side and the median
of the per-pair ratios B/A (below 1: B is faster). Before each row both workers read every
page of their layers (pair_row). Run it on an otherwise idle machine: no builds, tests or helpers beside it.
A pair of processes can also differ by itself: on the shared Zen 5 host, one build against
itself (S1 RAWINT4, 1 and 8 tokens, 30 calls, 2026-11-27) gave 0.79 and 0.88 in one run
and 0.97-1.03 in the next, steady within a run, so the pairing cannot cancel it.
``--rounds N`` starts N fresh pairs of workers per group and reports, per row, the median
over the rounds' medians with their range: trust a change that moves every round.
Groups are ``SHAPE:METHOD`` with the bench's shapes (S1, S2) and methods, those its
``--method`` takes beyond the default set included (e.g. ``S1:Q5_1``); a side whose
checkout predates such a method packs it as that checkout packs its GGUF methods.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(group: str, tokens_list: list[int]) -> None:
    """Packs the group's layers, prints "ready", then times one call per "go T" line."""
    import torch

    import kt_ops.bench.runner as runner

    from kt_ops import moe_forward
    from kt_ops.bench.runner import SHAPES, make_layers, previous_layer, previous_shape, random_routing

    shape_name, method = group.split(":")
    shape = SHAPES[shape_name]
    known = getattr(runner, "ALL_METHODS", runner.METHODS + runner.GGUF_METHODS)
    if method not in known:  # an older checkout's bench
        runner.GGUF_METHODS = (*runner.GGUF_METHODS, method)
    torch.manual_seed(0)
    layers = make_layers(shape, method, 3)
    previous = previous_layer(shape, method)
    data = {}
    for tokens in tokens_list:
        g = torch.Generator().manual_seed(tokens)
        inputs = []
        for i in range(12):
            x = torch.randn(tokens, shape.hidden, generator=g).to(torch.bfloat16)
            ids, weights = random_routing(shape, tokens, g)
            inputs.append((x, ids, weights, layers[i % 3]))
        small = previous_shape(shape)
        small_x = torch.randn(tokens, small.hidden, generator=g).to(torch.bfloat16)
        small_ids, small_weights = random_routing(small, tokens, g)
        data[tokens] = (inputs, small_x, small_ids, small_weights)
        moe_forward(*inputs[0][:3], inputs[0][3].packed)
    flush = flusher()
    print("ready", flush=True)
    i = 0
    for line in sys.stdin:
        if line.startswith("warm"):  # read one byte of every page of the layers: none starts a row cold
            for layer in (*layers, previous):
                layer.packed.data.view(torch.uint8)[::4096].sum()
            print("warm", flush=True)
            continue
        if not line.startswith("go"):
            break
        inputs, small_x, small_ids, small_weights = data[int(line.split()[1])]
        flush()
        moe_forward(small_x, small_ids, small_weights, previous.packed)
        x, ids, weights, layer = inputs[i % len(inputs)]
        start = time.perf_counter()
        moe_forward(x, ids, weights, layer.packed)
        print((time.perf_counter() - start) * 1e6, flush=True)
        i += 1


def flusher():  # type: ignore[no-untyped-def]
    """The worker's cache flush, the bench's size (:func:`kt_ops.bench.limits.flush_bytes` of
    its read buffer: 4x the last-level cache, at least 256 MiB); 256 MiB in a checkout that
    predates it. A fixed 256 MiB evicts nothing where the LLC is larger (480 MiB on a
    2-core Xeon VM)."""
    from kt_ops.bench import limits

    if not hasattr(limits, "flush_bytes"):
        return limits.CacheFlusher(limits.read_buffer(256 << 20))
    llc = limits.last_level_cache_bytes()
    return limits.CacheFlusher(limits.read_buffer(limits.flush_bytes(llc, limits.read_buffer_bytes(llc))))


class Side:
    """One worker process: kt_ops from ``path`` under ``variant`` (None: the default)."""

    def __init__(self, path: str, variant: str | None, group: str, tokens: list[int],
                 extra_env: list[str] | None = None) -> None:
        env = {**os.environ, **dict(item.split("=", 1) for item in extra_env or []), "PYTHONPATH": path}
        if variant:
            env["KT_OPS_CPU_VARIANT"] = variant
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", group, "--tokens", *map(str, tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"worker for {group} ({path}, {variant or 'default'}) failed to start")

    def call(self, tokens: int) -> float:
        self.proc.stdin.write(f"go {tokens}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def warm(self) -> None:
        """Touches every page of the worker's layers (see pair_row)."""
        self.proc.stdin.write("warm\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "warm":
            raise RuntimeError("a worker did not answer 'warm'")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def pair_row(a: Side, b: Side, tokens: int, calls: int) -> dict[str, float]:
    """``calls`` paired calls in ABBA order: medians of each side and of the ratios B/A.
    Both workers first touch every page of their layers: on the Firecracker VMs, memory a
    process left idle for seconds (side A's layers while side B packs) came back slowly —
    a 1-token call reads a few experts, so a side's first rows ran up to 2.3x slower than the
    same build on the other side (S1 AMXINT8 against itself, Zen 3, 2026-12-02)."""
    a.warm()
    b.warm()
    times_a, times_b = [], []
    for i in range(calls):
        if i % 2:
            times_b.append(b.call(tokens))
            times_a.append(a.call(tokens))
        else:
            times_a.append(a.call(tokens))
            times_b.append(b.call(tokens))
    ratios = [tb / ta for ta, tb in zip(times_a, times_b)]
    return {"a_us": statistics.median(times_a), "b_us": statistics.median(times_b), "ratio": statistics.median(ratios)}


def combine_rounds(rounds: list[dict[str, float]]) -> dict[str, object]:
    """One row over several rounds (fresh worker pairs): the medians of the rounds' medians,
    with every round's ratio B/A."""
    return {
        "a_us": statistics.median(r["a_us"] for r in rounds),
        "b_us": statistics.median(r["b_us"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "round_ratios": [r["ratio"] for r in rounds],
    }


def b_group(group: str, b_method: str | None) -> str:
    """Side B's SHAPE:METHOD: the group's, or its shape with ``b_method``."""
    return group if b_method is None else f"{group.partition(':')[0]}:{b_method}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/ab_pair.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="+", metavar="SHAPE:METHOD", help="e.g. S1:AMXINT4 S2:Q4_K")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 512])
    parser.add_argument("--a", default=str(ROOT), help="side A's checkout (default: this one)")
    parser.add_argument("--b", default=str(ROOT), help="side B's checkout (default: this one)")
    parser.add_argument("--a-variant", default=None, help="side A's KT_OPS_CPU_VARIANT (default: the best)")
    parser.add_argument("--b-variant", default=None, help="side B's KT_OPS_CPU_VARIANT (default: the best)")
    parser.add_argument("--b-method", default=None, help="side B packs this method instead (same shape)")
    parser.add_argument("--a-env", nargs="+", default=[], metavar="NAME=VALUE",
                        help="environment variables of side A's worker only (e.g. a run-time switch)")
    parser.add_argument("--b-env", nargs="+", default=[], metavar="NAME=VALUE",
                        help="environment variables of side B's worker only")
    parser.add_argument("--calls", type=int, default=40, help="paired calls per row (a third at 512+ tokens)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="fresh pairs of worker processes per group (default 1); rows report their median")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1 or any(t < 1 for t in args.tokens):
        parser.error("--calls, --rounds and --tokens must be >= 1")
    for item in args.a_env + args.b_env:
        if "=" not in item or not item.split("=", 1)[0]:
            parser.error(f"--a-env/--b-env: expected NAME=VALUE, got {item!r}")
    if args.worker:  # validated by the driver; the worker's checkout may predate ALL_METHODS
        return args
    from kt_ops.bench.runner import ALL_METHODS, GGUF_METHODS, SHAPES, gguf_types_for

    for group in args.groups:
        shape, _, method = group.partition(":")
        if shape not in SHAPES or method not in ALL_METHODS:
            parser.error(f"{group!r}: expected SHAPE:METHOD with SHAPE in {sorted(SHAPES)} and METHOD in {list(ALL_METHODS)}")
    if args.b_method is not None and args.b_method not in ALL_METHODS:
        parser.error(f"--b-method {args.b_method!r}: expected one of {list(ALL_METHODS)}")
    for group in args.groups:  # a type the workers could not pack (Q2_K / Q3_K on S2), found before they start
        for side in dict.fromkeys((group, b_group(group, args.b_method))):
            shape, _, method = side.partition(":")
            if method in GGUF_METHODS:
                try:
                    gguf_types_for(method, SHAPES[shape])
                except ValueError as error:
                    parser.error(str(error))
    if args.json == "":  # an unset shell variable: every row would run and no JSON be written
        parser.error("--json needs a file path, got an empty string")
    if args.json:  # found out now, not after every row was timed
        target = Path(args.json)
        folder = target.parent
        if target.is_dir():
            parser.error(f"--json {args.json} is a directory; give a file path")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            parser.error(f"--json {args.json}: cannot write into {folder} "
                         f"({'no such directory' if not folder.is_dir() else 'permission denied'})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.groups[0], args.tokens)
        return 0
    print(f"A: {args.a} ({args.a_variant or 'default variant'}{''.join(', ' + e for e in args.a_env)})"
          f"  B: {args.b} ({args.b_variant or 'default variant'}{''.join(', ' + e for e in args.b_env)}"
          + (f", method {args.b_method})" if args.b_method else ")"))
    print(f"{'row':18} {'A us':>9} {'B us':>9}  median B/A")
    rows = {}
    for group in args.groups:
        rounds: dict[int, list[dict[str, float]]] = {tokens: [] for tokens in args.tokens}
        for round_index in range(args.rounds):
            a = Side(args.a, args.a_variant, group, args.tokens, args.a_env)
            b = None
            try:  # side A's worker is closed also when side B's fails to start
                b = Side(args.b, args.b_variant, b_group(group, args.b_method), args.tokens, args.b_env)
                for tokens in args.tokens:
                    calls = args.calls if tokens < 512 else max(3, args.calls // 3)
                    row = pair_row(a, b, tokens, calls)
                    rounds[tokens].append(row)
                    label = f"{group}:{tokens}" + (f" r{round_index + 1}" if args.rounds > 1 else "")
                    print(f"{label:18} {row['a_us']:9.0f} {row['b_us']:9.0f}  {row['ratio']:.3f}", flush=True)
            finally:
                a.close()
                if b is not None:
                    b.close()
        for tokens in args.tokens:
            row = combine_rounds(rounds[tokens])
            rows[f"{group}:{tokens}"] = row
            if args.rounds > 1:
                ratios = row["round_ratios"]
                print(f"{group + ':' + str(tokens):18} {row['a_us']:9.0f} {row['b_us']:9.0f}  {row['ratio']:.3f}"
                      f"  (rounds {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
