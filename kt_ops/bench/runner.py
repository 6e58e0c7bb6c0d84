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
from kt_ops.gguf_types import LLAMA_CPP_FALLBACK, ggml_type_info, gguf_type_id
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

# Methods the benchmark runs by default (kt-kernel names); INT4 uses the default k-group (128).
METHODS: tuple[str, ...] = ("BF16", "AMXINT8", "AMXINT4", "Q4_K", "Q4_K_M", "Q6_K", "Q8_0", "Q4_0")
# The other GGUF types kt_ops computes, llama.cpp's Q5_K_M mix and MXFP4 in GGUF's blocks (as
# LLAMAFILE reads a gpt-oss GGUF; method MXFP4 is format mxfp4): chosen with --method.
EXTRA_METHODS: tuple[str, ...] = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q5_K_M", "GGUF_MXFP4")
# FP8 methods (e4m3 weights decoded to bf16 in the kernels; quantized online here).
FP8_METHODS: tuple[str, ...] = ("FP8", "FP8_PERCHANNEL", "MXFP8")
# 4-bit checkpoint methods, quantized online as their checkpoints are: MXFP4 (format
# mxfp4), int4 groups of 32 (RAWINT4), int4 groups of 128 (GPTQ), int4_asym groups of 128 (AWQ).
CHECKPOINT_METHODS: tuple[str, ...] = ("MXFP4", "RAWINT4", "GPTQ_INT4", "AWQ_INT4")
ALL_METHODS: tuple[str, ...] = METHODS + EXTRA_METHODS + FP8_METHODS + CHECKPOINT_METHODS
# GGUF file mixes: (gate and up type, down type), as llama.cpp's Q4_K_M and Q5_K_M store the
# experts of the layers whose down gets more bits (use_more_bits: the first and last eighth
# and every third layer between, about half; the other layers' down is Q4_K / Q5_K, as gate
# and up); GGUF_MXFP4: every matrix MXFP4, as gpt-oss GGUFs store them.
GGUF_MIXES: dict[str, tuple[str, str]] = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"),
                                          "GGUF_MXFP4": ("MXFP4", "MXFP4")}
# Bench methods that are GGUF types or mixes (LLAMAFILE, quantized online with our round-to-nearest).
GGUF_METHODS: tuple[str, ...] = ("Q4_K", "Q4_K_M", "Q6_K", "Q8_0", "Q4_0") + EXTRA_METHODS


def gguf_types_for(method: str, shape: Shape) -> tuple[str, str, str]:
    """(gate, up, down) types of a GGUF bench row: the method's type (or its mix, e.g.
    Q4_K_M: Q4_K, Q4_K, Q6_K), except that a K-quant ``down`` whose row length (I) is not
    a multiple of 256 gets llama.cpp's fallback type (S2, I = 1408: Q4_K -> Q5_0, Q5_K ->
    Q5_1, Q6_K -> Q8_0), as a GGUF file of that model stores it. ``ValueError`` where that
    type is one kt_ops does not compute (Q2_K and Q3_K on S2: IQ4_NL)."""
    gate, down = GGUF_MIXES.get(method, (method, method))
    info = ggml_type_info(gguf_type_id(down))
    if shape.intermediate % info.block_elems:
        if down not in LLAMA_CPP_FALLBACK:  # Q2_K / Q3_K: llama.cpp writes IQ4_NL there
            raise ValueError(
                f"{method} on {shape.name}: llama.cpp stores down (I = {shape.intermediate}, not a multiple of"
                f" {info.block_elems}) as {info.llama_cpp_fallback}, which kt_ops does not compute"
            )
        down = LLAMA_CPP_FALLBACK[down]
    return gate, gate, down


def arithmetic_of(method: str) -> str:
    """What our kernels multiply in for ``method``: "float" for BF16 and the FP8 methods
    (bf16 or fp32, by variant), "int8" for the quantized methods (INT8, INT4 and the GGUF
    types dot int8 activations with int8-decoded weights: vpmaddubsw, vpdpbusd or AMX int8)."""
    return "float" if method == "BF16" or method in FP8_METHODS else "int8"


def pack_layer(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, method: str, shape: Shape) -> PackedExperts:
    if method in GGUF_METHODS:
        return pack_experts(gate, up, down, "LLAMAFILE", gguf_type=gguf_types_for(method, shape))
    return pack_experts(gate, up, down, method)


