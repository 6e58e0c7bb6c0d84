"""Benchmark rows: one MoE layer forward per (shape, method, tokens)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import gguf
import torch

from kt_ops.bench.baseline import torch_moe_forward
from kt_ops._native import _C
from kt_ops.gguf_types import LLAMA_CPP_FALLBACK
from kt_ops.ops import moe_forward, pack_experts
from kt_ops.packed import PackedExperts


@dataclass(frozen=True)
class Shape:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    model: str

    def expert_bytes(self, bytes_per_weight: float) -> float:
        return 3 * self.hidden * self.intermediate * bytes_per_weight


SHAPES: dict[str, Shape] = {
    "S1": Shape("S1", 128, 8, 2048, 768, "Qwen3-30B-A3B"),
    "S2": Shape("S2", 64, 6, 2048, 1408, "DeepSeek-V2-Lite"),
}

# Methods the benchmark runs (kt-kernel names); INT4 uses the default k-group (128).
METHODS: tuple[str, ...] = ("BF16", "AMXINT8", "AMXINT4", "Q4_K", "Q4_K_M", "Q6_K", "Q8_0", "Q4_0")
# Bench methods that are GGUF types (LLAMAFILE, quantized online with our round-to-nearest).
GGUF_METHODS: tuple[str, ...] = ("Q4_K", "Q4_K_M", "Q6_K", "Q8_0", "Q4_0")
# GGUF file mixes: (gate and up type, down type), as llama.cpp's Q4_K_M stores the experts.
GGUF_MIXES: dict[str, tuple[str, str]] = {"Q4_K_M": ("Q4_K", "Q6_K")}


def gguf_types_for(method: str, shape: Shape) -> tuple[str, str, str]:
    """(gate, up, down) types of a GGUF bench row: the method's type (or its mix, e.g.
    Q4_K_M: Q4_K, Q4_K, Q6_K), except that a K-quant ``down`` whose row length (I) is not
    a multiple of 256 gets llama.cpp's fallback type (S2, I = 1408: Q4_K -> Q5_0, Q6_K ->
    Q8_0), as a GGUF file of that model stores it."""
    gate, down = GGUF_MIXES.get(method, (method, method))
    if down in LLAMA_CPP_FALLBACK and shape.intermediate % 256:
        down = LLAMA_CPP_FALLBACK[down]
    return gate, gate, down


def pack_layer(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, method: str, shape: Shape) -> PackedExperts:
    if method in GGUF_METHODS:
        return pack_experts(gate, up, down, "LLAMAFILE", gguf_type=gguf_types_for(method, shape))
    return pack_experts(gate, up, down, method)


def bytes_per_weight(layer_packed: PackedExperts, shape: Shape) -> float:
    """Packed bytes per weight, scales included (2 for BF16, ~1.0 INT8, ~0.53 INT4,
    0.5625 Q4_K / Q4_0, 0.82 Q6_K, 1.06 Q8_0)."""
    weights = shape.num_experts * 3 * shape.hidden * shape.intermediate
    if layer_packed.format == "gguf":  # the matrices themselves (no header or padding)
        info = _C.packed_info(layer_packed.data)
        total = 0.0
        for name, (rows, k) in zip(info["gguf_types"], ((shape.intermediate, shape.hidden),) * 2 + ((shape.hidden, shape.intermediate),)):
            block, type_bytes = _C.ggml_type(int(gguf.GGMLQuantizationType[name]))[1:]
            total += shape.num_experts * rows * k / block * type_bytes
        return total / weights
    return (layer_packed.nbytes - 256) / weights


@dataclass
class Row:
    shape: str
    method: str
    tokens: int
    us: float  # median microseconds per layer forward (ours)
    torch_us: float  # median microseconds, plain-PyTorch layer
    weight_gbs: float  # bytes of the activated experts' weights / time
    gflops: float
    limit: str  # "bandwidth" or "gemm": the roofline bound that applies
    limit_fraction: float  # roofline time / measured time
    speedup: float  # torch_us / us
    read_gbs: float  # the read bandwidth measured next to this row

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Layer:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    packed: PackedExperts


def make_layers(shape: Shape, method: str, count: int) -> list[Layer]:
    """``count`` distinct layers with random bf16 weights (std 0.02), packed (and
    quantized) with ``method``; the plain-PyTorch baseline uses the bf16 weights."""
    layers = []
    for _ in range(count):
        gate = torch.randn(shape.num_experts, shape.intermediate, shape.hidden, dtype=torch.bfloat16) * 0.02
        up = torch.randn(shape.num_experts, shape.intermediate, shape.hidden, dtype=torch.bfloat16) * 0.02
        down = torch.randn(shape.num_experts, shape.hidden, shape.intermediate, dtype=torch.bfloat16) * 0.02
        layers.append(Layer(gate, up, down, pack_layer(gate, up, down, method, shape)))
    return layers


def previous_shape(shape: Shape) -> Shape:
    """The small layer run before each timed call (8 experts, hidden and intermediate 256)."""
    return Shape("previous", 8, min(shape.top_k, 8), 256, 256, shape.model)


def previous_layer(shape: Shape, method: str) -> Layer:
    """A small layer of the same method, called between the cache flush and each timed
    call, as a model calls the previous layer's MoE block right before this one: the
    operator's code, dispatch path and scratch are warm, this layer's weights come from
    DRAM. Without it every call also pays for cold code (~250 us here, even for a tiny
    layer)."""
    return make_layers(previous_shape(shape), method, 1)[0]


def random_routing(shape: Shape, tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform routing: ``top_k`` distinct experts per token, softmax-normalised weights."""
    scores = torch.rand(tokens, shape.num_experts, generator=generator)
    weights, ids = scores.topk(shape.top_k, dim=-1)
    return ids.to(torch.int32), torch.softmax(weights, dim=-1)


