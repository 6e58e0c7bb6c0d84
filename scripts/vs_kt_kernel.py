"""kt_ops against kt-kernel, the package it replaces: the same layers through both ``KTMoEWrapper``s.

    .venv/bin/python scripts/vs_kt_kernel.py --kt-python /path/to/kt-kernel-venv/bin/python
        [--group S1:AMXINT8 S1:AMXINT4 S1:BF16 ...] [--tokens 1 8 64 512] [--calls 16] [--rounds 1]
        [--threads 2] [--kt-threads N] [--json OUT]

kt-kernel (``pip install kt-kernel``, never a kt_ops dependency) runs in its own interpreter
(``--kt-python``: a virtual environment holding kt-kernel and a torch of the same version).
Side A is kt_ops' ``KTMoEWrapper``, side B kt-kernel's, each in a worker process: both
build the same bf16 layers (the bench's shapes, weights drawn from fixed seeds; 3 layers
cycled) — AMXINT8/AMXINT4 with ``load_weights_from_tensors`` (kt-kernel quantizes online as
its converter does; kt_ops packs the same method), BF16 with ``load_weights`` from a
safetensors directory the worker writes (kt-kernel's BF16 wrapper reads nothing else) —
``cpuinfer_threads`` = ``--threads`` (``--kt-threads`` for kt-kernel), one NUMA part, and
time ``wrapper.forward(x, ids, weights, None)`` (CPU tensors: both wrappers submit and wait)
on the same bf16 inputs and routing. Before every timed call the caches are flushed (a 256
MiB read) and a small layer of the same method runs (a model's previous layer: its pool is
awake). The driver alternates the sides call by call (ABBA) and reports per row the median
microseconds of each side and the median of the per-pair ratios kt-kernel / kt_ops (above 1:
kt_ops is faster), and each side's relative error (Frobenius) against the fp32 reference on
the row's first input. Run it on an otherwise idle machine.

On a CPU-only torch kt-kernel's pinned buffers fail (``pin_memory`` needs CUDA): the worker
drops that flag (pinning changes how memory is locked, not its contents), and sets
``KT_FORCE_SYNC_SUBMIT=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The bench's shapes (kt_ops/bench/runner.py SHAPES; repeated: kt-kernel's worker does not import kt_ops):
# name -> (experts, top-k, hidden, intermediate). The small "previous" layer: 16 experts of I 256 with the
# shape's H and top-k (kt-kernel's staging buffers are shared by its layers and sized by the first one).
SHAPES = {"S1": (128, 8, 2048, 768), "S2": (64, 6, 2048, 1408)}
LAYERS = 3
INPUTS = 12


def _drop_pin_memory() -> None:
    """kt-kernel on a CPU-only torch: allocate its pinned buffers as plain ones."""
    import torch

    for name in ("zeros", "empty", "full", "ones"):
        original = getattr(torch, name)

        def unpinned(*args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            kwargs.pop("pin_memory", None)
            return _original(*args, **kwargs)

        setattr(torch, name, unpinned)


def _weights(shape: tuple[int, int, int, int], seed: int):  # type: ignore[no-untyped-def]
    """bf16 gate [E, I, H], up [E, I, H], down [E, H, I] drawn from ``seed``."""
    import torch

    E, _, H, I = shape
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    up = (torch.randn(E, I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    return gate, up, down


def _inputs(shape: tuple[int, int, int, int], tokens: int, seed: int):  # type: ignore[no-untyped-def]
    """bf16 x [T, H], int64 ids [T, k] (distinct experts per token), fp32 softmax weights [T, k]."""
    import torch

    E, k, H, _ = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(torch.int64)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return x, ids, weights


def worker(backend: str, group: str, tokens_list: list[int], threads: int) -> None:
    """Builds the group's layers through ``backend``'s KTMoEWrapper, prints "ready", then times
    one call per "go T" line (and returns the first output of a row on "out T")."""
    import torch

    if backend == "kt-kernel":
        _drop_pin_memory()
        from kt_kernel import KTMoEWrapper
    else:
        from kt_ops import KTMoEWrapper
    shape_name, method = group.split(":")
    shape = SHAPES[shape_name]
    small = (16, shape[1], shape[2], 256)
    chunk = max(512, -(-max(tokens_list) // 32) * 32)  # kt-kernel's AMX buffers take multiples of 32 rows

    def build(layer_idx: int, dims: tuple[int, int, int, int], weight_path: str):  # type: ignore[no-untyped-def]
        E, k, H, I = dims
        wrapper = KTMoEWrapper(layer_idx=layer_idx, num_experts=E, num_experts_per_tok=k, hidden_size=H,
                               moe_intermediate_size=I, gpu_experts_mask=torch.zeros(E, dtype=torch.bool),
                               cpuinfer_threads=threads, threadpool_count=1, weight_path=weight_path,
                               chunked_prefill_size=chunk, method=method)
        if method == "BF16":  # kt-kernel's BF16 wrapper reads safetensors only (no load_weights_from_tensors)
            wrapper.load_weights(torch.arange(E, dtype=torch.int64))
        else:  # AMXINT8 / AMXINT4: quantized online (kt-kernel: as its converter does)
            wrapper.load_weights_from_tensors(*_weights(dims, layer_idx), torch.arange(E, dtype=torch.int64))
        return wrapper

    dims = [shape] * LAYERS + [small]  # layer LAYERS: the small previous layer
    with tempfile.TemporaryDirectory() as scratch:
        from safetensors.torch import save_file

        # the layers as an HF checkpoint (BF16), or one unused file (kt-kernel opens a loader on
        # weight_path at construction)
        save_file({"unused": torch.zeros(1)}, os.path.join(scratch, "unused.safetensors"))
        if method == "BF16":
            for layer_idx, layer_dims in enumerate(dims):
                tensors = {}
                for name, weights in zip(("gate_proj", "up_proj", "down_proj"), _weights(layer_dims, layer_idx)):
                    for e in range(layer_dims[0]):
                        tensors[f"model.layers.{layer_idx}.mlp.experts.{e}.{name}.weight"] = weights[e].contiguous()
                save_file(tensors, os.path.join(scratch, f"layer-{layer_idx}.safetensors"))
        built = [build(layer_idx, layer_dims, scratch) for layer_idx, layer_dims in enumerate(dims)]
    layers, previous = built[:LAYERS], built[LAYERS]
    data = {}
    for tokens in tokens_list:
        inputs = [_inputs(shape, tokens, 1000 * tokens + i) for i in range(INPUTS)]
        small_inputs = _inputs(small, tokens, 7)
        data[tokens] = (inputs, small_inputs)
        layers[0].forward(*inputs[0], None)
    flush_buffer = torch.ones(256 << 18, dtype=torch.float32)  # 256 MiB
    print("@@ready", flush=True)
    i = 0
    for line in sys.stdin:
        command, tokens = line.split()
        inputs, small_inputs = data[int(tokens)]
        if command == "out":
            out = layers[0].forward(*inputs[0], None).float()
            print("@@" + json.dumps(out.flatten().tolist()), flush=True)
            continue
        flush_buffer.sum()
        previous.forward(*small_inputs, None)
        x, ids, weights = inputs[i % INPUTS]
        start = time.perf_counter()
        layers[i % LAYERS].forward(x, ids, weights, None)
        print(f"@@{(time.perf_counter() - start) * 1e6}", flush=True)
        i += 1


class Side:
    """One worker process."""

    def __init__(self, python: str, backend: str, group: str, tokens: list[int], threads: int) -> None:
        env = {**os.environ, "KT_FORCE_SYNC_SUBMIT": "1"}
        if backend == "kt_ops":
            env["PYTHONPATH"] = str(ROOT)
        else:
            env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(
            [python, __file__, "--worker", backend, group, "--tokens", *map(str, tokens), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        if self.answer() != "ready":
            raise RuntimeError(f"the {backend} worker for {group} failed to start")

    def answer(self) -> str:
        """The worker's next answer: its next line marked "@@" (kt-kernel prints its own lines)."""
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line[2:].strip()
        return ""

    def ask(self, command: str, tokens: int) -> str:
        self.proc.stdin.write(f"{command} {tokens}\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _reference(shape: tuple[int, int, int, int], tokens: int):  # type: ignore[no-untyped-def]
    """fp32 output of layer 0 on the first input of a row (what "out" returns), flattened."""
    import torch

    gate, up, down = (w.float() for w in _weights(shape, 0))
    x, ids, weights = _inputs(shape, tokens, 1000 * tokens)
    x, out = x.float(), torch.zeros(tokens, shape[2])
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        h = torch.nn.functional.silu(x[rows] @ gate[e].T) * (x[rows] @ up[e].T)
        out.index_add_(0, rows, (h @ down[e].T) * weights[rows, slots, None])
    return out.flatten()


def pair_row(a: Side, b: Side, shape: tuple[int, int, int, int], tokens: int, calls: int) -> dict[str, float]:
    """``calls`` paired calls in ABBA order: medians of each side, of the ratios B/A, and the
    relative errors of the two first outputs against the fp32 reference."""
    import torch

    out_a = torch.tensor(json.loads(a.ask("out", tokens)))
    out_b = torch.tensor(json.loads(b.ask("out", tokens)))
    reference = _reference(shape, tokens)
    times_a, times_b = [], []
    for i in range(calls):
        order = (b, a) if i % 2 else (a, b)
        for side in order:
            (times_a if side is a else times_b).append(float(side.ask("go", tokens)))
    ratios = [tb / ta for ta, tb in zip(times_a, times_b)]
    return {"kt_ops_us": statistics.median(times_a), "kt_kernel_us": statistics.median(times_b),
            "ratio": statistics.median(ratios), "kt_ops_error": _relative(out_a, reference),
            "kt_kernel_error": _relative(out_b, reference)}


def _relative(out, reference) -> float:  # type: ignore[no-untyped-def]
    return float((out - reference).norm() / max(float(reference.norm()), 1e-30))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/vs_kt_kernel.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--kt-python", required=True, help="an interpreter that imports kt_kernel")
    parser.add_argument("--group", nargs="+", default=["S1:AMXINT8", "S1:AMXINT4", "S1:BF16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="cpuinfer_threads of both wrappers")
    parser.add_argument("--kt-threads", type=int, help="kt-kernel's cpuinfer_threads instead of --threads")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    print("group        tokens   kt_ops us   kt-kernel us   kt-kernel/kt_ops (rounds)   "
          "error vs fp32: kt_ops  kt-kernel")
    for group in args.group:
        rounds: dict[int, list[dict[str, float]]] = {t: [] for t in args.tokens}
        for _ in range(args.rounds):
            a = Side(sys.executable, "kt_ops", group, args.tokens, args.threads)
            b = Side(args.kt_python, "kt-kernel", group, args.tokens, args.kt_threads or args.threads)
            try:
                for tokens in args.tokens:
                    rounds[tokens].append(pair_row(a, b, SHAPES[group.split(":")[0]], tokens, args.calls))
            finally:
                a.close()
                b.close()
        for tokens, results in rounds.items():
            row = {"group": group, "tokens": tokens,
                   **{key: statistics.median(r[key] for r in results) for key in results[0]},
                   "round_ratios": [r["ratio"] for r in results]}
            rows.append(row)
            spread = " ".join(f"{r:.2f}" for r in row["round_ratios"])
            print(f"{group:<12} {tokens:>6} {row['kt_ops_us']:>11.0f} {row['kt_kernel_us']:>14.0f}   "
                  f"{row['ratio']:>6.2f} ({spread})   {row['kt_ops_error']:.2e}  {row['kt_kernel_error']:.2e}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        parsed = argparse.ArgumentParser()
        parsed.add_argument("backend")
        parsed.add_argument("group")
        parsed.add_argument("--tokens", type=int, nargs="+")
        parsed.add_argument("--threads", type=int)
        worker_args = parsed.parse_args(sys.argv[2:])
        worker(worker_args.backend, worker_args.group, worker_args.tokens, worker_args.threads)
    else:
        sys.exit(main())