def bytes_per_weight(layer_packed: PackedExperts, shape: Shape) -> float:
    """Packed bytes per weight, scales included (2 for BF16, ~1.0 INT8, ~0.53 INT4, 0.5625 MXFP4,
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
    """One row: ours and the plain-PyTorch layer at one (shape, method, tokens). ``bound``
    and ``limit_fraction`` are set by :func:`kt_ops.bench.roofline.rate` once the run's
    limits are known."""

    shape: str
    method: str
    tokens: int
    us: float  # median microseconds per layer forward (ours)
    torch_us: float  # median microseconds, plain-PyTorch layer (in the run's torch dtype)
    speedup: float  # torch_us / us
    weight_bytes: float  # packed bytes of the activated experts' weights, mean per call
    flops: float  # 2 * 3 * tokens * top_k * hidden * intermediate
    arithmetic: str  # "float" or "int8": what our kernels multiply in (arithmetic_of)
    weight_gbs: float  # weight_bytes / time
    gflops: float  # flops / time
    bound: str = "unrated"  # "bandwidth", "<dtype> gemm" (e.g. "int8 gemm") or "cache" (fits in the LLC)
    limit_fraction: float | None = None  # roofline time / measured time; None for "cache"
    # Packed weight bytes the row's calls can reach: every expert of every layer it cycles
    # through (routing draws new experts each call). None: unknown, taken as weight_bytes.
    reachable_bytes: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ExpertWeights:
    """One layer's expert weights: gate and up ``[E, I, H]``, down ``[E, H, I]``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def to(self, dtype: torch.dtype) -> "ExpertWeights":
        """The same weights in ``dtype`` (these tensors themselves if already in it)."""
        return ExpertWeights(self.gate.to(dtype), self.up.to(dtype), self.down.to(dtype))


@dataclass
class Layer:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    packed: PackedExperts


def random_weights(shape: Shape, count: int) -> list[ExpertWeights]:
    """``count`` distinct layers of random bf16 weights (std 0.02)."""
    return [
        ExpertWeights(
            torch.randn(shape.num_experts, shape.intermediate, shape.hidden, dtype=torch.bfloat16) * 0.02,
            torch.randn(shape.num_experts, shape.intermediate, shape.hidden, dtype=torch.bfloat16) * 0.02,
            torch.randn(shape.num_experts, shape.hidden, shape.intermediate, dtype=torch.bfloat16) * 0.02,
        )
        for _ in range(count)
    ]


def make_layers(shape: Shape, method: str, count: int, weights: list[ExpertWeights] | None = None) -> list[Layer]:
    """``count`` layers packed (and quantized) with ``method`` from ``weights`` (bf16; new
    random ones if None): the bench draws a shape's weights once and packs them for every
    method, since drawing them costs more than packing them (one S1 layer here: 3.6 s
    against 0.4-1.3 s per method)."""
    weights = random_weights(shape, count) if weights is None else weights[:count]
    if len(weights) < count:
        raise ValueError(f"weights holds {len(weights)} layers, count is {count}")
    return [Layer(w.gate, w.up, w.down, pack_layer(w.gate, w.up, w.down, method, shape)) for w in weights]


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


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x [T, H] bf16, ids [T, k] int32, weights [T, k] fp32
# Distinct inputs a row cycles through: one per timed call up to this many (all held at once,
# so not one per call of a large --repeats: 2 MiB each at 512 S1 tokens).
MAX_INPUTS = 64


def input_count(repeats: int) -> int:
    """How many inputs a row of ``repeats`` timed calls draws (8 ... :data:`MAX_INPUTS`)."""
    return min(max(repeats, 8), MAX_INPUTS)


def timed_inputs(shape: Shape, tokens: int, count: int) -> list[Inputs]:
    """``count`` random inputs, the same for every method and the plain layer (seeded
    by ``tokens``)."""
    generator = torch.Generator().manual_seed(tokens)
    inputs = []
    for _ in range(count):
        x = torch.randn(tokens, shape.hidden, generator=generator).to(torch.bfloat16)
        inputs.append((x, *random_routing(shape, tokens, generator)))
    return inputs