def time_calls(
    call: Callable[[int], object], repeats: int, min_seconds: float, before: Callable[[], None]
) -> float:
    """Median seconds of ``call(i)`` over at least ``repeats`` calls (or ``min_seconds``),
    running ``before()`` untimed ahead of each."""
    call(0)
    seconds: list[float] = []
    started = time.perf_counter()
    i = 1
    while len(seconds) < repeats or (time.perf_counter() - started < min_seconds and len(seconds) < 200):
        before()
        start = time.perf_counter()
        call(i)
        seconds.append(time.perf_counter() - start)
        i += 1
    return statistics.median(seconds)


def measure_row(
    shape: Shape,
    method: str,
    tokens: int,
    layers: list[Layer],
    read_gbs: float,
    gemm_gflops: float,
    repeats: int,
    flush: Callable[[], None],
    previous: Layer | None = None,
) -> Row:
    """One row: ours and the plain-PyTorch layer, each call preceded by ``flush()`` and,
    when ``previous`` is given, by the same kind of call on that small layer."""
    generator = torch.Generator().manual_seed(tokens)
    inputs = []
    for i in range(max(repeats, 8)):
        x = torch.randn(tokens, shape.hidden, generator=generator).to(torch.bfloat16)
        ids, weights = random_routing(shape, tokens, generator)
        inputs.append((x, ids, weights, layers[i % len(layers)]))
    if previous is not None:
        small = previous_shape(shape)
        small_x = torch.randn(tokens, small.hidden, generator=generator).to(torch.bfloat16)
        small_ids, small_weights = random_routing(small, tokens, generator)

    def ours(i: int) -> object:
        x, ids, weights, layer = inputs[i % len(inputs)]
        return moe_forward(x, ids, weights, layer.packed)

    def plain(i: int) -> object:
        x, ids, weights, layer = inputs[i % len(inputs)]
        return torch_moe_forward(x, ids, weights, layer.gate, layer.up, layer.down)

    def before_ours() -> None:
        flush()
        if previous is not None:
            moe_forward(small_x, small_ids, small_weights, previous.packed)

    def before_plain() -> None:
        flush()
        if previous is not None:
            torch_moe_forward(small_x, small_ids, small_weights, previous.gate, previous.up, previous.down)

    min_seconds = 1.0
    seconds = time_calls(ours, repeats, min_seconds, before_ours)
    torch_seconds = time_calls(plain, max(3, repeats // 4), min_seconds / 2, before_plain)

    activated = statistics.mean(len(torch.unique(ids)) for _, ids, _, _ in inputs)
    weight_bytes = activated * shape.expert_bytes(bytes_per_weight(layers[0].packed, shape))
    flops = 2.0 * 3 * tokens * shape.top_k * shape.hidden * shape.intermediate
    bandwidth_time = weight_bytes / (read_gbs * 1e9)
    compute_time = flops / (gemm_gflops * 1e9)
    return Row(
        shape=shape.name,
        method=method,
        tokens=tokens,
        us=seconds * 1e6,
        torch_us=torch_seconds * 1e6,
        weight_gbs=weight_bytes / seconds / 1e9,
        gflops=flops / seconds / 1e9,
        limit="bandwidth" if bandwidth_time >= compute_time else "gemm",
        limit_fraction=max(bandwidth_time, compute_time) / seconds,
        speedup=torch_seconds / seconds,
        read_gbs=read_gbs,
    )
