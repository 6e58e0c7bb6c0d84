"""GPU-assisted prefill against the CPU experts, one MoE layer, activations on the GPU.

    python scripts/bench_gpu_prefill.py [--shape S1] [--method BF16 AMXINT4 AMXINT8 Q4_K_M] [--tokens 512 2048 8192]

For each method and prompt length: the layer's routed experts through the CPU kernels
(``kt::moe_forward``'s CUDA key: activations copied to the host and back) and through
:func:`kt_ops.gpu_prefill.moe_forward_on_device` (the routed experts staged, copied and
computed on the GPU), interleaved, medians of ``--repeats``. Also prints the bytes the
GPU path copied per call and the rate that makes; the crossover is where the GPU column
drops below the CPU one (kt-kernel's default threshold is 4096 tokens). Needs a GPU and
kt_ops built with its CUDA key.

``--breakdown`` also times the GPU path's two transfers alone, each over all the call's
routed experts in its chunks: the host staging them (``stage ms``, into pinned memory on a
GPU) and copying the staged chunks to the device (``copy ms``); against ``gpu ms`` they
say whether the call's pipeline overlaps them.

``--layers N`` (N >= 2) also times a chain of N distinct layers of the method, each after
an attention-sized block of GPU work (four ``[T, H] x [H, H]`` bf16 products), through the
GPU path with each layer staging the next one's first chunk ahead (``next_layer``) and
without, interleaved: the ``chain ms`` columns, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kt_ops
import kt_ops.cuda
from kt_ops import gpu_prefill
from kt_ops.bench.runner import SHAPES, pack_layer, random_weights, timed_inputs


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    parser.add_argument("--method", nargs="+", default=["BF16", "AMXINT4", "AMXINT8"],
                        help="methods as python -m kt_ops.bench names them (GGUF types and mixes: Q4_K, Q4_K_M, ...)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script where no GPU is")
    parser.add_argument("--layers", type=int, default=1,
                        help="N >= 2: also a chain of N layers with and without the next layer staged ahead")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the host's staging and the copies alone (stage ms, copy ms)")
    args = parser.parse_args()
    if args.device != "cpu" and (not torch.cuda.is_available() or not kt_ops.cuda.is_built()):
        raise SystemExit("needs a GPU and kt_ops built with its CUDA key (KT_OPS_CUDA=1)")
    shape = SHAPES[args.shape]
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
    torch.manual_seed(0)
    layer = random_weights(shape, 1)[0]
    print(f"{torch.cuda.get_device_name() if args.device != 'cpu' else 'cpu'} | CPU variant {kt_ops.cpu_variant()}, {kt_ops.get_num_threads()} threads | "
          f"{shape.name} ({shape.model}): E={E} K={K} H={H} I={I}")
    if args.device != "cpu":  # the link's limit: pinned host -> GPU
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        target = torch.empty_like(pinned, device=args.device)
        rate = statistics.median(timed(lambda: target.copy_(pinned, non_blocking=True)) for _ in range(5))
        print(f"pinned host -> GPU copy: {pinned.numel() / rate / 1e9:.1f} GB/s")
        del pinned, target
    chain_head = f" {'chain ms':>9} {'ahead ms':>9} {'ratio':>6}" if args.layers > 1 else ""
    if args.breakdown:
        chain_head = f" {'stage ms':>8} {'copy ms':>8}" + chain_head
    print(f"{'method':14} {'tokens':>6} {'cpu ms':>8} {'gpu ms':>8} {'gpu/cpu':>7} {'copied MB':>9} {'GB/s':>6} "
          f"{'rel err':>8}{chain_head}")
    others = random_weights(shape, args.layers - 1) if args.layers > 1 else []
    for method in args.method:
        packed = pack_layer(layer.gate, layer.up, layer.down, method, shape)
        chain = [packed] + [pack_layer(w.gate, w.up, w.down, method, shape) for w in others]
        for tokens in args.tokens:
            x, ids, weights = (t.to(args.device) for t in timed_inputs(shape, tokens, 1)[0])
            cpu_out = kt_ops.moe_forward(x, ids, weights, packed)
            gpu_out = gpu_prefill.moe_forward_on_device(x, ids, weights, packed)
            err = ((gpu_out.float() - cpu_out.float()).norm() / cpu_out.float().norm()).item()
            cpu_s, gpu_s = [], []
            for _ in range(args.repeats):
                cpu_s.append(timed(lambda: kt_ops.moe_forward(x, ids, weights, packed)))
                gpu_s.append(timed(lambda: gpu_prefill.moe_forward_on_device(x, ids, weights, packed)))
            cpu_ms, gpu_ms = statistics.median(cpu_s) * 1e3, statistics.median(gpu_s) * 1e3
            copied = copied_bytes(packed, int(torch.unique(ids).numel()), gpu_prefill._compute_dtype(x)) / 1e6
            tail = ""
            if args.breakdown:
                stage_ms, copy_ms = transfers(packed, ids, x, args.repeats)
                tail += f" {stage_ms:8.2f} {copy_ms:8.2f}"
            if len(chain) > 1:
                attention = [torch.randn(H, H, device=args.device).to(x.dtype) / H**0.5 for _ in range(4)]
                plain, ahead = [], []
                for _ in range(args.repeats):
                    plain.append(timed(lambda: run_chain(chain, attention, x, ids, weights, False)))
                    ahead.append(timed(lambda: run_chain(chain, attention, x, ids, weights, True)))
                plain_ms, ahead_ms = statistics.median(plain) * 1e3, statistics.median(ahead) * 1e3
                tail += f" {plain_ms:9.2f} {ahead_ms:9.2f} {ahead_ms / plain_ms:6.3f}"
            print(f"{method:14} {tokens:6d} {cpu_ms:8.2f} {gpu_ms:8.2f} {gpu_ms / cpu_ms:7.2f} {copied:9.1f} "
                  f"{copied / gpu_ms:6.2f} {err:8.1e}{tail}", flush=True)


def copied_bytes(packed, routed: int, dtype: torch.dtype) -> int:
    """Bytes the GPU path copies to the device for ``routed`` experts of ``packed`` in a call
    in ``dtype``: one expert's host tensors as it stages them (its transport's rows, GGUF
    blocks, or the weights dequantized to ``dtype``) times ``routed``. Not the blob's bytes
    per expert: those share out its header, and GGUF MXFP4 travels as format mxfp4's rows
    (bf16 scales: 18 bytes per 32 weights against the file's 17)."""
    one = gpu_prefill._host_chunk(packed, [0], gpu_prefill.transport(packed), dtype, False)
    return routed * sum(t.numel() * t.element_size() for t in one)


def transfers(packed, ids: torch.Tensor, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Medians (ms) of the GPU path's host staging of a call's routed experts, chunk by
    chunk as :func:`kt_ops.gpu_prefill.moe_forward_on_device` cuts them, and of the copies
    of the staged chunks to ``x``'s device (0 on the CPU: nothing to copy)."""
    routed = sorted(int(e) for e in torch.unique(ids.cpu()) if e >= 0)
    size = gpu_prefill._chunk_experts(packed, gpu_prefill.DEFAULT_CHUNK_BYTES)
    chunks = [routed[i:i + size] for i in range(0, len(routed), size)]
    layout, dtype, cuda = gpu_prefill.transport(packed), gpu_prefill._compute_dtype(x), x.device.type == "cuda"
    stage_s, copy_s = [], []
    for _ in range(repeats):
        hosts: list = []
        stage_s.append(timed(lambda: hosts.extend(gpu_prefill._host_chunk(packed, c, layout, dtype, cuda) for c in chunks)))
        if cuda:
            copy_s.append(timed(lambda: [gpu_prefill._to_device(h, x.device) for h in hosts]))
    return statistics.median(stage_s) * 1e3, statistics.median(copy_s) * 1e3 if copy_s else 0.0


def run_chain(chain: list, attention: list[torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, ahead: bool) -> None:
    """One prompt through ``chain``'s layers on the GPU path, each after the attention
    stand-in; ``ahead``: each layer stages the next one's first chunk."""
    h = x
    for i, packed in enumerate(chain):
        for w in attention:
            h = h @ w
        following = chain[i + 1] if ahead and i + 1 < len(chain) else None
        h = h + gpu_prefill.moe_forward_on_device(h, ids, weights, packed, next_layer=following)


if __name__ == "__main__":
    main()