def time_calls(
    call: Callable[[int], object], repeats: int, min_seconds: float, before: Callable[[], None], warmup: int = 1
) -> float:
    """Median seconds of ``call(i)`` over at least ``repeats`` calls (or ``min_seconds``),
    running ``before()`` untimed ahead of each, after ``warmup`` untimed calls (each
    after ``before()`` too)."""
    for i in range(warmup):
        before()
        call(i)
    seconds: list[float] = []
    started = time.perf_counter()
    i = warmup
    while len(seconds) < repeats or (time.perf_counter() - started < min_seconds and len(seconds) < 200):
        before()
        start = time.perf_counter()
        call(i)
        seconds.append(time.perf_counter() - start)
        i += 1
    return statistics.median(seconds)


def measure_baseline(
    shape: Shape,
    tokens: int,
    weights: list[ExpertWeights],
    repeats: int,
    flush: Callable[[], None],
    previous: ExpertWeights | None = None,
    min_seconds: float = 0.5,
) -> float:
    """Median seconds of the plain-PyTorch layer (:func:`torch_moe_forward`) in the dtype
    of ``weights`` (activations converted to it), cycling through ``weights``; each call
    preceded by ``flush()`` and, when ``previous`` is given, by a call on that small layer
    (:func:`previous_shape`). The plain layer does not depend on the method, so the bench
    times it once per (shape, tokens) for all methods' rows."""
    dtype = weights[0].gate.dtype
    inputs = [(x.to(dtype), ids, w) for x, ids, w in timed_inputs(shape, tokens, input_count(repeats))]
    small_x, small_ids, small_weights = previous_inputs(shape, tokens)
    small_x = small_x.to(dtype)

    def plain(i: int) -> object:
        x, ids, topk_weights = inputs[i % len(inputs)]
        layer = weights[i % len(weights)]
        return torch_moe_forward(x, ids, topk_weights, layer.gate, layer.up, layer.down)

    def before() -> None:
        flush()
        if previous is not None:
            torch_moe_forward(small_x, small_ids, small_weights, previous.gate, previous.up, previous.down)

    # Three warm-up calls: oneDNN (torch's bf16 path) compiles a kernel per new row count
    # of each linear, so the first bf16 calls here took 140-500 ms and the next ones 3x
    # the settled time (12 against 4 ms at one token).
    return time_calls(plain, repeats, min_seconds, before, warmup=3)


def previous_inputs(shape: Shape, tokens: int) -> Inputs:
    """The small layer's input (:func:`previous_shape`)."""
    small = previous_shape(shape)
    generator = torch.Generator().manual_seed(1_000_000 + tokens)
    x = torch.randn(tokens, small.hidden, generator=generator).to(torch.bfloat16)
    return (x, *random_routing(small, tokens, generator))


def measure_row(
    shape: Shape,
    method: str,
    tokens: int,
    layers: list[Layer],
    torch_seconds: float,
    repeats: int,
    flush: Callable[[], None],
    previous: Layer | None = None,
    min_seconds: float = 1.0,
) -> Row:
    """One row, unrated: our layer's median seconds over at least ``repeats`` calls (or
    ``min_seconds``), cycling through ``layers``, each call preceded by ``flush()`` and,
    when ``previous`` is given, by the same kind of call on that small layer;
    ``torch_seconds`` is the plain layer's time (:func:`measure_baseline`)."""
    inputs = timed_inputs(shape, tokens, input_count(repeats))
    small_x, small_ids, small_weights = previous_inputs(shape, tokens)

    def ours(i: int) -> object:
        x, ids, weights = inputs[i % len(inputs)]
        return moe_forward(x, ids, weights, layers[i % len(layers)].packed)

    def before() -> None:
        flush()
        if previous is not None:
            moe_forward(small_x, small_ids, small_weights, previous.packed)

    seconds = time_calls(ours, repeats, min_seconds, before)
    activated = statistics.mean(len(torch.unique(ids)) for _, ids, _ in inputs)
    expert_bytes = shape.expert_bytes(bytes_per_weight(layers[0].packed, shape))
    weight_bytes = activated * expert_bytes
    flops = 2.0 * 3 * tokens * shape.top_k * shape.hidden * shape.intermediate
    return Row(
        shape=shape.name,
        method=method,
        tokens=tokens,
        us=seconds * 1e6,
        torch_us=torch_seconds * 1e6,
        speedup=torch_seconds / seconds,
        weight_bytes=weight_bytes,
        flops=flops,
        arithmetic=arithmetic_of(method),
        weight_gbs=weight_bytes / seconds / 1e9,
        gflops=flops / seconds / 1e9,
        reachable_bytes=len(layers) * shape.num_experts * expert_bytes,
    )
