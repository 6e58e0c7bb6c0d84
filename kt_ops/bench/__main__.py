"""python -m kt_ops.bench [--quick] [--shape S1 S2] [--method BF16 AMXINT8 AMXINT4 Q4_K Q4_K_M Q6_K Q8_0 Q4_0] [--tokens 1 8 64 512]
[--layers N] [--threads N] [--json PATH] [--cold-code] [--model-step]

Prints, per row: microseconds per MoE layer forward (median; the caches are evicted
before every timed call, as a real model's other layers would, then a small layer of
the same method runs, as the previous layer's MoE block would), the activated experts'
weight bytes read per second, GFLOP/s, the roofline fraction of the machine limit that
binds (read bandwidth, measured again next to each row and shown as "read GB/s", or the
bf16 GEMM reference, both measured in this run), and the speed-up over the plain-PyTorch
layer. Q4_K, Q6_K, Q8_0 and Q4_0 are GGUF types (method LLAMAFILE), Q4_K_M their mix in
llama.cpp's Q4_K_M files (gate/up Q4_K, down Q6_K); on S2 (I = 1408) the K-quant rows
store down as llama.cpp does for that size (Q4_K -> Q5_0, Q6_K -> Q8_0).

--model-step times the op inside a model step instead: torch work (an attention-sized
block) alone, the op alone, and the two alternating, interleaved; see
kt_ops/bench/model_step.py (default: method BF16, tokens 1 8 512).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import kt_ops
from kt_ops.bench.limits import CacheFlusher, bf16_gemm_gflops, last_level_cache_bytes, read_bandwidth_gbs
from kt_ops.bench.model_step import StepRow, format_steps, measure_step
from kt_ops.bench.runner import (
    GGUF_METHODS,
    METHODS,
    SHAPES,
    Row,
    gguf_types_for,
    make_layers,
    measure_row,
    previous_layer,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kt_ops.bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("--quick", action="store_true", help="S1 only, tokens 1 and 64, 2 layers (~1-2 min)")
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--method", nargs="+", choices=METHODS, default=None)
    parser.add_argument("--tokens", nargs="+", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help="distinct layers cycled through (default 3; 2 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads = torch's intra-op threads (default: torch's, the physical cores)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 30; 10 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and limits as JSON")
    parser.add_argument(
        "--cold-code",
        action="store_true",
        help="flush only: do not run the small previous layer between the flush and the timed call "
        "(the call's code and buffers start cold too)",
    )
    parser.add_argument(
        "--model-step",
        action="store_true",
        help="time the op alternating with torch work, as inside a model step, against the two alone",
    )
    args = parser.parse_args(argv)
    args.shape = args.shape or (["S1"] if args.quick else ["S1", "S2"])
    args.method = args.method or (["BF16"] if args.model_step else list(METHODS))
    args.tokens = args.tokens or ([1, 64] if args.quick else [1, 8, 512] if args.model_step else [1, 8, 64, 512])
    args.layers = args.layers or (2 if args.quick else 3)
    args.repeats = args.repeats or (10 if args.quick else 30)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens must be >= 1")
    return args


def progress(message: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{message}")
    else:
        sys.stderr.write(message + "\n")
    sys.stderr.flush()


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'shape':5} {'method':7} {'tokens':>6} {'us/layer':>10} {'torch us':>10} {'speedup':>8} "
        f"{'GB/s':>7} {'GFLOP/s':>8} {'bound':>9} {'of limit':>8} {'read GB/s':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.shape:5} {r.method:7} {r.tokens:>6} {r.us:>10.0f} {r.torch_us:>10.0f} {r.speedup:>7.2f}x "
            f"{r.weight_gbs:>7.1f} {r.gflops:>8.1f} {r.limit:>9} {100 * r.limit_fraction:>7.0f}% {r.read_gbs:>9.1f}"
        )
    return "\n".join(lines)


def model_step_main(args: argparse.Namespace) -> int:
    print(
        f"kt_ops {kt_ops.__version__} | torch {torch.__version__} | variant {kt_ops.cpu_variant()} | "
        f"threads {kt_ops.get_num_threads()} (torch {torch.get_num_threads()}) on {kt_ops.thread_source()}"
    )
    rows: list[StepRow] = []
    total = len(args.shape) * len(args.method) * len(args.tokens)
    for shape_name in args.shape:
        for method in args.method:
            for tokens in args.tokens:
                progress(f"[{len(rows)}/{total}] model step {shape_name} {method} tokens={tokens} ...")
                rows.append(measure_step(shape_name, method, tokens, layers=args.layers))
    progress("")
    print(format_steps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_variant": kt_ops.cpu_variant(), "threads": kt_ops.get_num_threads(),
                       "thread_source": kt_ops.thread_source(), "model_step": [r.as_dict() for r in rows]}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        kt_ops.set_num_threads(args.threads)
    if args.model_step:
        return model_step_main(args)
    torch.manual_seed(0)
    started = time.perf_counter()
    progress("measuring read bandwidth and the bf16 GEMM reference ...")
    flush = CacheFlusher()
    read_gbs = read_bandwidth_gbs(flush.buffer)
    gemm_gflops = bf16_gemm_gflops()
    print(
        f"kt_ops {kt_ops.__version__} | torch {torch.__version__} | variant {kt_ops.cpu_variant()} | "
        f"threads {kt_ops.get_num_threads()} (torch {torch.get_num_threads()})"
    )
    print(
        f"machine limits: read bandwidth {read_gbs:.1f} GB/s ({flush.buffer.numel() >> 20} MiB buffer; "
        f"LLC {last_level_cache_bytes() >> 20} MiB, evicted before every timed call), "
        f"bf16 GEMM (torch.matmul) {gemm_gflops:.0f} GFLOP/s"
    )
    rows: list[Row] = []
    total = len(args.shape) * len(args.method) * len(args.tokens)
    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        for method in args.method:
            progress(f"[{len(rows)}/{total}] packing {args.layers} {shape.name} layers ({shape.model}) as {method} ...")
            layers = make_layers(shape, method, args.layers)
            previous = None if args.cold_code else previous_layer(shape, method)
            for tokens in args.tokens:
                progress(f"[{len(rows)}/{total}] {shape.name} {method} tokens={tokens} ...")
                # The machine is shared: measure the bandwidth again next to each row.
                row_read_gbs = read_bandwidth_gbs(flush.buffer, repeats=3)
                rows.append(
                    measure_row(shape, method, tokens, layers, row_read_gbs, gemm_gflops, args.repeats, flush, previous)
                )
            del layers
    progress(f"done in {time.perf_counter() - started:.0f} s\n")
    print(format_table(rows))
    mixed = sorted({f"{r.shape} {r.method}: {'/'.join(gguf_types_for(r.method, SHAPES[r.shape]))}"
                    for r in rows if r.method in GGUF_METHODS and set(gguf_types_for(r.method, SHAPES[r.shape])) != {r.method}})
    if mixed:
        print("GGUF rows whose gate/up/down types differ from the method (mixes such as Q4_K_M; llama.cpp's down "
              "type where I is not a multiple of 256): " + "; ".join(mixed))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "read_bandwidth_gbs": read_gbs,
                    "bf16_gemm_gflops": gemm_gflops,
                    "cpu_variant": kt_ops.cpu_variant(),
                    "threads": kt_ops.get_num_threads(),
                    "previous_layer_warm_up": not args.cold_code,
                    "rows": [r.as_dict() for r in rows],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
